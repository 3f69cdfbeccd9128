"""The documented epilogue rounding order of lowbit's Triton GEMMs, pinned bit for bit.

test_gemm_triton.py checks the kernels against the float64 reference within a derived bound;
a bound cannot notice the epilogue's order changing (scales multiplied together first, the
zero-point correction taken in fp32, a fused multiply-add). These tests choose inputs whose
contraction is exact in fp32 (small integer products: every partial sum below 2**13 is
exact even in Hopper's ~14-bit fp8 accumulator), so the kernel's output is a deterministic
function of the epilogue alone; they emulate the order each kernel's docstring states with
one torch fp32 operation per documented rounding and require the kernel's bits. Each test
also emulates the plausible other orders and requires that at least one output differs
from the kernel's: the data can tell the orders apart, so a changed order fails.
"""
from __future__ import annotations

import pytest
import torch

import lowbit as lb
from lowbit.ops.triton.gemm_blockscaled import blockscaled_gemm, fp8_block_gemm
from lowbit.ops.triton.gemm_fp8 import fp8_gemm
from lowbit.ops.triton.gemm_int8 import int8_gemm
from lowbit.ops.triton.w8a16 import w8a16_gemm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F32 = torch.float32
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)


def _scales(rng, n: int) -> torch.Tensor:
    """fp32 scales with random 24-bit significands over 2**-12..2**-2 (like real scales)."""
    return (torch.exp2(torch.rand(n, generator=rng) * 10 - 12) * (1 + torch.rand(n, generator=rng))).float()


def _small_ints(rng, *shape, dtype) -> torch.Tensor:
    """Integers in [-7, 7] (zeros included) as `dtype`: exact in e4m3 / bf16; products <= 49."""
    return torch.randint(-7, 8, shape, generator=rng).to(dtype)


def rowcol(acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias, order: str) -> torch.Tensor:
    """fp32 epilogue out of an fp32 accumulator [M, N], per-row sa [M], per-column sb [N].
    documented: y = (acc * sa) * sb, then y + bias (lowbit.ops.triton.common.rowcol_scale,
    add_bias: one fp32 rounding per operation). The others are what a kernel might do instead."""
    a, s, t = acc.to(F32), sa.to(F32)[:, None], sb.to(F32)[None, :]
    b = torch.zeros(1, acc.shape[1]) if bias is None else bias.to(F32)[None, :]
    if order == "documented":
        return (a * s) * t + b
    if order == "scales_first":             # acc * (sa * sb)
        return a * (s * t) + b
    if order == "weight_scale_first":       # (acc * sb) * sa
        return (a * t) * s + b
    if order == "one_rounding":             # everything in float64, rounded once
        return (a.double() * s.double() * t.double() + b.double()).to(F32)
    if order == "fused":                    # the GPU: fma((acc * sa), sb, bias), one rounding for the last two
        return ((a * s).double() * t.double() + b.double()).to(F32)
    raise ValueError(order)


ALTERNATIVES = ("scales_first", "weight_scale_first", "one_rounding")


# On the GPU Triton contracts a multiply followed by an add into one FMA (its default fp fusion):
# the documented orders say so, and the H200 kernels matched exactly these fused forms.
DOCUMENTED = "fused" if DEV == "cuda" else "documented"


def _pin(got: torch.Tensor, emulate, out_dtype: torch.dtype, alternatives=ALTERNATIVES) -> None:
    """got (the kernel) must equal emulate(DOCUMENTED) cast to out_dtype bit for bit (torch's
    casts round to nearest even, as lowbit.ops.triton.common.cast_out does), and every
    alternative order must differ from got somewhere when out_dtype is fp32."""
    want = emulate(DOCUMENTED).to(out_dtype)
    if not torch.equal(got, want):
        also = []
        for o in ("documented", "fused") + tuple(alternatives):
            try:
                if torch.equal(got, emulate(o).to(out_dtype)):
                    also.append(o)
            except ValueError:  # an order this emulation does not model
                pass
        bad = (got != want).sum().item()
        raise AssertionError(f"{bad} of {got.numel()} outputs differ from the documented epilogue order; "
                             f"the kernel matches: {also or 'no emulated order'}")
    if out_dtype == F32:
        for o in alternatives:
            assert not torch.equal(got, emulate(o)), f"the data cannot tell {o!r} from the documented order"


def _bias_like(rng, acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, N: int) -> torch.Tensor:
    """A bias [N] of the products' own size: a bias far larger than acc * sa * sb would swallow
    the products' roundings in its own, and every order would give the same fp32 sum."""
    size = float((acc.double() * sa.double().reshape(-1, 1) * sb.double().reshape(1, -1)).abs().mean())
    return (torch.randn(N, generator=rng, dtype=torch.float64) * size).float()


def _dev(t):
    return None if t is None else t.to(DEV)


@pytest.mark.parametrize("out_dtype", [F32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asym", [False, True])
def test_int8_epilogue_order(rng, out_dtype, asym):
    """int8_gemm: acc exact in int32 (minus za * colsum in int64), fp32(acc), (. * sa) * sb, + bias."""
    M, N, K = 19, int(torch.randint(24, 41, (1,), generator=rng)), int(torch.randint(64, 161, (1,), generator=rng))
    a = torch.randint(-128 if asym else -127, 128, (M, K), generator=rng, dtype=torch.int8)
    b = torch.randint(-127, 128, (N, K), generator=rng, dtype=torch.int8)
    sa, sb = _scales(rng, M), _scales(rng, N)
    za = torch.randint(-128, 128, (M,), generator=rng, dtype=torch.int32) if asym else None
    cs = b.sum(1, dtype=torch.int32) if asym else None
    acc = torch._int_mm(a, b.t().contiguous()).long()
    if asym:
        acc = acc - za.long()[:, None] * cs.long()[None, :]
    bias = _bias_like(rng, acc, sa, sb, N)
    got = int8_gemm(a.to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV), a_zero=_dev(za), b_colsum=_dev(cs),
                    bias=bias.to(DEV), out_dtype=out_dtype, config=SMALL).cpu()
    _pin(got, lambda o: rowcol(acc.to(F32), sa, sb, bias, o), out_dtype)


def test_int8_zero_point_correction_in_int64_at_long_k(rng):
    """The asymmetric correction za * colsum is subtracted in int64, before the one conversion
    to fp32. It matters only when |za * colsum| > 2**24 and is not a multiple of its fp32 ulp:
    K = 4096, GELU-like activations (min -0.17, so za is not -128, a power of two) and
    positive-mean weights (colsum ~ 4096 * 60). Then fp32(acc) - fp32(za * colsum) differs.
    Tokens of different sizes (gains 0.5..4) spread za over ~20 values: with one size the za
    were often all even, and below 2**25 an even za * colsum is exact in fp32 (3 seeds in 50)."""
    M, N, K = 33, 21, 4096
    gains = torch.exp2(torch.rand(M, 1, generator=rng) * 3 - 1)
    x = torch.nn.functional.gelu(torch.randn(M, K, generator=rng) * gains)
    w = torch.randn(N, K, generator=rng) * 0.3 + 1.0
    xq = lb.quantize(x, lb.QuantScheme("int8", "token", symmetric=False))
    wq = lb.quantize(w, lb.get_preset("int8_channel"))
    za, cs = xq.zero_point.reshape(-1), wq.codes.sum(1, dtype=torch.int32)
    sa, sb = xq.scale.reshape(-1), wq.scale.reshape(-1)
    zc = za.long()[:, None] * cs.long()[None, :]
    assert zc.abs().max() > 2**24 and not torch.equal(zc.to(F32).long(), zc), "inputs miss the regime"
    got = int8_gemm(xq.codes.to(DEV), wq.codes.to(DEV), sa.to(DEV), sb.to(DEV), a_zero=za.to(DEV),
                    b_colsum=cs.to(DEV), out_dtype=F32).cpu()
    acc = torch._int_mm(xq.codes, wq.codes.t().contiguous()).long()
    exact = (acc - zc).to(F32)
    in_fp32 = acc.to(F32) - zc.to(F32)       # the correction taken in fp32 instead
    assert not torch.equal(exact, in_fp32)
    # no bias: the two scale orders ("documented", "fused") coincide; only the correction differs
    _pin(got, lambda o: rowcol(in_fp32 if o == "fp32 correction" else exact, sa, sb, None, "documented"), F32,
         alternatives=("fp32 correction",))


@pytest.mark.parametrize("out_dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("rowwise", [True, False])
def test_fp8_rowwise_epilogue_order(rng, out_dtype, rowwise):
    """fp8_gemm: fp32 accumulation (exact here: integer products, sums < 2**13), then
    (acc * sa) * sb + bias, as int8_gemm (the same rowcol_scale / add_bias)."""
    M, N, K = 17, int(torch.randint(24, 41, (1,), generator=rng)), int(torch.randint(64, 161, (1,), generator=rng))
    a = _small_ints(rng, M, K, dtype=torch.float8_e4m3fn)
    b = _small_ints(rng, N, K, dtype=torch.float8_e4m3fn)
    sa, sb = _scales(rng, M if rowwise else 1), _scales(rng, N if rowwise else 1)
    acc = a.double() @ b.double().T                      # exact integers < 2**13
    bias = _bias_like(rng, acc, sa, sb, N)
    got = fp8_gemm(a.to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV), bias=bias.to(DEV), out_dtype=out_dtype,
                   config=SMALL).cpu()
    _pin(got, lambda o: rowcol(acc.to(F32), sa.expand(M), sb.expand(N), bias, o), out_dtype,
         ALTERNATIVES if rowwise else ("one_rounding",))  # one scale each: the products commute


def _blockscaled_emulation(parts, sa, sb, R, order):
    """documented (gemm_blockscaled's docstring): acc += part_g * (sa[m, g] * sb[n // R, g]) in
    fp32, groups in K order, then + bias (none here). parts: [G, M, N] exact fp32 partial dots."""
    n = parts.shape[2]
    sbn = sb.repeat_interleave(R, 0)[:n]                 # [N, groups]
    acc = torch.zeros(parts.shape[1:], dtype=F32)
    if order == "one_rounding":
        return (parts.double() * (sa.double().T[:, :, None] * sbn.double().T[:, None, :])).sum(0).to(F32)
    for g in range(parts.shape[0]):
        s, t = sa[:, g, None], sbn[None, :, g]
        if order == "documented":
            acc = acc + parts[g] * (s * t)
        elif order == "fused":                           # the GPU: fma(part, sa * sb, acc)
            acc = (acc.double() + parts[g].double() * (s * t).double()).to(F32)
        elif order == "part_times_sa_then_sb":
            acc = acc + (parts[g] * s) * t
        else:
            raise ValueError(order)
    return acc


@pytest.mark.parametrize("group,rows", [(128, 128), (32, 1)])
def test_blockscaled_epilogue_order(rng, group, rows):
    """blockscaled_gemm: each group's partial dot (exact here) times (sa * sb), summed in fp32."""
    M, N = 9, int(torch.randint(24, 41, (1,), generator=rng)) + (128 if rows > 1 else 0)
    K = group * int(torch.randint(3, 5, (1,), generator=rng))
    a = _small_ints(rng, M, K, dtype=torch.float8_e4m3fn)
    b = _small_ints(rng, N, K, dtype=torch.float8_e4m3fn)
    sa = _scales(rng, M * (K // group)).reshape(M, -1)
    sb = _scales(rng, -(-N // rows) * (K // group)).reshape(-1, K // group)
    cfg = dict(SMALL, BLOCK_K=max(group, 64))
    if rows > 1:
        got = fp8_block_gemm(a.to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV), out_dtype=F32, config=cfg).cpu()
    else:
        got = blockscaled_gemm(a.to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV), group=group, weight_block_rows=1,
                               out_dtype=F32, config=cfg).cpu()
    A, B = a.double().reshape(M, -1, group), b.double().reshape(N, -1, group)
    parts = torch.einsum("mgk,ngk->gmn", A, B).to(F32)  # exact integers
    _pin(got, lambda o: _blockscaled_emulation(parts, sa, sb, rows, o), F32,
         alternatives=("part_times_sa_then_sb", "one_rounding"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a16_epilogue_order(rng, dtype):
    """w8a16_gemm: fp32 accumulation (exact here), y = acc * s[n], y + bias[n], cast to x's dtype."""
    M, N, K = 5, int(torch.randint(24, 41, (1,), generator=rng)), int(torch.randint(64, 161, (1,), generator=rng))
    x = _small_ints(rng, M, K, dtype=dtype)
    q = torch.randint(-127, 128, (N, K), generator=rng, dtype=torch.int8)   # products < 2**10, sums < 2**18
    s, bias = _scales(rng, N), torch.randn(N, generator=rng)
    got = w8a16_gemm(x.to(DEV), q.to(DEV), s.to(DEV), bias.to(DEV)).cpu()
    acc = (x.double() @ q.double().T).to(F32)
    documented = lambda o: acc * s[None, :] + bias[None, :]  # noqa: E731
    _pin(got, documented, dtype, alternatives=())
