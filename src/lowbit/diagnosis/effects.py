"""What each calibration algorithm does to the sites: the per-site report
(lowbit.diagnosis.sites: weight, layer-output and block SQNR) of round-to-nearest on the float model
("before") beside the report after the algorithm ("after"), on text no algorithm saw.

- smoothquant / awq / rotation change the float weights (folded factors, rotated residual stream):
  "after" is the report of the transformed float model under the same recipe.
- gptq changes which codes are stored: "after" diagnoses GPTQ's QuantLinears on the float model's
  inputs (site_report(quantized=...)), so weight SQNR may drop while output / block SQNR rise.

    python -m lowbit.diagnosis.effects --recipe w4a16 --algorithms gptq,awq,rotation --out effects_w4a16.md
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from pathlib import Path

import torch

from lowbit.algorithms.gptq.model import gptq_model
from lowbit.diagnosis.report import optional_png
from lowbit.diagnosis.sites import plot_sites, site_report
from lowbit.evaluation.embedded import windows
from lowbit.evaluation.workload import load_model, prepare_texts
from lowbit.nn.quant_linear import QuantLinear
from lowbit.pipelines.steps import AWQ, Rotate, RunState, SmoothQuant
from lowbit.recipes.presets import get_recipe

# The steps whose effect on the float weights is diagnosed (a job's step objects, lowbit.pipelines.steps);
# GPTQ changes which codes are stored instead, and is diagnosed on them.
FOLDS = {"smoothquant": SmoothQuant(0.5), "awq": AWQ(), "rotation": Rotate()}
ALGORITHMS = (*FOLDS, "gptq")


def algorithm_effect(model: torch.nn.Module, calib: list, report_batches: list, recipe: str, algorithm: str,
                     progress: bool = False):
    """(before, after) SiteReports of `recipe` on `report_batches` for one algorithm calibrated on
    `calib` (input-id batches [B, T]). The model is not changed."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    r = get_recipe(recipe)
    before = site_report(model, report_batches, r, progress=progress)
    m = copy.deepcopy(model)
    if algorithm == "gptq":
        gptq_model(m, r, calib, progress=progress)
        layers = {n: mod for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
        return before, site_report(model, report_batches, r, progress=progress, quantized=layers)
    FOLDS[algorithm].apply(RunState(m, r, calib, progress=progress))
    return before, site_report(m, report_batches, r, progress=progress)


def summary_rows(before, after) -> list[tuple[str, float, float, float, float, int]]:
    """Per SQNR kind: (kind, median before, median after, min before, min after, sites improved),
    over the sites both reports hold (dB; improved: after > before)."""
    a = {r.name: r for r in after.rows}
    pairs = [(r, a[r.name]) for r in before.rows if r.name in a]
    out = []
    for kind, attr in (("weight", "weight_db"), ("output", "out_db"), ("block", "block_db")):
        xs = [(getattr(p, attr), getattr(q, attr)) for p, q in pairs
              if math.isfinite(getattr(p, attr)) and math.isfinite(getattr(q, attr))]
        if xs:
            b, c = zip(*xs)
            out.append((kind, statistics.median(b), statistics.median(c), min(b), min(c), sum(y > x for x, y in xs)))
    return out


def to_markdown(recipe: str, algorithm: str, before, after) -> str:
    n = len(before.rows)
    lines = [f"### {recipe}: {algorithm} (per-site SQNR before -> after, {n} sites, {before.tokens} tokens)", "",
             "| SQNR | median before | median after | worst before | worst after | sites improved |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {k} | {mb:.1f} dB | {ma:.1f} dB | {wb:.1f} dB | {wa:.1f} dB | {imp} of {n} |"
              for k, mb, ma, wb, wa, imp in summary_rows(before, after)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowbit.diagnosis.effects", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--algorithms", default="gptq,awq,rotation", help=f"comma-separated: {', '.join(ALGORITHMS)}")
    ap.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens (other articles)")
    ap.add_argument("--tokens", type=int, default=512, help="report tokens (the evaluation text's first ones)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="markdown file; one PNG per algorithm beside it")
    args = ap.parse_args(argv)
    algos = args.algorithms.split(",")
    bad = [a for a in algos if a not in ALGORITHMS]
    if bad:
        raise SystemExit(f"--algorithms: unknown {bad}; choose from {', '.join(ALGORITHMS)}")
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2")
    texts = prepare_texts(loaded, args.tokens, args.calib_tokens, 512)
    report = windows(texts.eval_ids, 512)
    out = Path(args.out)
    parts = [f"Command: `python -m lowbit.diagnosis.effects {' '.join(argv if argv is not None else sys.argv[1:])}`", ""]
    for a in algos:
        before, after = algorithm_effect(loaded.model, texts.calib, report, args.recipe, a, progress=True)
        parts.append(to_markdown(args.recipe, a, before, after))
        png = optional_png(plot_sites, [before, after], str(out.with_name(f"{out.stem}_{a}.png")),
                           labels=[f"{args.recipe} round to nearest", f"{args.recipe} + {a}"])
        if png:
            parts.append(f"![{args.recipe} {a}]({Path(png).name})\n")
        out.write_text("\n".join(parts), encoding="utf-8")
        print(parts[-2] if png else parts[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
