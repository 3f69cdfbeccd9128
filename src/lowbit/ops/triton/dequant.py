"""Block-scaled codes -> bf16, one pass: what the MX / NVFP4 emulation multiplies on Hopper.

    out[r, k] = decode(codes[r, k]) * decode_scale(scale_codes[r, k // G])

Elements: fp8 e4m3fn (MXFP8) or fp4 e2m1fn (MXFP4 / NVFP4; one code per byte, as the fused
quantizer writes them). Scales: e8m0 (2^(c - 127)) or fp8 e4m3fn (NVFP4's block scale; its
per-tensor fp32 scale is NOT applied here: the caller multiplies the fp32 accumulator by it).
Every product is exact in bf16: e4m3 x 2^e has 4 significant bits, e2m1 x e4m3 at most 6,
and bf16 has fp32's exponent range (|value| <= 448 * 2^127 stays finite for the e8m0 codes
1..254 real data produces). So a bf16 tensor-core GEMM on two such tensors with fp32
accumulation computes exactly the products the MX / NVFP4 definition asks for.

Stacked expert weights (the MoE bf16 path, lowbit.ops.grouped_dequant): dequantize_rows and
dequantize_packed take the [E * N, K] rows of all experts and, given the routing's offsets, skip
the rows of experts that received no token (their output rows are left as they were: the grouped
GEMM reads no row of an empty expert), so a decode step dequantizes only the experts it uses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.float_gemm import bf16_gemm  # noqa: F401  (the dequant paths' GEMM, re-exported)

from .common import decode_e4m3fn, interpreting, launch
from .fused_quant import _absmax, _codes, _group_scales, _ld, _st, nvfp4_block_scales, round_to, tensor_scale
from .w4a16 import _e2m1_value, block_scale
from .w4a16.codes import W_INT4 as _W_INT4, _nibble_value

# a constexpr: compiled Triton reads only constexpr globals (the interpreter reads any)
W_INT4 = tl.constexpr(_W_INT4)

E4M3, E2M1 = 0, 1
E8M0, SCALE_E4M3 = 2, 3   # block_scale's codes (w4a16.py: MXFP4 = 2, NVFP4 = 3; SCALE_KIND + 1)


@triton.jit
def _group_dequant_kernel(C, SC, OUT, R, K, s_c, s_sc, s_o,
                          EFMT: tl.constexpr, SFMT: tl.constexpr, G: tl.constexpr,
                          BLOCK_R: tl.constexpr, GROUPS: tl.constexpr):
    """BLOCK_R rows x GROUPS consecutive groups of G codes per program, one group at a time: the
    group's scale is one load per row, broadcast along the group (a scale gathered per element
    was ~15 loads of every 16 the kernel issued); the groups' code spans are contiguous in each
    row, so the loads still fill whole sectors. A last group shorter than G is masked."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < R
    r64 = rows.to(tl.int64)
    for j in tl.static_range(GROUPS):
        g = tl.program_id(1) * GROUPS + j
        cols = g * G + tl.arange(0, G)
        ok = r_ok[:, None] & (cols < K)[None, :]
        c = tl.load(C + r64[:, None] * s_c + cols[None, :], mask=ok, other=0).to(tl.int32)
        sc = tl.load(SC + r64 * s_sc + g, mask=r_ok & (g * G < K), other=127).to(tl.int32)
        if EFMT == 0:
            v = decode_e4m3fn(c)
        else:
            v = _e2m1_value(c)
        s = block_scale(sc, SFMT)
        tl.store(OUT + r64[:, None] * s_o + cols[None, :], round_to(v * s[:, None], OUT.dtype.element_ty), mask=ok)


def dequantize_groups(codes: torch.Tensor, scale_codes: torch.Tensor, group: int, element: str,
                      scale: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """codes uint8 [R, K] (element "e4m3" or "e2m1"), scale_codes uint8 [R, K // group] (scale
    "e8m0" or "e4m3") -> bf16 [R, K], into `out` (a contiguous bf16 [R, K] buffer, e.g.
    lowbit.ops.scratch's) or a new tensor. No argument checks: lowbit.ops.prepared checks at
    prepare time."""
    R, K = codes.shape
    if out is None:
        out = torch.empty((R, K), dtype=torch.bfloat16, device=codes.device)
    # 16 rows x 256 codes per program on the GPU (the tile of the gathered-scale version before it)
    br, span = (16, 64) if interpreting() else (16, 256)
    groups = max(1, span // group)
    launch(_group_dequant_kernel, (triton.cdiv(R, br), triton.cdiv(triton.cdiv(K, group), groups)), codes, scale_codes, out,
           R, K, codes.stride(0), scale_codes.stride(0), out.stride(0),
           EFMT=E4M3 if element == "e4m3" else E2M1, SFMT=E8M0 if scale == "e8m0" else SCALE_E4M3, G=group,
           BLOCK_R=br, GROUPS=groups, num_warps=4)
    return out


@triton.jit
def _qdq_rows_kernel(X, s_x, OUT, s_o, AMAX, WG, GPROD, M, K,
                     FMT: tl.constexpr, SCALE_KIND: tl.constexpr, E8M0_ROUND: tl.constexpr, QMAX: tl.constexpr,
                     EMAX: tl.constexpr, MBITS: tl.constexpr, HW_FP8: tl.constexpr, FAST_DIV: tl.constexpr,
                     G_DIV: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr,
                     AMAX_ONLY: tl.constexpr, ONE: tl.constexpr, MP2: tl.constexpr, HAS_WG: tl.constexpr):
    """Dynamic fp4 (MXFP4 / NVFP4) quantization of row pid of x [M, K] straight to its dequantized
    value (e2m1 * block scale, exact in bf16; NVFP4's tensor scale NOT applied): what
    fused.quantize_rows + dequantize_groups compute, one kernel instead of two (NVFP4: instead of
    six with the torch max and product), from the same helpers, so the same codes and scales (lowbit.quantize's). The row is an
    [NG, G] tile. NVFP4: the tensor amax is the max of the rows' absmax -- this row's own (ONE: M
    = 1), else the first M entries of AMAX from an AMAX_ONLY launch (the rows' absmax, or above
    fused.QDQ_MAX_ROWS rows their max alone, M = 1; MP2 = next power of two >= M) --; program 0
    writes GPROD = WG * g (HAS_WG: the weight's tensor scale times the activation's, the W4A16
    kernel's one scale of the accumulator) or g itself."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, NG)[:, None] * G + tl.arange(0, G)[None, :]
    mask = cols < K
    y = _ld(X + row * s_x + cols, mask, EVEN).to(tl.float32)
    amax = _absmax(y)                                                   # [NG], NaN counted as +inf
    if AMAX_ONLY:
        tl.store(AMAX + row, tl.max(amax, axis=0))
        return
    if SCALE_KIND == 2:
        if ONE:
            gs = tensor_scale(tl.max(amax, axis=0), G_DIV)
        else:
            r = tl.arange(0, MP2)
            gs = tensor_scale(tl.max(tl.load(AMAX + r, mask=r < M, other=0.0), axis=0), G_DIV)
        if tl.program_id(0) == 0:
            if HAS_WG:
                tl.store(GPROD, tl.load(WG) * gs)
            else:
                tl.store(GPROD, gs)
    amax = tl.where(amax == float("inf"), float("nan"), amax)
    if SCALE_KIND == 2:
        s, code = nvfp4_block_scales(amax, gs, QMAX)
    else:
        s, code = _group_scales(amax, AMAX, SCALE_KIND, E8M0_ROUND, QMAX, EMAX, MBITS, G_DIV)
    codes = _codes(y, s[:, None], FMT, SCALE_KIND, QMAX, HW_FP8, FAST_DIV, LEAN=True)
    v = _e2m1_value(codes.to(tl.int32)) * block_scale((code & 255)[:, None], 1 + SCALE_KIND)  # e8m0 / e4m3
    _st(OUT + row * s_o + cols, round_to(v, OUT.dtype.element_ty), mask, EVEN)


@triton.jit
def _live_rows(OFF, rows, R, RPE, SKIP: tl.constexpr):
    """Which of `rows` to write: those < R and, SKIP, those of an expert with tokens (row r is
    expert r // RPE's; OFF the routing's int64 offsets [E + 1])."""
    ok = rows < R
    if SKIP:
        e = rows // RPE
        ok = ok & (tl.load(OFF + e + 1, mask=ok, other=0) > tl.load(OFF + e, mask=ok, other=0))
    return ok


@triton.jit
def _row_dequant_kernel(C, S, OUT, OFF, R, K, RPE, s_c, s_o, FP8: tl.constexpr, SKIP: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[r, k] = bf16(decode(codes[r, k]) * s[r]): the fp32 product (one rounding), then one
    round to nearest even to the output dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = _live_rows(OFF, rows, R, RPE, SKIP)
    ok = r_ok[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)
    c = tl.load(C + r64[:, None] * s_c + cols[None, :], mask=ok, other=0)
    if FP8:
        v = decode_e4m3fn(c.to(tl.int32))
    else:
        v = c.to(tl.float32)
    s = tl.load(S + rows, mask=r_ok, other=0.0)
    tl.store(OUT + r64[:, None] * s_o + cols[None, :], round_to(v * s[:, None], OUT.dtype.element_ty), mask=ok)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                    offsets: torch.Tensor | None = None) -> torch.Tensor:
    """8-bit weight codes [N, K] (int8, or fp8 e4m3fn / its uint8 bit patterns) times one fp32
    scale per row [N], into out [N, K] (bf16 / fp16): each weight rounded once from its fp32
    product. Stacked experts: codes [E, N, K], scale [E, N], out [E, N, K] and, with the routing's
    offsets [E + 1], only the experts that have rows are written. No argument checks (the callers
    check at prepare time)."""
    K = codes.shape[-1]
    rpe = codes.shape[-2]
    c = codes.reshape(-1, K)
    R = c.shape[0]
    fp8 = c.dtype in (torch.float8_e4m3fn, torch.uint8)
    c = c.view(torch.uint8) if fp8 else c
    br, bk = (16, 64) if interpreting() else (16, 256)
    launch(_row_dequant_kernel, (triton.cdiv(R, br), triton.cdiv(K, bk)), c, scale, out,
           scale if offsets is None else offsets, R, K, rpe, c.stride(0), K, FP8=fp8, SKIP=offsets is not None,
           BLOCK_R=br, BLOCK_K=bk, num_warps=4)
    return out


@triton.jit
def _packed_dequant_kernel(W, S, Z, OUT, OFF, R, K, RPE, s_w, s_s, WFMT: tl.constexpr, HAS_Z: tl.constexpr,
                           SKIP: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr, GROUPS: tl.constexpr):
    """BLOCK_R rows x GROUPS groups of G codes of 4-bit weights packed two per byte along K
    (lowbit.pack_int4 / pack_fp4: code 2j in byte j's low nibble; int4 in two's complement), as
    _group_dequant_kernel walks them: one scale per row and group. Each group's G / 2 bytes are loaded
    once, as one contiguous (vectorizable) run per row; the low and high nibbles' values are
    interleaved back into K order (join + reshape), so the stores are contiguous too.
      int4 (WFMT 0)     (code - zero point) exactly (w4a16.codes._nibble_value of the offset-binary
                        nibble), times the fp32 scale: one fp32 rounding, then one to OUT's dtype
      MXFP4 / NVFP4     e2m1 value times the block scale (e8m0 codes clamped to [1, 254], e4m3),
      (WFMT 2 / 3)      exact in float32 and in bf16; NVFP4's tensor scale is the caller's"""
    HALF: tl.constexpr = G // 2
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = _live_rows(OFF, rows, R, RPE, SKIP)
    r64 = rows.to(tl.int64)
    for j in tl.static_range(GROUPS):
        g = tl.program_id(1) * GROUPS + j
        bcols = g * HALF + tl.arange(0, HALF)                      # the group's bytes
        cols = g * G + tl.arange(0, G)
        g_ok = r_ok & (g * G < K)
        b = tl.load(W + r64[:, None] * s_w + bcols[None, :], mask=g_ok[:, None] & (bcols < K // 2)[None, :],
                    other=0).to(tl.int32)
        if WFMT == W_INT4:
            off = tl.full((BLOCK_R,), 8388616.0, tl.float32)            # 2^23 + 8 (+ z): _int4_offset's
            if HAS_Z:
                off += tl.load(Z + r64 * s_s + g, mask=g_ok, other=0).to(tl.float32)
            s = tl.load(S + r64 * s_s + g, mask=g_ok, other=0.0)
            # c ^ 8: two's complement -> code + 8
            lo = _nibble_value((b & 15) ^ 8, off[:, None]) * s[:, None]
            hi = _nibble_value(((b >> 4) & 15) ^ 8, off[:, None]) * s[:, None]
        else:
            sc = tl.load(S + r64 * s_s + g, mask=g_ok, other=127).to(tl.int32)
            bs = block_scale(sc, WFMT)[:, None]
            lo = _e2m1_value(b & 15) * bs
            hi = _e2m1_value((b >> 4) & 15) * bs
        ty = OUT.dtype.element_ty
        v = tl.reshape(tl.join(round_to(lo, ty), round_to(hi, ty)), (BLOCK_R, G))   # codes 2j, 2j + 1 in K order
        tl.store(OUT + r64[:, None] * K + cols[None, :], v, mask=g_ok[:, None] & (cols < K)[None, :])


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, wfmt: int, group: int,
                      zero: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Stacked 4-bit expert weights packed [E, N, K / 2] uint8 with per-group scales [E, N, K / group]
    (int4, wfmt W_INT4: fp32 scales and int zero points `zero`; MXFP4 / NVFP4, wfmt 2 / 3: the
    uint8 scale codes) -> out [E, N, K] (bf16 / fp16, contiguous), one launch; with the routing's
    offsets [E + 1], only the experts that have rows are written. No argument checks (the callers
    check at prepare time)."""
    E, N, Kh = packed.shape
    K, R = 2 * Kh, E * N
    w, s = packed.reshape(R, Kh), scale.reshape(R, -1)
    z = None if zero is None else zero.reshape(R, -1)
    br, span = (16, 64) if interpreting() else (16, 256)
    groups = max(1, span // group)
    launch(_packed_dequant_kernel, (triton.cdiv(R, br), triton.cdiv(triton.cdiv(K, group), groups)), w, s,
           s if z is None else z, out, s if offsets is None else offsets, R, K, N, w.stride(0), s.stride(0),
           WFMT=wfmt, HAS_Z=z is not None, SKIP=offsets is not None, G=group, BLOCK_R=br, GROUPS=groups,
           num_warps=4)
    return out


