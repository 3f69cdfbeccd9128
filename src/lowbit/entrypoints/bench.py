"""`lowbit bench`: run every benchmark module (lowbit.bench.BENCH_MODULES) on the GPU, print a
table and optionally write JSON with the GPU's name and the software versions."""
from __future__ import annotations

import importlib
import sys


def register(p) -> None:
    p.add_argument("--only", metavar="NAME", default=None,
                   help="run only entries whose name contains NAME (a module name such as 'gemm' or "
                        "'memory' selects that module; baselines always run)")
    p.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write all rows and the environment as JSON")
    # `lowbit bench model [options]`: the end-to-end model benchmark with its own options
    from lowbit.bench import model
    model.register(p.add_subparsers(dest="bench", metavar="{model}").add_parser(
        "model", help="a Llama-shaped or MoE (Mixtral, Qwen3-MoE) model: bf16 vs every recipe, prefill and "
        "decode, eager and compiled"))


def run(args) -> int:
    import torch

    from lowbit.bench import BENCH_MODULES

    if getattr(args, "bench", None) == "model":
        from lowbit.bench.model import main
        return main(args)
    if not torch.cuda.is_available():
        print("lowbit bench: no CUDA GPU here; the benchmarks time GPU kernels. `lowbit doctor` says "
              "what runs on this machine.", file=sys.stderr)
        return 2
    from lowbit.bench.common import environment, write_run

    env = environment()
    print(f"# {env.get('gpu')} (sm_{env.get('compute_capability', '?').replace('.', '')}), torch "
          f"{env['torch']}, triton {env['triton']}")
    modules = [m for m in BENCH_MODULES]
    only = args.only
    short = {m.rsplit(".", 1)[-1]: m for m in modules}
    if only in short:  # `--only gemm` selects a whole module
        modules, only = [short[only]], None
    rows, notes = [], []
    failed = False
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            notes.append(f"{name} skipped: not importable ({exc})")
            print(f"# {notes[-1]}")
            continue
        print(f"# {name}")
        try:
            mod_rows = mod.run(only, args.quick)
        except Exception as exc:  # one module's failure must not discard the others' rows
            notes.append(f"{name} failed: {type(exc).__name__}: {exc}")
            print(f"# {notes[-1]}")
            failed = True
            continue
        for r in mod_rows:
            r.setdefault("module", name.rsplit(".", 1)[-1])
        rows += mod_rows
    _summary(rows)
    if args.json:
        write_run(args.json, env, rows, notes=notes)
        print(f"# wrote {args.json}")
        gemm_rows = [r for r in rows if r.get("module") == "gemm"]
        if gemm_rows:
            try:
                from lowbit.bench.gemm import plot
                png = args.json.rsplit(".", 1)[0] + ".png"
                plot(gemm_rows, png)
                print(f"# wrote {png}")
            except ImportError as exc:  # matplotlib is optional on the GPU machine
                print(f"# no plot ({exc})")
    return 1 if failed else 0


def _summary(rows: list[dict]) -> None:
    """Short table last: per lowbit GEMM kernel and shape, TF/s and its ratios to the baselines
    (other modules print their own rows as they run)."""
    lb = [r for r in rows if r.get("module") == "gemm" and str(r.get("name", "")).startswith("lowbit_")
          and r.get("ms") and "tflops" in r]
    if not lb:
        return
    print("\n# summary (ratio = baseline ms / lowbit ms; >1 is faster)")
    print(f"{'kernel':20s} {'shape':>17s} {'TF/s':>7s} {'%peak':>6s} {'vs bf16':>8s} {'vs int_mm':>9s} "
          f"{'vs +epi':>8s} {'vs s_row':>8s} {'vs s_ten':>8s} {'vs s_fast':>9s}")
    fmt = lambda r, k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
    for r in lb:
        if "tflops" not in r:
            continue
        print(f"{r['name']:20s} {r['shape']:>17s} {r['tflops']:7.1f} {100 * r['frac_peak']:6.1f} "
              f"{fmt(r, 'vs_bf16'):>8s} {fmt(r, 'vs_int_mm'):>9s} {fmt(r, 'vs_int_mm+epi'):>8s} "
              f"{fmt(r, 'vs_scaled_row'):>8s} {fmt(r, 'vs_scaled_ten'):>8s} {fmt(r, 'vs_scaled_row_fast'):>9s}")
