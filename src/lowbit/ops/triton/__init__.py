"""Triton kernels for quantized matmuls and attention on NVIDIA GPUs (tested on the CPU via TRITON_INTERPRET=1).

Kernels import lazily: `import lowbit.ops.triton` does not require Triton until a kernel is used.
- gemm_int8, gemm_fp8, gemm_blockscaled   W8A8 int8, fp8 (row- or tensor-wise scales), per-K-group / MX scales
- w4a16/ (layouts: codes, pairs, planar, planar8), w8a16, dequant   weight-only GEMMs and block-scaled dequantization
- act_quant, fused_quant               dynamic activation quantizers (alone, or fused into the norm / SiLU in front)
- grouped, grouped_mx, grouped_w, grouped_schedule   MoE grouped GEMMs in one launch for all experts
- attention, attention_prefill, attention_decode   flash attention over a quantized KV cache (general, tensor-core
                                       prefill tilings, split-KV decode)
- kv_append, kv_dequant                cache writes; the cache dequantized bit-exactly for the SDPA backend
- probe_dot                            the plainest GEMM, for `lowbit probe`
- common                               shared rounding primitives and the cached launcher (`launch`)
"""
