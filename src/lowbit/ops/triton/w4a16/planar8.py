"""W4A16 on the "planar8" layout (int4 / uint4): the CUDA-core GEMV "gemv8" and the tensor-core "dot8"."""

from __future__ import annotations

import triton
import triton.language as tl

from ..fused_quant import round_to


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
def _gemv8_store(acc, OUT, BIAS, row, M, offs_n, n_ok, s_om, HAS_BIAS: tl.constexpr):
    out = tl.sum(acc, axis=1)
    o_ok = n_ok & (row < M)
    o_ptr = OUT + row.to(tl.int64) * s_om + offs_n
    if HAS_BIAS:
        out += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(o_ptr, round_to(out, OUT.dtype.element_ty), mask=o_ok)


@triton.jit
def _w4a16_gemv8_kernel(
    X, W, S, Z, BIAS, OUT, M, N, K, K_SPLIT, s_xm, s_wn, s_sn, s_om,
    SIGNED: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, INTERP: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), split, cdiv(M, BLOCK_M)); each program covers K_SPLIT codes
    (a multiple of BLOCK_K, itself a multiple of C = G) from pid_k * K_SPLIT, for BLOCK_M
    (1, 2 or 4) rows of x, each with its own [BLOCK_N, C/8] float32 accumulator (2-D tiles
    only: one register layout for weights, x and accumulators, no shared-memory shuffles).
    X [M, K] bf16/fp16; W int32 [N, K/8] (planar8, s_wn in words); S fp32 [N, K/G];
    Z int8 [N, K/G]; OUT [M, N]; PARTIAL (split-K): a float32
    workspace [split, M, N], this program's partial written at split pid_k (summed by
    lowbit.ops.triton.split_k)."""
    KW: tl.constexpr = C // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PARTIAL:  # split-K: this split's slice of the float32 workspace (rows of s_om = N elements)
        OUT += pid_k.to(tl.int64) * M * s_om
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
    _gemv8_store(acc0, OUT, BIAS, m0, M, offs_n, n_ok, s_om, HAS_BIAS)
    if BLOCK_M >= 2:
        _gemv8_store(acc1, OUT, BIAS, m0 + 1, M, offs_n, n_ok, s_om, HAS_BIAS)
    if BLOCK_M >= 4:
        _gemv8_store(acc2, OUT, BIAS, m0 + 2, M, offs_n, n_ok, s_om, HAS_BIAS)
        _gemv8_store(acc3, OUT, BIAS, m0 + 3, M, offs_n, n_ok, s_om, HAS_BIAS)


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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
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
    if PARTIAL:  # split-K: this split's slice of the float32 workspace (rows of s_om = N elements)
        OUT += pid_k.to(tl.int64) * M * s_om
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
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr, round_to(acc, OUT.dtype.element_ty), mask=o_ok)
