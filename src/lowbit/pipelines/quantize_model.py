"""quantize_model: replace a model's nn.Linear layers by QuantLinear under a recipe.

What stays in high precision by default (the sites where quantization costs most for least gain): everything
that is not a Linear (embeddings, norms, the residual stream, softmax) and `lm_head` (the
logits) or any Linear whose weight is tied to an embedding. Per-site control:
  ignore=[pattern, ...]            keep these Linears in high precision;
  overrides={pattern: recipe|"skip"} another recipe (or none) for the matching Linears.
A weight whose in_features the recipe's group size does not divide gets a short last group
(compressed-tensors' convention; the summary says so for each such layer).
Patterns are shell globs or `re:` regular expressions on module names; the decisions come from
lowbit.recipes.plan (one typed plan, made before anything changes).

Mixture-of-experts blocks (lowbit.archs.experts: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3,
gpt-oss): the fused experts module of each block becomes a lowbit.nn.experts.QuantExperts under
the same recipe (per-expert codes and scales); ignore / override patterns may name experts
modules as they name Linears. Routers and shared-expert gates stay in high precision; shared
experts are plain Linears. A module with fused 3-D weights that the map does not know is refused.
method="gptq" calibrates each expert on the tokens routed to it (lowbit.algorithms.gptq.experts:
experts with fewer than min_tokens routed tokens keep round to nearest, listed in the summary);
mse=True gives each expert MSE-optimal scales.

Coverage (lowbit.pipelines.coverage), never silent: before anything changes, every weight
tensor of >= 2 dimensions holding >= 1% of the parameters must be planned for quantization or
kept by a rule (embedding, norm, router, lm_head, ignore list); otherwise ValueError names them
(on_untouched="warn" warns instead). `summary.coverage` reports the result, by rule and kind.

The model is changed only after every layer has been quantized successfully: an error leaves
it untouched.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lowbit.algorithms.gptq.model import gptq_model
from lowbit.algorithms.scale_search import search_scales
from lowbit.archs.experts import find_experts
from lowbit.nn.quant_linear import QuantLinear
from lowbit.archs.decoders import sibling_groups
from lowbit.nn.shared_input import GROUPS, share_inputs as share
from lowbit.ops.kv_quant import KVScheme
from lowbit.options import Options
from lowbit.pipelines.coverage import check_coverage, coverage
from lowbit.pipelines.moe import build_experts, keep_routers, plan_experts, swap_in
from lowbit.recipes.plan import (DEFAULT_KEEP, LayerDecision, QuantSummary, layer_act, linear_layers,  # noqa: F401
                                 match, plan, tied_to_embedding)
from lowbit.recipes.presets import Recipe, get_recipe
from lowbit.progress import progress_bar

def quantize_layer(d: LayerDecision, summary: QuantSummary, linear: torch.nn.Linear,
                   act_static_scales: dict | None = None, backend: str = "auto", mse: bool = False) -> QuantLinear:
    """The round-to-nearest QuantLinear of one planned layer (its recipe, its static scale); mse:
    with the MSE-optimal weight scales of lowbit.algorithms.scale_search (unweighted: no calibration)."""
    r = summary.recipe_of(d)
    act, scale = layer_act(d, r, act_static_scales)
    try:
        scales = None
        if mse:
            scales = search_scales(linear.weight.detach(), r.weight)
        return QuantLinear.from_linear(linear, r.weight, act, act_static_scale=scale, backend=backend, pad=True,
                                       scales=scales)
    except (ValueError, NotImplementedError) as err:
        raise type(err)(f"layer {d.name} ({d.shape[0]}x{d.shape[1]}) under recipe {r.name}: {err}. "
                        f"Keep it in high precision with ignore=[{d.name!r}] or override it.") from err


def _share(model: torch.nn.Module) -> None:
    """Merge the quantized siblings reading one input: the family's groups from the decoder map,
    shared_input's default for a model the map does not know (merging is exact for any model)."""
    groups = sibling_groups(model)
    share(model, GROUPS if groups is None else groups)


@dataclass(frozen=True)
class QuantizeOptions(Options):
    """Everything quantize_model takes besides the model and the recipe, typed in one place (each
    field is described in quantize_model's docstring). Pass one as `options=`, or the same names
    as keywords, which replace the options' fields."""
    ignore: Sequence[str] | None = None
    overrides: Mapping[str, object] | None = None
    act_static_scales: Mapping[str, torch.Tensor] | None = None
    backend: str = "auto"
    progress: bool = False
    share_inputs: bool = True
    method: str = "rtn"
    calib: Sequence | None = None
    method_options: Mapping[str, object] | None = None
    mse: bool = False
    kv_cache: object = None
    kv_calib: Sequence | None = None
    on_untouched: str = "raise"
    min_untouched_fraction: float = 0.01
    lm_head: str | Recipe | None = None


@torch.no_grad()
def quantize_model(model: torch.nn.Module, recipe: str | Recipe | QuantSummary,
                   options: QuantizeOptions | None = None, **changes) -> QuantSummary:
    """Replace nn.Linear layers of `model` (in place) by QuantLinear under `recipe` (a name, a Recipe or
    a plan made by lowbit.recipes.plan.plan for this model, used as it is); returns the
    QuantSummary. The options (a QuantizeOptions, or its fields as keywords):
    ignore / overrides: see the module docstring. act_static_scales: {layer name: float32 scale} from
    calibration.calibrate_static_scales, to use one calibrated per-tensor activation scale per
    layer instead of dynamic scales (every quantized layer with activations needs one).
    share_inputs: merge the quantized layers that read one input (Llama's q/k/v, gate/up) so
    the fast path quantizes each activation once (lowbit.nn.shared_input).
    method: "rtn" (round to nearest) or "gptq" (lowbit.algorithms.gptq.model.gptq_model on `calib`, a list of
    input-id tensors [B, T] or dicts of model kwargs; method_options: its keyword arguments such
    as damp, act_order). mse: MSE-optimal weight scales (lowbit.algorithms.scale_search) instead of round to
    nearest's: unweighted for "rtn", weighted by each layer's Hessian diagonal for "gptq".
    kv_cache: also quantize the KV cache ("fp8", "int8", "fp8-head", "int8-token", "int4-g32", or a
    lowbit.ops.kv_quant.KVScheme; lowbit.nn.kv_cache): static schemes are calibrated, after the
    Linears are quantized, on `kv_calib` (default `calib`: input-id tensors [B, T]); the model then
    quantizes its cache in every forward and generate, and save_compressed writes kv_cache_scheme.
    on_untouched / min_untouched_fraction: what an untouched large weight does ("raise", "warn",
    "ignore"; see lowbit.pipelines.coverage.check_coverage).
    lm_head: None (default: the LM head stays in high precision), "int8" or "fp8" (weight-only, one
    scale per output channel) or "w4a16" (int4, groups of 128): quantize the LM head too. A head
    tied to the input embedding is untied: the embedding keeps its weight (lookups unchanged,
    bit for bit), the head gets the quantized copy, and config.tie_word_embeddings becomes False so
    neither transformers nor a checkpoint reader ties them again."""
    o = QuantizeOptions.merge(options, changes, "quantize_model")
    kv_cache, kv_calib, calib = o.kv_cache, o.kv_calib, o.calib
    kv_scheme = None
    if kv_cache is not None:                           # every refusal before any layer changes
        from lowbit.nn.kv_cache import attach_kv_cache, attention_modules, calibrate_kv_cache  # needs transformers
        kv_scheme = KVScheme.parse(kv_cache)
        kv_calib = calib if kv_calib is None else kv_calib
        if not kv_scheme.dynamic and not kv_calib:
            raise ValueError(f"kv_cache={kv_cache!r} has static scales: pass kv_calib=[input-id tensors] to "
                             "calibrate them, or choose a dynamic scheme such as 'fp8-token'")
        if not attention_modules(model):
            raise ValueError(f"kv_cache={kv_cache!r}: {type(model).__name__} has no decoder attention modules that "
                             "keep a KV cache the way lowbit's quantized cache reads them (with layer_idx, k_proj "
                             "and v_proj: an encoder has none, and multi-head latent attention such as "
                             "DeepSeek-V3's projects K and V from a compressed latent); drop kv_cache")
    summary = _quantize_linears(model, recipe, ignore=o.ignore, overrides=o.overrides,
                                act_static_scales=o.act_static_scales, backend=o.backend, progress=o.progress,
                                share_inputs=o.share_inputs, method=o.method, calib=calib,
                                method_options=o.method_options, mse=o.mse, on_untouched=o.on_untouched,
                                min_fraction=o.min_untouched_fraction, lm_head=o.lm_head)
    if kv_scheme is not None:
        kv = calibrate_kv_cache(model, kv_calib or [], kv_scheme)
        attach_kv_cache(model, kv)
        summary.kv_cache = kv
    return summary


def _quantize_linears(model, recipe, *, ignore, overrides, act_static_scales, backend, progress, share_inputs,
                      method, calib, method_options, mse, on_untouched, min_fraction, lm_head=None) -> QuantSummary:
    if method not in ("rtn", "gptq"):
        raise ValueError(f"method={method!r}; choose 'rtn' (round to nearest) or 'gptq' (needs calib=batches)")
    if method == "gptq" and calib is None:
        raise ValueError("method='gptq' needs calibration inputs: pass calib=[input-id tensors or dicts]")
    experts = find_experts(model)       # raises on fused experts the map does not know
    linear_ignore, linear_over, found, exp_decisions, resolved = split_patterns(model, experts, recipe, ignore,
                                                                                 overrides)
    summary = plan(model, recipe, linear_ignore or None, linear_over or None, lm_head=lm_head)
    for r in resolved.values():                    # recipes that only experts overrides name
        if r != "skip" and summary.recipes.setdefault(r.name, r) != r:
            raise ValueError(f"two different recipes are both called {r.name!r}; give them distinct names")
    summary.experts = exp_decisions
    routers = keep_routers(model, found, summary)      # Linear routers / shared-expert gates
    skipped = {d.name: d.reason for d in summary.skipped + [e for e in exp_decisions if e.action == "skipped"]}
    planned = {d.name: d.recipe for d in summary.quantized + [e for e in exp_decisions if e.action == "quantized"]}
    check_coverage(coverage(model, skipped, tuple(routers), planned), min_fraction=min_fraction,
                   on_untouched=on_untouched)
    layers = linear_layers(model)
    tied = [d.name for d in summary.quantized if d.name in layers and tied_to_embedding(model, layers[d.name])]
    if method == "gptq":
        if lm_head is not None:
            raise NotImplementedError("lm_head with method='gptq': GPTQ calibrates the decoder layers only; quantize "
                                      "the LM head by round to nearest (method='rtn') or leave lm_head=None")
        gptq_model(model, summary, calib, act_static_scales=act_static_scales, progress=progress,
                   **{**(method_options or {}), **({"mse": True} if mse else {})})
        if share_inputs:
            _share(model)
        summary.coverage = coverage(model, skipped, tuple(routers))
        return summary
    todo = summary.quantized
    if progress:
        todo = progress_bar(todo, desc=f"quantize {summary.recipe}", unit="layer")
    new = {d.name: quantize_layer(d, summary, layers[d.name], act_static_scales, backend, mse) for d in todo}
    new_experts = build_experts(model, found, exp_decisions, summary.recipes, mse=mse)
    if act_static_scales is not None and new_experts:
        raise NotImplementedError("act_static_scales: static activation scales are not supported for MoE experts; "
                                  "use a dynamic recipe or ignore the experts")
    for name, q in new.items():                    # only now touch the model
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q.to(layers[name].weight.device))
    swap_in(model, new_experts)
    if tied:
        untie_embeddings(model, tied)
    if share_inputs:
        _share(model)
    summary.coverage = coverage(model, skipped, tuple(routers))
    return summary


def untie_embeddings(model: torch.nn.Module, names: list[str]) -> None:
    """Record that the output layers `names` no longer share the input embedding's weight (each
    was replaced by a QuantLinear): config.tie_word_embeddings (and the text config's) False and
    their entries dropped from transformers' tie map, so a later tie_weights() or a checkpoint
    reader does not put the embedding's float weight back into a quantized head."""
    cfg = getattr(model, "config", None)
    configs = [cfg] + ([cfg.get_text_config()] if hasattr(cfg, "get_text_config") else [])
    for c in configs:
        if c is not None and getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False
    for prefix, m in model.named_modules():  # transformers 5 caches the map it ties by
        keys = getattr(m, "all_tied_weights_keys", None)
        if isinstance(keys, dict):
            pre = prefix + "." if prefix else ""
            m.all_tied_weights_keys = {k: v for k, v in keys.items() if (pre + k)[: -len(".weight")] not in names}


def split_patterns(model, experts, recipe, ignore, overrides):
    """(Linear ignore, Linear overrides, experts found, experts decisions, resolved overrides): a
    pattern that matches experts modules and no Linear goes to the experts plan only (plan()
    refuses a pattern that matches no Linear, and still does for one that matches nothing at
    all). A plan passed as the recipe keeps its own experts decisions when it has them."""
    ignore, overrides = list(ignore or []), dict(overrides or {})
    linears = linear_layers(model)
    only_experts = {p for p in ignore + list(overrides)
                    if any(match(p, n) for n in experts) and not any(match(p, n) for n in linears)}
    base = recipe.recipes[recipe.recipe] if isinstance(recipe, QuantSummary) else get_recipe(recipe)
    resolved = {p: (r if r == "skip" else get_recipe(r)) for p, r in overrides.items()}
    found, decisions = plan_experts(model, base, ignore, resolved) if experts else ({}, [])
    if isinstance(recipe, QuantSummary) and recipe.experts:
        decisions = recipe.experts
    return ([p for p in ignore if p not in only_experts], {p: r for p, r in overrides.items() if p not in only_experts},
            found, decisions, resolved)
