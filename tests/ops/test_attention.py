"""Quantized attention: the torch path and the Triton kernel against the float64 reference's derived
gate; the reference against torch's SDPA when nothing is quantized; bad input."""
import math

import pytest
import torch

from lowbit.ops import attention_reference as ar
from lowbit.ops.attention import attention
from lowbit.ops.kv_quant import KVScheme, observe_amax, quantize_kv, static_scale

CUDA = torch.cuda.is_available()
# the Triton backend runs compiled on the GPU where there is one; elsewhere conftest sets
# TRITON_INTERPRET and the same calls run in the CPU interpreter
DEV = "cuda" if CUDA else "cpu"


def _cache(rng, B, Hkv, Tk, D, scheme, device="cpu"):
    k = torch.randn(B, Hkv, Tk, D, generator=rng) * torch.linspace(0.5, 2, Hkv).reshape(1, Hkv, 1, 1)
    v = torch.randn(B, Hkv, Tk, D, generator=rng)
    if scheme is None:
        return k.to(device), v.to(device)
    if scheme.dynamic:
        return quantize_kv(k, scheme).to(device), quantize_kv(v, scheme).to(device)
    return (quantize_kv(k, scheme, static_scale(observe_amax(k, scheme), scheme)).to(device),
            quantize_kv(v, scheme, static_scale(observe_amax(v, scheme), scheme)).to(device))


def _check(out, q, kq, vq, spec, out_dtype=torch.float32):
    q_hat = ar.quantize_q(q.cpu(), spec.q_format)
    deq = [t.to("cpu").dequantize() if hasattr(t, "scheme") else t.cpu().float() for t in (kq, vq)]
    ref = ar.attention_reference(q_hat, *deq, spec, out_dtype=out_dtype)
    err = (out.cpu().double() - ref.out).abs()
    assert bool(torch.isfinite(out).all())
    worst = float((err / ref.gate).max())
    assert worst <= 1.0, f"worst err/gate {worst:.3g}"
    return ref


CASES = [  # B, Hq, Hkv, Tq, Tk, D, scheme, p_format, causal
    (1, 4, 2, 5, 37, 40, KVScheme("fp8", "token"), "fp8_e4m3fn", True),      # prefill after a cache, GQA 2
    (2, 3, 1, 1, 50, 72, KVScheme("int8", "head"), "int8", False),            # decode, GQA 3 (MQA)
    (1, 2, 2, 19, 19, 24, KVScheme("int4", "group", 8), None, True),          # prefill, no GQA, P in fp32
    (1, 4, 1, 3, 33, 40, KVScheme("fp8", "tensor"), "fp8_e4m3fn", False),
    (1, 2, 1, 6, 21, 72, None, "fp8_e4m3fn", True),                           # an unquantized cache
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c[5]}-Tq{c[3]}-Tk{c[4]}-{c[6]}-{c[7]}-{'causal' if c[8] else 'full'}")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_within_derived_gate(rng, case, backend):
    B, Hq, Hkv, Tq, Tk, D, scheme, pf, causal = case
    dev = DEV if backend == "triton" else "cpu"
    kq, vq = _cache(rng, B, Hkv, Tk, D, scheme, device=dev)
    q = (torch.randn(B, Hq, Tq, D, generator=rng) * 1.5).to(dev)
    spec = ar.AttnSpec(q_format="fp8_e4m3fn" if scheme is not None else None, p_format=pf, p_block=16, causal=causal)
    out = attention(q, kq, vq, spec, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, q, kq, vq, spec)


def test_triton_bf16_output_within_gate(rng):
    kq, vq = _cache(rng, 1, 2, 29, 40, KVScheme("fp8", "head"), device=DEV)
    q = torch.randn(1, 4, 3, 40, generator=rng).to(DEV)
    spec = ar.AttnSpec(p_block=16)
    out = attention(q, kq, vq, spec, backend="triton", out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    _check(out, q, kq, vq, spec, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("causal", [True, False])
def test_unquantized_reference_equals_sdpa(rng, causal):
    q = torch.randn(2, 4, 9, 24, generator=rng, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 24, generator=rng, dtype=torch.float64)
    v = torch.randn(2, 2, 9, 24, generator=rng, dtype=torch.float64)
    spec = ar.AttnSpec(q_format=None, p_format=None, p_block=16, causal=causal)
    ref = ar.attention_reference(q.float().double(), k, v, spec, out_dtype=torch.float64)
    sd = torch.nn.functional.scaled_dot_product_attention(q.float().double(), k.repeat_interleave(2, 1),
                                                          v.repeat_interleave(2, 1), is_causal=causal)
    # both float64: the reference's exp2 / online rescale against SDPA's softmax differ by a few
    # float64 roundings per term; 2^-40 of |V| max leaves room for 9 keys' worth of them.
    assert float((ref.out - sd).abs().max()) <= 2.0 ** -40 * float(v.abs().max())


def test_quantization_error_shrinks_with_finer_p(rng):
    """Against unquantized attention of the original inputs, per-block fp8 P beats int8 P at small
    probabilities (the softmax tail), and per-(row, block) P keeps the tail: few zero codes."""
    k = torch.randn(1, 2, 64, 32, generator=rng)
    v = torch.randn(1, 2, 64, 32, generator=rng)
    q = torch.randn(1, 2, 4, 32, generator=rng) * 3
    exact = ar.sdpa_float64(q, k, v, causal=False)
    errs = {}
    for pf in ("fp8_e4m3fn", None):
        spec = ar.AttnSpec(q_format=None, p_format=pf, p_block=16, causal=False)
        ref = ar.attention_reference(q, k, v, spec)
        errs[pf] = float((ref.out - exact).abs().max())
    assert errs[None] <= 2.0 ** -20 * float(v.abs().max()) * 64     # P in fp32: only float roundings
    assert errs["fp8_e4m3fn"] > errs[None]


def test_all_zero_kv_head_gives_mean_of_v(rng):
    k = torch.randn(1, 2, 20, 24, generator=rng)
    k[:, 1] = 0
    v = torch.randn(1, 2, 20, 24, generator=rng)
    sch = KVScheme("fp8", "head")
    kq = quantize_kv(k, sch, static_scale(observe_amax(k, sch), sch))
    vq = quantize_kv(v, sch, static_scale(observe_amax(v, sch), sch))
    q = torch.randn(1, 2, 3, 24, generator=rng)
    spec = ar.AttnSpec(p_block=16, causal=False)
    out = attention(q, kq, vq, spec, backend="torch")
    ref = _check(out, q, kq, vq, spec)
    mean_v = vq.dequantize().double()[:, 1].mean(dim=1)               # every score 0: uniform weights
    assert float((ref.out[0, 1] - mean_v).abs().max()) <= 2.0 ** -40


def test_bad_input(rng):
    kq, vq = _cache(rng, 1, 2, 8, 24, KVScheme("fp8", "token"))
    q = torch.randn(1, 4, 3, 24, generator=rng)
    with pytest.raises(ValueError, match="NaN/Inf"):
        attention(q.index_fill(3, torch.tensor([2]), float("nan")), kq, vq)
    with pytest.raises(ValueError, match="at least as many tokens"):
        attention(torch.randn(1, 4, 9, 24), kq, vq, ar.AttnSpec(causal=True))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention(torch.randn(1, 3, 3, 24), kq, vq)
    with pytest.raises(ValueError, match="head_dim"):
        attention(torch.randn(1, 4, 3, 16), kq, vq)
    with pytest.raises(ValueError, match="p_block must be a power of two"):
        ar.AttnSpec(p_block=24)
    with pytest.raises(ValueError, match="backend"):
        attention(q, kq, vq, backend="cuda")
    k_nan = torch.randn(1, 2, 8, 24)
    k_nan[0, 0, 3, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        attention(q, k_nan, torch.randn(1, 2, 8, 24))
    with pytest.raises(ValueError, match="head_dim 320"):
        kb, vb = _cache(rng, 1, 1, 4, 320, None, device=DEV)
        attention(torch.randn(1, 1, 1, 320, device=DEV), kb, vb, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("scheme", [KVScheme("fp8", "head"), KVScheme("fp8", "token"), KVScheme("int8", "tensor"),
                                    KVScheme("int4", "group", 8)], ids=str)
@pytest.mark.parametrize("shape", [(2, 32, 8, 1, 1000, 128), (1, 8, 2, 300, 300, 128), (1, 4, 4, 77, 513, 72)])
def test_triton_cuda_within_gate(rng, scheme, shape):
    B, Hq, Hkv, Tq, Tk, D = shape
    kq, vq = _cache(rng, B, Hkv, Tk, D, scheme, device="cuda")
    q = torch.randn(B, Hq, Tq, D, generator=rng).cuda().to(torch.bfloat16)
    for pf in ("fp8_e4m3fn", "int8"):
        spec = ar.AttnSpec(p_format=pf, p_block=64, causal=True)
        out = attention(q, kq, vq, spec, backend="triton", out_dtype=torch.float32)
        _check(out, q.float(), kq, vq, spec)
        assert math.isfinite(float(out.float().abs().max()))


def test_triton_packed_gqa_tiles_within_and_across_heads(rng):
    """Rows are (query head, token) pairs of one KV head; with 16-row tiles over Tq = 40 some tiles
    lie inside one head (their key loop stops at the causal limit) and some straddle two."""
    from lowbit.ops.triton.attention import flash_attention
    kq, vq = _cache(rng, 1, 1, 45, 24, KVScheme("fp8", "token"), device=DEV)
    q = torch.randn(1, 2, 40, 24, generator=rng).to(DEV)
    spec = ar.AttnSpec(q_format=None, p_block=16, causal=True)
    out = flash_attention(q, kq, vq, spec, block_m=16, mma=False)
    _check(out, q, kq, vq, spec)


@pytest.mark.parametrize("scheme", [KVScheme("fp8", "head"), KVScheme("int8", "tensor")], ids=str)
@pytest.mark.parametrize("pf", ["fp8_e4m3fn", "int8"])
def test_triton_tensor_core_mode_within_gate(rng, scheme, pf):
    """The bf16-codes mode (scales after the dots) against the same reference gate, both with Q as
    codes and Q given in bf16; and its refusal where it would not be exact."""
    from lowbit.ops.triton.attention import flash_attention
    kq, vq = _cache(rng, 1, 2, 37, 40, scheme, device=DEV)
    q = torch.randn(1, 4, 5, 40, generator=rng).to(DEV)
    spec = ar.AttnSpec(p_format=pf, p_block=16, causal=True)
    vals, scale = ar.quantize_q_parts(q, spec.q_format)
    _check(flash_attention(vals, kq, vq, spec, q_scale=scale, mma=True), q, kq, vq, spec)
    qb = q.to(torch.bfloat16)
    spec_b = ar.AttnSpec(q_format=None, p_format=pf, p_block=16, causal=True)
    _check(flash_attention(qb, kq, vq, spec_b, mma=True), qb.float(), kq, vq, spec_b)
    with pytest.raises(ValueError, match="mma=True needs"):
        flash_attention(vals, kq, vq, ar.AttnSpec(p_format=None, p_block=16), q_scale=scale, mma=True)
