"""lowbit.experiments.kv_cache_error on a tiny Llama: the side switch and the clipping count."""
import pytest
import torch

from lowbit.evaluation.evaluate import prepare_reference, reference_logits
from lowbit.experiments.kv_cache_error import _parse_row, run_row
from lowbit.ops.kv_quant import KVScheme


def _tiny(rng):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, head_dim=24)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def test_sides_and_clipping(rng):
    model = _tiny(rng)
    ids = torch.randint(0, 61, (1024,), generator=rng)
    ref = prepare_reference(reference_logits(model, ids, 512))
    calib = [ids[:512][None]]
    fp8 = KVScheme.parse("fp8")
    r = {s: run_row(model, ids, ref, fp8, s, calib) for s in ("kv", "k", "v")}
    assert all(x["kl"] > 0 for x in r.values())
    assert len({x["kl"] for x in r.values()}) == 3                   # each side quantizes something else
    # calibrated on the first window: it clips nothing there, and the count covers both windows
    assert 0 <= r["kv"]["clipped"] < 1 and r["k"]["clipped"] is not None
    assert run_row(model, ids, ref, KVScheme.parse("fp8-token"), "kv", calib)["clipped"] is None   # dynamic
    big = run_row(model, ids, ref, fp8, "kv", [ids[:512][None] * 0 + 1])       # one token's states: others clip
    assert big["clipped"] > r["kv"]["clipped"]


def test_rows_are_checked():
    assert _parse_row("fp8:k:8192", 1024) == (KVScheme.parse("fp8"), "k", 8192)
    with pytest.raises(ValueError, match="SCHEME:SIDES"):
        _parse_row("fp8:q", 1024)
