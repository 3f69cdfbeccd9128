"""lowbit.pipelines.verify_attention.check_layer on one attention call, and lowbit.pipelines.attention_tap:
transformers' SDPA and eager attention over a quantized cache pass in float32, SDPA in bf16 (held to the
bf16 flash gate, sdpa_bf16_reference), eager in bf16 (bf16 scores) is at worst `computed_in_bf16`;
a cache read with a wrong scale is `kv_cache_read`; the tap sees every layer of an eager model
without changing its logits."""
import types

import pytest
import torch

from lowbit.pipelines.attention_tap import attention_tap
from lowbit.ops.kv_quant import KVScheme, quantize_kv
from lowbit.pipelines import verify_attention as va

transformers = pytest.importorskip("transformers")
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402


def _call(rng, dtype, implementation="sdpa"):
    """One causal GQA attention call by transformers' `implementation` over an fp8 per-token cache
    read in `dtype`: (Seen of the last 9 queries, the cache)."""
    B, Hq, Hkv, T, D = 2, 6, 2, 37, 24
    q = torch.randn(B, Hq, T, D, generator=rng).to(dtype)
    sch = KVScheme("fp8_e4m3fn", "token")
    kq, vq = (quantize_kv(torch.randn(B, Hkv, T, D, generator=rng) * 2, sch) for _ in range(2))
    k, v = kq.dequantize(dtype), vq.dequantize(dtype)
    module = types.SimpleNamespace(num_key_value_groups=3, training=False, is_causal=True)
    mask = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), 0.0, -torch.inf).to(dtype)[None, None]
    fn = sdpa_attention_forward if implementation == "sdpa" else eager_attention_forward
    out, _ = fn(module, q, k, v, None if implementation == "sdpa" else mask, scaling=D ** -0.5)
    return va.Seen(q[:, :, -9:], k, v, out.transpose(1, 2)[:, :, -9:], D ** -0.5), (kq, vq)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_a_quantized_cache_passes(rng, dtype, implementation):
    seen, cache = _call(rng, dtype, implementation)
    c = va.check_layer(seen, cache, va.layer_spec(None, implementation, seen.scaling))
    if implementation == "eager" and dtype == torch.bfloat16:
        # eager attention in bf16 rounds the scores to bf16 (a flash kernel keeps them in fp32): beyond
        # the flash gate it is numerical, within the bound of bf16 scores and P, never a logic error
        assert c.verdict == "ok" or (c.verdict == "numerical" and c.cause.startswith("computed_in_bf16")), c
    else:
        assert c.verdict == "ok" and c.worst_over_gate <= 1.0, c


def test_cache_read_with_another_scale_is_kv_cache_read(rng):
    seen, (kq, vq) = _call(rng, torch.float32)
    seen.v = seen.v * 1.5          # what a kernel dequantizing with the wrong V scale reads
    c = va.check_layer(seen, (kq, vq), va.layer_spec(None, "sdpa", None))
    assert c.verdict == "logic" and c.cause.startswith("kv_cache_read: the attention read V"), c


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_tap_sees_every_layer_and_changes_nothing(rng, implementation):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(implementation)
    ids = torch.randint(0, 64, (2, 11), generator=rng)
    seen = []
    with torch.no_grad():
        plain = model(ids).logits
        with attention_tap(model, lambda m, q, k, v, s, out: seen.append((m.layer_idx, q.shape, out.shape))) as impl:
            tapped = model(ids).logits
    assert impl == implementation and model.config._attn_implementation == implementation
    assert torch.equal(plain, tapped)
    assert seen == [(i, (2, 4, 11, 8), (2, 11, 4, 8)) for i in range(3)]
