"""`lowbit.ops.linear(xq, wq)`: out = x_q @ w_q.T (+ bias), dispatched to the right kernel.

Backends (never a silent fallback from one to another, nor from one scheme to another):
- "triton":    the Triton kernels of lowbit.ops.triton (CUDA; the CPU interpreter in tests);
- "torch":     PyTorch's own quantized matmuls: torch._int_mm (int32 accumulation) with the
               epilogue in float64, or torch._scaled_mm for fp8 row-/tensor-wise;
- "reference": lowbit.ops.reference.qlinear_reference (float64, exact integer accumulation),
               any scheme pair it supports.
backend=None picks "triton" for CUDA tensors and, on the CPU, "torch" for int8 W8A8 (exact) and
"reference" for everything else. A scheme pair with no kernel on the chosen backend raises
NotImplementedError naming the schemes.

The kernel for a scheme pair is the GEMM registry's choice (lowbit.ops.kernels.gemm: one class per
GEMM, its table of scheme pairs there); `kernel_for(x_scheme, w_scheme)` names it.
"""
from __future__ import annotations

import torch

from lowbit.ops.dispatch import gemm_kernel as kernel_for  # noqa: F401  (the public name of the choice)
from lowbit.ops.kernels.gemm import GEMM, row_scale, zero_and_colsum
from lowbit.ops.reference import qlinear_reference

BACKENDS = ("triton", "torch", "reference")
def _is_qtensor(t) -> bool:
    return hasattr(t, "codes") and hasattr(t, "scale") and hasattr(t, "scheme")


def _scheme_name(t) -> str:
    return str(t.scheme) if _is_qtensor(t) else f"unquantized {getattr(t, 'dtype', type(t).__name__)}"


def _not_implemented(xq, wq, backend: str, why: str = "") -> NotImplementedError:
    hint = ("; weight-only 4-bit schemes run through lowbit.ops.weight_only.w4a16_linear"
            if not _is_qtensor(xq) else "")
    return NotImplementedError(
        f"no {backend} kernel for x: {_scheme_name(xq)} with w: {_scheme_name(wq)}{why}. "
        f"Kernels exist for {', '.join(GEMM.names())} (see lowbit.ops.kernels.gemm's docstring){hint}; "
        "backend='reference' computes any supported pair exactly in float64")


def linear(xq, wq, *, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
           backend: str | None = None, w_colsum: torch.Tensor | None = None) -> torch.Tensor:
    """Quantized linear layer: out = x_q @ w_q.T (+ bias), shape [..., N] in out_dtype.

    xq: QTensor of the activations, codes [..., K]; wq: QTensor of the weights, codes [N, K]
    (K-major). bias: [N] float, added in fp32 (Triton) or float64 (torch / reference paths).
    w_colsum: int32 [N] sums over K of the weight codes, needed when x has zero points
    (asymmetric int8); computed here when omitted (an extra pass over the weights per call:
    precompute it once per layer for speed).
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS} (or None to pick by device)")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"out_dtype={out_dtype} is not supported; use bfloat16, float16, float32 "
                         "(or float64 with backend='reference' / 'torch')")
    if not _is_qtensor(wq):
        raise TypeError("wq must be a QTensor (lowbit.quantize(w, scheme)); for unquantized weights "
                        "use torch.nn.functional.linear")
    kernel = kernel_for(xq.scheme if _is_qtensor(xq) else None, wq.scheme)
    device = wq.codes.device
    if backend is None:
        if device.type == "cuda":
            backend = "triton"
        else:
            backend = "torch" if kernel == "int8" else "reference"
    if backend == "reference":

        return qlinear_reference(xq, wq, bias).to(out_dtype)
    if kernel is None:
        raise _not_implemented(xq, wq, backend)
    x2, w2, lead = _operands(xq, wq)
    if out_dtype == torch.float64 and backend == "triton":
        raise ValueError("out_dtype=float64 is not produced by the Triton kernels (fp32 epilogue); "
                         "use float32, or backend='torch' / 'reference'")
    if backend == "torch":
        out = _torch_path(kernel, xq, wq, x2, w2, bias, out_dtype, w_colsum)
    else:
        out = _triton_path(kernel, xq, wq, x2, w2, bias, out_dtype, w_colsum)
    return out.reshape(*lead, out.shape[-1])


def _operands(xq, wq):
    """2-D codes [M, K] and [N, K] plus x's leading shape; checks shapes and devices."""
    xc, wc = xq.codes, wq.codes
    if wc.dim() != 2:
        raise ValueError(f"weight codes must be 2-D [N, K], got shape {tuple(wc.shape)}")
    if xc.shape[-1] != wc.shape[-1]:
        raise ValueError(f"x codes have K={xc.shape[-1]} but weight codes have K={wc.shape[-1]} "
                         f"(x {tuple(xc.shape)}, w {tuple(wc.shape)}): the contraction axes must match")
    if xc.device != wc.device:
        raise ValueError(f"x is on {xc.device} but w is on {wc.device}: move both to one device")
    lead = tuple(xc.shape[:-1])
    return xc.reshape(-1, xc.shape[-1]), wc, lead


def _triton_path(kernel, xq, wq, x2, w2, bias, out_dtype, w_colsum):
    return GEMM.get(kernel).apply(xq, wq, x2, w2, bias, out_dtype, w_colsum)


def _torch_path(kernel, xq, wq, x2, w2, bias, out_dtype, w_colsum):
    M, N = x2.shape[0], w2.shape[0]
    if kernel == "int8":
        if x2.device.type == "cuda" and (M <= 16 or x2.shape[1] % 8 or N % 8):
            raise _not_implemented(xq, wq, "torch", f" at M={M}, K={x2.shape[1]}, N={N}: torch._int_mm "
                                   "on CUDA needs M > 16 and K, N multiples of 8")
        acc = torch._int_mm(x2.contiguous(), w2.t())  # exact int32
        za, cs = zero_and_colsum(xq, wq, M, w_colsum)
        y = acc.to(torch.float64)
        if za is not None:
            y = y - za.to(torch.float64)[:, None] * cs.to(torch.float64)[None, :]
        y = y * row_scale(xq, M).to(torch.float64)[:, None] * row_scale(wq, N).to(torch.float64)[None, :]
        if bias is not None:
            y = y + bias.to(torch.float64)
        return y.to(out_dtype)
    if kernel == "fp8_rowwise":
        if x2.device.type == "cuda" and (x2.shape[1] % 16 or N % 16):
            raise _not_implemented(xq, wq, "torch", f" at K={x2.shape[1]}, N={N}: torch._scaled_mm on "
                                   "CUDA needs K and N multiples of 16")
        # cuBLAS's fp8 GEMM on the raw codes (unit tensor-wise scales, fp32 out: the one output
        # type every scaling mode and bias combination allows), then the scales and the bias in
        # float64 like the int8 path: one final rounding to out_dtype.
        one = torch.ones((), dtype=torch.float32, device=x2.device)
        acc = torch._scaled_mm(x2.contiguous().view(torch.float8_e4m3fn), w2.view(torch.float8_e4m3fn).t(),
                               scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = acc.to(torch.float64) * row_scale(xq, M).to(torch.float64)[:, None] \
            * row_scale(wq, N).to(torch.float64)[None, :]
        if bias is not None:
            y = y + bias.to(torch.float64)
        return y.to(out_dtype)
    raise _not_implemented(xq, wq, "torch")
