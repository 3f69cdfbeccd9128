"""Named quantization recipes: one weight scheme, one activation scheme (or None for
weight-only) and the compressed-tensors `format` a checkpoint of that recipe is written in.

The schemes are ordinary `QuantScheme`s; every number they imply (scales, codes) comes from
`lowbit.quantize`. Activation schemes are dynamic: their scales are measured on each forward
call (per token, per group/MX block, or once per call for the `-tensor` outlier lesson).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lowbit.scheme import QuantScheme, get_preset


@dataclass(frozen=True)
class Recipe:
    """A named pairing of weight and activation schemes.

    name:      the recipe's name (`lowbit quantize --recipe NAME`).
    weight:    scheme of the Linear weights [N, K] (scales along K).
    act:       scheme of the Linear inputs [..., K], or None (weights only, inputs stay float).
    ct_format: compressed-tensors `format` string for checkpoints of this recipe.
    description: one line for help texts and reports.
    """
    name: str
    weight: QuantScheme
    act: QuantScheme | None
    ct_format: str
    description: str = ""


def _dynamic(scheme: QuantScheme) -> QuantScheme:
    return dataclasses.replace(scheme, dynamic=True)


def _build() -> dict[str, Recipe]:
    int8_w = QuantScheme(format="int8", strategy="channel", symmetric=True)
    int8_tok = QuantScheme(format="int8", strategy="token", symmetric=True, dynamic=True)
    int8_tensor = QuantScheme(format="int8", strategy="tensor", symmetric=True, dynamic=True)
    fp8_w = QuantScheme(format="fp8_e4m3fn", strategy="channel", symmetric=True)
    fp8_tok = QuantScheme(format="fp8_e4m3fn", strategy="token", symmetric=True, dynamic=True)
    int4_g128 = QuantScheme(format="int4", strategy="group", group_size=128, symmetric=True)
    int4_g128_asym = QuantScheme(format="int4", strategy="group", group_size=128, symmetric=False)
    int4_g32 = QuantScheme(format="int4", strategy="group", group_size=32, symmetric=True)
    recipes = [
        Recipe("w8a8-int8", int8_w, int8_tok, "int-quantized",
               "int8 weights per output channel, int8 activations per token (dynamic)"),
        Recipe("w8a8-int8-tensor", int8_w, int8_tensor, "int-quantized",
               "int8 weights per channel, ONE int8 activation scale per tensor (the outlier lesson)"),
        Recipe("w8a8-fp8", fp8_w, fp8_tok, "float-quantized",
               "fp8 e4m3 weights per output channel, fp8 e4m3 activations per token (dynamic)"),
        Recipe("w8a16-int8", int8_w, None, "pack-quantized",
               "int8 weights per output channel, activations stay in high precision"),
        Recipe("w4a16", int4_g128, None, "pack-quantized",
               "int4 weights, symmetric, one scale per group of 128; activations in high precision"),
        Recipe("w4a16-asym", int4_g128_asym, None, "pack-quantized",
               "int4 weights, asymmetric (scale + zero point) per group of 128"),
        Recipe("w4a16-g32", int4_g32, None, "pack-quantized",
               "int4 weights, symmetric, one scale per group of 32"),
        Recipe("mxfp8", get_preset("mxfp8"), _dynamic(get_preset("mxfp8")), "mxfp8-quantized",
               "MXFP8: fp8 e4m3 elements, one e8m0 scale per 32, weights and activations"),
        Recipe("mxfp4", get_preset("mxfp4"), _dynamic(get_preset("mxfp4")), "mxfp4-pack-quantized",
               "MXFP4: fp4 e2m1 elements, one e8m0 scale per 32, weights and activations"),
        Recipe("nvfp4", get_preset("nvfp4"), _dynamic(get_preset("nvfp4")), "nvfp4-pack-quantized",
               "NVFP4: fp4 e2m1 elements, fp8 e4m3 scale per 16 times a per-tensor fp32 scale"),
    ]
    return {r.name: r for r in recipes}


RECIPES: dict[str, Recipe] = _build()

# The opt-in quantized LM head (`quantize_model(..., lm_head=KIND)`, `lowbit quantize --lm-head KIND`):
# weight-only, so the logits' inputs stay exact; at a 128k vocabulary the head is about a fifth
# of a 4-bit model's decode bytes. Not in RECIPES: these name what the head gets, not a model recipe.
LM_HEAD: dict[str, Recipe] = {
    "int8": RECIPES["w8a16-int8"],
    "fp8": Recipe("w8a16-fp8", QuantScheme(format="fp8_e4m3fn", strategy="channel", symmetric=True), None,
                  "naive-quantized", "fp8 e4m3 weights per output channel, activations stay in high precision"),
    "w4a16": RECIPES["w4a16"],
}


def get_lm_head_recipe(kind: str | Recipe) -> Recipe:
    """The weight-only recipe of the LM head option `kind` ("int8", "fp8", "w4a16"; a Recipe
    passes through); ValueError naming the choices otherwise."""
    if isinstance(kind, Recipe):
        return kind
    key = kind.strip().lower() if isinstance(kind, str) else kind
    if key not in LM_HEAD:
        raise ValueError(f"lm_head={kind!r}; choose one of {', '.join(LM_HEAD)} (weight-only, per output channel "
                         "for int8 / fp8, int4 groups of 128 for w4a16), or None to keep it in high precision")
    return LM_HEAD[key]


def get_recipe(name: str | Recipe) -> Recipe:
    """The recipe called `name`, in any letter case (`W4A16` as llm-compressor writes it; a
    Recipe passes through). Unknown names raise ValueError listing the known ones."""
    if isinstance(name, Recipe):
        return name
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in RECIPES:
        raise ValueError(f"recipe={name!r} is not a lowbit recipe; choose one of: {', '.join(RECIPES)}")
    return RECIPES[key]
