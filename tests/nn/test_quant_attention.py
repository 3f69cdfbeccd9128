"""The "lowbit" attention implementation inside a transformers Llama, and the attention rows of
the per-site report."""
import pytest
import torch

from lowbit.diagnosis.attention_sites import attention_site_report
from lowbit.nn.kv_cache import attach_kv_cache, calibrate_kv_cache, enable_quantized_attention
from lowbit.ops import attention_reference as ar

transformers = pytest.importorskip("transformers")
U32 = 2.0 ** -24


def _llama(rng, layers=2):
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    return transformers.LlamaForCausalLM(cfg).eval()


def test_unquantized_spec_matches_sdpa_and_fp8_p_changes_logits(rng):
    model = _llama(rng)
    ids = torch.randint(0, 61, (2, 20), generator=rng)
    with torch.no_grad():
        ref = model(ids).logits
        enable_quantized_attention(model, ar.AttnSpec(q_format=None, p_format=None, p_block=16))
        same = model(ids).logits
        enable_quantized_attention(model, ar.AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn", p_block=16))
        quant = model(ids).logits
    # float32 both ways, differing in summation order and exp2 vs exp: each of the <= 7 * layers + 1
    # matmuls on the path to the logits is within K * u of exact (Higham), K <= 96 here.
    tol = 2 * (7 * 2 + 1) * 96 * U32 * float(ref.abs().max())
    assert float((same - ref).abs().max()) <= tol
    assert float((quant - ref).abs().max()) > tol


def test_padding_mask_is_refused(rng):
    model = _llama(rng, layers=1)
    enable_quantized_attention(model)
    ids = torch.randint(0, 61, (2, 8), generator=rng)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(NotImplementedError, match="causal masks only"):
        model(ids, attention_mask=mask)


def test_attention_site_rows(rng):
    model = _llama(rng)
    batch = torch.randint(0, 61, (1, 24), generator=rng)
    kv = calibrate_kv_cache(model, [batch], "int8-head")
    attach_kv_cache(model, kv)
    rep = attention_site_report(model, batch, kv, ar.AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn",
                                                              p_block=16))
    assert [s.layer for s in rep.sites] == [0, 1]
    for s in rep.sites:
        # int8 per head: the rounding noise of a uniform step is ~ 6.02 * 8 - 1.25 - crest-factor dB;
        # far above 20 dB, far below exact
        assert 20 < s.k_sqnr < 80 and 20 < s.v_sqnr < 80
        assert 10 < s.p_sqnr < 80 and 10 < s.out_sqnr < 80
        assert 0 <= s.p_zero < 1
    fine = attention_site_report(model, batch, None)            # nothing quantized: exact up to float64
    assert all(s.out_sqnr > 200 and s.k_sqnr == float("inf") for s in fine.sites)
    assert "| layer |" in rep.to_markdown() and "worst attention output SQNR" in str(rep)
