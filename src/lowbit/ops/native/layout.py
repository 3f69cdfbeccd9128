"""Weight layouts of lowbit's native decode kernels (csrc/decode_kernels.cu), made once at prepare time.

The kernels compute out^T = W x^T with the weight as the tensor-core instruction's A operand, one warp
per tile of 16 weight rows, each lane reading its 16 bytes of a tile with one 128-bit load, so a warp
reads 512 contiguous bytes (csrc/decode_math.h has the lane geometry). Lane l = 4g + t:

- "w4" (int4 codes, groups of G): tiles of 16 rows x 64 codes, [N16, K/64, 32 lanes, 16 bytes]. Word j
  (little-endian int32 j of the lane's 16 bytes) holds the codes of k16 step j: nibble r + 4h =
  code[16 nt + g + 8 (r % 2), 64 kt + 16 j + 4 t + 2 (r // 2) + h] + 8 (offset binary), for r < 4, h < 2,
  so a shift and a LOP3 put two codes into a bf16 pair. Scales float32 [N16, K/G, 16] and zero points
  int8 [N16, K/G, 16] (one 64-byte row per group and tile).
- "w8" (int8 or fp8 e4m3 codes, one scale per row): tiles of 16 rows x 32 codes, [N16, K/32, 32, 16]:
  the lane's words are (row g, k 8t..8t+3), (row g + 8, same k), (row g, k 8t+4..8t+7), (row g + 8, same).

Rows are padded to a multiple of 16 and K to the tile with code 0 (the kernels read no activation
past K, so padding never reaches an output). Each arrangement has an inverse; both are pure torch.
"""
from __future__ import annotations

import torch

W4_TILE_K, W8_TILE_K, TILE_N = 64, 32, 16


def _pad_codes(codes: torch.Tensor, tile_k: int) -> torch.Tensor:
    N, K = codes.shape
    return torch.nn.functional.pad(codes, (0, (-K) % tile_k, 0, (-N) % TILE_N))


def arrange_w4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (int8 tensor with values in -8..7) -> uint8 [N16, K64, 32, 16] (module docstring)."""
    c = (_pad_codes(codes.to(torch.int16), W4_TILE_K) + 8).to(torch.uint8)
    n16, k64 = c.shape[0] // TILE_N, c.shape[1] // W4_TILE_K
    # rows 16 nt + 8 a + g, k = 64 kt + 16 j + 4 t + 2 p + h; nibble a + 2 p + 4 h of word j of lane 4 g + t
    c = c.reshape(n16, 2, 8, k64, 4, 4, 2, 2).permute(0, 3, 2, 5, 4, 7, 6, 1)   # [nt, kt, g, t, j, h, p, a]
    nib = c.reshape(n16, k64, 8, 4, 4, 8)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).reshape(n16, k64, 32, 16).contiguous()


def unarrange_w4(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The inverse of arrange_w4: int8 codes [N, K]."""
    n16, k64 = packed.shape[:2]
    b = packed.reshape(n16, k64, 8, 4, 4, 4)
    nib = torch.stack([b & 15, b >> 4], dim=-1).reshape(n16, k64, 8, 4, 4, 2, 2, 2)
    c = nib.permute(0, 7, 2, 1, 4, 3, 6, 5).reshape(n16 * TILE_N, k64 * W4_TILE_K)
    return (c.to(torch.int16) - 8).to(torch.int8)[:N, :K].contiguous()


def arrange_groups(t: torch.Tensor, N16: int) -> torch.Tensor:
    """Per-group values [N, groups] (scales or zero points) -> [N16, groups, 16], rows padded with 0."""
    t = torch.nn.functional.pad(t, (0, 0, 0, N16 * TILE_N - t.shape[0]))
    return t.reshape(N16, TILE_N, -1).transpose(1, 2).contiguous()


def unarrange_groups(t: torch.Tensor, N: int) -> torch.Tensor:
    """The inverse of arrange_groups: [N, groups]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:N].contiguous()


def arrange_w8(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes [N, K] (int8 values or uint8 fp8 bit patterns) -> uint8 [N16, K32, 32, 16]."""
    c = _pad_codes(codes.view(torch.uint8), W8_TILE_K)
    n16, k32 = c.shape[0] // TILE_N, c.shape[1] // W8_TILE_K
    # rows 16 nt + 8 a + g, k = 32 kt + 8 t + 4 p + y; word a + 2 p of lane 4 g + t, byte y
    c = c.reshape(n16, 2, 8, k32, 4, 2, 4).permute(0, 3, 2, 4, 5, 1, 6)          # [nt, kt, g, t, p, a, y]
    return c.reshape(n16, k32, 32, 16).contiguous()


def unarrange_w8(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The inverse of arrange_w8: uint8 codes [N, K] (view as int8 for int8 weights)."""
    n16, k32 = packed.shape[:2]
    c = packed.reshape(n16, k32, 8, 4, 2, 2, 4).permute(0, 5, 2, 1, 3, 4, 6)
    return c.reshape(n16 * TILE_N, k32 * W8_TILE_K)[:N, :K].contiguous()
