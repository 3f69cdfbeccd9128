"""The float GEMM every dequantized path ends in (the weight dequantized into lowbit.ops.scratch's buffer, then
this): pure torch, no Triton, so the native and the Triton dequant paths share one arithmetic."""
from __future__ import annotations

import torch


def bf16_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a @ b.T for dequantized 16-bit operands a [M, K], b [N, K] (fp32 accumulation): straight to
    out_dtype (one rounding of the fp32 sum) when that is a's dtype and there is no bias, else float32
    out (torch.mm out_dtype on CUDA), the bias added in fp32 and one rounding to out_dtype."""
    if bias is None and out_dtype == a.dtype:
        return a @ b.t()
    y = torch.mm(a, b.t(), out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
