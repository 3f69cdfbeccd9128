"""W4A16 weight layouts: how prepare_w4 lays a 4-bit weight [N, K] out for the kernels
(lowbit.ops.triton.w4a16), and the W4Weight that carries it (W4Weight.metadata() records it).

"planar_chunks": [N, K/2] uint8 in planar chunks of C codes along K (C = G for int4 from group 128
up, 2G below when 2G divides K -- each nibble plane then holds one group --, and 128 -- or the
largest power of two >= 32 dividing K -- for fp4): byte j of chunk c holds code cC + j in the low
nibble and code cC + C/2 + j in the high nibble, so each nibble plane multiplies a contiguous half
of x. Signed int4 codes are stored offset-binary (code + 8). This differs from lowbit.pack_int4's
interleaved order (which checkpoints use); W4Weight.qtensor keeps the source. Per-group scales
[N, K/G] float32 (int4) or scale codes [N, K/G] uint8 (fp4: e8m0 or e4m3); zero points narrowed to int8
(they lie in the 4-bit code range, so exactly).

"planar8", prepare_w4(wq, layout="planar8") (int4 / uint4 only): the same [N, K/2] bytes
read as little-endian int32 words [N, K/8]; word t of group c (G/8 words) holds code
c*G + p*(G/8) + t in nibble p (bits 4p..4p+3), int4 offset-binary. Kernels: "gemv8" (CUDA
cores, M <= 4: one lop3 + one FADD + one FFMA per weight) and "dot8" (tensor cores, M > 4,
G >= 128: one K = 16 dot per nibble plane of a group); pick_config_planar8 chooses. Both
are exact in the same sense as the planar_chunks kernels (exact weights and products,
float32 accumulation, one scale product per group), so the same error bound holds.

"pairs" (what prepare_w4's "auto" picks where it applies): little-endian int32 words [N, K/8] in
chunks of 128 codes, each word holding a pair of codes from each of the chunk's four 32-code
planes (pairs_bytes). `python -m lowbit.bench.memory` times the layouts side by side (rows
lowbit_w4a16_int4_g128, _gemv8, _dot8, _pairs_best).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.quantize import QTensor

MXFP4_MAX_SCALE_CODE = 240  # e8m0 2^113: the W4A16 kernel's scale * 2^14 stays finite (w4a16.codes._fp4_scaled)


@dataclass(frozen=True, eq=False)
class W4Weight:
    """A 4-bit weight [N, K] laid out for the W4A16 kernel (see module docstring)."""

    packed: torch.Tensor                 # uint8 [N, K // 2], planar chunks of `chunk` codes
    scale: torch.Tensor                  # float32 [N, K // G] effective scale (all kinds)
    zero_point: torch.Tensor | None      # int8 [N, K // G] or None
    scale_codes: torch.Tensor | None     # uint8 [N, K // G] (fp4 kinds) or None
    global_scale: torch.Tensor | None    # float32 [1] (NVFP4) or None
    kind: str                            # "int4" | "uint4" | "mxfp4" | "nvfp4"
    group_size: int
    chunk: int
    shape: tuple[int, int]
    qtensor: QTensor                     # the source, for references and checkpoints
    layout: str = "planar_chunks"        # or "planar8" (kernels "gemv8" / "dot8") or "pairs" (kernel "pairs")
    fp4_exp_offset: int | None = None    # MXFP4 "pairs": D of the folded block scales (pairs_fp4_exp_offset)

    def metadata(self) -> dict:
        """The layout the kernel expects, for checkpoints and reports."""
        nib = {"planar_chunks": "byte j of chunk c: low = code[c*chunk + j], high = code[c*chunk + chunk/2 + j]",
               "planar8": "little-endian int32 word t of chunk c: nibble p (bits 4p..4p+3) = code[c*chunk + p*chunk/8 + t]",
               "pairs": "little-endian int32 word w of chunk c (128 codes): nibble i = code[c*128 + 32i + 2P], "
                        "nibble i+4 = code[c*128 + 32i + 2P + 1], P = w2 + 2 w3 + 4 w0 + 8 w1 (bits of w)",
               }[self.layout]
        return {"kernel": "lowbit.w4a16", "kind": self.kind, "group_size": self.group_size,
                "layout": self.layout, "chunk": self.chunk, "nibbles": nib,
                "int4_storage": "offset binary (code + 8)" if self.kind == "int4" else "as is",
                "scales": "fp32[N,K/G]" if self.kind in ("int4", "uint4") else "uint8 codes[N,K/G]",
                "zero_point": "int8[N,K/G]" if self.zero_point is not None else None,
                "scheme": self.qtensor.scheme.to_dict()}


def pairs_fp4_exp_offset(packed: torch.Tensor, scale_codes: torch.Tensor) -> int | None:
    """D of an MXFP4 weight in the "pairs" layout (packed: its bytes [N, K/2]; scale_codes uint8
    [N, K/32]) for the pairs kernel's folded scales (lowbit.ops.triton.w4a16.pairs): the kernel
    multiplies each e2m1 pair by the bf16 K = 2^(E + D - 127), E the block's e8m0 code, which must
    be a normal bf16 whose products value * 2^(E + D - 253) are normal too: E + D <= 254 for every
    block, >= 128 for every block holding a nonzero code (all-zero blocks give 0 anyway); D <= 252
    keeps the epilogue's 2^(126 - D) a normal float32. None where no D fits (the nonzero blocks'
    scales span more than 2^126): the kernel then scales each block's float32 dot. Computed
    from the packed words, so weights merged along N (lowbit.nn.shared_input) get their own D."""
    if scale_codes is None or scale_codes.numel() == 0:
        return None
    N = packed.shape[0]
    words = packed.contiguous().view(torch.int32).reshape(N, -1, 16)      # [N, chunks, 16 words]
    # block 4c + i = plane i of chunk c: magnitude bits of nibbles i and i + 4 of the chunk's words
    nonzero = torch.stack([(words & ((7 << (4 * i)) | (7 << (16 + 4 * i)))).ne(0).any(dim=2) for i in range(4)],
                          dim=2).reshape(N, -1)
    e = scale_codes.to(torch.int32)
    d = min(254 - int(e.max()), 252)
    lo = int(torch.where(nonzero, e, torch.full_like(e, 255)).min())
    return d if lo + d >= 128 else None


def planar_bytes(codes: torch.Tensor, kind: str, group: int) -> tuple[torch.Tensor, int]:
    """codes [N, K] -> (uint8 [N, K/2] in planar chunks, chunk size); see the module docstring."""
    N, K = codes.shape
    if kind in ("int4", "uint4"):
        # groups below 128: two groups per chunk, one per nibble plane (K = 32 per tensor-core
        # step instead of 16; sm_90 SASS at g32: 8.9 instead of 10.3 instructions per weight)
        chunk = 2 * group if group < 128 and K % (2 * group) == 0 else group
    else:
        chunk = 128
        while K % chunk:
            chunk //= 2
        if chunk < 32:
            raise ValueError(f"prepare_w4: fp4 weights need K divisible by 32 (got K = {K})")
    u = codes.to(torch.int16)
    if kind == "int4":
        u = u + 8  # offset binary: 0..15
    u = u.to(torch.uint8).reshape(N, K // chunk, 2, chunk // 2)
    packed = u[:, :, 0, :] | (u[:, :, 1, :] << 4)
    return packed.reshape(N, K // 2).contiguous(), chunk


def planar8_bytes(codes: torch.Tensor, kind: str, group: int) -> torch.Tensor:
    """codes [N, K] -> uint8 [N, K/2] holding little-endian int32 words [N, K/8]: word t of
    chunk c (group-sized) has code c*G + p*(G/8) + t in nibble p (bits 4p..4p+3)."""
    N, K = codes.shape
    u = codes.to(torch.int32)
    if kind == "int4":
        u = u + 8  # offset binary: 0..15
    u = u.reshape(N, K // group, 8, group // 8)           # [n, c, p, t]
    words = torch.zeros(N, K // group, group // 8, dtype=torch.int32, device=codes.device)
    for p in range(8):
        words |= u[:, :, p, :] << (4 * p)  # p = 7 sets bit 31: int32 wraps, the bits are what count
    # int32 -> 4 bytes, little-endian (the kernel reads int32 words on little-endian GPUs)
    b = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
    return b.reshape(N, K // 2).contiguous()


def pairs_fit(kind: str, K: int, group: int) -> bool:
    """Whether the "pairs" layout holds this weight: K a multiple of 128 (its chunk); int4 / uint4
    with a group of 32 or 64 (whole groups per plane) or a multiple of 128 (whole chunks per
    group; w4a16_kind already requires a power of two >= 32); MXFP4 (a plane is one 32-code block)
    and NVFP4 (two 16-code blocks per plane)."""
    if K % 128:
        return False
    return kind in ("mxfp4", "nvfp4") or (kind in ("int4", "uint4") and (group < 128 or group % 128 == 0))


def pairs_bytes(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """codes [N, K] (K % 128 == 0) -> uint8 [N, K/2] holding little-endian int32 words [N, K/8]
    in the "pairs" layout (lowbit.ops.triton.w4a16.pairs): chunk c of 128 codes = 16 words = 4
    planes of 32 codes; word w holds, for each plane i, codes 2P and 2P + 1 of the plane in
    nibbles i and i + 4, where P = w2 + 2 w3 + 4 w0 + 8 w1 (w's bits: the pair the wgmma
    operand order puts at word w, see pairs._pairs_relabel)."""
    N, K = codes.shape
    u = codes.to(torch.int32)
    if kind == "int4":
        u = u + 8  # offset binary: 0..15
    u = u.reshape(N, K // 128, 4, 16, 2)                  # [n, c, plane i, pair P, b]
    w = torch.arange(16)
    pair = ((w >> 2) & 1) + 2 * ((w >> 3) & 1) + 4 * (w & 1) + 8 * ((w >> 1) & 1)
    u = u[:, :, :, pair.to(codes.device), :]              # [n, c, i, word w, b]
    words = torch.zeros(N, K // 128, 16, dtype=torch.int32, device=codes.device)
    for i in range(4):
        words |= (u[:, :, i, :, 0] << (4 * i)) | (u[:, :, i, :, 1] << (16 + 4 * i))  # bit 31 wraps: bits count
    b = torch.stack([(words >> (8 * k)) & 0xFF for k in range(4)], dim=-1).to(torch.uint8)
    return b.reshape(N, K // 2).contiguous()
