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

Second layout "planar8" (int4 / uint4; below): kernels _w4a16_gemv8_kernel (CUDA cores,
M <= 4) and _w4a16_dot8_kernel (tensor cores). Split-K there is atomic as well: the float32
sum order of the partials varies from run to run (the error bound counts `split` extra
roundings either way).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import decode_e4m3fn, decode_e8m0
from .fused_quant import round_to

W_INT4, W_UINT4, W_MXFP4, W_NVFP4 = 0, 1, 2, 3
WFMT = {"int4": W_INT4, "uint4": W_UINT4, "mxfp4": W_MXFP4, "nvfp4": W_NVFP4}  # W4Weight.kind -> WFMT


@triton.jit
def _nibble_value(u, off):
    """Nibble u (int32, 0..15) -> float32 u - off_int, exactly: 2^23 + u has the integer in
    its mantissa; `off` = 2^23 + the integer offset (broadcast)."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - off


@triton.jit
def _int4_offset(Z, zidx, n_ok, WFMT: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_N: tl.constexpr):
    """The constant _nibble_value subtracts per column of one group: 2^23 + 8 (offset-binary
    int4) or 2^23 (uint4), plus the group's zero point (int8 at Z + zidx [BN])."""
    if WFMT == 0:
        off = tl.full((BLOCK_N,), 8388616.0, tl.float32)
    else:
        off = tl.full((BLOCK_N,), 8388608.0, tl.float32)
    if HAS_Z:
        off += tl.load(Z + zidx, mask=n_ok, other=0).to(tl.float32)
    return off


@triton.jit
def _e2m1_half(c):
    """fp4 e2m1 code (int32, 0..15) -> float32 value * 2^-14, exactly: the three magnitude
    bits e1 e0 m placed at fp16 bits 11..9 (exponent field = e, top mantissa bit = m) make
    the fp16 number 2^(e-15) * (1 + m/2) for e > 0 and m * 2^-15 (subnormal) for e = 0,
    i.e. the e2m1 value times 2^-14; the sign goes to bit 15. Three integer operations and a
    conversion per code (building float32 bits directly needs a select for e = 0); the one e2m1
    decoder of the GEMM and the dequant kernels (_e2m1_value)."""
    h = ((c & 7) << 9) | ((c & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp4_scaled(c, sc, WFMT: tl.constexpr, NG: tl.constexpr, L: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exact float32 weights of fp4 codes c [NG * L, BN] (int32) whose runs of L rows share one
    scale code of sc [NG, BN]: the e2m1 value (as value * 2^-14, _e2m1_half) times the block
    scale * 2^14 (exact: a power of two; prepare_w4 refuses MXFP4 scales above 2^113, where
    scale * 2^14 would overflow). e2m1 (2 significant bits) times e8m0 / e4m3 (1 / 4 bits)
    fits bfloat16 exactly, so the tensor-core operand is the exact weight too."""
    s = block_scale(sc.to(tl.int32), WFMT) * 16384.0
    return tl.reshape(tl.reshape(_e2m1_half(c), (NG, L, BLOCK_N)) * s[:, None, :], (NG * L, BLOCK_N))


@triton.jit
def _e2m1_value(c):
    """fp4 e2m1 code (int32, 0..15) -> float32 value (0, .5, 1, 1.5, 2, 3, 4, 6, signed):
    _e2m1_half's value * 2^-14 times 2^14 (exact)."""
    return _e2m1_half(c) * 16384.0


@triton.jit
def block_scale(sc, WFMT: tl.constexpr):
    """The float32 value of an fp4 block's scale code (int32): e8m0 2^(code - 127) for MXFP4
    (WFMT 2; codes clamped to [1, 254]), fp8 e4m3fn for NVFP4 (WFMT 3)."""
    if WFMT == 2:
        return (tl.minimum(tl.maximum(sc, 1), 254) << 23).to(tl.float32, bitcast=True)
    return decode_e4m3fn(sc)


@triton.jit
def _fp4_pair(wp, sca, scb, WFMT: tl.constexpr):
    """Exact float32 values of both nibbles of the bytes wp (int32), each times its block scale."""
    return _e2m1_value(wp & 15) * block_scale(sca, WFMT), _e2m1_value(wp >> 4) * block_scale(scb, WFMT)


@triton.jit
def _product1(x, w, acc, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """acc + x @ w for an x half [BM, C/2] and a weight half [C/2, BN] (float32, exact values),
    accumulated in float32."""
    if USE_DOT:
        if INTERP:
            acc = tl.dot(x.to(tl.float32), w, acc)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    else:
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    return acc


@triton.jit
def _product(xa, wa, xb, wb, acc, USE_DOT: tl.constexpr, INTERP: tl.constexpr):
    """acc + xa @ wa + xb @ wb (both halves of a chunk)."""
    return _product1(xb, wb, _product1(xa, wa, acc, USE_DOT, INTERP), USE_DOT, INTERP)


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
    if ATOMIC:
        tl.atomic_add(o_ptr, acc, mask=o_ok, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr, round_to(acc, OUT.dtype.element_ty), mask=o_ok)


# ------------------------------------------------------------------------------------------
# "gemv8": a CUDA-core GEMV for decode (M = 1..4 rows per program), int4 / uint4 only, on
# the "planar8" layout (lowbit.ops.weight_only.prepare_w4(wq, layout="planar8")): int32
# words [N, K / 8]; word t of chunk c (C = G codes, C / 8 words) holds code c*C + p*(C/8) + t
# in nibble p (bits 4p..4p+3). So nibble plane p of a run of words multiplies a contiguous
# run of x (vector loads of x), and each 16-byte load of weights gives 32 codes.
#
# Nibble -> float with one LOP3 and one FADD, exactly: for a nibble u at bits pos..pos+3 of
# a word (pos <= 16, inside the float32 mantissa), float_bits((word & (15 << pos)) |
# exponent_bits(23 - pos)) = 2^(23-pos) + u exactly (the nibble's mantissa weight 2^(pos-23)
# times 2^(23-pos) is 1); subtracting the constant 2^(23-pos) + 8 + z (exactly representable,
# an integer below 2^24) gives u - 8 - z exactly (Sterbenz). Nibbles 5..7 (bits 20..31) are
# taken from word >> 12 at bits 8, 12, 16 (one shift for three nibbles). Per weight: ~1 LOP3,
# 1 FADD, 1 FFMA (+1/8 shift); x products are exact in float32 (8 x 5 significant bits),
# each group's partial sum is scaled once per group: acc += s_g * sum_k x_k (q_k - z_g).
# ------------------------------------------------------------------------------------------
@triton.jit
def _and_or(a, mask: tl.constexpr, bits: tl.constexpr, INTERP: tl.constexpr):
    """(a & mask) | bits for int32 a. On the GPU one lop3 (LUT 0xEA = (x & y) | z) with both
    constants in registers: written as Triton ops, ptxas emits an AND and an OR (a LOP3 takes
    one immediate), one extra instruction per weight. The interpreter has no inline PTX."""
    if INTERP:
        return (a & mask) | bits
    else:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [a, tl.full(a.shape, mask, tl.int32), tl.full(a.shape, bits, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _row_value(P, idx, n_ok, t, EVEN_N: tl.constexpr):
    """P[idx] per row as a [BN, 1] tile in the weights' register layout. A plain 1-D (or
    [BN, 1]) load gets a layout of its own from Triton, and meeting the weights' layout then
    costs a shared-memory round trip and a barrier per group; a [BN, KW] load whose pointers
    run along K like the weights' gets their layout, so it is loaded that way with only the
    column t = 0 unmasked and summed along K (other columns add exact zeros)."""
    if EVEN_N:
        v = tl.load(P + idx[:, None] + t[None, :], mask=(t == 0)[None, :], other=0)
    else:
        v = tl.load(P + idx[:, None] + t[None, :], mask=n_ok[:, None] & (t == 0)[None, :], other=0)
    return tl.sum(v, axis=1, keep_dims=True)


@triton.jit
def _gemv8_row(acc, f, x_ptr, m_ok, p: tl.constexpr, EVEN_M: tl.constexpr):
    """acc [BN, KW] + f [BN, KW] * x_ptr[0, :] (x_ptr [1, KW]: one row of x at the plane's
    codes, loaded as float32); p = 0 starts the sum (no zeroed registers)."""
    if EVEN_M:
        xp = tl.load(x_ptr).to(tl.float32)  # [1, KW]
    else:
        xp = tl.load(x_ptr, mask=m_ok, other=0.0).to(tl.float32)
    if p == 0:
        acc = f * xp
    else:
        acc = acc + f * xp
    return acc


@triton.jit
def _gemv8_store(acc, OUT, BIAS, row, M, offs_n, n_ok, s_om, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr):
    out = tl.sum(acc, axis=1)
    o_ok = n_ok & (row < M)
    o_ptr = OUT + row.to(tl.int64) * s_om + offs_n
    if ATOMIC:
        tl.atomic_add(o_ptr, out, mask=o_ok, sem="relaxed")
    else:
        if HAS_BIAS:
            out += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(o_ptr, round_to(out, OUT.dtype.element_ty), mask=o_ok)


@triton.jit
def _w4a16_gemv8_kernel(
    X, W, S, Z, BIAS, OUT, M, N, K, K_SPLIT, s_xm, s_wn, s_sn, s_om,
    SIGNED: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, INTERP: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), split, cdiv(M, BLOCK_M)); each program covers K_SPLIT codes
    (a multiple of BLOCK_K, itself a multiple of C = G) from pid_k * K_SPLIT, for BLOCK_M
    (1, 2 or 4) rows of x, each with its own [BLOCK_N, C/8] float32 accumulator (2-D tiles
    only: one register layout for weights, x and accumulators, no shared-memory shuffles).
    X [M, K] bf16/fp16; W int32 [N, K/8] (planar8, s_wn in words); S fp32 [N, K/G];
    Z int8 [N, K/G]; OUT [M, N] (float32 when ATOMIC)."""
    KW: tl.constexpr = C // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    t = tl.arange(0, KW)
    k_lo = tl.multiple_of(pid_k * K_SPLIT, C)  # K_SPLIT is a multiple of C: 16-byte aligned loads
    # pointers move by one scalar per loop step; chunk / plane offsets are constants that
    # fold into the load instructions
    w_ptr = W + n64[:, None] * s_wn + (tl.multiple_of(k_lo // 8, KW) + t)[None, :]  # [BN, KW]
    x_ptr = X + m0.to(tl.int64) * s_xm + (k_lo + t)[None, :]            # [1, KW]
    s_ptr = n64 * s_sn + k_lo // C                                      # [BN] element index
    acc0 = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):
        for ci in tl.static_range(BLOCK_K // C):
            if EVEN_N:  # N % BLOCK_N == 0: no masks, no zeroed registers for masked lanes
                wd = tl.load(w_ptr + ci * KW, eviction_policy="evict_first")  # [BN, KW] int32
            else:
                wd = tl.load(w_ptr + ci * KW, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
            g = s_ptr + ci
            xc = x_ptr + ci * C
            if SIGNED:
                off = tl.full((BLOCK_N, 1), 8.0, tl.float32)
            else:
                off = tl.zeros((BLOCK_N, 1), tl.float32)
            if HAS_Z:
                off += _row_value(Z, g, n_ok, t, EVEN_N).to(tl.float32)
            p0 = tl.zeros((BLOCK_N, KW), dtype=tl.float32)  # (the zeros fold into the first FMA)
            p1 = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
            p2 = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
            p3 = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
            for p in tl.static_range(8):
                SH = 12 * (p // 5)                  # nibbles 5..7 from word >> 12
                POS = 4 * p - SH                    # 0, 4, .., 16, then 8, 12, 16
                EXP = (150 - POS) << 23             # float bits of 2^(23 - POS)
                bits = _and_or(wd >> SH, 15 << POS, EXP, INTERP)
                base = tl.full((BLOCK_N, 1), EXP, tl.int32).to(tl.float32, bitcast=True) + off
                f = bits.to(tl.float32, bitcast=True) - base           # q - z, exact
                p0 = _gemv8_row(p0, f, xc + p * KW, m0 < M, p, EVEN_M)
                if BLOCK_M >= 2:
                    p1 = _gemv8_row(p1, f, xc + s_xm + p * KW, m0 + 1 < M, p, EVEN_M)
                if BLOCK_M >= 4:
                    p2 = _gemv8_row(p2, f, xc + 2 * s_xm + p * KW, m0 + 2 < M, p, EVEN_M)
                    p3 = _gemv8_row(p3, f, xc + 3 * s_xm + p * KW, m0 + 3 < M, p, EVEN_M)
            s = _row_value(S, g, n_ok, t, EVEN_N)
            acc0 += p0 * s
            if BLOCK_M >= 2:
                acc1 += p1 * s
            if BLOCK_M >= 4:
                acc2 += p2 * s
                acc3 += p3 * s
        w_ptr += BLOCK_K // 8
        x_ptr += BLOCK_K
        s_ptr += BLOCK_K // C
    _gemv8_store(acc0, OUT, BIAS, m0, M, offs_n, n_ok, s_om, HAS_BIAS, ATOMIC)
    if BLOCK_M >= 2:
        _gemv8_store(acc1, OUT, BIAS, m0 + 1, M, offs_n, n_ok, s_om, HAS_BIAS, ATOMIC)
    if BLOCK_M >= 4:
        _gemv8_store(acc2, OUT, BIAS, m0 + 2, M, offs_n, n_ok, s_om, HAS_BIAS, ATOMIC)
        _gemv8_store(acc3, OUT, BIAS, m0 + 3, M, offs_n, n_ok, s_om, HAS_BIAS, ATOMIC)


@triton.jit
def _half2_planes(wd, cpair, i: tl.constexpr, HALF: tl.constexpr):
    """Nibble planes i and i + 4 of the words wd (int32 [BN, KW]) as exact 16-bit floats
    q - z, two weights per instruction: (wd >> 4i) & 0x000F000F | magic puts nibble i in the
    low half and nibble i + 4 in the high half of a packed pair whose halves read 2^e + u
    (bf16: 128 + u, magic 0x43004300; fp16: 1024 + u, 0x64006400; u sits in the low mantissa
    bits, ulp 1); one packed subtraction of cpair (both halves 2^e + offset + z, exact) leaves
    u - offset - z exactly. GPU only (inline PTX); returns (plane i, plane i + 4)."""
    if HALF == 1:
        magic = tl.full(wd.shape, 0x43004300, tl.int32)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, $4, 0xEA; sub.rn.bf16x2 t, t, $3; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r", [wd >> (4 * i), cpair, magic], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        magic = tl.full(wd.shape, 0x64006400, tl.int32)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, $4, 0xEA; sub.rn.f16x2 t, t, $3; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r", [wd >> (4 * i), cpair, magic], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def _w4a16_dot8_kernel(
    X, W, S, Z, BIAS, OUT, M, N, K, K_SPLIT, s_xm, s_wn, s_sn, s_om,
    SIGNED: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
    INTERP: tl.constexpr, UNPACK: tl.constexpr = 0,
):
    """"dot8": the tensor-core form on the planar8 layout, for M = 16..64. Per group and
    nibble plane p, the weights' plane (exact q - z from one lop3 + one FADD, as in gemv8,
    then bf16: |q - z| <= 15 is exact) is a [C/8, BLOCK_N] operand of one tl.dot against the
    plane's x columns [BLOCK_M, C/8] (contiguous codes p*C/8 + t); the 8 products of a group
    add into a float32 partial that is scaled once: acc += s_g * partial. C/8 >= 16 (G >= 128).
    Grid and arguments as _w4a16_gemv8_kernel (BLOCK_M >= 16, rows past M masked).
    UNPACK 1 (GPU only): planes straight to packed bf16 / fp16 pairs (_half2_planes: ~1.5
    instructions per 2 weights instead of ~2.5 per weight), same exact values."""
    KW: tl.constexpr = C // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    t = tl.arange(0, KW)
    k_lo = tl.multiple_of(pid_k * K_SPLIT, C)
    w_ptr = W + n64[:, None] * s_wn + (tl.multiple_of(k_lo // 8, KW) + t)[None, :]   # [BN, KW]
    x_ptr = X + offs_m.to(tl.int64)[:, None] * s_xm + (k_lo + t)[None, :]            # [BM, KW]
    s_idx = n64 * s_sn + k_lo // C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):
        for ci in tl.static_range(BLOCK_K // C):
            wd = tl.load(w_ptr + ci * KW, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
            if SIGNED:
                off = tl.full((BLOCK_N, 1), 8.0, tl.float32)
            else:
                off = tl.zeros((BLOCK_N, 1), tl.float32)
            if HAS_Z:
                off += tl.load(Z + s_idx + ci, mask=n_ok, other=0).to(tl.float32)[:, None]
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if UNPACK == 1 and not INTERP:
                # both halves: 2^e + offset + z as 16-bit float bits (2^e = 128 bf16, 1024 fp16)
                if X.dtype.element_ty == tl.bfloat16:
                    cbits = 0x4300 | off.to(tl.int32)
                else:
                    cbits = 0x6400 | off.to(tl.int32)
                cpair = tl.broadcast_to(cbits * 65537, (BLOCK_N, KW))
                for i in tl.static_range(4):
                    fa, fb = _half2_planes(wd, cpair, i, 1 if X.dtype.element_ty == tl.bfloat16 else 2)
                    xa = tl.load(x_ptr + (ci * C + i * KW), mask=m_ok[:, None], other=0.0)
                    xb = tl.load(x_ptr + (ci * C + (i + 4) * KW), mask=m_ok[:, None], other=0.0)
                    part = tl.dot(xa, tl.trans(fa), part)
                    part = tl.dot(xb, tl.trans(fb), part)
            else:
                for p in tl.static_range(8):
                    SH = 12 * (p // 5)
                    POS = 4 * p - SH
                    EXP = (150 - POS) << 23
                    bits = _and_or(wd >> SH, 15 << POS, EXP, INTERP)
                    base = tl.full((BLOCK_N, 1), EXP, tl.int32).to(tl.float32, bitcast=True) + off
                    f = bits.to(tl.float32, bitcast=True) - base                  # [BN, KW] q - z, exact
                    xp = tl.load(x_ptr + (ci * C + p * KW), mask=m_ok[:, None], other=0.0)   # [BM, KW]
                    if INTERP:  # the interpreter has no bf16 dot: float32 operands (exact values)
                        part = tl.dot(xp.to(tl.float32), tl.trans(f), part)
                    else:
                        part = tl.dot(xp, tl.trans(f.to(xp.dtype)), part)
            s = tl.load(S + s_idx + ci, mask=n_ok, other=0.0)
            acc += part * s[None, :]
        w_ptr += BLOCK_K // 8
        x_ptr += BLOCK_K
        s_idx += BLOCK_K // C
    o_ptr = OUT + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :]
    o_ok = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(o_ptr, acc, mask=o_ok, sem="relaxed")
    else:
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


# ------------------------------------------------------------------------------------------
# "pairs": tensor cores fed straight from registers, for every M (decode and up to 64 rows),
# int4 / uint4 at group 32, 64 or a multiple of 128, MXFP4 and NVFP4 (the fp4 part below,
# _pairs_chunk_fp4) (lowbit.ops.weight_only.prepare_w4(wq, layout="pairs")). Little-endian int32 words [N, K / 8]; a chunk of 128 codes is 16 words
# and 4 planes of 32 codes (plane i: codes 32i .. 32i + 31 of the chunk, a contiguous run of
# x). Word w holds, for each plane i, the two ADJACENT codes 2P and 2P + 1 of pair P of the
# plane: code 2P in nibble i (bits 4i..4i+3), code 2P + 1 in nibble i + 4 (bits 16+4i..). So one
# lop3 on (word >> 4i) gives a packed 16-bit pair (2^e + u_2P, 2^e + u_2P+1) and one packed
# subtraction the exact pair (q - z) -- which is exactly what a tensor-core operand register
# holds: two consecutive K values of one row. About 11 instructions per 8 weights instead of
# ~25 (gemv8's float32 lop3 + FADD + FFMA), and no register shuffles if the words already sit
# where the mma operand wants them:
#
# The kernel computes out^T = W x^T (weights as the mma's A operand: 16 weight rows per
# instruction, x padded to the instruction's 8 / 16 columns). A coalesced 16-byte load gives
# a thread 4 consecutive words of one row; the A operand layout wants, per thread, rows g and
# g + 8 and (in Triton's mma v2, kWidth 4) pairs {P, P + 1, P + 8, P + 9}-like patterns. Any
# consistent permutation of the weight rows and of K gives the same sums, so the kernel
# RELABELS the loaded tile (a reshape / permute that moves no data: _pairs_relabel) so that
# logical row n and logical pair P sit where the mma wants them, and then
#   - loads per-row data (scales, zero points) and stores outputs at the rows' physical
#     indices (_pairs_row_perm);
#   - the words' content makes logical pair P of the wgmma order (M >= 16) hold codes 2P,
#     2P + 1 of the plane (the layout's word order, weight_only._pairs_words), so x -- many
#     rows there -- is read contiguously; for mma v2 (M <= 8: a different K order, one to
#     eight rows of x) x is relabelled too (_pairs_x).
# The permutation is pure index arithmetic: correctness never depends on Triton's layout
# choice (the interpreter runs the same relabelling); only the speed does (sm_90 SASS counts:
# python -m lowbit.bench.memory --sass, no shuffles in the K loop).
# Exactness: as gemv8 / dot8 (exact q - z in bf16 / fp16, exact products, float32
# accumulation, one scale product per group), so the same error bound holds.
# ------------------------------------------------------------------------------------------
@triton.jit
def _pairs_row_perm(j, WARPS: tl.constexpr):
    """Physical row (within the tile) of logical row j: a 16-byte load spreads rows as
    lane + 8 warp + 8 WARPS reg; the mma A operand wants lane + 8 reg_lo + 16 warp + 16 WARPS reg_hi."""
    lane = j % 8
    r_lo = (j // 8) % 2
    warp = (j // 16) % WARPS
    r_hi = j // (16 * WARPS)
    return lane + 8 * warp + 8 * WARPS * (r_lo + 2 * r_hi)


@triton.jit
def _pairs_relabel(wd, BLOCK_N: tl.constexpr, WARPS: tl.constexpr, V3: tl.constexpr):
    """wd [BN, 16] words in load order -> [BN, 16] with logical rows (_pairs_row_perm) and
    logical pairs: word w = (w3 w2 w1 w0 in bits) is pair P = (w1 w3 w2 w0) for mma v2 and
    (w1 w0 w3 w2) for wgmma (V3), the order each operand layout takes from a thread's 4
    consecutive words and its lane."""
    t = tl.reshape(wd, (BLOCK_N // (16 * WARPS), 2, WARPS, 8, 2, 2, 2, 2))
    if V3:
        t = tl.permute(t, (0, 2, 1, 3, 6, 7, 4, 5))
    else:
        t = tl.permute(t, (0, 2, 1, 3, 6, 4, 5, 7))
    return tl.reshape(t, (BLOCK_N, 16))


@triton.jit
def _pairs_x(xp, BLOCK_M: tl.constexpr, V3: tl.constexpr):
    """x [BM, 32] of a plane (loaded contiguously) in the dot's logical K order: as is for
    wgmma (the words' content is laid out for its order); for mma v2, logical pair P = (P3 P2
    P1 P0) sits on the word holding pair (P3 P0 P2 P1), so x is relabelled the same way."""
    if V3:
        return xp
    t = tl.permute(tl.reshape(xp, (BLOCK_M, 2, 2, 2, 2, 2)), (0, 1, 3, 4, 2, 5))
    return tl.reshape(t, (BLOCK_M, 32))


@triton.jit
def _pairs_plane(wd, cpair, off, i: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                 INTERP: tl.constexpr):
    """Plane i of the (relabelled) words wd [BN, 16]: [BN, 32] exact q - z (pairs 2P, 2P + 1 side
    by side). GPU: one lop3 + one packed subtraction per pair (_half2_planes); the interpreter
    (no inline PTX): the same values in float32 (off [BN, 16]: the integer offset 8 + z / z)."""
    if INTERP:
        lo = ((wd >> (4 * i)) & 15).to(tl.float32) - off
        hi = ((wd >> (16 + 4 * i)) & 15).to(tl.float32) - off
    else:
        lo, hi = _half2_planes(wd, cpair, i, HALF)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, 32))


@triton.jit
def _pairs_raw(P, idx, ok, NC: tl.constexpr):
    """P[idx] for the columns < NC of idx [BN, 16] (per PHYSICAL row: the row's first per-group
    element of a K step plus the column), zero elsewhere: one K step's scales / zero points / fp4
    scale words. A load whose pointers run along the words' 16 columns takes their register layout
    (a 1-D load gets a layout of its own, and meeting the dot's result layout then costs a shared-
    memory round trip and two barriers per group, which stalls every warp of the program); the
    kernel loads these tiles with the weights, ahead of the step that uses them."""
    col = tl.arange(0, 16)[None, :]
    return tl.load(P + idx, mask=ok & (col < NC), other=0)


@triton.jit
def _pairs_pick(raw, c: tl.constexpr):
    """Column c of a raw tile as [BN, 1] in the words' load layout (the other columns add exact zeros)."""
    col = tl.arange(0, 16)[None, :]
    return tl.sum(tl.where(col == c, raw, 0), axis=1, keep_dims=True)


@triton.jit
def _pairs_row_scale(sraw, c: tl.constexpr, BLOCK_N: tl.constexpr, WARPS: tl.constexpr, V3: tl.constexpr):
    """Column c of a raw float32 tile per LOGICAL row, [BN, 1], in the rows' layout of the dot's
    result: broadcast along the words' columns, relabelled like the words (no data moves), reduced
    (a max of equal values: warp shuffles, no shared memory)."""
    v = tl.broadcast_to(_pairs_pick(sraw, c), (BLOCK_N, 16))
    return tl.max(_pairs_relabel(v, BLOCK_N, WARPS, V3), axis=1, keep_dims=True)


@triton.jit
def _pairs_offset(zraw, c: tl.constexpr, SIGNED: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_N: tl.constexpr,
                  HALF: tl.constexpr, WARPS: tl.constexpr, V3: tl.constexpr):
    """(offset [BN, 16] int32, packed 16-bit pair of 2^e + offset [BN, 16]) for one group, in the
    relabelled words' order: offset = 8 (int4 offset binary) or 0, plus the zero point (column c
    of the raw int8 tile zraw, per PHYSICAL row), broadcast along the columns before the
    relabelling, which then moves no data; 2^e = 128 (bf16) / 1024 (fp16)."""
    if SIGNED:
        off = tl.full((BLOCK_N, 16), 8, tl.int32)
    else:
        off = tl.zeros((BLOCK_N, 16), tl.int32)
    if HAS_Z:
        z = _pairs_pick(zraw.to(tl.int32), c)
        off += _pairs_relabel(tl.broadcast_to(z, (BLOCK_N, 16)), BLOCK_N, WARPS, V3)
    if HALF == 1:
        bits = 0x4300 | off
    else:
        bits = 0x6400 | off
    return off, bits * 65537


@triton.jit
def _pairs_dot(f, xp, part, INTERP: tl.constexpr):
    """part + f [BN, k] @ xp [BM, k]^T in float32 (the pairs kernels' one dot: weights as A)."""
    if INTERP:  # the interpreter has no bf16 dot: float32 operands (exact values)
        return tl.dot(f, tl.trans(xp.to(tl.float32)), part)
    return tl.dot(f, tl.trans(xp), part)


@triton.jit
def _pairs_chunk(acc, wd, c: tl.constexpr, kx, X_ROWS, sraw, zraw, m_ok,
                 SIGNED: tl.constexpr, HAS_Z: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, WARPS: tl.constexpr, V3: tl.constexpr, HALF: tl.constexpr,
                 INTERP: tl.constexpr):
    """acc [BN, BM] + chunk c (0 or 1) of a K step: 128 codes (words wd [BN, 16] as loaded; x at
    X_ROWS [BM, 32] pointers + kx, the chunk's offset in this program's K range; sraw / zraw the
    step's raw scale / zero-point tiles, _pairs_raw): four planes, one dot each, each scale
    group's partial scaled once (PG planes per group)."""
    PG: tl.constexpr = G // 32 if G < 128 else 4
    wd = _pairs_relabel(wd, BLOCK_N, WARPS, V3)
    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in tl.static_range(4):
        q = (128 * c + 32 * i) // G    # (a constant) the group's column in the step's raw tiles
        if i % PG == 0:                          # a scale group starts at this plane
            off, cpair = _pairs_offset(zraw, q, SIGNED, HAS_Z, BLOCK_N, HALF, WARPS, V3)
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        f = _pairs_plane(wd, cpair, off.to(tl.float32), i, HALF, BLOCK_N, INTERP)
        xp = _pairs_x(tl.load(X_ROWS + (kx + 32 * i), mask=m_ok[:, None], other=0.0), BLOCK_M, V3)   # [BM, 32]
        part = _pairs_dot(f, xp, part, INTERP)
        if i % PG == PG - 1:                     # ... and ends here: scale it once
            acc += part * _pairs_row_scale(sraw, q, BLOCK_N, WARPS, V3)
    return acc


# fp4 weights (MXFP4, NVFP4) in the same words: nibble = the e2m1 code (s e1 e0 m) as stored.
# On the GPU a plane's pair is built in packed bf16: the magnitude bits shifted to bits 8..6 and
# 24..22 (exponent field e, top mantissa bit m) and the signs to bits 15 / 31 read as the bf16
# number t = value * 2^-126 (subnormal for e = 0, exactly as e2m1's own subnormal), and one packed
# multiplication t * K by a bf16 pair (K, K) makes the weight (5 instructions per 2 weights; a
# layout that needs one shift per plane does not exist: the sign sits 9 bits above the magnitude
# field in bf16, and four such 4-bit patterns cannot tile a 16-bit half).
# K carries the block scale ("folded" scales): the tensor cores then get value * scale * 2^c,
# and every plane's dot accumulates straight into the one float32 accumulator (no per-block
# float32 partial to zero, scale and add: at 64 rows of x that was more work than the dot);
# the constant 2^-c comes back with the epilogue's one multiplication.
#   NVFP4: K = s * 2^118 (s the e4m3 scale; <= 448 * 2^118 < 2^127), f = t * K = value * s * 2^-8.
#     e2m1 (2 significant bits) * e4m3 (4 bits) fits bf16's 8 exactly, >= 2^-19 (normal). K from
#     the code: its 7 magnitude bits at bf16 bits 10..4 read as s * 2^-120 (e4m3 subnormals
#     included: both formats' subnormals sit 120 binades apart), times 2^119 twice.
#   MXFP4: K = 2^(E + D - 127) (E the e8m0 code, D = W4Weight.fp4_exp_offset, per tensor), f =
#     value * 2^(E + D - 253); prepare_w4 picks D so that every block holding a nonzero code has
#     128 <= E + D <= 254: K is a normal bf16 (bits (E + D) << 7: one add) and so is f. Where the
#     tensor's scales span more than 2^126 (no such D; not real weights), D is None and each
#     plane's dot is scaled in float32 as before (K = 2^126: f = the e2m1 value).
# Products f * x are exact in float32 (<= 14 significant bits) unless they fall below 2^-126 in
# this scaled domain; such a product errs by < 2^-149 there, a float32 rounding's worth of the
# largest product as long as the activations are above ~2^-100 (the largest block's f is >= 1:
# MXFP4's D makes it so; NVFP4's smallest f is 2^-19): the int4 kernels' error bound holds.
@triton.jit
def _fp4_plane(wd, i: tl.constexpr, mult, INTERP: tl.constexpr):
    """Plane i of fp4 words wd [R, C] (relabelled) times the multiplier (broadcast to [R, C]):
    [R, 2C], pairs 2P, 2P + 1 side by side. GPU: bfloat16 t * K, mult = the packed bf16 pair (K, K)
    (int32); interpreter: float32 value * mult, mult = K * 2^-126 (float32): the same numbers."""
    if INTERP:
        lo = _e2m1_value((wd >> (4 * i)) & 15) * mult
        hi = _e2m1_value((wd >> (16 + 4 * i)) & 15) * mult
    else:
        # magnitude bits of nibbles i / i + 4 to bits 8..6 / 24..22, their signs to bits 15 / 31
        if i < 2:
            mag = wd << (6 - 4 * i)
        else:
            mag = wd >> (4 * i - 6)
        if i < 3:
            sgn = wd << (12 - 4 * i)
        else:
            sgn = wd
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 a, t; and.b32 a, $2, 0x01C001C0; lop3.b32 t, $3, 0x80008000, a, 0xEA; "
            "mul.rn.bf16x2 t, t, $4; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r", [mag, sgn, tl.broadcast_to(mult, wd.shape)], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=1)
    return tl.reshape(tl.join(lo, hi), (wd.shape[0], 2 * wd.shape[1]))


@triton.jit
def _fp4_unit(shape, INTERP: tl.constexpr):
    """The multiplier K = 2^126 (f = the e2m1 value) for the planes of unfolded MXFP4 scales."""
    if INTERP:
        return tl.full(shape, 1.0, tl.float32)
    return tl.full(shape, 0x7E807E80, tl.int32)


@triton.jit
def _fp4_mults(sw, WFMT: tl.constexpr, dexp, INTERP: tl.constexpr):
    """The multipliers K (see above) of the 4 blocks whose scale codes are the bytes of sw (int32
    tile; byte j = block j): a tuple of 4 tiles like sw. GPU: packed bf16 pairs (K, K) from both
    halves at once -- bytes 0 / 2 to the low / high half, bytes 1 / 3 likewise, one prmt each to
    duplicate a half; interpreter: float32 K * 2^-126. dexp = D (MXFP4)."""
    if INTERP:
        if WFMT == 3:
            return (decode_e4m3fn(sw & 255) * 0.00390625, decode_e4m3fn((sw >> 8) & 255) * 0.00390625,
                    decode_e4m3fn((sw >> 16) & 255) * 0.00390625, decode_e4m3fn((sw >> 24) & 255) * 0.00390625)
        e0 = (sw & 255) + dexp - 126        # float32 exponent field of 2^(E + D - 253); blocks with
        e1 = ((sw >> 8) & 255) + dexp - 126  # E + D < 127 hold only zero codes (prepare_w4): K = 0
        e2 = ((sw >> 16) & 255) + dexp - 126
        e3 = ((sw >> 24) & 255) + dexp - 126
        return (tl.where(e0 > 0, e0 << 23, 0).to(tl.float32, bitcast=True),
                tl.where(e1 > 0, e1 << 23, 0).to(tl.float32, bitcast=True),
                tl.where(e2 > 0, e2 << 23, 0).to(tl.float32, bitcast=True),
                tl.where(e3 > 0, e3 << 23, 0).to(tl.float32, bitcast=True))
    if WFMT == 3:
        # (b0, b2) and (b1, b3): magnitude bits to 10..4 / 26..20, signs to 15 / 31 (s * 2^-120 in
        # bf16), then two multiplications by 2^119 (0x7B00)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 a, b, t; shl.b32 a, $4, 4; shl.b32 t, $4, 8; and.b32 t, t, 0x80008000; "
            "lop3.b32 a, a, 0x07F007F0, t, 0xEA; shr.b32 b, $4, 4; and.b32 t, $4, 0x80008000; "
            "lop3.b32 b, b, 0x07F007F0, t, 0xEA; mov.b32 t, 0x7B007B00; "
            "mul.rn.bf16x2 a, a, t; mul.rn.bf16x2 a, a, t; mul.rn.bf16x2 b, b, t; mul.rn.bf16x2 b, b, t; "
            "prmt.b32 $0, a, a, 0x1010; prmt.b32 $1, b, b, 0x1010; prmt.b32 $2, a, a, 0x3232; "
            "prmt.b32 $3, b, b, 0x3232; }",
            "=r,=r,=r,=r,r", [sw], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    # MXFP4: (E + D) << 7 per half, E0 / E2 and E1 / E3 at once
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, b; shl.b32 a, $4, 7; and.b32 a, a, 0x7F807F80; add.u32 a, a, $5; "
        "shr.b32 b, $4, 1; and.b32 b, b, 0x7F807F80; add.u32 b, b, $5; "
        "prmt.b32 $0, a, a, 0x1010; prmt.b32 $1, b, b, 0x1010; prmt.b32 $2, a, a, 0x3232; "
        "prmt.b32 $3, b, b, 0x3232; }",
        "=r,=r,=r,=r,r,r", [sw, tl.zeros(sw.shape, tl.int32) + (dexp << 7) * 65537],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _plane_mults(ka, kb, BLOCK_N: tl.constexpr, WARPS: tl.constexpr, V3: tl.constexpr):
    """The multipliers of one plane's words: ka for logical pairs 0-7 (the plane's codes 0-15), kb
    for pairs 8-15 (codes 16-31; NVFP4's second block; MXFP4 passes ka twice). ka, kb [BN, 1] per
    PHYSICAL row in the words' load layout; a word's pair P has bit 3 = bit 1 of its column w in
    both operand orders (_pairs_relabel), so the choice is by column before the relabelling
    (known per register at compile time: a thread's 4 words are columns 4j..4j+3), which then
    moves no data (as _pairs_offset's)."""
    w = tl.arange(0, 16)[None, :]
    return _pairs_relabel(tl.where((w & 2) != 0, kb, ka), BLOCK_N, WARPS, V3)


@triton.jit
def _scaled_dot(acc, f, xp, s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
    """acc [BN, BM] + s[:, None] * (f [BN, k] @ xp[BM, k]^T): one block's float32 dot, scaled once."""
    return acc + _pairs_dot(f, xp, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), INTERP) * s[:, None]


@triton.jit
def _pairs_chunk_fp4(acc, wd, c: tl.constexpr, kc, kx, X_ROWS, SCW, scraw, sc_log, n_ok, m_ok, dexp,
                     WFMT: tl.constexpr, FOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     WARPS: tl.constexpr, V3: tl.constexpr, INTERP: tl.constexpr):
    """_pairs_chunk for fp4 words (chunk c of a K step starting at code kc). The chunk's 4 e8m0
    codes (MXFP4, one per plane) or 8 e4m3 codes (NVFP4, two per plane) are one or two int32 words
    per row of SCW (the uint8 block-scale codes [N, K/G]): columns c (MXFP4) or 2c, 2c + 1 (NVFP4)
    of the step's raw tile scraw (_pairs_raw, loaded ahead with the weights). FOLD: the scales go
    into the multipliers K (above) and each plane is one K = 32 dot into the accumulator. Else
    (MXFP4 only, scales spanning more than 2^126) each plane's float32 dot is scaled by its block's
    scale (sc_log: the rows' first scale word, logical rows)."""
    wd = _pairs_relabel(wd, BLOCK_N, WARPS, V3)
    if FOLD:
        if WFMT == 3:
            mults = _fp4_mults(_pairs_pick(scraw, 2 * c), WFMT, dexp, INTERP) + \
                _fp4_mults(_pairs_pick(scraw, 2 * c + 1), WFMT, dexp, INTERP)   # blocks 0-3, 4-7
        else:
            mults = _fp4_mults(_pairs_pick(scraw, c), WFMT, dexp, INTERP)
    else:
        unit = _fp4_unit(wd.shape, INTERP)
        sw = tl.load(SCW + sc_log + kc // 128, mask=n_ok, other=0)
    for i in tl.static_range(4):
        xp = _pairs_x(tl.load(X_ROWS + (kx + 32 * i), mask=m_ok[:, None], other=0.0), BLOCK_M, V3)   # [BM, 32]
        if FOLD:  # plane i: NVFP4 blocks 2i and 2i + 1, MXFP4 block i
            if WFMT == 3:
                k = _plane_mults(mults[2 * i], mults[2 * i + 1], BLOCK_N, WARPS, V3)
            else:
                k = _plane_mults(mults[i], mults[i], BLOCK_N, WARPS, V3)
            acc = _pairs_dot(_fp4_plane(wd, i, k, INTERP), xp, acc, INTERP)
        else:
            acc = _scaled_dot(acc, _fp4_plane(wd, i, unit, INTERP), xp, decode_e8m0((sw >> (8 * i)) & 255),
                              BLOCK_M, BLOCK_N, INTERP)
    return acc


@triton.jit
def _fp4_epilogue(acc, GS, GX, offs_n, n_ok, dexp, WFMT: tl.constexpr, FOLD: tl.constexpr, GS_ROWS: tl.constexpr,
                  HAS_GX: tl.constexpr):
    """The folded scales' constant back (and NVFP4's tensor scale): NVFP4 acc * (g * 2^8) with g =
    GS[0] or, GS_ROWS (layers merged along N with their own tensor scales), GS[n] per output
    row, times GX[0] (HAS_GX: the activation's tensor scale, g_w * g_x formed here as the unmerged
    path forms it before the launch: the same float32 product); folded MXFP4 acc * 2^(126 - D)
    (prepare_w4 keeps D <= 252: a normal float32); powers of two are exact."""
    if WFMT == 3:
        if GS_ROWS:
            g = tl.load(GS + offs_n, mask=n_ok, other=0.0)[:, None]
        else:
            g = tl.load(GS)
        if HAS_GX:
            g = g * tl.load(GX)
        acc = acc * (g * 256.0)
    if WFMT == 2 and FOLD:
        acc = acc * ((253 - dexp) << 23).to(tl.float32, bitcast=True)
    return acc


@triton.jit
def _prefetch_l1(ptrs):
    """Start bringing the lines at ptrs into this SM's L1 (prefetch.global.L1: a hint, nothing
    waits on it, no register is held). The pairs kernel can do this for the next K step's x while
    the current step computes (XPF), so the step's x loads hit L1 instead of paying an L2 round
    trip; its weights are already prefetched into registers. On the H200 that paid at 64 rows of x
    only (weight_only.pick_config_pairs has the numbers). The addresses must lie inside x (the
    caller clamps them): a prefetch does not fault, but we do not lean on that."""
    tl.inline_asm_elementwise("prefetch.global.L1 [$1]; mov.b32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _fence_gpu(v):
    """A gpu-scope acquire-release fence in every thread (v: any int32 tensor, returned): the
    split-K partials one program stores are visible to the program that sums them. The
    interpreter runs programs one after another: no fence needed."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _w4a16_pairs_kernel(
    X, W, S, Z, GS, GX, BIAS, OUT, PART, LOCK, M, N, K, K_SPLIT, DEXP, s_xm, s_wn, s_sn, s_om,
    WFMT: tl.constexpr, FOLD: tl.constexpr, GS_ROWS: tl.constexpr, HAS_GX: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    WARPS: tl.constexpr, V3: tl.constexpr, XPF: tl.constexpr, INTERP: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), SPLIT, cdiv(M, BLOCK_M)); each program covers K_SPLIT codes (a
    multiple of BLOCK_K = 128 or 256, itself a multiple of G) from pid_k * K_SPLIT for BLOCK_M
    rows of x. X [M, K] bf16/fp16; W int32 [N, K/8] ("pairs"); WFMT 0 / 1 (int4 / uint4): S fp32
    [N, K/G], Z int8 [N, K/G]; WFMT 2 / 3 (MXFP4 / NVFP4, bf16 x): S the uint8 scale codes
    [N, K/G] as int32 words [N, K/(4G)] (s_sn in words), GS the NVFP4 tensor scale (fp32 [1], or
    [N] with GS_ROWS), GX the activation's (fp32 [1], HAS_GX; see _fp4_epilogue);
    FOLD: the fp4 block scales folded into the bf16 weights (NVFP4 always; MXFP4 with DEXP = D,
    W4Weight.fp4_exp_offset, see _fp4_mults). OUT [M, N] in x's dtype. BLOCK_N a multiple of
    16 * WARPS (WARPS = num_warps);
    V3: the dot is a wgmma (BLOCK_M >= 16), which orders K differently.
    The words and per-group data of the next step are loaded before the current step is
    computed (registers: the loads are in flight while the tensor cores work; XPF: the next
    step's x lines are prefetched into L1 at the same time, _prefetch_l1; Triton's
    num_stages pipelining goes through shared memory and was slower on the H200; loading two
    steps ahead was no faster at M = 1 and ~2x slower at M >= 16, measured on the H200).
    Split-K (SPLIT > 1) without atomics on the output and without extra kernels: each program
    stores its float32 partial in PART [SPLIT, M, N]; the last of a tile's SPLIT programs
    (a counter in LOCK [tiles] int32, zero between calls: the last program resets it) adds
    the partials in the order 0..SPLIT-1 -- the same sums on every run -- adds the bias and
    writes OUT."""
    HALF: tl.constexpr = 1 if X.dtype.element_ty == tl.bfloat16 else 2
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    j = tl.arange(0, BLOCK_N)
    phys = pid_n * BLOCK_N + j                           # rows in load order
    offs_n = pid_n * BLOCK_N + _pairs_row_perm(j, WARPS)  # logical row -> its physical row
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    t = tl.arange(0, 16)
    k_lo = tl.multiple_of(pid_k * K_SPLIT, 128)
    w_ptr = W + phys.to(tl.int64)[:, None] * s_wn + (tl.multiple_of(k_lo // 8, 16) + t)[None, :]
    p_ok = phys < N
    w_ok = p_ok[:, None]
    # per-group data per physical row: [BN, 16] index tiles (the row's element + the column) of one
    # K step's scales and zero points (int4) or fp4 scale-code words (_pairs_raw)
    g_row = phys.to(tl.int64)[:, None] * s_sn + t[None, :]
    GW: tl.constexpr = 4 * G if WFMT >= 2 else G                   # codes per raw element (fp4: per scale word)
    NC: tl.constexpr = BLOCK_K // GW if BLOCK_K >= GW else 1       # raw-tile columns per step
    sc_log = n64 * s_sn                                            # unfolded MXFP4: logical rows' scale words
    x_rows = X + offs_m.to(tl.int64)[:, None] * s_xm + (k_lo + tl.arange(0, 32))[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if XPF and not INTERP:
        # one address per 32 codes (64 bytes: every 128-byte line of the step's x, whatever x's
        # alignment) of each row, padding rows clamped to the last real row
        x_pf = X + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * s_xm + \
            (k_lo + 32 * tl.arange(0, BLOCK_K // 32))[None, :]
        _prefetch_l1(x_pf)
    # the first step: words (chunk a, chunk b = a at BLOCK_K 128) and raw per-group tiles
    wa = tl.load(w_ptr, mask=w_ok, other=0, eviction_policy="evict_first")
    wb = wa
    if BLOCK_K == 256:
        wb = tl.load(w_ptr + 16, mask=w_ok, other=0, eviction_policy="evict_first")
    sr = _pairs_raw(S, g_row + k_lo // GW, w_ok, NC)
    zr = sr
    if HAS_Z:
        zr = _pairs_raw(Z, g_row + k_lo // GW, w_ok, NC)
    for kk in range(0, K_SPLIT, BLOCK_K):
        kn = kk + BLOCK_K                                  # the step loaded now
        more = w_ok & (kn < K_SPLIT)
        na = tl.load(w_ptr + BLOCK_K // 8, mask=more, other=0, eviction_policy="evict_first")
        nb = na
        if BLOCK_K == 256:
            nb = tl.load(w_ptr + BLOCK_K // 8 + 16, mask=more, other=0, eviction_policy="evict_first")
        ns = _pairs_raw(S, g_row + (k_lo + kn) // GW, more, NC)
        nz = ns
        if HAS_Z:
            nz = _pairs_raw(Z, g_row + (k_lo + kn) // GW, more, NC)
        if XPF and not INTERP:  # the last step wraps to the program's first: an address inside x
            _prefetch_l1(x_pf + kn % K_SPLIT)
        if WFMT >= 2:
            acc = _pairs_chunk_fp4(acc, wa, 0, k_lo + kk, kk, x_rows, S, sr, sc_log, n_ok, m_ok,
                                   DEXP, WFMT, FOLD, BLOCK_M, BLOCK_N, WARPS, V3, INTERP)
            if BLOCK_K == 256:
                acc = _pairs_chunk_fp4(acc, wb, 1, k_lo + kk + 128, kk + 128, x_rows, S, sr, sc_log,
                                       n_ok, m_ok, DEXP, WFMT, FOLD, BLOCK_M, BLOCK_N, WARPS, V3, INTERP)
        else:
            acc = _pairs_chunk(acc, wa, 0, kk, x_rows, sr, zr, m_ok, WFMT == 0, HAS_Z, G, BLOCK_M, BLOCK_N,
                               WARPS, V3, HALF, INTERP)
            if BLOCK_K == 256:
                acc = _pairs_chunk(acc, wb, 1, kk + 128, x_rows, sr, zr, m_ok, WFMT == 0, HAS_Z, G, BLOCK_M,
                                   BLOCK_N, WARPS, V3, HALF, INTERP)
        wa = na
        wb = nb
        sr = ns
        zr = nz
        w_ptr += BLOCK_K // 8
    o_off = offs_m[None, :].to(tl.int64) * s_om + offs_n[:, None]
    o_ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT > 1:
        p_off = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(PART + pid_k * M * N + p_off, acc, mask=o_ok)
        tile = pid_m * tl.num_programs(0) + pid_n
        if not INTERP:
            _fence_gpu(t)
        tl.debug_barrier()
        done = tl.atomic_add(LOCK + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:                            # the tile's last program: sum in order
            if not INTERP:
                _fence_gpu(t)
            acc = tl.load(PART + p_off, mask=o_ok, other=0.0, cache_modifier=".cg")
            for r in tl.static_range(1, SPLIT):
                acc += tl.load(PART + r * M * N + p_off, mask=o_ok, other=0.0, cache_modifier=".cg")
            acc = _fp4_epilogue(acc, GS, GX, offs_n, n_ok, DEXP, WFMT, FOLD, GS_ROWS, HAS_GX)
            if HAS_BIAS:
                acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(OUT + o_off, round_to(acc, OUT.dtype.element_ty), mask=o_ok)
            tl.atomic_xchg(LOCK + tile, 0, sem="relaxed", scope="gpu")
    else:
        acc = _fp4_epilogue(acc, GS, GX, offs_n, n_ok, DEXP, WFMT, FOLD, GS_ROWS, HAS_GX)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(OUT + o_off, round_to(acc, OUT.dtype.element_ty), mask=o_ok)


@triton.jit
def _pairs_dequant_kernel(W, S, Z, OUT, N, s_wn, s_sn, s_on, WFMT: tl.constexpr, HAS_Z: tl.constexpr,
                          G: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    """Dequantize one chunk of 128 codes of BLOCK_N rows of a "pairs" weight to OUT's dtype
    (prefill: the weight for a bf16 GEMM). Word w's pair index P = w2 + 2 w3 + 4 w0 + 8 w1
    (weight_only._pairs_words); value (q - z) * s (int4 / uint4: S fp32 scales) or e2m1 * block
    scale (fp4: S the uint8 scale codes; NVFP4's tensor scale NOT applied) in float32, one
    rounding to the output dtype (none for fp4 in bf16: exact), as _w4_dequant_kernel.
    Grid (cdiv(N, BLOCK_N), K / (128 CHUNKS)): CHUNKS consecutive chunks per program."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < N)[:, None]
    n64 = offs_n.to(tl.int64)[:, None]
    # the words gathered in pair order (word of pair P: w = P2 + 2 P3 + 4 P0 + 8 P1), so each
    # plane's values come out in K order and are stored contiguously (wide, coalesced stores;
    # storing each code at its own column halves the store width and was ~10x slower on the H200)
    P = tl.arange(0, 16)
    w = ((P >> 2) & 1) + 2 * ((P >> 3) & 1) + 4 * (P & 1) + 8 * ((P >> 1) & 1)
    for c in tl.static_range(CHUNKS):
        kc = (tl.program_id(1) * CHUNKS + c) * 128
        wd = tl.load(W + n64 * s_wn + (kc // 8 + w)[None, :], mask=n_ok, other=0)                  # [BN, 16 pairs]
        ty = OUT.dtype.element_ty
        for i in tl.static_range(4):
            col = kc + 32 * i + tl.arange(0, 32)[None, :]
            lo_c = (wd >> (4 * i)) & 15
            hi_c = (wd >> (16 + 4 * i)) & 15
            if WFMT >= 2:  # a pair never straddles a block (G >= 16, even columns): pairs 0-7 / 8-15 of
                # the plane lie in its first / second 16 codes (one block for MXFP4, two for NVFP4);
                # one scale load per row and block, not one per pair (~2.5x slower on the H200)
                g0 = n64 * s_sn + (kc + 32 * i) // G
                sa = tl.load(S + g0, mask=n_ok, other=0).to(tl.int32)
                if WFMT == 2:
                    s = decode_e8m0(sa)
                else:
                    s = tl.where(P[None, :] < 8, decode_e4m3fn(sa),
                                 decode_e4m3fn(tl.load(S + g0 + 1, mask=n_ok, other=0).to(tl.int32)))
                lo = _e2m1_value(lo_c) * s
                hi = _e2m1_value(hi_c) * s
            else:
                g = n64 * s_sn + (kc + 32 * i) // G
                off = 8.0 if WFMT == 0 else 0.0
                if HAS_Z:
                    off += tl.load(Z + g, mask=n_ok, other=0).to(tl.float32)
                s = tl.load(S + g, mask=n_ok, other=0.0)
                lo = (lo_c.to(tl.float32) - off) * s
                hi = (hi_c.to(tl.float32) - off) * s
            v = tl.reshape(tl.join(round_to(lo, ty), round_to(hi, ty)), (BLOCK_N, 32))
            tl.store(OUT + n64 * s_on + col, v, mask=n_ok)


@triton.jit
def _scale_output_kernel(Y, S, BIAS, OUT, M, N, s_y, s_o, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
    """OUT = round(float32(Y) * S [+ BIAS]) (weight_only.scale_output): S float32 [1] or [N] (ROWS).
    The product is rounded before the bias is added (mul.rn: the compiler would fuse an FMA, one
    rounding instead of torch's two)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    y = tl.load(Y + r64 * s_y + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if ROWS:
        s = tl.broadcast_to(tl.load(S + cols, mask=cols < N, other=0.0)[None, :], (BLOCK_M, BLOCK_N))
    else:
        s = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32) + tl.load(S)
    if INTERP:
        y = y * s
    else:
        y = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [y, s], dtype=tl.float32, is_pure=True,
                                      pack=1)
    if HAS_BIAS:
        y = y + tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + r64 * s_o + cols[None, :], round_to(y, OUT.dtype.element_ty), mask=ok)
