"""lowbit.nn: quantize real models. QuantLinear, named recipes, quantize_model, the per-site
SQNR diagnosis, SmoothQuant, static-scale calibration, evaluation and the embedded model/data.

Names resolve lazily so that `import lowbit.nn` does not pull transformers or matplotlib."""
from __future__ import annotations

import importlib

# The function shares its module's name: bind it now, or importing the submodule later would
# leave `lowbit.nn.quantize_model` pointing at the module instead of the function.
from lowbit.nn.quantize_model import QuantSummary, quantize_model  # noqa: E402,F401

_EXPORTS = {
    "QuantLinear": "lowbit.nn.quant_linear",
    "prepare_model": "lowbit.nn.shared_input",
    "share_inputs": "lowbit.nn.shared_input",
    "Recipe": "lowbit.nn.recipes",
    "RECIPES": "lowbit.nn.recipes",
    "get_recipe": "lowbit.nn.recipes",
    "quantize_model": "lowbit.nn.quantize_model",
    "QuantSummary": "lowbit.nn.quantize_model",
    "site_report": "lowbit.nn.sites",
    "smooth_model": "lowbit.nn.smoothquant",
    "perplexity": "lowbit.nn.evaluate",
    "embedding_cosine": "lowbit.nn.evaluate",
    "model_bytes": "lowbit.nn.evaluate",
    "calibrate_static_scales": "lowbit.nn.calibration",
    "clipping_report": "lowbit.nn.calibration",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lowbit.nn' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
