"""Long-context attention accumulation: the gate follows the accumulators AttnSpec declares, and a
kernel that sums P.V in a narrow accumulator across the whole context is named
accumulator_narrower_than_promised (with "promote every N keys"), not a P-scale or rescale bug.

The kernel is tests/attention_fixtures.flash_attention in float64, with P.V summed the way the H200's
fp8 tensor core sums it (its own truncation code), never promoted (vLLM's fp8 FlashAttention-3 path
at 128k keys; 8k and 32k keys here, 128k in docs/attention-accumulation.md) or promoted into fp32
once per key block (the fix). Decode: one query per head, a few
heads, an fp8 cache per KV head, fp8 Q and P.
"""
import dataclasses

import pytest
import torch

from attention_fixtures import flash_attention
from lowbit.ops import attention_reference as ar
from lowbit.ops.kv_quant import KVScheme, observe_amax, quantize_kv, static_scale
from lowbit.verify.attention import check_attention

SPEC = ar.AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn", p_block=64, causal=False)
FP8H = KVScheme("fp8_e4m3fn", "head")


def decode_case(rng, Tk, Hq=2, Hkv=1, D=64):
    q = torch.randn(1, Hq, 1, D, generator=rng) * 1.5
    k = torch.randn(1, Hkv, Tk, D, generator=rng)
    v = torch.randn(1, Hkv, Tk, D, generator=rng) + 0.5     # a mean per channel, as real V caches have
    kq = quantize_kv(k, FP8H, static_scale(observe_amax(k, FP8H), FP8H))
    vq = quantize_kv(v, FP8H, static_scale(observe_amax(v, FP8H), FP8H))
    return q, kq, vq


def kernel(q, kq, vq, spec=SPEC, **kw):
    return flash_attention(ar.quantize_q(q, spec.q_format), kq.dequantize(), vq.dequantize(), spec,
                           dtype=torch.float64, **kw)


def test_accumulation_factor_grows_with_the_keys_summed_before_promotion():
    # fp8_fast: ceil(n / 32) steps of 33 truncations below 2^-13 of the largest term
    assert ar.accumulation_factor("fp8_fast", 32) == 33 * 2.0 ** -13
    assert ar.accumulation_factor("fp8_fast", 131072) == 4096 * 33 * 2.0 ** -13
    never = dataclasses.replace(SPEC, pv_acc="fp8_fast", pv_promote=0)
    block = dataclasses.replace(SPEC, pv_acc="fp8_fast", pv_promote=64)
    assert never.pv_stretch(8192) == 8192 and block.pv_stretch(8192) == 64
    with pytest.raises(ValueError, match="pv_promote"):
        ar.AttnSpec(pv_acc="fp8_fast", pv_promote=48)
    with pytest.raises(ValueError, match="pv_acc"):
        ar.AttnSpec(pv_acc="fp8")


@pytest.mark.parametrize("Tk", [8192])
def test_gate_grows_with_context_only_when_never_promoted(rng, Tk):
    q, kq, vq = decode_case(rng, Tk)
    q_hat = ar.quantize_q(q, SPEC.q_format)
    gates = {}
    for n in (Tk // 8, Tk):
        for promote in (0, 64):
            spec = dataclasses.replace(SPEC, pv_acc="fp8_fast", pv_promote=promote)
            gates[n, promote] = ar.attention_reference(q_hat, kq.dequantize()[:, :, :n], vq.dequantize()[:, :, :n],
                                                       spec).gate.median()
    assert gates[Tk, 0] > 4 * gates[Tk // 8, 0]          # ~8x: linear in the keys never promoted
    assert gates[Tk, 64] < 2 * gates[Tk // 8, 64]        # promoted: only the fp32 roundings grow


@pytest.mark.parametrize("Tk", [8192, 32768])
def test_pv_in_fp8_accumulator_never_promoted_is_named(rng, Tk):
    q, kq, vq = decode_case(rng, Tk)
    out = kernel(q, kq, vq, pv="fp8_fast", promote=0)
    v = check_attention(out, q, kq, vq, SPEC)
    assert not v.passed and v.kind == "numerical", v.report()
    first = v.causes[0]
    assert first.name == "accumulator_narrower_than_promised", v.report()
    assert "never promoted" in first.detail and "promote every 64 keys" in first.detail, v.report()
    # declared as promised once per key block, it still breaks that promise, and is named
    declared = dataclasses.replace(SPEC, pv_acc="fp8_fast", pv_promote=64)
    v = check_attention(out, q, kq, vq, declared)
    assert not v.passed and v.causes[0].name == "accumulator_narrower_than_promised", v.report()


@pytest.mark.parametrize("Tk", [8192])
def test_promoted_every_block_passes_its_declared_gate(rng, Tk):
    q, kq, vq = decode_case(rng, Tk)
    out = kernel(q, kq, vq, pv="fp8_fast", promote=64)
    v = check_attention(out, q, kq, vq, dataclasses.replace(SPEC, pv_acc="fp8_fast", pv_promote=64))
    assert v.passed, v.report()


@pytest.mark.parametrize("Tk", [8192])
def test_fp32_kernel_passes_at_long_context(rng, Tk):
    q, kq, vq = decode_case(rng, Tk)
    v = check_attention(kernel(q, kq, vq), q, kq, vq, SPEC)
    assert v.passed and v.kind == "ok", v.report()


def test_skipped_rescale_at_long_context_is_not_an_accumulator(rng):
    q, kq, vq = decode_case(rng, 8192)
    kq_grow = kq.dequantize() * torch.linspace(0.5, 2.0, 8192).reshape(1, 1, -1, 1)   # the max moves along the keys
    spec = SPEC
    out = flash_attention(ar.quantize_q(q, spec.q_format), kq_grow, vq.dequantize(), spec, bug="rescale_skipped",
                          dtype=torch.float64)
    v = check_attention(out, q, kq_grow, vq, spec)
    assert not v.passed and v.causes[0].name == "rescale_skipped", v.report()
