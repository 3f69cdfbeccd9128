"""quantize_model: replace a model's nn.Linear layers by QuantLinear under a recipe.

What stays in high precision by default (seed 004, "Where the quantize sites are"): everything
that is not a Linear (embeddings, norms, the residual stream, softmax) and `lm_head` (the
logits) or any Linear whose weight is tied to an embedding. Per-site control:
  ignore=[pattern, ...]            keep these Linears in high precision;
  overrides={pattern: recipe|"skip"} another recipe (or none) for the matching Linears.
A weight whose in_features the recipe's group size does not divide gets a short last group
(compressed-tensors' convention; the summary says so for each such layer).
Patterns are shell globs or `re:` regular expressions on module names; the decisions come from
lowbit.recipes.plan (one typed plan, made before anything changes).

The model is changed only after every layer has been quantized successfully: an error leaves
it untouched.
"""
from __future__ import annotations

import torch

from lowbit.nn.quant_linear import QuantLinear
from lowbit.recipes.plan import (DEFAULT_KEEP, LayerDecision, QuantSummary, layer_act, linear_layers,  # noqa: F401
                                 match, plan)
from lowbit.recipes.presets import Recipe

def quantize_layer(d: LayerDecision, summary: QuantSummary, linear: torch.nn.Linear,
                   act_static_scales: dict | None = None, backend: str = "auto", mse: bool = False) -> QuantLinear:
    """The round-to-nearest QuantLinear of one planned layer (its recipe, its static scale); mse:
    with the MSE-optimal weight scales of lowbit.algorithms.scale_search (unweighted: no calibration)."""
    r = summary.recipe_of(d)
    act, scale = layer_act(d, r, act_static_scales)
    try:
        scales = None
        if mse:
            from lowbit.algorithms.scale_search import search_scales
            scales = search_scales(linear.weight.detach(), r.weight)
        return QuantLinear.from_linear(linear, r.weight, act, act_static_scale=scale, backend=backend, pad=True,
                                       scales=scales)
    except (ValueError, NotImplementedError) as err:
        raise type(err)(f"layer {d.name} ({d.shape[0]}x{d.shape[1]}) under recipe {r.name}: {err}. "
                        f"Keep it in high precision with ignore=[{d.name!r}] or override it.") from err


@torch.no_grad()
def quantize_model(model: torch.nn.Module, recipe: str | Recipe, *, ignore=None, overrides=None,
                   act_static_scales: dict[str, torch.Tensor] | None = None, backend: str = "auto",
                   progress: bool = False, share_inputs: bool = True, method: str = "rtn", calib=None,
                   method_options: dict | None = None, mse: bool = False) -> QuantSummary:
    """Replace nn.Linear layers of `model` (in place) by QuantLinear under `recipe`; returns the
    QuantSummary. act_static_scales: {layer name: float32 scale} from
    calibration.calibrate_static_scales, to use one calibrated per-tensor activation scale per
    layer instead of dynamic scales (every quantized layer with activations needs one).
    share_inputs: merge the quantized layers that read one input (Llama's q/k/v, gate/up) so
    the fast path quantizes each activation once (lowbit.nn.shared_input).
    method: "rtn" (round to nearest) or "gptq" (lowbit.algorithms.gptq.core.gptq_model on `calib`, a list of
    input-id tensors [B, T] or dicts of model kwargs; method_options: its keyword arguments such
    as damp, act_order). mse: MSE-optimal weight scales (lowbit.algorithms.scale_search) instead of round to
    nearest's: unweighted for "rtn", weighted by each layer's Hessian diagonal for "gptq"."""
    if method != "rtn":
        if method != "gptq":
            raise ValueError(f"method={method!r}; choose 'rtn' (round to nearest) or 'gptq' (needs calib=batches)")
        if calib is None:
            raise ValueError("method='gptq' needs calibration inputs: pass calib=[input-id tensors or dicts]")
        from lowbit.algorithms.gptq.core import gptq_model
        summary = gptq_model(model, recipe, calib, ignore=ignore, overrides=overrides,
                             act_static_scales=act_static_scales, progress=progress,
                             **{**(method_options or {}), **({"mse": True} if mse else {})})
        if share_inputs:
            from lowbit.nn.shared_input import share_inputs as share
            share(model)
        return summary
    summary = plan(model, recipe, ignore, overrides)
    layers = linear_layers(model)
    todo = summary.quantized
    if progress:
        from tqdm import tqdm
        todo = tqdm(todo, desc=f"quantize {summary.recipe}", unit="layer")
    new = {d.name: quantize_layer(d, summary, layers[d.name], act_static_scales, backend, mse) for d in todo}
    for name, q in new.items():                    # only now touch the model
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q.to(layers[name].weight.device))
    if share_inputs:
        from lowbit.nn.shared_input import share_inputs as share
        share(model)
    return summary
