"""quantize / dequantize against independent formulations (numpy, torch's float8 casts),
error-bound properties, all-zero groups and bad input. MX / NVFP4 vs torchao: test_mx_torchao.py."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as lb
from lowbit.quantize import QTensor, expand_scale, reduce_amax
from lowbit.scheme import PRESETS, SCALE_ROUNDINGS, QuantScheme

F32_EPS = 2.0 ** -23  # float32 unit roundoff is 2^-24; each float32 op below adds at most that relative error


def _seeded(rng):
    return np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=rng)))


def _weight(rng, n, k):
    """A weight as real ones look: per-row gain spread 64x, an outlier every 37th element (8x)."""
    w = torch.randn(n, k, generator=rng)
    gain = 2.0 ** torch.linspace(-6, 0, n).reshape(n, 1)
    w = w * gain
    flat = w.reshape(-1)
    flat[::37] *= 8
    return w


# ---------------------------------------------------------------------------------------------
# integer paths: bit-exact against straightforward numpy written here
# ---------------------------------------------------------------------------------------------
def _np_int_sym(x, qmax, axis_groups):
    """numpy float32 reference of symmetric int quantization over groups along the last axis."""
    x = x.astype(np.float32)
    xg = x.reshape(*x.shape[:-1], -1, axis_groups)
    amax = np.abs(xg).max(axis=-1, keepdims=True)
    s = (amax / np.float32(qmax)).astype(np.float32)
    s = np.where(s == 0, np.float32(1), s)
    q = np.clip(np.rint(xg / s), -qmax, qmax)  # np.rint: round half to even
    return q.reshape(x.shape).astype(np.int8), s[..., 0]


def _np_int_asym(x, qmin, qmax, g):
    x = x.astype(np.float32)
    xg = x.reshape(*x.shape[:-1], -1, g)
    lo = np.minimum(xg.min(axis=-1, keepdims=True), 0).astype(np.float32)
    hi = np.maximum(xg.max(axis=-1, keepdims=True), 0).astype(np.float32)
    s = ((hi - lo) / np.float32(qmax - qmin)).astype(np.float32)
    s = np.where(s == 0, np.float32(1), s)
    z = np.clip(np.rint(np.float32(qmin) - lo / s), qmin, qmax)
    q = np.clip(np.rint(xg / s) + z, qmin, qmax)
    return q.reshape(x.shape), s[..., 0], z[..., 0].astype(np.int32)


@pytest.mark.parametrize("n,k", [(37, 50), (5, 129)])
def test_int8_channel_matches_numpy(rng, device, n, k):
    w = _weight(rng, n, k)
    w[3] = 0.0  # an all-zero row: zero codes, scale 1.0
    qt = lb.quantize(w.to(device), lb.get_preset("int8_channel"))
    q_ref, s_ref = _np_int_sym(w.numpy(), 127, k)
    assert qt.codes.dtype == torch.int8 and qt.scale.shape == (n, 1) and qt.zero_point is None
    assert torch.equal(qt.codes.cpu(), torch.from_numpy(q_ref))
    assert torch.equal(qt.scale.cpu(), torch.from_numpy(s_ref))
    assert bool((qt.codes[3] == 0).all()) and float(qt.scale[3]) == 1.0


def test_int8_token_equals_channel_reduction(rng):
    x = torch.randn(3, 7, 40, generator=rng)
    a = lb.quantize(x, lb.get_preset("int8_token"))
    b = lb.quantize(x, lb.get_preset("int8_channel"))
    assert a.scale.shape == (3, 7, 1) and torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("fmt,g", [("int4", 32), ("int8", 16), ("int2", 8)])
def test_int_group_sym_matches_numpy(rng, device, fmt, g):
    x = torch.randn(9, 3 * g, generator=rng) * torch.rand(9, 1, generator=rng) * 10
    qt = lb.quantize(x.to(device), QuantScheme(fmt, "group", group_size=g))
    qmax = lb.get_format(fmt).qmax
    q_ref, s_ref = _np_int_sym(x.numpy(), qmax, g)
    assert torch.equal(qt.codes.cpu(), torch.from_numpy(q_ref)) and qt.scale.shape == (9, 3)
    assert torch.equal(qt.scale.cpu(), torch.from_numpy(s_ref))


@pytest.mark.parametrize("fmt", ["int4", "uint4", "int8", "uint8"])
def test_int_group_asym_matches_numpy(rng, device, fmt):
    g = 32
    x = torch.randn(11, 3 * g, generator=rng) * 3 + torch.randn(11, 1, generator=rng) * 2
    x[2, :g] = torch.rand(g, generator=rng)  # one-sided group: min(x,0) = 0
    x[4, g:2 * g] = 0.0                        # zero group
    f = lb.get_format(fmt)
    qt = lb.quantize(x.to(device), QuantScheme(fmt, "group", group_size=g, symmetric=False))
    q_ref, s_ref, z_ref = _np_int_asym(x.numpy(), f.qmin, f.qmax, g)
    assert qt.codes.dtype == (torch.int8 if f.signed else torch.uint8)
    assert torch.equal(qt.codes.cpu().to(torch.int64), torch.from_numpy(q_ref.astype(np.int64)))
    assert torch.equal(qt.scale.cpu(), torch.from_numpy(s_ref))
    assert qt.zero_point.dtype == torch.int32 and torch.equal(qt.zero_point.cpu(), torch.from_numpy(z_ref))
    # zero is exactly representable: a zero input dequantizes to exactly 0
    assert bool((qt.dequantize()[4, g:2 * g] == 0).all())


def test_symmetric_never_wraps_to_minus_128(rng):
    # With s = amax / 127 taken from the data, the amax element maps to fl(amax / fl(amax / 127)),
    # within a few ulps of 127 at every magnitude: it must come out as exactly +-127, and no code
    # may leave [-127, 127] (a wrap needs x / s >= 127.5, which only a stale scale gives).
    mags = 2.0 ** torch.randint(-120, 120, (512, 1), generator=rng).float()
    x = torch.randn(512, 33, generator=rng) * mags
    qt = lb.quantize(x, QuantScheme("int8", "channel"))
    assert int(qt.codes.min()) >= -127 and int(qt.codes.max()) <= 127
    top = x.abs().argmax(dim=1, keepdim=True)
    top_codes = qt.codes.gather(1, top).squeeze(1).to(torch.int64)
    signs = torch.sign(x.gather(1, top).squeeze(1)).to(torch.int64)
    assert torch.equal(top_codes, 127 * signs)


# ---------------------------------------------------------------------------------------------
# float elements with fp32 scales, block strategy: against torch's own float8 casts
# ---------------------------------------------------------------------------------------------
def _torch_fp8_codes(v, dtype):
    fi = torch.finfo(dtype)
    return v.clamp(-fi.max, fi.max).to(dtype).view(torch.uint8)


@pytest.mark.parametrize("fmt,dtype", [("fp8_e4m3fn", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2),
                                       ("fp8_e4m3fnuz", torch.float8_e4m3fnuz)])
def test_fp8_row_and_tensor_match_torch_cast(rng, device, fmt, dtype):
    x = _weight(rng, 19, 45)
    for strategy in ("channel", "tensor"):
        qt = lb.quantize(x.to(device), QuantScheme(fmt, strategy))
        amax = x.abs().amax(dim=-1, keepdim=True) if strategy == "channel" else x.abs().max().reshape(1, 1)
        s = amax / torch.finfo(dtype).max
        assert torch.equal(qt.scale.cpu(), s)
        assert torch.equal(qt.codes.cpu(), _torch_fp8_codes(x / s, dtype))


@pytest.mark.parametrize("rows,k,block", [(130, 256, (128, 128)), (7, 384, (1, 128)), (33, 96, (16, 32))])
def test_block_scales_match_loop_reference(rng, device, rows, k, block):
    x = _weight(rng, rows, k)
    br, bc = block
    x[:br, :bc] = 0.0  # an all-zero block
    qt = lb.quantize(x.to(device), QuantScheme("fp8_e4m3fn", "block", block_size=block))
    nb_r = math.ceil(rows / br)
    assert qt.scale.shape == (nb_r, k // bc)
    s_ref = torch.empty(nb_r, k // bc)
    for i in range(nb_r):
        for j in range(k // bc):
            a = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max()
            s_ref[i, j] = a / 448.0 if a > 0 else 1.0
    assert torch.equal(qt.scale.cpu(), s_ref)
    s_full = s_ref.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)
    assert torch.equal(qt.codes.cpu(), _torch_fp8_codes(x / s_full, torch.float8_e4m3fn))
    assert torch.equal(qt.expanded_scale().cpu(), s_full)
    assert bool((qt.codes[:br, :bc] == 0).all())


def test_int8_block(rng):
    x = torch.randn(20, 64, generator=rng)
    qt = lb.quantize(x, QuantScheme("int8", "block", block_size=(8, 32)))
    assert qt.scale.shape == (3, 2) and qt.codes.dtype == torch.int8
    blk = x[8:16, 32:64]
    assert float(qt.scale[1, 1]) == float(blk.abs().max() / 127)


# ---------------------------------------------------------------------------------------------
# error-bound properties
# ---------------------------------------------------------------------------------------------
_INT_SCHEMES = [QuantScheme("int8", "channel"), QuantScheme("int4", "group", group_size=8),
                QuantScheme("int8", "tensor"), QuantScheme("int4", "group", group_size=8, symmetric=False),
                QuantScheme("uint8", "channel", symmetric=False), QuantScheme("int2", "block", block_size=(2, 4))]


def _quantized_with_error(scheme, rows, k, seed, log_mag):
    """Normal data [rows, k] from `seed` times 2**log_mag (hypothesis draws both), quantized by
    lowbit. Returns (x as float64, |x - dequantized| in float64 (exact), the expanded scale as
    float64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0 ** log_mag
    qt = lb.quantize(x, scheme)
    xd = x.double()
    return xd, (xd - qt.dequantize(torch.float64)).abs(), qt.expanded_scale().double()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_INT_SCHEMES), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**31 - 1),
       st.floats(-30, 30))
def test_int_error_at_most_half_a_step(scheme, rows, kgroups, seed, log_mag):
    _, err, s = _quantized_with_error(scheme, rows, 8 * kgroups, seed, log_mag)
    # |x/s - fl(x/s)| <= |x/s| 2^-24 <= (qmax - qmin) 2^-24 steps; the rounding itself is <= 1/2 step;
    # with a zero point an end code can clamp one step only where x/s + z sits at a half (so still
    # <= 1/2 step). The float64 dequantization is exact. Bound: s * (1/2 + (qmax - qmin) * 2^-23).
    f = scheme.fmt
    bound = s * (0.5 + (f.qmax - f.qmin) * F32_EPS)
    assert bool((err <= bound).all()), float((err / s).max())


_FLOAT_SCHEMES = [QuantScheme("fp8_e4m3fn", "channel"), QuantScheme("fp8_e5m2", "group", group_size=16),
                  QuantScheme("fp6_e2m3fn", "tensor"), QuantScheme("fp4_e2m1fn", "group", group_size=16),
                  QuantScheme("fp6_e3m2fn", "block", block_size=(2, 16)), lb.get_preset("nvfp4")] + [
    QuantScheme(f, "group", group_size=16, scale_format="e8m0", scale_rounding=r)
    for f in ("fp8_e4m3fn", "fp4_e2m1fn") for r in SCALE_ROUNDINGS]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(_FLOAT_SCHEMES), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31 - 1),
       st.floats(-20, 20))
def test_float_error_within_unit_roundoff(scheme, rows, kgroups, seed, log_mag):
    xd, err, s = _quantized_with_error(scheme, rows, 16 * kgroups, seed, log_mag)
    f = scheme.fmt
    in_range = xd.abs() <= f.max * s
    # In range: encode rounds x/s once to nearest, so |err| <= u |x| for normals and
    # <= s * min_subnormal / 2 in the subnormal range; fl(x/s) adds |x| 2^-24 (scaled back by s).
    bound = f.unit_roundoff * xd.abs() + s * f.min_subnormal / 2 + xd.abs() * F32_EPS
    assert bool((err[in_range] <= bound[in_range]).all())
    # Out of range (floor-rounded e8m0, e4m3-rounded NVFP4 scales): saturated to +-max * s exactly.
    sat = ~in_range
    assert torch.equal(err[sat], xd.abs()[sat] - f.max * s[sat])
    if scheme.scale_format == "fp32" or scheme.scale_rounding in ("ceil", "rceil"):
        # s = amax / max (or a power of two above it) leaves no element out of range beyond
        # one float32 rounding of amax / s.
        assert bool((xd.abs() <= f.max * s * (1 + F32_EPS)).all())


# ---------------------------------------------------------------------------------------------
# zero groups, padding, dtypes, layouts, bad input
# ---------------------------------------------------------------------------------------------
def _all_schemes():
    rules = [QuantScheme(f, "group", group_size=32, scale_format="e8m0", scale_rounding=r)
             for f in ("fp8_e4m3fn", "fp6_e3m2fn", "fp4_e2m1fn", "fp8_e5m2") for r in SCALE_ROUNDINGS]
    return list(PRESETS.values()) + rules


@pytest.mark.parametrize("scheme", _all_schemes(), ids=str)
def test_zero_rows_groups_blocks_give_zero_codes_and_finite_scales(rng, scheme):
    x = torch.randn(20, 256, generator=rng)
    x[5] = 0.0
    x[:, 128:] = 0.0  # zero groups, and zero blocks of 128x128 / 1x128
    for t in (x, torch.zeros(3, 256)):  # also a wholly zero tensor
        qt = lb.quantize(t, scheme)
        assert bool(torch.isfinite(qt.scale).all()) and bool((qt.scale > 0).all())
        dq = qt.dequantize()
        assert bool(torch.isfinite(dq).all())
        assert bool((dq[t == 0] == 0).all())
        zero_code = 0 if scheme.type == "float" or scheme.symmetric else None
        if zero_code is not None:
            assert bool((qt.codes[t == 0] == 0).all())


def test_pad_only_when_asked(rng):
    x = torch.randn(4, 100, generator=rng)
    with pytest.raises(ValueError, match="K = x.shape\\[-1\\] = 100 is not a multiple of the group_size 128.*pad=True"):
        lb.quantize(x, lb.get_preset("int4_g128"))
    qt = lb.quantize(x, lb.get_preset("int4_g128"), pad=True)
    assert qt.codes.shape == (4, 128) and qt.shape == (4, 100) and qt.scale.shape == (4, 1)
    assert bool((qt.codes[:, 100:] == 0).all())
    ref = lb.quantize(torch.nn.functional.pad(x, (0, 28)), lb.get_preset("int4_g128"))
    assert torch.equal(qt.codes, ref.codes) and torch.equal(qt.dequantize(), ref.dequantize()[:, :100])
    with pytest.raises(ValueError, match="block width 128"):
        lb.quantize(x, lb.get_preset("fp8_block128"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_input_dtypes_are_rounded_to_float32_first(rng, dtype):
    x = (torch.randn(6, 128, generator=rng) * 3).to(dtype)
    for name in ("int8_channel", "mxfp8", "nvfp4", "fp8_block1x128"):
        a, b = lb.quantize(x, lb.get_preset(name)), lb.quantize(x.float(), lb.get_preset(name))
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale), name


def test_non_contiguous_and_numpy_inputs(rng, device):
    x = torch.randn(64, 48, generator=rng).to(device)
    xt = x.t()  # [48, 64] view, not contiguous
    assert not xt.is_contiguous()
    for name in ("int8_channel", "mxfp4", "int4_g128_asym"):
        s = lb.get_preset(name)
        if s.strategy == "group" and 64 % s.group_size:
            s = QuantScheme(s.format, "group", group_size=32, symmetric=s.symmetric)
        a, b = lb.quantize(xt, s), lb.quantize(xt.contiguous(), s)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    n = lb.quantize(x.cpu().numpy(), lb.get_preset("int8_channel"))
    assert torch.equal(n.codes, lb.quantize(x.cpu(), lb.get_preset("int8_channel")).codes)


def test_nan_and_inf_are_reported(rng):
    x = torch.randn(4, 64, generator=rng)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    x[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"3 non-finite value\(s\) \(2 NaN, 1 Inf\); first at index \(1, 7\)"):
        lb.quantize(x, lb.get_preset("int8_channel"))
    with pytest.raises(ValueError, match="needs an element format with a NaN code"):
        lb.quantize(x, lb.get_preset("int8_channel"), nan_policy="propagate")
    with pytest.raises(ValueError, match="needs an element format with a NaN code"):
        lb.quantize(x, lb.get_preset("mxfp4"), nan_policy="propagate")
    with pytest.raises(ValueError, match="nan_policy must be one of"):
        lb.quantize(x, lb.get_preset("mxfp8"), nan_policy="ignore")
    qt = lb.quantize(x, lb.get_preset("mxfp8"), nan_policy="propagate")
    fmt = lb.get_format("fp8_e4m3fn")
    bad_groups = {(1, 0), (2, 0), (3, 0)}
    for r in range(4):
        for gi in range(2):
            codes = qt.codes[r, 32 * gi:32 * gi + 32]
            if (r, gi) in bad_groups:
                assert qt.scale_codes[r, gi] == 0xFF and math.isnan(float(qt.scale[r, gi]))
                assert all(int(c) in fmt.nan_codes for c in codes)
            else:
                assert qt.scale_codes[r, gi] != 0xFF and not any(int(c) in fmt.nan_codes for c in codes)


@pytest.mark.parametrize("bad, exc, match", [
    (torch.zeros(4, 4, dtype=torch.int32), TypeError, "dtype torch.int32.*x.float"),
    (torch.zeros(4, 4, dtype=torch.bool), TypeError, "dtype torch.bool"),
    (torch.zeros(4, 4, dtype=torch.complex64), TypeError, "complex"),
    (np.zeros((4, 4), dtype=np.int64), TypeError, "floating array"),
    ([1.0, 2.0], TypeError, "torch.Tensor or numpy array"),
    (torch.tensor(3.0), ValueError, "0-d"),
    (torch.zeros(0, 32), ValueError, "empty"),
])
def test_bad_inputs(bad, exc, match):
    with pytest.raises(exc, match=match):
        lb.quantize(bad, lb.get_preset("int8_channel"))


def test_bad_scheme_argument_and_block_on_1d(rng):
    with pytest.raises(TypeError, match="scheme must be a QuantScheme"):
        lb.quantize(torch.randn(4, 4, generator=rng), "int8_channel")
    with pytest.raises(ValueError, match="tiles the last two axes"):
        lb.quantize(torch.randn(256, generator=rng), lb.get_preset("fp8_block1x128"))


def test_asymmetric_range_overflow_is_an_error():
    x = torch.tensor([[3e38, -3e38, 1.0, 0.0]])
    with pytest.raises(ValueError, match="overflows float32.*symmetric=True"):
        lb.quantize(x, QuantScheme("int8", "channel", symmetric=False))


def test_1d_and_3d_shapes(rng):
    v = torch.randn(96, generator=rng)
    qt = lb.quantize(v, lb.get_preset("mxfp8"))
    assert qt.scale.shape == (3,) and qt.dequantize().shape == (96,)
    x = torch.randn(2, 5, 64, generator=rng)
    qt = lb.quantize(x, QuantScheme("fp8_e4m3fn", "block", block_size=(2, 32)))
    assert qt.scale.shape == (2, 3, 2) and qt.expanded_scale().shape == (2, 5, 64)
    ref = lb.quantize(x[1], QuantScheme("fp8_e4m3fn", "block", block_size=(2, 32)))
    assert torch.equal(qt.codes[1], ref.codes) and torch.equal(qt.scale[1], ref.scale)


def test_dequantize_float64_is_exact_product(rng, device):
    x = torch.randn(8, 64, generator=rng).to(device)
    for name in ("int4_g128_asym", "nvfp4", "mxfp6_e3m2"):
        s = lb.get_preset(name)
        qt = lb.quantize(x, s, pad=True)
        dec = lb.decode(qt.codes, s.fmt).double()
        z = qt.expanded_zero_point()
        if z is not None:
            dec = dec - z.double()
        ref = (dec * qt.expanded_scale().double())[:, :64]
        assert torch.equal(qt.dequantize(torch.float64), ref)
        assert qt.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_two_level_effective_scale(rng):
    x = torch.randn(16, 64, generator=rng) * 5
    qt = lb.quantize(x, lb.get_preset("nvfp4"))
    g = float(x.abs().max()) / (448 * 6)
    assert qt.global_scale.ndim == 0 and math.isclose(float(qt.global_scale), g, rel_tol=2 ** -23)
    eff = lb.decode(qt.scale_codes, "fp8_e4m3fn") * qt.global_scale
    assert torch.equal(qt.scale, eff.float())


def test_helpers_and_repr(rng):
    x = torch.randn(4, 64, generator=rng)
    s = QuantScheme("int8", "group", group_size=16)
    amax = reduce_amax(x, s)
    assert torch.equal(amax, x.abs().reshape(4, 4, 16).amax(-1))
    assert expand_scale(amax, s, (4, 64)).shape == (4, 64)
    qt = lb.quantize(x, s)
    assert isinstance(qt, QTensor) and "int8 group16" in repr(qt)
    assert torch.equal(lb.dequantize(qt), qt.dequantize())


def test_demo_numbers_and_output(capsys, seed):
    import argparse

    from lowbit.entrypoints import demo
    w = demo.gain_spread_weight(64, 256, seed=seed)
    rows = {r["scheme"]: r for r in demo.compare(w)}
    quiet = rows["per-tensor"]["quiet_row"]
    wn = w.numpy().astype(np.float32)
    # independent count: one scale for the tensor vs one for the quiet row, numpy half-even rounding
    s_t = np.float32(np.abs(wn).max() / np.float32(127))
    s_r = np.float32(np.abs(wn[quiet]).max() / np.float32(127))
    assert rows["per-tensor"]["codes_used"] == len(np.unique(np.clip(np.rint(wn[quiet] / s_t), -127, 127)))
    assert rows["per-channel"]["codes_used"] == len(np.unique(np.clip(np.rint(wn[quiet] / s_r), -127, 127)))
    assert rows["per-tensor"]["codes_used"] < rows["per-channel"]["codes_used"] < rows["per-group 32"]["codes_used"]
    assert rows["per-tensor"]["rel_l2"] > rows["per-channel"]["rel_l2"] > rows["per-group 32"]["rel_l2"]
    demo.run(argparse.Namespace(png=None))
    out = capsys.readouterr().out
    assert "fp8_e4m3fn" in out and "of 255" in out and "per-channel" in out


def test_static_scales_clamp_after_rounding(rng, device):
    """The stale-scale pitfall: a calibrated scale smaller than today's amax / 127 puts x / s at or
    beyond 127.5; rounding gives 128, which must clamp to 127 and never wrap to -128."""
    from lowbit.quantize import Scales, compute_scale

    scheme = QuantScheme("int8", "tensor")
    calib = compute_scale(torch.tensor([[2.0]], device=device), scheme)  # s = 2/127
    s = float(calib.scale)
    x = torch.tensor([[127.5 * s, -127.5 * s, 300 * s, 126.5 * s, 0.3 * s]], device=device)
    qt = lb.quantize(x, scheme, scales=calib)
    assert qt.codes.cpu().tolist() == [[127, -127, 127, 126, 0]]  # 126.5 -> 126: half to even
    # the same through the numpy formulation of the canonical rule
    ref = np.clip(np.rint(x.cpu().numpy() / np.float32(s)), -127, 127)
    assert qt.codes.cpu().tolist() == ref.astype(int).tolist()
    with pytest.raises(ValueError, match="shape \\(1, 1\\).*needs \\(3, 1\\)"):
        lb.quantize(torch.randn(3, 8, device=device), QuantScheme("int8", "channel"), scales=calib)
    with pytest.raises(ValueError, match="zero_point must be given"):
        lb.quantize(x, QuantScheme("int8", "tensor", symmetric=False), scales=calib)
    with pytest.raises(TypeError, match="Scales"):
        lb.quantize(x, scheme, scales=torch.ones(1, 1))
    bad = Scales(torch.zeros(1, 1, device=device), None, None, None)
    with pytest.raises(ValueError, match="finite and > 0"):
        lb.quantize(x, scheme, scales=bad)
