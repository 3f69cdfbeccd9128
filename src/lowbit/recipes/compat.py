"""Whether a recipe's checkpoint can be written for a model's Linear shapes, decided from the
shapes alone (config.json, or a plan of the loaded model) before any calibration work.

compressed-tensors stores a grouped weight [N, K] as K / group scales per row: K must be a
multiple of the group (lowbit quantizes a short last group, but no checkpoint format holds
one). The refusal names a recipe that fits ("use w4a16-g32: 576 is a multiple of 32")."""
from __future__ import annotations

from lowbit.recipes.plan import QuantSummary
from lowbit.recipes.presets import RECIPES, Recipe, get_recipe


def stored_group(recipe: Recipe) -> int | None:
    """The group K must be a multiple of for the recipe's weights to be stored (None: any K)."""
    w = recipe.weight
    return w.group_size if w.strategy == "group" and w.group_size else None


def _fits(recipe: Recipe, ks) -> bool:
    g = stored_group(recipe)
    return g is None or all(k % g == 0 for k in ks)


def alternative(recipe: Recipe, ks) -> Recipe | None:
    """A recipe like `recipe` (same weight format, symmetry and activation scheme) whose groups
    divide every K; else one with the same weight format; else None."""
    same = [r for r in RECIPES.values() if r.weight.format == recipe.weight.format and r.act == recipe.act
            and r.weight.symmetric == recipe.weight.symmetric]
    near = [r for r in RECIPES.values() if r.weight.format == recipe.weight.format]
    for r in same + near:
        if r.name != recipe.name and _fits(r, ks):
            return r
    return None


def refusal(recipe: Recipe | str, layers: dict[str, int], no_save: bool = True) -> str | None:
    """Why `recipe` cannot be stored for layers {name or pattern: K}, with the fix; None if it can.
    no_save: whether evaluating without saving is a way out to name (not for a path that only writes)."""
    r = get_recipe(recipe)
    g = stored_group(r)
    if g is None:
        return None
    bad: dict[int, list[str]] = {}
    for name, k in layers.items():
        if k % g:
            bad.setdefault(k, []).append(name)
    if not bad:
        return None
    ks = sorted(set(layers.values()))
    alt = alternative(r, ks)
    where = "; ".join(f"K = {k} ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"
                      for k, names in sorted(bad.items()))
    fix = (f"use {alt.name}: {' and '.join(str(k) for k in ks)} "
           f"{'is a multiple' if len(ks) == 1 else 'are multiples'} of {stored_group(alt) or 'any group'}, "
           if alt else "")
    return (f"recipe {r.name} groups K by {g}, but {where} is not a multiple of {g}, so no checkpoint can "
            f"store it: {fix}keep those layers in high precision (--ignore)"
            + (", or evaluate without saving (--no-save)" if no_save else ""))


def plan_refusal(summary: QuantSummary, extra: list[str] = ()) -> str | None:
    """refusal() for every recipe of a plan, on the layers it quantizes, and for each recipe of
    `extra` (e.g. --override-to, which may land on any quantized layer)."""
    by_recipe: dict[str, dict[str, int]] = {}
    objs: dict[str, Recipe] = {}      # the Recipe objects: a plan's may be custom (e.g. the LM head's)
    for d in summary.quantized:
        r = objs.setdefault(summary.recipe_of(d).name, summary.recipe_of(d))
        by_recipe.setdefault(r.name, {})[d.name] = d.shape[1]
    every = {d.name: d.shape[1] for d in summary.quantized}
    for name in extra:
        r = objs.setdefault(get_recipe(name).name, get_recipe(name))
        by_recipe.setdefault(r.name, {}).update(every)
    for name, layers in by_recipe.items():
        why = refusal(objs[name], layers)
        if why:
            return why
    return None


# The embedded models' config values that set their Linears' K (lowbit.evaluation.embedded).
EMBEDDED_CONFIGS = {"smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                                "head_dim": 64},
                    "minilm": {"hidden_size": 384, "intermediate_size": 1536, "num_attention_heads": 12}}


def config_head_dim(cfg: dict) -> int | None:
    """A Hugging Face config's attention head_dim: its own entry, else hidden_size /
    num_attention_heads; None when the config says neither."""
    h, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    hd = cfg.get("head_dim") or (h // heads if isinstance(h, int) and isinstance(heads, int) and heads else None)
    return hd if isinstance(hd, int) else None


def config_in_features(cfg: dict) -> dict[str, int]:
    """{which Linears: K} that a Hugging Face config.json implies for a decoder or encoder:
    the layers reading the hidden state, the MLP's down projection, the attention output.
    Keys missing from the config are left out (the exact check after loading covers them)."""
    out = {}
    h = cfg.get("hidden_size")
    if isinstance(h, int):
        out["the Linears reading the hidden state (hidden_size)"] = h
    for key in ("intermediate_size", "moe_intermediate_size"):
        if isinstance(cfg.get(key), int):
            out[f"the MLP down projection ({key})"] = cfg[key]
    heads, hd = cfg.get("num_attention_heads"), config_head_dim(cfg)
    if isinstance(heads, int) and hd is not None:
        out["the attention output (num_attention_heads x head_dim)"] = heads * hd
    return out
