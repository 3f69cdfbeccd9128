"""4-bit dense kernels of the prepared path: W4A16 and the fp4 x fp4 emulation (+ their bf16 paths).

  triton_w4a16      int4 / uint4 per group, MXFP4 or NVFP4 weights, float activations -> the W4A16
                    kernel (its layout: lowbit.ops.weight_only.prepare_w4, two codes per byte)
  dequant_w4a16     where the tuning table says so (large M): one pass dequantizing the weight to
                    x's dtype into a reusable buffer, then the bf16 GEMM
  triton_fp4        MXFP4 / NVFP4 weights *and* activations: the activations quantized by the fused
                    quantizer and dequantized exactly into bf16 (e2m1 x e8m0, and e2m1 x e4m3 for
                    NVFP4, are exact in bf16; NVFP4's per-tensor scales multiply the fp32 accumulator
                    once), then the W4A16 kernel: the emulation of the fp4 x fp4 product on a GPU
                    without an fp4 datapath, with the same products and fp32 accumulation
  dequant_fp4       the same activations into dequant_w4a16's path
"""
from __future__ import annotations

import torch

from lowbit.ops.fused import qdq_rows
from lowbit.ops.kernels.base import Refused
from lowbit.ops.kernels.prepared_kernel import Prepared, PreparedKernel, act_json
from lowbit.ops.kernels.schemes import pair_refusal, w4a16_refusal, weight_only_refusal
from lowbit.ops.float_gemm import bf16_gemm
from lowbit.ops.scratch import scratch
from lowbit.ops.w4a16.launch import dequantize_w4, launch_w4a16, scale_output
from lowbit.ops.weight_only import W4Weight, prepare_w4


def _w4(spec, ops, global_scale=None) -> W4Weight:
    return W4Weight(ops["packed"], ops["scale"], ops.get("zero_point"), ops.get("scale_codes"),
                    ops.get("global_scale") if global_scale is None else global_scale,
                    spec.w4kind, spec.group, spec.chunk, (spec.N, spec.K), None, spec.layout, spec.fp4_exp_offset)


def w4_kernel(spec, x2, ops, bias, global_scale=None, act_scale=None):
    """The W4A16 kernel. global_scale: NVFP4's accumulator scale instead of the weight's; act_scale
    (decode sizes): the activation's tensor scale, multiplied into the weight's by the kernel (W4A4
    NVFP4 layers merged along N, whose weight tensor scales are one per output row)."""
    from lowbit.ops.triton.common import interpreting    # optional: triton

    return launch_w4a16(x2, _w4(spec, ops, global_scale), bias, None, interpreting(), act_scale)


def w4_dequant(spec, x2, ops, bias, global_scale=None):
    """The weight dequantized to x's dtype into a scratch buffer, then the bf16 GEMM; NVFP4's tensor
    scale and the bias applied to its output in float32, one pass."""
    w = _w4(spec, ops, global_scale)
    wd = dequantize_w4(w, x2.dtype, scratch((spec.N, spec.K), x2.dtype, x2.device))
    if w.global_scale is None:
        return bf16_gemm(x2, wd, bias, x2.dtype)
    return scale_output(torch.nn.functional.linear(x2, wd), w.global_scale, bias)  # y * g (+ bias) in float32, one pass


def _prepare(cls, weight_q, act_scheme):
    N, K = int(weight_q.shape[0]), int(weight_q.shape[1])
    try:
        w4 = prepare_w4(weight_q)
    except (ValueError, NotImplementedError) as err:
        raise Refused(f"the W4A16 layout cannot hold this weight ({err})") from None
    t = {"packed": w4.packed, "scale": w4.scale}
    for name in ("zero_point", "scale_codes", "global_scale"):
        if getattr(w4, name) is not None:
            t[name] = getattr(w4, name)
    return Prepared(cls.spec(cls.kind, N, K, t, act=act_json(act_scheme) if cls.kind == "fp4" else None,
                             w4kind=w4.kind, group=w4.group_size, chunk=w4.chunk, layout=w4.layout,
                             fp4_exp_offset=w4.fp4_exp_offset), t)


def _padded(layer) -> str | None:
    if layer.padded:
        return ("the weight's last group is zero-padded (K not a multiple of the group size); the W4A16 "
                "layout needs whole groups")
    return None


class TritonW4A16(PreparedKernel):
    name = "triton_w4a16"
    kind = "w4a16"
    min_capability = (8, 0)
    summary = "4-bit weights dequantized in registers to x's dtype, bf16/fp16 MMA"

    @classmethod
    def refuses(cls, layer):
        return weight_only_refusal(layer) or w4a16_refusal(layer.weight) or _padded(layer)

    @classmethod
    def prepare(cls, weight_q, act_scheme, static_scale):
        return _prepare(cls, weight_q, act_scheme)

    @classmethod
    def input_dtypes(cls, spec):
        # fp4 weights only with bf16 (their dequantized values can exceed fp16's range)
        return (torch.bfloat16,) if spec.w4kind in ("mxfp4", "nvfp4") else cls.dtypes

    @classmethod
    def graph_safe(cls, spec):
        return True

    @staticmethod
    def apply(spec, x2, ops, bias, config):
        return w4_kernel(spec, x2, ops, bias)


class DequantW4A16(TritonW4A16):
    name = "dequant_w4a16"
    summary = "4-bit weight dequantized to x's dtype into a scratch buffer, then the bf16 GEMM"

    @staticmethod
    def apply(spec, x2, ops, bias, config):
        return w4_dequant(spec, x2, ops, bias)


class TritonFP4(PreparedKernel):
    name = "triton_fp4"
    kind = "fp4"
    min_capability = (8, 0)
    dtypes = (torch.bfloat16,)
    summary = "fp4 activations dequantized exactly to bf16, then the W4A16 kernel (no fp4 datapath)"

    @classmethod
    def refuses(cls, layer):
        return pair_refusal(layer.weight, layer.act, "fp4") or _padded(layer)

    @classmethod
    def prepare(cls, weight_q, act_scheme, static_scale):
        return _prepare(cls, weight_q, act_scheme)

    @classmethod
    def apply(cls, spec, x2, ops, bias, config):
        return _fp4(spec, x2, ops, bias, dequant=cls.bf16_path)


class DequantFP4(TritonFP4):
    name = "dequant_fp4"
    summary = "fp4 activations dequantized exactly to bf16, the weight into a scratch buffer, the bf16 GEMM"
    bf16_path = True


def _fp4(spec, x2, ops, bias, dequant: bool):
    """One kernel quantizes and dequantizes the activation (fused.qdq_rows; NVFP4: two, three above
    QDQ_MAX_ROWS rows), and the product of the tensor scales comes with it; then the W4A16 kernel or
    (dequant) the bf16 path."""
    wg = ops.get("global_scale")
    if wg is not None and wg.numel() > 1:  # merged layers: per-row weight scales
        xd, gx = qdq_rows(x2, spec.act_scheme)
        if dequant:
            return w4_dequant(spec, xd, ops, bias, (wg * gx).contiguous()).to(x2.dtype)
        return w4_kernel(spec, xd, ops, bias, act_scale=gx).to(x2.dtype)   # g_w * g_x in the kernel
    xd, gs = qdq_rows(x2, spec.act_scheme, wg)
    return (w4_dequant if dequant else w4_kernel)(spec, xd, ops, bias, gs).to(x2.dtype)


TritonW4A16.dequant, DequantW4A16.dequant = DequantW4A16, None
TritonFP4.dequant, DequantFP4.dequant = DequantFP4, None
