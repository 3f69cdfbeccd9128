"""Which loader reads a compressed-tensors checkpoint, decided from what the checkpoint declares.

One part of a checkpoint ("dense": the Linear layers, "experts": MoE experts stored one Linear per
expert and projection) is described by its config group: the weights' and input activations'
QuantizationArgs (as config.json holds them) and the compression format. `why_not(loader, part,
weights, acts, fmt)` gives the reason a loader cannot read that part (None: it loads it), so
`lowbit quantize` (from the recipe it is about to write) and `lowbit inspect` (from a checkpoint's
config.json) apply the same rules. The test matrix (tests/pipelines/test_loaders.py) loads every
recipe x part in the pinned transformers and checks each "loads" and "does not load" against it.

Loaders:
- lowbit: `load_compressed` reads every scheme `args_to_scheme` reads.
- compressed-tensors 0.20: its compressors decompress every format lowbit writes, dense and
  experts (tests/pipelines/test_moe_checkpoint.py decompresses each expert exactly).
- transformers 5.24 with compressed-tensors 0.20 (the pinned pair): `from_pretrained(dir)`.
  Dense Linears go through compressed-tensors' own modules; experts through transformers'
  CompressedTensorsDequantize (integrations/compressed_tensors.py), which merges the per-expert
  tensors into its fused parameters.
- vLLM: a static rule table, not run here (vLLM is not installable on the CPU machine), read
  from vLLM's source: dense layers by CompressedTensorsConfig._get_scheme_from_parts
  (vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py), experts by
  CompressedTensorsMoEMethod.get_moe_method (.../compressed_tensors/compressed_tensors_moe/
  compressed_tensors_moe.py) and the methods it returns (compressed_tensors_moe_w8a8_int8.py reads
  int8 `weight` per expert; compressed_tensors_moe_wna16_marlin.py reads `weight_packed` with
  zero points for asymmetric weights; compressed_tensors_w4a4_nvfp4.py reads `input_global_scale`).
"""
from __future__ import annotations

import json

from lowbit.io.ct_layout import UnsupportedScheme, args_to_scheme, scheme_to_args
from lowbit.recipes.presets import RECIPES, Recipe

LOADERS = {
    "lowbit": "lowbit",
    "compressed-tensors": "compressed-tensors 0.20",
    "transformers": "transformers 5.24 (compressed-tensors 0.20)",
    "vllm": "vLLM",
}
PARTS = ("dense", "experts")

# compressed-tensors 0.20's compressor registry, for the formats a checkpoint may name
CT_FORMATS = ("dense", "naive-quantized", "int-quantized", "float-quantized", "pack-quantized",
              "mxfp4-pack-quantized", "nvfp4-pack-quantized", "mxfp8-quantized")
PACKED = ("pack-quantized", "mxfp4-pack-quantized", "nvfp4-pack-quantized")


def _strategy(a: dict) -> str:
    s = a.get("strategy")
    if s:
        return s
    g = a.get("group_size")
    return "tensor" if g is None else ("channel" if g == -1 else "group")


def _is(a: dict | None, typ: str, bits: int) -> bool:
    return a is not None and a.get("type", "int") == typ and a.get("num_bits") == bits


def _mx(a: dict) -> bool:
    return _is(a, "float", 8) and "uint8" in str(a.get("scale_dtype") or "")


def _nvfp4(a: dict | None) -> bool:
    return _is(a, "float", 4) and _strategy(a) == "tensor_group" and a.get("group_size") == 16


def _lowbit(weights: dict, acts: dict | None, fmt: str) -> str | None:
    try:
        args_to_scheme(weights)
        if acts is not None:
            args_to_scheme(acts)
    except (UnsupportedScheme, KeyError, ValueError) as e:
        return f"no lowbit scheme for it ({e})"
    return None


def _transformers(part: str, weights: dict, acts: dict | None, fmt: str) -> str | None:
    asym = not weights.get("symmetric", True)
    if part == "dense":
        if asym and fmt == "pack-quantized" and _strategy(weights) in ("group", "channel"):
            # compressed-tensors 0.20 compresses the empty model's zero point without packing it ([N, G],
            # not [N / 8, G]), so the packed one in the files is refused as a size mismatch
            return "compressed-tensors sizes the packed zero points unpacked (a loader bug)"
        return None
    # experts: transformers' CompressedTensorsDequantize
    if _mx(weights):
        return "multiplies the e8m0 scale codes as float scales (a loader bug)"
    if _is(weights, "float", 8):
        return None
    if fmt not in PACKED:
        return f"reads experts from weight_packed only, {fmt} stores weight (a loader bug)"
    if _nvfp4(weights):
        return "drops weight_global_scale (a loader bug)"
    if asym:
        return "drops weight_zero_point (a loader bug)"
    return None


def _vllm(part: str, weights: dict, acts: dict | None, fmt: str) -> str | None:
    strat = _strategy(weights)
    if _nvfp4(weights):
        if acts is not None and acts.get("dynamic") is True:
            # CompressedTensorsW4A4Fp4 (and the MoE method) read input_global_scale from the files;
            # lowbit's NVFP4 activations take their tensor scale per call and store none
            return "needs a calibrated input_global_scale, which dynamic NVFP4 activations lack"
        return None
    if _is(weights, "float", 4) and strat == "group" and weights.get("group_size") == 32:
        return None                                                     # MXFP4
    if _mx(weights) and strat == "group" and weights.get("group_size") == 32:
        return None                                                     # MXFP8
    if acts is None and weights.get("type", "int") == "int" and strat in ("group", "channel"):
        if fmt == "pack-quantized" and weights.get("num_bits") in (4, 8):
            return None                                                 # WNA16 (zero points included)
        return f"weight-only int experts/layers need pack-quantized 4- or 8-bit, not {fmt}"
    if _is(weights, "float", 8) and acts is None and part == "dense" and strat in ("tensor", "channel", "block"):
        return None                                                     # W8A16 FP8 (e.g. an fp8 LM head)
    if _is(weights, "float", 8) and _is(acts, "float", 8) and strat in ("tensor", "channel", "block"):
        if acts.get("dynamic") is True or _strategy(acts) == "tensor":
            return None                                                 # W8A8 FP8
    if _is(weights, "int", 8) and _is(acts, "int", 8) and strat in ("tensor", "channel"):
        act = _strategy(acts)
        if act == "token" and acts.get("dynamic") is True:
            return None                                                 # W8A8 int8, dynamic per token
        if part == "dense" and act == "tensor" and not acts.get("dynamic"):
            return None                                                 # static per-tensor int8
        return f"no int8 scheme for {'dynamic' if acts.get('dynamic') else 'static'} per-{act} activations"
    return "no compressed-tensors scheme in vLLM matches it"


def why_not(loader: str, part: str, weights: dict, acts: dict | None, fmt: str) -> str | None:
    """Why `loader` cannot load a checkpoint `part` ("dense" | "experts") of weights / input
    activations (compressed-tensors QuantizationArgs dicts) in compression format `fmt`; None: it can."""
    if part not in PARTS:
        raise ValueError(f"part={part!r}; choose one of {', '.join(PARTS)}")
    if loader == "lowbit":
        return _lowbit(weights, acts, fmt)
    if loader == "compressed-tensors":
        return None if fmt in CT_FORMATS else f"compressed-tensors 0.20 has no compressor for format {fmt!r}"
    if loader == "transformers":
        return _transformers(part, weights, acts, fmt)
    if loader == "vllm":
        return _vllm(part, weights, acts, fmt)
    raise ValueError(f"loader={loader!r}; choose one of {', '.join(LOADERS)}")


def note(loader: str, part: str, weights: dict, acts: dict | None) -> str | None:
    """A caveat for a part the loader does read (None: none)."""
    if loader != "transformers":
        return None
    if part == "experts":       # the fused experts are plain parameters: no activation quantizer runs
        return None if acts is None else "float activations"
    if weights.get("type") == "float" and (weights.get("num_bits") == 4 or _mx(weights)):
        return "in bf16"        # compressed-tensors decompresses fp4 and e8m0-scaled weights to bf16
    if _is(acts, "int", 8):     # calculate_qparams: symmetric scale = amax / ((qmax - qmin) / 2)
        return "int8 activations scaled by amax/127.5"
    return None


def recipe_form(r: Recipe) -> tuple[dict, dict | None, str]:
    """(weights args, activation args, format) a checkpoint of recipe `r` declares."""
    return scheme_to_args(r.weight), None if r.act is None else scheme_to_args(r.act), r.ct_format


def cell(loader: str, part: str, recipe: Recipe) -> tuple[bool, str | None]:
    """(loads, the reason it does not or the caveat it loads with) for one recipe x part x loader."""
    w, a, fmt = recipe_form(recipe)
    why = why_not(loader, part, w, a, fmt)
    return why is None, (note(loader, part, w, a) if why is None else why)


def recipes_that_load(loader: str, parts) -> list[str]:
    """The recipes whose checkpoint `loader` reads for every part in `parts`."""
    return [n for n, r in RECIPES.items() if all(cell(loader, p, r)[0] for p in parts)]


def loader_warnings(forms: dict[str, dict[str, set[str]]]) -> dict[str, str]:
    """{loader: one line} for each loader that cannot read a checkpoint, naming the recipes it would.

    forms: {part: {freeze(weights, acts, format): {names of the recipes or layers that have it}}}
    for the parts a checkpoint holds."""
    out = {}
    parts = [p for p in PARTS if forms.get(p)]
    for loader, title in LOADERS.items():
        fails = []
        for part in parts:
            for key, who in forms[part].items():
                why = why_not(loader, part, *json.loads(key))
                if why:
                    fails.append(f"{part} {', '.join(sorted(who)[:2])}{', ...' if len(who) > 2 else ''}: {why}")
            if loader == "transformers" and part == "experts" and len(forms[part]) > 1:
                fails.append("experts: it dequantizes every experts block by the first experts scheme")
        if fails:
            ok = recipes_that_load(loader, parts)
            alt = f"; recipes it loads here: {', '.join(ok)}" if ok else "; no lowbit recipe loads there"
            out[loader] = f"{title} cannot load this checkpoint ({'; '.join(fails)}){alt}"
    return out


def freeze(weights: dict, acts: dict | None, fmt: str) -> str:
    """A hashable key of one checkpoint form (config values may be lists or dicts): its JSON."""
    return json.dumps([weights, acts, fmt], sort_keys=True, default=str)


def plan_warnings(summary, experts_decisions) -> dict[str, str]:
    """`loader_warnings` for the checkpoint a plan will write: its quantized Linears (summary:
    QuantSummary) and its experts decisions (lowbit.pipelines.moe.ExpertsDecision: .action, .recipe)."""
    forms: dict = {}
    for part, r in [("dense", summary.recipe_of(d)) for d in summary.quantized] + \
            [("experts", summary.recipes.get(d.recipe) or RECIPES[d.recipe]) for d in experts_decisions
             if d.action == "quantized"]:
        add_form(forms, part, *recipe_form(r), r.name)
    return loader_warnings(forms)


def add_form(forms: dict, part: str, weights: dict, acts: dict | None, fmt: str, who: str) -> None:
    """Record that `who` (a recipe or layer name) stores `part` in this form."""
    forms.setdefault(part, {}).setdefault(freeze(weights, acts, fmt), set()).add(who)


def markdown_table(parts=PARTS) -> str:
    """The recipe x part x loader table of docs/checkpoints.md (both parts) and docs/moe.md (experts)."""
    rows = ["| recipe | part | " + " | ".join(LOADERS.values()) + " |", "|---|---|" + "---|" * len(LOADERS)]
    for name in RECIPES:
        for part in parts:
            cells = []
            for loader in LOADERS:
                ok, why = cell(loader, part, RECIPES[name])
                cells.append(("yes" if ok else "**no**") + (f": {why}" if why else ""))
            rows.append(f"| {name} | {part} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
