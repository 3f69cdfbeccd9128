"""The plan: what a recipe does to each Linear of a model, decided once and before anything changes.

`plan(model, recipe, ignore, overrides)` resolves a recipe (a name or a Recipe), the user's ignore
patterns and per-site overrides into a QuantSummary: one LayerDecision per Linear, with the Recipe
object each quantized layer uses. Every pipeline consumes this typed plan; none re-resolves names.

Patterns are shell globs on module names (`model.layers.*.mlp.down_proj`) or, with a `re:`
prefix, regular expressions (compressed-tensors' convention). A user pattern that matches no
Linear is an error, as is a layer matched by two overrides that disagree.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch

from lowbit.quantize import static_scheme
from lowbit.recipes.presets import Recipe, get_lm_head_recipe, get_recipe

# Linears kept in high precision unless an override names them: the logits.
DEFAULT_KEEP = ("lm_head", "*.lm_head")


@dataclass
class LayerDecision:
    """What quantize_model did with one Linear: action "quantized" or "skipped", and why."""
    name: str
    shape: tuple[int, int]          # (out_features, in_features)
    action: str
    recipe: str | None
    reason: str


@dataclass
class QuantSummary:
    """Per-layer decisions of one quantize_model call."""
    recipe: str
    layers: list[LayerDecision] = field(default_factory=list)
    recipes: dict[str, Recipe] = field(default_factory=dict, repr=False)   # name -> Recipe used
    method: str = "rtn"             # how the weights' codes were chosen: "rtn" | "gptq"
    kv_cache: object = None         # lowbit.nn.kv_cache.KVCacheQuant when the KV cache is quantized too
    experts: list = field(default_factory=list)   # MoE experts modules (lowbit.pipelines.moe.ExpertsDecision)
    coverage: object = None         # lowbit.pipelines.coverage.Coverage of the quantized model, when made

    def recipe_of(self, d: LayerDecision) -> Recipe:
        """The Recipe object a quantized layer's decision names (custom Recipes included)."""
        return self.recipes[d.recipe]

    @property
    def quantized(self) -> list[LayerDecision]:
        return [d for d in self.layers if d.action == "quantized"]

    @property
    def skipped(self) -> list[LayerDecision]:
        return [d for d in self.layers if d.action == "skipped"]

    def counts(self) -> dict[str, int]:
        """Number of Linears per recipe (quantized) plus "skipped"."""
        out: dict[str, int] = {}
        for d in self.layers:
            key = d.recipe if d.action == "quantized" else "skipped"
            out[key] = out.get(key, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [f"recipe {self.recipe}{'' if self.method == 'rtn' else ' (' + self.method + ')'}: {len(self.quantized)} of {len(self.layers)} Linear layers quantized "
                 f"({', '.join(f'{k}: {v}' for k, v in self.counts().items())})"]
        if self.kv_cache is not None:
            lines.append(f"  KV cache: {self.kv_cache.scheme} "
                         f"({'dynamic scales' if self.kv_cache.scheme.dynamic else 'calibrated static scales'})")
        for d in self.layers:
            if d.action == "skipped" or d.recipe != self.recipe:
                lines.append(f"  {d.name} {d.shape[0]}x{d.shape[1]}: {d.action}"
                             f"{'' if d.recipe is None else ' as ' + d.recipe} ({d.reason})")
        if self.experts:
            done = [e for e in self.experts if e.action == "quantized"]
            lines.append(f"MoE: {len(done)} of {len(self.experts)} experts modules quantized "
                         f"({self.experts[0].family}, E x 2I x H = {'x'.join(map(str, self.experts[0].shape))})")
            for e in self.experts:
                if e.action == "skipped" or e.recipe != self.recipe:
                    lines.append(f"  {e.name}: {e.action}{'' if e.recipe is None else ' as ' + e.recipe} ({e.reason})")
                if getattr(e, "calibration", None) is not None:    # GPTQ per expert: the few-token rule's list
                    lines.append(f"  {e.calibration}")
        if self.coverage is not None:
            lines.append(str(self.coverage))
        return "\n".join(lines)


def match(pattern: str, name: str) -> bool:
    """Whether a module name matches a glob or `re:` pattern (full match)."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def check_patterns(patterns, names) -> None:
    """Every user pattern must match some Linear name: a pattern matching nothing is a typo."""
    names = list(names)
    for p in patterns:
        if not any(match(p, n) for n in names):
            near = ", ".join(sorted(names)[:3])
            raise ValueError(f"pattern {p!r} matches no Linear layer (names look like: {near}, ...); "
                             "fix the pattern (globs: *, re: prefix for regex) or drop it")


def by_patterns(name: str, ignore, overrides: dict, what: str = "layer") -> tuple[str, str | None, str] | None:
    """(action, recipe name or None, reason) that the user's patterns decide for module `name`, or
    None when no pattern names it. An ignore pattern wins; overrides {pattern: Recipe | "skip"}
    that match and disagree are an error. Linears and MoE experts are decided by this one rule."""
    hit = [p for p in ignore if match(p, name)]
    if hit:
        return "skipped", None, f"ignore pattern {hit[0]!r}"
    ov = {p: r for p, r in overrides.items() if match(p, name)}
    choices = {r if r == "skip" else r.name for r in ov.values()}
    if len(choices) > 1:
        raise ValueError(f"{what} {name} matches overrides {list(ov)} that disagree ({sorted(choices)}); "
                         "make the patterns disjoint")
    if not ov:
        return None
    p, r = next(iter(ov.items()))
    return ("skipped", None, f"override {p!r} -> skip") if r == "skip" else ("quantized", r.name, f"override {p!r}")


def kept_by_default(name: str) -> bool:
    """Whether a Linear stays in high precision unless an override names it (the logits)."""
    return any(match(p, name) for p in DEFAULT_KEEP)


def linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """name -> nn.Linear (QuantLinears already in the model are not listed)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def tied_to_embedding(model: torch.nn.Module, linear: torch.nn.Linear) -> bool:
    """Whether `linear`'s weight is an embedding's weight (tied input and output embeddings)."""
    if linear.weight.is_meta:       # a skeleton (lowbit.pipelines.layerwise): no storage, ties are shared Parameters
        return any(isinstance(m, torch.nn.Embedding) and m.weight is linear.weight for m in model.modules())
    ptr = linear.weight.data_ptr()
    return any(isinstance(m, torch.nn.Embedding) and m.weight.data_ptr() == ptr for m in model.modules())


def plan(model: torch.nn.Module, recipe: str | Recipe, ignore=None, overrides=None,
         lm_head: str | Recipe | None = None) -> QuantSummary:
    """Decide, without changing the model, what quantize_model would do with every Linear.
    recipe: a name, a Recipe, or a QuantSummary made by an earlier plan() of this model, which is
    returned as it is (checked against the model's Linears), so a pipeline resolves it once.
    lm_head: None (the LM head stays in high precision) or "int8" / "fp8" / "w4a16" (a Recipe):
    the weight-only recipe the LM head is quantized with, tied to the embedding or not (the
    embedding keeps its own weight: quantize_model unties them). An ignore / override pattern
    naming the head still wins."""
    if isinstance(recipe, QuantSummary):
        if ignore or overrides or lm_head is not None:
            raise ValueError("recipe is already a plan (QuantSummary) with its own ignore / overrides: "
                             "give them to the plan() call that made it")
        names = set(linear_layers(model)) | {d.name for d in recipe.quantized if _is_quant_linear(model, d.name)}
        planned = {d.name for d in recipe.layers}
        if planned != names:
            raise ValueError(f"the plan (QuantSummary of recipe {recipe.recipe}) was made for another model: "
                             f"{len(planned ^ names)} Linear names differ (e.g. {sorted(planned ^ names)[:3]}); "
                             "call plan() on this model")
        return recipe
    base = get_recipe(recipe)
    ignore = list(ignore or [])
    overrides = {p: (r if r == "skip" else get_recipe(r)) for p, r in (overrides or {}).items()}
    layers = linear_layers(model)
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) has no torch.nn.Linear layers: nothing to quantize")
    check_patterns(ignore + list(overrides), list(layers))
    summary = QuantSummary(base.name, recipes={base.name: base})
    head = None if lm_head is None else get_lm_head_recipe(lm_head)
    if head is not None:
        if not any(kept_by_default(n) for n in layers):
            raise ValueError(f"lm_head={lm_head!r}: {type(model).__name__} has no Linear named lm_head; drop lm_head "
                             "(or name the output layer with overrides={pattern: recipe})")
        if summary.recipes.setdefault(head.name, head) != head:
            raise ValueError(f"lm_head recipe {head.name!r} clashes with another recipe of that name; rename one")
    for r in overrides.values():
        if r != "skip":
            if summary.recipes.setdefault(r.name, r) != r:
                raise ValueError(f"two different recipes are both called {r.name!r}; give them distinct names")
    for name, lin in layers.items():
        shape = (lin.out_features, lin.in_features)
        by_user = by_patterns(name, ignore, overrides, "layer")
        if by_user is not None:
            summary.layers.append(LayerDecision(name, shape, *by_user))
            continue
        if kept_by_default(name) and head is not None:
            why = "lm_head option" + ("; untied from the embedding, which keeps its weight"
                                      if tied_to_embedding(model, lin) else "")
            summary.layers.append(LayerDecision(name, shape, "quantized", head.name, why))
        elif kept_by_default(name):
            summary.layers.append(LayerDecision(name, shape, "skipped", None, "logits (lm_head) stay high precision"))
        elif tied_to_embedding(model, lin):
            summary.layers.append(LayerDecision(name, shape, "skipped", None, "weight tied to an embedding"))
        else:
            summary.layers.append(LayerDecision(name, shape, "quantized", base.name, "recipe"))
    for d in summary.quantized:
        w = summary.recipe_of(d).weight
        g = w.group_size if w.strategy == "group" else None
        if g and d.shape[1] % g:
            d.reason += f"; in_features {d.shape[1]} % group {g} = {d.shape[1] % g}: last weight group is short"
    return summary


def layer_act(d: LayerDecision, r: Recipe, act_static_scales: dict | None):
    """(activation scheme, static scale or None) of one quantized layer: the recipe's dynamic
    scheme, or its per-tensor static twin with the layer's calibrated scale."""
    if act_static_scales is None or r.act is None:
        return r.act, None
    if d.name not in act_static_scales:
        raise ValueError(f"act_static_scales has no scale for layer {d.name}: calibrate every quantized layer")
    return static_scheme(r.act), act_static_scales[d.name]


def _is_quant_linear(model: torch.nn.Module, name: str) -> bool:
    """Whether `name` is a Linear the plan already replaced (a QuantLinear is no nn.Linear)."""
    try:
        mod = model.get_submodule(name)
    except AttributeError:
        return False
    return not isinstance(mod, torch.nn.Linear) and hasattr(mod, "weight_q")
