"""What a Hadamard rotation of the residual stream does to 4-bit sites of the embedded model
(SmolLM2-135M): per-site weight, activation and output SQNR before and after
lowbit.algorithms.rotation, and with the norm gains folded into the readers but not rotated (what the rotation must do first),
grouped by what the rotation touches (readers: q/k/v, gate/up, whose
input columns are rotated; writers: o, down, whose output rows are mixed), and how many weight
groups of 32 lie on a 16-level grid before and after (the embedded weights were published as GGUF
Q4_1: 16 levels per group of 32).

    python -m lowbit.experiments.rotation_sites --tokens 256 --out rotation_sites.md
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch

from lowbit.algorithms.rotation import rotate_model
from lowbit.diagnosis.sites import site_report
from lowbit.evaluation.embedded import windows
from lowbit.evaluation.workload import load_model, prepare_texts
from lowbit.recipes.plan import linear_layers

READERS = ("q/k/v", "gate/up")
WRITERS = ("o", "down")
RECIPES = ("w4a16-g32", "w4a16", "mxfp4", "nvfp4")


def on_grid_share(w: torch.Tensor, group: int = 32, levels: int = 16) -> float:
    """Share of w's groups of `group` consecutive elements (along K) whose values all lie, within
    2^-10 of one step, on the grid min + k (max - min) / (levels - 1), k = 0 .. levels - 1."""
    K = w.shape[1] - w.shape[1] % group
    g = w[:, :K].double().reshape(-1, group)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    step = (hi - lo) / (levels - 1)
    t = (g - lo) / torch.where(step > 0, step, torch.ones_like(step))
    return float(((t - t.round()).abs() <= 2.0 ** -10).all(1).double().mean())


def _medians(report, kinds) -> tuple[float, float, float]:
    rows = [r for r in report.rows if r.kind in kinds]
    return tuple(statistics.median(getattr(r, a) for r in rows) for a in ("weight_db", "act_db", "out_db"))


def run(tokens: int = 256, recipes=RECIPES, progress: bool = False) -> dict:
    loaded = load_model("smollm2")
    texts = prepare_texts(loaded, tokens, tokens, tokens)
    batches = windows(texts.eval_ids, tokens)
    rotated, absorbed = copy.deepcopy(loaded.model), copy.deepcopy(loaded.model)
    rotate_model(rotated, seed=0)
    d = loaded.model.config.hidden_size
    rotate_model(absorbed, q=torch.eye(d, dtype=torch.float64))     # the gains folded, no rotation
    models = (("before", loaded.model), ("absorbed", absorbed), ("after", rotated))
    out = {"tokens": tokens, "grid": {}, "sites": {}}
    for name, m in models[::2]:
        ws = [l.weight for n, l in linear_layers(m).items() if "lm_head" not in n]
        out["grid"][name] = statistics.mean(on_grid_share(w) for w in ws)
    for r in recipes:
        for name, m in models:
            rep = site_report(m, batches, r, block=False, progress=progress)
            out["sites"][(r, name)] = {"readers": _medians(rep, READERS), "writers": _medians(rep, WRITERS)}
    return out


def to_markdown(res: dict) -> str:
    lines = [f"Weight groups of 32 on a 16-level grid: {res['grid']['before']:.1%} before rotation, "
             f"{res['grid']['after']:.1%} after.", "",
             f"Median per-site SQNR (dB) on {res['tokens']} tokens: as published -> norm gains folded into the "
             "readers (Q = I) -> gains folded and rotated (random Hadamard Q):", "",
             "| recipe | sites | weight | activation | layer output |", "|---|---|---:|---:|---:|"]
    recipes = sorted({r for r, _ in res["sites"]}, key=list(RECIPES).index)
    for r in recipes:
        for part in ("readers", "writers"):
            b, m, a = (res["sites"][(r, k)][part] for k in ("before", "absorbed", "after"))
            cells = [f"{x:.1f} -> {y:.1f} -> {z:.1f}" if x != float("inf") else "- (not quantized)"
                     for x, y, z in zip(b, m, a)]
            lines.append(f"| {r} | {part} ({', '.join(READERS if part == 'readers' else WRITERS)}) | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowbit.experiments.rotation_sites", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="evaluation tokens the site reports run on (one window)")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="markdown file (default: print only)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = to_markdown(run(args.tokens, args.recipes.split(","), progress=True))
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
