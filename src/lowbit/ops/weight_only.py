"""W4A16: 4-bit weights, bf16 / fp16 activations, for decode-sized M (1..64).

    w4 = prepare_w4(wq)                 # wq: QTensor of weights [N, K], at load time
    out = w4a16_linear(x, w4, bias)     # x [..., K] -> out [..., N] in x's dtype

Weight schemes: int4 (signed, symmetric or with zero points) or uint4 (with zero points),
strategy group, group_size 32 or 128 (any power of two >= 32 dividing K); MXFP4
(fp4_e2m1fn, group 32, e8m0 scales); NVFP4 (fp4_e2m1fn, group 16, fp8_e4m3fn scales and a
tensor scale). Anything else raises NotImplementedError naming the scheme.

Backends: CUDA -> the Triton kernel (lowbit.ops.triton.w4a16); CPU -> "torch": the
dequantized weight (float32) times x in float32, cast to x's dtype. backend="triton" on a
CPU tensor runs the kernel in Triton's interpreter. The float64 reference is
w4a16_reference (x @ wq.dequantize(float64).T).

Where the pieces live: lowbit.ops.w4a16.layout (the load-time layouts "planar_chunks",
"planar8", "pairs", and W4Weight), lowbit.ops.w4a16.configs (kernel choice and tiles per M:
pick_config*), lowbit.ops.w4a16.launch (the launchers, dequantize_w4, scale_output).
"""
from __future__ import annotations

import os

import torch

from lowbit.ops.kernels.schemes import w4a16_kind
from lowbit.ops.w4a16.configs import (PAIRS_DEQUANT, PAIRS_DEQUANT_INTERP, pick_config, pick_config_gemv8,
                                      pick_config_pairs, pick_config_planar8)
from lowbit.ops.w4a16.launch import dequantize_w4, launch_w4a16, scale_output, split_locks
from lowbit.ops.w4a16.layout import (MXFP4_MAX_SCALE_CODE, W4Weight, pairs_bytes, pairs_fit, pairs_fp4_exp_offset,
                                     planar8_bytes, planar_bytes)
from lowbit.quantize import QTensor

__all__ = ["W4Weight", "prepare_w4", "w4a16_linear", "w4a16_reference", "dequantize_w4", "scale_output",
           "pairs_fp4_exp_offset", "pick_config", "pick_config_gemv8", "pick_config_pairs", "pick_config_planar8",
           "PAIRS_DEQUANT", "PAIRS_DEQUANT_INTERP", "MXFP4_MAX_SCALE_CODE"]


def prepare_w4(wq: QTensor, layout: str = "auto") -> W4Weight:
    """Lay out a quantized weight [N, K] for w4a16_linear (done once, at load time).

    layout "auto" (default): "pairs" where it applies (K a multiple of 128; int4 / uint4 with
    group 32, 64 or a multiple of 128, MXFP4, NVFP4: the fastest at decode sizes,
    docs/benchmarks-memory.md), else "planar_chunks" (kernels "dot" and "gemv"; every scheme); "planar8"
    (int4 / uint4; kernels "gemv8", the decode GEMV, and "dot8"): see lowbit.ops.w4a16.layout
    and lowbit.ops.triton.w4a16.planar8."""
    if layout not in ("auto", "planar_chunks", "planar8", "pairs"):
        raise ValueError(f"prepare_w4: layout must be 'auto', 'planar_chunks', 'planar8' or 'pairs', got {layout!r}")
    if not isinstance(wq, QTensor):
        raise TypeError(f"prepare_w4: wq must be a lowbit QTensor (lowbit.quantize(w, scheme)), "
                        f"got {type(wq).__name__}")
    if wq.codes.ndim != 2 or wq.padded:
        raise ValueError(f"prepare_w4: the weight must be an unpadded 2-D [N, K] QTensor, got codes "
                         f"{tuple(wq.codes.shape)} for shape {wq.shape}")
    kind = w4a16_kind(wq.scheme)
    N, K = wq.codes.shape
    if K % 2:
        raise ValueError(f"prepare_w4: K = {K} must be even (two codes per byte)")
    if layout == "auto":
        layout = "pairs" if pairs_fit(kind, K, wq.scheme.group_size) else "planar_chunks"
    if layout == "planar8":
        if kind not in ("int4", "uint4"):
            raise NotImplementedError(f"prepare_w4: layout 'planar8' takes int4 / uint4 weights, got {kind}; "
                                      "use layout='planar_chunks'")
        packed, chunk = planar8_bytes(wq.codes, kind, wq.scheme.group_size), wq.scheme.group_size
    elif layout == "pairs":
        if not pairs_fit(kind, K, wq.scheme.group_size):
            raise NotImplementedError(f"prepare_w4: layout 'pairs' takes weights with K a multiple of 128: MXFP4, "
                                      f"NVFP4, int4 / uint4 with group 32, 64 or a multiple of 128, got {kind} K = {K} "
                                      f"group {wq.scheme.group_size}; use layout='planar_chunks'")
        packed, chunk = pairs_bytes(wq.codes, kind), 128
    else:
        packed, chunk = planar_bytes(wq.codes, kind, wq.scheme.group_size)
    # the planar kernel forms scale * 2^14 (the pairs kernel scales its float32 dots: no limit)
    top = (int(wq.scale_codes.max()) if layout == "planar_chunks" and kind == "mxfp4" and wq.scale_codes is not None
           and wq.scale_codes.numel() else 0)
    if top > MXFP4_MAX_SCALE_CODE:
        raise ValueError(f"prepare_w4: an MXFP4 weight scale of 2^{top - 127} is beyond the "
                         f"kernel's exact range (e8m0 codes <= {MXFP4_MAX_SCALE_CODE}, scales <= 2^113: it forms "
                         "value * 2^-14 and scale * 2^14); such weights are not real model weights -- check "
                         "the checkpoint, or dequantize it with QTensor.dequantize()")
    if layout == "pairs" and wq.codes.is_cuda and not torch.cuda.is_current_stream_capturing():
        # the split-K counters made now, outside any CUDA-graph memory pool (see split_locks),
        # for up to 256 rows of x at BLOCK_N 128
        split_locks(wq.codes.device, 4 * -(-N // 128))
    dexp = pairs_fp4_exp_offset(packed, wq.scale_codes) if layout == "pairs" and kind == "mxfp4" else None
    zp = None
    if wq.zero_point is not None:
        zp = wq.zero_point.to(torch.int8).contiguous()  # z lies in [qmin, qmax]: exact
    return W4Weight(packed, wq.scale.to(torch.float32).contiguous(), zp,
                    None if wq.scale_codes is None else wq.scale_codes.contiguous(),
                    None if wq.global_scale is None else wq.global_scale.to(torch.float32).reshape(1).contiguous(),
                    kind, wq.scheme.group_size, chunk, (N, K), wq, layout, dexp)


def w4a16_reference(x: torch.Tensor, w: W4Weight | QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 x @ dequant(w).T (+ bias): the exact value the kernel approximates."""
    wq = w.qtensor if isinstance(w, W4Weight) else w
    out = x.to(torch.float64) @ wq.dequantize(torch.float64).T
    return out if bias is None else out + bias.to(torch.float64)


def w4a16_linear(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None, *,
                 backend: str | None = None, config: dict | None = None) -> torch.Tensor:
    """out = x @ dequant(w).T (+ bias), x [..., K] bf16/fp16 -> out [..., N] in x's dtype.

    config: override pick_config's choice (keys BLOCK_M, BLOCK_N, BLOCK_K, split, num_warps,
    num_stages); benchmarks use it to sweep."""
    if not isinstance(w, W4Weight):
        raise TypeError(f"w4a16_linear: w must be a W4Weight (prepare_w4(qtensor)), got {type(w).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"w4a16_linear: x must be a bfloat16 or float16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    N, K = w.shape
    if x.ndim == 0 or x.shape[-1] != K:
        raise ValueError(f"w4a16_linear: x has shape {tuple(x.shape)}; its last dim must be K = {K}")
    if w.kind in ("mxfp4", "nvfp4") and x.dtype != torch.bfloat16:
        raise TypeError(f"w4a16_linear: {w.kind} weights take bfloat16 activations (the dequantized "
                        f"weights can exceed float16's range), got {x.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,)):
        raise ValueError(f"w4a16_linear: bias must be a tensor of shape ({N},)")
    if x.device != w.packed.device:
        raise ValueError(f"w4a16_linear: x is on {x.device} but the weight is on {w.packed.device}; "
                         "move one of them")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if backend is None:
        backend = "triton" if x.is_cuda else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"w4a16_linear: backend must be 'triton', 'torch' or None, got {backend!r}")
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, K)
    if backend == "torch":
        out = x2.float() @ w.qtensor.dequantize(torch.float32).T
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).reshape(lead + (N,))
    if not x.is_cuda and not interp:
        raise RuntimeError("w4a16_linear: backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 "
                           "(Triton's interpreter); use backend='torch'")
    return launch_w4a16(x2.contiguous(), w, bias, config, interp).reshape(lead + (N,))
