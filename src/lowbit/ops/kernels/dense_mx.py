"""The MXFP8 dense kernel of the prepared path (+ its bf16 path).

  triton_mxfp8    MXFP8 weights and activations (e8m0 scales per 32): the fused quantizer, then the
                  emulated MX GEMM (the e8m0 scales applied to the operands in each tile, fed exactly
                  to the bf16 tensor cores: no MX datapath before sm_100)
  dequant_mxfp8   where the tuning table says so: both operands dequantized exactly to bf16 and one
                  cuBLAS GEMM (gemm_blockscaled.mxfp8_dequant_gemm: fp32 accumulation; a bias is
                  added in fp32 after it)
"""
from __future__ import annotations

import torch

from lowbit.ops.fused import quantize_rows
from lowbit.ops.kernels.prepared_kernel import Prepared, PreparedKernel, act_json
from lowbit.ops.kernels.schemes import pair_refusal
from lowbit.ops.scratch import scratch


class TritonMXFP8(PreparedKernel):
    name = "triton_mxfp8"
    kind = "mxfp8"
    min_capability = (8, 9)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    summary = "fp8 tiles times their e8m0 scales fed exactly to the bf16 tensor cores"

    @classmethod
    def refuses(cls, layer):
        return pair_refusal(layer.weight, layer.act, "mxfp8")

    @classmethod
    def prepare(cls, weight_q, act_scheme, static_scale):
        N, K = int(weight_q.shape[0]), int(weight_q.shape[1])
        t = {"w": weight_q.codes.contiguous(), "w_scale_codes": weight_q.scale_codes.contiguous()}
        return Prepared(cls.spec("mxfp8", N, K, t, act=act_json(act_scheme), group=32), t)

    @classmethod
    def apply(cls, spec, x2, ops, bias, config):
        return _mxfp8(spec, x2, ops, bias, dequant=cls.bf16_path)


class DequantMXFP8(TritonMXFP8):
    name = "dequant_mxfp8"
    summary = "both MXFP8 operands dequantized exactly to bf16, one cuBLAS GEMM"
    bf16_path = True


def _mxfp8(spec, x2, ops, bias, dequant: bool):
    """The activations quantized by the fused quantizer, then the MX GEMM or (dequant) both operands
    dequantized to bf16 into the scratch buffer and one cuBLAS GEMM."""
    from lowbit.ops.triton.gemm_blockscaled import mxfp8_dequant_gemm, mxfp8_gemm    # optional: triton

    qt = quantize_rows(x2, spec.act_scheme, check_finite=False)
    sx = qt.scale_codes.reshape(x2.shape[0], -1)
    if dequant:
        return mxfp8_dequant_gemm(qt.codes, ops["w"], sx, ops["w_scale_codes"], bias, x2.dtype,
                                  scratch((spec.N, spec.K), torch.bfloat16, x2.device))
    return mxfp8_gemm(qt.codes, ops["w"], sx, ops["w_scale_codes"], bias=bias, out_dtype=x2.dtype)


TritonMXFP8.dequant, DequantMXFP8.dequant = DequantMXFP8, None
