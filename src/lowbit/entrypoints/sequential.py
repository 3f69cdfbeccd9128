"""`lowbit quantize --sequential` (and `--distributed`): the command-line side of
lowbit.pipelines.layerwise and lowbit.algorithms.distributed. The model is never whole in memory, so there
is no before/after evaluation: the checkpoint is written and a summary printed."""
from __future__ import annotations

import json
import time
from pathlib import Path

from lowbit.evaluation.workload import tokenizer_files

# Measures the layer-by-layer path does not do (yet): the flag and why.
UNSUPPORTED = {"awq": "--awq", "rotate": "--rotate", "override_worst": "--override-worst", "override": "--override",
               "mse": "--mse-scales"}


def check(args) -> None:
    """Flags that cannot combine with --sequential, before anything loads."""
    bad = [flag for attr, flag in UNSUPPORTED.items() if getattr(args, attr, None)]
    if bad:
        raise ValueError(f"--sequential quantizes layer by layer without {', '.join(bad)}; drop them or quantize "
                         "the whole model (without --sequential)")
    if args.model_dir is None:
        raise ValueError(f"--sequential reads a safetensors checkpoint directory; --model {args.model!r} is not one")
    if args.no_save:
        raise ValueError("--sequential writes the checkpoint as it goes; --no-save would leave nothing")
    if getattr(args, "eval_data", None):
        raise ValueError("--sequential does not evaluate the model; drop --eval-data")
    if getattr(args, "dtype", "auto") != "auto":
        raise ValueError("--sequential copies the tensors kept in high precision as the source stores them; "
                         "drop --dtype")


def loader_lines(model_dir: str, recipe: str, ignore) -> list[str]:
    """The loaders that cannot read the checkpoint this run writes (lowbit.recipes.loaders), from
    config.json and the recipe alone: --sequential writes layer by layer, so this is said first."""
    from lowbit.pipelines.layerwise import MOE_FAMILIES
    from lowbit.recipes.loaders import add_form, loader_warnings, recipe_form
    from lowbit.recipes.plan import match
    from lowbit.recipes.presets import RECIPES
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    experts = "model.layers.0.mlp.experts"      # layer 0's experts module in every MoE family transformers ships
    parts = ["dense"] + (["experts"] if model_type in MOE_FAMILIES
                         and not any(match(p, experts) for p in ignore or ()) else [])
    forms: dict = {}
    for part in parts:
        add_form(forms, part, *recipe_form(RECIPES[recipe]), recipe)
    return list(loader_warnings(forms).values())


def calibration_windows(model_dir: str, tokens: int, window: int, calib_data: str | None = None, *,
                        text_column: str | None = None, chat: str = "auto", exact: bool = True) -> list:
    """[1, window] id tensors of the calibration text (Wikipedia's calib split, as the whole-model
    path, or the --calib-data file), tokenized by the checkpoint's own tokenizer. exact False:
    `tokens` is a default, and a file holding fewer gives its whole windows (said in a line)."""
    from lowbit.evaluation.embedded import _offline, wiki_token_ids, windows
    from lowbit.evaluation import text_files as T
    _offline()
    tokenizer_files(Path(model_dir))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    if calib_data is not None:
        ids, chat_line = T.read_token_ids(calib_data, tok, "--calib-data", text_column=text_column, chat=chat)
        ids, fit_line = T.fit_tokens(ids, tokens, window, "--calib-data", calib_data, "--calib-tokens", exact)
        for line in (chat_line, fit_line):
            if line:
                print(line, flush=True)
        return windows(ids, window)
    return windows(wiki_token_ids(tok, tokens, split="calib"), window)


def run(args, recipes: list[str], outs: dict, device: str) -> int:
    """Quantize args.model layer by layer for each recipe; rank 0 writes under torch.distributed."""
    import torch
    from lowbit.algorithms import distributed as D
    from lowbit.pipelines.layerwise import quantize_layerwise
    from lowbit.workflows.job import Measures, QuantizeJob
    # the data file's reading options travel with it
    data = dict(calib_data=args.calib_data, text_column=args.text_column, chat=args.chat_template,
                exact=args.calib_tokens_given) if getattr(args, "calib_data", None) else {}
    calib = D.shard(calibration_windows(args.model_dir, args.calib_tokens, args.window, **data))
    method = args.method or "rtn"
    say = print if D.rank() == 0 else (lambda *a, **k: None)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    steps = Measures(smoothquant=args.smoothquant, method=method, static=args.static_scales).steps()
    for recipe in recipes:
        job = QuantizeJob.build(recipe, steps, ignore=args.ignore)
        for line in loader_lines(args.model_dir, recipe, job.ignore):
            say(f"warning: {line}", flush=True)
        t0 = time.time()
        say(f"{recipe}: layer by layer on {device} ({dtype}), {method}"
            f"{'' if args.smoothquant is None else f', SmoothQuant alpha {args.smoothquant}'}"
            f"{', static scales' if args.static_scales else ''}; {D.world_size()} rank(s), "
            f"{len(calib)} calibration window(s) of {args.window} tokens on this rank", flush=True)
        res = quantize_layerwise(args.model_dir, outs[recipe] if D.rank() == 0 else None, job.recipe, calib,
                                 steps=job.steps, ignore=list(job.ignore) or None, device=device, dtype=dtype, overwrite=args.overwrite, progress=D.rank() == 0)
        peak = res.get("peak_device_bytes", res["peak_rss_over_start_bytes"])
        experts = res.get("experts", {})
        n_exp = sum(1 for n in res["quantized"] if n in experts)
        what = f"{len(res['quantized']) - n_exp} Linears" + (f" and {n_exp} experts modules" if experts else "")
        say(f"{recipe}: checkpoint {outs[recipe]} ({what} quantized) in "
            f"{time.time() - t0:.0f} s; peak memory {peak / 2**20:.0f} MiB "
            f"({'device' if 'peak_device_bytes' in res else 'RSS over the start'}), one layer "
            f"{res['layer_bytes'] / 2**20:.0f} MiB, calibration activations {res['activation_bytes'] / 2**20:.0f} MiB",
            flush=True)
        for name, d in experts.items():    # GPTQ per expert: which experts kept round to nearest, and why
            if d.get("calibration"):
                say(f"  {d['calibration']}")
            elif d.get("action") != "quantized":
                say(f"  {name}: {d.get('action')} ({d.get('reason')})")
        say(json.dumps({k: v for k, v in res.items() if k not in ("quantized", "seconds_per_layer")}))
    return 0
