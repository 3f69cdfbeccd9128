"""quantize_job: run a QuantizeJob on a loaded model: copy it, run the job's steps, quantize,
and evaluate the result against the float model (the workflow behind `lowbit quantize` and the
perplexity table of lowbit.experiments.perplexity_table).

    import lowbit as lb
    from lowbit.evaluation.workload import load_model, prepare_texts
    from lowbit.workflows.steps import OverrideWorst, SmoothQuant
    loaded = load_model("smollm2")
    texts = prepare_texts(loaded, tokens=8192, calib_tokens=1024, window=512)
    job = lb.QuantizeJob.build("w8a8-int8", [SmoothQuant(0.5), OverrideWorst(0.05)])
    run = lb.quantize_job(loaded, texts, job, reference=loaded.model)
    print(run.summary, run.value, run.tokens)
    lb.save_compressed(run.model, "out", job.recipe, tokenizer=loaded.tokenizer)

`loaded.model` is never changed: the job works on a deep copy (JobRun.model). Every step's
refusal of the model is raised before the copy is made.
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.archs.experts import find_experts
from lowbit.diagnosis.routing_report import expert_weight_sqnr
from lowbit.evaluation.evaluate import token_metrics
from lowbit.evaluation.workload import Loaded, Texts, metric
from lowbit.nn.experts import QuantExperts
from lowbit.pipelines.quantize_model import quantize_model, split_patterns
from lowbit.recipes.plan import kept_by_default, linear_layers
from lowbit.algorithms.static_scales import clipping_report
from lowbit.workflows.job import QuantizeJob
from lowbit.workflows.steps import AWQ_FOLD, FOLD, QUANTIZE, ROTATE, OverrideWorst, RunState, diagnose


@dataclass
class JobRun:
    """What quantize_job returns: the quantized copy and what the report shows."""
    recipe: str
    model: torch.nn.Module
    summary: object
    sites_before: object
    sites_after: object | None
    overrides: dict
    value: float | None         # None when not evaluated (evaluate=False)
    clipping: list
    tokens: object = None       # evaluate.TokenMetrics (KL / top-1 vs the reference) when a reference was given
    calib_s: float = 0.0        # seconds from the float copy to the quantized model (the steps, the site
    eval_s: float = 0.0         # reports, the quantization); seconds evaluating it
    kl_pick: object = None      # site_kl.KLPick when the overrides were picked by measured KL
    without_kv: object = None   # KV cache: the same metrics with the KV cache left unquantized (value or TokenMetrics)
    float_head: object = None   # LM head: the same metrics with the LM head in high precision (value or TokenMetrics)
    # MoE after a fold (SmoothQuant / AWQ): per-expert weight SQNR against the folded float weights,
    # {experts module: {projection: dB per expert}} (routing_report's weight_db)
    experts_weight_db: dict | None = None


def _refuse(loaded: Loaded, job: QuantizeJob) -> None:
    for s in job.steps:
        why = s.refuses(loaded)
        if why:
            raise ValueError(why)


def quantize_job(loaded: Loaded, texts: Texts, job: QuantizeJob, *, reference=None, window: int = 512,
                 evaluate: bool = True, sites: bool = True, progress: bool = True) -> JobRun:
    """Quantize a copy of loaded.model by `job` (calibrated on texts.calib) and evaluate it on
    texts. reference: the float model, or evaluate.reference_logits of it on texts.eval_ids (causal
    models), to report the next-token KL divergence and top-1 agreement beside perplexity
    (JobRun.tokens). sites: the per-site report before (and after SmoothQuant); skipped when False
    unless a step picks sites by it. With a KV-cache step the run is evaluated again with the cache
    unquantized (JobRun.without_kv); with a quantized LM head, again with the float head
    (JobRun.float_head). evaluate=False: quantize only (JobRun.value None, no token metrics)."""
    _refuse(loaded, job)
    r = job.recipe
    t0 = time.perf_counter()
    m = copy.deepcopy(loaded.model)
    state = RunState(m, r, texts.calib, loaded.kind, progress=progress)
    steps = list(job.steps)
    while steps and steps[0].order == ROTATE:          # rotation: the diagnosis describes the rotated model
        steps.pop(0).apply(state)
    # The per-site diagnosis is of Linears: the patterns that name MoE experts modules only are for
    # quantize_model (site_report would refuse a pattern that matches no Linear).
    state.experts = find_experts(m)
    ignore, overrides = list(job.ignore) or None, dict(job.overrides) or None
    lin_ignore, lin_over = split_patterns(m, state.experts, r, ignore, overrides)[:2] if state.experts \
        else (ignore, overrides)
    state.ignore, state.overrides = lin_ignore or None, lin_over or None
    pick = job.step(OverrideWorst)
    state.want_sites = sites or (pick is not None and pick.by == "block")
    if sites or (state.want_sites and not any(s.diagnose_after for s in steps)):
        state.sites_before = diagnose(state)
    for s in [s for s in steps if s.order < QUANTIZE]:
        s.apply(state)
        if s.diagnose_after and state.want_sites:
            state.sites_after = diagnose(state)
    # the folded float experts, held until their quantized weights are compared with them (the
    # float model's weights differ from them by the fold's factors)
    folded = {n: m.get_submodule(n) for n in state.experts} if any(s.order in (FOLD, AWQ_FOLD) for s in steps) \
        else {}
    heads = {n: mod for n, mod in linear_layers(m).items() if kept_by_default(n)} if job.lm_head else {}
    options = {}
    for s in steps:
        options.update(s.quantize_options(state))
    ov = {**(overrides or {}), **state.picked}
    state.summary = quantize_model(m, r, ignore=ignore, overrides=ov or None, progress=progress,
                                   lm_head=job.lm_head, **options)
    for s in [s for s in steps if s.order > QUANTIZE]:
        s.apply(state)
    summary = state.summary
    quantized = {d.name for d in summary.quantized}
    experts_weight_db = {n: expert_weight_sqnr(f, state.experts[n], m.get_submodule(n)) for n, f in folded.items()
                         if isinstance(m.get_submodule(n), QuantExperts)} or None
    del folded
    heads = {n: h for n, h in heads.items() if n in quantized}     # an ignore pattern may have kept the head
    clipping = clipping_report(m, texts.new) if state.act_static_scales is not None and evaluate else []
    t1 = time.perf_counter()
    by_tokens = reference is not None and loaded.kind == "causal"

    def evaluated(tokens_desc: str, metric_desc: str):
        """The quantized model's token metrics against the float reference (causal models with
        one), else the run's metric; the descriptions label the progress bar."""
        if by_tokens:
            return token_metrics(m, texts.eval_ids, reference, window, progress=progress,
                                 desc=f"{r.name} eval{tokens_desc}")
        return metric(loaded, m, loaded.model, texts, window, progress, f"{r.name} eval{metric_desc}")

    tokens, value = None, None
    if evaluate:
        value = evaluated("", "")
        if by_tokens:
            tokens, value = value, value.perplexity
    without_kv = None
    if job.kv_cache is not None and evaluate:
        from lowbit.nn.kv_cache import kv_cache_disabled      # transformers: an optional dependency
        with kv_cache_disabled(m):
            without_kv = evaluated(", KV cache unquantized", ", KV unquantized")
    float_head = None
    if heads and evaluate:
        with float_modules(m, heads):
            float_head = evaluated(", LM head in high precision", ", float LM head")
    return JobRun(r.name, m, summary, state.sites_before, state.sites_after, state.picked, value, clipping, tokens,
                  t1 - t0, time.perf_counter() - t1, state.kl_pick, without_kv, float_head, experts_weight_db)


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


def round_float_parts(model, dtype) -> None:
    """Round every float parameter and persistent buffer to `dtype` in place (kept in their own
    dtype): the model evaluated, quantized and saved is then the one the checkpoint holds."""
    if dtype == torch.float32:
        return
    with torch.no_grad():
        for m in model.modules():
            ts = list(m._parameters.values()) + [b for k, b in m._buffers.items()
                                                 if k not in m._non_persistent_buffers_set]
            for t in ts:
                if t is not None and t.is_floating_point() and t.dtype != dtype:
                    t.copy_(t.to(dtype))


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the checkpoint's tensor files on disk (safetensors shards and their index)."""
    return sum(f.stat().st_size for f in Path(directory).iterdir()
               if f.name.endswith(".safetensors") or f.name.endswith(".safetensors.index.json"))
