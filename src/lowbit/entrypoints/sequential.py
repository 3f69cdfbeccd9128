"""`lowbit quantize --sequential` (and `--distributed`): the command-line side of
lowbit.pipelines.layerwise, lowbit.workflows.sequential and lowbit.algorithms.distributed. The model is never whole in memory, so there
is no before/after evaluation: the checkpoint is written and a summary printed."""
from __future__ import annotations

import json
import time
from pathlib import Path


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


def run(args, recipes: list[str], outs: dict, device: str) -> int:
    """Quantize args.model layer by layer for each recipe; rank 0 writes under torch.distributed."""
    import torch
    from lowbit.algorithms import distributed as D
    from lowbit.pipelines.layerwise import quantize_layerwise
    from lowbit.workflows.job import Measures, QuantizeJob
    from lowbit.workflows.sequential import calibration_windows, loader_lines
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
