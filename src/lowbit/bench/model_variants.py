"""The variants `lowbit bench model` runs, parsed once from their names.

A name is a lowbit recipe, optionally followed by suffixes in any order, or one of torchao's configs:
  RECIPE+lm_head=KIND   the recipe with quantize_model's quantized LM head (KIND int8 / fp8 / w4a16)
  RECIPE+native         the recipe's layers prepared with lowbit's native sm_90a decode kernels opted in
                        (lowbit.ops.kernels.native.opted_in), for recipes a native class covers
  torchao-int4 / torchao-int8wo / torchao-int8 / torchao-fp8-row
Names are lower-cased first (W4A16 as llm-compressor writes it).
"""
from __future__ import annotations

from dataclasses import dataclass

from lowbit.ops.kernels.native import covering
from lowbit.recipes.presets import LM_HEAD, RECIPES
from lowbit.workflows.job import parse_recipe

TORCHAO = ("torchao-int4", "torchao-int8wo", "torchao-int8", "torchao-fp8-row")
NATIVE = "native"
FORMS = "RECIPE, RECIPE+lm_head=KIND and RECIPE+native (suffixes in either order)"


@dataclass(frozen=True)
class Variant:
    """One parsed variant name: `recipe` (a lowbit recipe or a torchao config name), `lm_head` (None:
    the LM head stays in high precision) and `native` (the native decode kernels opted in)."""
    name: str
    recipe: str
    lm_head: str | None = None
    native: bool = False

    @property
    def torchao(self) -> bool:
        return self.recipe in TORCHAO


def parse_variant(name: str) -> Variant:
    """The Variant of one name; ValueError naming the name and the forms for a malformed suffix
    (an unknown recipe or KIND is check_variants' question)."""
    name = name.strip().lower()
    base, *suffixes = name.split("+")
    head, native = None, False
    for s in suffixes:
        key, eq, kind = s.partition("=")
        if s == NATIVE and not native:
            native = True
        elif key == "lm_head" and eq and head is None:
            head = kind
        else:
            raise ValueError(f"recipes={name}: {s!r} is not a suffix (or is given twice); write {FORMS}, "
                             f"KIND one of {', '.join(LM_HEAD)}")
    return Variant(name, base, head, native)


def native_recipes() -> list[str]:
    """The lowbit recipes whose layers a native decode class takes (the ones `+native` accepts)."""
    return [n for n, r in RECIPES.items() if covering(r.weight, r.act)]


def native_kernel_names(recipe: str) -> set[str]:
    """The names of the native decode classes that take a lowbit recipe's layers (empty: none)."""
    r = parse_recipe(recipe)
    return {cls.name for cls in covering(r.weight, r.act)}


def all_variants() -> list[str]:
    return list(RECIPES) + list(TORCHAO)


def check_variants(names: tuple[str, ...], moe: bool = False) -> tuple[Variant, ...]:
    """The variants to run (all when `names` is empty), parsed; a MoE model runs lowbit recipes only
    (torchao's configs quantize nn.Linear layers, not fused experts). ValueError naming every bad name
    and what to choose from."""
    known = [v for v in all_variants() if not (moe and v in TORCHAO)]
    variants = [parse_variant(n) for n in names] or [parse_variant(n) for n in known]
    bad = [v.name for v in variants if v.recipe not in known or (v.torchao and (v.lm_head or v.native))
           or (v.lm_head is not None and v.lm_head not in LM_HEAD)]
    if bad:
        raise ValueError(f"recipes={','.join(bad)} not known{' for a MoE shape' if moe else ''}; choose from: "
                         f"{', '.join(known)} (a lowbit recipe may add +lm_head=KIND, KIND one of "
                         f"{', '.join(LM_HEAD)}, and +native)")
    uncovered = [v.name for v in variants if v.native and v.recipe not in native_recipes()]
    if uncovered:
        raise ValueError(f"recipes={','.join(uncovered)}: no native decode kernel takes that recipe's layers; "
                         f"+native works with {', '.join(native_recipes())}")
    return tuple(variants)
