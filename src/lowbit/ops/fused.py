"""Fused activation quantizers: RMSNorm (+ residual add) + quantize, SiLU-and-multiply +
quantize, and standalone dynamic quantization per token / per group.

Public functions (CUDA -> Triton kernel, CPU -> PyTorch reference twin; `backend="triton"`
or `"torch"` forces one, and on the CPU "triton" runs in Triton's interpreter):

    qt, new_residual = rmsnorm_quant(x, weight, eps, scheme, residual=None)
    qt = silu_mul_quant(x, scheme)            # x = [..., 2H]: gate then up
    qt = quantize_rows(x, scheme)             # dynamic quantize, no prologue

Kernel variants (`kernel=`): "row" (one row per program) and "tile" (ROWS rows per program:
a per-token fast path for int8 / fp8_e4m3fn with fp32 scales, and a group variant for every
other scheme; `tile=(ROWS, num_warps)` overrides its heuristic tile_config); None picks
DEFAULT_KERNEL (per entry point and scheme kind). All give identical codes.

fp4 codes packed two per byte (`pack=True`, fp4_e2m1fn schemes, tile kernel): the entry points
return a PackedQTensor whose `packed` is uint8 [..., K / 2] in lowbit.packing.pack_fp4's layout
(element 2j in the low nibble) -- what the W4A16 kernels and compressed-tensors' nvfp4 read --
and whose unpack() is the QTensor the unpacked call returns.

Schemes the kernel takes (anything else raises NotImplementedError naming the scheme):
symmetric; element format int8, fp8_e4m3fn or fp4_e2m1fn; strategy token / channel (one
scale per row), group (power-of-two group_size dividing K) or block (1, bc); scale format
fp32, e8m0 (MXFP8 / MXFP4, any scale_rounding) or fp8_e4m3fn (NVFP4: the tensor scale is
taken from the live tensor in a first pass that only reduces the row maxima).

Arithmetic (both backends): the prologue is evaluated in float32,
    RMSNorm:  h = x + residual (rounded to residual's dtype: that is the new residual),
              y = (h * weight) * (1 / sqrt_rn(mean(h^2) + eps))
    SiLU-mul: y = (g / (1 + exp(-g))) * u
and y is quantized with lowbit.quantize's canonical arithmetic. The kernel's codes and
scales equal lowbit.quantize(y_kernel, scheme) exactly; the twin's y may differ from the
kernel's y in the last float32 bit (reduction order of mean(h^2); exp), which is the one
documented source of differing codes between the backends. Both are checked against a
float64 evaluation within the bound derived in tests/ops/test_fused_quant.py.

The residual stream itself is never quantized (its outliers would be clipped): new_residual has residual's dtype.

Kernel choice and tiles live in lowbit.ops.fused_configs, the launchers in lowbit.ops.fused_launch;
this module checks the arguments, runs the reference twins and assembles the results.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lowbit.ops.fused_configs import (DEFAULT_KERNEL, KERNELS, default_tile, resolve_kernel, row_warps, tile_config,
                                      tile_supports)
from lowbit.ops.fused_launch import FMT_CODES, format_meta, launch_rows, launch_tile
from lowbit.packing import pack_fp4, unpack_fp4
from lowbit.quantize import QTensor, compute_scale, quantize, reduce_amax, scale_shape, tensors_to
from lowbit.scheme import QuantScheme

__all__ = ["rmsnorm_quant", "silu_mul_quant", "quantize_rows", "qdq_rows", "PackedQTensor", "rmsnorm_reference",
           "silu_mul_reference", "KERNELS", "DEFAULT_KERNEL", "QDQ_MAX_ROWS", "default_tile", "tile_config",
           "tile_supports"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------------------
# Reference twins (PyTorch, any device)
# ------------------------------------------------------------------------------------------
def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 y = RMSNorm(x [+ residual]) * weight, and the new residual (residual's dtype)."""
    new_res = None
    if residual is not None:
        new_res = (x.float() + residual.float()).to(residual.dtype)
        h = new_res.float()
    else:
        h = x.float()
    ms = (h * h).sum(-1, keepdim=True) / h.shape[-1]
    inv = 1.0 / torch.sqrt(ms + eps)
    return (h * weight.float()) * inv, new_res


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """float32 y = silu(gate) * up for x = [..., 2H] (gate = first half)."""
    H = x.shape[-1] // 2
    g, u = x[..., :H].float(), x[..., H:].float()
    return (g / (1.0 + torch.exp(-g))) * u


# ------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------
def _check_scheme(scheme: QuantScheme, K: int, where: str) -> int:
    """Return the group width G (K for per-row scales); raise for what the kernel cannot do."""
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"{where}: scheme must be a QuantScheme (e.g. lowbit.get_preset('int8_token')), "
                        f"got {type(scheme).__name__}")
    if scheme.format not in FMT_CODES:
        raise NotImplementedError(f"{where}: element format {scheme.format!r} ({scheme}) has no fused kernel; "
                                  f"supported: {', '.join(FMT_CODES)}. Use lowbit.quantize on the float output.")
    if not scheme.symmetric:
        raise NotImplementedError(f"{where}: asymmetric activation quantization ({scheme}) has no fused kernel; "
                                  "use symmetric=True (zero points cost a GEMM correction term)")
    s = scheme.strategy
    if s in ("token", "channel"):
        return K
    if s == "block":
        if scheme.block_size[0] != 1:
            raise NotImplementedError(f"{where}: block {scheme.block_size} spans rows; the row kernel takes "
                                      "block_size (1, cols) only")
        g = scheme.block_size[1]
    elif s == "group":
        g = scheme.group_size
    else:
        raise NotImplementedError(f"{where}: strategy {s!r} ({scheme}) needs a whole-tensor reduction; "
                                  "the row kernel takes token, channel, group or (1, cols) block")
    if K % g:
        raise ValueError(f"{where}: hidden size K = {K} is not a multiple of the group width {g} ({scheme}); "
                         f"choose a group size dividing {K}")
    if g & (g - 1):
        raise NotImplementedError(f"{where}: group width {g} is not a power of two; the kernel tiles rows "
                                  "as [groups, width] with power-of-two extents")
    return g


def _check_x(x: torch.Tensor, name: str, where: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{where}: {name} has dtype {x.dtype}; use bfloat16, float16 or float32")
    if x.ndim == 0 or x.numel() == 0:
        raise ValueError(f"{where}: {name} has shape {tuple(x.shape)}; give it shape [..., K] with K > 0")


def _pick_backend(x: torch.Tensor, backend: str | None, where: str) -> str:
    if backend is None:
        return "triton" if x.is_cuda else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"{where}: backend must be 'triton', 'torch' or None, got {backend!r}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{where}: backend='triton' on a CPU tensor needs Triton's interpreter; set "
                           "TRITON_INTERPRET=1 before importing triton, or use backend='torch'")
    return backend


def _check_pack(pack: bool, scheme: QuantScheme, K: int, where: str) -> None:
    if not isinstance(pack, bool):
        raise TypeError(f"{where}: pack must be True or False, got {pack!r}")
    if pack and scheme.format != "fp4_e2m1fn":
        raise ValueError(f"{where}: pack=True packs 4-bit codes two per byte; {scheme} has {scheme.format} "
                         "elements (one byte each already). Use pack=False")
    if pack and K % 2:
        raise ValueError(f"{where}: pack=True needs an even hidden size, got K = {K}")


def _check_global_scale(g, scheme: QuantScheme, x: torch.Tensor, where: str,
                        check_value: bool = True) -> torch.Tensor | None:
    """A calibrated tensor scale for two-level (NVFP4) schemes: float32 [1], finite, > 0, on x's
    device. Its value is checked only with check_value (the entry points' check_finite): reading it
    is a device-to-host sync, which a CUDA graph capture does not allow."""
    if g is None:
        return None
    if not scheme.two_level:
        raise ValueError(f"{where}: global_scale is the tensor scale of two-level schemes (fp8_e4m3fn block "
                         f"scales, NVFP4); {scheme} has none. Leave global_scale=None")
    if not isinstance(g, torch.Tensor) or g.numel() != 1 or g.dtype != torch.float32:
        raise ValueError(f"{where}: global_scale must be a float32 tensor with one element (the calibrated "
                         f"tensor scale, e.g. compressed-tensors' input_global_scale), got "
                         f"{getattr(g, 'dtype', type(g).__name__)} {tuple(getattr(g, 'shape', ()))}")
    if g.device != x.device:
        raise ValueError(f"{where}: global_scale is on {g.device}, x on {x.device}; move it to x's device")
    if check_value and not bool(torch.isfinite(g).all() and (g > 0).all()):
        raise ValueError(f"{where}: global_scale must be finite and > 0, got {float(g.reshape(()))}")
    return g.reshape(1).contiguous()


def _canonical(y: torch.Tensor, scheme: QuantScheme, g: torch.Tensor | None) -> QTensor:
    """lowbit.quantize(y), with the block scales taken relative to a given tensor scale g."""
    if g is None:
        return quantize(y, scheme)
    return quantize(y, scheme, scales=compute_scale(reduce_amax(y, scheme), scheme, global_scale=g))


# ------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedQTensor:
    """A QTensor of fp4 codes stored two per byte (what pack=True returns).

    packed:       uint8 [..., K / 2], element 2j in the low nibble, 2j + 1 in the high one
                  (lowbit.packing.pack_fp4's layout, the W4A16 kernels' and compressed-tensors').
    scale, scheme, shape, scale_codes, global_scale: as QTensor's (shape is the unpacked [..., K])."""

    packed: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme
    shape: tuple[int, ...]
    scale_codes: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def unpack(self) -> QTensor:
        """The QTensor with one code per byte (equal to the pack=False call's)."""
        return QTensor(unpack_fp4(self.packed, k=self.shape[-1]), self.scale, None, self.scheme, self.shape,
                       self.scale_codes, self.global_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.unpack().dequantize(dtype)

    def to(self, device) -> "PackedQTensor":
        return tensors_to(self, device)


def _assemble(codes, scale, scodes, gscale, scheme: QuantScheme, lead: tuple[int, ...], K: int,
              check_finite: bool, where: str, pack: bool = False) -> QTensor | PackedQTensor:
    shape = lead + (K,)
    s = scale.reshape(scale_shape(shape, scheme))
    if check_finite and not bool(torch.isfinite(s).all()):
        raise ValueError(f"{where}: the input holds NaN or Inf (a non-finite scale came out); clean the input "
                         "or pass check_finite=False to get the raw result")
    sc = None if scodes is None else scodes.reshape(s.shape)
    gs = None if gscale is None else gscale.reshape(())
    if pack:
        return PackedQTensor(codes.reshape(lead + (K // 2,)), s, scheme, shape, sc, gs)
    return QTensor(codes.reshape(shape), s, None, scheme, shape, sc, gs)


def _packed_twin(qt: QTensor, pack: bool) -> QTensor | PackedQTensor:
    """The torch backend's result in the kernel's form: pack_fp4 of the canonical codes."""
    if not pack:
        return qt
    return PackedQTensor(pack_fp4(qt.codes), qt.scale, qt.scheme, qt.shape, qt.scale_codes, qt.global_scale)


def _rows(x: torch.Tensor, K: int) -> torch.Tensor:
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# ------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------
def _run(pre: int, x2: torch.Tensor, K: int, scheme: QuantScheme, G: int, where: str, variant: str,
         kernel: str | None, tile, pack: bool, **args):
    """Dispatch to the kernel resolve_kernel names; returns what launch_rows returns."""
    if resolve_kernel(kernel, scheme, where, variant, pack) == "tile":
        return launch_tile(pre, x2, K, scheme, G, tile=tile, pack=pack, **args)
    return launch_rows(pre, x2, K, scheme, G, **args)


def quantize_rows(x: torch.Tensor, scheme: QuantScheme, *, backend: str | None = None,
                  check_finite: bool = True, fp8_encoder: str = "auto", kernel: str | None = None,
                  tile: tuple[int, ...] | None = None, pack: bool = False,
                  global_scale: torch.Tensor | None = None) -> QTensor | PackedQTensor:
    """Dynamic quantization of x [..., K] per token / per group (see module docstring).

    Equals lowbit.quantize(x, scheme) code for code; the Triton path reads x once and writes
    codes [..., K] (int8 or uint8 bit patterns; with pack=True fp4 codes two per byte,
    [..., K / 2], returned as a PackedQTensor) and float32 scales [..., K // g].
    global_scale (NVFP4): a calibrated float32 tensor scale g; the block scales are taken
    relative to it (lowbit.quantize with compute_scale(..., global_scale=g)) in one pass over x,
    instead of two (the live tensor's amax first). Its value (finite, > 0) is checked with
    check_finite, which reads it on the host (check_finite=False inside a CUDA graph)."""
    where = "quantize_rows"
    _check_x(x, "x", where)
    K = x.shape[-1]
    G = _check_scheme(scheme, K, where)
    _check_pack(pack, scheme, K, where)
    g = _check_global_scale(global_scale, scheme, x, where, check_finite)
    if _pick_backend(x, backend, where) == "torch":
        return _packed_twin(_canonical(x, scheme, g), pack)
    codes, scale, sc, gs, _ = _run(0, _rows(x, K), K, scheme, G, where, "", kernel, tile, pack,
                                   fp8_encoder=fp8_encoder, global_scale=g)
    return _assemble(codes, scale, sc, gs, scheme, tuple(x.shape[:-1]), K, check_finite, where, pack)


# Up to this many rows, qdq_rows' NVFP4 programs each reduce all rows' absmax themselves (decode
# sizes: no extra launch); above it torch reduces them to the tensor's absmax first (one small
# reduction kernel) and every program reads that one value (an M-wide tile per program would
# not fit its registers at prefill sizes).
QDQ_MAX_ROWS = 64


def qdq_rows(x2: torch.Tensor, scheme: QuantScheme, weight_scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MXFP4 / NVFP4 dynamic quantization of x2 [M, K] (bf16 / fp16 / fp32, unit stride along K)
    returned dequantized: (xd bf16 [M, K] = e2m1 * block scale, exact;
    NVFP4: weight_scale * g as float32 [1], g the activation's tensor scale -- g itself without a
    weight_scale; MXFP4: None). The same
    numbers as quantize_rows(x2, scheme) decoded by dequantize_groups (the runtime's W4A4
    emulation), in one kernel (NVFP4 with M > 1: the rows' absmax first, and above QDQ_MAX_ROWS
    rows their maximum by torch: three). No argument
    checks beyond the shapes: lowbit.ops.prepared's fast path calls it (CUDA-graph safe: no host sync)."""
    import triton

    from lowbit.ops.triton import common, dequant    # optional: triton

    M, K = x2.shape
    G = scheme.group_size
    meta = format_meta(scheme, x2)
    nv = meta["SCALE_KIND"] == 2
    if scheme.format != "fp4_e2m1fn" or meta["SCALE_KIND"] == 0 or K % G:
        raise ValueError(f"qdq_rows: MXFP4 / NVFP4 schemes with K a multiple of the group, got {scheme}, K = {K}")
    block = max(16, triton.next_power_of_2(K))
    dev = x2.device
    out = torch.empty((M, K), dtype=torch.bfloat16, device=dev)
    gprod = torch.empty(1, dtype=torch.float32, device=dev) if nv else None
    amax = torch.empty(M, dtype=torch.float32, device=dev) if nv and M > 1 else out
    warps = row_warps(block)
    args = dict(meta, NG=block // G, G=G, EVEN=block == K, ONE=M == 1, HAS_WG=weight_scale is not None,
                num_warps=warps)
    wg = weight_scale if weight_scale is not None else out
    rows_amax = M  # how many entries of amax the quantizing programs reduce
    if nv and M > 1:
        common.launch(dequant._qdq_rows_kernel, (M,), x2, x2.stride(0), out, out.stride(0), amax, wg, out, M, K,
                      AMAX_ONLY=True, MP2=2, **args)
        if M > QDQ_MAX_ROWS:  # the max is exact: the same tensor scale as the programs' own reduction
            amax, rows_amax = amax.amax().reshape(1), 1
    common.launch(dequant._qdq_rows_kernel, (M,), x2, x2.stride(0), out, out.stride(0), amax, wg,
                  gprod if nv else out, rows_amax, K, AMAX_ONLY=False, MP2=max(2, triton.next_power_of_2(rows_amax)),
                  **args)
    return out, gprod


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, scheme: QuantScheme,
                  residual: torch.Tensor | None = None, *, backend: str | None = None,
                  return_normalized: bool = False, check_finite: bool = True, fp8_encoder: str = "auto",
                  kernel: str | None = None, tile: tuple[int, ...] | None = None, pack: bool = False,
                  global_scale: torch.Tensor | None = None):
    """RMSNorm(x [+ residual]) * weight, quantized with `scheme`, in one pass over the row.

    x: [..., K] bf16/fp16/fp32; weight: [K]; eps: float; residual: like x (any float dtype) or None.
    Returns (qt, new_residual) -- new_residual = x + residual in residual's dtype (None when no
    residual) -- and, with return_normalized=True, also the float32 normalized output y [..., K]
    the codes were computed from (tests use it to check codes against lowbit.quantize(y)).
    pack=True (fp4 schemes): qt is a PackedQTensor, two codes per byte. global_scale: as quantize_rows'."""
    where = "rmsnorm_quant"
    _check_x(x, "x", where)
    K = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (K,):
        raise ValueError(f"{where}: weight must be a tensor of shape ({K},) (the hidden size), "
                         f"got {getattr(weight, 'shape', type(weight).__name__)}")
    if residual is not None:
        _check_x(residual, "residual", where)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"{where}: residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}; "
                             "they must match")
    if residual is not None and residual.device != x.device or weight.device != x.device:
        raise ValueError(f"{where}: x, weight and residual must be on one device (x is on {x.device})")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"{where}: eps must be a non-negative float, got {eps!r}")
    G = _check_scheme(scheme, K, where)
    _check_pack(pack, scheme, K, where)
    g = _check_global_scale(global_scale, scheme, x, where, check_finite)
    if _pick_backend(x, backend, where) == "torch":
        y, new_res = rmsnorm_reference(x, weight, eps, residual)
        qt = _packed_twin(_canonical(y, scheme, g), pack)
        return (qt, new_res, y) if return_normalized else (qt, new_res)
    lead = tuple(x.shape[:-1])
    res2 = _rows(residual, K) if residual is not None else None
    res_out = torch.empty(res2.shape, device=x.device, dtype=residual.dtype) if residual is not None else None
    codes, scale, sc, gs, y = _run(1, _rows(x, K), K, scheme, G, where, "+residual" if residual is not None else "",
                                   kernel, tile, pack, weight=weight.contiguous(), eps=float(eps), res2=res2,
                                   res_out=res_out, store_y=return_normalized, fp8_encoder=fp8_encoder,
                                   global_scale=g)
    qt = _assemble(codes, scale, sc, gs, scheme, lead, K, check_finite, where, pack)
    new_res = res_out.reshape(x.shape) if res_out is not None else None
    return (qt, new_res, y.reshape(x.shape)) if return_normalized else (qt, new_res)


def silu_mul_quant(x: torch.Tensor, scheme: QuantScheme, *, backend: str | None = None,
                   return_product: bool = False, check_finite: bool = True, fp8_encoder: str = "auto",
                   kernel: str | None = None, tile: tuple[int, ...] | None = None, pack: bool = False,
                   global_scale: torch.Tensor | None = None):
    """silu(gate) * up, quantized with `scheme`: x [..., 2H] (gate = x[..., :H], up = x[..., H:]).

    Returns qt (codes [..., H]; a PackedQTensor with pack=True) and, with return_product=True,
    (qt, y) with y the float32 product. global_scale: as quantize_rows'."""
    where = "silu_mul_quant"
    _check_x(x, "x", where)
    if x.shape[-1] % 2:
        raise ValueError(f"{where}: the last dim of x ({x.shape[-1]}) must be even: gate and up halves "
                         "concatenated, [..., 2H]")
    H = x.shape[-1] // 2
    G = _check_scheme(scheme, H, where)
    _check_pack(pack, scheme, H, where)
    g = _check_global_scale(global_scale, scheme, x, where, check_finite)
    if _pick_backend(x, backend, where) == "torch":
        y = silu_mul_reference(x)
        qt = _packed_twin(_canonical(y, scheme, g), pack)
        return (qt, y) if return_product else qt
    lead = tuple(x.shape[:-1])
    codes, scale, sc, gs, y = _run(2, _rows(x, 2 * H), H, scheme, G, where, "", kernel, tile, pack,
                                   store_y=return_product, fp8_encoder=fp8_encoder, global_scale=g)
    qt = _assemble(codes, scale, sc, gs, scheme, lead, H, check_finite, where, pack)
    return (qt, y.reshape(lead + (H,))) if return_product else qt
