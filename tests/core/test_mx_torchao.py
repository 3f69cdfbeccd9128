"""MX (e8m0 scales) and NVFP4 quantization bit-exact against torchao's reference
implementation (torchao.prototype.mx_formats, runs on the CPU), for every scale rule and
element format both libraries share.

Documented differences, each tested explicitly below rather than hidden:
- Blocks so small that the e8m0 code clamps at the bottom: torchao stores code 0 (2^-127)
  but divides by 2^-126; lowbit stores code 1 (2^-126), the scale it divides by.
- torchao's eager RCEIL takes ceil(torch.log2(amax / max)) in float32; lowbit reads the exact
  ceiling from the bits (as the hardware cvt.rp.satfinite.ue8m0 does). They differ only when
  amax / max exceeds a power of two by less than float32 log2 resolution.
- NVFP4: torchao multiplies by a reciprocal, x * ((1/g) / b); lowbit divides x / s (the
  contract's IEEE division). Element codes can differ only where x / s sits within float32
  rounding of an fp4 rounding boundary.
"""
import pytest
import torch

import lowbit as lb
from lowbit.quantize import e8m0_exponent
from lowbit.scheme import QuantScheme

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2  # noqa: E402
from torchao.prototype.mx_formats.kernels import unpack_uint4  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale  # noqa: E402

ELEMS = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp6_e2m3fn": DTYPE_FP6_E2M3,
         "fp6_e3m2fn": DTYPE_FP6_E3M2, "fp4_e2m1fn": torch.float4_e2m1fn_x2}
RULES = {"floor": ScaleCalculationMode.FLOOR, "ceil": ScaleCalculationMode.CEIL,
         "rceil": ScaleCalculationMode.RCEIL, "even": ScaleCalculationMode.EVEN}


def _torchao_mx(x, fmt, rule):
    """(scale codes uint8 [.., K/32], element codes uint8 [.., K]) from torchao's to_mx."""
    s, d = mx.to_mx(x, ELEMS[fmt], 32, RULES[rule])
    if fmt == "fp4_e2m1fn":
        d = unpack_uint4(d.view(torch.uint8))
    return s.view(torch.uint8), d.view(torch.uint8)


def _mx_data(rng, rows, k, dtype):
    """Groups of 32 with magnitudes from 2^-30 to 2^30, exact powers of two and exact format
    maxima as amax, and zero groups."""
    g = k // 32
    x = torch.randn(rows, g, 32, generator=rng) * 2.0 ** torch.randint(-30, 31, (rows, g, 1), generator=rng)
    x[0, 0] = 0.0
    if rows > 2:
        x[1, 0, 5] = 2.0 ** 7 * (1 + x[1, 0].abs().max())  # amax an exact power of two times something
        x[2, :, 0] = 448.0 * 2.0 ** torch.randint(-10, 10, (g,), generator=rng)  # amax a multiple of 448
    x = x.reshape(rows, k)
    return x.to(dtype)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("fmt", list(ELEMS))
def test_mx_matches_torchao(rng, device, fmt, rule):
    rows = int(torch.randint(3, 40, (1,), generator=rng))
    k = 32 * int(torch.randint(1, 5, (1,), generator=rng))
    for dtype in (torch.float32, torch.bfloat16):
        x = _mx_data(rng, rows, k, dtype)
        ts, td = _torchao_mx(x, fmt, rule)
        qt = lb.quantize(x.to(device), QuantScheme(fmt, "group", group_size=32, scale_format="e8m0",
                                                   scale_rounding=rule)).to("cpu")
        assert torch.equal(qt.codes, td), f"{int((qt.codes != td).sum())} element codes differ"
        ok = ts != 0
        assert torch.equal(qt.scale_codes[ok], ts[ok])
        # torchao's code 0 <-> lowbit's 1 (both divided by 2^-126), only for blocks that tiny.
        assert bool((qt.scale_codes[~ok] == 1).all())


@pytest.mark.parametrize("rule", ["floor", "ceil", "even", "rceil"])
def test_e8m0_rule_over_random_float32_bit_patterns(rng, device, rule):
    """Scale codes for amax across the whole positive float32 range (subnormals included)."""
    n = 2048
    bits = torch.randint(1, 0x7F800000, (n,), generator=rng, dtype=torch.int64).to(torch.int32)
    amax = bits.view(torch.float32)
    x = torch.zeros(n, 32)
    x[:, 0] = amax
    x[:, 1:] = amax[:, None] * torch.rand(n, 31, generator=rng)
    for fmt in ("fp8_e4m3fn", "fp4_e2m1fn"):
        ts, _ = _torchao_mx(x, fmt, rule)
        ours = e8m0_exponent(amax.to(device), lb.get_format(fmt), rule).cpu()
        keep = ts[:, 0] != 0
        if rule == "rceil":
            # torchao's float32 log2 cannot resolve d = amax/max = 2^k (1 + m) from 2^k when m is
            # below log2's float32 resolution, at most 2^-17 for |k| < 128: skip those draws.
            d = (amax / lb.get_format(fmt).max).view(torch.int32)
            keep &= (d & 0x7FFFFF) >= (1 << 6)
        assert torch.equal(ours[keep], ts[keep, 0])
        assert bool((ours[~(ts[:, 0] != 0)] == 1).all())


def test_rceil_exact_where_torchao_log2_rounds():
    """amax/448 = 16 (1 + 2^-23): the exact ceiling is 2^5; float32 log2 gives exactly 4.0."""
    amax = torch.tensor([448.0 * 16 * (1 + 2.0 ** -23)])
    ours = int(e8m0_exponent(amax, lb.get_format("fp8_e4m3fn"), "rceil"))
    assert ours == 127 + 5
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    ts, _ = _torchao_mx(x, "fp8_e4m3fn", "rceil")
    assert int(ts[0, 0]) == 127 + 4  # torchao's eager rule: its scale would saturate amax
    qt = lb.quantize(x, lb.QuantScheme("fp8_e4m3fn", "group", group_size=32, scale_format="e8m0",
                                       scale_rounding="rceil"))
    assert float(qt.dequantize()[0, 0]) <= float(amax) and float(qt.dequantize()[0, 0]) > 0.9 * float(amax)


def test_ceil_to_ue8m0_is_torchao_rceil_not_ceil(rng):
    """ceil_to_ue8m0(amax / 448) (the DeepSeek-V3 / cuBLAS rule), written out here, equals lowbit's 'rceil'; torchao's
    CEIL (ceil(log2 amax) - 8) is a different, coarser rule."""
    amax = torch.rand(500, generator=rng) * 2.0 ** torch.randint(-20, 20, (500,), generator=rng)
    bits = (amax / 448.0).view(torch.int32)
    seed_exp = (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(1, 254)
    fmt = lb.get_format("fp8_e4m3fn")
    assert torch.equal(e8m0_exponent(amax, fmt, "rceil").to(torch.int32), seed_exp)
    ceil = e8m0_exponent(amax, fmt, "ceil").to(torch.int32)
    assert bool((ceil >= seed_exp).all()) and bool((ceil > seed_exp).any())


def test_mx_dequantize_matches_torchao(rng):
    x = _mx_data(rng, 9, 128, torch.float32)
    for fmt in ("fp8_e4m3fn", "fp4_e2m1fn"):
        t = mx.MXTensor.to_mx(x, ELEMS[fmt], 32, ScaleCalculationMode.FLOOR)
        ours = lb.quantize(x, QuantScheme(fmt, "group", group_size=32, scale_format="e8m0", scale_rounding="floor"))
        ref = t.dequantize(torch.float32)
        ok = (t.scale.view(torch.uint8) != 0).repeat_interleave(32, dim=-1)  # see module docstring
        assert torch.equal(ours.dequantize()[ok], ref[ok])


def _nvfp4_data(rng, rows, k):
    x = torch.randn(rows, k // 16, 16, generator=rng) * 2.0 ** torch.randint(-8, 9, (rows, k // 16, 1), generator=rng)
    x[0, 0] = 0.0
    return x.reshape(rows, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_matches_torchao(rng, device, dtype):
    rows, k = int(torch.randint(2, 50, (1,), generator=rng)), 16 * int(torch.randint(1, 9, (1,), generator=rng))
    x = _nvfp4_data(rng, rows, k).to(dtype)
    g = per_tensor_amax_to_scale(x.float().abs().max())
    ts, td = nvfp4_quantize(x, 16, g)
    td = unpack_uint4(td)
    qt = lb.quantize(x.to(device), lb.get_preset("nvfp4")).to("cpu")
    assert torch.equal(qt.global_scale, g.reshape(()))
    assert torch.equal(qt.scale_codes, ts.view(torch.uint8))
    diff = qt.codes != td
    if bool(diff.any()):
        # Only allowed at a rounding boundary: x/s and x*((1/g)/b) round differently in float32
        # (each within 2^-24 relative), so x/s is within ~2^-22 relative of a midpoint between
        # the two fp4 values both sides chose.
        v = (x.float() / qt.expanded_scale())[diff].double()
        a, b = lb.decode(qt.codes[diff], "fp4_e2m1fn").double(), lb.decode(td[diff], "fp4_e2m1fn").double()
        mid = (a + b) / 2
        assert bool(((v - mid).abs() <= v.abs() * 2.0 ** -21).all())
        # (bf16 inputs put exact fp4 ties at ~0.1% of elements, so a handful of these is expected.)


def test_nvfp4_all_zero_tensor_has_finite_scales():
    # torchao divides by a zero tensor scale here (NaN); lowbit uses g = 1 (module docstring).
    qt = lb.quantize(torch.zeros(4, 32), lb.get_preset("nvfp4"))
    assert float(qt.global_scale) == 1.0 and bool(torch.isfinite(qt.scale).all())
    assert bool((qt.codes == 0).all())
