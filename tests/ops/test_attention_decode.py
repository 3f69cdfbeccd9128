"""The split-KV (flash-decoding) attention kernel against the float64 reference's derived gate at
odd sizes (head dims that are not powers of two, lengths that are not tile multiples, GQA 1 / 3 /
4, one to several splits, fp8 / int8 caches scaled per tensor, head and token, Q quantized in the
kernel); check_attention's verdict on it; the split boundaries; the dispatch; bad input."""
import math

import pytest
import torch

from lowbit.ops import attention_reference as ar
from lowbit.ops import dispatch
from lowbit.ops.attention import attention
from lowbit.ops.kernels.attention_call import AttentionCall, CacheOperand
from lowbit.ops.kv_quant import KVScheme, observe_amax, quantize_kv, static_scale
from lowbit.ops.triton.attention_decode import MAX_ROWS, pick_splits, split_kv_attention
from lowbit.verify.attention import check_attention

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"      # the interpreter (conftest) runs the kernel on CPU tensors


def _states(rng, B, Hkv, Tk, D):
    # heads of different size, as real models have: per-head scales then matter
    k = torch.randn(B, Hkv, Tk, D, generator=rng) * torch.linspace(0.5, 2, Hkv).reshape(1, Hkv, 1, 1)
    v = torch.randn(B, Hkv, Tk, D, generator=rng) * torch.linspace(2, 0.7, Hkv).reshape(1, Hkv, 1, 1)
    return k, v


def _quant(k, v, scheme):
    if scheme is None:
        return k.to(torch.bfloat16), v.to(torch.bfloat16)
    if scheme.dynamic:
        return quantize_kv(k, scheme), quantize_kv(v, scheme)
    return (quantize_kv(k, scheme, static_scale(observe_amax(k, scheme), scheme)),
            quantize_kv(v, scheme, static_scale(observe_amax(v, scheme), scheme)))


def _to(t, dev):
    return t.to(dev)


def _worst(out, q, kq, vq, spec, out_dtype=torch.float32):
    q_hat = ar.quantize_q(q.cpu(), spec.q_format)
    deq = [t.to("cpu").dequantize() if hasattr(t, "scheme") else t.cpu().float() for t in (kq, vq)]
    ref = ar.attention_reference(q_hat, *deq, spec, out_dtype=out_dtype)
    assert bool(torch.isfinite(out).all())
    return float(((out.cpu().double() - ref.out).abs() / ref.gate).max())


CASES = [  # B, Hq, Hkv, Tq, Tk, D, scheme, q_format, p_format, causal, splits
    (2, 8, 2, 1, 150, 40, KVScheme("fp8", "head"), "fp8_e4m3fn", "fp8_e4m3fn", True, 3),     # GQA 4
    (2, 3, 1, 1, 77, 72, KVScheme("int8", "token"), "int8", "int8", True, None),              # GQA 3 (MQA)
    (2, 2, 2, 1, 37, 24, KVScheme("fp8", "tensor"), "fp8_e4m3fn", None, False, 2),             # GQA 1, P fp32
    (2, 4, 1, 3, 99, 40, KVScheme("fp8", "token"), None, "fp8_e4m3fn", True, 4),               # bf16 Q, Tq 3
    (3, 6, 2, 2, 200, 64, KVScheme("int8", "head"), "fp8_e4m3fn", "fp8_e4m3fn", True, 13),     # 13 splits
    (2, 4, 4, 1, 61, 40, KVScheme("int8", "tensor"), "int8", "int8", False, 1),                # one split
    (2, 1, 1, 40, 45, 24, KVScheme("fp8", "token"), "fp8_e4m3fn", "fp8_e4m3fn", True, 3),      # splits no key of some rows reach
    (2, 6, 2, 1, 53, 72, None, None, "fp8_e4m3fn", True, 2),                                   # a bf16 cache
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-G{c[1] // c[2]}-Tq{c[3]}-Tk{c[4]}-D{c[5]}-{c[6]}-"
                         f"Q{c[7]}-P{c[8]}-{'causal' if c[9] else 'full'}-s{c[10]}")
def test_split_kv_within_derived_gate(rng, case):
    B, Hq, Hkv, Tq, Tk, D, scheme, qf, pf, causal, splits = case
    k, v = _states(rng, B, Hkv, Tk, D)
    kq, vq = _quant(k, v, scheme)
    q = torch.randn(B, Hq, Tq, D, generator=rng) * 1.5
    if qf is None:
        q = q.to(torch.bfloat16)
    spec = ar.AttnSpec(q_format=qf, p_format=pf, p_block=16, causal=causal)
    out = split_kv_attention(_to(q, DEV), _to(kq, DEV), _to(vq, DEV), spec, splits=splits)
    assert out.shape == q.shape and out.dtype == torch.float32
    worst = _worst(out, q, kq, vq, spec)
    assert worst <= 1.0, f"worst err/gate {worst:.3g}"


def test_split_kv_given_q_codes_and_bf16_output(rng):
    """Q handed over as its code values and scales (what the prefill kernel takes) gives the same
    arithmetic; a bf16 output is rounded once, within the gate for bf16."""
    k, v = _states(rng, 2, 2, 70, 40)
    kq, vq = _quant(k, v, KVScheme("fp8", "head"))
    q = torch.randn(2, 8, 1, 40, generator=rng)
    spec = ar.AttnSpec(p_block=16)
    vals, scale = ar.quantize_q_parts(q, spec.q_format)
    out = split_kv_attention(vals.to(DEV), kq.to(DEV), vq.to(DEV), spec, q_scale=scale.to(DEV), splits=3,
                             out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert _worst(out, q, kq, vq, spec, out_dtype=torch.bfloat16) <= 1.0


def test_check_attention_passes_the_split_kernel(rng):
    k, v = _states(rng, 2, 2, 90, 40)
    kq, vq = _quant(k, v, KVScheme("fp8", "head"))
    q = torch.randn(2, 8, 1, 40, generator=rng) * 1.5
    spec = ar.AttnSpec(p_block=16, causal=True)
    out = split_kv_attention(q.to(DEV), kq.to(DEV), vq.to(DEV), spec, splits=4)
    verdict = check_attention(out.cpu(), q, kq, vq, spec, k_float=k, v_float=v)
    assert verdict.passed and verdict.kind == "ok", verdict.report()


@pytest.mark.parametrize("B,Hkv,Tk,bn,sms", [(1, 8, 32768, 64, 132), (16, 8, 32768, 64, 132), (1, 1, 37, 16, 4),
                                              (3, 2, 1000, 16, 132), (64, 8, 8192, 64, 132)])
def test_pick_splits_boundaries_on_p_blocks(B, Hkv, Tk, bn, sms):
    split, ns = pick_splits(B, Hkv, Tk, bn, sms)
    assert split % bn == 0                      # a split boundary is a P block boundary
    assert (ns - 1) * split < Tk <= ns * split  # every key in exactly one split, no split empty
    nblocks = math.ceil(Tk / bn)
    assert ns == 1 or split // bn >= 4                       # enough loop trips to pipeline
    assert B * Hkv * ns <= max(3 * sms, B * Hkv)              # one wave of resident programs
    if B * Hkv * 2 <= 3 * sms and nblocks >= 8:
        assert ns >= 2                                        # a small batch is split


def _op(kind):
    if kind == "bf16":
        return CacheOperand.of_scheme(None)
    if kind == "float":
        return CacheOperand("float", None, torch.float32)
    return CacheOperand.of_scheme(KVScheme("fp8", kind, 32 if kind == "group" else None))


def _call(Tq, G, q="quantized", k="tensor", v="head"):
    return AttentionCall(Tq, G, 64, q, _op(k), _op(v), ar.AttnSpec())


def test_dispatch_picks_split_kv_for_decode():
    assert dispatch.attention_kernel(_call(1, 4)) == "split_kv"
    assert dispatch.attention_kernel(_call(16, 4, k="token", v="token")) == "split_kv"
    assert dispatch.attention_kernel(_call(1, 4, q="bf16", k="bf16", v="bf16")) == "split_kv"
    # past the split-KV tile (68 rows), or not exact in its dots: a prefill kernel, the tensor-core
    # one unless it refuses the call
    assert dispatch.attention_kernel(_call(17, 4, k="token")) == "prefill"
    assert dispatch.attention_kernel(_call(17, 4, k="token", v="token")) == "flash"
    assert dispatch.attention_kernel(_call(1, 4, q="float", k="bf16", v="bf16")) == "flash"
    assert dispatch.attention_kernel(_call(1, 4, k="group", v="group")) == "flash"
    assert dispatch.attention_kernel(_call(1, 4, k="float", v="float")) == "flash"
    # a choice, for prefill only (decode keeps split-KV)
    assert dispatch.attention_kernel(_call(1, 4), "sdpa") == "split_kv"
    assert dispatch.attention_kernel(_call(300, 4), "sdpa") == "sdpa"
    assert dispatch.attention_kernel(_call(300, 4), "flash") == "flash"
    with pytest.raises(ValueError, match="v: scales per token.*choose 'flash' or 'sdpa'"):
        dispatch.attention_kernel(_call(300, 4, k="token", v="token"), "prefill")
    with pytest.raises(ValueError, match="one of"):
        dispatch.attention_kernel(_call(300, 4), "cudnn")
    assert dispatch.kv_kind(torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16)) == "bf16"


def test_attention_triton_backend_runs_split_kv_on_decode(rng):
    """attention(backend='triton') on a decode step: the dispatch's kernel, within the gate."""
    k, v = _states(rng, 2, 1, 50, 24)
    kq, vq = _quant(k, v, KVScheme("int8", "token"))
    q = torch.randn(2, 3, 1, 24, generator=rng)
    spec = ar.AttnSpec(q_format="int8", p_format="int8", p_block=16)
    out = attention(q.to(DEV), kq.to(DEV), vq.to(DEV), spec, backend="triton")
    assert _worst(out, q, kq, vq, spec) <= 1.0


def test_split_kv_bad_input(rng):
    k, v = _states(rng, 1, 1, 20, 24)
    kq, vq = (_to(t, DEV) for t in _quant(k, v, KVScheme("fp8", "token")))
    spec = ar.AttnSpec(p_block=16, causal=False)
    with pytest.raises(ValueError, match="G \\* Tq"):
        split_kv_attention(torch.randn(1, 1, MAX_ROWS + 1, 24, device=DEV), kq, vq, spec)
    with pytest.raises(ValueError, match="bfloat16"):
        split_kv_attention(torch.randn(1, 1, 1, 24, device=DEV), kq, vq, ar.AttnSpec(q_format=None, p_block=16))
    kg, vg = (_to(t, DEV) for t in _quant(k, v, KVScheme("int4", "group", 8)))
    with pytest.raises(ValueError, match="head-dim group"):
        split_kv_attention(torch.randn(1, 1, 1, 24, device=DEV), kg, vg, spec)
    with pytest.raises(ValueError, match="splits"):
        split_kv_attention(torch.randn(1, 1, 1, 24, device=DEV), kq, vq, spec, splits=0)
    with pytest.raises(ValueError, match="at least as many tokens"):
        split_kv_attention(torch.randn(1, 1, 21, 24, device=DEV), kq, vq, ar.AttnSpec(p_block=16, causal=True))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("scheme", [KVScheme("fp8", "tensor"), KVScheme("fp8", "head"), KVScheme("fp8", "token"),
                                    KVScheme("int8", "head"), None], ids=str)
@pytest.mark.parametrize("shape", [(2, 32, 8, 1, 3001, 128), (3, 8, 2, 4, 777, 128), (1, 12, 4, 1, 5000, 72)])
def test_split_kv_cuda_within_gate(rng, scheme, shape):
    """Compiled on the GPU (fp16 / bf16 tensor cores, the hardware e4m3 conversion, the picked splits)."""
    B, Hq, Hkv, Tq, Tk, D = shape
    k, v = _states(rng, B, Hkv, Tk, D)
    kq, vq = _quant(k, v, scheme)
    q = torch.randn(B, Hq, Tq, D, generator=rng).to(torch.bfloat16)
    for qf, pf in (("fp8_e4m3fn", "fp8_e4m3fn"), (None, "fp8_e4m3fn"), ("int8", "int8"), ("fp8_e4m3fn", None)):
        spec = ar.AttnSpec(q_format=qf, p_format=pf, p_block=64, causal=True)
        out = split_kv_attention(q.cuda(), _to(kq, "cuda"), _to(vq, "cuda"), spec)
        worst = _worst(out, q.float() if qf else q, kq, vq, spec)
        assert worst <= 1.0, f"{qf} / {pf}: worst err/gate {worst:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_split_kv_cache_past_2_to_31_bytes():
    """A cache whose batch offset passes 2^31 bytes (batch 2 of [3, 1, 2^23, 128] fp8 codes): the
    last sequence's output equals the kernel's on that sequence alone (same splits: the same
    arithmetic, bit for bit); 32-bit offsets would read another sequence's keys."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, D = 3, 2 ** 23, 128
    sch = KVScheme("fp8", "tensor")
    # random finite e4m3 bit patterns (0x7F / 0xFF are NaN)
    k = torch.randint(0, 0x7E, (B, 1, T, D), generator=gen, device="cuda", dtype=torch.uint8)
    k |= torch.randint(0, 2, k.shape, generator=gen, device="cuda", dtype=torch.uint8) << 7
    v = torch.randint(0, 0x7E, (B, 1, T, D), generator=gen, device="cuda", dtype=torch.uint8)
    scale = torch.full((1, 1, 1, 1), 2.0 ** -8, device="cuda")
    from lowbit.ops.kv_quant import KVQuant
    kq, vq = KVQuant(k, scale, sch), KVQuant(v, scale, sch)
    q = torch.randn(B, 2, 1, D, generator=gen, device="cuda").to(torch.bfloat16)
    spec = ar.AttnSpec(p_block=64)
    full = split_kv_attention(q, kq, vq, spec, splits=64)
    last = split_kv_attention(q[2:], KVQuant(k[2:], scale, sch), KVQuant(v[2:], scale, sch), spec, splits=64)
    assert torch.equal(full[2:], last)
