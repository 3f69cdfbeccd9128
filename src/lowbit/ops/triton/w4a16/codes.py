"""W4A16 kernels, the shared part: 4-bit code decoders (int4 offset binary, e2m1, block scales), the
inner products and the output scaling kernel. The layouts and exactness argument are in lowbit.ops.triton.w4a16."""

from __future__ import annotations

import triton
import triton.language as tl

from lowbit.ops.w4_formats import WFMT, W_INT4, W_MXFP4, W_NVFP4, W_UINT4  # noqa: F401  (W4Weight.kind -> WFMT)

from ..common import decode_e4m3fn
from ..fused_quant import round_to


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
    accumulated in float32: bf16 / fp16 x on the tensor cores with w in x's dtype (exact when w is
    representable there), float32 x with IEEE float32 products; widened to float32 in the
    interpreter (it has no bf16 dot)."""
    if USE_DOT:
        if INTERP:
            acc = tl.dot(x.to(tl.float32), w, acc)
        elif x.dtype == tl.float32:   # float32 activations: IEEE products, not TF32 (x's 24 bits kept)
            acc = tl.dot(x, w, acc, input_precision="ieee")
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
def _scale_output_kernel(Y, S, BIAS, OUT, M, N, s_y, s_o, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
    """OUT = round(float32(Y) * S [+ BIAS]) (lowbit.ops.w4a16.launch.scale_output): S float32 [1] or [N] (ROWS).
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
