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
Split-K stores float32 partials, one per K slice, into a workspace [split, M, N]; a second
kernel (lowbit.ops.triton.split_k.reduce_split_k) sums them in a fixed order, adds the bias and
rounds to x's dtype. In Triton's CPU interpreter (no bf16 dot there) the dot operands are
widened to float32 first (exact).

Second layout "planar8" (int4 / uint4; below): kernels _w4a16_gemv8_kernel (CUDA cores,
M <= 4) and _w4a16_dot8_kernel (tensor cores). Split-K there is the same workspace and reduction
(split - 1 float32 additions of the partials in a fixed order: the results are deterministic).

The kernels live by layout: codes (decoders shared by all), planar (planar chunks: DOT / GEMV
and the dequantization for large M), planar8 (gemv8, dot8) and pairs. This package's names are
those the launchers in lowbit.ops.w4a16.launch use.
"""
from .codes import WFMT, W_INT4, W_MXFP4, W_NVFP4, W_UINT4, _e2m1_value, _scale_output_kernel, block_scale  # noqa: F401
from .pairs import _pairs_dequant_kernel, _w4a16_pairs_kernel  # noqa: F401
from .planar import _w4_dequant_kernel, _w4a16_kernel  # noqa: F401
from .planar8 import _w4a16_dot8_kernel, _w4a16_gemv8_kernel  # noqa: F401
from ..split_k import reduce_split_k  # noqa: F401
