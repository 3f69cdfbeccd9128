"""W4A16 decode GEMM: out[M, N] = x[M, K] @ dequant(W)[N, K].T with 4-bit weights and
bf16 / fp16 activations, for small M (decode, 1..64), where time is spent reading weights.

Weight layout (what lowbit.ops.weight_only.prepare_w4 produces; no shuffle): the codes
packed by lowbit.pack_int4, [N, K / 2] uint8, k = 2j in the low nibble of byte j and
k = 2j + 1 in the high nibble; per-group data [N, K / G] row-major.

Exactness: the kernel multiplies the activations by exactly representable values only,
so the one rounding source is float32 accumulation (and the output cast):
- int4 (G = 32 or 128, fp32 scales, optional int8 zero points): each group's partial dot
  x . (q - z) has small-integer weights (exact in bf16/fp16; products exact in fp32) and is
  scaled by the group's fp32 scale afterwards: acc += s_g * (x_g . (q_g - z_g)).
- MXFP4 (G = 32, e8m0 scales): e2m1 value * 2^e is exact in bf16, dequantized in registers.
- NVFP4 (G = 16, e4m3 block scales, fp32 tensor scale g): e2m1 value * e4m3 value has at
  most 6 significant bits, exact in bf16; g multiplies the float32 result once at the end.
  (QTensor's effective scale is float32(e4m3 * g); the kernel uses e4m3 * g unrounded, a
  relative difference of at most 2^-24 per weight, inside the tolerance.)
Even k (low nibbles) and odd k (high nibbles) are two dots against x[:, 0::2] and
x[:, 1::2]: no register shuffle is needed to undo the interleaving.

Split-K: with SPLIT, each program covers K / split and adds its float32 partial into a
zeroed float32 output with atomics (summation order then varies from run to run, within
the tolerance). In Triton's CPU interpreter bf16 dots are not supported, so there the
operands are widened to float32 first (exact); the GPU path runs bf16 tensor-core dots.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fused_quant import round_to

W_INT4, W_UINT4, W_MXFP4, W_NVFP4 = 0, 1, 2, 3


@triton.jit
def _e2m1_value(c):
    """fp4 e2m1 code (int32, 0..15) -> float32 value (0, .5, 1, 1.5, 2, 3, 4, 6, signed)."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _e4m3_value(c):
    """fp8 e4m3fn code (int32) -> float32, exact."""
    e = (c >> 3) & 15
    m = c & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125,
                   (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
    return tl.where((c & 128) != 0, -mag, mag)


@triton.jit
def _dot(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b with float32 accumulation; b is float32 or int32 holding values exact in
    a's dtype, cast to it here (kept float32 in the interpreter, which has no bf16 dot)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b.to(a.dtype), acc)


@triton.jit
def _w4a16_kernel(
    X, W, S, Z, SC, GS, BIAS, OUT, M, N, K, K_SPLIT, s_xm, s_wn, s_sn, s_om,
    WFMT: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
    HALF: tl.constexpr, INTERP: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), split, cdiv(M, BLOCK_M)). K_SPLIT (a multiple of BLOCK_K) is
    the K range of one program. X [M, K]; W [N, K/2] uint8; S fp32 [N, K/G] (int4);
    Z int8 [N, K/G]; SC uint8 [N, K/G] scale codes (fp4); GS fp32 [1] (NVFP4); OUT [M, N]
    (float32 when ATOMIC). HALF = G // 2 (int4: one group per dot) or BLOCK_K // 2 (fp4)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    j = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        if WFMT <= 1:  # int4: one scaled partial dot per group of G
            for t in tl.static_range(BLOCK_K // G):
                kg = k0 + t * G
                wp = tl.load(W + n64[None, :] * s_wn + (kg // 2 + j)[:, None], mask=n_ok[None, :],
                             other=0, eviction_policy="evict_first").to(tl.int32)
                lo = wp & 15
                hi = wp >> 4
                if WFMT == 0:  # two's complement nibbles
                    lo = (lo ^ 8) - 8
                    hi = (hi ^ 8) - 8
                gidx = kg // G
                if HAS_Z:
                    z = tl.load(Z + n64 * s_sn + gidx, mask=n_ok, other=0).to(tl.int32)
                    lo = lo - z[None, :]
                    hi = hi - z[None, :]
                xe = tl.load(X + offs_m[:, None] * s_xm + (kg + 2 * j)[None, :], mask=m_ok[:, None], other=0.0)
                xo = tl.load(X + offs_m[:, None] * s_xm + (kg + 2 * j + 1)[None, :], mask=m_ok[:, None],
                             other=0.0)
                part = _dot(xe, lo, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), INTERP)
                part = _dot(xo, hi, part, INTERP)
                s = tl.load(S + n64 * s_sn + gidx, mask=n_ok, other=0.0)
                acc += part * s[None, :]
        else:  # fp4: exact dequantization to bf16 in registers, one dot per BLOCK_K
            wp = tl.load(W + n64[None, :] * s_wn + (k0 // 2 + j)[:, None], mask=n_ok[None, :],
                         other=0, eviction_policy="evict_first").to(tl.int32)
            gi = (k0 + 2 * j) // G  # both nibbles of a byte share a group (G is even)
            sc = tl.load(SC + n64[None, :] * s_sn + gi[:, None], mask=n_ok[None, :], other=127).to(tl.int32)
            if WFMT == 2:
                sv = (tl.minimum(tl.maximum(sc, 1), 254) << 23).to(tl.float32, bitcast=True)
            else:
                sv = _e4m3_value(sc)
            wl = _e2m1_value(wp & 15) * sv
            wh = _e2m1_value(wp >> 4) * sv
            xe = tl.load(X + offs_m[:, None] * s_xm + (k0 + 2 * j)[None, :], mask=m_ok[:, None], other=0.0)
            xo = tl.load(X + offs_m[:, None] * s_xm + (k0 + 2 * j + 1)[None, :], mask=m_ok[:, None], other=0.0)
            acc = _dot(xe, wl, acc, INTERP)
            acc = _dot(xo, wh, acc, INTERP)
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
