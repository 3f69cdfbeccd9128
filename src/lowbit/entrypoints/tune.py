"""`lowbit tune`: measure which path each quantized layer kind should take on this GPU (lowbit
kernel or the bf16 GEMM on the dequantized weight, and the kernel's tiles; attention prefill's
kernel or SDPA over the dequantized cache; the grouped MoE kernels' tiles), per M bucket, at a
model's shapes; write the table that dispatch reads (lowbit.ops.tuning explains how it is found)."""
from __future__ import annotations

import os


def register(p) -> None:
    from lowbit.bench.tune import GROUPED_RECIPES, RECIPES, SHAPES
    from lowbit.ops.tuning import BUCKET_NAMES
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="the model's Linear shapes to time")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipes to tune")
    p.add_argument("--buckets", default=",".join(BUCKET_NAMES), help="comma-separated M buckets to tune")
    p.add_argument("--moe", default="mixtral,qwen3-30b-a3b",
                   help="comma-separated MoE shapes whose grouped expert GEMMs to tune ('none' skips them)")
    p.add_argument("--moe-recipes", default=",".join(GROUPED_RECIPES),
                   help="comma-separated recipes whose grouped expert kernels to tune (each kernel and weight "
                        "format gets cells of its own)")
    p.add_argument("--out", default=None,
                   help="where to write the table (default: lowbit-tune-<gpu>.json here); dispatch reads it "
                        "when LOWBIT_TUNE_TABLE names it")


def run(args) -> int:
    from lowbit.bench.tune import run_tune, summary
    from lowbit.ops import tuning
    from lowbit.workflows.job import parse_recipe

    recipes = [parse_recipe(r.strip()).name for r in args.recipes.split(",") if r.strip()]  # names checked first
    moe_recipes = [parse_recipe(r.strip()).name for r in args.moe_recipes.split(",") if r.strip()]
    buckets = [b.strip() for b in args.buckets.split(",") if b.strip()]
    bad = [b for b in buckets if b not in tuning.BUCKET_NAMES]
    if bad or not buckets:
        raise ValueError(f"--buckets {args.buckets!r}: choose from {', '.join(tuning.BUCKET_NAMES)}")
    from lowbit.bench.tune import MOE_SHAPES
    moe = [] if args.moe.strip().lower() == "none" else [m.strip() for m in args.moe.split(",") if m.strip()]
    unknown = [m for m in moe if m not in MOE_SHAPES]
    if unknown:
        raise ValueError(f"--moe {args.moe!r}: unknown shape(s) {unknown}; choose from {', '.join(MOE_SHAPES)} or none")
    out = args.out or f"lowbit-tune-{tuning.shipped_path(tuning.environment()['gpu'] or 'cpu').stem}.json"
    table = run_tune(args.shape, recipes, buckets, moe=moe, out=out, moe_recipes=moe_recipes)
    print(summary(table))
    print(f"wrote {out}: set LOWBIT_TUNE_TABLE={os.path.abspath(out)} for lowbit to use it")
    return 0
