"""`lowbit quantize`: quantize a model by a recipe, show the sites that hurt, what it costs
(perplexity / embedding cosine) and what it buys (bytes, tokens/s on CUDA), and write a
compressed-tensors checkpoint plus a report (markdown + PNG).

Defaults: the embedded SmolLM2-135M-Instruct, Wikipedia text, recipe w8a8-int8."""
from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path


def register(p) -> None:
    from lowbit.recipes.presets import RECIPES
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (embedded default), minilm (embedded encoder), or a model directory (HF or .gguf)")
    p.add_argument("--recipe", default="w8a8-int8",
                   help=f"recipe, or several separated by commas (one table): {', '.join(RECIPES)}")
    p.add_argument("--out", default=None, help="checkpoint + report directory (default lowbit-out/<model>-<recipe>); "
                   "a non-empty directory lowbit did not write is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that lowbit did not write: lowbit's files are added next to "
                        "the ones there, none of which is deleted or replaced")
    p.add_argument("--tokens", type=int, default=8192, help="evaluation tokens (perplexity windows of --window)")
    p.add_argument("--window", type=int, default=512, help="perplexity window (non-overlapping)")
    p.add_argument("--calib-tokens", type=int, default=None,
                   help=f"calibration / per-site report tokens (separate text; default {CALIB_TOKENS}, or the count "
                        "the recipe's best measures were measured with when they are applied)")
    p.add_argument("--smoothquant", nargs="?", type=float, const=0.5, default=None, metavar="ALPHA",
                   help="fold SmoothQuant factors (alpha, default 0.5) before quantizing")
    p.add_argument("--override-worst", type=float, default=0.0, metavar="FRACTION",
                   help="send the worst sites of the per-site report (at most this fraction of Linears, e.g. 0.05) "
                        "to --override-to")
    p.add_argument("--override-to", default="skip", help="'skip' (high precision) or a recipe for --override-worst")
    p.add_argument("--ignore", action="append", default=None, metavar="PATTERN", help="keep matching Linears in high precision")
    p.add_argument("--override", action="append", default=None, metavar="PATTERN=RECIPE",
                   help="another recipe (or skip) for matching Linears")
    p.add_argument("--method", choices=("rtn", "gptq"), default=None,
                   help="how weight codes are chosen: rtn (round to nearest) or gptq (calibrated, lowbit.algorithms.gptq)")
    p.add_argument("--plain", action="store_true",
                   help="round to nearest and nothing else; without --plain or any measure flag, the recipe's best "
                        "measured measures are applied (lowbit.recipes.best, docs/perplexity.md)")
    p.add_argument("--gptq", dest="method", action="store_const", const="gptq", help="same as --method gptq")
    p.add_argument("--mse-scales", dest="mse", action="store_true",
                   help="MSE-optimal weight scales (range searched per group/channel, lowbit.algorithms.scale_search) instead "
                        "of round to nearest's; with --gptq weighted by each layer's Hessian diagonal")
    p.add_argument("--awq", action="store_true",
                   help="fold activation-aware (AWQ) weight scales before quantizing (weight-only recipes)")
    p.add_argument("--rotate", nargs="?", const="hadamard", default=None, choices=("hadamard",),
                   help="rotate the residual stream by a random Hadamard matrix first (folded exactly; lowbit.algorithms.rotation)")
    p.add_argument("--static-scales", action="store_true",
                   help="calibrated per-tensor activation scales instead of dynamic ones (+ clipping report on new text)")
    p.add_argument("--kv-cache", default=None, metavar="SCHEME",
                   help="also quantize the KV cache: fp8 | int8 (static per tensor, calibrated), fp8-head | int8-head "
                        "(static per KV head), fp8-token | int8-token (dynamic per token and head), int4-g32 (dynamic "
                        "per 32 head-dim values); the report gives the metrics with and without it and the "
                        "checkpoint carries compressed-tensors' kv_cache_scheme")
    p.add_argument("--no-save", action="store_true", help="evaluate only, write no checkpoint (report still written)")
    p.add_argument("--sequential", action="store_true",
                   help="layer by layer from the --model directory's (sharded) safetensors, Llama family: one decoder "
                        "layer in memory at a time, calibrated on cached activations, quantized, written, freed "
                        "(lowbit.pipelines.layerwise; same codes as the whole-model path). Calibration text tokenized by the "
                        "directory's tokenizer; only the measures flagged (--gptq, --smoothquant, --static-scales), "
                        "no best-measured defaults; no evaluation")
    p.add_argument("--device", default=None,
                   help="--sequential: where the layers run (default: cuda if available, else cpu)")
    p.add_argument("--distributed", action="store_true",
                   help="data-parallel calibration under `torchrun --nproc-per-node N -m lowbit quantize ...` "
                        "(also on whenever torchrun's environment is present): calibration batches split across "
                        "ranks, statistics all-reduced (lowbit.algorithms.distributed; NCCL on GPUs, gloo on CPUs), the "
                        "same checkpoint as one process, written by rank 0 (the whole-model path evaluates on every rank)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


CALIB_TOKENS = 1024        # --calib-tokens when neither the flag nor the recipe's best measures give a count


def _measures(args, recipe: str, kind: str) -> tuple[dict, int]:
    """The measures for one recipe and its calibration tokens: the flags given, or (no measure flag,
    no --plain, a causal decoder: where they were measured) the best measured ones from
    lowbit.recipes.best, printed with the reason, on the calibration tokens they were measured with
    unless --calib-tokens is given."""
    given = {"smoothquant": args.smoothquant, "override_worst": args.override_worst or 0.0,
             "method": args.method or "rtn", "awq": args.awq, "rotate": args.rotate, "mse": args.mse}
    flagged = (args.smoothquant is not None or args.override_worst or args.method or args.awq or args.rotate
               or args.static_scales or args.mse)
    if args.plain or flagged:
        if args.plain and flagged:
            raise ValueError("--plain means round to nearest alone; drop it or the measure flags")
        return given, args.calib_tokens
    from lowbit.recipes.best import best_options
    best = best_options(recipe) if kind == "causal" else None
    if best is None:
        print(f"{recipe}: no measured improvement on file; plain round to nearest", flush=True)
        return given, args.calib_tokens
    print(f"{recipe}: applying the best measured measures {best.options} ({best.why}); --plain for "
          "round to nearest alone", flush=True)
    n = args.calib_tokens if args.calib_tokens_given or not best.calib_tokens else best.calib_tokens
    if n != args.calib_tokens:
        print(f"{recipe}: on {n} calibration tokens, what they were measured with (--calib-tokens sets them)",
              flush=True)
    return {**given, **best.options}, n


def _save(model, out: Path, recipe, tokenizer) -> str | None:
    """Write the checkpoint into `out` (a staging directory); None, or why it was not written."""
    from lowbit.pipelines.checkpoint import save_compressed
    try:
        save_compressed(model, out, recipe, tokenizer=tokenizer, overwrite=True)
    except (ValueError, NotImplementedError) as err:
        return f"not written: {err}"
    return None


def _kv_line(kv_name: str, mname: str, run_) -> str:
    """One report line: the metrics with the quantized KV cache and without it."""
    def fmt(v):
        if hasattr(v, "kl"):
            return f"{mname} {v.perplexity:.4f}, KL from float {v.kl:.4f} nats, top-1 agreement {100 * v.top1:.2f}%"
        return f"{mname} {v:.4f}"
    with_kv = run_.tokens if run_.tokens is not None else run_.value
    return f"KV cache {kv_name}: {fmt(with_kv)}; with the KV cache unquantized: {fmt(run_.without_kv)}"


def _out_dirs(args, recipes: list[str]) -> dict[str, Path]:
    """Each recipe's output directory (known before the model is loaded)."""
    name = args.model
    if name not in ("smollm2", "minilm"):
        d = Path(args.model)
        ggufs = sorted(d.glob("*.gguf")) if d.is_dir() else []
        name = ggufs[0].stem if ggufs else d.name   # what load_model calls the model
    if args.out is None:
        return {r: Path(f"lowbit-out/{name}-{r}") for r in recipes}
    return {r: Path(args.out) / r for r in recipes} if len(recipes) > 1 else {recipes[0]: Path(args.out)}


def validate(args) -> tuple[list[str], dict, dict[str, Path]]:
    """Every check that needs no model: (recipes, overrides, output directory per recipe).
    Raises ValueError naming the flag and the fix."""
    from lowbit.io.outdir import OutputDirError, check_out_dir
    from lowbit.entrypoints import quantize_args as A
    recipes = A.recipe_names(args.recipe)
    overrides = A.overrides(args.override)
    override_to = A.recipe_or_skip(args.override_to, "--override-to")
    A.text_sizes(args.tokens, args.window)
    args.calib_tokens_given = args.calib_tokens is not None
    if args.calib_tokens is None:
        args.calib_tokens = CALIB_TOKENS
    A.text_sizes(args.calib_tokens, args.window, "--calib-tokens")
    A.positive(args.threads, "--threads", allow_none=True)
    A.kv_cache(getattr(args, "kv_cache", None))
    if getattr(args, "kv_cache", None) and args.sequential:
        raise ValueError("--kv-cache is not available with --sequential (which writes layers without running the "
                         "whole model); drop one of them")
    A.fraction(args.override_worst, "--override-worst", 0.5)
    if args.smoothquant is not None:
        A.fraction(args.smoothquant, "--smoothquant ALPHA")
    if args.static_scales:
        from lowbit.recipes.presets import get_recipe
        weight_only = [r for r in recipes if get_recipe(r).act is None]
        if weight_only:
            raise ValueError(f"--static-scales calibrates activation scales; recipe(s) {weight_only} quantize "
                             "weights only: drop --static-scales or choose a W8A8 recipe")
        if args.override_worst > 0 and override_to != "skip":
            raise ValueError("--static-scales are calibrated for the recipe's activation format; combine them "
                             "only with --override-to skip")
    outs = _out_dirs(args, recipes)
    for out in outs.values():   # the report is written even with --no-save
        try:
            check_out_dir(out, args.overwrite)
        except OutputDirError as err:
            raise ValueError(str(err)) from err
    return recipes, overrides, outs


def run(args) -> int:
    """Bad input raises ValueError / FileNotFoundError; lowbit.entrypoints.main prints it without a traceback."""
    import torch
    from lowbit.io.outdir import staged
    from lowbit.evaluation.evaluate import model_bytes, tokens_per_second
    from lowbit.evaluation.workload import load_model, machine, metric, prepare_texts
    from lowbit.entrypoints.quantize_job import run_recipe
    from lowbit.recipes.presets import get_recipe
    from lowbit.diagnosis.report import QuantizeResult, optional_png, write_report
    from lowbit.diagnosis.sites import plot_sites

    recipes, overrides, outs = validate(args)   # before anything slow
    if args.threads:
        torch.set_num_threads(args.threads)
    from lowbit.algorithms import distributed as D
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.sequential:
        from lowbit.entrypoints import sequential as cli_sequential
        cli_sequential.check(args)
    if args.distributed or D.launched_by_torchrun():
        rank_device = D.init_from_env("cuda" if device.startswith("cuda") else "cpu")
        device = rank_device if args.sequential else device
    if args.sequential:
        return cli_sequential.run(args, recipes, outs, device)
    if D.active() and D.rank() != 0:     # every rank calibrates on its share and evaluates; rank 0 reports and writes
        sys.stdout = open(os.devnull, "w")
    command = "lowbit " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[0].endswith("lowbit") \
        else "lowbit quantize " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    t0 = time.time()
    print(f"loading {args.model} ...", flush=True)
    loaded = load_model(args.model)
    texts = prepare_texts(loaded, args.tokens, args.calib_tokens, args.window)
    texts.calib = D.shard(texts.calib)           # all batches in one process
    before = metric(loaded, loaded.model, None, texts, args.window, True, "float eval")
    mname = "perplexity" if loaded.kind == "causal" else "embedding cosine"
    ntok = args.tokens if loaded.kind == "causal" else len(texts.sentences)
    bytes_before = model_bytes(loaded.model)
    tps_before = tokens_per_second(loaded.model, texts.eval_ids) if texts.eval_ids is not None else None
    print(f"{loaded.name}: float {mname} {before:.4f} on {ntok} {'tokens' if loaded.kind == 'causal' else 'sentences'}"
          f" ({time.time() - t0:.0f} s)", flush=True)
    table = []
    for recipe in recipes:
        opts, n_calib = _measures(args, recipe, loaded.kind)
        rtexts = texts if n_calib == args.calib_tokens else dataclasses.replace(
            texts, calib=D.shard(prepare_texts(loaded, args.tokens, n_calib, args.window).calib))
        run_ = run_recipe(loaded, rtexts, recipe, override_to=args.override_to, ignore=args.ignore,
                          overrides=overrides, static=args.static_scales, window=args.window,
                          reference=loaded.model if loaded.kind == "causal" else None,
                          kv_cache=getattr(args, "kv_cache", None), **opts)
        print(run_.sites_before)
        if run_.sites_after is not None:
            print("after SmoothQuant:\n" + str(run_.sites_after))
        if run_.overrides:
            print("overridden worst sites: " + ", ".join(f"{k} -> {v}" for k, v in run_.overrides.items()))
        print(run_.summary)
        tps = tokens_per_second(run_.model, texts.eval_ids) if tps_before else None
        res = QuantizeResult(
            model=loaded.name, recipe=recipe, metric=mname, before=before, after=run_.value,
            bytes_before=bytes_before, bytes_after=model_bytes(run_.model), eval_tokens=ntok,
            command=command, machine=machine(),
            smoothquant=None if opts["smoothquant"] is None else f"alpha {opts['smoothquant']}",
            summary=str(run_.summary), overrides=run_.overrides, clipping=run_.clipping, tokens=run_.tokens,
            tokens_per_s=(tps_before, tps) if tps else None,
            sites_markdown=[("Worst sites" + (" before SmoothQuant" if run_.sites_after else ""),
                             run_.sites_before.to_markdown(10))]
            + ([("Worst sites after SmoothQuant", run_.sites_after.to_markdown(10))] if run_.sites_after else []))
        if run_.without_kv is not None:
            res.extra.append(_kv_line(args.kv_cache, mname, run_))
            print(res.extra[-1], flush=True)
            from lowbit.diagnosis.attention_sites import attention_site_report
            att = attention_site_report(run_.model, texts.calib[0], run_.summary.kv_cache)
            print(att)
            res.sites_markdown.append(("Attention sites (KV cache; first calibration batch)", att.to_markdown()))
        out = outs[recipe]
        if D.rank() != 0:
            continue
        with staged(out, args.overwrite) as stage:   # Ctrl-C or an error leaves `out` as it was
            if not args.no_save:
                why = _save(run_.model, stage, get_recipe(recipe), loaded.tokenizer)
                res.checkpoint = why or str(out)
            reps = [run_.sites_before] + ([run_.sites_after] if run_.sites_after else [])
            labels = [f"{recipe}"] + ([f"{recipe} + SmoothQuant"] if run_.sites_after else [])
            png = optional_png(plot_sites, reps, str(stage / "lowbit_sites.png"), labels=labels)
            write_report(res, stage, png)
        if res.checkpoint:
            print(f"checkpoint: {res.checkpoint}")
        md = out / "lowbit_report.md"
        mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        kl = "" if run_.tokens is None else \
            f", KL from float {run_.tokens.kl:.4f} nats, top-1 agreement {100 * run_.tokens.top1:.2f}%"
        print(f"{recipe}: {mname} {before:.4f} -> {run_.value:.4f} ({res.change()}){kl}, "
              f"bytes {mb(res.bytes_before)} -> {mb(res.bytes_after)}; report {md}", flush=True)
        if run_.clipping:
            worst = run_.clipping[0]
            print(f"static scales on new text: worst clipping {worst['clip_rate']:.2e} at {worst['name']} "
                  f"(max |x|/range {worst['max_ratio']:.2f})")
        table.append((recipe, run_.value, res.change(), res.bytes_after, len(run_.overrides)))
        del run_
    if len(table) > 1:
        print(f"\n| recipe | {mname} | change | bytes | overrides |\n|---|---:|---:|---:|---:|")
        print(f"| float | {before:.3f} | | {bytes_before} | |")
        for r, v, c, b, n in table:
            print(f"| {r} | {v:.3f} | {c} | {b} | {n} |")
    print(f"done in {time.time() - t0:.0f} s")
    return 0
