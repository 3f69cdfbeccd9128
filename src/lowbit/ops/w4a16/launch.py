"""Launchers of the W4A16 kernels (lowbit.ops.triton.w4a16): the decode GEMM per layout
(planar_chunks, planar8, pairs) with its configuration checked before launch, the one-pass
dequantization for large M, the output scaling, and the pairs kernel's split-K counters."""
from __future__ import annotations

import os

import torch

from lowbit.ops.w4a16 import configs
from lowbit.ops.w4a16.configs import pick_config, pick_config_pairs, pick_config_planar8
from lowbit.ops.w4a16.layout import W4Weight


def split_k_out(x2: torch.Tensor, N: int, split: int) -> tuple[bool, torch.Tensor]:
    """(partial, out) of a planar kernel's launch: with split > 1 each K slice's programs store
    float32 partials into an uninitialised workspace [split, M, N] (every program stores its whole
    masked tile; lowbit.ops.triton.split_k then sums them, adds the bias and rounds to x's dtype);
    else one program per tile writes the output [M, N] in x's dtype."""
    if split > 1:
        return True, torch.empty(split, x2.shape[0], N, device=x2.device, dtype=torch.float32)
    return False, torch.empty(x2.shape[0], N, device=x2.device, dtype=x2.dtype)


def launch_w4a16(x2: torch.Tensor, w: W4Weight, bias, config, interp: bool, act_scale=None) -> torch.Tensor:
    """act_scale (pairs layout, NVFP4): float32 [1], the activation's tensor scale, multiplied
    into w.global_scale ([1] or per row [N]) in the kernel's epilogue."""
    import triton

    from lowbit.ops.triton import w4a16 as k    # optional: triton
    from lowbit.ops.triton.common import launch    # optional: triton

    M, K = x2.shape
    N = w.shape[0]
    if w.layout == "pairs" or (config or {}).get("kernel") == "pairs":
        return launch_pairs(x2, w, bias, config, interp, act_scale)
    if act_scale is not None or (w.global_scale is not None and w.global_scale.numel() != 1):
        raise ValueError("w4a16_linear: per-row or activation tensor scales need the 'pairs' layout")
    if w.layout == "planar8" or (config or {}).get("kernel") in ("gemv8", "dot8"):
        return launch_planar8(x2, w, bias, config, interp)
    cfg = dict(pick_config(M, N, K, w.kind, w.group_size, w.chunk, interpret=interp))
    if config:
        cfg.update(config)
    bk, split = cfg["BLOCK_K"], cfg["split"]
    if K % (bk * split) or bk % w.chunk:
        raise ValueError(f"w4a16_linear: config BLOCK_K={bk}, split={split} does not divide K = {K} "
                         f"(or BLOCK_K is not a multiple of the layout's chunk {w.chunk})")
    if cfg["kernel"] not in ("gemv", "dot"):
        raise ValueError(f"w4a16_linear: config kernel must be 'gemv' or 'dot', got {cfg['kernel']!r}")
    if cfg["kernel"] == "dot" and cfg["BLOCK_M"] < 16:
        cfg["BLOCK_M"] = 16  # tensor-core tiles have at least 16 rows (rows past M are masked)
    wfmt = k.WFMT[w.kind]
    partial, out = split_k_out(x2, N, split)
    dummy = torch.empty(1, device=x2.device, dtype=torch.float32)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split, triton.cdiv(M, cfg["BLOCK_M"]))
    per_group = w.scale if w.kind in ("int4", "uint4") else w.scale_codes
    launch(
        k._w4a16_kernel, grid, x2, w.packed, w.scale, w.zero_point if w.zero_point is not None else dummy,
        w.scale_codes if w.scale_codes is not None else dummy,
        w.global_scale if w.global_scale is not None else dummy,
        bias if (bias is not None and not partial) else dummy, out,
        M, N, K, K // split, x2.stride(0), w.packed.stride(0), per_group.stride(0), out.stride(-2),
        WFMT=wfmt, HAS_Z=w.zero_point is not None, HAS_BIAS=bias is not None and not partial,
        G=w.group_size, C=w.chunk, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, PARTIAL=partial,
        USE_DOT=cfg["kernel"] == "dot", INTERP=interp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return k.reduce_split_k(out, bias, x2.dtype) if partial else out


def dequantize_w4(w: W4Weight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight [N, K] in `dtype` (bf16 / fp16) from a planar-chunks or pairs W4Weight, one Triton pass
    (lowbit.ops.triton.w4a16 _w4_dequant_kernel / _pairs_dequant_kernel: int4 values rounded once per weight, fp4
    values exact; NVFP4's tensor scale is NOT applied). For large-M GEMMs; written into `out` (a
    contiguous [N, K] buffer of `dtype`, e.g. lowbit.ops.scratch's) or a new tensor."""
    import triton

    from lowbit.ops.triton import w4a16 as k    # optional: triton
    from lowbit.ops.triton.common import interpreting, launch    # optional: triton

    N, K = w.shape
    if out is None:
        out = torch.empty((N, K), dtype=dtype, device=w.packed.device)
    dummy = torch.empty(1, device=w.packed.device, dtype=torch.float32)
    if w.layout == "pairs":
        words = w.packed.view(torch.int32)
        bn, chunks, warps = configs.PAIRS_DEQUANT_INTERP if interpreting() else configs.PAIRS_DEQUANT
        while (K // 128) % chunks:
            chunks //= 2
        per_group = w.scale if w.kind in ("int4", "uint4") else w.scale_codes
        launch(k._pairs_dequant_kernel, (triton.cdiv(N, bn), K // (128 * chunks)), words, per_group,
               w.zero_point if w.zero_point is not None else dummy, out, N, words.stride(0), per_group.stride(0),
               out.stride(0), WFMT=k.WFMT[w.kind], HAS_Z=w.zero_point is not None, G=w.group_size, BLOCK_N=bn,
               CHUNKS=chunks, num_warps=warps)
        return out
    if w.layout != "planar_chunks":
        raise ValueError(f"dequantize_w4: layout {w.layout!r} has no dequantization kernel; prepare the weight "
                         "with layout='planar_chunks' or 'pairs'")
    per_group = w.scale if w.kind in ("int4", "uint4") else w.scale_codes
    wfmt = k.WFMT[w.kind]
    bn = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 64
    launch(
        k._w4_dequant_kernel, (triton.cdiv(N, bn), K // w.chunk), w.packed, w.scale, w.zero_point if w.zero_point is not None else dummy,
        w.scale_codes if w.scale_codes is not None else dummy, out, N, K,
        w.packed.stride(0), per_group.stride(0), out.stride(0),
        WFMT=wfmt, HAS_Z=w.zero_point is not None, G=w.group_size, C=w.chunk, BLOCK_N=bn, num_warps=4)
    return out


def scale_output(y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """round(float32(y) * scale [+ bias]) to y's dtype in one pass (y [M, N] bf16 / fp16, scale
    float32 [1] or [N], bias [N] or None): the large-M W4A16 path's NVFP4 tensor scale, the same
    float32 operations as y.float() * scale + bias.float() then .to(y.dtype), which took three passes."""
    import triton

    from lowbit.ops.triton import w4a16 as k    # optional: triton
    from lowbit.ops.triton.common import interpreting, launch    # optional: triton

    M, N = y.shape
    out = torch.empty_like(y)
    interp = interpreting()
    bm, bn = (16, 64) if interp else (16, 256)
    launch(k._scale_output_kernel, (triton.cdiv(M, bm), triton.cdiv(N, bn)), y, scale,
           bias if bias is not None else scale, out, M, N, y.stride(0), out.stride(0),
           ROWS=scale.numel() > 1, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
           INTERP=interp, num_warps=4)
    return out


_SPLIT_LOCKS: dict = {}


def split_locks(device: torch.device, tiles: int) -> torch.Tensor:
    """A zeroed int32 counter per output tile for the pairs kernel's split-K (each call's last
    program per tile resets its counter to 0). On a device's default stream, outside CUDA-graph
    capture: one persistent buffer per device, grown, never shrunk. On any other stream, and
    during capture: a fresh zeroed buffer for this call (one memset; freed with the call's
    other temporaries), because
      - kernels on two streams may run at once and must not share counters;
      - torch.compile's CUDA graphs warm up and record on a side stream with allocations going
        to the graph's memory pool, where a buffer that outlives the call is refused ("tensor(s)
        in the cudagraph pool not tracked as outputs"; the persistent buffer per stream did that).
    """
    if device.type == "cuda" and (torch.cuda.is_current_stream_capturing()
                                  or torch.cuda.current_stream(device) != torch.cuda.default_stream(device)):
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    buf = _SPLIT_LOCKS.get(str(device))
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _SPLIT_LOCKS[str(device)] = buf
    return buf


def launch_pairs(x2: torch.Tensor, w: W4Weight, bias, config, interp: bool, act_scale=None) -> torch.Tensor:
    """The "pairs" kernel on a weight prepared with layout="pairs" (lowbit.ops.triton.w4a16.pairs)."""
    from lowbit.ops.triton import w4a16 as k    # optional: triton
    from lowbit.ops.triton.common import launch    # optional: triton

    M, K = x2.shape
    N = w.shape[0]
    if w.layout != "pairs":
        raise ValueError("w4a16_linear: kernel 'pairs' needs a weight prepared with prepare_w4(wq, layout='pairs')")
    key = (M, N, K, w.group_size, w.kind, interp, x2.device)
    hit = _PAIRS_LAUNCH.get(key) if config is None else None
    if hit is None:
        hit = _pairs_launch(M, N, K, w, config, interp)
        if config is None and M <= CACHE_MAX_M:
            _PAIRS_LAUNCH[key] = hit
    cfg, grid = hit
    bm, bn, bk, split, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["split"], cfg["num_warps"]
    dev = x2.device
    out = torch.empty(M, N, device=dev, dtype=x2.dtype)
    if split > 1:
        part = torch.empty(split, M, N, device=dev, dtype=torch.float32)
        locks = split_locks(dev, grid[0] * grid[2])
    else:
        part = locks = torch.empty(1, device=dev, dtype=torch.float32)
    words = w.packed.view(torch.int32)  # [N, K/8]
    fp4 = w.kind in ("mxfp4", "nvfp4")
    # fp4: the uint8 block-scale codes [N, K/G] read as int32 words (K/G is a multiple of 4)
    per_group = w.scale_codes.view(torch.int32) if fp4 else w.scale
    launch(k._w4a16_pairs_kernel, grid,
           x2, words, per_group, w.zero_point if w.zero_point is not None else part,
           w.global_scale if w.global_scale is not None else part, act_scale if act_scale is not None else part,
           bias if bias is not None else part,
           out, part, locks, M, N, K, K // split, w.fp4_exp_offset or 0, x2.stride(0), words.stride(0),
           per_group.stride(0), out.stride(0), WFMT=k.WFMT[w.kind],
           FOLD=w.kind == "nvfp4" or w.fp4_exp_offset is not None,
           GS_ROWS=w.global_scale is not None and w.global_scale.numel() > 1, HAS_GX=act_scale is not None,
           HAS_Z=w.zero_point is not None,
           HAS_BIAS=bias is not None,
           G=w.group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, WARPS=warps, V3=bm >= 16,
           XPF=bool(cfg["xpf"]), INTERP=interp, num_warps=warps, num_stages=cfg["num_stages"],
           **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interp else {}))
    return out


# Decode-sized launches (rows <= CACHE_MAX_M) keep their checked configuration and grid per (M, N,
# K, group, kind, interpreter, device): the per-call host work is then the allocations and the launch
CACHE_MAX_M = 64
_PAIRS_LAUNCH: dict = {}


def _pairs_launch(M: int, N: int, K: int, w: W4Weight, config, interp: bool) -> tuple[dict, tuple[int, int, int]]:
    """The pairs kernel's checked configuration (the heuristic's, updated by `config`) and grid."""
    cfg = dict(pick_config_pairs(M, N, K, w.group_size, kind=w.kind, interpret=interp))
    unknown = sorted(set(config or {}) - set(cfg))
    if unknown:
        raise ValueError(f"w4a16_linear: pairs config keys {unknown} are not known; the keys are {sorted(cfg)}")
    if config:
        cfg.update(config)
        if "split" in config and "BLOCK_K" not in config and K % (cfg["BLOCK_K"] * cfg["split"]):
            cfg["BLOCK_K"] = 128  # a split asked for without a tile: the smallest step (refused below if it
            # still does not divide K)
    if cfg["kernel"] != "pairs":
        raise ValueError(f"w4a16_linear: a 'pairs' weight runs kernel 'pairs', config asks for {cfg['kernel']!r}; "
                         "prepare the weight with layout='planar_chunks' for it")
    bm, bn, bk, split, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["split"], cfg["num_warps"]
    if bk not in (128, 256) or K % (bk * split):
        raise ValueError(f"w4a16_linear: pairs config BLOCK_K={bk}, split={split}: BLOCK_K must be 128 or 256 "
                         f"and BLOCK_K * split must divide K = {K}")
    if bm & (bm - 1) or bm > 64:
        raise ValueError(f"w4a16_linear: pairs BLOCK_M must be a power of two <= 64, got {bm}")
    if bn % (16 * warps) or bn & (bn - 1):
        raise ValueError(f"w4a16_linear: pairs BLOCK_N must be a power of two and a multiple of 16 * num_warps "
                         f"(the row relabelling), got BLOCK_N={bn}, num_warps={warps}")
    return cfg, (-(-N // bn), split, -(-M // bm))


def launch_planar8(x2: torch.Tensor, w: W4Weight, bias, config, interp: bool) -> torch.Tensor:
    """The "gemv8" or "dot8" kernel on a planar8 weight (lowbit.ops.triton.w4a16.planar8)."""
    import triton

    from lowbit.ops.triton import w4a16 as k    # optional: triton
    from lowbit.ops.triton.common import launch    # optional: triton

    M, K = x2.shape
    N = w.shape[0]
    if w.layout != "planar8":
        raise ValueError("w4a16_linear: kernels 'gemv8' / 'dot8' need a weight prepared with "
                         "prepare_w4(wq, layout='planar8')")
    cfg = dict(pick_config_planar8(M, N, K, w.group_size, interpret=interp, kernel=(config or {}).get("kernel")))
    if config:
        cfg.update(config)
        if "split" in config and "BLOCK_K" not in config:
            # a split asked for without a tile: halve the heuristic's BLOCK_K (down to one
            # group) until the split divides K, instead of refusing a valid request
            while K % (cfg["BLOCK_K"] * cfg["split"]) and cfg["BLOCK_K"] // 2 >= w.group_size \
                    and cfg["BLOCK_K"] % (2 * w.group_size) == 0:
                cfg["BLOCK_K"] //= 2
    kern = cfg["kernel"]
    if kern not in ("gemv8", "dot8"):
        raise ValueError(f"w4a16_linear: a planar8 weight runs kernels 'gemv8' or 'dot8', config asks for "
                         f"{kern!r}; prepare the weight with layout='planar_chunks' for it")
    bk, split, bm = cfg["BLOCK_K"], cfg["split"], cfg["BLOCK_M"]
    if K % (bk * split) or bk % w.group_size:
        raise ValueError(f"w4a16_linear: config BLOCK_K={bk}, split={split} does not divide K = {K} "
                         f"(or BLOCK_K is not a multiple of the group size {w.group_size})")
    if kern == "gemv8" and bm not in (1, 2, 4):
        raise ValueError(f"w4a16_linear: gemv8 BLOCK_M must be 1, 2 or 4, got {bm}")
    if kern == "dot8" and (bm < 16 or w.group_size < 128):
        raise ValueError(f"w4a16_linear: dot8 needs BLOCK_M >= 16 (got {bm}) and group_size >= 128 "
                         f"(got {w.group_size}: a plane of a group is one K = 16 tensor-core step)")
    partial, out = split_k_out(x2, N, split)
    dummy = torch.empty(1, device=x2.device, dtype=torch.float32)
    words = w.packed.view(torch.int32)  # [N, K/8]; K/2 is a multiple of 4 (group >= 32 divides K)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split, triton.cdiv(M, bm))
    args = (x2, words, w.scale, w.zero_point if w.zero_point is not None else dummy,
            bias if (bias is not None and not partial) else dummy, out,
            M, N, K, K // split, x2.stride(0), words.stride(0), w.scale.stride(0), out.stride(-2))
    common = dict(SIGNED=w.kind == "int4", HAS_Z=w.zero_point is not None, HAS_BIAS=bias is not None and not partial,
                  C=w.group_size, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, PARTIAL=partial, INTERP=interp,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if kern == "gemv8":
        launch(k._w4a16_gemv8_kernel, grid, *args, EVEN_N=N % cfg["BLOCK_N"] == 0, EVEN_M=M % bm == 0, **common)
    else:
        unpack = int(cfg.get("unpack", 0))
        if unpack not in (0, 1):
            raise ValueError(f"w4a16_linear: dot8 config 'unpack' must be 0 (float32 unpack) or 1 (packed "
                             f"16-bit pairs, GPU only), got {unpack}")
        launch(k._w4a16_dot8_kernel, grid, *args, UNPACK=unpack, **common)
    return k.reduce_split_k(out, bias, x2.dtype) if partial else out
