"""The GEMMs of two quantized operands (QTensor x QTensor), what `lowbit.ops.linear` runs.

  x scheme                                    w scheme                          kernel
  int8  token|channel|tensor (sym or asym)  x int8 channel|tensor (sym)      -> int8
  fp8_e4m3fn token|channel|tensor (fp32)    x fp8_e4m3fn channel|tensor      -> fp8_rowwise
  fp8_e4m3fn block (1,128) or group 128     x fp8_e4m3fn block (128,128)     -> fp8_block
  fp8_e4m3fn group 32 e8m0 (MXFP8)          x fp8_e4m3fn group 32 e8m0       -> mxfp8
Each class's `apply` is its Triton launch; lowbit.ops.linear's "torch" backend runs the same
arithmetic through torch._int_mm / torch._scaled_mm for the classes named there. The GEMM registry
(`lowbit.ops.kernels.GEMM`) is asked with device None: which backend runs is ops.linear's choice.
"""
from __future__ import annotations

import torch

from lowbit.ops.kernels.base import Kernel, Registry
from lowbit.ops.kernels.schemes import is_mx, per_row_fp32


def row_scale(qt, rows: int) -> torch.Tensor:
    """Per-row fp32 scale [rows] (a tensor-wise scale stays one value; kernels broadcast it)."""
    s = qt.scale.reshape(-1)
    if s.numel() not in (1, rows):
        raise ValueError(f"scale of {qt} has {s.numel()} values for {rows} rows: re-quantize it")
    return s


def zero_and_colsum(xq, wq, rows: int, w_colsum):
    """x's zero points as a [rows] vector and the weight's int32 column sums (None, None without)."""
    if xq.zero_point is None:
        return None, None
    za = xq.zero_point.reshape(-1)
    if za.numel() == 1:
        za = za.expand(rows)
    if w_colsum is None:
        w_colsum = wq.codes.sum(dim=1, dtype=torch.int32)
    elif w_colsum.dtype != torch.int32 or w_colsum.numel() != wq.codes.shape[0]:
        raise ValueError(f"w_colsum must be int32 with one value per output channel "
                         f"({wq.codes.shape[0]}), got {w_colsum.dtype} {tuple(w_colsum.shape)}; "
                         "use wq.codes.sum(dim=1, dtype=torch.int32)")
    return za, w_colsum


def group_scales(qt, e8m0: bool) -> torch.Tensor:
    """[rows-or-blocks, K/G] scales for the block-scaled kernels (uint8 codes for MX)."""
    if e8m0:
        if qt.scale_codes is None:
            raise ValueError(f"{qt} has no e8m0 scale_codes: re-quantize it with scale_format='e8m0'")
        s = qt.scale_codes
    else:
        s = qt.scale
    return s.reshape(-1, s.shape[-1])


def _pair(layer, fmt: str) -> str | None:
    xs, ws = layer.act, layer.weight
    if xs is None:
        return "the activations are not quantized (weight-only): no W8A8 GEMM applies"
    if xs.format != fmt or ws.format != fmt:
        return f"x is {xs.format}, w is {ws.format}; this GEMM multiplies {fmt} by {fmt}"
    return None


class GemmInt8(Kernel):
    name = kind = "int8"
    summary = "int8 x int8, exact int32 accumulation, scales (and x's zero points) in the epilogue"

    @classmethod
    def refuses(cls, layer):
        why = _pair(layer, "int8")
        xs, ws = layer.act, layer.weight
        if why is None and not (per_row_fp32(xs) and per_row_fp32(ws) and ws.symmetric and ws.strategy != "token"):
            why = ("this GEMM takes fp32 scales per token / channel / tensor on x and symmetric fp32 scales per "
                   f"channel / tensor on w; got x {xs.strategy}, w {ws.strategy}"
                   f"{'' if ws.symmetric else ' with zero points'}")
        return why

    @staticmethod
    def apply(xq, wq, x2, w2, bias, out_dtype, w_colsum):
        from lowbit.ops.triton.gemm_int8 import int8_gemm    # optional: triton

        M, N = x2.shape[0], w2.shape[0]
        za, cs = zero_and_colsum(xq, wq, M, w_colsum)
        return int8_gemm(x2, w2, row_scale(xq, M), row_scale(wq, N), a_zero=za, b_colsum=cs,
                         bias=bias, out_dtype=out_dtype)


class GemmFp8Rowwise(Kernel):
    name = kind = "fp8_rowwise"
    min_capability = (8, 9)
    summary = "fp8 e4m3 x fp8 e4m3, fp32 scales per row / tensor in the epilogue"

    @classmethod
    def refuses(cls, layer):
        why = _pair(layer, "fp8_e4m3fn")
        if why is None and not (per_row_fp32(layer.act) and per_row_fp32(layer.weight)):
            why = "this GEMM takes one fp32 scale per row or tensor on both operands"
        return why

    @staticmethod
    def apply(xq, wq, x2, w2, bias, out_dtype, w_colsum):
        from lowbit.ops.triton.gemm_fp8 import fp8_gemm    # optional: triton

        M, N = x2.shape[0], w2.shape[0]
        return fp8_gemm(x2, w2, row_scale(xq, M), row_scale(wq, N), bias=bias, out_dtype=out_dtype)


class GemmFp8Block(Kernel):
    name = kind = "fp8_block"
    min_capability = (8, 9)
    summary = "fp8 e4m3, x scaled per 1x128, w per 128x128 block, scales applied per K block"

    @classmethod
    def refuses(cls, layer):
        why = _pair(layer, "fp8_e4m3fn")
        if why is not None:
            return why
        xs, ws = layer.act, layer.weight
        x_1x128 = xs.scale_format == "fp32" and (
            (xs.strategy == "block" and xs.block_size == (1, 128)) or (xs.strategy == "group" and xs.group_size == 128))
        if not (x_1x128 and ws.strategy == "block" and ws.block_size == (128, 128) and ws.scale_format == "fp32"):
            return "this GEMM takes x in fp32-scaled 1x128 blocks (or groups of 128) and w in 128x128 blocks"
        return None

    @staticmethod
    def apply(xq, wq, x2, w2, bias, out_dtype, w_colsum):
        return _block_scaled(xq, wq, x2, w2, bias, out_dtype, e8m0=False)


class GemmMXFP8(Kernel):
    name = kind = "mxfp8"
    min_capability = (8, 9)
    summary = "MXFP8 x MXFP8: fp8 tiles times their e8m0 scales, bf16 tensor cores"

    @classmethod
    def refuses(cls, layer):
        why = _pair(layer, "fp8_e4m3fn")
        if why is None and not (is_mx(layer.act, "fp8_e4m3fn", 32, "e8m0", any_sign=True)
                                and is_mx(layer.weight, "fp8_e4m3fn", 32, "e8m0", any_sign=True)):
            why = "this GEMM takes MXFP8 on both operands (groups of 32, e8m0 scales)"
        return why

    @staticmethod
    def apply(xq, wq, x2, w2, bias, out_dtype, w_colsum):
        return _block_scaled(xq, wq, x2, w2, bias, out_dtype, e8m0=True)


def _block_scaled(xq, wq, x2, w2, bias, out_dtype, e8m0: bool):
    """The fp8 block GEMM (fp32 scales per K block) or, e8m0, the MX GEMM."""
    from lowbit.ops.triton.gemm_blockscaled import fp8_block_gemm, mxfp8_gemm    # optional: triton

    fn = mxfp8_gemm if e8m0 else fp8_block_gemm
    return fn(x2, w2, group_scales(xq, e8m0), group_scales(wq, e8m0), bias=bias, out_dtype=out_dtype)


# lowbit.ops.linear's GEMMs, in preference order (their conditions are disjoint)
GEMM = Registry("QTensor GEMM", (GemmInt8, GemmFp8Rowwise, GemmFp8Block, GemmMXFP8))
