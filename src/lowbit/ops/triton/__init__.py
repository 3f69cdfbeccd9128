"""Triton kernels for quantized matmuls on NVIDIA GPUs (tested on CPU via TRITON_INTERPRET=1).

Kernels import lazily: `import lowbit.ops.triton` does not require Triton until a kernel is used.
- gemm_int8.int8_gemm          W8A8 int8, int32 accumulation, fused scale / zero-point / bias epilogue
- gemm_fp8.fp8_gemm            fp8 e4m3fn, row-wise or tensor-wise fp32 scales
- gemm_blockscaled.fp8_block_gemm / mxfp8_gemm   per-K-group scales (1x128 / 128x128, MX e8m0 per 32)
- act_quant.quantize_per_token dynamic per-token int8 / fp8 activation quantization
"""
