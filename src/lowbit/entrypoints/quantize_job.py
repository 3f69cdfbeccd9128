"""The quantize-and-evaluate job behind `lowbit quantize` (and the perplexity table of
lowbit.experiments.perplexity_table): diagnose per-site SQNR, optionally rotate, SmoothQuant, AWQ
and override the worst sites, quantize, evaluate before/after on the texts of
lowbit.evaluation.workload."""
from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass

import torch

from lowbit.archs.experts import find_experts
from lowbit.diagnosis.routing_report import expert_weight_sqnr
from lowbit.evaluation.workload import Loaded, Texts, metric
from lowbit.nn.experts import QuantExperts
from lowbit.recipes.presets import get_recipe


@dataclass
class RecipeRun:
    recipe: str
    model: torch.nn.Module
    summary: object
    sites_before: object
    sites_after: object | None
    overrides: dict
    value: float | None         # None when not evaluated (evaluate=False)
    clipping: list
    tokens: object = None       # evaluate.TokenMetrics (KL / top-1 vs the reference) when a reference was given
    calib_s: float = 0.0        # seconds from the float copy to the quantized model (rotation, SmoothQuant, AWQ,
    eval_s: float = 0.0         # GPTQ, site reports, quantization); seconds evaluating it
    kl_pick: object = None      # site_kl.KLPick when the overrides were picked by measured KL
    without_kv: object = None   # kv_cache: the same metrics with the KV cache left unquantized (value or TokenMetrics)
    float_head: object = None   # lm_head: the same metrics with the LM head in high precision (value or TokenMetrics)
    # MoE after a fold (SmoothQuant / AWQ): per-expert weight SQNR against the folded float weights,
    # {experts module: {projection: dB per expert}} (routing_report's weight_db)
    experts_weight_db: dict | None = None


def run_recipe(loaded: Loaded, texts: Texts, recipe: str, *, smoothquant: float | None = None,
               override_worst: float = 0.0, override_to: str = "skip", ignore=None, overrides=None,
               static: bool = False, window: int = 512, progress: bool = True, sites: bool = True,
               method: str = "rtn", awq: bool = False, rotate: str | None = None,
               reference: list | torch.nn.Module | None = None, mse: bool = False,
               override_by: str = "block", kv_cache: str | None = None, evaluate: bool = True,
               lm_head: str | None = None) -> RecipeRun:
    """Quantize a copy of loaded.model by `recipe` and evaluate it. smoothquant: alpha or None;
    override_worst: fraction of Linear layers (at most 0.05: a handful of sites, not a different recipe) whose worst output
    SQNR sends them to `override_to` ("skip" = high precision, or a recipe name).
    method: "rtn" or "gptq" (lowbit.algorithms.gptq, calibrated on texts.calib); awq: fold AWQ scales
    (lowbit.algorithms.awq, weight-only recipes) after SmoothQuant and before quantizing; rotate:
    "hadamard" rotates the residual stream first (lowbit.algorithms.rotation) or None; reference: the float
    model, or evaluate.reference_logits of it on texts.eval_ids (causal models), to report the
    next-token KL divergence and top-1 agreement beside perplexity (RecipeRun.tokens). mse: MSE-optimal
    weight scales (lowbit.algorithms.scale_search) instead of round to nearest's, for RTN and GPTQ alike.
    override_by: how the override_worst sites are picked: "block" (worst block SQNR in the per-site
    report) or "kl" (largest measured drop of the next-token KL on texts.calib, greedy:
    lowbit.diagnosis.site_kl; causal models), both on round to nearest's codes after the folds.
    kv_cache: also quantize the KV cache (lowbit.nn.kv_cache; static scales calibrated on
    texts.calib); the run is evaluated with it and again without it (RecipeRun.without_kv).
    lm_head: also quantize the LM head ("int8", "fp8", "w4a16"; quantize_model's lm_head); the run
    is evaluated again with the float head put back (RecipeRun.float_head).

    evaluate=False: quantize only (RecipeRun.value None, no token metrics)."""
    from lowbit.algorithms.static_scales import calibrate_static_scales, clipping_report
    from lowbit.recipes.plan import kept_by_default, linear_layers
    from lowbit.pipelines.quantize_model import quantize_model, split_patterns
    from lowbit.diagnosis.sites import override_count, pick_overrides, site_report
    from lowbit.algorithms.smoothquant import fold_plan, smooth_model
    r = get_recipe(recipe)
    if override_by not in ("block", "kl"):
        raise ValueError(f"override_by={override_by!r}: choose 'block' (block SQNR) or 'kl' (measured KL)")
    if override_by == "kl" and loaded.kind != "causal":
        raise ValueError("override_by='kl' measures next-token distributions: it needs a causal language model; "
                         "use override_by='block' for an encoder")
    t0 = time.perf_counter()
    m = copy.deepcopy(loaded.model)
    if rotate is not None:
        if rotate != "hadamard":
            raise ValueError(f"rotate={rotate!r}: the rotation lowbit knows is 'hadamard'")
        from lowbit.algorithms.rotation import rotate_model
        from lowbit.archs.decoders import UnsupportedArchitecture
        try:
            rotate_model(m)
        except UnsupportedArchitecture as err:
            raise ValueError(f"--rotate {rotate} refused: {err}. Quantize without --rotate") from None
    # The per-site diagnosis is of Linears: the patterns that name MoE experts modules only are for
    # quantize_model (site_report would refuse a pattern that matches no Linear).
    experts_found = find_experts(m)
    lin_ignore, lin_over = split_patterns(m, experts_found, r, ignore, overrides)[:2] if experts_found \
        else (ignore, overrides)
    lin_ignore, lin_over = lin_ignore or None, lin_over or None
    # sites=False skips the diagnosis when nothing depends on it (no overrides to pick).
    want = sites or (override_worst > 0 and override_by == "block")
    sites_before = site_report(m, texts.calib, r, ignore=lin_ignore, overrides=lin_over, progress=progress) \
        if sites else None
    sites_after = None
    moe = bool(experts_found)
    if smoothquant is not None and moe:     # MoE: the one exact fold is each expert's down side
        from lowbit.algorithms.experts_fold import smooth_experts
        done = smooth_experts(m, texts.calib, alpha=smoothquant)
        kept = sum(s is None for d in done.values() for s in d["s"])
        print(f"{r.name}: SmoothQuant (alpha {smoothquant}) folded into the down side of "
              f"{sum(len(d['s']) for d in done.values()) - kept} experts ({kept} with too few routed tokens kept "
              "s = 1); the experts' gate_up, attention and shared experts are not smoothed (no exact fold point for "
              "a MoE family)", flush=True)
        if want:
            sites_after = site_report(m, texts.calib, r, ignore=lin_ignore, overrides=lin_over, progress=progress)
    elif smoothquant is not None:
        # the decoder map says where the fold is exact: a family it does not know is refused here
        # (before anything is folded), Linears without a fold point are named and left unsmoothed
        from lowbit.archs.decoders import UnsupportedArchitecture
        try:
            _, why = fold_plan(m)
        except UnsupportedArchitecture as err:
            raise ValueError(f"SmoothQuant (alpha {smoothquant}, the flag or the recipe's best measures) refused: "
                             f"{err}. Run with --plain, or with other measure flags and no --smoothquant") from None
        for w in why:
            print(f"{r.name}: SmoothQuant: {w}", flush=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="SmoothQuant: ")   # printed above
            smooth_model(m, texts.calib, alpha=smoothquant, progress=progress)
        if want:
            sites_after = site_report(m, texts.calib, r, ignore=lin_ignore, overrides=lin_over, progress=progress)
    elif want and sites_before is None:
        sites_before = site_report(m, texts.calib, r, ignore=lin_ignore, overrides=lin_over, progress=progress)
    if awq:
        if moe:       # MoE: the one exact AWQ fold is each expert's down side
            from lowbit.algorithms.experts_fold import awq_experts
            done = awq_experts(m, r, texts.calib)
            kept = sum(a is None for d in done.values() for a in d["alpha"])
            print(f"{r.name}: AWQ folded into the down side of {sum(len(d['alpha']) for d in done.values()) - kept} "
                  f"experts ({kept} with too few routed tokens kept s = 1); the experts' gate_up, attention and "
                  "shared experts are not folded (no exact fold point for a MoE family)", flush=True)
        else:
            from lowbit.algorithms.awq import awq_model
            awq_model(m, r, texts.calib, progress=progress)
    ov = dict(overrides or {})
    picked, klp = {}, None
    if override_worst > 0 and override_by == "kl":
        from lowbit.diagnosis.site_kl import kl_pick
        klp = kl_pick(m, texts.calib, r, override_count(len(linear_layers(m)), override_worst), to=override_to,
                      ignore=lin_ignore, overrides=lin_over, progress=progress)
        picked = {s: override_to for s in klp.picked}
        ov.update(picked)
    elif override_worst > 0:
        final = sites_after or sites_before
        picked = pick_overrides(final, len(linear_layers(m)), override_worst, override_to)
        ov.update(picked)
    scales = None
    if static and override_to != "skip" and picked:
        raise ValueError("static scales are calibrated for the recipe's activation format; combine them only "
                         "with override_to='skip'")
    if static:
        if r.act is None:
            raise ValueError(f"--static-scales needs a recipe with activation quantization; {r.name} is weight-only")
        scales = calibrate_static_scales(m, texts.calib, r.act)
    heads = {n: mod for n, mod in linear_layers(m).items() if kept_by_default(n)} if lm_head else {}
    # the folded float experts, held until their quantized weights are compared with them (the
    # float model's weights differ from them by the fold's factors)
    folded = {n: m.get_submodule(n) for n in experts_found} if moe and (smoothquant is not None or awq) else {}
    summary = quantize_model(m, r, ignore=ignore, overrides=ov or None, act_static_scales=scales, progress=progress,
                             method=method, calib=texts.calib if method != "rtn" else None, mse=mse,
                             kv_cache=kv_cache, kv_calib=texts.calib if kv_cache else None, lm_head=lm_head)
    quantized = {d.name for d in summary.quantized}
    experts_weight_db = {n: expert_weight_sqnr(f, experts_found[n], m.get_submodule(n)) for n, f in folded.items()
                         if isinstance(m.get_submodule(n), QuantExperts)} or None
    del folded
    heads = {n: h for n, h in heads.items() if n in quantized}     # an ignore pattern may have kept the head
    clipping = clipping_report(m, texts.new) if static and evaluate else []
    t1 = time.perf_counter()
    by_tokens = reference is not None and loaded.kind == "causal"

    def evaluated(tokens_desc: str, metric_desc: str):
        """The quantized model's token metrics against the float reference (causal models with
        one), else the run's metric; the descriptions label the progress bar."""
        if by_tokens:
            from lowbit.evaluation.evaluate import token_metrics
            return token_metrics(m, texts.eval_ids, reference, window, progress=progress,
                                 desc=f"{r.name} eval{tokens_desc}")
        return metric(loaded, m, loaded.model, texts, window, progress, f"{r.name} eval{metric_desc}")

    tokens, value = None, None
    if evaluate:
        value = evaluated("", "")
        if by_tokens:
            tokens, value = value, value.perplexity
    without_kv = None
    if kv_cache is not None and evaluate:
        from lowbit.nn.kv_cache import kv_cache_disabled
        with kv_cache_disabled(m):
            without_kv = evaluated(", KV cache unquantized", ", KV unquantized")
    float_head = None
    if heads and evaluate:
        with float_modules(m, heads):
            float_head = evaluated(", LM head in high precision", ", float LM head")
    return RecipeRun(r.name, m, summary, sites_before, sites_after, picked, value, clipping, tokens,
                     t1 - t0, time.perf_counter() - t1, klp, without_kv, float_head, experts_weight_db)


@contextlib.contextmanager
def float_modules(model: torch.nn.Module, modules: dict[str, torch.nn.Module]):
    """Put the float modules {name: module} back in place of what replaced them, for the block."""
    now = {n: model.get_submodule(n) for n in modules}

    def put(mods):
        for name, mod in mods.items():
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, mod)
    put(modules)
    try:
        yield
    finally:
        put(now)
