"""`lowbit experiment NAME [--json] [--png PATH]`."""
from __future__ import annotations

import importlib
import json
import sys
import time

_MODULES = {"matmul": "lowbit.experiments.matmul", "error-model": "lowbit.experiments.error_model",
            "layout": "lowbit.experiments.layout", "outliers": "lowbit.experiments.outliers"}


def register(parser) -> None:
    parser.add_argument("name", choices=list(_MODULES), help="which experiment")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--png", metavar="PATH", help="also write a figure (matmul: code usage per column, error vs K)")
    parser.add_argument("--sizes", metavar="S,S,...", help="matmul only: sizes (default 256,1024,2048)")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: the experiment's)")


def run(args) -> int:
    mod = importlib.import_module(_MODULES[args.name])
    opts = {}
    if args.seed is not None:
        opts["seed"] = args.seed
    if args.sizes:
        if args.name != "matmul":
            print("--sizes applies to the matmul experiment only", file=sys.stderr)
            return 2
        try:
            opts["sizes"] = tuple(int(s) for s in args.sizes.split(","))
        except ValueError:
            print(f"--sizes must be comma-separated integers, got {args.sizes!r}", file=sys.stderr)
            return 2
    if args.png and not hasattr(mod, "plot"):
        print(f"--png: the {args.name} experiment has no figure (matmul has one)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = mod.run(progress=lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr),
                     **opts)
    result["seconds"] = time.perf_counter() - t0
    if args.json:
        # per-column lists feed the figure; as JSON they would bury the rows
        slim = dict(result, rows=[{k: v for k, v in r.items() if not k.endswith("_per_col")}
                                  for r in result["rows"]])
        print(json.dumps(slim, indent=1))
    else:
        print(mod.format_table(result))
        print(f"({result['seconds']:.1f} s)")
    if args.png:
        mod.plot(result, args.png)
        print(f"figure written to {args.png}", file=sys.stderr)
    return 0
