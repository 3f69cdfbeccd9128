"""lowbit.formats.grid.nearest against decode(encode(x, saturate=True)), bit for bit (the sign of
zero included), for every float format of <= 8 bits it applies to. nearest is piecewise constant
between the decision boundaries, so the points that can differ are the boundaries themselves: each
midpoint of two neighbouring values (exact in float32), the float32 just above and just below it,
and every grid value are checked, with +-0, +-inf, values far beyond the range, and fresh random
values of every magnitude (random float32 bit patterns) and of the format's range.

grid.nearest_code (lowbit.quantize's element step for these formats) against encode(saturate=True):
its result depends only on the sign bit, the key (exponent and top 4 fraction bits) and whether the
low 19 fraction bits are 0, so every (sign, key) pair with low bits 0, 1, all ones and a fresh random
value covers every float32, NaN and inf included; then lowbit.quantize's codes against encode of the
same scaled values for every float preset (NVFP4's fp8 block scales are checked against torchao in
tests/core/test_mx_torchao.py)."""
import math

import pytest
import torch

from lowbit.formats import decode, encode, get_format, grid, list_formats
from lowbit.scheme import PRESETS, QuantScheme, get_preset

FORMATS = [n for n in list_formats() if grid.supported(n)]


def test_formats_covered():
    # every <= 8-bit float element format lowbit has (e8m0 is a scale format: ties upward, no sign)
    assert set(FORMATS) == {n for n in list_formats() if get_format(n).kind == "float"
                            and get_format(n).bits <= 8 and n != "e8m0fnu"}


@pytest.mark.parametrize("name", FORMATS)
def test_nearest_is_decode_of_encode(rng, name):
    f = get_format(name)
    vals = sorted({abs(float(v)) for v in f.spec.table.tolist() if math.isfinite(v)})
    mids = torch.tensor([(a + b) / 2 for a, b in zip(vals, vals[1:])], dtype=torch.float32)
    assert torch.equal(mids.double(), torch.tensor([(a + b) / 2 for a, b in zip(vals, vals[1:])],
                                                   dtype=torch.float64))    # the midpoints are float32s
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    bits = torch.randint(-2**31, 2**31 - 1, (50_000,), generator=rng, dtype=torch.int32).view(torch.float32)
    pts = torch.cat([mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                     torch.tensor(vals, dtype=torch.float32),
                     torch.tensor([0.0, math.inf, 3.0e38, 2.0 * f.max, f.max * (1 + 2.0 ** -20)]),
                     bits[~torch.isnan(bits)],
                     torch.randn(50_000, generator=rng) * (f.max / 3)])
    pts = torch.cat([pts, -pts])
    want = decode(encode(pts.double(), f, saturate=True), f)
    got = grid.nearest(pts, f)
    bad = want.view(torch.int32) != got.view(torch.int32)
    assert not bool(bad.any()), f"{int(bad.sum())} differ, e.g. x={pts[bad][:4].tolist()}: " \
                                f"{got[bad][:4].tolist()} != {want[bad][:4].tolist()}"


@pytest.mark.parametrize("name", FORMATS)
def test_nearest_code_is_encode_on_every_key(rng, name):
    f = get_format(name)
    keys = torch.arange(1 << (31 - grid.LOW_BITS), dtype=torch.int32)
    low = 1 << grid.LOW_BITS
    lows = [torch.zeros_like(keys), torch.ones_like(keys), torch.full_like(keys, low - 1),
            torch.randint(1, low, keys.shape, generator=rng, dtype=torch.int32)]
    bits = torch.cat([(keys << grid.LOW_BITS) | lo for lo in lows])
    x = torch.cat([bits, bits | torch.tensor(-2**31, dtype=torch.int32)]).view(torch.float32)
    if f.spec._nan_magcode is None:       # no NaN code: encode refuses NaN, so does nearest_code
        with pytest.raises(ValueError, match="no NaN"):
            grid.nearest_code(x, f)
        x = x[~torch.isnan(x)]
    want = encode(x.double(), f, saturate=True)
    got = grid.nearest_code(x, f)
    assert got.dtype == torch.uint8 and got.shape == x.shape
    bad = want != got
    assert not bool(bad.any()), f"{int(bad.sum())} differ, e.g. bits {x[bad][:4].view(torch.int32).tolist()}: " \
                                f"{got[bad][:4].tolist()} != {want[bad][:4].tolist()}"
    # nearest() is decode(nearest_code()) on every non-NaN input
    fin = ~torch.isnan(x)
    assert torch.equal(grid.nearest(x[fin], f).view(torch.int32), decode(got[fin], f).view(torch.int32))


SCHEMES = [*(get_preset(n) for n in PRESETS if get_preset(n).fmt.kind == "float"),
           QuantScheme("fp8_e5m2", "group", group_size=16), QuantScheme("fp8_e4m3fnuz", "channel"),
           QuantScheme("fp8_e5m2fnuz", "token", dynamic=True)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_quantize_codes_are_encode_of_the_scaled_values(rng, scheme, monkeypatch):
    import lowbit as lb
    from lowbit.quantize import expand_scale
    calls = []
    real = grid.nearest_code
    monkeypatch.setattr(grid, "nearest_code", lambda x, f: calls.append(f) or real(x, f))
    width = scheme.block_size[1] if scheme.strategy == "block" else (scheme.group_size or 32)
    rows, k = 37, 2 * width + 5                               # a short last group / block
    x = torch.randn(rows, k, generator=rng) * torch.exp(4 * torch.randn(rows, 1, generator=rng))
    x[0, :3] = torch.tensor([0.0, -0.0, -1e-30])              # zeros of both signs and an underflow
    qt = lb.quantize(x, scheme, pad=True)
    xp = torch.nn.functional.pad(x, (0, qt.codes.shape[-1] - k))
    scaled = xp / expand_scale(qt.scale, scheme, tuple(xp.shape))
    assert torch.equal(qt.codes, encode(scaled.double(), scheme.fmt, saturate=True))
    assert scheme.fmt in calls                                # the element step took the table path


def test_bad_input():
    with pytest.raises(ValueError, match="int8 is not a float format"):
        grid.nearest(torch.ones(3), "int8")
    with pytest.raises(ValueError, match="e8m0fnu"):
        grid.nearest(torch.ones(3), "e8m0fnu")
    with pytest.raises(TypeError, match="must be float32"):
        grid.nearest(torch.ones(3, dtype=torch.float64), "fp8_e4m3fn")
    with pytest.raises(ValueError, match="int8 is not a float format"):
        grid.nearest_code(torch.ones(3), "int8")
    with pytest.raises(TypeError, match="must be float32"):
        grid.nearest_code(torch.ones(3, dtype=torch.bfloat16), "fp4_e2m1fn")
