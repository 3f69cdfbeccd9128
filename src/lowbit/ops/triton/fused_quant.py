"""One row-wise Triton kernel for the memory-bound activation quantizers: an optional
prologue (RMSNorm with an optional residual add in front, or SiLU-and-multiply) followed
by dynamic quantization of the row, per token or per group of the last axis.

Each program owns one row, holds it in registers as a [NG, G] tile (NG groups of G
elements; per-token scaling is NG = 1, G = the padded row), and reads and writes device
memory once: that is what makes fusion pay.

The quantizer reproduces lowbit.quantize's canonical arithmetic (docs/formats.md):
the scale from the group's absmax in float32, IEEE division `y / s` (tl.math.div_rn),
round-half-even, clamp after rounding, a zero group gets the documented zero-group scale.
The float element encoders use exact float32 / integer arithmetic (encode_e4m3fn comes
from ops/triton/common.py) so that Triton's CPU interpreter (whose fp8 and bf16 casts
do not round to nearest even) and the GPU produce the same codes; on the GPU the fp8
encoder may instead use the hardware cast (`cvt.rn.satfinite`), which rounds the same way
-- both paths are tested against the canonical quantizer.

Launcher arguments are validated by lowbit.ops.fused (the public entry point); this
module only describes the kernel."""
from __future__ import annotations

import triton
import triton.language as tl

from .common import decode_e4m3fn, encode_e4m3fn, nonzero_quotient  # shared with the GEMMs (common.py)

# Prologues
PRE_NONE, PRE_RMSNORM, PRE_SILU_MUL = 0, 1, 2
# Element formats (FMT): lowbit.ops.fused_launch.FMT_CODES numbers them (int8, fp8 e4m3, fp4 e2m1)
# Scale kinds: plain float32; e8m0 power of two (MX); fp8-e4m3 block scale times a
# float32 tensor scale (NVFP4, two-level)
SCALE_FP32, SCALE_E8M0, SCALE_NV = 0, 1, 2
# e8m0 rounding modes (torchao's names)
ROUND_FLOOR, ROUND_RCEIL, ROUND_CEIL, ROUND_EVEN = 0, 1, 2, 3

MAX_BLOCK = 32768  # elements a program holds in registers; larger rows raise in lowbit.ops.fused_launch


@triton.jit
def _encode_e2m1(v):
    """float32 -> fp4 e2m1fn bit pattern (int32 in [0, 15]), round to nearest even,
    saturating to +-6. Values 0, .5, 1, 1.5, 2, 3, 4, 6; a tie goes to the even code.

    One float add does the rounding: for a = min(|v|, 6) below 2^(1+j) (j = 0, 1, 2 for the
    binades [0, 2), [2, 4), [4, 6]), a + 2^(22+j) lies in [2^(22+j), 2^(23+j)), where float32's
    spacing is 2^(j-1) -- the e2m1 grid's step in that range (0.5, 1, 2). The add rounds a to
    that step, half to even, and the sum's bits minus 2^(22+j)'s are a / step = the code for
    j = 0 (0, .5, 1, 1.5, 2 -> 0..4) and the code minus 2j above (2, 3, 4 -> 4, 5, 6; 4, 6 ->
    6, 7). An even multiple of the step is an even code, so the ties agree with e2m1's.
    (~10 SASS instructions against ~24 for the seven comparisons it replaces.)"""
    sign = (v.to(tl.int32, bitcast=True) >> 28) & 8  # the sign bit, so -0.0 -> 0x8
    a = tl.minimum(tl.abs(v), 6.0)
    ge2 = a >= 2.0
    ge4 = a >= 4.0
    m = tl.where(ge4, 16777216.0, tl.where(ge2, 8388608.0, 4194304.0))  # 2^(22 + j)
    # bits of 2^(22 + j) minus 2j: (149 + j) << 23, i.e. 0x4A800000, 0x4B000000, 0x4B800000
    k = tl.where(ge4, 0x4B800000 - 4, tl.where(ge2, 0x4B000000 - 2, 0x4A800000))
    return ((a + m).to(tl.int32, bitcast=True) - k) | sign


@triton.jit
def div_exact(y, s, r):
    """RN(y / s), IEEE-exact, for s > 0 normal with r = RN(1 / s) normal and y / s in the
    normal range or rounding to a code of 0 anyway: q = y * r is within a few ulps of y / s;
    two Newton corrections with exact FMA remainders e = y - s * q reach the correctly
    rounded quotient (Markstein's theorem: the second starts within 1 ulp). Five FMA-class
    operations instead of div.rn's fixup sequence: the quantizer's hot loop on the GPU.
    A zero y loses its sign here (e = +0); callers that encode signs restore it."""
    q = y * r
    e = tl.fma(-s, q, y)
    q = tl.fma(e, r, q)
    e = tl.fma(-s, q, y)
    return tl.fma(e, r, q)


@triton.jit
def _copy_sign_bit(v, y):
    """v with y's sign bit OR-ed in (v >= 0 or already negative where y is): -0 for y = -0."""
    return (v.to(tl.int32, bitcast=True) | (y.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _ld_policy(ptr, mask, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """Load a row tile; EVEN (the tile is exactly the row) drops the mask. EVICT: the L2 eviction
    policy, "" (Triton's default), "evict_last" or "evict_first"."""
    if EVEN:
        return tl.load(ptr, eviction_policy=EVICT)
    else:
        return tl.load(ptr, mask=mask, other=0.0, eviction_policy=EVICT)


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    """_ld_policy with Triton's default eviction policy."""
    return _ld_policy(ptr, mask, EVEN, "")


@triton.jit
def _st(ptr, v, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, v)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """float32 -> `dtype` with round-to-nearest-even. bfloat16 is done on the bits because
    Triton's CPU interpreter truncates float32 -> bfloat16; the GPU rounds the same way."""
    if dtype == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def _silu_mul(g, u):
    """SiLU(g) * u in float32; approximate division: y only needs the derived bound."""
    return (g / (1.0 + tl.exp(-g))) * u


@triton.jit
def _max_nan(a, b):
    """max(a, b), NaN if either is NaN (PTX max.NaN: one instruction on sm_80 and later)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _absmax(y):
    """max |y| along axis 1; a NaN counts as +inf (max alone would skip it): the NaN-propagating
    max reduces, and only the per-row result is mapped NaN -> inf, instead of every element."""
    m = tl.reduce(tl.abs(y), 1, _max_nan)
    return tl.where(m == m, m, float("inf"))


@triton.jit
def _rms_inv(ss, K, eps):
    """1 / sqrt_rn(ss / K + eps) with IEEE division and square root: ss = sum of squares (float32)."""
    return tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(ss, K.to(tl.float32)) + eps))


@triton.jit
def _codes(y, s, FMT: tl.constexpr, SCALE_KIND: tl.constexpr, QMAX: tl.constexpr, HW_FP8: tl.constexpr,
           FAST_DIV: tl.constexpr, LEAN: tl.constexpr = False, STATIC: tl.constexpr = False):
    """Codes of y / s (s broadcast to y's shape: [groups or rows, 1]) as lowbit.quantize computes
    them: IEEE division, round-half-even, clamp / saturate. Returns int8 (FMT 0) or uint8 bit
    patterns, shaped like y. Shared by both row kernels: the one place the kernels divide.
    LEAN (the "tile" kernel; False keeps the measured "row" kernel's code): the fast division
    restores the sign of a zero y by OR-ing y's sign bit into the quotient (one LOP3; the
    quotient of a nonzero y already has y's sign, and RN(-tiny / s) is -0) instead of a select
    (an FSETP and a predicate per element, partly spilled to registers on sm_90), and subnormal
    scales take div_exact on operands scaled by 2^64 instead of a div_rn call per element (the
    calls pushed the kernel from ~80 to ~140 registers per thread, for a branch rarely taken).
    STATIC: s is a calibrated scale, not this row's absmax / QMAX, so |y / s| may exceed QMAX and the
    fast path clamps too (unclamped, the int8 rounding trick below would wrap instead of saturate)."""
    if FAST_DIV:
        if SCALE_KIND == 1:  # a power of two: y * (1 / s) is exact (same rounding as y / s)
            v = y * tl.math.div_rn(1.0, s)
        elif tl.min(tl.min(s, axis=1), axis=0) >= 1.1754943508222875e-38:  # every scale normal: 1 / s finite
            # and for int8, s = RN(amax / 127) is within 2^-24 of amax / 127, so |y / s|
            # rounds to at most 127: no clamp needed
            v = div_exact(y, s, tl.math.div_rn(1.0, s))
            if STATIC:
                v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
            if FMT != 0 and LEAN:  # div_exact returns +0 for y = -0: the encoders want -0
                v = _copy_sign_bit(v, y)
        elif LEAN:  # subnormal (or NaN) scales: y / s = (y * 2^64) / (s * 2^64) exactly (scaling by
            # a power of two is exact without overflow, and |y| <= amax < 2^-100 here), now with a
            # normal divisor; the quotient is the same real number, so the same rounding
            s2 = s * 18446744073709551616.0
            v = div_exact(y * 18446744073709551616.0, s2, tl.math.div_rn(1.0, s2))
            v = tl.minimum(tl.maximum(v, -QMAX), QMAX)  # subnormal s = RN(amax / max) lost bits
            if FMT != 0:
                v = _copy_sign_bit(v, y)
        else:  # subnormal scales (amax < ~1e-36): IEEE division, then clamp
            v = tl.math.div_rn(y, s)
            v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
        if FMT != 0 and not LEAN:
            v = tl.where(y == 0.0, y, v)  # keep the sign of zero for the float encoders
    else:
        v = tl.math.div_rn(y, s)
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if FMT == 0:
        # round with the 1.5 * 2^23 trick (|v| <= 127 here): the low byte of the sum's
        # bits is the integer in two's complement; clamping before rounding is the same
        # as after
        t = v + 12582912.0
        return t.to(tl.int32, bitcast=True).to(tl.int8)
    elif FMT == 1:
        if HW_FP8:  # the hardware cast rounds to nearest even
            if SCALE_KIND != 0:  # e8m0 'floor' scales can put |v| past 448: saturate
                v = tl.minimum(tl.maximum(v, -448.0), 448.0)
            return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            return encode_e4m3fn(v)
    else:
        return _encode_e2m1(v).to(tl.uint8)


@triton.jit
def _store_tensor_scale(GSCALE, GOUT, G_DIV: tl.constexpr):
    """NVFP4: publish the tensor scale g = amax / G_DIV (1.0 when that is 0), as
    quantize.two_level_global_scale; one program calls it."""
    tl.store(GOUT, tensor_scale(tl.load(GSCALE), G_DIV))


@triton.jit
def _group_scales(amax, GSCALE, SCALE_KIND: tl.constexpr, E8M0_ROUND: tl.constexpr, QMAX: tl.constexpr,
                  EMAX: tl.constexpr, MBITS: tl.constexpr, G_DIV: tl.constexpr, G_GIVEN: tl.constexpr = False):
    """(effective float32 scale, scale code as int32) per group from its absmax (any shape), as
    lowbit.quantize computes them: the one place the fused kernels derive a group's scale.
    SCALE_KIND 0: s = RN(amax / QMAX), 1.0 for a zero group (the code is unused); 1: e8m0 (MX),
    the biased exponent under E8M0_ROUND; 2: NVFP4's e4m3 block scale of (amax / QMAX) / g with
    g = tensor amax (GSCALE) / G_DIV -- or g = GSCALE itself with G_GIVEN (a calibrated tensor
    scale) --, clamped to [2^-6, 448]. A NaN amax gives a NaN scale."""
    if SCALE_KIND == 0:
        s = tl.math.div_rn(amax, QMAX)
        s = tl.where(s == 0.0, 1.0, s)  # zero group (or underflow): s = 1.0
        code = s.to(tl.int32, bitcast=True)
    elif SCALE_KIND == 1:
        # e8m0 code = biased float32 exponent of a source value (quantize.e8m0_exponent)
        if E8M0_ROUND == 1:  # rceil: ceil(log2(amax / max))
            src = tl.math.div_rn(amax, QMAX).to(tl.int32, bitcast=True)
        elif E8M0_ROUND == 3:  # even: amax rounded half-up to the element's mantissa bits
            src = (amax.to(tl.int32, bitcast=True) + (1 << (22 - MBITS))) & 0x7F800000
        else:
            src = amax.to(tl.int32, bitcast=True)
        e = (src >> 23) & 255
        if E8M0_ROUND == 1 or E8M0_ROUND == 2:
            e = e + ((src & 0x7FFFFF) != 0).to(tl.int32)
        if E8M0_ROUND != 1:
            e = e - EMAX
        e = tl.minimum(tl.maximum(e, 1), 254)  # 2^-126 .. 2^127
        s = (e << 23).to(tl.float32, bitcast=True)
        code = tl.where(amax != amax, 255, e)
        s = tl.where(amax != amax, float("nan"), s)
    else:  # NVFP4
        if G_GIVEN:
            gs = tl.load(GSCALE)
        else:
            gs = tensor_scale(tl.load(GSCALE), G_DIV)
        s, code = nvfp4_block_scales(amax, gs, QMAX)
    return s, code


@triton.jit
def tensor_scale(tamax, G_DIV: tl.constexpr):
    """NVFP4's tensor scale g = tamax / G_DIV (1.0 when that is 0), as quantize.two_level_global_scale."""
    return nonzero_quotient(tamax, G_DIV)


@triton.jit
def nvfp4_block_scales(amax, gs, QMAX: tl.constexpr):
    """(effective scale e4m3 * g, e4m3 code as int32) of NVFP4 blocks with absmax amax under the
    tensor scale gs: the e4m3 value of (amax / QMAX) / g, clamped to [2^-6, 448]; NaN for a NaN amax."""
    rel = tl.math.div_rn(tl.math.div_rn(amax, QMAX), gs)
    code = encode_e4m3fn(tl.maximum(rel, 0.015625)).to(tl.int32)
    s = decode_e4m3fn(code) * gs
    return tl.where(amax != amax, float("nan"), s), code


@triton.jit
def _row_quant_kernel(
    X, X_stride, W, R, R_stride, R_OUT, R_OUT_stride, Y, CODES, SCALE, SCALE_CODES,
    GSCALE, GOUT, AMAX, K, NGROUPS, eps,
    PRE: tl.constexpr, HAS_RES: tl.constexpr, STORE_Y: tl.constexpr, AMAX_ONLY: tl.constexpr,
    FMT: tl.constexpr, SCALE_KIND: tl.constexpr, E8M0_ROUND: tl.constexpr,
    QMAX: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, HW_FP8: tl.constexpr,
    FAST_DIV: tl.constexpr, G_DIV: tl.constexpr, NG: tl.constexpr, G: tl.constexpr,
    EVEN: tl.constexpr, G_GIVEN: tl.constexpr = False,
):
    """One program per row of K elements, held as an [NG, G] tile (NG * G >= K).

    X: [rows, K] (or [rows, 2K] for SiLU-and-multiply: gate then up), bf16/fp16/fp32.
    W: RMSNorm weight [K]. R / R_OUT: residual in and out [rows, K] (R_OUT = X + R rounded
    to R_OUT's dtype; the norm reads that rounded value, as the unfused code would).
    Y: float32 [rows, K] normalized output, written only when STORE_Y (tests).
    CODES: [rows, K] int8 / uint8. SCALE: float32 [rows, ngroups] effective scales.
    SCALE_CODES: uint8 [rows, ngroups] (e8m0 or e4m3 bit patterns) for MX / NVFP4.
    GSCALE: float32 [1], the tensor's amax (NVFP4); GOUT: float32 [1], written by program 0:
    the tensor scale g = amax / G_DIV (1.0 when that is 0), as quantize.two_level_global_scale.
    G_GIVEN: GSCALE holds a calibrated tensor scale g itself (one pass, nothing written to GOUT).
    AMAX: float32 [rows], AMAX_ONLY pass. FAST_DIV: div_exact instead of div_rn (GPU only:
    the interpreter's fma is not fused, so there the remainders would not be exact).
    """
    row = tl.program_id(0).to(tl.int64)
    gi = tl.arange(0, NG)[:, None]
    ci = tl.arange(0, G)[None, :]
    offs = gi * G + ci
    mask = offs < K
    x_row = X + row * X_stride
    # amax per group; a NaN counts as +inf (max alone would skip it), and an infinite amax
    # becomes a NaN scale below, which the caller checks (e8m0 / e4m3 clamping would hide it)
    if PRE == 2:  # SiLU(gate) * up, in float32
        g = _ld(x_row + offs, mask, EVEN).to(tl.float32)
        u = _ld(x_row + K + offs, mask, EVEN).to(tl.float32)
        y = _silu_mul(g, u)
        amax = _absmax(y)  # [NG]
    else:
        h = _ld(x_row + offs, mask, EVEN).to(tl.float32)
        if HAS_RES:
            r = _ld(R + row * R_stride + offs, mask, EVEN).to(tl.float32)
            hr = round_to(h + r, R_OUT.dtype.element_ty)
            if not AMAX_ONLY:
                _st(R_OUT + row * R_OUT_stride + offs, hr, mask, EVEN)
            h = hr.to(tl.float32)
        if PRE == 1:
            w = _ld(W + offs, mask, EVEN).to(tl.float32)
            hw = h * w
            # the two reductions are independent (no pass over y after the norm): rounding is
            # monotonic, so max |fl(hw * inv)| = fl(max |hw| * inv) exactly. A non-finite h
            # shows in the sum of squares (a NaN weight is not looked for: it is a parameter)
            amax_hw = tl.max(tl.abs(hw), axis=1)
            ss = tl.sum(h * h)
            inv = _rms_inv(ss, K, eps)
            y = hw * inv
            amax = amax_hw * inv
            amax = tl.where(ss < float("inf"), amax, float("inf"))  # non-finite h
        else:
            y = h
            amax = _absmax(y)
    if AMAX_ONLY:
        tl.store(AMAX + row, tl.max(amax, axis=0))
    else:
        amax = tl.where(amax == float("inf"), float("nan"), amax)
        if STORE_Y:
            _st(Y + row * K + offs, y, mask, EVEN)
        ngroups = NGROUPS
        gidx = tl.arange(0, NG)
        gmask = gidx < ngroups
        # --- scale, as lowbit.quantize computes it ---
        if SCALE_KIND == 2:
            if row == 0 and not G_GIVEN:  # publish the tensor scale the codes were computed with
                _store_tensor_scale(GSCALE, GOUT, G_DIV)
        s, sc = _group_scales(amax, GSCALE, SCALE_KIND, E8M0_ROUND, QMAX, EMAX, MBITS, G_DIV, G_GIVEN)
        if SCALE_KIND != 0:
            tl.store(SCALE_CODES + row * ngroups + gidx, sc.to(tl.uint8), mask=gmask)
        tl.store(SCALE + row * ngroups + gidx, s, mask=gmask)
        # --- codes: v = y / s, IEEE ---
        _st(CODES + row * K + offs, _codes(y, s[:, None], FMT, SCALE_KIND, QMAX, HW_FP8, FAST_DIV), mask, EVEN)


@triton.jit
def _tok_load(X, X_stride, R, R_stride, rows, n_rows, K, PRE: tl.constexpr, HAS_RES: tl.constexpr,
              BLOCK: tl.constexpr, FULL: tl.constexpr):
    """The inputs of a [ROWS, BLOCK] tile of the token kernel, as loaded (no conversion): (gate, up)
    for SiLU-and-multiply, else (x, residual) -- the second is x itself without a residual. Rows
    past n_rows are read as row n_rows - 1 (valid memory; their results are never stored), so
    only a padded row (FULL False: BLOCK > K) needs a mask. The stream is read once: evict_first."""
    rl = tl.minimum(rows, n_rows - 1)[:, None]
    cc = tl.arange(0, BLOCK)[None, :]
    x_ptr = X + rl * X_stride + cc
    if FULL:
        a = tl.load(x_ptr, eviction_policy="evict_first")
        if PRE == 2:
            b = tl.load(x_ptr + K, eviction_policy="evict_first")
        elif HAS_RES:
            b = tl.load(R + rl * R_stride + cc, eviction_policy="evict_first")
        else:
            b = a
    else:
        cm = cc < K
        a = tl.load(x_ptr, mask=cm, other=0.0, eviction_policy="evict_first")
        if PRE == 2:
            b = tl.load(x_ptr + K, mask=cm, other=0.0, eviction_policy="evict_first")
        elif HAS_RES:
            b = tl.load(R + rl * R_stride + cc, mask=cm, other=0.0, eviction_policy="evict_first")
        else:
            b = a
    return a, b


@triton.jit
def _tok_weight(W, K, PRE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr):
    """The RMSNorm weight as float32, shaped to multiply a [ROWS, BLOCK] tile (0 for other prologues)."""
    if PRE == 1:
        if ROWS == 1:  # a [1, BLOCK] load takes the tile's layout (sm_90 SASS: a 1-D load
            # broadcast with [None, :] goes through shared memory and two barriers)
            cc = tl.arange(0, BLOCK)[None, :]
            w = _ld(W + cc, cc < K, FULL).to(tl.float32)
        else:  # loaded once per program for ROWS rows (there the 1-D form compiled smaller)
            cols = tl.arange(0, BLOCK)
            w = _ld(W + cols, cols < K, FULL).to(tl.float32)[None, :]
    else:
        w = 0.0
    return w


@triton.jit
def _tok_tile(a, b, w, R_OUT, R_OUT_stride, Y, CODES, SCALE, rows, n_rows, K, eps,
              PRE: tl.constexpr, HAS_RES: tl.constexpr, STORE_Y: tl.constexpr, FMT: tl.constexpr,
              QMAX: tl.constexpr, HW_FP8: tl.constexpr, FAST_DIV: tl.constexpr,
              ROWS: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Everything after the loads for one [ROWS, BLOCK] tile of rows `rows`: prologue, per-row
    scale, codes; writes the new residual, y (STORE_Y), codes and scales."""
    cols = tl.arange(0, BLOCK)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < K)[None, :]
    rr = rows[:, None]
    cc = cols[None, :]
    if PRE == 2:  # SiLU(gate) * up, in float32
        y = _silu_mul(a.to(tl.float32), b.to(tl.float32))
        amax = _absmax(y)  # [ROWS]
    else:
        h = a.to(tl.float32)
        if HAS_RES:
            hr = round_to(h + b.to(tl.float32), R_OUT.dtype.element_ty)
            _st(R_OUT + rr * R_OUT_stride + cc, hr, mask, EVEN)
            h = hr.to(tl.float32)
        if PRE == 1:
            hw = h * w
            # as in _row_quant_kernel: independent reductions, amax = fl(max |hw| * inv) exactly
            amax_hw = tl.max(tl.abs(hw), axis=1)
            ss = tl.sum(h * h, axis=1)
            inv = _rms_inv(ss, K, eps)
            y = hw * inv[:, None]
            amax = amax_hw * inv
            amax = tl.where(ss < float("inf"), amax, float("inf"))  # non-finite h
        else:
            y = h
            amax = _absmax(y)
    amax = tl.where(amax == float("inf"), float("nan"), amax)
    if STORE_Y:
        _st(Y + rr * K + cc, y, mask, EVEN)
    s, _ = _group_scales(amax, SCALE, 0, 0, QMAX, 0, 0, 1.0)  # fp32: the tensor-scale pointer is unused
    if EVEN:
        tl.store(SCALE + rows, s)
    else:
        tl.store(SCALE + rows, s, mask=rmask)
    _st(CODES + rr * K + cc, _codes(y, s[:, None], FMT, 0, QMAX, HW_FP8, FAST_DIV, LEAN=True), mask, EVEN)


@triton.jit
def _token_tile_kernel(
    X, X_stride, W, R, R_stride, R_OUT, R_OUT_stride, Y, CODES, SCALE, n_rows, K, eps,
    PRE: tl.constexpr, HAS_RES: tl.constexpr, STORE_Y: tl.constexpr, FMT: tl.constexpr,
    QMAX: tl.constexpr, HW_FP8: tl.constexpr, FAST_DIV: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr, FULL: tl.constexpr = False,
    NPROG: tl.constexpr = 0,
):
    """The per-token (one float32 scale per row, int8 or fp8 e4m3fn) case of _row_quant_kernel,
    with ROWS rows per program held as a [ROWS, BLOCK] tile (BLOCK >= K, a power of two).

    Why a second kernel: at 8192 x 4096 the one-row kernel with 16 elements per thread spends
    about as many instructions per thread on per-row work (two block reductions, sqrt, three
    IEEE divisions, barriers) as on the 16 elements; here the launcher picks ROWS and
    num_warps so each thread holds 32-64 elements, the weight is loaded and widened once per
    program for ROWS rows, and the streamed input is read with evict_first. Arithmetic is the
    same as _row_quant_kernel's (same helpers: RMSNorm, scale, _codes), so codes and scales
    are bit-identical to lowbit.quantize on the kernel's own y, as for the one-row kernel.

    NPROG > 0: persistent, NPROG programs stepping over the tiles, each loading its next tile
    before it works on the current one (the loads of tile i + 1 are in flight during the
    reductions and stores of tile i, which otherwise leave the memory system idle per program).

    Arguments as _row_quant_kernel's (X: [n_rows, K] or [n_rows, 2K] for SiLU; W: [K];
    R / R_OUT: [n_rows, K]; Y: float32 [n_rows, K] when STORE_Y; CODES: [n_rows, K];
    SCALE: float32 [n_rows]). EVEN: BLOCK == K and ROWS divides n_rows (no masks at all);
    FULL: BLOCK == K (loads need no mask).
    """
    pid = tl.program_id(0)
    w = _tok_weight(W, K, PRE, ROWS, BLOCK, FULL)
    if NPROG == 0:
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        a, b = _tok_load(X, X_stride, R, R_stride, rows, n_rows, K, PRE, HAS_RES, BLOCK, FULL)
        _tok_tile(a, b, w, R_OUT, R_OUT_stride, Y, CODES, SCALE, rows, n_rows, K, eps, PRE, HAS_RES, STORE_Y,
                  FMT, QMAX, HW_FP8, FAST_DIV, ROWS, BLOCK, EVEN)
    else:
        n_tiles = tl.cdiv(n_rows, ROWS)
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        a, b = _tok_load(X, X_stride, R, R_stride, rows, n_rows, K, PRE, HAS_RES, BLOCK, FULL)
        for t in tl.range(pid, n_tiles, NPROG):
            rows = tl.arange(0, ROWS).to(tl.int64) + t * ROWS
            a_next, b_next = _tok_load(X, X_stride, R, R_stride, rows + NPROG * ROWS, n_rows, K, PRE, HAS_RES,
                                       BLOCK, FULL)
            _tok_tile(a, b, w, R_OUT, R_OUT_stride, Y, CODES, SCALE, rows, n_rows, K, eps, PRE, HAS_RES,
                      STORE_Y, FMT, QMAX, HW_FP8, FAST_DIV, ROWS, BLOCK, EVEN)
            a = a_next
            b = b_next


@triton.jit
def _pack_nibbles(c, N: tl.constexpr, G: tl.constexpr):
    """[N, G] 4-bit codes (int32 in [0, 15]) -> [N, G // 2] uint8, element 2j in the low
    nibble and 2j + 1 in the high one (lowbit.packing.pack_fp4's layout)."""
    odd = (tl.arange(0, G) % 2)[None, :]
    return tl.sum(tl.reshape(c << (odd * 4), (N, G // 2, 2)), axis=2).to(tl.uint8)


@triton.jit
def _group_tile_kernel(
    X, X_stride, W, R, R_stride, R_OUT, R_OUT_stride, Y, CODES, SCALE, SCALE_CODES,
    GSCALE, GOUT, AMAX, INV, n_rows, K, NGROUPS, eps,
    PRE: tl.constexpr, HAS_RES: tl.constexpr, STORE_Y: tl.constexpr, AMAX_ONLY: tl.constexpr,
    FMT: tl.constexpr, SCALE_KIND: tl.constexpr, E8M0_ROUND: tl.constexpr,
    QMAX: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, HW_FP8: tl.constexpr,
    FAST_DIV: tl.constexpr, G_DIV: tl.constexpr, PACK: tl.constexpr, G_GIVEN: tl.constexpr,
    ROWS: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr, TWO_PASS: tl.constexpr = False,
):
    """The group-scaled case of the "tile" kernel (MX, NVFP4, per-group int8 / fp8, (1, g)
    blocks): ROWS rows per program, held as one [ROWS * NG, G] tile -- line i is group i % NG
    of row i // NG --, so a group's absmax is a reduction along the tile's short axis and the
    RMSNorm's sum of squares a reduction of the NG partial sums of each row.

    Arguments as _row_quant_kernel's (X: [n_rows, K] or [n_rows, 2K] for SiLU; SCALE: float32
    [n_rows, NGROUPS]; SCALE_CODES: uint8 [n_rows, NGROUPS]; GSCALE: the tensor's amax for
    NVFP4, or the calibrated tensor scale g itself with G_GIVEN (then one pass), else from this
    kernel's AMAX_ONLY pass: the row maxima of y, into AMAX [n_rows], and for
    RMSNorm each row's 1 / rms into INV [n_rows] (NaN for a non-finite row), which the second
    pass reads instead of reducing again -- so both passes see the same y bit for bit: on sm_90
    two compilations of the same sum may add in different orders). PACK (fp4 codes only): CODES is uint8
    [n_rows, K // 2], two codes per byte as lowbit.packing.pack_fp4 stores them. EVEN: NG * G == K
    and ROWS divides n_rows (no masks). Same helpers as the other kernels (_group_scales,
    _codes), so the codes and scales equal lowbit.quantize on the kernel's own y.

    TWO_PASS (NVFP4's passes with a tensor scale from this tensor): the first pass reads x with
    evict_last and the second walks the tiles from the last one down, reading with evict_first,
    so it starts on the rows the first pass read last, which are still in L2 (50 MB on the
    H100 / H200: most of an 8192 x 4096 bf16 tensor). The order of the programs does not
    change what any of them computes."""
    RNG: tl.constexpr = ROWS * NG
    fi = tl.arange(0, RNG)
    tile = tl.program_id(0)
    if TWO_PASS and not AMAX_ONLY:
        tile = tl.num_programs(0) - 1 - tile
    EVICT: tl.constexpr = ("evict_last" if AMAX_ONLY else "evict_first") if TWO_PASS else ""
    rows = tile.to(tl.int64) * ROWS + fi // NG  # [RNG]: the row of each line
    gi = fi % NG
    cols = gi[:, None] * G + tl.arange(0, G)[None, :]  # [RNG, G]
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < K)
    rr = rows[:, None]
    x_ptr = X + rr * X_stride + cols
    if PRE == 2:  # SiLU(gate) * up, in float32
        g = _ld_policy(x_ptr, mask, EVEN, EVICT).to(tl.float32)
        u = _ld_policy(x_ptr + K, mask, EVEN, EVICT).to(tl.float32)
        y = _silu_mul(g, u)
        amax = _absmax(y)  # [RNG]
    else:
        h = _ld_policy(x_ptr, mask, EVEN, EVICT).to(tl.float32)
        if HAS_RES:
            r = _ld_policy(R + rr * R_stride + cols, mask, EVEN, EVICT).to(tl.float32)
            hr = round_to(h + r, R_OUT.dtype.element_ty)
            if not AMAX_ONLY:
                _st(R_OUT + rr * R_OUT_stride + cols, hr, mask, EVEN)
            h = hr.to(tl.float32)
        if PRE == 1:
            hw = h * _ld(W + cols, cols < K, EVEN).to(tl.float32)
            # as in _row_quant_kernel: independent reductions, amax = fl(max |hw| * inv) exactly
            if SCALE_KIND == 2 and not AMAX_ONLY and not G_GIVEN:  # NVFP4's second pass: the first pass's 1 / rms
                inv = tl.load(INV + rows, mask=rmask, other=1.0)  # NaN for a non-finite row
                amax = tl.max(tl.abs(hw), axis=1) * inv
            else:
                ss = tl.sum(tl.reshape(tl.sum(h * h, axis=1), (ROWS, NG)), axis=1)  # [ROWS]
                inv_r = _rms_inv(ss, K, eps)
                if AMAX_ONLY:
                    rw = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
                    tl.store(INV + rw, tl.where(ss < float("inf"), inv_r, float("nan")), mask=rw < n_rows)
                inv = tl.reshape(tl.broadcast_to(inv_r[:, None], (ROWS, NG)), (RNG,))
                fin = tl.reshape(tl.broadcast_to((ss < float("inf"))[:, None], (ROWS, NG)), (RNG,))
                amax = tl.where(fin, tl.max(tl.abs(hw), axis=1) * inv, float("inf"))  # non-finite h: NaN scale
            y = hw * inv[:, None]
        else:
            y = h
            amax = _absmax(y)
    if AMAX_ONLY:  # NVFP4's first pass: each row's max over its NG groups
        ra = tl.max(tl.reshape(amax, (ROWS, NG)), axis=1)
        rw = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        tl.store(AMAX + rw, ra, mask=rw < n_rows)
        return
    amax = tl.where(amax == float("inf"), float("nan"), amax)
    if STORE_Y:
        _st(Y + rr * K + cols, y, mask, EVEN)
    if SCALE_KIND == 2:
        if tl.program_id(0) == 0 and not G_GIVEN:  # publish the tensor scale the codes were computed with
            _store_tensor_scale(GSCALE, GOUT, G_DIV)
    s, sc = _group_scales(amax, GSCALE, SCALE_KIND, E8M0_ROUND, QMAX, EMAX, MBITS, G_DIV, G_GIVEN)
    sidx = rows * NGROUPS + gi
    smask = rmask & (gi < NGROUPS)
    tl.store(SCALE + sidx, s, mask=smask)
    if SCALE_KIND != 0:
        tl.store(SCALE_CODES + sidx, sc.to(tl.uint8), mask=smask)
    codes = _codes(y, s[:, None], FMT, SCALE_KIND, QMAX, HW_FP8, FAST_DIV, LEAN=True)
    if PACK:
        H: tl.constexpr = G // 2
        pcols = gi[:, None] * H + tl.arange(0, H)[None, :]
        _st(CODES + rr * (K // 2) + pcols, _pack_nibbles(codes.to(tl.int32), RNG, G),
            rmask[:, None] & (pcols < K // 2), EVEN)
    else:
        _st(CODES + rr * K + cols, codes, mask, EVEN)


@triton.jit
def copy_kernel(SRC, DST, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n]: the plain streaming copy the benchmarks measure their ceiling with."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + offs, tl.load(SRC + offs, mask=offs < n), mask=offs < n)
