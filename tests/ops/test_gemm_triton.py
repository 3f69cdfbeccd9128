"""Triton GEMM and activation-quantization kernels against independent oracles.

Runs on CUDA when present, else in Triton's CPU interpreter (tests/conftest.py). Shapes are
small and never tile multiples; every test draws fresh random data (the `rng` fixture).
Oracles: torch._int_mm on the CPU (int32 accumulation), float64 matmuls of operands decoded by
torch's own float8 dtype, torch's IEEE division / round-half-even, ml_dtypes' e4m3 cast, and
lowbit.quantize (the canonical arithmetic the kernels must reproduce bit for bit).
"""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from lowbit.ops.triton.act_quant import quantize_per_token
from lowbit.ops.triton.gemm_blockscaled import blockscaled_gemm, fp8_block_gemm, mxfp8_gemm
from lowbit.ops.triton.gemm_fp8 import fp8_gemm
from lowbit.ops.triton.gemm_int8 import int8_gemm
from lowbit.verify.tolerance import gamma

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U32 = 2.0 ** -24  # fp32 unit roundoff
U_OUT = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# fp32 accumulation of fp8 products: exact products, one rounding per addition (interpreter:
# numpy float32). On Hopper the fp8 MMA keeps only about 14 significant bits inside one MMA
# chain before the kernels promote into fp32 (DeepSeek-V3 report), so its unit roundoff is
# taken as 2**-13 there.
U_ACC_FP8 = 2.0 ** -13 if DEV == "cuda" else U32
# Tile shapes forced in the interpreter so that M, N and K all span several tiles with ragged
# edges (on CUDA the shape heuristics choose, and one forced config checks the small-M path).
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
# TMA descriptors (zero-filled out-of-range boxes) in a persistent grid: K is rounded to a
# multiple of 16 for these (the bulk-copy engine needs 16-byte rows), not of BLOCK_K.
TMA_PERSISTENT = dict(SMALL, TMA=True, PERSISTENT=True)
CONFIGS = [None, SMALL, TMA_PERSISTENT]


def _shape(rng, k_lo=64, k_hi=160, config=None):
    M = [1, 3, 17][int(torch.randint(0, 3, (1,), generator=rng))]
    N = int(torch.randint(24, 41, (1,), generator=rng))
    K = int(torch.randint(k_lo, k_hi + 1, (1,), generator=rng))
    if config is not None and config.get("TMA"):
        K = 16 * -(-K // 16)
    return M, N, K


def _int8(rng, *shape, lo=-127):
    return torch.randint(lo, 128, shape, generator=rng, dtype=torch.int8)


def _fp8(rng, *shape):
    """Random e4m3fn values over the whole range (normals and subnormals, both signs)."""
    mag = torch.exp2(torch.rand(shape, generator=rng) * 17 - 9) * torch.sign(torch.randn(shape, generator=rng))
    return mag.clamp(-448, 448).to(torch.float8_e4m3fn)


def _epilogue_tol(prod_abs, bias_abs, ref, out_dtype, acc_err=0.0):
    """Bound on |out - ref| for y = ((acc * sa) * sb) + bias rounded to out_dtype.

    prod_abs: |acc * sa * sb| (float64); acc_err: bound on the accumulator's error times
    sa * sb. The fp32 epilogue rounds at most 4 times (acc -> fp32 when |acc| > 2**24, two
    products, the bias add), compounding to Higham's gamma_4(U32) of a quantity <= prod_abs +
    acc_err + bias_abs; the final cast adds U_OUT of |out| <= |ref| + that error.
    """
    e = acc_err + gamma(4, U32) * (prod_abs + acc_err + bias_abs)
    return e + U_OUT[out_dtype] * (ref.abs() + e)


# ----------------------------------------------------------------------------- int8

@pytest.mark.parametrize("config", CONFIGS)
def test_int8_raw_accumulator_bit_exact(rng, config):
    M, N, K = _shape(rng, config=config)
    a, b = _int8(rng, M, K, lo=-128), _int8(rng, N, K)
    got = int8_gemm(a.to(DEV), b.to(DEV), out_dtype=torch.int32, config=config).cpu()
    assert torch.equal(got, torch._int_mm(a, b.t().contiguous()))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asym,with_bias", [(False, False), (True, True), (False, True)])
def test_int8_fused_epilogue(rng, out_dtype, asym, with_bias):
    M, N, K = _shape(rng)
    a, b = _int8(rng, M, K, lo=-128 if asym else -127), _int8(rng, N, K)
    sa = torch.rand(M, generator=rng) * 0.05 + 1e-3
    sb = torch.rand(N, generator=rng) * 0.01 + 1e-4
    za = torch.randint(-128, 128, (M,), generator=rng, dtype=torch.int32) if asym else None
    cs = b.sum(1, dtype=torch.int32) if asym else None
    bias = torch.randn(N, generator=rng) if with_bias else None
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    got = int8_gemm(a.to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV), a_zero=dev(za), b_colsum=dev(cs),
                    bias=dev(bias), out_dtype=out_dtype).cpu().double()
    acc = torch._int_mm(a, b.t().contiguous()).double()  # exact integers
    if asym:
        acc = acc - za.double()[:, None] * b.double().sum(1)[None, :]
    prod = acc * sa.double()[:, None] * sb.double()[None, :]
    bias64 = bias.double()[None, :] if with_bias else torch.zeros(1, N, dtype=torch.float64)
    ref = prod + bias64
    tol = _epilogue_tol(prod.abs(), bias64.abs(), ref, out_dtype)
    assert torch.all((got - ref).abs() <= tol), f"max excess {((got - ref).abs() - tol).max()}"


def test_int8_tensorwise_scales_broadcast(rng):
    M, N, K = _shape(rng)
    a, b = _int8(rng, M, K), _int8(rng, N, K)
    sa, sb = torch.rand(1, generator=rng) + 0.1, torch.rand(1, generator=rng) + 0.1
    got = int8_gemm(a.to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV), out_dtype=torch.float32).cpu().double()
    prod = torch._int_mm(a, b.t().contiguous()).double() * sa.double() * sb.double()
    assert torch.all((got - prod).abs() <= _epilogue_tol(prod.abs(), 0.0, prod, torch.float32))


def test_int8_bad_input_errors(rng):
    a, b = _int8(rng, 3, 64).to(DEV), _int8(rng, 24, 64).to(DEV)
    s3, s24 = torch.ones(3, device=DEV), torch.ones(24, device=DEV)
    with pytest.raises(TypeError, match="a has dtype"):
        int8_gemm(a.float(), b, s3, s24)
    with pytest.raises(ValueError, match="K must match"):
        int8_gemm(a, b[:, :48].contiguous(), s3, s24)
    with pytest.raises(TypeError, match="a_scale has dtype"):
        int8_gemm(a, b, s3.double(), s24)
    with pytest.raises(ValueError, match="a_scale has 2 values"):
        int8_gemm(a, b, s3[:2], s24)
    with pytest.raises(ValueError, match="contiguous along K"):
        int8_gemm(a, _int8(rng, 64, 24).to(DEV).t(), s3, s24)
    with pytest.raises(ValueError, match="a_zero and b_colsum go together"):
        int8_gemm(a, b, s3, s24, a_zero=torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="out_dtype"):
        int8_gemm(a, b, s3, s24, out_dtype=torch.int8)
    # K * 127 * 127 >= 2**31 would overflow the int32 accumulator: refused before launch.
    k_big = 2**31 // (127 * 127) + 1
    with pytest.raises(ValueError, match="too large for exact int32"):
        int8_gemm(torch.ones(1, k_big, dtype=torch.int8, device=DEV),
                  torch.ones(1, k_big, dtype=torch.int8, device=DEV),
                  torch.ones(1, device=DEV), torch.ones(1, device=DEV))


# ----------------------------------------------------------------------------- fp8

def _fp8_tol(S, prod_abs, bias_abs, ref, out_dtype, K):
    # Accumulating K exact fp8 products with unit roundoff U_ACC_FP8: |error| <= K * U * S
    # (gamma_K, first order), S = sum_k |a_k b_k| * scales.
    return _epilogue_tol(prod_abs, bias_abs, ref, out_dtype, acc_err=K * U_ACC_FP8 * S)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rowwise", [True, False])
def test_fp8_rowwise_and_tensorwise(rng, config, rowwise):
    M, N, K = _shape(rng, config=config)
    a, b = _fp8(rng, M, K), _fp8(rng, N, K)
    sa = (torch.rand(M if rowwise else 1, generator=rng) + 0.01)
    sb = (torch.rand(N if rowwise else 1, generator=rng) + 0.01)
    bias = torch.randn(N, generator=rng).to(torch.bfloat16)
    got = fp8_gemm(a.view(torch.uint8).to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV), bias=bias.to(DEV),
                   out_dtype=torch.bfloat16, config=config).cpu().double()
    a64, b64 = a.double(), b.double()  # decoded by torch's float8 dtype
    scale = sa.double().reshape(-1, 1) * sb.double().reshape(1, -1)
    prod = (a64 @ b64.T) * scale
    S = (a64.abs() @ b64.abs().T) * scale
    ref = prod + bias.double()
    tol = _fp8_tol(S, prod.abs(), bias.double().abs(), ref, torch.bfloat16, K)
    assert torch.all((got - ref).abs() <= tol), f"max excess {((got - ref).abs() - tol).max()}"


def _blockscaled_oracle(a, b, sa, sb, group, rows_per_scale):
    sa64 = sa.double().repeat_interleave(group, 1)
    sb64 = sb.double().repeat_interleave(group, 1).repeat_interleave(rows_per_scale, 0)[: b.shape[0]]
    A, B = a.double() * sa64, b.double() * sb64  # exact: 4-bit significands times fp32 scales
    return A @ B.T, A.abs() @ B.abs().T


@pytest.mark.parametrize("config", [None, dict(SMALL, BLOCK_K=128), dict(TMA_PERSISTENT, BLOCK_K=128)])
def test_fp8_block_1x128_128x128(rng, config):
    M, N, _ = _shape(rng)
    N = N + 128  # two 128-row weight blocks, the second partial
    K = 128 * int(torch.randint(1, 3, (1,), generator=rng)) + 128
    a, b = _fp8(rng, M, K), _fp8(rng, N, K)
    sa = torch.rand(M, K // 128, generator=rng) + 0.01
    sb = torch.rand(-(-N // 128), K // 128, generator=rng) + 0.01
    got = fp8_block_gemm(a.to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV), out_dtype=torch.float32,
                         config=config).cpu().double()
    ref, S = _blockscaled_oracle(a, b, sa, sb, 128, 128)
    # per group: fresh dot (K_g * U), rescale (2 roundings), add into acc (K/G roundings)
    tol = _epilogue_tol(ref.abs(), 0.0, ref, torch.float32,
                        acc_err=(128 * U_ACC_FP8 + (K // 128 + 2) * U32) * S)
    assert torch.all((got - ref).abs() <= tol), f"max excess {((got - ref).abs() - tol).max()}"


@pytest.mark.parametrize("codes,tma", [(True, False), (False, False), (True, True)])
def test_mxfp8_e8m0_per_32(rng, codes, tma):
    M, N, K = _shape(rng, 2, 5)
    K = 32 * K  # 64..160 in steps of 32; with BLOCK_K=64 the last K step is half past K
    a, b = _fp8(rng, M, K), _fp8(rng, N, K)
    ea = torch.randint(110, 140, (M, K // 32), generator=rng, dtype=torch.uint8)
    eb = torch.randint(110, 140, (N, K // 32), generator=rng, dtype=torch.uint8)
    if codes:
        # e8m0 codes: the kernel scales each operand to bf16, exact for codes in [10, 245] (see
        # mxfp8_gemm); test both ends, 2**-117 on fp8 subnormals and 2**118 on values up to 448,
        # paired so that the output stays in fp32's range.
        ea[0, 0] = 10
        ea[:, -1], eb[-1, -1] = 10, 245
    else:
        # fp32 scales: the per-32 partial-product kernel applies sa * sb, exact over all codes:
        # 2**-127 (an fp32 subnormal) and 2**127 paired with 2**-126.
        ea[0, 0] = 0
        ea[:, -1], eb[-1, -1] = 1, 254
    sa, sb = torch.exp2(ea.double() - 127), torch.exp2(eb.double() - 127)
    cfg = dict(TMA_PERSISTENT if tma else SMALL, BLOCK_K=64)
    args = (ea, eb) if codes else (sa.float(), sb.float())
    got = mxfp8_gemm(a.to(DEV), b.to(DEV), *(t.to(DEV) for t in args), out_dtype=torch.float32,
                     config=cfg).cpu().double()
    ref, S = _blockscaled_oracle(a, b, sa, sb, 32, 1)
    tol = _epilogue_tol(ref.abs(), 0.0, ref, torch.float32,
                        acc_err=(32 * U_ACC_FP8 + (K // 32 + 2) * U32) * S)
    assert torch.all((got - ref).abs() <= tol), f"max excess {((got - ref).abs() - tol).max()}"


@pytest.mark.parametrize("out_dtype,with_bias", [(torch.bfloat16, False), (torch.bfloat16, True),
                                                   (torch.float32, True)])
def test_mxfp8_dequant_path(rng, monkeypatch, out_dtype, with_bias):
    """mxfp8_gemm from MX_DEQUANT_MIN_M rows (lowered to 1 here): both operands dequantized to
    bf16 (the kernel's operand values: exact over the codes 10..245 it states) and one bf16 GEMM.
    Products exact, a K-long fp32 sum: |error| <= K * 2u32 * sum |products| (2u32: one ulp per
    addition, for tensor cores that truncate the aligned addends), then the bias add and the
    output rounding (_epilogue_tol); plus (K + 1) * 2**-126 absolute: a library GEMM may flush
    subnormal products and results to zero (seen: oneDNN's bf16 GEMM on the CPU returned 0 for
    a ~1e-38 result of the 2**-117-scaled rows), each losing less than fp32's smallest normal."""
    from lowbit.ops.triton import gemm_blockscaled as gb
    monkeypatch.setattr(gb, "MX_DEQUANT_MIN_M", 1)
    M, N, K = _shape(rng, 2, 5)
    K = 32 * K
    a, b = _fp8(rng, M, K), _fp8(rng, N, K)
    ea = torch.randint(110, 140, (M, K // 32), generator=rng, dtype=torch.uint8)
    eb = torch.randint(110, 140, (N, K // 32), generator=rng, dtype=torch.uint8)
    ea[0, 0] = 10
    ea[:, -1], eb[-1, -1] = 10, 245
    bias = torch.randn(N, generator=rng) * 4 if with_bias else None
    calls = []
    real = gb.mxfp8_dequant_gemm
    monkeypatch.setattr(gb, "mxfp8_dequant_gemm", lambda *args: calls.append(1) or real(*args))
    y = mxfp8_gemm(a.to(DEV), b.to(DEV), ea.to(DEV), eb.to(DEV), out_dtype=out_dtype,
                   bias=None if bias is None else bias.to(DEV))
    assert calls and y.dtype == out_dtype and y.shape == (M, N)
    got = y.cpu().double()
    ref, S = _blockscaled_oracle(a, b, torch.exp2(ea.double() - 127), torch.exp2(eb.double() - 127), 32, 1)
    bias_abs = 0.0
    if bias is not None:
        ref, bias_abs = ref + bias.double(), bias.double().abs()
    tol = _epilogue_tol(S, bias_abs, ref, out_dtype, acc_err=K * 2 * U32 * S) + (K + 1) * 2.0 ** -126
    assert torch.all((got - ref).abs() <= tol), f"max excess {((got - ref).abs() - tol).max()}"


def test_blockscaled_bad_input_errors(rng):
    a, b = _fp8(rng, 3, 96).to(DEV), _fp8(rng, 24, 96).to(DEV)
    with pytest.raises(ValueError, match="not a multiple of the scale group size 128"):
        fp8_block_gemm(a, b, torch.ones(3, 1, device=DEV), torch.ones(1, 1, device=DEV))
    with pytest.raises(ValueError, match=r"expected \(24, 3\)"):
        mxfp8_gemm(a, b, torch.ones(3, 3, device=DEV), torch.ones(1, 3, device=DEV))
    with pytest.raises(TypeError, match="both as fp32 or both"):
        mxfp8_gemm(a, b, torch.ones(3, 3, device=DEV), torch.ones(24, 3, dtype=torch.uint8, device=DEV))
    with pytest.raises(TypeError, match="a has dtype"):
        fp8_gemm(a.float(), b, torch.ones(3, device=DEV), torch.ones(24, device=DEV))
    with pytest.raises(ValueError, match="group=48"):
        blockscaled_gemm(a, b, torch.ones(3, 2, device=DEV), torch.ones(24, 2, device=DEV),
                         group=48, weight_block_rows=1)


# ----------------------------------------------------------------------------- activation quant

def _rows(rng, M, K):
    """Rows with very different ranges, one all-zero row, exact ties for round-half-even."""
    x = torch.randn(M, K, generator=rng) * torch.exp2(torch.randint(-10, 10, (M, 1), generator=rng).float())
    x[1] = 0.0
    x[2, :5] = torch.tensor([127.0, 0.5, -1.5, 2.5, -127.0])  # scale 1.0: x / s hits .5 ties
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_int8_symmetric_bit_exact(rng, dtype):
    import lowbit as lb

    x = _rows(rng, 5, int(torch.randint(100, 5000, (1,), generator=rng))).to(dtype)
    q, s, z = quantize_per_token(x.to(DEV), "int8")
    q, s = q.cpu(), s.cpu()
    xf = x.float()
    s_ref = xf.abs().amax(1, keepdim=True) / 127.0  # torch: IEEE fp32 division
    s_ref[s_ref == 0] = 1.0
    q_ref = torch.round(xf / s_ref).clamp(-127, 127).to(torch.int8)  # round half to even
    assert z is None and torch.equal(s, s_ref) and torch.equal(q, q_ref)
    assert torch.all(s[1] == 1.0) and torch.all(q[1] == 0)  # all-zero row: no NaN
    qt = lb.quantize(x, lb.get_preset("int8_token"))
    assert torch.equal(q, qt.codes) and torch.equal(s, qt.scale)


def test_act_quant_int8_asymmetric_bit_exact(rng):
    import lowbit as lb

    x = _rows(rng, 4, 300) + 0.3
    x[1] = 0.0
    q, s, z = quantize_per_token(x.to(DEV), "int8_asym")
    qt = lb.quantize(x, lb.QuantScheme("int8", "token", symmetric=False))
    assert torch.equal(q.cpu(), qt.codes) and torch.equal(s.cpu(), qt.scale)
    assert torch.equal(z.cpu(), qt.zero_point)
    lo, hi = x.amin(1, keepdim=True).clamp_max(0), x.amax(1, keepdim=True).clamp_min(0)
    s_ref = (hi - lo) / 255.0
    s_ref[s_ref == 0] = 1.0
    assert torch.equal(s.cpu(), s_ref)


def test_act_quant_fp8_bit_exact(rng):
    import lowbit as lb

    x = _rows(rng, 6, 517) * torch.logspace(-6, 2, 517)  # spans e4m3 subnormals after scaling
    q, s, _ = quantize_per_token(x.to(DEV), "fp8_e4m3fn")
    q, s = q.cpu(), s.cpu()
    s_ref = x.abs().amax(1, keepdim=True) / 448.0
    s_ref[s_ref == 0] = 1.0
    v = (x / s_ref).clamp(-448, 448).numpy()
    assert torch.equal(s, s_ref)
    assert np.array_equal(q.numpy(), v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    qt = lb.quantize(x, lb.QuantScheme("fp8_e4m3fn", "token"))
    assert torch.equal(q, qt.codes) and torch.equal(s, qt.scale)


def test_act_quant_bad_input(rng):
    with pytest.raises(ValueError, match="mode="):
        quantize_per_token(torch.randn(2, 8, device=DEV), "int4")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_per_token(torch.ones(2, 8, dtype=torch.int32, device=DEV))
    x = torch.randn(2, 8, generator=rng)
    x[1, 3] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_per_token(x.to(DEV))


@pytest.mark.parametrize("name", ["int8_token", "int8_asym", "fp8_token"])
def test_quantize_tokens_is_lowbit_quantize_and_feeds_linear(rng, name):
    import lowbit as lb
    from lowbit.ops import linear
    from lowbit.ops.triton.act_quant import quantize_tokens

    scheme = {"int8_token": lb.get_preset("int8_token"),
              "int8_asym": lb.QuantScheme("int8", "token", symmetric=False, dynamic=True),
              "fp8_token": lb.QuantScheme("fp8_e4m3fn", "token", dynamic=True)}[name]
    x = torch.randn(2, 5, 96, generator=rng) * 4
    x[0, 1] = 0.0
    got, ref = quantize_tokens(x.to(DEV), scheme), lb.quantize(x, scheme)
    assert got.shape == ref.shape and got.scheme == ref.scheme
    assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scale.cpu(), ref.scale)
    assert (got.zero_point is None) == (ref.zero_point is None)
    if ref.zero_point is not None:
        assert torch.equal(got.zero_point.cpu(), ref.zero_point)
    w_scheme = lb.get_preset("int8_channel" if name.startswith("int8") else "fp8_row")
    wq = lb.quantize(torch.randn(24, 96, generator=rng).to(DEV), w_scheme)
    out = linear(got, wq, out_dtype=torch.float32, backend="triton")
    assert torch.equal(out, linear(ref.to(DEV), wq, out_dtype=torch.float32, backend="triton"))
    with pytest.raises(NotImplementedError, match="quantize_tokens: no kernel"):
        quantize_tokens(x.to(DEV), lb.get_preset("mxfp8"))
