"""lowbit.nn: the runtime modules a quantized model runs (QuantLinear, QuantExperts, shared-input groups).

This package is also the public face of model quantization: the names below (quantize_model,
recipes, the per-site diagnosis, SmoothQuant, calibration, evaluation) are defined in
lowbit.pipelines, lowbit.recipes, lowbit.algorithms, lowbit.diagnosis and lowbit.evaluation and
resolve lazily, so `import lowbit.nn` pulls neither those layers nor transformers."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "QuantLinear": "lowbit.nn.quant_linear",
    "QuantExperts": "lowbit.nn.experts",
    "ExpertsOptions": "lowbit.nn.experts",
    "prepare_model": "lowbit.nn.shared_input",
    "share_inputs": "lowbit.nn.shared_input",
    "Recipe": "lowbit.recipes.presets",
    "RECIPES": "lowbit.recipes.presets",
    "get_recipe": "lowbit.recipes.presets",
    "quantize_model": "lowbit.pipelines.quantize_model",
    "QuantizeOptions": "lowbit.pipelines.quantize_model",
    "GPTQOptions": "lowbit.algorithms.gptq.options",
    "QuantSummary": "lowbit.recipes.plan",
    "site_report": "lowbit.diagnosis.sites",
    "smooth_model": "lowbit.algorithms.smoothquant",
    "perplexity": "lowbit.evaluation.evaluate",
    "embedding_cosine": "lowbit.evaluation.evaluate",
    "model_bytes": "lowbit.evaluation.evaluate",
    "calibrate_static_scales": "lowbit.algorithms.static_scales",
    "clipping_report": "lowbit.algorithms.static_scales",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lowbit.nn' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
