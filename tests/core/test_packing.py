"""Packing: nibbles and fp6 against hand-written bit arithmetic and torchao's pack_uint4;
scale layouts against the SFA word formula and torchao's to_blocked (>= 2 word groups)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as lb
from lowbit.packing import (pack_fp4, pack_fp6, pack_int4, pack_scales, pack_uint4, unpack_fp4, unpack_fp6,
                            unpack_int4, unpack_scales, unpack_uint4)


def test_int4_nibble_order_and_sign_by_hand():
    codes = torch.tensor([[-1, 7, -8, 0, 3, -3]], dtype=torch.int8)
    packed = pack_int4(codes)
    # element 0 in the low nibble: -1 -> 0xF, 7 -> 0x7 => 0x7F; -8 -> 0x8, 0 => 0x08; 3, -3 (0xD) => 0xD3
    assert packed.tolist() == [[0x7F, 0x08, 0xD3]]
    assert torch.equal(unpack_int4(packed), codes)
    assert unpack_int4(packed, signed=False).tolist() == [[15, 7, 8, 0, 3, 13]]  # logical decode differs


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(1, 41), st.booleans(), st.integers(0, 2**31 - 1))
def test_int4_and_uint4_round_trip(rows, k, signed, seed):
    g = torch.Generator().manual_seed(seed)
    if signed:
        codes = torch.randint(-8, 8, (rows, k), generator=g, dtype=torch.int8)
    else:
        codes = torch.randint(0, 16, (rows, k), generator=g, dtype=torch.uint8)
    packed = pack_int4(codes, pad=True)
    assert packed.shape == (rows, (k + 1) // 2) and packed.dtype == torch.uint8
    back = unpack_int4(packed, signed=signed, k=k)
    assert torch.equal(back, codes)
    # independent formulation: byte j = (c[2j] & 15) | (c[2j+1] & 15) << 4, with Python ints
    flat = [int(v) & 0xF for v in codes.reshape(rows, k).flatten().tolist()]
    for r in range(rows):
        row = flat[r * k:(r + 1) * k] + ([0] if k % 2 else [])
        assert packed[r].tolist() == [row[2 * j] | (row[2 * j + 1] << 4) for j in range(len(row) // 2)]


def test_fp4_packing_matches_torchao(rng, device):
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    x = torch.randn(6, 64, generator=rng)
    qt = lb.quantize(x.to(device), lb.get_preset("mxfp4"))
    packed = pack_fp4(qt.codes)
    assert torch.equal(packed.cpu(), kernels.pack_uint4(qt.codes.cpu()))
    assert torch.equal(unpack_fp4(packed), qt.codes)
    assert torch.equal(pack_uint4(qt.codes), packed) and torch.equal(unpack_uint4(packed), qt.codes)


def test_int4_quantized_codes_round_trip(rng, device):
    x = torch.randn(5, 256, generator=rng).to(device)
    qt = lb.quantize(x, lb.get_preset("int4_g128"))
    assert torch.equal(lb.unpack_int4(lb.pack_int4(qt.codes)), qt.codes)


def test_4bit_errors():
    with pytest.raises(ValueError, match="last dim \\(5\\) must be a multiple of 2.*pad=True"):
        pack_int4(torch.zeros(2, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match="must lie in \\[-8, 7\\], found \\[-9, 0\\]"):
        pack_int4(torch.tensor([[-9, 0]], dtype=torch.int8))
    with pytest.raises(ValueError, match="must lie in \\[0, 15\\]"):
        pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8))
    with pytest.raises(TypeError, match="int8 .* or uint8"):
        pack_int4(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="uint8"):
        pack_fp4(torch.zeros(2, 4, dtype=torch.int8))
    with pytest.raises(TypeError, match="packed must be uint8"):
        unpack_int4(torch.zeros(2, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="k=9 is outside"):
        unpack_int4(torch.zeros(2, 4, dtype=torch.uint8), k=9)
    with pytest.raises(ValueError, match="0-d"):
        pack_int4(torch.tensor(3, dtype=torch.int8))


def test_fp6_bit_order_by_hand():
    codes = torch.tensor([[0b000001, 0b000010, 0b000011, 0b111111]], dtype=torch.uint8)
    # 24-bit word = v0 | v1 << 6 | v2 << 12 | v3 << 18 = 1 + 128 + 12288 + 16515072 = 0xFC3081
    assert pack_fp6(codes).tolist() == [[0x81, 0x30, 0xFC]]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 30), st.integers(0, 2**31 - 1))
def test_fp6_round_trip_and_bit_stream(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (rows, k), generator=g, dtype=torch.uint8)
    packed = pack_fp6(codes, pad=True)
    k4 = -(-k // 4) * 4
    assert packed.shape == (rows, 3 * k4 // 4)
    assert torch.equal(unpack_fp6(packed, k=k), codes)
    # independent formulation: a big integer bit stream, 6 bits per value, LSB first
    for r in range(rows):
        stream = sum(int(v) << (6 * i) for i, v in enumerate(codes[r].tolist()))
        assert packed[r].tolist() == [(stream >> (8 * j)) & 0xFF for j in range(packed.shape[1])]


def test_fp6_quantized_codes_and_errors(rng):
    qt = lb.quantize(torch.randn(3, 64, generator=rng), lb.get_preset("mxfp6_e2m3"))
    assert torch.equal(unpack_fp6(pack_fp6(qt.codes)), qt.codes)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_fp6(torch.zeros(1, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="\\[0, 63\\]"):
        pack_fp6(torch.full((1, 4), 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 3 bytes"):
        unpack_fp6(torch.zeros(1, 4, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# scale layouts
# ---------------------------------------------------------------------------------------------
def _scale_codes(rng, rows, n):
    return torch.randint(100, 160, (rows, n), generator=rng, dtype=torch.uint8)


@pytest.mark.parametrize("rows,n", [(5, 8), (3, 12), (17, 16)])  # 2, 3 and 4 word groups
def test_group_major_words_match_seed_formula(rng, device, rows, n):
    codes = _scale_codes(rng, rows, n).to(device)
    words = pack_scales(codes, "group_major")
    assert words.dtype == torch.uint32 and words.shape == (n // 4, rows)
    flat = words.reshape(-1).cpu().to(torch.int64).tolist()
    c = codes.cpu().tolist()
    for g in range(n // 4):
        for m in range(rows):
            b0, b1, b2, b3 = c[m][4 * g:4 * g + 4]
            assert flat[g * rows + m] == b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    assert torch.equal(unpack_scales(words, "group_major", rows, n), codes)
    # with >= 2 word groups, group-major differs from row-major words (the one-word pitfall)
    row_major_words = codes.cpu().contiguous().view(torch.int32).reshape(-1)  # little-endian bytes
    assert not torch.equal(words.cpu().reshape(-1).to(torch.int64), row_major_words.to(torch.int64) & 0xFFFFFFFF)


def test_group_major_pad_and_errors(rng):
    codes = _scale_codes(rng, 4, 6)
    with pytest.raises(ValueError, match="multiple of 4.*pad=True"):
        pack_scales(codes, "group_major")
    words = pack_scales(codes, "group_major", pad=True)
    assert words.shape == (2, 4)
    assert torch.equal(unpack_scales(words, "group_major", 4, 6), codes)
    with pytest.raises(ValueError, match="expected uint32 \\[2, 5\\]"):
        unpack_scales(words, "group_major", 5, 6)
    with pytest.raises(ValueError, match="2-D uint8"):
        pack_scales(codes.to(torch.int32), "group_major")
    with pytest.raises(ValueError, match="layout must be one of"):
        pack_scales(codes, "column_major")


def test_row_major_is_plain_bytes(rng):
    codes = _scale_codes(rng, 7, 9)
    assert torch.equal(pack_scales(codes, "row_major"), codes)
    assert torch.equal(unpack_scales(pack_scales(codes, "row_major"), "row_major", 7, 9), codes)


@pytest.mark.parametrize("rows,n", [(5, 8), (130, 12), (256, 4), (129, 9)])
def test_blocked_matches_torchao_to_blocked(rng, device, rows, n):
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    codes = _scale_codes(rng, rows, n).to(device)
    ours = pack_scales(codes, "blocked")
    assert torch.equal(ours.cpu(), utils.to_blocked(codes.cpu()))
    assert torch.equal(unpack_scales(ours, "blocked", rows, n), codes)
    assert torch.equal(utils.from_blocked(ours.cpu(), rows, n), codes.cpu())
    with pytest.raises(ValueError, match="blocked"):
        unpack_scales(ours[:-1], "blocked", rows, n)


def test_blocked_layout_of_real_mx_and_nvfp4_scales(rng):
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    x = torch.randn(200, 512, generator=rng)
    for name in ("mxfp8", "nvfp4"):
        qt = lb.quantize(x, lb.get_preset(name))
        assert torch.equal(lb.pack_scales(qt.scale_codes, layout="blocked"), utils.to_blocked(qt.scale_codes))
        assert torch.equal(lb.unpack_scales(lb.pack_scales(qt.scale_codes, layout="group_major"), "group_major",
                                            *qt.scale_codes.shape), qt.scale_codes)
