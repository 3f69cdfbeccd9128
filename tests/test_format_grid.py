"""lowbit.formats.grid.nearest against decode(encode(x, saturate=True)), bit for bit (the sign of
zero included), for every float format of <= 8 bits it applies to. nearest is piecewise constant
between the decision boundaries, so the points that can differ are the boundaries themselves: each
midpoint of two neighbouring values (exact in float32), the float32 just above and just below it,
and every grid value are checked, with +-0, +-inf, values far beyond the range, and fresh random
values of every magnitude (random float32 bit patterns) and of the format's range."""
import math

import pytest
import torch

from lowbit.formats import decode, encode, get_format, grid, list_formats

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


def test_bad_input():
    with pytest.raises(ValueError, match="int8 is not a float format"):
        grid.nearest(torch.ones(3), "int8")
    with pytest.raises(ValueError, match="e8m0fnu"):
        grid.nearest(torch.ones(3), "e8m0fnu")
    with pytest.raises(TypeError, match="must be float32"):
        grid.nearest(torch.ones(3, dtype=torch.float64), "fp8_e4m3fn")
