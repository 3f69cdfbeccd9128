"""The native kernels' weight layouts (lowbit.ops.native.layout): exact round trips on odd shapes, and
each layout's element positions checked against its docstring's formula element by element."""
import torch

from lowbit.ops.native.layout import (arrange_groups, arrange_w4, arrange_w8, unarrange_groups, unarrange_w4,
                                      unarrange_w8)

SHAPES = [(1, 64), (37, 96), (16, 32), (45, 200), (33, 1000)]


def test_w4_round_trip_odd_shapes():
    for N, K in SHAPES:
        codes = torch.randint(-8, 8, (N, K), dtype=torch.int8)
        packed = arrange_w4(codes)
        assert packed.dtype == torch.uint8 and packed.shape == (-(-N // 16), -(-K // 64), 32, 16)
        assert torch.equal(unarrange_w4(packed, N, K), codes)


def test_w8_round_trip_odd_shapes():
    for N, K in SHAPES:
        codes = torch.randint(-128, 128, (N, K), dtype=torch.int8)
        packed = arrange_w8(codes)
        assert packed.shape == (-(-N // 16), -(-K // 32), 32, 16)
        assert torch.equal(unarrange_w8(packed, N, K).view(torch.int8), codes)


def test_groups_round_trip():
    t = torch.randn(37, 5)
    a = arrange_groups(t, 3)
    assert a.shape == (3, 5, 16) and torch.equal(unarrange_groups(a, 37), t)
    assert torch.equal(a[2, :, 5:], torch.zeros(5, 11))   # padded rows hold 0


def test_w4_positions_follow_the_docstring():
    N, K = 35, 192
    codes = torch.randint(-8, 8, (N, K), dtype=torch.int8)
    words = arrange_w4(codes).view(torch.int32)            # [N16, K64, 32 lanes, 4 words] little-endian
    for _ in range(300):
        nt, kt = torch.randint(0, 3, ()).item(), torch.randint(0, 3, ()).item()
        lane, j, r, h = (torch.randint(0, n, ()).item() for n in (32, 4, 4, 2))
        g, t = lane // 4, lane % 4
        n, k = 16 * nt + g + 8 * (r % 2), 64 * kt + 16 * j + 4 * t + 2 * (r // 2) + h
        nib = (int(words[nt, kt, lane, j]) >> (4 * (r + 4 * h))) & 15
        assert nib == (int(codes[n, k]) + 8 if n < N else 8)   # padding rows hold code 0


def test_w8_positions_follow_the_docstring():
    N, K = 21, 96
    codes = torch.randint(0, 256, (N, K), dtype=torch.uint8)
    b = arrange_w8(codes)                                   # [N16, K32, 32, 16]
    for _ in range(300):
        nt, kt, lane, word, y = (torch.randint(0, n, ()).item() for n in (2, 3, 32, 4, 4))
        g, t = lane // 4, lane % 4
        n, k = 16 * nt + g + 8 * (word % 2), 32 * kt + 8 * t + 4 * (word // 2) + y
        assert int(b[nt, kt, lane, 4 * word + y]) == (int(codes[n, k]) if n < N else 0)
