"""W4A16 decode GEMM: out[M, N] = x[M, K] @ dequant(W)[N, K].T with 4-bit weights and
bf16 / fp16 activations, for small M (decode, 1..64), where time is spent reading weights.

Weight layout (made at load time by lowbit.ops.weight_only.prepare_w4, recorded in its
metadata): [N, K / 2] uint8 in "planar chunks" of C codes along K -- byte j of chunk c holds
code c*C + j in its low nibble and code c*C + C/2 + j in its high nibble, so both halves of
a chunk multiply a contiguous half of x (no interleaving to undo in registers). int4 codes
are stored offset-binary (code + 8); a nibble u becomes a float exactly with one OR and one
subtraction: float_bits(0x4B000000 | u) - (2^23 + 8 + z) = code - z.
Per-group data [N, K / G] row-major: float32 scales (int4), int8 zero points, uint8 scale
codes (fp4: e8m0 for MXFP4, e4m3 for NVFP4 with a float32 tensor scale).

Exactness: the kernel multiplies activations by exactly representable weights only, so
the rounding is float32 accumulation (and the output cast):
- int4 (C = G): each group's partial x . (q - z) has small-integer weights (products exact
  in float32) and is scaled by the group's fp32 scale afterwards: acc += s_g * partial_g.
- MXFP4: e2m1 value * 2^e is exact in bf16. NVFP4: e2m1 * e4m3 has at most 6 significant
  bits, exact in bf16; the tensor scale g multiplies the float32 result once at the end
  (QTensor's effective scale is float32(e4m3 * g): a relative difference <= 2^-24 per weight).
Two inner products: DOT (tensor cores, BLOCK_M >= 16 rows, rows past M masked) for M > 2,
and GEMV (float32 FMAs and a reduction, no layout change for the tensor cores) for M <= 2.
Split-K adds float32 partials into a zeroed float32 output with atomics. In Triton's CPU
interpreter (no bf16 dot there) the dot operands are widened to float32 first (exact).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fused_quant import round_to

W_INT4, W_UINT4, W_MXFP4, W_NVFP4 = 0, 1, 2, 3


@triton.jit
def _nibble_value(u, off):
    """Nibble u (int32, 0..15) -> float32 u - off_int, exactly: 2^23 + u has the integer in
    its mantissa; `off` = 2^23 + the integer offset (broadcast)."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - off


@triton.jit
def _e2m1_value(c):
    """fp4 e2m1 code (int32, 0..15) -> float32 value (0, .5, 1, 1.5, 2, 3, 4, 6, signed),
    built from bits: 2^(e-1) * (1 + m/2) for e > 0, m/2 for e = 0."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(c):
    """fp8 e4m3fn code (int32) -> float32, exact."""
    e = (c >> 3) & 15
    m = c & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125,
                   (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
    return tl.where((c & 128) != 0, -mag, mag)


@triton.jit
def _product(xa, wa, xb, wb, acc, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """acc + xa @ wa + xb @ wb for x halves [BM, C/2] and weight halves [C/2, BN] (float32,
    exact values), accumulated in float32."""
    if USE_DOT:
        if INTERP:
            acc = tl.dot(xa.to(tl.float32), wa, acc)
            acc = tl.dot(xb.to(tl.float32), wb, acc)
        else:
            acc = tl.dot(xa, wa.to(xa.dtype), acc)
            acc = tl.dot(xb, wb.to(xb.dtype), acc)
    else:
        p = xa.to(tl.float32)[:, :, None] * wa[None, :, :] + xb.to(tl.float32)[:, :, None] * wb[None, :, :]
        acc += tl.sum(p, axis=1)
    return acc


@triton.jit
def _w4a16_kernel(
    X, W, S, Z, SC, GS, BIAS, OUT, M, N, K, K_SPLIT, s_xm, s_wn, s_sn, s_om,
    WFMT: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, G: tl.constexpr, C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
    USE_DOT: tl.constexpr, INTERP: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), split, cdiv(M, BLOCK_M)); each program covers K_SPLIT (a
    multiple of BLOCK_K, itself a multiple of the chunk C) starting at pid_k * K_SPLIT.
    X [M, K]; W [N, K/2] uint8 (planar chunks); S fp32 [N, K/G]; Z int8 [N, K/G];
    SC uint8 [N, K/G]; GS fp32 [1]; OUT [M, N] (float32 when ATOMIC)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    j = tl.arange(0, C // 2)
    x_rows = X + offs_m[:, None].to(tl.int64) * s_xm
    w_cols = W + n64[None, :] * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    for kk in range(0, K_SPLIT, BLOCK_K):
        for t in tl.static_range(BLOCK_K // C):
            kc = tl.multiple_of(k_lo + kk + t * C, C)  # chunk start (alignment hint: 16-byte loads)
            kb = tl.multiple_of(kc // 2, C // 2)
            wp = tl.load(w_cols + (kb + j)[:, None], mask=n_ok[None, :], other=0,
                         eviction_policy="evict_first").to(tl.int32)  # [C/2, BN]
            xa = tl.load(x_rows + (kc + j)[None, :], mask=m_ok[:, None], other=0.0)  # [BM, C/2]
            xb = tl.load(x_rows + (kc + C // 2 + j)[None, :], mask=m_ok[:, None], other=0.0)
            if WFMT <= 1:  # int4 / uint4, chunk = group: one scaled partial per group
                gidx = kc // G
                if WFMT == 0:  # offset-binary int4: value = u - 8
                    off = tl.full((BLOCK_N,), 8388616.0, tl.float32)
                else:
                    off = tl.full((BLOCK_N,), 8388608.0, tl.float32)
                if HAS_Z:
                    off += tl.load(Z + n64 * s_sn + gidx, mask=n_ok, other=0).to(tl.float32)
                wa = _nibble_value(wp & 15, off[None, :])
                wb = _nibble_value(wp >> 4, off[None, :])
                part = _product(xa, wa, xb, wb, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), USE_DOT, INTERP)
                s = tl.load(S + n64 * s_sn + gidx, mask=n_ok, other=0.0)
                acc += part * s[None, :]
            else:  # fp4: dequantize exactly (scale per element's group) and accumulate
                ga = (kc + j) // G
                gb = (kc + C // 2 + j) // G
                sca = tl.load(SC + n64[None, :] * s_sn + ga[:, None], mask=n_ok[None, :], other=127).to(tl.int32)
                scb = tl.load(SC + n64[None, :] * s_sn + gb[:, None], mask=n_ok[None, :], other=127).to(tl.int32)
                if WFMT == 2:  # e8m0: 2^(code - 127), codes in [1, 254]
                    sva = (tl.minimum(tl.maximum(sca, 1), 254) << 23).to(tl.float32, bitcast=True)
                    svb = (tl.minimum(tl.maximum(scb, 1), 254) << 23).to(tl.float32, bitcast=True)
                else:
                    sva = _e4m3_value(sca)
                    svb = _e4m3_value(scb)
                wa = _e2m1_value(wp & 15) * sva
                wb = _e2m1_value(wp >> 4) * svb
                acc = _product(xa, wa, xb, wb, acc, USE_DOT, INTERP)
    if WFMT == 3:
        acc = acc * tl.load(GS)
    o_ptr = OUT + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :]
    o_ok = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(o_ptr, acc, mask=o_ok, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr, round_to(acc, OUT.dtype.element_ty), mask=o_ok)
