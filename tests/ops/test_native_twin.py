"""The native decode kernels' logic on the CPU: csrc/host_twin.cpp runs decode_warp.h's warp programs (the
kernels' own loads, decode, folds and reductions) with the mma instructions emulated from the PTX fragment
layouts. Oracles: lowbit's float64 reference (check_quantized: gate for a float32 accumulator and a bf16
output), the QTensor's codes (bit for bit), and torch's exact integer products (W8A8 int8, bit for bit)."""
import pytest
import torch

import lowbit as lb
from lowbit.ops.native import kernels as nk
from lowbit.scheme import QuantScheme
from lowbit.verify.check import check_quantized

# (M, N, K, splits): odd N (a partial 16-row tile), K not a multiple of the 256-code k-block, M across the
# one- and two-mma cases, splits beyond the k-blocks there are (empty splits)
CASES = [(1, 40, 320, 1), (5, 33, 384, 2), (9, 17, 640, 3), (16, 24, 256, 5)]


def _w4_scheme(group, symmetric):
    return QuantScheme(format="int4", strategy="group", group_size=group, symmetric=symmetric)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("symmetric", [True, False])
def test_twin_w4_weights_are_the_codes(group, symmetric, rng):
    qt = lb.quantize(torch.randn(37, 512, generator=rng), _w4_scheme(group, symmetric))
    want = qt.codes.float() - (0 if symmetric else qt.expanded_zero_point().float())
    assert torch.equal(nk.twin_weights(nk.prepare_w4(qt)), want)


def test_twin_w8_weights_are_the_codes(rng):
    qt = lb.quantize(torch.randn(21, 200, generator=rng), lb.get_preset("int8_channel"))
    assert torch.equal(nk.twin_weights(nk.prepare_w8(qt)), qt.codes.float())


@pytest.mark.parametrize("group,symmetric", [(128, True), (128, False), (32, True), (64, False)])
def test_twin_w4a16_matches_the_reference(group, symmetric, rng):
    for M, N, K, splits in CASES:
        K = K - K % group if K % group else K
        qt = lb.quantize(torch.randn(N, K, generator=rng), _w4_scheme(group, symmetric))
        x = torch.randn(M, K, generator=rng).bfloat16()
        y = nk.twin_w4a16(x, nk.prepare_w4(qt), splits)
        v = check_quantized(y, x.double(), qt, accumulator="fp32")
        assert v.passed, v.report()


def test_twin_w8a16_matches_the_reference(rng):
    for M, N, K, splits in CASES:
        qt = lb.quantize(torch.randn(N, K, generator=rng), lb.get_preset("int8_channel"))
        x = torch.randn(M, K, generator=rng).bfloat16()
        y = nk.twin_w8a16(x, nk.prepare_w8(qt), splits)
        v = check_quantized(y, x.double(), qt, accumulator="fp32")
        assert v.passed, v.report()


@pytest.mark.parametrize("preset,fp8", [("int8_token", False), ("fp8_row", True)])
def test_twin_act_quant_is_lowbit_quantize(preset, fp8, rng):
    x = torch.randn(7, 1000, generator=rng) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0.0                                          # an all-zero token: scale 1.0, codes 0
    x = x.bfloat16()
    codes, scales = nk.twin_act_quant(x, fp8)
    q = lb.quantize(x.float(), lb.get_preset(preset))
    assert torch.equal(codes, q.codes.view(torch.uint8))
    assert torch.equal(scales, q.scale.reshape(-1))


def test_twin_w8a8_int8_is_bit_exact(rng):
    for M, N, K, splits in CASES:
        w, x = torch.randn(N, K, generator=rng), torch.randn(M, K, generator=rng).bfloat16()
        wq, xq = lb.quantize(w, lb.get_preset("int8_channel")), lb.quantize(x.float(), lb.get_preset("int8_token"))
        y = nk.twin_w8a8(x, nk.prepare_w8(wq), splits)
        acc = (xq.codes.double() @ wq.codes.double().T).float()       # exact integers (|acc| < 2^24)
        want = ((acc * xq.scale) * wq.scale.reshape(1, -1)).bfloat16()  # the documented epilogue, by torch
        assert torch.equal(y, want)


def test_twin_w8a8_fp8_matches_the_reference(rng):
    for M, N, K, splits in CASES:
        w, x = torch.randn(N, K, generator=rng), torch.randn(M, K, generator=rng).bfloat16()
        wq, xq = lb.quantize(w, lb.get_preset("fp8_row")), lb.quantize(x.float(), lb.get_preset("fp8_row"))
        y = nk.twin_w8a8(x, nk.prepare_w8(wq), splits)
        v = check_quantized(y, xq, wq, accumulator="fp32")
        assert v.passed, v.report()


def test_refusals_name_the_argument(rng):
    qt = lb.quantize(torch.randn(16, 256, generator=rng), lb.get_preset("int4_g128"))
    w = nk.prepare_w4(qt)
    with pytest.raises(ValueError, match="M = 1..16"):
        nk.twin_w4a16(torch.zeros(17, 256, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bfloat16"):
        nk.twin_w4a16(torch.zeros(1, 256), w)
    with pytest.raises(ValueError, match="K = 128"):
        nk.twin_w4a16(torch.zeros(1, 128, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="splits"):
        nk.twin_w4a16(torch.zeros(1, 256, dtype=torch.bfloat16), w, 0)
    with pytest.raises(ValueError, match="groups of"):
        nk.prepare_w4(lb.quantize(torch.randn(16, 256, generator=rng), lb.get_preset("mxfp4")))
    with pytest.raises(ValueError, match="multiple of 8"):
        nk.prepare_w8(lb.quantize(torch.randn(16, 100, generator=rng), lb.get_preset("int8_channel")))
    with pytest.raises(ValueError, match="int8 weights"):
        nk.w8a16(torch.zeros(1, 256, dtype=torch.bfloat16),
                 nk.prepare_w8(lb.quantize(torch.randn(16, 256, generator=rng), lb.get_preset("fp8_row"))))


def _biased(N, rng):
    # a bias as large as the outputs, so that one left out (or added before a scale) fails the gate
    return torch.randn(N, generator=rng) * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_w8a8_int8_bias_is_added_last_bit_exact(dtype, rng):
    for M, N, K, splits in CASES:
        w, x = torch.randn(N, K, generator=rng), torch.randn(M, K, generator=rng).bfloat16()
        bias = _biased(N, rng).to(dtype)
        wq, xq = lb.quantize(w, lb.get_preset("int8_channel")), lb.quantize(x.float(), lb.get_preset("int8_token"))
        y = nk.twin_w8a8(x, nk.prepare_w8(wq), splits, bias=bias)
        acc = (xq.codes.double() @ wq.codes.double().T).float()       # exact integers (|acc| < 2^24)
        # the documented epilogue, by torch: two float32 products, one float32 sum, then bf16
        want = (((acc * xq.scale) * wq.scale.reshape(1, -1)) + bias.float()).bfloat16()
        assert torch.equal(y, want)


@pytest.mark.parametrize("kind", ["w4a16-g64-asym", "w4a16-g128", "w8a16", "w8a8-fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_bias_matches_the_reference(kind, dtype, rng):
    """Each kernel with a float32 / bf16 bias against the float64 reference with that bias (the gate counts
    the bias's float32 addition); the same output without the bias fails it."""
    for M, N, K, splits in CASES:
        w, x = torch.randn(N, K, generator=rng), torch.randn(M, K, generator=rng).bfloat16()
        bias = _biased(N, rng).to(dtype)
        if kind.startswith("w4a16"):
            group = 64 if "g64" in kind else 128
            K = K - K % group
            w, x = w[:, :K], x[:, :K].contiguous()
            qt = lb.quantize(w, _w4_scheme(group, "asym" not in kind))
            run, operand = (lambda b: nk.twin_w4a16(x, nk.prepare_w4(qt), splits, bias=b)), x.double()
        elif kind == "w8a16":
            qt = lb.quantize(w, lb.get_preset("int8_channel"))
            run, operand = (lambda b: nk.twin_w8a16(x, nk.prepare_w8(qt), splits, bias=b)), x.double()
        else:
            qt = lb.quantize(w, lb.get_preset("fp8_row"))
            run, operand = (lambda b: nk.twin_w8a8(x, nk.prepare_w8(qt), splits, bias=b)), lb.quantize(
                x.float(), lb.get_preset("fp8_row"))
        v = check_quantized(run(bias), operand, qt, bias=bias.double(), accumulator="fp32")
        assert v.passed, v.report()
        assert not check_quantized(run(None), operand, qt, bias=bias.double(), accumulator="fp32").passed


def test_bias_refusals_name_the_argument(rng):
    w = nk.prepare_w8(lb.quantize(torch.randn(24, 256, generator=rng), lb.get_preset("int8_channel")))
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 or bfloat16.*bias.float"):
        nk.twin_w8a16(x, w, bias=torch.zeros(24, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[N\] = \[24\]"):
        nk.twin_w8a16(x, w, bias=torch.zeros(23))
    with pytest.raises(ValueError, match="contiguous"):
        nk.twin_w8a8(x, w, bias=torch.zeros(48)[::2])


# Launch variants: NT row tiles per CTA (a partial last column of tiles at N = 40 and 33 with NT = 2, 4) and the
# weight prefetch keep every output's summation order, so each must give the default launch's bits; the
# default is held to the float64 reference (and to torch's exact product for int8) by the tests above, and
# here again, so a variant that drifted would fail both.
VARIANTS = [(2, False), (4, False), (1, True), (2, True), (4, True)]


def _variant_case(kind, M, N, K, rng):
    w, x = torch.randn(N, K, generator=rng), torch.randn(M, K, generator=rng).bfloat16()
    if kind.startswith("w4a16"):
        group = 32 if "g32" in kind else 128
        K = K - K % group
        w, x = w[:, :K], x[:, :K].contiguous()
        qt = lb.quantize(w, _w4_scheme(group, "asym" not in kind))
        return (lambda **kw: nk.twin_w4a16(x, nk.prepare_w4(qt), **kw)), x.double(), qt
    if kind == "w8a16":
        qt = lb.quantize(w, lb.get_preset("int8_channel"))
        return (lambda **kw: nk.twin_w8a16(x, nk.prepare_w8(qt), **kw)), x.double(), qt
    qt = lb.quantize(w, lb.get_preset("fp8_row" if kind == "w8a8-fp8" else "int8_channel"))
    xq = lb.quantize(x.float(), lb.get_preset("fp8_row" if kind == "w8a8-fp8" else "int8_token"))
    return (lambda **kw: nk.twin_w8a8(x, nk.prepare_w8(qt), **kw)), xq, qt


@pytest.mark.parametrize("kind", ["w4a16-g128", "w4a16-g32-asym", "w8a16", "w8a8-int8", "w8a8-fp8"])
def test_twin_launch_variants_give_the_default_bits(kind, rng):
    for M, N, K, splits in CASES[:3]:
        run, operand, qt = _variant_case(kind, M, N, K, rng)
        base = run(splits=splits)
        v = check_quantized(base, operand, qt, accumulator="fp32")
        assert v.passed, v.report()
        if kind == "w8a8-int8":
            acc = (operand.codes.double() @ qt.codes.double().T).float()    # exact integers (|acc| < 2^24)
            assert torch.equal(base, ((acc * operand.scale) * qt.scale.reshape(1, -1)).bfloat16())
        for nt, prefetch in VARIANTS:
            y = run(splits=splits, nt=nt, prefetch=prefetch)
            assert torch.equal(y.view(torch.int16), base.view(torch.int16)), (kind, M, N, K, splits, nt, prefetch)


def test_launch_variant_refusals_name_the_argument(rng):
    w = nk.prepare_w8(lb.quantize(torch.randn(24, 256, generator=rng), lb.get_preset("int8_channel")))
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"nt \(row tiles per CTA\) must be one of \(1, 2, 4\), got 3"):
        nk.twin_w8a16(x, w, nt=3)
    with pytest.raises(ValueError, match="prefetch must be True or False, got 1"):
        nk.twin_w8a8(x, w, prefetch=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["w4-g128", "w4-g32-asym", "w4-g256", "w8"])
def test_twin_dequantize_is_each_weight_rounded_once(kind, dtype, rng):
    """The large-M path's weight: dtype(float32(code - z) * scale), by torch (the product in float32, one rounding
    to the dtype), bit for bit; odd N and K past the tile (zeros past K never written)."""
    N, K = 37, {"w4-g128": 384, "w4-g32-asym": 352, "w4-g256": 512, "w8": 328}[kind]    # 352, 328: a partial tile
    w = torch.randn(N, K, generator=rng) * torch.logspace(-4, 5, N)[:, None]     # scales far apart: fp16 overflows to inf
    if kind == "w8":
        qt = lb.quantize(w, lb.get_preset("int8_channel"))
        want = (qt.codes.float() * qt.scale.reshape(N, 1).float()).to(dtype)
        got = nk.twin_dequantize(nk.prepare_w8(qt), dtype)
    else:
        qt = lb.quantize(w, _w4_scheme(int(kind.split("-g")[1].split("-")[0]), "asym" not in kind))
        z = 0 if qt.zero_point is None else qt.expanded_zero_point().float()
        want = ((qt.codes.float() - z) * qt.expanded_scale().float()).to(dtype)
        got = nk.twin_dequantize(nk.prepare_w4(qt), dtype)
    assert got.dtype == dtype and torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def test_dequantize_refusals_name_the_argument(rng):
    w = nk.prepare_w8(lb.quantize(torch.randn(24, 256, generator=rng), lb.get_preset("int8_channel")))
    with pytest.raises(ValueError, match="dtype must be one of"):
        nk.twin_dequantize(w, torch.int8)
