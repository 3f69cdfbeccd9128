"""`lowbit quantize`: quantize a model by a recipe, show the sites that hurt, what it costs
(perplexity / embedding cosine) and what it buys (bytes, tokens/s on CUDA), and write a
compressed-tensors checkpoint plus a report (markdown + PNG).

Defaults: the embedded SmolLM2-135M-Instruct, Wikipedia text, recipe w8a8-int8."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

from lowbit.evaluation import text_files as T
from lowbit.evaluation.workload import (CALIB_TOKENS, EMBEDDED, EVAL_TOKENS, model_files, model_source,
                                       read_config, weight_files)


def register(p) -> None:
    from lowbit.recipes.presets import RECIPES
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (the embedded default: SmolLM2-135M-Instruct from a Q4_1 GGUF file, dequantized; "
                        "that is its float baseline), minilm (embedded encoder), a model directory (Hugging Face "
                        "or .gguf), or a model id ORG/NAME already in the local Hugging Face cache (HF_HUB_CACHE, "
                        "HF_HOME; never downloaded)")
    p.add_argument("--recipe", default="w8a8-int8",
                   help=f"recipe, or several separated by commas (one table; any letter case): {', '.join(RECIPES)}")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="checkpoint + report directory (default lowbit-out/<model>-<recipe>); "
                   "a non-empty directory lowbit did not write is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that lowbit did not write: lowbit's files are added next to "
                        "the ones there, none of which is deleted or replaced")
    p.add_argument("--tokens", type=int, default=None, metavar="N",
                   help=f"evaluation tokens, read in windows of --window (default {EVAL_TOKENS}, or the whole windows "
                        "of --eval-data when it holds fewer)")
    p.add_argument("--window", type=int, default=512, metavar="N",
                   help="perplexity window in tokens; windows do not overlap")
    p.add_argument("--calib-tokens", type=int, default=None, metavar="N",
                   help=f"calibration tokens (default {CALIB_TOKENS}, or as many as the recipe's best measures were "
                        "measured with when they are applied; either default gives way to the whole windows of "
                        "--calib-data when it holds fewer)")
    p.add_argument("--calib-data", metavar="PATH", default=None,
                   help="your calibration text instead of the embedded Wikipedia articles: .txt, .jsonl (a \"text\" "
                        "or \"messages\" field per line), .parquet, a folder saved by datasets' save_to_disk, or "
                        ".safetensors (one tensor of token ids)")
    p.add_argument("--eval-data", metavar="PATH", default=None,
                   help="your evaluation text (same kinds as --calib-data; keep it apart from the "
                        "calibration text)")
    p.add_argument("--text-column", metavar="NAME", default=None,
                   help="the column (.parquet, saved dataset) or field (.jsonl) of --calib-data / --eval-data that "
                        "holds the text; default 'text', else 'messages' (chat conversations)")
    p.add_argument("--chat-template", choices=T.CHAT_MODES, default="auto",
                   help="chat conversations in the data (a 'messages' column of role/content lists): rendered by the "
                        "tokenizer's chat template (on; auto: where the model has one) or as their contents one per "
                        "line (off)")
    p.add_argument("--no-eval", action="store_true",
                   help="skip the before/after evaluation (perplexity / cosine) and the per-site report: quantize "
                        "and save only")
    p.add_argument("--no-sites", action="store_true",
                   help="skip the per-site SQNR report of round to nearest's codes (not run with GPTQ either; "
                        "computed all the same where --override-worst picks sites by it)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="dtype of the tensors kept in high precision (embeddings, norms, skipped Linears) in the "
                        "checkpoint and in the model evaluated; by default (auto) what the source stores "
                        "(config.json's dtype), and bfloat16 for a GGUF file, the embedded SmolLM2 included (its "
                        "dequantized values rounded to bf16; float32 keeps them exactly)")
    p.add_argument("--smoothquant", nargs="?", type=float, const=0.5, default=None, metavar="ALPHA",
                   help="fold SmoothQuant factors (alpha, default 0.5) before quantizing")
    p.add_argument("--override-worst", type=float, default=0.0, metavar="FRACTION",
                   help="send the worst sites of the per-site report (at most this fraction of Linears, e.g. 0.05) "
                        "to --override-to")
    p.add_argument("--override-to", default="skip", metavar="RECIPE",
                   help="'skip' (keep in high precision) or a recipe, for --override-worst")
    p.add_argument("--ignore", action="append", default=None, metavar="PATTERN",
                   help="keep matching Linears, or MoE experts modules (e.g. 'model.layers.*.mlp.experts'), in high "
                        "precision (glob, or re:REGEX)")
    p.add_argument("--override", action="append", default=None, metavar="PATTERN=RECIPE",
                   help="another recipe (or skip) for matching Linears or MoE experts modules")
    p.add_argument("--method", choices=("rtn", "gptq"), default=None,
                   help="how weight codes are chosen: rtn (round to nearest) or gptq (calibrated)")
    p.add_argument("--plain", action="store_true",
                   help="round to nearest and nothing else; without --plain or any measure flag, the recipe's best "
                        "measured measures are applied (docs/perplexity.md)")
    p.add_argument("--gptq", dest="method", action="store_const", const="gptq", help="same as --method gptq")
    p.add_argument("--mse-scales", dest="mse", action="store_true",
                   help="MSE-optimal weight scales (range searched per group/channel) instead of round to nearest's; "
                        "with --gptq weighted by each layer's Hessian diagonal")
    p.add_argument("--awq", action="store_true",
                   help="fold activation-aware (AWQ) weight scales before quantizing (weight-only recipes)")
    p.add_argument("--rotate", nargs="?", const="hadamard", default=None, choices=("hadamard",),
                   help="rotate the residual stream by a random Hadamard matrix first (folded exactly)")
    p.add_argument("--static-scales", action="store_true",
                   help="calibrated per-tensor activation scales instead of dynamic ones (+ clipping report "
                        "on new text, unless --no-eval)")
    p.add_argument("--kv-cache", default=None, metavar="SCHEME",
                   help="also quantize the KV cache: fp8 | int8 (static per tensor, calibrated), fp8-head | int8-head "
                        "(static per KV head), fp8-token | int8-token (dynamic per token and head), int4-gN (dynamic "
                        "per N head-dim values, N dividing head_dim: int4-g32, int4-g64, int4-g128); the report gives the metrics with and without it and the "
                        "checkpoint carries compressed-tensors' kv_cache_scheme. Most accurate: int8-token; as fp8: "
                        "fp8-token (docs/kv-cache.md)")
    p.add_argument("--lm-head", choices=("int8", "fp8", "w4a16"), default=None,
                   help="also quantize the LM head, weight-only: int8 or fp8 (one scale per output channel) or w4a16 "
                        "(int4, groups of 128); a head tied to the embedding is untied (the embedding keeps its "
                        "weight). The report gives the metrics with the head quantized and in high precision. "
                        "Default: the head stays in high precision")
    p.add_argument("--no-save", action="store_true", help="evaluate only, write no checkpoint (report still written)")
    p.add_argument("--save-float", metavar="DIR", default=None,
                   help="also write the float baseline the report compares against (the embedded SmolLM2: its "
                        "dequantized weights) as a transformers folder in float32 with its tokenizer, to compare "
                        "generations")
    p.add_argument("--sequential", action="store_true",
                   help="layer by layer from the --model directory's (sharded) safetensors, Llama family and the MoE "
                        "families Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3 (experts per expert): one decoder "
                        "layer in memory at a time, calibrated on cached activations, quantized, written, freed "
                        "(same codes as the whole-model path). Calibration text tokenized by the directory's "
                        "tokenizer; only the measures flagged (--gptq, --smoothquant, --static-scales), no "
                        "best-measured defaults; no evaluation")
    p.add_argument("--device", default=None,
                   help="--sequential: where the layers run, cpu or cuda[:N] (default: cuda if available, else cpu)")
    p.add_argument("--distributed", action="store_true",
                   help="data-parallel calibration under `torchrun --nproc-per-node N -m lowbit quantize ...` "
                        "(also on whenever torchrun's environment is present): calibration batches split across "
                        "processes, statistics summed (NCCL on GPUs, gloo on CPUs), the same checkpoint as one "
                        "process, written by rank 0 (the whole-model path evaluates on every rank)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's choice)")


# Files a quantize output may hold besides the checkpoint's safetensors: a user's file of one of
# these names in --out is refused before the job starts, not after it.
OUTPUT_FILES = {"config.json", "lowbit.json", "lowbit_report.md", "lowbit_sites.png", "lowbit_metric.png",
                "lowbit_routing.png",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json",
                "generation_config.json"}
REPORT_FILES = {"lowbit_report.md", "lowbit_sites.png", "lowbit_metric.png", "lowbit_routing.png"}


FLOAT_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json"}


def _measures(args, recipe: str, kind: str, moe: bool = False, n_linear: int = 0) -> tuple[tuple, int]:
    """The steps for one recipe and its calibration tokens: the flags' steps, or (no measure flag,
    no --plain, a dense causal decoder: where they were measured) the best measured ones from
    lowbit.workflows.job.BEST, printed with the reason, on the calibration tokens they were measured
    with unless --calib-tokens is given (n_linear: the model's Linears, which the line counts sites
    of). moe: the model has MoE experts, where no measure was measured
    (SmoothQuant folds only the experts' down side there, --override-worst ranks only Linears):
    plain round to nearest, said so."""
    from lowbit.workflows.job import Measures, best_line, best_steps
    from lowbit.workflows.steps import OverrideWorst
    given = Measures(smoothquant=args.smoothquant, override_worst=args.override_worst or 0.0,
                     override_to=args.override_to, method=args.method or "rtn", awq=args.awq, rotate=args.rotate,
                     mse=args.mse, static=args.static_scales).steps()
    flagged = (args.smoothquant is not None or args.override_worst or args.method or args.awq or args.rotate
               or args.static_scales or args.mse)
    if args.plain or flagged:
        if args.plain and flagged:
            raise ValueError("--plain means round to nearest alone; drop it or the measure flags")
        return given, args.calib_tokens
    best = best_steps(recipe) if kind == "causal" else None
    if best is None:
        print(f"{recipe}: no measured improvement on file; plain round to nearest", flush=True)
        return given, args.calib_tokens
    if moe:
        print(f"{recipe}: the best measured measures {best.options} were measured on a dense decoder, not on "
              "MoE experts; plain round to nearest (give measure flags, e.g. --method gptq, to choose)", flush=True)
        return given, args.calib_tokens
    n = args.calib_tokens if args.calib_tokens_given or not best.calib_tokens else best.calib_tokens
    print(best_line(recipe, best, n_linear, n), flush=True)
    if n != args.calib_tokens:
        print(f"{recipe}: on {n} calibration tokens, what they were measured with (--calib-tokens sets them)",
              flush=True)
    # --override-to without --override-worst sends the best measures' picked sites there
    picked_to = [dataclasses.replace(s, to=args.override_to) if isinstance(s, OverrideWorst) else s
                 for s in best.steps]
    return given + tuple(picked_to), n


def _out_dirs(args, recipes: list[str]) -> dict[str, Path]:
    """Each recipe's output directory (known before the model is loaded)."""
    name = args.model if args.model in ("smollm2", "minilm") else args.source.name   # what load_model calls it
    if args.out is None:
        return {r: Path(f"lowbit-out/{name}-{r}") for r in recipes}
    return {r: Path(args.out) / r for r in recipes} if len(recipes) > 1 else {recipes[0]: Path(args.out)}


def validate(args) -> tuple[list[str], dict, dict[str, Path]]:
    """Every check that needs no model: (recipes, overrides, output directory per recipe).
    Raises ValueError naming the flag and the fix."""
    from lowbit.io.outdir import OutputDirError, check_out_dir
    from lowbit.entrypoints import quantize_args as A
    from lowbit.workflows.job import parse_recipe
    recipes = A.recipe_names(args.recipe)
    overrides = A.overrides(args.override)
    override_to = A.recipe_or_skip(args.override_to, "--override-to")
    args.override_to = override_to
    args.tokens_given = args.tokens is not None
    if args.tokens is None:
        args.tokens = EVAL_TOKENS
    A.text_sizes(args.tokens, args.window)
    args.calib_tokens_given = args.calib_tokens is not None
    if args.calib_tokens is None:
        args.calib_tokens = CALIB_TOKENS
    A.text_sizes(args.calib_tokens, args.window, "--calib-tokens")
    A.positive(args.threads, "--threads", allow_none=True)
    A.kv_cache(getattr(args, "kv_cache", None))
    if getattr(args, "lm_head", None) and args.sequential:
        raise ValueError("--lm-head is not available with --sequential (which writes decoder layers one at a time); "
                         "drop one of them")
    if getattr(args, "lm_head", None) and (args.method == "gptq"):
        raise ValueError("--lm-head with --gptq: GPTQ calibrates the decoder layers only; drop --lm-head or --gptq")
    if getattr(args, "kv_cache", None) and args.sequential:
        raise ValueError("--kv-cache is not available with --sequential (which writes layers without running the "
                         "whole model); drop one of them")
    A.fraction(args.override_worst, "--override-worst", 0.5)
    A.device(args.device)
    from lowbit.algorithms import distributed as D
    if args.distributed and not D.launched_by_torchrun():
        raise ValueError("--distributed splits the calibration across the processes torchrun starts; launch with "
                         "`torchrun --nproc-per-node N -m lowbit quantize ...`, or drop --distributed for one process")
    if args.no_eval and args.eval_data:
        raise ValueError("--eval-data is the evaluation text and --no-eval skips the evaluation: drop one")
    args.source = model_source(args.model)       # the folder's files checked; a model id found in the cache
    args.model_dir = None if args.source.directory is None else str(args.source.directory)
    if args.source.hub_id:
        print(f"--model {args.model}: the Hugging Face cache's {args.model_dir}", flush=True)
    cfg = _model_config(args)
    vocab = cfg.get("vocab_size") if cfg else None
    template = _chat_template(args)
    for path, flag, count, count_flag, given in (
            (args.calib_data, "--calib-data", args.calib_tokens, "--calib-tokens", args.calib_tokens_given),
            (args.eval_data, "--eval-data", args.tokens, "--tokens", args.tokens_given)):
        A.data_file(path, flag, text_column=args.text_column, chat=args.chat_template, template=template, count=count,
                    count_flag=count_flag, given=given, window=args.window,
                    vocab_size=vocab if isinstance(vocab, int) else None)
    if args.text_column is not None and not (args.calib_data or args.eval_data):
        raise ValueError("--text-column names a column of --calib-data / --eval-data; give one of them or drop it")
    if args.smoothquant is not None:
        A.fraction(args.smoothquant, "--smoothquant ALPHA")
    with_act = [r for r in recipes if parse_recipe(r).act is not None]
    weight_only = [r for r in recipes if parse_recipe(r).act is None]
    if args.awq and with_act:
        raise ValueError(f"--awq searches weight-only scales; recipe(s) {with_act} also quantize activations: drop "
                         "--awq (--smoothquant moves outliers for those) or choose a w4a16 / w8a16 recipe")
    if args.static_scales:
        if weight_only:
            raise ValueError(f"--static-scales calibrates activation scales; recipe(s) {weight_only} quantize "
                             "weights only: drop --static-scales or choose a W8A8 recipe")
        if args.override_worst > 0 and override_to != "skip":
            raise ValueError("--static-scales are calibrated for the recipe's activation format; combine them "
                             "only with --override-to skip")
    if args.model == "minilm":
        _encoder_measures(args, "minilm is an encoder")
        for path, flag in ((args.calib_data, "--calib-data"), (args.eval_data, "--eval-data")):
            T.sentences_file(path, flag)
    if not args.no_save:
        _shapes_before_loading(args, recipes, overrides, override_to)
    outs = _out_dirs(args, recipes)
    new_files = REPORT_FILES if args.no_save else OUTPUT_FILES | {"model.safetensors"}
    try:
        for out in outs.values():   # the report is written even with --no-save
            check_out_dir(out, args.overwrite, new_files=new_files)
        if args.save_float:
            if args.sequential:
                raise ValueError("--save-float writes the whole float model; --sequential never holds it: drop one")
            if any(Path(args.save_float).resolve() == Path(o).resolve() for o in outs.values()):
                raise ValueError(f"--save-float {args.save_float} is the checkpoint's --out; give another folder")
            check_out_dir(args.save_float, args.overwrite, what="--save-float", new_files=FLOAT_FILES)
    except OutputDirError as err:
        raise ValueError(str(err)) from err
    if args.source.directory is not None and args.source.gguf is None:
        # weights and tokenizer there, named if not (--sequential: its calibration text checks the
        # tokenizer, before any layer loads)
        (weight_files if args.sequential else model_files)(args.source.directory, args.model)
    return recipes, overrides, outs


def _encoder_measures(args, why: str) -> None:
    """The folds that need a pre-norm decoder, refused for an encoder."""
    bad = [f for f, on in (("--smoothquant", args.smoothquant is not None), ("--awq", args.awq),
                           ("--rotate", args.rotate)) if on]
    if bad:
        raise ValueError(f"{' '.join(bad)} fold scales into a pre-norm decoder's norms; {why} (post-norm): drop "
                         f"{' and '.join(bad)}")


def _model_config(args) -> dict | None:
    """The config values known before loading (the Linears' K, the vocabulary): the embedded models'
    own, or a Hugging Face directory's config.json, read by model_files when the source was resolved
    (None for a GGUF directory: the exact check after loading covers it)."""
    from lowbit.recipes.compat import EMBEDDED_CONFIGS
    if args.model in EMBEDDED_CONFIGS:
        return EMBEDDED_CONFIGS[args.model]
    if args.source.gguf is not None:
        return None
    return read_config(args.source.directory, args.model)


def _chat_template(args) -> bool | None:
    """Whether the model's tokenizer has a chat template, known before loading (the embedded
    models, a Hugging Face folder's tokenizer_config.json / chat_template.jinja); None for a GGUF
    file (its template is read with the tokenizer)."""
    if args.model in EMBEDDED:
        return args.model == "smollm2"       # SmolLM2-135M-Instruct's GGUF carries ChatML; MiniLM has none
    d = args.source.directory
    if args.source.gguf is not None:
        return None
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def _shapes_before_loading(args, recipes: list[str], overrides: dict, override_to: str) -> None:
    """Refuse a recipe whose checkpoint cannot hold the model's shapes, from the config alone. With
    --ignore / --override the layers in play are only known after loading (check_plan then)."""
    from lowbit.recipes.compat import config_in_features, refusal
    cfg = _model_config(args)
    if cfg is None or args.ignore or overrides:
        return
    ks = config_in_features(cfg)
    for r in recipes + ([override_to] if override_to != "skip" and args.override_worst > 0 else []):
        why = refusal(r, ks, no_save=not args.sequential)     # --sequential only writes
        if why:
            raise ValueError(f"--recipe {r}: {why}" if r in recipes else f"--override-to {r}: {why}")


def check_plan(args, model, recipe: str, overrides: dict) -> None:
    """After loading, before any calibration: the patterns against the model, the MoE experts'
    groups (with --no-save too: stacked expert scales need whole groups), and, when saving, the
    exact plan's shapes against each recipe's checkpoint format."""
    from lowbit.archs.experts import find_experts
    from lowbit.pipelines.quantize_model import split_patterns
    from lowbit.recipes.compat import plan_refusal
    from lowbit.recipes.loaders import plan_warnings
    from lowbit.recipes.plan import plan
    experts = find_experts(model)
    # a pattern naming only experts modules is for the experts plan (as in quantize_model); plan()
    # alone would call it a pattern that matches no Linear
    lin_ignore, lin_over, found, decisions, _ = split_patterns(model, experts, recipe, args.ignore, overrides)
    summary = plan(model, recipe, ignore=lin_ignore or None, overrides=lin_over or None,
                   lm_head=getattr(args, "lm_head", None))
    extra = [args.override_to] if args.override_to != "skip" and args.override_worst > 0 else []
    quantized = [d for d in decisions if d.action == "quantized"]
    why = experts_refusal(recipe, quantized) or _kv_group_refusal(getattr(args, "kv_cache", None), model)
    if why:
        raise ValueError(why)
    if args.static_scales and quantized:
        raise ValueError(f"--static-scales: static activation scales are not supported for MoE experts "
                         f"({quantized[0].name}, ...); drop --static-scales (dynamic per-token scales), or keep the "
                         f"experts in high precision (--ignore '{_experts_glob(quantized[0].name)}')")
    if args.no_save:
        return
    fused = [d for d in quantized if found[d.name].ckpt_projs is None]
    if fused:
        raise ValueError(f"--recipe {recipe}: {fused[0].family} checkpoints keep the experts fused, and no loader reads "
                         f"them quantized per expert ({', '.join(d.name for d in fused[:2])}"
                         f"{', ...' if len(fused) > 2 else ''}): keep them in high precision to save the model "
                         f"(--ignore '{_experts_glob(fused[0].name)}'), or evaluate without saving (--no-save)")
    why = plan_refusal(summary, extra)
    if why:
        raise ValueError(f"--recipe {recipe}: {why}")
    for line in plan_warnings(summary, quantized).values():     # loaders that cannot read what will be written
        print(f"warning: --recipe {recipe}: {line}", flush=True)


def _kv_head_dim(model) -> int | None:
    """head_dim of the heads the KV cache holds, from the model's (text) config; None when it does
    not say."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    from lowbit.recipes.compat import config_head_dim
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return config_head_dim(cfg.to_dict())


def _kv_group_refusal(kv_cache: str | None, model) -> str | None:
    """Why --kv-cache cannot apply to this model (no attention modules the quantized cache knows,
    or an int4-gN group that does not divide its head_dim), with the fix; else None."""
    if kv_cache is None:
        return None
    from lowbit.nn.kv_cache import attention_modules
    if not attention_modules(model):
        return (f"--kv-cache {kv_cache}: {type(model).__name__} has no attention modules lowbit's quantized KV cache "
                "knows (with layer_idx, k_proj and v_proj; multi-head latent attention such as DeepSeek-V3's "
                "projects K and V from a compressed latent, an encoder keeps no cache): drop --kv-cache")
    from lowbit.workflows.job import parse_kv_cache
    s = parse_kv_cache(kv_cache).scheme
    if s.granularity != "group":
        return None
    hd = _kv_head_dim(model)
    if hd is None or hd % s.group_size == 0:
        return None
    fits = [n for n in (128, 64, 32, 16, 8) if hd % n == 0][:2]
    fmt = kv_cache.partition("-")[0]
    use = f"use {' or '.join(f'--kv-cache {fmt}-g{n}' for n in fits)}, " if fits else ""
    return (f"--kv-cache {kv_cache}: head_dim {hd} of {type(model).__name__} is not a multiple of the group of "
            f"{s.group_size} head-dim values: {use}or a cache scaled per token (--kv-cache int8-token)")


def _experts_glob(name: str) -> str:
    """A glob naming every experts module like `name` (the layer index replaced by *)."""
    return re.sub(r"\.\d+\.", ".*.", name, count=1)


def experts_refusal(recipe: str, decisions, ignore_hint: bool = True) -> str | None:
    """Why the experts of `decisions` (quantized ones) cannot take their recipe's groups, with the
    fix; None if they can. Both projections: gate_up reads H, down reads I. ignore_hint: name
    --ignore as a way out (lowbit sites has no such flag)."""
    from lowbit.recipes.compat import alternative, stored_group
    from lowbit.workflows.job import parse_recipe
    for d in decisions:
        if d.action != "quantized":
            continue
        r = parse_recipe(d.recipe)
        g = stored_group(r)
        _, two_i, h = d.shape
        ks = {"gate_up (hidden size H)": h, "down (expert intermediate size I)": two_i // 2}
        bad = {what: k for what, k in ks.items() if g and k % g}
        if not bad:
            continue
        alt = alternative(r, sorted(set(ks.values())))
        # an override's decision reads "override 'PATTERN'" (lowbit.recipes.plan.by_patterns)
        flag = f"--override {d.reason[len('override '):].strip(chr(39))}=" if d.reason.startswith("override ") \
            else "--recipe "
        flag = f"{flag}{d.recipe}"
        where = " and ".join(f"K = {k} of {what}" for what, k in bad.items())
        use = "" if alt is None else f"use {alt.name} ({'groups of %d' % stored_group(alt) if stored_group(alt) else 'per-channel scales'})"
        return (f"{flag}: the MoE experts ({d.name}, E x 2I x H = {'x'.join(map(str, d.shape))}) have "
                f"{where}, not a multiple of {r.name}'s group of {g}; experts are quantized in whole groups, saved "
                f"or not: {use}"
                + (f"{', ' if use else ''}or keep the experts in high precision (--ignore '{_experts_glob(d.name)}')"
                   if ignore_hint else ""))
    return None


def run(args) -> int:
    """Bad input raises ValueError / FileNotFoundError; lowbit.entrypoints.main prints it without a traceback.
    The work is lowbit.workflows.session's: this parses, checks, and prints."""
    import torch
    from lowbit.algorithms import distributed as D
    from lowbit.workflows.job import QuantizeJob
    from lowbit.workflows.session import QuantizeSession, TextOptions
    from lowbit.workflows.steps import GPTQ

    recipes, overrides, outs = validate(args)   # before anything slow
    if args.threads:
        torch.set_num_threads(args.threads)
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
    session = QuantizeSession.load(args.model, command=command)
    if session.loaded.kind != "causal":
        _encoder_measures(args, f"{session.loaded.name} is an encoder")
    for recipe in recipes:                       # before any calibration work
        check_plan(args, session.loaded.model, recipe, overrides)
    evaluate = not args.no_eval
    fit = frozenset(n for n, given in (("tokens", args.tokens_given), ("calib_tokens", args.calib_tokens_given))
                    if not given)
    session.prepare(TextOptions(tokens=args.tokens, calib_tokens=args.calib_tokens, window=args.window,
                                calib_data=args.calib_data, eval_data=args.eval_data, text_column=args.text_column,
                                chat=args.chat_template, fit=fit),
                    dtype=args.dtype, evaluate=evaluate, save_float_to=args.save_float, overwrite=args.overwrite)
    table = []
    for recipe in recipes:
        steps, n_calib = _measures(args, recipe, session.loaded.kind, moe=session.moe, n_linear=session.n_linear)
        job = QuantizeJob.build(recipe, steps, kv_cache=getattr(args, "kv_cache", None),
                                lm_head=getattr(args, "lm_head", None), ignore=args.ignore, overrides=overrides)
        # the per-site report diagnoses round to nearest's codes: shown when those are the codes
        # saved, or when a step picks sites by it (quantize_job then runs it all the same)
        sites = evaluate and not args.no_sites and job.step(GPTQ) is None
        if evaluate and not args.no_sites and not sites:
            print(f"{recipe}: no per-site report: GPTQ chooses the codes, and the report diagnoses round to "
                  f"nearest's (`lowbit sites --recipe {recipe}` shows them)", flush=True)
        result = session.quantize(job, calib_tokens=n_calib, sites=sites, estimated=args.no_save)
        session.write(result, outs[recipe], save=not args.no_save, overwrite=args.overwrite)
        if D.rank() != 0:
            continue
        print(result.line(), flush=True)
        run_ = result.run
        if run_.clipping:
            worst = run_.clipping[0]
            print(f"static scales on new text: worst clipping {worst['clip_rate']:.2e} at {worst['name']} "
                  f"(max |x|/range {worst['max_ratio']:.2f})")
        table.append((recipe, run_.value, result.report.change(), result.report.bytes_after, len(run_.overrides)))
        del result, run_
    if len(table) > 1:
        print(f"\n| recipe | {session.metric} | change | bytes | overrides |\n|---|---:|---:|---:|---:|")
        v3 = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"| float | {v3(session.before)} | | {session.bytes_before} | |")
        for r, v, c, b, n in table:
            print(f"| {r} | {v3(v)} | {c} | {b} | {n} |")
    print(f"done in {time.time() - t0:.0f} s")
    return 0
