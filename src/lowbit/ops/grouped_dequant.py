"""The bf16 path of a grouped (MoE) GEMM ("dequant" in the tuning table): every expert's weight of
one projection dequantized into one reusable buffer [E, N, K] (lowbit.ops.scratch: one per
shape, dtype and device, shared by the layers of that shape), then torch._grouped_mm over the
tokens sorted by expert. Where lowbit's grouped kernel loses to the bf16 grouped GEMM (the
weight-only kernels at prefill sizes), this path runs instead and the weights stay 4 / 8-bit at
rest: the buffer is the only bf16 copy, one per projection shape.

Weights (the grouped kernels' own layout, lowbit.ops.kernels.grouped: nothing is kept twice):
  int4 (+- zero points)   (code - z) * s in float32, then one rounding to bf16 (to nearest even):
                          the float32 value QTensor.dequantize gives, cast to bf16
  MXFP4 / NVFP4           e2m1 value * block scale (e8m0 codes clamped to [1, 254], as the W4A16
                          kernels read them; e4m3): at most 6 significant bits, exact in bf16;
                          NVFP4's per-expert tensor scale multiplies the GEMM's output instead
  int8 (W8A16)            code * s in float32, then one rounding to bf16
One launch per projection on CUDA (lowbit.ops.triton.dequant: dequantize_packed / dequantize_rows),
writing only the experts that received tokens (their rows are all the GEMM reads); the CPU
runs the torch twin (every expert, the same values).

The GEMM (torch._grouped_mm: self [M, K] bf16, mat2 [E, K, N] with 16-byte aligned strides, offs
int32 [E] the cumulative row ends, output bf16): bf16 operands, float32 accumulation, one
rounding of each output to bf16. Then, in float32: NVFP4's tensor scale, the bias, the rows of
dropped slots (past offsets[E], owned by no expert) set to zero, one rounding to out_dtype.
No host synchronisation (the expert of each row comes from a device searchsorted), so CUDA graphs
and torch.compile capture it. What it refuses (grouped_bf16_refusal): activations other than
bf16 (torch runs other dtypes one expert at a time with a host synchronisation), K not a multiple
of 8 (16-byte rows), a torch without _grouped_mm, and on CUDA a GPU other than sm_90 / sm_100
(torch's grouped GEMM kernel; elsewhere it falls back to the per-expert loop).
"""
from __future__ import annotations

import torch

from lowbit.formats import decode
from lowbit.ops.grouped import Routing
from lowbit.ops.scratch import scratch
from lowbit.ops.w4_formats import FP4_GROUPS, FP4_SCALES, GROUPED_W4, WFMT
from lowbit.packing import unpack_fp4, unpack_int4

GPU_MAJORS = (9, 10)     # torch._grouped_mm's CUTLASS kernel: sm_90 and sm_100 (no host sync)


def grouped_bf16_refusal(dtype: torch.dtype, K: int, capability: tuple[int, int] | None = None) -> str | None:
    """Why the bf16 grouped path cannot run activations of `dtype` with K columns (on a GPU of this
    capability; None: not a GPU), or None."""
    if getattr(torch, "_grouped_mm", None) is None:
        return f"torch {torch.__version__} has no torch._grouped_mm (the bf16 grouped GEMM)"
    if dtype != torch.bfloat16:
        return (f"the activations are {dtype}; torch._grouped_mm's grouped kernel takes bfloat16 (other dtypes run "
                "one GEMM per expert with a host synchronisation): the grouped kernel runs them")
    if K % 8:
        return f"K = {K} is not a multiple of 8: torch._grouped_mm needs 16-byte aligned bf16 rows"
    if capability is not None and capability[0] not in GPU_MAJORS:
        return (f"torch._grouped_mm's grouped kernel runs on sm_90 / sm_100; this GPU is sm_{capability[0]}"
                f"{capability[1]} (torch would run one GEMM per expert with a host synchronisation)")
    return None


def _check(x: torch.Tensor, K: int) -> None:
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [rows, K = {K}], got {tuple(x.shape)}")
    why = grouped_bf16_refusal(x.dtype, K)
    if why is not None:
        raise ValueError(f"grouped bf16 path: {why}")


def _kernels():
    """lowbit.ops.triton.dequant, where the CUDA kernels are (imported on first use)."""
    from lowbit.ops.triton import dequant    # optional: triton

    return dequant


def dequantize_w4(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, kind: str, group: int,
                  zero: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit expert weights packed [E, N, K / 2] (pack_int4 of signed int4 codes, or pack_fp4), with
    per-group scales [E, N, K / group] (int4: fp32, and int zero points `zero`; MXFP4 / NVFP4: the
    uint8 scale codes) -> out [E, N, K] bf16 (see the module docstring). offsets (CUDA only): skip
    experts without rows."""
    if kind not in GROUPED_W4:
        raise ValueError(f"kind={kind!r}; choose one of {GROUPED_W4}")
    if out.is_cuda:
        return _kernels().dequantize_packed(packed, scale, out, wfmt=WFMT[kind], group=group, zero=zero, offsets=offsets)
    E, N, Kh = packed.shape
    if kind == "int4":
        vals = unpack_int4(packed).to(torch.float32)
        if zero is not None:
            vals = vals - zero.to(torch.float32).repeat_interleave(group, dim=-1)
        w = vals * scale.to(torch.float32).repeat_interleave(group, dim=-1)
    else:
        codes = scale.to(torch.uint8)
        if kind == "mxfp4":
            codes = codes.clamp(1, 254)
        s = decode(codes, FP4_SCALES[kind]).repeat_interleave(group, dim=-1)
        w = decode(unpack_fp4(packed), "fp4_e2m1fn") * s
    return out.copy_(w)


def dequantize_w8(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                  offsets: torch.Tensor | None = None) -> torch.Tensor:
    """int8 expert weights [E, N, K] times per-channel fp32 scales [E, N] -> out [E, N, K] bf16
    (each weight rounded once from its float32 product). offsets (CUDA only): skip experts without rows."""
    if out.is_cuda:
        return _kernels().dequantize_rows(codes, scale.reshape(-1), out, offsets)
    return out.copy_(codes.to(torch.float32) * scale.to(torch.float32)[..., None])


def weights_buffer(E: int, N: int, K: int, device: torch.device) -> torch.Tensor:
    """The reusable bf16 buffer [E, N, K] of this projection shape (lowbit.ops.scratch)."""
    return scratch((E, N, K), torch.bfloat16, device)


def grouped_bf16(x: torch.Tensor, w: torch.Tensor, routing: Routing, *, identity: bool = False,
                 bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out [R, N] (out_dtype) of the sorted rows: x [T, K] bf16 gathered by routing.token (identity:
    x is the sorted buffer [R, K]) times its expert's w [E, N, K] bf16 by torch._grouped_mm, then in
    float32 * scale[e] (per-expert factors [E], e.g. NVFP4's tensor scales) + bias[e] ([E, N]);
    rows past offsets[E] are zero (see the module docstring)."""
    E, N, K = w.shape
    _check(x, K)
    a = x if identity else x[routing.token]
    a = a.contiguous()
    if a.data_ptr() % 16:                       # torch._grouped_mm reads 16-byte aligned operands
        a = a.clone()
    ends = routing.offsets[1:].to(torch.int32)
    y = torch._grouped_mm(a, w.transpose(1, 2), offs=ends)
    rows = torch.arange(routing.rows, device=y.device)
    expert = torch.searchsorted(routing.offsets[1:], rows, right=True)   # E for rows past offsets[E]
    owned = (expert < E)[:, None]
    if scale is None and bias is None and out_dtype == torch.bfloat16:
        return torch.where(owned, y, 0)
    e = expert.clamp(max=E - 1)
    yf = y.float()
    if scale is not None:
        yf = yf * scale.reshape(E).float()[e][:, None]
    if bias is not None:
        yf = yf + bias.reshape(E, N).float()[e]
    return torch.where(owned, yf, 0).to(out_dtype)


def grouped_dequant_w4(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, routing: Routing, *,
                       group_size: int | None = None, kind: str = "int4", w_zero: torch.Tensor | None = None,
                       w_global: torch.Tensor | None = None, bias=None, identity: bool = False,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """lowbit.ops.triton.grouped_w.grouped_w4a16's product (its arguments, less the tile config) on
    the bf16 path: the weights into the scratch buffer, then grouped_bf16; w_global multiplies each
    expert's output."""
    E, N, Kh = w_packed.shape
    group = FP4_GROUPS.get(kind, group_size)
    if group is None or (2 * Kh) % group:
        raise ValueError(f"group_size={group_size} for kind {kind!r}: int4 needs its group size (dividing K = "
                         f"{2 * Kh}); MXFP4 / NVFP4 use 32 / 16")
    _check(x, 2 * Kh)
    w = dequantize_w4(w_packed, w_scale, weights_buffer(E, N, 2 * Kh, x.device), kind=kind, group=group,
                      zero=w_zero, offsets=routing.offsets)
    return grouped_bf16(x, w, routing, identity=identity, bias=bias, scale=w_global, out_dtype=out_dtype)


def grouped_dequant_w8(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, routing: Routing, *,
                       bias=None, identity: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """lowbit.ops.triton.grouped_w.grouped_w8a16's product (its arguments, less the tile config) on
    the bf16 path."""
    E, N, K = w_codes.shape
    _check(x, K)
    w = dequantize_w8(w_codes, w_scale, weights_buffer(E, N, K, x.device), routing.offsets)
    return grouped_bf16(x, w, routing, identity=identity, bias=bias, out_dtype=out_dtype)
