"""Timing hooks for tuning the grouped MoE kernels (lowbit.ops.grouped_configs): one launch of a
kind at (E, N, K, M sorted rows) under an explicit config, or on the bf16 path (path "dequant":
the weights dequantized into the scratch buffer, then torch._grouped_mm; lowbit.ops.grouped_dequant),
or the grouped bf16 GEMM the paths are compared with (grouped_bf16_case), on random operands laid
out as the kernels read them (the numbers do not matter for the time; the codes are random, the
scales finite). A tuner calls grouped_case once per (cell, config) and times the returned closure,
or time_grouped_case for a median time."""
from __future__ import annotations

import time
from typing import Callable

import torch

from lowbit.ops.grouped import route_fixed
from lowbit.ops.grouped_configs import WEIGHT_ONLY, GroupedConfig, check_config
from lowbit.ops.grouped_dequant import grouped_bf16, grouped_dequant_w4, grouped_dequant_w8
from lowbit.ops.tuning import GROUPED_W4_KINDS, grouped_kind_key
from lowbit.ops.w4_formats import W4Format


def _routing(E: int, M: int, top_k: int, device, gen: torch.Generator):
    """M sorted rows: ceil(M / top_k) tokens, top_k distinct experts each, uniformly random."""
    T = -(-M // top_k)
    idx = torch.rand(T, E, generator=gen).topk(top_k, dim=1).indices.to(device)
    return T, route_fixed(idx, E)


def grouped_case(kind: str, E: int, N: int, K: int, M: int, config: GroupedConfig | None, device, *, top_k: int = 2,
                 weight: W4Format | None = None, identity: bool = False, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, path: str = "kernel") -> Callable[[], torch.Tensor]:
    """A closure running one grouped GEMM of `kind` ("w4a16" / "fp4" with their 4-bit `weight` format:
    int4 per group, with zero points where weight.zero, MXFP4, NVFP4; "w8a16", "int8", "fp8") over M
    sorted rows (ceil(M / top_k) tokens, top_k distinct experts each, uniformly random; identity: A is
    the sorted buffer, the down projection's case) of E experts' [N, K] weights, under `config` (path
    "kernel") or on the bf16 path (path "dequant", config None: the weight-only kinds), output in
    `dtype`. Operands are made here, once."""
    from lowbit.ops.triton import grouped as gk    # optional: triton

    grouped_kind_key(kind, E, weight)       # the cell this case times: refuses a kind without its format
    if path not in ("kernel", "dequant") or (path == "dequant") != (config is None) or \
            (path == "dequant" and kind not in WEIGHT_ONLY):
        raise ValueError(f"path={path!r} with config {config}: 'kernel' takes a GroupedConfig, 'dequant' (the "
                         f"weight-only kinds {WEIGHT_ONLY}) none")
    if config is not None:
        check_config(kind, config, K, None if weight is None else weight.group)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T, routing = _routing(E, M, top_k, device, gen)
    rows = routing.rows if identity else T
    kw = dict(identity=identity, out_dtype=dtype) if path == "dequant" else \
        dict(identity=identity, config=config, out_dtype=dtype)
    if kind in ("int8", "fp8"):
        a = torch.randint(-127, 128, (rows, K), generator=gen, dtype=torch.int8)
        w = torch.randint(-127, 128, (E, N, K), generator=gen, dtype=torch.int8)
        if kind == "fp8":                               # finite e4m3 patterns: |value| <= 1
            a = (a.float() / 127).to(torch.float8_e4m3fn)
            w = (w.float() / 127).to(torch.float8_e4m3fn)
        sa = torch.rand(rows, generator=gen) + 0.5
        sb = torch.rand(E, N, generator=gen) + 0.5
        a, w, sa, sb = (t.to(device) for t in (a, w, sa, sb))
        fn = gk.grouped_int8 if kind == "int8" else gk.grouped_fp8
        return lambda: fn(a, sa, w, sb, routing, **kw)
    x = torch.randn(rows, K, generator=gen).to(device, dtype)
    if kind == "w8a16":
        w = torch.randint(-127, 128, (E, N, K), generator=gen, dtype=torch.int8).to(device)
        s = (torch.rand(E, N, generator=gen) / 64).to(device)
        fn8 = grouped_dequant_w8 if path == "dequant" else gk.grouped_w8a16
        return lambda: fn8(x, w, s, routing, **kw)
    if kind not in GROUPED_W4_KINDS:
        raise ValueError(f"kind={kind!r}: grouped_case takes w4a16, fp4, w8a16, int8, fp8")
    w = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8).to(device)
    fn4 = grouped_dequant_w4 if path == "dequant" else gk.grouped_w4a16
    g, w4 = weight.group, weight.name
    if w4 == "int4":
        s = (torch.rand(E, N, K // g, generator=gen) / 8).to(device)
        z = torch.randint(-8, 8, (E, N, K // g), generator=gen, dtype=torch.int32).to(device) if weight.zero else None
        return lambda: fn4(x, w, s, routing, kind="int4", group_size=g, w_zero=z, **kw)
    codes = torch.randint(120, 128, (E, N, K // g), generator=gen, dtype=torch.uint8) if w4 == "mxfp4" else \
        torch.randint(0x30, 0x38, (E, N, K // g), generator=gen, dtype=torch.uint8)   # e8m0 ~2^-7..1 / e4m3 ~1
    codes = codes.to(device)
    gl = torch.ones(E, device=device) if w4 == "nvfp4" else None
    return lambda: fn4(x, w, codes, routing, kind=w4, w_global=gl, **kw)


def grouped_bf16_case(E: int, N: int, K: int, M: int, device, *, top_k: int = 2, identity: bool = False,
                      seed: int = 0) -> Callable[[], torch.Tensor]:
    """The baseline of a grouped cell: the same routing of M sorted rows over E experts' bf16 weights
    [E, N, K], torch._grouped_mm with bf16 output (lowbit.ops.grouped_dequant.grouped_bf16, the bf16
    path less its dequantization)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T, routing = _routing(E, M, top_k, device, gen)
    x = torch.randn(routing.rows if identity else T, K, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(E, N, K, generator=gen) / 64).to(device, torch.bfloat16)
    return lambda: grouped_bf16(x, w, routing, identity=identity, out_dtype=torch.bfloat16)


def time_grouped_case(kind: str, E: int, N: int, K: int, M: int, config: GroupedConfig, device, *,
                      warmup: int = 3, reps: int = 20, **case) -> float:
    """Median milliseconds of grouped_case(...)() over `reps` calls after `warmup` (CUDA events on
    a GPU; wall time elsewhere). `case`: grouped_case's keywords (top_k, weight, identity, dtype)."""
    run = grouped_case(kind, E, N, K, M, config, device, **case)
    for _ in range(warmup):
        run()
    cuda = torch.device(device).type == "cuda"
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]
