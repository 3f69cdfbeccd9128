"""W4A16 on the "planar chunks" layout: the DOT / GEMV decode kernel and the dequantization kernel
for large M (see lowbit.ops.triton.w4a16 for the layout and the exactness argument)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..fused_quant import round_to
from .codes import _fp4_pair, _fp4_scaled, _int4_offset, _nibble_value, _product, _product1
from .codes import WFMT


@triton.jit
def _w4a16_kernel(
    X, W, S, Z, SC, GS, BIAS, OUT, M, N, K, K_SPLIT, s_xm, s_wn, s_sn, s_om,
    WFMT: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, G: tl.constexpr, C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
    USE_DOT: tl.constexpr, INTERP: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), split, cdiv(M, BLOCK_M)); each program covers K_SPLIT (a
    multiple of BLOCK_K, itself a multiple of the chunk C) starting at pid_k * K_SPLIT.
    X [M, K]; W [N, K/2] uint8 (planar chunks); S fp32 [N, K/G]; Z int8 [N, K/G];
    SC uint8 [N, K/G]; GS fp32 [1]; OUT [M, N]; PARTIAL (split-K): a float32
    workspace [split, M, N], this program's partial written at split pid_k (summed by
    lowbit.ops.triton.split_k)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PARTIAL:  # split-K: this split's slice of the float32 workspace (rows of s_om = N elements)
        OUT += pid_k.to(tl.int64) * M * s_om
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
    NG: tl.constexpr = C // 2 // G if C >= 2 * G else 1   # fp4: scale groups per half-chunk (C = G: one)
    for kk in range(0, K_SPLIT, BLOCK_K):
        for t in tl.static_range(BLOCK_K // C):
            kc = tl.multiple_of(k_lo + kk + t * C, C)  # chunk start (alignment hint: 16-byte loads)
            kb = tl.multiple_of(kc // 2, C // 2)
            wp = tl.load(w_cols + (kb + j)[:, None], mask=n_ok[None, :], other=0,
                         eviction_policy="evict_first").to(tl.int32)  # [C/2, BN]
            xa = tl.load(x_rows + (kc + j)[None, :], mask=m_ok[:, None], other=0.0)  # [BM, C/2]
            xb = tl.load(x_rows + (kc + C // 2 + j)[None, :], mask=m_ok[:, None], other=0.0)
            if WFMT <= 1 and C == G:  # int4 / uint4, chunk = group: one scaled partial per group
                gidx = kc // G
                off = _int4_offset(Z, n64 * s_sn + gidx, n_ok, WFMT, HAS_Z, BLOCK_N)
                wa = _nibble_value(wp & 15, off[None, :])
                wb = _nibble_value(wp >> 4, off[None, :])
                part = _product(xa, wa, xb, wb, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), USE_DOT, INTERP)
                s = tl.load(S + n64 * s_sn + gidx, mask=n_ok, other=0.0)
                acc += part * s[None, :]
            elif WFMT <= 1:  # int4 / uint4, chunk = 2 groups (G < 128): each half is one group
                ga = n64 * s_sn + kc // G
                offa = _int4_offset(Z, ga, n_ok, WFMT, HAS_Z, BLOCK_N)
                offb = _int4_offset(Z, ga + 1, n_ok, WFMT, HAS_Z, BLOCK_N)
                zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                pa = _product1(xa, _nibble_value(wp & 15, offa[None, :]), zero, USE_DOT, INTERP)
                pb = _product1(xb, _nibble_value(wp >> 4, offb[None, :]), zero, USE_DOT, INTERP)
                sa = tl.load(S + ga, mask=n_ok, other=0.0)
                sb = tl.load(S + ga + 1, mask=n_ok, other=0.0)
                acc += pa * sa[None, :]
                acc += pb * sb[None, :]
            else:  # fp4: exact weights (e2m1 value times its group's scale) and accumulate
                # a half-chunk of C/2 codes holds C/(2G) whole groups (or, for MXFP4 at C = G = 32,
                # half of one): one scale load and decode per group and column, broadcast over the
                # group's codes through a reshape, instead of a scale gather and decode per weight
                gi = kc // G + tl.arange(0, NG)
                sca = tl.load(SC + n64[None, :] * s_sn + gi[:, None], mask=n_ok[None, :], other=127)  # [NG, BN]
                if C >= 2 * G:   # the high half's groups follow the low half's
                    scb = tl.load(SC + n64[None, :] * s_sn + (gi + NG)[:, None], mask=n_ok[None, :], other=127)
                else:            # C = G: both halves lie in one group
                    scb = sca
                wa = _fp4_scaled(wp & 15, sca, WFMT, NG, C // 2 // NG, BLOCK_N)
                wb = _fp4_scaled(wp >> 4, scb, WFMT, NG, C // 2 // NG, BLOCK_N)
                acc = _product(xa, wa, xb, wb, acc, USE_DOT, INTERP)
    if WFMT == 3:
        acc = acc * tl.load(GS)
    o_ptr = OUT + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :]
    o_ok = m_ok[:, None] & n_ok[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr, round_to(acc, OUT.dtype.element_ty), mask=o_ok)


# ------------------------------------------------------------------------------------------
# Dequantization of a planar-chunks weight to the activation dtype, for large M (prefill),
# where a bf16 tensor-core GEMM (cuBLAS) on the dequantized weight beats unpacking nibbles
# in every tile: one pass writing N*K 16-bit values (~5% of an M = 2048 GEMM's time). The
# weight is made per call and freed with the call's output: nothing is kept.
# Values: int4 / uint4 (code - z) * s in float32, then ONE rounding to the output dtype per
# weight (the only rounding the decode kernel does not make); fp4: e2m1 * e8m0 / e4m3 is exact
# in bf16; NVFP4's tensor scale is left to the caller (it multiplies the fp32 accumulator).
@triton.jit
def _w4_dequant_kernel(W, S, Z, SC, OUT, N, K, s_wn, s_sn, s_on,
                       WFMT: tl.constexpr, HAS_Z: tl.constexpr, G: tl.constexpr, C: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    kc = tl.program_id(1) * C
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    j = tl.arange(0, C // 2)
    wp = tl.load(W + n64[:, None] * s_wn + (kc // 2 + j)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
    if WFMT <= 1:
        ga = n64 * s_sn + kc // G
        gb = ga + (C // 2) // G  # the high half's group: the same one (C = G) or the next (C = 2G)
        offa = _int4_offset(Z, ga, n_ok, WFMT, HAS_Z, BLOCK_N)
        offb = _int4_offset(Z, gb, n_ok, WFMT, HAS_Z, BLOCK_N)
        va = _nibble_value(wp & 15, offa[:, None]) * tl.load(S + ga, mask=n_ok, other=0.0)[:, None]
        vb = _nibble_value(wp >> 4, offb[:, None]) * tl.load(S + gb, mask=n_ok, other=0.0)[:, None]
    else:
        ga = (kc + j) // G
        gb = (kc + C // 2 + j) // G
        sca = tl.load(SC + n64[:, None] * s_sn + ga[None, :], mask=n_ok[:, None], other=127).to(tl.int32)
        scb = tl.load(SC + n64[:, None] * s_sn + gb[None, :], mask=n_ok[:, None], other=127).to(tl.int32)
        va, vb = _fp4_pair(wp, sca, scb, WFMT)
    o = OUT + n64[:, None] * s_on + (kc + j)[None, :]
    ty = OUT.dtype.element_ty
    tl.store(o, round_to(va, ty), mask=n_ok[:, None])
    tl.store(o + C // 2, round_to(vb, ty), mask=n_ok[:, None])
