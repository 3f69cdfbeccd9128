"""W4A16: 4-bit weights, bf16 / fp16 activations, for decode-sized M (1..64).

    w4 = prepare_w4(wq)                 # wq: QTensor of weights [N, K], at load time
    out = w4a16_linear(x, w4, bias)     # x [..., K] -> out [..., N] in x's dtype

Weight schemes: int4 (signed, symmetric or with zero points) or uint4 (with zero points),
strategy group, group_size 32 or 128 (any power of two >= 32 dividing K); MXFP4
(fp4_e2m1fn, group 32, e8m0 scales); NVFP4 (fp4_e2m1fn, group 16, fp8_e4m3fn scales and a
tensor scale). Anything else raises NotImplementedError naming the scheme.

Backends: CUDA -> the Triton kernel (lowbit.ops.triton.w4a16); CPU -> "torch": the
dequantized weight (float32) times x in float32, cast to x's dtype. backend="triton" on a
CPU tensor runs the kernel in Triton's interpreter. The float64 reference is
w4a16_reference (x @ wq.dequantize(float64).T).

Load-time layout (W4Weight.metadata() records it): [N, K/2] uint8 in planar chunks of C
codes along K (C = G for int4 from group 128 up, 2G below when 2G divides K -- each nibble
plane then holds one group --, and 128 -- or the largest power of two >= 32 dividing K -- for
fp4): byte j of chunk c holds code cC + j in the low nibble and code cC + C/2 + j in the
high nibble, so each nibble plane multiplies a contiguous half of x. Signed int4 codes are
stored offset-binary (code + 8). This differs from lowbit.pack_int4's interleaved order
(which checkpoints use); W4Weight.qtensor keeps the source. Per-group scales [N, K/G]
float32 (int4) or scale codes [N, K/G] uint8 (fp4: e8m0 or e4m3); zero points narrowed to
int8 (they lie in the 4-bit code range, so exactly).

Second layout, prepare_w4(wq, layout="planar8") (int4 / uint4 only): the same [N, K/2] bytes
read as little-endian int32 words [N, K/8]; word t of group c (G/8 words) holds code
c*G + p*(G/8) + t in nibble p (bits 4p..4p+3), int4 offset-binary. Kernels: "gemv8" (CUDA
cores, M <= 4: one lop3 + one FADD + one FFMA per weight) and "dot8" (tensor cores, M > 4,
G >= 128: one K = 16 dot per nibble plane of a group); pick_config_planar8 chooses. Both
are exact in the same sense as the planar_chunks kernels (exact weights and products,
float32 accumulation, one scale product per group), so the same error bound holds.
`python -m lowbit.bench.memory` times the layouts side by side (rows lowbit_w4a16_int4_g128,
_gemv8, _dot8, _pairs_best); "auto" picks "pairs" where it applies (prepare_w4).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lowbit.ops.dispatch import w4a16_kind
from lowbit.quantize import QTensor

MXFP4_MAX_SCALE_CODE = 240  # e8m0 2^113: the W4A16 kernel's scale * 2^14 stays finite (w4a16.codes._fp4_scaled)
_SMS = 132  # H100 / H200 multiprocessors: the split-K heuristic aims at >= 2 programs per SM


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


def _kind(wq: QTensor) -> str:
    return w4a16_kind(wq.scheme)


def prepare_w4(wq: QTensor, layout: str = "auto") -> W4Weight:
    """Lay out a quantized weight [N, K] for w4a16_linear (done once, at load time).

    layout "auto" (default): "pairs" where it applies (K a multiple of 128; int4 / uint4 with
    group 32, 64 or a multiple of 128, MXFP4, NVFP4: the fastest at decode sizes,
    docs/benchmarks-memory.md), else "planar_chunks" (kernels "dot" and "gemv"; every scheme); "planar8"
    (int4 / uint4; kernels "gemv8", the decode GEMV, and "dot8"): see the module docstring
    and lowbit.ops.triton.w4a16.planar8."""
    if layout not in ("auto", "planar_chunks", "planar8", "pairs"):
        raise ValueError(f"prepare_w4: layout must be 'auto', 'planar_chunks', 'planar8' or 'pairs', got {layout!r}")
    if not isinstance(wq, QTensor):
        raise TypeError(f"prepare_w4: wq must be a lowbit QTensor (lowbit.quantize(w, scheme)), "
                        f"got {type(wq).__name__}")
    if wq.codes.ndim != 2 or wq.padded:
        raise ValueError(f"prepare_w4: the weight must be an unpadded 2-D [N, K] QTensor, got codes "
                         f"{tuple(wq.codes.shape)} for shape {wq.shape}")
    kind = _kind(wq)
    N, K = wq.codes.shape
    if K % 2:
        raise ValueError(f"prepare_w4: K = {K} must be even (two codes per byte)")
    if layout == "auto":
        layout = "pairs" if _pairs_fit(kind, K, wq.scheme.group_size) else "planar_chunks"
    if layout == "planar8":
        if kind not in ("int4", "uint4"):
            raise NotImplementedError(f"prepare_w4: layout 'planar8' takes int4 / uint4 weights, got {kind}; "
                                      "use layout='planar_chunks'")
        packed, chunk = _planar8(wq.codes, kind, wq.scheme.group_size), wq.scheme.group_size
    elif layout == "pairs":
        if not _pairs_fit(kind, K, wq.scheme.group_size):
            raise NotImplementedError(f"prepare_w4: layout 'pairs' takes weights with K a multiple of 128: MXFP4, "
                                      f"NVFP4, int4 / uint4 with group 32, 64 or a multiple of 128, got {kind} K = {K} "
                                      f"group {wq.scheme.group_size}; use layout='planar_chunks'")
        packed, chunk = _pairs_words(wq.codes, kind), 128
    else:
        packed, chunk = _planar(wq.codes, kind, wq.scheme.group_size)
    # the planar kernel forms scale * 2^14 (the pairs kernel scales its float32 dots: no limit)
    top = (int(wq.scale_codes.max()) if layout == "planar_chunks" and kind == "mxfp4" and wq.scale_codes is not None
           and wq.scale_codes.numel() else 0)
    if top > MXFP4_MAX_SCALE_CODE:
        raise ValueError(f"prepare_w4: an MXFP4 weight scale of 2^{top - 127} is beyond the "
                         f"kernel's exact range (e8m0 codes <= {MXFP4_MAX_SCALE_CODE}, scales <= 2^113: it forms "
                         "value * 2^-14 and scale * 2^14); such weights are not real model weights -- check "
                         "the checkpoint, or dequantize it with QTensor.dequantize()")
    if layout == "pairs" and wq.codes.is_cuda and not torch.cuda.is_current_stream_capturing():
        # the split-K counters made now, outside any CUDA-graph memory pool (see _split_locks),
        # for up to 256 rows of x at BLOCK_N 128
        _split_locks(wq.codes.device, 4 * -(-N // 128))
    dexp = pairs_fp4_exp_offset(packed, wq.scale_codes) if layout == "pairs" and kind == "mxfp4" else None
    zp = None
    if wq.zero_point is not None:
        zp = wq.zero_point.to(torch.int8).contiguous()  # z lies in [qmin, qmax]: exact
    return W4Weight(packed, wq.scale.to(torch.float32).contiguous(), zp,
                    None if wq.scale_codes is None else wq.scale_codes.contiguous(),
                    None if wq.global_scale is None else wq.global_scale.to(torch.float32).reshape(1).contiguous(),
                    kind, wq.scheme.group_size, chunk, (N, K), wq, layout, dexp)


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


def _planar(codes: torch.Tensor, kind: str, group: int) -> tuple[torch.Tensor, int]:
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


def _planar8(codes: torch.Tensor, kind: str, group: int) -> torch.Tensor:
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


def _pairs_fit(kind: str, K: int, group: int) -> bool:
    """Whether the "pairs" layout holds this weight: K a multiple of 128 (its chunk); int4 / uint4
    with a group of 32 or 64 (whole groups per plane) or a multiple of 128 (whole chunks per
    group; _kind already requires a power of two >= 32); MXFP4 (a plane is one 32-code block)
    and NVFP4 (two 16-code blocks per plane)."""
    if K % 128:
        return False
    return kind in ("mxfp4", "nvfp4") or (kind in ("int4", "uint4") and (group < 128 or group % 128 == 0))


def _pairs_words(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """codes [N, K] (K % 128 == 0) -> uint8 [N, K/2] holding little-endian int32 words [N, K/8]
    in the "pairs" layout (lowbit.ops.triton.w4a16.pairs): chunk c of 128 codes = 16 words = 4
    planes of 32 codes; word w holds, for each plane i, codes 2P and 2P + 1 of the plane in
    nibbles i and i + 4, where P = w2 + 2 w3 + 4 w0 + 8 w1 (w's bits: the pair the wgmma
    operand order puts at word w, see _pairs_relabel)."""
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


def w4a16_reference(x: torch.Tensor, w: W4Weight | QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 x @ dequant(w).T (+ bias): the exact value the kernel approximates."""
    wq = w.qtensor if isinstance(w, W4Weight) else w
    out = x.to(torch.float64) @ wq.dequantize(torch.float64).T
    return out if bias is None else out + bias.to(torch.float64)



def _split_k(programs: int, steps: int, target: int) -> int:
    """Split-K factor for the W4A16 heuristics: double it while there are fewer than `target`
    programs and each split keeps at least 2 K steps of an even division."""
    split = 1
    while programs * split < target and steps % (2 * split) == 0 and steps // (2 * split) >= 2:
        split *= 2
    return split


def pick_config_planar8(M: int, N: int, K: int, group: int, *, interpret: bool = False,
                        kernel: str | None = None) -> dict:
    """Kernel and tiles for a planar8 weight (reasoned from sm_90 SASS counts, not tuned by
    timing): "gemv8" for M <= 4 (or groups below 128), else "dot8" -- the tensor-core
    form on the same layout: BLOCK_N 128, BLOCK_K 256, 4 warps, 16 / 32 / 64 rows (K loop
    ~4.1-4.5 SASS instructions per weight against ~7.6 for the planar_chunks "dot" kernel at
    16 rows), split-K until one program per SM (N = 8192, 16 rows: 64 blocks x split 4)."""
    if kernel == "gemv8" or (kernel is None and (M <= 4 or group < 128)):
        return pick_config_gemv8(M, N, K, group, interpret=interpret)
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    bn = 16 if interpret else 128
    bk = group if interpret else max(256, group)
    while K % bk:
        bk //= 2
    steps = K // bk
    split = 1 if interpret else _split_k(-(-N // bn) * -(-M // bm), steps, _SMS)
    # unpack 1 (packed bf16/fp16 pairs, inline PTX: ~3.3 instead of ~4.1 SASS instructions per
    # weight at 16 rows) is opt-in: it has not been checked on a GPU
    return {"kernel": "dot8", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
            "split": split, "num_warps": 4, "num_stages": 1, "unpack": 0}


def pick_config_gemv8(M: int, N: int, K: int, group: int, *, interpret: bool = False) -> dict:
    """Tiles and split-K of the "gemv8" kernel (planar8 layout; reasoned from sm_90 SASS, not
    tuned by timing). BLOCK_N 128 with 4 warps: each thread holds 4 rows x 4 words (16-byte
    loads, 32 codes per row per group of 128), so every x value it loads serves 4 rows.
    BLOCK_K 512 codes per loop step at one row of x (4 groups of 128: 4 independent 16-byte
    loads per row in flight per thread; 128 registers, sm_90 compile), 256 at 2 rows, 128 at
    4 rows (255 registers; 512 spills). Split-K until there are >= 2 programs per SM (N =
    8192: 64 column blocks x split 4), keeping >= 2 loop steps per program. Up to 4 rows of x
    per program: each further block of 4 rows unpacks the weights again (read from L2), so
    this kernel is for M = 1..4; the tensor-core form is the one for larger M."""
    bm = 1 if M == 1 else (2 if M == 2 else 4)
    bn = 16 if interpret else 128
    bk_max = group if interpret else max(512 // bm, group)
    bk = group
    while bk * 2 <= bk_max and K % (bk * 2) == 0:
        bk *= 2
    steps = K // bk
    split = 1 if interpret else _split_k(-(-N // bn) * -(-M // bm), steps, 2 * _SMS)
    return {"kernel": "gemv8", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
            "split": split, "num_warps": 4, "num_stages": 1}


def pick_config_pairs(M: int, N: int, K: int, group: int, *, kind: str = "int4", interpret: bool = False) -> dict:
    """Tiles of the "pairs" kernel (lowbit.ops.triton.w4a16.pairs), from sm_90 SASS counts (2.3 /
    2.7 / 3.2 instructions per weight in the K loop at 1 / 16 / 64 rows) and timings on the H200:
    BLOCK_M = M rounded up to a power of two (1..8: mma v2, x padded to 8 columns; 16..64:
    wgmma), BLOCK_N 128 (64 at 16 rows) with 4 warps (the row relabelling assumes BLOCK_N %
    (16 * warps) == 0),
    BLOCK_K 256 codes (two chunks; the next step's words are loaded while this one computes),
    128 at 64 rows except for NVFP4;
    split-K by K (below); per-kind register caps and tiles (below; `scripts/gpu.sh w4configs`
    times the alternatives); xpf: the next step's x prefetched into L1 (_prefetch_l1).
    kind: the weight's format, W4Weight.kind ("int4", "uint4", "mxfp4", "nvfp4")."""
    bm = 1
    while bm < min(M, 64):
        bm *= 2
    warps = 1 if interpret else 4
    # BLOCK_N 64 at 16 rows: ~7% faster than 128 there; at 1 and 64 rows 128 is the best or within 1%
    bn = 16 if interpret else (64 if bm == 16 else 128)
    # 64 rows: one chunk per step for integer weights (two spill: 255 registers, local loads in the
    # sm_90 K loop); NVFP4's folded scales leave room for two, 8-13% faster than one
    bk = 128 if interpret or K % 256 or (bm >= 64 and kind != "nvfp4") else 256
    steps = K // bk
    split = 1
    if not interpret:
        # split-K: ~2048 codes of K per program (split 4 at K = 8192 is the fastest or within 2% at
        # 1, 16 and 64 rows; the 8-16 a programs-per-SM rule gives is 1.1-1.6x slower at 16 / 64
        # rows), then more only while there are fewer programs than SMs
        while 2 * split * 2048 <= K and steps % (2 * split) == 0:
            split *= 2
        split = max(split, _split_k(-(-N // bn) * -(-M // bm) * split, steps // split, _SMS) * split)
    # wgmma tiles (16+ rows): Triton's 2-stage pipelining on top (1.4-1.8x faster than one stage)
    # groups below 128 codes (two to four scale tiles per step): a register cap (168 at one row,
    # 128 at 16) lets ptxas keep more programs per SM, 5-30% faster; at g128 it does not help
    maxnreg = 0
    if group < 128 and kind in ("int4", "uint4") and not interpret:
        maxnreg = {1: 168, 16: 128}.get(bm, 0)
    # the next step's x prefetched into L1 (_prefetch_l1) at 64 rows only (16-32 KB of x per step:
    # up to 10% faster for int4 g128 and MXFP4); with one or a few 128-byte lines of x per step
    # (1 and 16 rows), for NVFP4 and for int4 g32 it is no faster or slower
    xpf = int(bm >= 64 and kind != "nvfp4" and (group >= 128 or kind == "mxfp4") and not interpret)
    return {"kernel": "pairs", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "split": split,
            "num_warps": warps, "num_stages": 2 if bm >= 16 and not interpret else 1,
            "maxnreg": maxnreg, "xpf": xpf}


def pick_config(M: int, N: int, K: int, kind: str, group: int, chunk: int, *, interpret: bool = False) -> dict:
    """Kernel choice, tiles and split-K (H100/H200, 132 SMs).

    From timings on the H200 (int4 g128, N = 8192 and 28672, K = 8192): at M = 1 and 16 every tensor-core configuration with BLOCK_N 32 or 64 ran within ~5% of
    the best (dot, BLOCK_N 32, no split) and the GEMV form was 1.5-3x slower, so the dot form
    is used for every M; BLOCK_N 32 up to 16 rows, 64 above. BLOCK_K holds several chunks
    (512 codes at 16 rows, 256 at 32/64 rows, whose pipelined buffers must fit shared memory:
    512 at 64 rows needed 237568 > 232448 bytes). Split-K only when there are fewer programs
    than SMs. kernel="gemv" (float32 FMAs, M <= 2) stays available through `config`."""
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    bn = 16 if interpret else (32 if M <= 16 else 64)
    bk_max = chunk if interpret else (512 if bm <= 16 else 256)
    if chunk < 128 and bm >= 32 and not interpret:
        # small groups at 32 / 64 rows: BLOCK_K 256 needs 255 registers and spilled at 64 rows
        # (sm_90 SASS: 18.8 instructions per weight with local loads/stores in the K loop, 0.1x
        # the speed of bf16); 128 takes 195 registers, no spills, 14.6
        bk_max = 128
    bk = chunk
    while bk * 2 <= bk_max and K % (bk * 2) == 0:
        bk *= 2
    steps = K // bk
    split = 1 if interpret else _split_k(-(-N // bn) * -(-M // bm), steps, _SMS)
    return {"kernel": "dot", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
            "split": split, "num_warps": 4, "num_stages": 3 if bm <= 16 else 2}


def w4a16_linear(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None, *,
                 backend: str | None = None, config: dict | None = None) -> torch.Tensor:
    """out = x @ dequant(w).T (+ bias), x [..., K] bf16/fp16 -> out [..., N] in x's dtype.

    config: override pick_config's choice (keys BLOCK_M, BLOCK_N, BLOCK_K, split, num_warps,
    num_stages); benchmarks use it to sweep."""
    if not isinstance(w, W4Weight):
        raise TypeError(f"w4a16_linear: w must be a W4Weight (prepare_w4(qtensor)), got {type(w).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"w4a16_linear: x must be a bfloat16 or float16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    N, K = w.shape
    if x.ndim == 0 or x.shape[-1] != K:
        raise ValueError(f"w4a16_linear: x has shape {tuple(x.shape)}; its last dim must be K = {K}")
    if w.kind in ("mxfp4", "nvfp4") and x.dtype != torch.bfloat16:
        raise TypeError(f"w4a16_linear: {w.kind} weights take bfloat16 activations (the dequantized "
                        f"weights can exceed float16's range), got {x.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,)):
        raise ValueError(f"w4a16_linear: bias must be a tensor of shape ({N},)")
    if x.device != w.packed.device:
        raise ValueError(f"w4a16_linear: x is on {x.device} but the weight is on {w.packed.device}; "
                         "move one of them")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if backend is None:
        backend = "triton" if x.is_cuda else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"w4a16_linear: backend must be 'triton', 'torch' or None, got {backend!r}")
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, K)
    if backend == "torch":
        out = x2.float() @ w.qtensor.dequantize(torch.float32).T
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).reshape(lead + (N,))
    if not x.is_cuda and not interp:
        raise RuntimeError("w4a16_linear: backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 "
                           "(Triton's interpreter); use backend='torch'")
    return _launch(x2.contiguous(), w, bias, config, interp).reshape(lead + (N,))


def _launch(x2: torch.Tensor, w: W4Weight, bias, config, interp: bool, act_scale=None) -> torch.Tensor:
    """act_scale (pairs layout, NVFP4): float32 [1], the activation's tensor scale, multiplied
    into w.global_scale ([1] or per row [N]) in the kernel's epilogue."""
    import triton

    from lowbit.ops.triton import w4a16 as k
    from lowbit.ops.triton.common import launch

    M, K = x2.shape
    N = w.shape[0]
    if w.layout == "pairs" or (config or {}).get("kernel") == "pairs":
        return _launch_pairs(x2, w, bias, config, interp, act_scale)
    if act_scale is not None or (w.global_scale is not None and w.global_scale.numel() != 1):
        raise ValueError("w4a16_linear: per-row or activation tensor scales need the 'pairs' layout")
    if w.layout == "planar8" or (config or {}).get("kernel") in ("gemv8", "dot8"):
        return _launch_planar8(x2, w, bias, config, interp)
    cfg = dict(pick_config(M, N, K, w.kind, w.group_size, w.chunk, interpret=interp))
    if config:
        cfg.update(config)
    bk, split = cfg["BLOCK_K"], cfg["split"]
    if K % (bk * split) or bk % w.chunk:
        raise ValueError(f"w4a16_linear: config BLOCK_K={bk}, split={split} does not divide K = {K} "
                         f"(or BLOCK_K is not a multiple of the layout's chunk {w.chunk})")
    if cfg["kernel"] not in ("gemv", "dot"):
        raise ValueError(f"w4a16_linear: config kernel must be 'gemv' or 'dot', got {cfg['kernel']!r}")
    if cfg["kernel"] == "dot" and cfg["BLOCK_M"] < 16:
        cfg["BLOCK_M"] = 16  # tensor-core tiles have at least 16 rows (rows past M are masked)
    wfmt = k.WFMT[w.kind]
    atomic = split > 1
    dev = x2.device
    out = (torch.zeros if atomic else torch.empty)(M, N, device=dev,
                                                   dtype=torch.float32 if atomic else x2.dtype)
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split, triton.cdiv(M, cfg["BLOCK_M"]))
    per_group = w.scale if w.kind in ("int4", "uint4") else w.scale_codes
    launch(
        k._w4a16_kernel, grid, x2, w.packed, w.scale, w.zero_point if w.zero_point is not None else dummy,
        w.scale_codes if w.scale_codes is not None else dummy,
        w.global_scale if w.global_scale is not None else dummy,
        bias if (bias is not None and not atomic) else dummy, out,
        M, N, K, K // split, x2.stride(0), w.packed.stride(0), per_group.stride(0), out.stride(0),
        WFMT=wfmt, HAS_Z=w.zero_point is not None, HAS_BIAS=bias is not None and not atomic,
        G=w.group_size, C=w.chunk, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, ATOMIC=atomic,
        USE_DOT=cfg["kernel"] == "dot", INTERP=interp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if atomic:
        if bias is not None:
            out = out + bias.float()
        out = out.to(x2.dtype)
    return out


def dequantize_w4(w: W4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` (bf16 / fp16) from a planar-chunks or pairs W4Weight, one Triton pass
    (lowbit.ops.triton.w4a16 _w4_dequant_kernel / _pairs_dequant_kernel: int4 values rounded once per weight, fp4
    values exact; NVFP4's tensor scale is NOT applied). For large-M GEMMs; never cached."""
    import triton

    from lowbit.ops.triton import w4a16 as k
    from lowbit.ops.triton.common import interpreting, launch

    N, K = w.shape
    out = torch.empty((N, K), dtype=dtype, device=w.packed.device)
    dummy = torch.empty(1, device=w.packed.device, dtype=torch.float32)
    if w.layout == "pairs":
        words = w.packed.view(torch.int32)
        bn, chunks, warps = PAIRS_DEQUANT_INTERP if interpreting() else PAIRS_DEQUANT
        while (K // 128) % chunks:
            chunks //= 2
        per_group = w.scale if w.kind in ("int4", "uint4") else w.scale_codes
        launch(k._pairs_dequant_kernel, (triton.cdiv(N, bn), K // (128 * chunks)), words, per_group,
               w.zero_point if w.zero_point is not None else dummy, out, N, words.stride(0), per_group.stride(0),
               out.stride(0), WFMT=k.WFMT[w.kind], HAS_Z=w.zero_point is not None, G=w.group_size, BLOCK_N=bn,
               CHUNKS=chunks, num_warps=warps)
        return out
    if w.layout != "planar_chunks":
        raise ValueError(f"dequantize_w4: layout {w.layout!r} has no dequantization kernel; prepare the weight "
                         "with layout='planar_chunks' or 'pairs'")
    per_group = w.scale if w.kind in ("int4", "uint4") else w.scale_codes
    wfmt = k.WFMT[w.kind]
    bn = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 64
    launch(
        k._w4_dequant_kernel, (triton.cdiv(N, bn), K // w.chunk), w.packed, w.scale, w.zero_point if w.zero_point is not None else dummy,
        w.scale_codes if w.scale_codes is not None else dummy, out, N, K,
        w.packed.stride(0), per_group.stride(0), out.stride(0),
        WFMT=wfmt, HAS_Z=w.zero_point is not None, G=w.group_size, C=w.chunk, BLOCK_N=bn, num_warps=4)
    return out


# (BLOCK_N, chunks of 128 codes per program, num_warps) of the pairs dequantization on the GPU:
# (128, 1, 4) is the fastest for int4 g128 and NVFP4 at 14336 x 4096 and 4096 x 14336 (up to
# 1.2x faster than (64, 1, 4)); every configuration gives the same bits
PAIRS_DEQUANT = (128, 1, 4)
PAIRS_DEQUANT_INTERP = (16, 1, 4)  # in Triton's interpreter (small tiles: every program runs in Python)


def scale_output(y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """round(float32(y) * scale [+ bias]) to y's dtype in one pass (y [M, N] bf16 / fp16, scale
    float32 [1] or [N], bias [N] or None): the large-M W4A16 path's NVFP4 tensor scale, the same
    float32 operations as y.float() * scale + bias.float() then .to(y.dtype), which took three passes."""
    import triton

    from lowbit.ops.triton import w4a16 as k
    from lowbit.ops.triton.common import interpreting, launch

    M, N = y.shape
    out = torch.empty_like(y)
    interp = interpreting()
    bm, bn = (16, 64) if interp else (16, 256)
    launch(k._scale_output_kernel, (triton.cdiv(M, bm), triton.cdiv(N, bn)), y, scale,
           bias if bias is not None else scale, out, M, N, y.stride(0), out.stride(0),
           ROWS=scale.numel() > 1, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
           INTERP=interp, num_warps=4)
    return out


_SPLIT_LOCKS: dict = {}


def _split_locks(device: torch.device, tiles: int) -> torch.Tensor:
    """A zeroed int32 counter per output tile for the pairs kernel's split-K (each call's last
    program per tile resets its counter to 0). On a device's default stream, outside CUDA-graph
    capture: one persistent buffer per device, grown, never shrunk. On any other stream, and
    during capture: a fresh zeroed buffer for this call (one memset; freed with the call's
    other temporaries), because
      - kernels on two streams may run at once and must not share counters;
      - torch.compile's CUDA graphs warm up and record on a side stream with allocations going
        to the graph's memory pool, where a buffer that outlives the call is refused ("tensor(s)
        in the cudagraph pool not tracked as outputs"; the persistent buffer per stream did that).
    """
    if device.type == "cuda" and (torch.cuda.is_current_stream_capturing()
                                  or torch.cuda.current_stream(device) != torch.cuda.default_stream(device)):
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    buf = _SPLIT_LOCKS.get(str(device))
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _SPLIT_LOCKS[str(device)] = buf
    return buf


def _launch_pairs(x2: torch.Tensor, w: W4Weight, bias, config, interp: bool, act_scale=None) -> torch.Tensor:
    """The "pairs" kernel on a weight prepared with layout="pairs" (lowbit.ops.triton.w4a16.pairs)."""
    import triton

    from lowbit.ops.triton import w4a16 as k
    from lowbit.ops.triton.common import launch

    M, K = x2.shape
    N = w.shape[0]
    if w.layout != "pairs":
        raise ValueError("w4a16_linear: kernel 'pairs' needs a weight prepared with prepare_w4(wq, layout='pairs')")
    cfg = dict(pick_config_pairs(M, N, K, w.group_size, kind=w.kind, interpret=interp))
    unknown = sorted(set(config or {}) - set(cfg))
    if unknown:
        raise ValueError(f"w4a16_linear: pairs config keys {unknown} are not known; the keys are {sorted(cfg)}")
    if config:
        cfg.update(config)
        if "split" in config and "BLOCK_K" not in config and K % (cfg["BLOCK_K"] * cfg["split"]):
            cfg["BLOCK_K"] = 128  # a split asked for without a tile: the smallest step (refused below if it
            # still does not divide K)
    if cfg["kernel"] != "pairs":
        raise ValueError(f"w4a16_linear: a 'pairs' weight runs kernel 'pairs', config asks for {cfg['kernel']!r}; "
                         "prepare the weight with layout='planar_chunks' for it")
    bm, bn, bk, split, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["split"], cfg["num_warps"]
    if bk not in (128, 256) or K % (bk * split):
        raise ValueError(f"w4a16_linear: pairs config BLOCK_K={bk}, split={split}: BLOCK_K must be 128 or 256 "
                         f"and BLOCK_K * split must divide K = {K}")
    if bm & (bm - 1) or bm > 64:
        raise ValueError(f"w4a16_linear: pairs BLOCK_M must be a power of two <= 64, got {bm}")
    if bn % (16 * warps) or bn & (bn - 1):
        raise ValueError(f"w4a16_linear: pairs BLOCK_N must be a power of two and a multiple of 16 * num_warps "
                         f"(the row relabelling), got BLOCK_N={bn}, num_warps={warps}")
    dev = x2.device
    out = torch.empty(M, N, device=dev, dtype=x2.dtype)
    grid = (triton.cdiv(N, bn), split, triton.cdiv(M, bm))
    if split > 1:
        part = torch.empty(split, M, N, device=dev, dtype=torch.float32)
        locks = _split_locks(dev, grid[0] * grid[2])
    else:
        part = locks = torch.empty(1, device=dev, dtype=torch.float32)
    words = w.packed.view(torch.int32)  # [N, K/8]
    fp4 = w.kind in ("mxfp4", "nvfp4")
    # fp4: the uint8 block-scale codes [N, K/G] read as int32 words (K/G is a multiple of 4)
    per_group = w.scale_codes.view(torch.int32) if fp4 else w.scale
    launch(k._w4a16_pairs_kernel, grid,
           x2, words, per_group, w.zero_point if w.zero_point is not None else part,
           w.global_scale if w.global_scale is not None else part, act_scale if act_scale is not None else part,
           bias if bias is not None else part,
           out, part, locks, M, N, K, K // split, w.fp4_exp_offset or 0, x2.stride(0), words.stride(0),
           per_group.stride(0), out.stride(0), WFMT=k.WFMT[w.kind],
           FOLD=w.kind == "nvfp4" or w.fp4_exp_offset is not None,
           GS_ROWS=w.global_scale is not None and w.global_scale.numel() > 1, HAS_GX=act_scale is not None,
           HAS_Z=w.zero_point is not None,
           HAS_BIAS=bias is not None,
           G=w.group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, WARPS=warps, V3=bm >= 16,
           XPF=bool(cfg["xpf"]), INTERP=interp, num_warps=warps, num_stages=cfg["num_stages"],
           **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interp else {}))
    return out


def _launch_planar8(x2: torch.Tensor, w: W4Weight, bias, config, interp: bool) -> torch.Tensor:
    """The "gemv8" or "dot8" kernel on a planar8 weight (lowbit.ops.triton.w4a16.planar8)."""
    import triton

    from lowbit.ops.triton import w4a16 as k
    from lowbit.ops.triton.common import launch

    M, K = x2.shape
    N = w.shape[0]
    if w.layout != "planar8":
        raise ValueError("w4a16_linear: kernels 'gemv8' / 'dot8' need a weight prepared with "
                         "prepare_w4(wq, layout='planar8')")
    cfg = dict(pick_config_planar8(M, N, K, w.group_size, interpret=interp, kernel=(config or {}).get("kernel")))
    if config:
        cfg.update(config)
        if "split" in config and "BLOCK_K" not in config:
            # a split asked for without a tile: halve the heuristic's BLOCK_K (down to one
            # group) until the split divides K, instead of refusing a valid request
            while K % (cfg["BLOCK_K"] * cfg["split"]) and cfg["BLOCK_K"] // 2 >= w.group_size \
                    and cfg["BLOCK_K"] % (2 * w.group_size) == 0:
                cfg["BLOCK_K"] //= 2
    kern = cfg["kernel"]
    if kern not in ("gemv8", "dot8"):
        raise ValueError(f"w4a16_linear: a planar8 weight runs kernels 'gemv8' or 'dot8', config asks for "
                         f"{kern!r}; prepare the weight with layout='planar_chunks' for it")
    bk, split, bm = cfg["BLOCK_K"], cfg["split"], cfg["BLOCK_M"]
    if K % (bk * split) or bk % w.group_size:
        raise ValueError(f"w4a16_linear: config BLOCK_K={bk}, split={split} does not divide K = {K} "
                         f"(or BLOCK_K is not a multiple of the group size {w.group_size})")
    if kern == "gemv8" and bm not in (1, 2, 4):
        raise ValueError(f"w4a16_linear: gemv8 BLOCK_M must be 1, 2 or 4, got {bm}")
    if kern == "dot8" and (bm < 16 or w.group_size < 128):
        raise ValueError(f"w4a16_linear: dot8 needs BLOCK_M >= 16 (got {bm}) and group_size >= 128 "
                         f"(got {w.group_size}: a plane of a group is one K = 16 tensor-core step)")
    atomic = split > 1
    dev = x2.device
    out = (torch.zeros if atomic else torch.empty)(M, N, device=dev,
                                                   dtype=torch.float32 if atomic else x2.dtype)
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    words = w.packed.view(torch.int32)  # [N, K/8]; K/2 is a multiple of 4 (group >= 32 divides K)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split, triton.cdiv(M, bm))
    args = (x2, words, w.scale, w.zero_point if w.zero_point is not None else dummy,
            bias if (bias is not None and not atomic) else dummy, out,
            M, N, K, K // split, x2.stride(0), words.stride(0), w.scale.stride(0), out.stride(0))
    common = dict(SIGNED=w.kind == "int4", HAS_Z=w.zero_point is not None, HAS_BIAS=bias is not None and not atomic,
                  C=w.group_size, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, ATOMIC=atomic, INTERP=interp,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if kern == "gemv8":
        launch(k._w4a16_gemv8_kernel, grid, *args, EVEN_N=N % cfg["BLOCK_N"] == 0, EVEN_M=M % bm == 0, **common)
    else:
        unpack = int(cfg.get("unpack", 0))
        if unpack not in (0, 1):
            raise ValueError(f"w4a16_linear: dot8 config 'unpack' must be 0 (float32 unpack) or 1 (packed "
                             f"16-bit pairs, GPU only), got {unpack}")
        launch(k._w4a16_dot8_kernel, grid, *args, UNPACK=unpack, **common)
    if atomic:
        if bias is not None:
            out = out + bias.float()
        out = out.to(x2.dtype)
    return out
