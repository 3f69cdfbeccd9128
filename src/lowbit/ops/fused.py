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

The residual stream itself is never quantized (seed 004): new_residual has residual's dtype.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from lowbit.packing import pack_fp4, unpack_fp4
from lowbit.quantize import QTensor, compute_scale, quantize, reduce_amax, scale_shape, tensors_to
from lowbit.scheme import QuantScheme

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FMT_CODES = {"int8": 0, "fp8_e4m3fn": 1, "fp4_e2m1fn": 2}
_ROUND_CODES = {"floor": 0, "rceil": 1, "ceil": 2, "even": 3}
# Kernel variants (issue 5 performance work): "row" = one row per program, any scheme (the kernel
# measured on the H200 in docs/benchmarks-memory.md); "tile" = ROWS rows per program, per-token
# int8 / fp8 with fp32 scales only, 32-64 elements per thread. Same arithmetic, same codes.
# DEFAULT_KERNEL is what kernel=None picks, per entry point, from the H200 runs of issue 10:
# "tile" for quantize_rows (1.16x / 1.25x the row kernel, int8 / fp8 at 8192 x 4096) and for
# RMSNorm without a residual (1.15-1.41x); "row" for RMSNorm with a residual (the tile kernel
# is no faster there, 0.97-0.99x, and gave non-canonical scales on sm_90 at ROWS = 1) and for
# SiLU-mul (fp8 tile 0.79x).
KERNELS = ("row", "tile")
DEFAULT_KERNEL = {"quantize_rows": "tile", "rmsnorm_quant": "tile", "rmsnorm_quant+residual": "row",
                  "silu_mul_quant": "row"}
# Schemes outside the per-token fast path (groups, MX, NVFP4, fp4 per token): ":group" entries
# choose between the row kernel and the tile kernel's group variant. H200, 2026-11-30 (bench rows in
# docs/benchmarks-memory.md): the group variant is 1.16-1.21x the row kernel for MXFP4 quantize_rows
# at 8192 x 4096, 1.19-1.47x for RMSNorm + MXFP4 (8192 x 4096 / 8192), 1.06-1.17x for MXFP8 and
# 1.00-1.10x for NVFP4; with a residual and for SiLU-mul it was not timed, so those stay "row".
DEFAULT_KERNEL.update({k + ":group": "row" for k in list(DEFAULT_KERNEL)})
DEFAULT_KERNEL.update({"quantize_rows:group": "tile", "rmsnorm_quant:group": "tile"})


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
    if scheme.format not in _FMT_CODES:
        raise NotImplementedError(f"{where}: element format {scheme.format!r} ({scheme}) has no fused kernel; "
                                  f"supported: {', '.join(_FMT_CODES)}. Use lowbit.quantize on the float output.")
    if not scheme.symmetric:
        raise NotImplementedError(f"{where}: asymmetric activation quantization ({scheme}) has no fused kernel; "
                                  "use symmetric=True (zero points cost a GEMM correction term, seed 004)")
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


# ------------------------------------------------------------------------------------------
# Kernel launch
# ------------------------------------------------------------------------------------------
def _launch(pre: int, x2: torch.Tensor, K: int, scheme: QuantScheme, G: int, *, weight=None, eps=0.0,
            res2=None, res_out=None, store_y=False, fp8_encoder: str = "auto", tile=None, pack: bool = False,
            global_scale: torch.Tensor | None = None):
    """Run the row kernel over x2 [rows, K or 2K]; returns (codes, scale, scale_codes, g, y).
    With `tile` = (ROWS, num_warps): the tile kernel's group variant instead (both of NVFP4's
    passes included, see _launch_groups); pack: fp4 codes two per byte (group variant only)."""
    import triton

    from lowbit.ops.triton import fused_quant as fq

    rows, dev = x2.shape[0], x2.device
    block = max(16, triton.next_power_of_2(K))
    if block > fq.MAX_BLOCK:
        raise ValueError(f"hidden size K = {K} exceeds the fused kernel's {fq.MAX_BLOCK} elements per row "
                         "(the row lives in registers); use backend='torch'")
    NG, Gt = (1, block) if G == K else (block // G, G)
    ngroups = K // G
    fmt = scheme.fmt
    warps = _row_warps(block)
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    w = weight if weight is not None else dummy
    r_in = res2 if res2 is not None else dummy
    r_out = res_out if res_out is not None else dummy
    common = dict(PRE=pre, HAS_RES=res2 is not None, **_format_meta(scheme, x2, fp8_encoder), NG=NG, G=Gt,
                  EVEN=NG * Gt == K, G_GIVEN=global_scale is not None, num_warps=warps)
    scale_kind = common["SCALE_KIND"]
    if tile is not None:  # the tile kernel's group variant
        return _launch_groups(x2, K, G, tile, common, w, eps, res2, res_out, store_y, pack, global_scale)
    tamax = gscale = global_scale  # a calibrated tensor scale: one pass, g = global_scale
    if scale_kind == 2 and global_scale is None:  # two-level: tensor scale from the live tensor's amax (first pass)
        amax = torch.empty(rows, device=dev, dtype=torch.float32)
        fq._row_quant_kernel[(rows,)](x2, x2.stride(0), w, r_in, r_in.stride(0) if res2 is not None else 0,
                                      r_out, 0, dummy, dummy, dummy, dummy, dummy, dummy, amax, K, ngroups,
                                      eps, STORE_Y=False, AMAX_ONLY=True, **common)
        # the second pass turns it into g = amax / (448 * fmt.max), quantize.two_level_global_scale's
        # rule, on the device (no host round trip, so the whole call can be graph-captured)
        tamax = amax.max().reshape(1)
        gscale = torch.empty(1, device=dev, dtype=torch.float32)
    codes = torch.empty(rows, K, device=dev, dtype=torch.int8 if fmt.kind == "int" else torch.uint8)
    scale = torch.empty(rows, ngroups, device=dev, dtype=torch.float32)
    scodes = torch.empty(rows, ngroups, device=dev, dtype=torch.uint8) if scale_kind else dummy
    y = torch.empty(rows, K, device=dev, dtype=torch.float32) if store_y else dummy
    fq._row_quant_kernel[(rows,)](
        x2, x2.stride(0), w, r_in, r_in.stride(0) if res2 is not None else 0,
        r_out, r_out.stride(0) if res_out is not None else 0, y, codes, scale, scodes,
        tamax if tamax is not None else dummy, gscale if gscale is not None else dummy, dummy, K, ngroups, eps,
        STORE_Y=store_y, AMAX_ONLY=False, **common)
    return codes, scale, (scodes if scale_kind else None), gscale, (y if store_y else None)


def _row_warps(block: int) -> int:
    """num_warps of a kernel holding one row of `block` elements in registers (row quantizer, qdq_rows)."""
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def _format_meta(scheme: QuantScheme, x2: torch.Tensor, fp8_encoder: str = "auto") -> dict:
    """The fused kernels' compile-time description of `scheme` (element format, scale kind and
    rounding, the element's max / qmax, exponent and mantissa widths, NVFP4's tensor-scale divisor)
    and of where they run (hardware fp8 encoder, fast division: GPU only)."""
    fmt = scheme.fmt
    scale_kind = {"fp32": 0, "e8m0": 1, "fp8_e4m3fn": 2}[scheme.scale_format]
    if fp8_encoder not in ("auto", "hw", "int"):
        raise ValueError(f"fp8_encoder must be 'auto', 'hw' or 'int', got {fp8_encoder!r}")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    g_div = 1.0
    if scale_kind == 2:  # NVFP4's tensor-scale divisor: scale format max * element max (448 * 6)
        from lowbit.formats import get_format

        g_div = float(get_format(scheme.scale_format).max) * float(fmt.max)
    return dict(FMT=_FMT_CODES[scheme.format], SCALE_KIND=scale_kind,
                E8M0_ROUND=_ROUND_CODES.get(scheme.scale_rounding or "floor", 0),
                QMAX=float(fmt.qmax if fmt.kind == "int" else fmt.max),
                EMAX=math.frexp(float(fmt.max))[1] - 1 if fmt.kind == "float" else 0,  # floor(log2 max)
                MBITS=int(getattr(fmt, "mbits", 0) or 0), HW_FP8=x2.is_cuda and fp8_encoder != "int" and not interp,
                FAST_DIV=x2.is_cuda and not interp, G_DIV=g_div)


def _launch_groups(x2, K, G, tile, common, w, eps, res2, res_out, store_y, pack, global_scale=None):
    """_group_tile_kernel over x2 with the row kernel's meta-parameters `common` (same scale and
    format arguments); NVFP4 takes two passes of it (the tensor amax of the same y, then the
    codes). Returns what _launch returns."""
    import triton

    from lowbit.ops.triton import fused_quant as fq

    rows, dev = x2.shape[0], x2.device
    R, warps = tile
    NG, Gt = common["NG"], common["G"]  # [groups, width] of a row, as the row kernel tiles it
    ngroups = K // G
    kind = common["SCALE_KIND"]
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    meta = {k: v for k, v in common.items() if k not in ("NG", "G", "EVEN", "num_warps")}
    meta.update(PACK=pack, ROWS=R, NG=NG, G=Gt, EVEN=NG * Gt == K and rows % R == 0, num_warps=warps)
    rin = dict(W=w, R=res2 if res2 is not None else dummy, R_stride=res2.stride(0) if res2 is not None else 0,
               R_OUT=res_out if res_out is not None else dummy,
               R_OUT_stride=res_out.stride(0) if res_out is not None else 0)
    grid = (triton.cdiv(rows, R),)
    tamax = gscale = global_scale  # a calibrated tensor scale: one pass, g = global_scale
    inv = dummy
    two_pass = kind == 2 and global_scale is None
    if two_pass:  # NVFP4: the tensor scale from the amax of the y this kernel computes
        amax = torch.empty(rows, device=dev, dtype=torch.float32)
        inv = torch.empty(rows, device=dev, dtype=torch.float32) if common["PRE"] == 1 else dummy
        fq._group_tile_kernel[grid](x2, x2.stride(0), Y=dummy, CODES=dummy, SCALE=dummy, SCALE_CODES=dummy,
                                    GSCALE=dummy, GOUT=dummy, AMAX=amax, INV=inv, n_rows=rows, K=K,
                                    NGROUPS=ngroups, eps=eps, STORE_Y=False, AMAX_ONLY=True, TWO_PASS=two_pass,
                                    **rin, **meta)
        tamax = amax.max().reshape(1)
        gscale = torch.empty(1, device=dev, dtype=torch.float32)
    codes = torch.empty(rows, K // 2 if pack else K, device=dev,
                        dtype=torch.int8 if common["FMT"] == 0 else torch.uint8)
    scale = torch.empty(rows, ngroups, device=dev, dtype=torch.float32)
    scodes = torch.empty(rows, ngroups, device=dev, dtype=torch.uint8) if kind else dummy
    y = torch.empty(rows, K, device=dev, dtype=torch.float32) if store_y else dummy
    fq._group_tile_kernel[grid](x2, x2.stride(0), Y=y, CODES=codes, SCALE=scale, SCALE_CODES=scodes,
                                GSCALE=tamax if tamax is not None else dummy,
                                GOUT=gscale if gscale is not None else dummy, AMAX=dummy, INV=inv, n_rows=rows, K=K,
                                NGROUPS=ngroups, eps=eps, STORE_Y=store_y, AMAX_ONLY=False,
                                TWO_PASS=two_pass, **rin, **meta)
    return codes, scale, (scodes if kind else None), gscale, (y if store_y else None)


def tile_supports(scheme: QuantScheme) -> bool:
    """Whether the "tile" kernel's per-token fast path (_token_tile_kernel) takes `scheme`:
    per-token / per-channel, int8 or fp8_e4m3fn, fp32 scale. Every other scheme the fused
    quantizer takes goes to its group kernel (_group_tile_kernel) under kernel="tile"."""
    return (scheme.strategy in ("token", "channel") and scheme.format in ("int8", "fp8_e4m3fn")
            and scheme.scale_format == "fp32")


def tile_config(K: int, pre: int, residual: bool = False, fp8: bool = False, mx: bool = False) -> tuple[int, ...]:
    """(ROWS, num_warps) of the "tile" kernel for rows of K elements: 32 elements of a row per
    thread (num_warps = next_pow2(K) / 1024, at most 16; 64 per thread from 8192 on), and rows stacked up to 32 elements per
    thread when a row is shorter than 1024. From the sm_90 SASS (python -m lowbit.bench.memory
    --sass), not from timings: 64 per thread takes 16.6 instead of 19.2 instructions per
    element on the RMSNorm + int8 fast path but ~140 registers instead of ~72 (half the warps
    per SM); the benchmark times 32 and 64 per thread side by side (`pre` is unused so far).
    With a `residual`, at least 2 rows per program (one row gave non-canonical scales on sm_90).
    fp8 (per-token fp8_e4m3fn on the token fast path), no residual, K >= 8192: (ROWS, num_warps, 2),
    the persistent form with 2 programs per SM (H200, RMSNorm + fp8 at 8192 x 8192: 79.9% / 78.5%
    of copy with 2 / 4 programs per SM against 74.9% one program per tile; for int8 it lost:
    79.8% against 85.1%, and at 4096 both lost).
    mx (the group kernel with e8m0 scales, MXFP4 / MXFP8), no residual: 64 per thread from 4096 on."""
    import triton

    block = max(16, triton.next_power_of_2(K))
    # rows of 8192 and more: 64 per thread (H200, 8192 x 8192: 84.9% of the copy ceiling
    # against 76.7% at 32 per thread for int8, 76.5% / 74.8% for fp8); at 4096, 32 per
    # thread stays ahead (77.5% against 74.9%). docs/benchmarks-memory.md has the rows.
    # MX group scales at 4096 (no residual): 64 per thread as well (H200, 2026-12-01, 8192 x 4096, one
    # row and 2 warps against 4: quantize MXFP4 73.4% / 69.5% of copy, RMSNorm + MXFP8 78.2% / 74.6%,
    # RMSNorm + MXFP4 64.6% / 63.8%, quantize MXFP8 81.8% / 82.4%; NVFP4 lost 1-2 points: unchanged)
    wide = block >= 8192 or (mx and not residual and block >= 4096)
    warps = min(16, max(1, block // (2048 if wide else 1024)))
    rows = 1
    while rows * block < 32 * 32 * warps and rows < 8:
        rows *= 2
    if (rows, warps) == (1, 1) or (residual and rows == 1):  # refused in _launch_tile (non-canonical
        rows = 2                                                # scales seen on sm_90)
    if fp8 and not residual and block >= 8192:
        return rows, warps, 2
    return rows, warps


def default_tile(scheme: QuantScheme, K: int, pre: int, residual: bool = False) -> tuple[int, ...]:
    """The tile the "tile" kernel takes for `scheme` when none is given: tile_config with the
    scheme's flags (fp8 on the per-token fast path; mx for e8m0 group scales)."""
    return tile_config(K, pre, residual=residual, fp8=tile_supports(scheme) and scheme.format == "fp8_e4m3fn",
                       mx=scheme.scale_format == "e8m0")


def _resolve_kernel(kernel: str | None, scheme: QuantScheme, where: str, variant: str = "",
                    pack: bool = False) -> str:
    """The kernel an entry point runs: `kernel`, or DEFAULT_KERNEL[where + variant] for None
    (group-scaled schemes: DEFAULT_KERNEL[where + ":group"]). pack=True needs "tile" (the
    kernel that writes two fp4 codes per byte)."""
    if kernel is None:
        if pack:
            return "tile"
        return DEFAULT_KERNEL[where + variant + ("" if tile_supports(scheme) else ":group")]
    if kernel not in KERNELS:
        raise ValueError(f"{where}: kernel must be one of {KERNELS} or None (default "
                         f"{DEFAULT_KERNEL[where + variant]!r}), got {kernel!r}")
    if pack and kernel != "tile":
        raise ValueError(f"{where}: pack=True writes two fp4 codes per byte, which only kernel='tile' does; "
                         f"pass kernel='tile' or kernel=None, not {kernel!r}")
    return kernel


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


def _launch_tile(pre: int, x2: torch.Tensor, K: int, scheme: QuantScheme, G: int, *, weight=None, eps=0.0,
                 res2=None, res_out=None, store_y=False, fp8_encoder: str = "auto",
                 tile: tuple[int, ...] | None = None, pack: bool = False,
                 global_scale: torch.Tensor | None = None):
    """The "tile" kernel over x2 [rows, K or 2K]: the per-token fast path for the schemes
    tile_supports takes, else the group variant; returns (codes, scale, scale_codes, g, y)."""
    import triton

    from lowbit.ops.triton import fused_quant as fq

    rows, dev = x2.shape[0], x2.device
    block = max(16, triton.next_power_of_2(K))
    if block > fq.MAX_BLOCK:
        raise ValueError(f"hidden size K = {K} exceeds the fused kernel's {fq.MAX_BLOCK} elements per row "
                         "(the row lives in registers); use backend='torch'")
    if tile is None:
        tile = default_tile(scheme, K, pre, residual=res2 is not None)
    if not isinstance(tile, (tuple, list)) or len(tile) not in (2, 3) or not all(isinstance(t, int) for t in tile):
        raise ValueError(f"tile must be (rows, num_warps) or (rows, num_warps, programs per SM), got {tile!r}")
    R, warps, persist = (tuple(tile) + (0,))[:3]
    if R < 1 or R & (R - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"tile=(rows, num_warps) must be powers of two, got {tile}")
    if persist < 0 or (persist and not tile_supports(scheme)):
        raise ValueError(f"tile={tuple(tile)}: the third entry (persistent programs per SM, >= 1) is for the "
                         f"per-token int8 / fp8 fast path only, not {scheme}")
    if (R, warps) == (1, 1):
        # Seen on the H200 (torch 2.11, triton 3.6): with one row and one warp per program the
        # per-token scales differed from lowbit.quantize on the kernel's own output (codes
        # equal); not understood yet, so the configuration is refused rather than trusted.
        raise ValueError("tile=(1, 1) gave non-canonical scales on sm_90 and is refused; use ROWS >= 2 "
                         "or num_warps >= 2 (tile=None picks a valid one)")
    if res2 is not None and R == 1:
        # Seen on the H200 in three runs (scripts/gpu_tile_diag.py): with a residual and one row per
        # program, per-token scales came out one or two ulps off RN(max |y| / qmax) of the stored
        # y (codes equal), also with amax reduced from y itself -- as if the compiler evaluated the
        # RMSNorm twice with two summation orders; ROWS >= 2 was canonical in every run.
        raise ValueError(f"tile={tuple(tile)} with a residual: one row per program gave non-canonical scales "
                         "on sm_90 and is refused; use ROWS >= 2 (tile=None picks a valid one)")
    if not tile_supports(scheme):  # (pack=True is fp4: never on the per-token fast path)
        return _launch(pre, x2, K, scheme, G, weight=weight, eps=eps, res2=res2, res_out=res_out, store_y=store_y,
                       fp8_encoder=fp8_encoder, tile=(R, warps), pack=pack, global_scale=global_scale)
    if fp8_encoder not in ("auto", "hw", "int"):
        raise ValueError(f"fp8_encoder must be 'auto', 'hw' or 'int', got {fp8_encoder!r}")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    fmt = scheme.fmt
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    codes = torch.empty(rows, K, device=dev, dtype=torch.int8 if fmt.kind == "int" else torch.uint8)
    scale = torch.empty(rows, 1, device=dev, dtype=torch.float32)
    y = torch.empty(rows, K, device=dev, dtype=torch.float32) if store_y else dummy
    n_tiles = triton.cdiv(rows, R)
    nprog = 0  # one program per tile; persist > 0: that many programs per SM, each prefetching its next tile
    if persist:
        from lowbit.ops.triton.common import num_sms

        nprog = min(n_tiles, persist * (num_sms() if x2.is_cuda else 4))
    fq._token_tile_kernel[(nprog or n_tiles,)](
        x2, x2.stride(0), weight if weight is not None else dummy, res2 if res2 is not None else dummy,
        res2.stride(0) if res2 is not None else 0, res_out if res_out is not None else dummy,
        res_out.stride(0) if res_out is not None else 0, y, codes, scale, rows, K, eps,
        PRE=pre, HAS_RES=res2 is not None, STORE_Y=store_y, FMT=_FMT_CODES[scheme.format],
        QMAX=float(fmt.qmax if fmt.kind == "int" else fmt.max),
        HW_FP8=x2.is_cuda and fp8_encoder != "int" and not interp, FAST_DIV=x2.is_cuda and not interp,
        ROWS=R, BLOCK=block, EVEN=block == K and rows % R == 0, FULL=block == K, NPROG=nprog, num_warps=warps)
    return codes, scale, None, None, (y if store_y else None)


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
    """Dispatch to the kernel _resolve_kernel names; returns what _launch returns."""
    if _resolve_kernel(kernel, scheme, where, variant, pack) == "tile":
        return _launch_tile(pre, x2, K, scheme, G, tile=tile, pack=pack, **args)
    return _launch(pre, x2, K, scheme, G, **args)


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

    from lowbit.ops.triton.dequant import _qdq_rows_kernel

    M, K = x2.shape
    G = scheme.group_size
    meta = _format_meta(scheme, x2)
    nv = meta["SCALE_KIND"] == 2
    if scheme.format != "fp4_e2m1fn" or meta["SCALE_KIND"] == 0 or K % G:
        raise ValueError(f"qdq_rows: MXFP4 / NVFP4 schemes with K a multiple of the group, got {scheme}, K = {K}")
    block = max(16, triton.next_power_of_2(K))
    dev = x2.device
    out = torch.empty((M, K), dtype=torch.bfloat16, device=dev)
    gprod = torch.empty(1, dtype=torch.float32, device=dev) if nv else None
    amax = torch.empty(M, dtype=torch.float32, device=dev) if nv and M > 1 else out
    warps = _row_warps(block)
    args = dict(meta, NG=block // G, G=G, EVEN=block == K, ONE=M == 1, HAS_WG=weight_scale is not None,
                num_warps=warps)
    wg = weight_scale if weight_scale is not None else out
    rows_amax = M  # how many entries of amax the quantizing programs reduce
    if nv and M > 1:
        _qdq_rows_kernel[(M,)](x2, x2.stride(0), out, out.stride(0), amax, wg, out, M, K,
                               AMAX_ONLY=True, MP2=2, **args)
        if M > QDQ_MAX_ROWS:  # the max is exact: the same tensor scale as the programs' own reduction
            amax, rows_amax = amax.amax().reshape(1), 1
    _qdq_rows_kernel[(M,)](x2, x2.stride(0), out, out.stride(0), amax, wg, gprod if nv else out, rows_amax, K,
                           AMAX_ONLY=False, MP2=max(2, triton.next_power_of_2(rows_amax)), **args)
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
