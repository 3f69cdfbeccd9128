"""Bit packing of quantized codes and MX / NVFP4 scale layouts. Pure torch, CPU and CUDA.

Element packing (always along the LAST axis, element 0 in the least significant bits):
- 4-bit (int4, uint4, fp4_e2m1fn codes): two per byte, element 2j in the LOW nibble and
  2j+1 in the HIGH nibble (torchao's pack_uint4, TileLang's int4 example). Signed int4 is
  stored as its 4-bit two's complement and decoded by an arithmetic shift
  ((b << 4) >> 4 on int8), so -1 comes back as -1, not 15 (a logical shift is the classic bug).
- 6-bit (fp6 codes): four per three bytes as a little-endian bit stream: element i of a
  group of four occupies bits 6i .. 6i+5 of the 24-bit word b0 | b1 << 8 | b2 << 16, i.e.
    b0 = v0 | v1 << 6,  b1 = v1 >> 2 | v2 << 4,  b2 = v2 >> 4 | v3 << 2   (each & 0xFF).
  The OCP MX spec leaves fp6 packing to implementations; this is the plain LSB-first order,
  consistent with the nibble rule above.
An odd (4-bit) or non-multiple-of-4 (6-bit) last dim is an error unless pad=True, which
appends zero codes; unpack takes `k` to crop them again.

Scale layouts for [rows, n_scales] uint8 scale codes (e8m0 for MX, e4m3 for NVFP4):
- "row_major":   the bytes as they are, [rows, n_scales].
- "group_major": uint32 words as Blackwell's SFA / SFB read them: word (g, m) = b0 | b1 << 8 | b2 << 16 |
  b3 << 24 with b_j = codes[m, 4g + j]; returned as [n_scales / 4, rows] so that the flat
  word index is g * rows + m (SFA[g * M + m]). With n_scales <= 4 there is one word group
  and this coincides with row-major words, which is why tests use >= 2 groups.
- "blocked":     the 128x4 swizzle cuBLAS and torchao use for MX and NVFP4 scales
  (torchao.prototype.mx_formats.utils.to_blocked): rows padded to 128 and columns to 4 with
  zero bytes, each 128x4 tile stored as 32x16 with element (r, c) of the tile at
  [r % 32, (r // 32) * 4 + c]; tiles in row-block-major order. Returned flat, length
  ceil(rows/128) * 128 * ceil(n_scales/4) * 4.
"""
from __future__ import annotations

import torch

SCALE_LAYOUTS = ("row_major", "group_major", "blocked")


def _pad_last(x: torch.Tensor, multiple: int, pad: bool, what: str) -> torch.Tensor:
    extra = (-x.shape[-1]) % multiple
    if extra == 0:
        return x
    if not pad:
        raise ValueError(f"{what}: the last dim ({x.shape[-1]}) must be a multiple of {multiple}; "
                         f"pass pad=True to append {extra} zero code(s) (and k={x.shape[-1]} when unpacking)")
    return torch.nn.functional.pad(x, (0, extra))


def _check_codes(codes: torch.Tensor, what: str) -> None:
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{what}: codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.ndim == 0:
        raise ValueError(f"{what}: codes is 0-d; packing works along the last axis")


def _crop(out: torch.Tensor, k: int | None, what: str) -> torch.Tensor:
    if k is None:
        return out
    if not 0 <= k <= out.shape[-1]:
        raise ValueError(f"{what}: k={k} is outside [0, {out.shape[-1]}] (the unpacked last dim)")
    return out[..., :k]


# ------------------------------------------------------------------------------------------
# 4-bit
# ------------------------------------------------------------------------------------------
def pack_int4(codes: torch.Tensor, *, pad: bool = False) -> torch.Tensor:
    """Pack 4-bit codes two per byte (low nibble first) along the last axis.

    codes: int8 with values in [-8, 7] (signed int4) or uint8 in [0, 15] (uint4 / fp4 bit
    patterns), shape [..., K]. Returns uint8 [..., ceil(K / 2)] (K odd needs pad=True).
    Out-of-range values are an error, never silently truncated."""
    _check_codes(codes, "pack_int4")
    if codes.dtype == torch.int8:
        lo, hi = -8, 7
    elif codes.dtype == torch.uint8:
        lo, hi = 0, 15
    else:
        raise TypeError(f"pack_int4: codes must be int8 (signed int4 values) or uint8 (uint4 / fp4 codes), "
                        f"got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise ValueError(f"pack_int4: {codes.dtype} codes must lie in [{lo}, {hi}], found "
                         f"[{int(codes.min())}, {int(codes.max())}]; these are not 4-bit codes")
    c = _pad_last(codes, 2, pad, "pack_int4")
    u = (c.to(torch.int16) & 0xF).to(torch.uint8)  # two's complement nibble for signed values
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, *, signed: bool = True, k: int | None = None) -> torch.Tensor:
    """Inverse of pack_int4. packed: uint8 [..., K2]. Returns int8 in [-8, 7] (signed, by
    arithmetic shift) or uint8 in [0, 15], shape [..., 2 * K2] cropped to k if given."""
    _check_codes(packed, "unpack_int4")
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4: packed must be uint8 (from pack_int4), got {packed.dtype}")
    if signed:
        s = packed.view(torch.int8)
        lo = (s << 4) >> 4   # sign-extend the low nibble: int8 >> is arithmetic
        hi = s >> 4          # the high nibble is already at the top: arithmetic shift extends it
    else:
        lo, hi = packed & 0xF, packed >> 4
    out = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return _crop(out, k, "unpack_int4")


def pack_uint4(codes: torch.Tensor, *, pad: bool = False) -> torch.Tensor:
    """pack_int4 for uint8 codes in [0, 15] (uint4 values)."""
    if isinstance(codes, torch.Tensor) and codes.dtype != torch.uint8:
        raise TypeError(f"pack_uint4: codes must be uint8 in [0, 15], got {codes.dtype}")
    return pack_int4(codes, pad=pad)


def unpack_uint4(packed: torch.Tensor, *, k: int | None = None) -> torch.Tensor:
    return unpack_int4(packed, signed=False, k=k)


def pack_fp4(codes: torch.Tensor, *, pad: bool = False) -> torch.Tensor:
    """Pack fp4_e2m1fn bit patterns (uint8 in [0, 15]) two per byte, low nibble first."""
    if isinstance(codes, torch.Tensor) and codes.dtype != torch.uint8:
        raise TypeError(f"pack_fp4: codes must be uint8 fp4 bit patterns, got {codes.dtype}")
    return pack_int4(codes, pad=pad)


def unpack_fp4(packed: torch.Tensor, *, k: int | None = None) -> torch.Tensor:
    return unpack_int4(packed, signed=False, k=k)


# ------------------------------------------------------------------------------------------
# 6-bit
# ------------------------------------------------------------------------------------------
def pack_fp6(codes: torch.Tensor, *, pad: bool = False) -> torch.Tensor:
    """Pack 6-bit codes (uint8 in [0, 63]) four per three bytes, LSB-first bit stream (see
    module docstring). codes [..., K] with K % 4 == 0 (or pad=True); returns uint8 [..., 3K/4]."""
    _check_codes(codes, "pack_fp6")
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_fp6: codes must be uint8 6-bit patterns, got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 63:
        raise ValueError(f"pack_fp6: codes must lie in [0, 63], found max {int(codes.max())}")
    c = _pad_last(codes, 4, pad, "pack_fp6").to(torch.int32)
    v = c.reshape(*c.shape[:-1], c.shape[-1] // 4, 4)
    word = v[..., 0] | (v[..., 1] << 6) | (v[..., 2] << 12) | (v[..., 3] << 18)
    b = torch.stack((word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF), dim=-1)
    return b.to(torch.uint8).reshape(*c.shape[:-1], 3 * (c.shape[-1] // 4))


def unpack_fp6(packed: torch.Tensor, *, k: int | None = None) -> torch.Tensor:
    """Inverse of pack_fp6: uint8 [..., 3n] -> uint8 codes [..., 4n] (cropped to k if given)."""
    _check_codes(packed, "unpack_fp6")
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp6: packed must be uint8 (from pack_fp6), got {packed.dtype}")
    if packed.shape[-1] % 3:
        raise ValueError(f"unpack_fp6: the last dim ({packed.shape[-1]}) must be a multiple of 3 bytes")
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], packed.shape[-1] // 3, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    v = torch.stack([(word >> (6 * i)) & 0x3F for i in range(4)], dim=-1)
    out = v.to(torch.uint8).reshape(*packed.shape[:-1], 4 * (packed.shape[-1] // 3))
    return _crop(out, k, "unpack_fp6")


# ------------------------------------------------------------------------------------------
# Scale layouts
# ------------------------------------------------------------------------------------------
def _check_scale_codes(codes: torch.Tensor, what: str) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.ndim != 2:
        got = f"{codes.dtype} with shape {tuple(codes.shape)}" if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise ValueError(f"{what}: scale codes must be a 2-D uint8 tensor [rows, n_scales] "
                         f"(e.g. qt.scale_codes reshaped to 2-D), got {got}")


def pack_scales(codes: torch.Tensor, layout: str = "group_major", *, pad: bool = False) -> torch.Tensor:
    """Lay out [rows, n_scales] uint8 scale codes for a kernel (see module docstring).

    group_major: uint32 [n_scales / 4, rows] (n_scales % 4 == 0, or pad=True adds zero bytes);
    row_major: uint8 [rows, n_scales]; blocked: flat uint8 (torchao to_blocked)."""
    _check_scale_codes(codes, "pack_scales")
    rows, n = codes.shape
    if layout == "row_major":
        return codes.contiguous()
    if layout == "group_major":
        c = _pad_last(codes, 4, pad, "pack_scales(layout='group_major')").to(torch.int64)
        q = c.reshape(rows, -1, 4)
        words = q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)  # [rows, G4]
        return words.t().contiguous().to(torch.uint32)
    if layout == "blocked":
        rb, cb = -(-rows // 128), -(-n // 4)
        padded = torch.zeros((rb * 128, cb * 4), dtype=torch.uint8, device=codes.device)
        padded[:rows, :n] = codes
        # tile (i, j) = padded[128i:128i+128, 4j:4j+4]; within a tile row r -> (r % 32, r // 32)
        t = padded.reshape(rb, 4, 32, cb, 4).permute(0, 3, 2, 1, 4)  # [rb, cb, r%32, r//32, c]
        return t.reshape(-1).contiguous()
    raise ValueError(f"pack_scales: layout must be one of {SCALE_LAYOUTS}, got {layout!r}")


def unpack_scales(packed: torch.Tensor, layout: str, rows: int, n_scales: int) -> torch.Tensor:
    """Inverse of pack_scales: back to uint8 [rows, n_scales]. rows / n_scales are the
    unpadded sizes; the packed size must match them exactly."""
    if layout == "row_major":
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (rows, n_scales):
            raise ValueError(f"unpack_scales(row_major): expected uint8 [{rows}, {n_scales}], got "
                             f"{packed.dtype} {tuple(packed.shape)}")
        return packed.contiguous()
    if layout == "group_major":
        g4 = -(-n_scales // 4)
        if packed.dtype != torch.uint32 or tuple(packed.shape) != (g4, rows):
            raise ValueError(f"unpack_scales(group_major): expected uint32 [{g4}, {rows}] for "
                             f"{rows} x {n_scales} scales, got {packed.dtype} {tuple(packed.shape)}")
        w = packed.to(torch.int64).t()  # [rows, g4]
        b = torch.stack([(w >> (8 * j)) & 0xFF for j in range(4)], dim=-1)
        return b.reshape(rows, 4 * g4)[:, :n_scales].to(torch.uint8).contiguous()
    if layout == "blocked":
        rb, cb = -(-rows // 128), -(-n_scales // 4)
        if packed.dtype != torch.uint8 or packed.numel() != rb * cb * 512:
            raise ValueError(f"unpack_scales(blocked): expected {rb * cb * 512} uint8 values for "
                             f"{rows} x {n_scales} scales, got {packed.dtype} with {packed.numel()}")
        t = packed.reshape(rb, cb, 32, 4, 4).permute(0, 3, 2, 1, 4)  # [rb, r//32, r%32, cb, c]
        return t.reshape(rb * 128, cb * 4)[:rows, :n_scales].contiguous()
    raise ValueError(f"unpack_scales: layout must be one of {SCALE_LAYOUTS}, got {layout!r}")
