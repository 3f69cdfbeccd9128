"""Launchers of the fused quantizer kernels (lowbit.ops.triton.fused_quant): the row kernel,
the "tile" kernel's per-token fast path and its group variant, NVFP4's two passes, and the
kernels' compile-time description of a scheme. Arguments are validated by lowbit.ops.fused
before these run; the tile is checked here."""
from __future__ import annotations

import math
import os

import torch

from lowbit.formats import get_format
from lowbit.ops.fused_configs import default_tile, row_warps, tile_supports
from lowbit.scheme import QuantScheme

FMT_CODES = {"int8": 0, "fp8_e4m3fn": 1, "fp4_e2m1fn": 2}   # fused_quant's FMT (its _codes branches on it)
ROUND_CODES = {"floor": 0, "rceil": 1, "ceil": 2, "even": 3}


def element_meta(format_name: str) -> tuple[int, float]:
    """(FMT, QMAX) of the fused kernels for an element format: its number in FMT_CODES and the
    largest code magnitude the codes saturate at (an int format's qmax, a float format's max)."""
    fmt = get_format(format_name)
    return FMT_CODES[format_name], float(fmt.qmax if fmt.kind == "int" else fmt.max)


def row_block(K: int) -> int:
    """The power-of-two block (>= 16) a fused kernel's program holds one row of K elements in;
    ValueError past fq.MAX_BLOCK, since the row lives in registers."""
    import triton

    from lowbit.ops.triton import fused_quant as fq    # optional: triton

    block = max(16, triton.next_power_of_2(K))
    if block > fq.MAX_BLOCK:
        raise ValueError(f"hidden size K = {K} exceeds the fused kernel's {fq.MAX_BLOCK} elements per row "
                         "(the row lives in registers); use backend='torch'")
    return block


def launch_rows(pre: int, x2: torch.Tensor, K: int, scheme: QuantScheme, G: int, *, weight=None, eps=0.0,
                res2=None, res_out=None, store_y=False, fp8_encoder: str = "auto", tile=None, pack: bool = False,
                global_scale: torch.Tensor | None = None):
    """Run the row kernel over x2 [rows, K or 2K]; returns (codes, scale, scale_codes, g, y).
    With `tile` = (ROWS, num_warps): the tile kernel's group variant instead (both of NVFP4's
    passes included, see launch_groups); pack: fp4 codes two per byte (group variant only)."""
    from lowbit.ops.triton import common as tc, fused_quant as fq    # optional: triton

    rows, dev = x2.shape[0], x2.device
    block = row_block(K)
    NG, Gt = (1, block) if G == K else (block // G, G)
    ngroups = K // G
    fmt = scheme.fmt
    warps = row_warps(block)
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    w = weight if weight is not None else dummy
    r_in = res2 if res2 is not None else dummy
    r_out = res_out if res_out is not None else dummy
    common = dict(PRE=pre, HAS_RES=res2 is not None, **format_meta(scheme, x2, fp8_encoder), NG=NG, G=Gt,
                  EVEN=NG * Gt == K, G_GIVEN=global_scale is not None, num_warps=warps)
    scale_kind = common["SCALE_KIND"]
    if tile is not None:  # the tile kernel's group variant
        return launch_groups(x2, K, G, tile, common, w, eps, res2, res_out, store_y, pack, global_scale)
    tamax = gscale = global_scale  # a calibrated tensor scale: one pass, g = global_scale
    if scale_kind == 2 and global_scale is None:  # two-level: tensor scale from the live tensor's amax (first pass)
        amax = torch.empty(rows, device=dev, dtype=torch.float32)
        tc.launch(fq._row_quant_kernel, (rows,), x2, x2.stride(0), w, r_in, r_in.stride(0) if res2 is not None else 0,
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
    tc.launch(fq._row_quant_kernel, (rows,),
        x2, x2.stride(0), w, r_in, r_in.stride(0) if res2 is not None else 0,
        r_out, r_out.stride(0) if res_out is not None else 0, y, codes, scale, scodes,
        tamax if tamax is not None else dummy, gscale if gscale is not None else dummy, dummy, K, ngroups, eps,
        STORE_Y=store_y, AMAX_ONLY=False, **common)
    return codes, scale, (scodes if scale_kind else None), gscale, (y if store_y else None)


def format_meta(scheme: QuantScheme, x2: torch.Tensor, fp8_encoder: str = "auto") -> dict:
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
        g_div = float(get_format(scheme.scale_format).max) * float(fmt.max)
    code, qmax = element_meta(scheme.format)
    return dict(FMT=code, SCALE_KIND=scale_kind,
                E8M0_ROUND=ROUND_CODES.get(scheme.scale_rounding or "floor", 0), QMAX=qmax,
                EMAX=math.frexp(float(fmt.max))[1] - 1 if fmt.kind == "float" else 0,  # floor(log2 max)
                MBITS=int(getattr(fmt, "mbits", 0) or 0), HW_FP8=x2.is_cuda and fp8_encoder != "int" and not interp,
                FAST_DIV=x2.is_cuda and not interp, G_DIV=g_div)


def launch_groups(x2, K, G, tile, common, w, eps, res2, res_out, store_y, pack, global_scale=None):
    """_group_tile_kernel over x2 with the row kernel's meta-parameters `common` (same scale and
    format arguments); NVFP4 takes two passes of it (the tensor amax of the same y, then the
    codes). Returns what launch_rows returns."""
    import triton

    from lowbit.ops.triton import fused_quant as fq    # optional: triton

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


def launch_tile(pre: int, x2: torch.Tensor, K: int, scheme: QuantScheme, G: int, *, weight=None, eps=0.0,
                res2=None, res_out=None, store_y=False, fp8_encoder: str = "auto",
                tile: tuple[int, ...] | None = None, pack: bool = False,
                global_scale: torch.Tensor | None = None):
    """The "tile" kernel over x2 [rows, K or 2K]: the per-token fast path for the schemes
    tile_supports takes, else the group variant; returns (codes, scale, scale_codes, g, y)."""
    import triton

    from lowbit.ops.triton import common as tc, fused_quant as fq    # optional: triton

    rows, dev = x2.shape[0], x2.device
    block = row_block(K)
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
        # on sm_90, one row and one warp per program gave per-token scales that differ from
        # lowbit.quantize of the kernel's own output (codes equal); unexplained, so refused
        raise ValueError("tile=(1, 1) gave non-canonical scales on sm_90 and is refused; use ROWS >= 2 "
                         "or num_warps >= 2 (tile=None picks a valid one)")
    if res2 is not None and R == 1:
        # on sm_90, a residual with one row per program gave per-token scales one or two ulps off
        # RN(max |y| / qmax) of the stored y (codes equal), as if the RMSNorm were evaluated twice
        # in two summation orders; ROWS >= 2 is canonical
        raise ValueError(f"tile={tuple(tile)} with a residual: one row per program gave non-canonical scales "
                         "on sm_90 and is refused; use ROWS >= 2 (tile=None picks a valid one)")
    if not tile_supports(scheme):  # (pack=True is fp4: never on the per-token fast path)
        return launch_rows(pre, x2, K, scheme, G, weight=weight, eps=eps, res2=res2, res_out=res_out, store_y=store_y,
                       fp8_encoder=fp8_encoder, tile=(R, warps), pack=pack, global_scale=global_scale)
    if fp8_encoder not in ("auto", "hw", "int"):
        raise ValueError(f"fp8_encoder must be 'auto', 'hw' or 'int', got {fp8_encoder!r}")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    fmt = scheme.fmt
    code, qmax = element_meta(scheme.format)
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    codes = torch.empty(rows, K, device=dev, dtype=torch.int8 if fmt.kind == "int" else torch.uint8)
    scale = torch.empty(rows, 1, device=dev, dtype=torch.float32)
    y = torch.empty(rows, K, device=dev, dtype=torch.float32) if store_y else dummy
    n_tiles = triton.cdiv(rows, R)
    nprog = 0  # one program per tile; persist > 0: that many programs per SM, each prefetching its next tile
    if persist:
        nprog = min(n_tiles, persist * (tc.num_sms() if x2.is_cuda else 4))
    tc.launch(fq._token_tile_kernel, (nprog or n_tiles,),
        x2, x2.stride(0), weight if weight is not None else dummy, res2 if res2 is not None else dummy,
        res2.stride(0) if res2 is not None else 0, res_out if res_out is not None else dummy,
        res_out.stride(0) if res_out is not None else 0, y, codes, scale, rows, K, eps,
        PRE=pre, HAS_RES=res2 is not None, STORE_Y=store_y, FMT=code, QMAX=qmax,
        HW_FP8=x2.is_cuda and fp8_encoder != "int" and not interp, FAST_DIV=x2.is_cuda and not interp,
        ROWS=R, BLOCK=block, EVEN=block == K and rows % R == 0, FULL=block == K, NPROG=nprog, num_warps=warps)
    return codes, scale, None, None, (y if store_y else None)
