"""`lowbit doctor`: what this machine can run, and how, for every lowbit scheme.

It names the GPU and its compute capability, which element formats have a native tensor-core
path on it (int8 from sm_75, fp8 from sm_89, 2:4 sparsity from sm_80, MX / NVFP4 block-scaled
MMA from sm_100), and for each preset pairing which path lowbit takes here: a native Triton
kernel, an emulated one (the format has no tensor-core path on this GPU, so the kernel
rescales or dequantizes on the CUDA cores), or the CPU (exact torch / float64 reference) path.
A number measured on an emulated path is not a hardware number; this report says which is which.
Then, per pairing, the kernel class that runs a layer here (lowbit.ops.kernels.explain: the dense
and the grouped registries asked in preference order), the class each batch-size bucket runs, and
why each kernel ahead of it was refused; and per KV cache scheme, the attention kernel of a decode
step and of a prefill chunk, with the same refusals (lowbit.ops.kernels.explain_attention).
"""
from __future__ import annotations

import sys

from lowbit.ops.native import library as native_library

# (name, minimum compute capability, what it is)
NATIVE_PATHS = (
    ("bf16/fp16 MMA", (8, 0), "dense bf16 tensor cores (fp16 from sm_70)"),
    ("int8 MMA", (7, 5), "int8 x int8 -> int32 tensor cores"),
    ("2:4 sparse MMA", (8, 0), "structured-sparse tensor cores (cuSPARSELt)"),
    ("fp8 MMA", (8, 9), "e4m3 / e5m2 tensor cores, fp32 accumulation"),
    ("MX / NVFP4 block-scaled MMA", (10, 0), "MXFP8/6/4 and NVFP4 with hardware block scales (tcgen05)"),
)

# preset pairings a user runs: (label, activation preset or None for weight-only, weight preset)
PAIRINGS = (
    ("W8A8 int8 (per-token x per-channel)", "int8_token", "int8_channel"),
    ("W8A8 fp8 rowwise", "fp8_row", "fp8_row"),
    ("W8A8 fp8 tensorwise", "fp8_tensor", "fp8_tensor"),
    ("W8A8 fp8 block 1x128 / 128x128", "fp8_block1x128", "fp8_block128"),
    ("MXFP8 (e8m0 per 32)", "mxfp8", "mxfp8"),
    ("MXFP6 e2m3", "mxfp6_e2m3", "mxfp6_e2m3"),
    ("MXFP6 e3m2", "mxfp6_e3m2", "mxfp6_e3m2"),
    ("W4A16 int4 g128", None, "int4_g128"),
    ("W4A16 int4 g128 asym", None, "int4_g128_asym"),
    ("W4A16 MXFP4", None, "mxfp4"),
    ("W4A16 NVFP4", None, "nvfp4"),
)

# KV caches whose attention kernels the report lists (--kv-cache names; None: an unquantized bf16 cache)
KV_CACHES = ("fp8", "fp8-head", "fp8-token", "int8-head", "int8-token", "int4-g32", None)

# which native path a lowbit kernel needs to count as "native"
_KERNEL_NEEDS = {"int8": "int8 MMA", "fp8_rowwise": "fp8 MMA", "fp8_block": "fp8 MMA",
                 "mxfp8": "MX / NVFP4 block-scaled MMA"}


def register(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def gpu_info() -> dict:
    """{'gpu': name or None, 'capability': (major, minor) or None, 'triton': version or None}."""
    from lowbit.ops.tuning import environment

    env = environment()
    cap = env["capability"]
    return dict(gpu=env["gpu"], capability=None if cap is None else tuple(int(c) for c in cap.split(".")),
                triton=env["triton"], torch=env["torch"])


def native_paths(capability) -> dict[str, bool]:
    return {name: capability is not None and tuple(capability) >= need for name, need, _ in NATIVE_PATHS}


def path_for(x_preset: str | None, w_preset: str, capability, has_triton: bool) -> tuple[str, str]:
    """(path, detail) for a preset pairing on a GPU of `capability` (None: no GPU).

    path is one of "native", "emulated", "cpu", "none"."""
    from lowbit.ops.dispatch import gemm_kernel, w4a16_kind
    from lowbit.scheme import get_preset

    ws = get_preset(w_preset)
    native = native_paths(capability)
    gpu = capability is not None and has_triton
    if x_preset is None:  # weight-only
        try:
            kind = w4a16_kind(ws)
        except NotImplementedError as exc:
            return "none", str(exc)
        if not gpu:
            return "cpu", f"W4A16 {kind}: dequantized fp32 matmul (torch)"
        return "emulated", (f"Triton W4A16 kernel: {kind} weights dequantized in registers to bf16 "
                            "MMA (weight-only schemes never use a 4-bit tensor-core path)")
    kernel = gemm_kernel(get_preset(x_preset), ws)
    if kernel is None:
        if not gpu:
            return "cpu", "float64 reference (backend='reference'); no GPU kernel exists for it"
        return "none", "no GPU kernel: lowbit.ops.linear raises NotImplementedError; backend='reference' works"
    if not gpu:
        how = "torch._int_mm + float64 epilogue (exact)" if kernel == "int8" else "float64 reference"
        return "cpu", how
    need = _KERNEL_NEEDS[kernel]
    if native[need]:
        return "native", f"Triton kernel '{kernel}' on the {need} path"
    if kernel == "mxfp8" and native["fp8 MMA"]:
        from lowbit.ops.triton.gemm_blockscaled import MX_DEQUANT_MIN_M
        return "emulated", ("Triton kernel 'mxfp8': fp8 tiles times their e8m0 scales fed exactly to the "
                            f"bf16 tensor cores; from {MX_DEQUANT_MIN_M} rows both operands dequantized to bf16 "
                            "and one cuBLAS GEMM (no MX datapath before sm_100)")
    return "none", f"Triton kernel '{kernel}' needs the {need} path (this GPU lacks it); use backend='reference'"


def report() -> dict:
    info = gpu_info()
    cap = info["capability"]
    rows = []
    for label, xp, wp in PAIRINGS:
        path, detail = path_for(xp, wp, cap, info["triton"] is not None)
        rows.append(dict(scheme=label, activation=xp, weight=wp, path=path, detail=detail))
    return dict(info, native=native_paths(cap), schemes=rows, tuning=tuning_report(),
                native_kernels=native_library.status(), kernels=kernels_report(), attention=attention_report())


def kernels_report() -> list[dict]:
    """Per preset pairing: lowbit.ops.kernels.explain's answer on this machine's kernel device."""
    from lowbit.ops.kernels import explain
    from lowbit.scheme import get_preset

    return [dict(scheme=label, **explain(get_preset(wp), None if xp is None else get_preset(xp)))
            for label, xp, wp in PAIRINGS]


def attention_report() -> list[dict]:
    """Per KV cache of KV_CACHES: lowbit.ops.kernels.explain_attention's answer on this machine's kernel
    device, at its defaults (Llama-3-8B's heads; Q and P in fp8)."""
    from lowbit.ops.kernels import explain_attention
    from lowbit.workflows.job import parse_kv_cache

    return [dict(kv_cache=name or "bf16", **explain_attention(None if name is None else parse_kv_cache(name).scheme))
            for name in KV_CACHES]


def tuning_report() -> dict:
    """Which table dispatch reads here (or why none) and, per layer kind and M bucket, the path it
    picks: the table's measured winner with its ratio to bf16, else the heuristic's."""
    from lowbit.ops import tuning
    from lowbit.ops.w4_formats import W4Format

    table, why = tuning.active()
    paths = {}
    if table is not None:
        cells = {}
        for c in table.cells.values():
            cells.setdefault(c.kind, {}).setdefault(c.bucket, []).append(c)
        for kind, per in cells.items():
            paths[kind] = {b: _cell_summary(per[b]) for b in tuning.BUCKET_NAMES if b in per}
    else:
        for kind in ("w4a16/int4/g128", "w8a16", "w8a8/int8", "w8a8/fp8_e4m3fn"):
            paths[kind] = {b: tuning.heuristic(kind, tuning.BUCKET_M[b]) for b in tuning.BUCKET_NAMES}
        # grouped experts (M: sorted rows), Mixtral's 8 experts
        for kind, weight in (("w4a16", W4Format("int4", 128)), ("w8a16", None), ("int8", None)):
            key = tuning.grouped_kind_key(kind, 8, weight)
            paths[f"experts {key}"] = {b: tuning.heuristic(key, tuning.BUCKET_M[b], "grouped")
                                       for b in tuning.BUCKET_NAMES}
    return dict(status=why, source="table" if table is not None else "heuristic", paths=paths)


def _cell_summary(cells) -> str:
    """The path of a bucket's shapes ("kernel", "dequant" or "kernel x2 / dequant x1") and the range of
    their measured ratios to bf16."""
    names = sorted({c.path for c in cells})
    path = names[0] if len(names) == 1 else " / ".join(f"{n} x{sum(c.path == n for c in cells)}" for n in names)
    ratios = [c.ratio for c in cells if c.ratio is not None]
    if not ratios:
        return path
    lo, hi = min(ratios), max(ratios)
    return f"{path} {lo:.2f}x" if lo == hi else f"{path} {lo:.2f}-{hi:.2f}x"


def run(args) -> int:
    rep = report()
    if getattr(args, "json", False):
        import json
        print(json.dumps(rep, indent=1, default=str))
        return 0
    cap = rep["capability"]
    gpu = f"{rep['gpu']} (compute capability {cap[0]}.{cap[1]}, sm_{cap[0]}{cap[1]})" if cap else "none (no CUDA GPU visible)"
    print(f"GPU:    {gpu}")
    print(f"torch {rep['torch']}, triton {rep['triton'] or 'not installed'}")
    print("\nnative tensor-core paths on this GPU:")
    for name, need, what in NATIVE_PATHS:
        mark = "yes" if rep["native"][name] else "no "
        print(f"  {mark}  {name:30s} (sm_{need[0]}{need[1]}+) {what}")
    print("\nschemes (native = hardware path; emulated = kernel works around a missing datapath;"
          " cpu = exact CPU path; none = no kernel here):")
    for r in rep["schemes"]:
        print(f"  {r['path']:8s}  {r['scheme']:38s} {r['detail']}")
    tun = rep["tuning"]
    print(f"\nkernel paths per layer kind and rows M ({tun['status']}):")
    for kind, buckets in tun["paths"].items():
        print(f"  {kind:26s} " + " | ".join(f"M {b}: {p}" for b, p in buckets.items()))
    nat = rep["native_kernels"]
    print("\nnative Hopper decode kernels (W4A16 / W8A16 GEMV and dequantization, W8A8 GEMV at M <= 16; "
          "python -m lowbit.ops.native.build):")
    print(f"  library:   {nat['library'] or 'not built (built on first use where the toolchain is found)'}")
    print(f"  toolchain: {nat['toolchain']}")
    print(f"  status:    {'can run here' if nat['unavailable_reason'] is None else 'unavailable: ' + nat['unavailable_reason']}")
    print("native Hopper prefill GEMMs (CUTLASS fp8 row-wise / block-wise; python -m lowbit.ops.native.build --prefill):")
    print(f"  library:   {nat['prefill_library'] or 'not built (built on first use where the toolchain and CUTLASS are found)'}")
    why = nat["prefill_unavailable_reason"]
    print(f"  status:    {'can run here' if why is None else 'unavailable: ' + why}")
    kern = rep["kernels"]
    print(f"\nkernel classes per scheme (device: {kern[0]['device']}; a layer gets the first that can run it):")
    for r in kern:
        lin, grp = r["linear"], r["grouped"]
        print(f"  {r['scheme']:38s} layer {lin['kernel']}, experts {grp['kernel']}")
        if lin["rows"]:
            print("      rows: " + " | ".join(f"M {b}: {k}" for b, k in lin["rows"].items()))
        if grp.get("rows"):
            print("      expert rows (tokens x top_k, bf16): " + " | ".join(f"M {b}: {k}" for b, k in grp["rows"].items()))
        for name, why in lin["refused"]:
            print(f"      not {name}: {why}")
    att = rep["attention"]
    head = att[0]
    print(f"\nattention kernels per KV cache (--kv-cache) and call (device: {head['device']}; head_dim {head['D']}, "
          f"{head['G']} query heads per KV head, Q {head['spec'].q_format}, P {head['spec'].p_format}):")
    for r in att:
        print(f"  {r['kv_cache']:10s} " + " | ".join(f"{c} {a['kernel'] or 'none'}" for c, a in r["calls"].items()))
        for c, a in r["calls"].items():
            for name, why in a["refused"]:
                print(f"      {c}: not {name}: {why}")
    if cap is None:
        print("\nNumbers measured on this machine are CPU numbers; GPU timings need `lowbit bench` on a GPU.",
              file=sys.stdout)
    return 0
