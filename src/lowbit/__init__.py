"""lowbit: low-precision quantization whose numbers can be trusted.

Public API (kept stable; outside tests call it):

    import lowbit as lb
    fmt = lb.get_format("fp8_e4m3fn")
    codes = lb.encode(x, fmt, saturate=True); y = lb.decode(codes, fmt)
    scheme = lb.QuantScheme(format="int8", strategy="channel")
    qt = lb.quantize(x, scheme); qt.dequantize()
    lb.pack_int4 / lb.unpack_int4 / lb.pack_scales / lb.unpack_scales
    lb.verify.check_linear(out, x, w, x_scheme=..., w_scheme=...)
    job = lb.QuantizeJob.build("w8a8-int8", [SmoothQuant(0.5)]); lb.quantize_job(loaded, texts, job)
    s = lb.QuantizeSession.load("smollm2"); s.prepare(lb.TextOptions()); s.write(s.quantize(job), "out")

Names are resolved lazily so that `import lowbit` stays cheap and a part under
construction cannot break the others.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Format": "lowbit.formats",
    "get_format": "lowbit.formats",
    "list_formats": "lowbit.formats",
    "encode": "lowbit.formats",
    "decode": "lowbit.formats",
    "QuantScheme": "lowbit.scheme",
    "get_preset": "lowbit.scheme",
    "PRESETS": "lowbit.scheme",
    "QTensor": "lowbit.quantize",
    "quantize": "lowbit.quantize",
    "dequantize": "lowbit.quantize",
    "pack_int4": "lowbit.packing",
    "unpack_int4": "lowbit.packing",
    "pack_fp6": "lowbit.packing",
    "unpack_fp6": "lowbit.packing",
    "pack_scales": "lowbit.packing",
    "unpack_scales": "lowbit.packing",
    "prune_2_4": "lowbit.sparsity",
    "compress_2_4": "lowbit.sparsity",
    "decompress_2_4": "lowbit.sparsity",
    "save_qtensors": "lowbit.io.qtensor_file",
    "load_qtensors": "lowbit.io.qtensor_file",
    "save_compressed": "lowbit.pipelines.checkpoint",
    "load_compressed": "lowbit.pipelines.checkpoint",
    "quantize_checkpoint": "lowbit.pipelines.tensorwise",
    "QuantizeJob": "lowbit.workflows.job",
    "quantize_job": "lowbit.workflows.quantize",
    "best_steps": "lowbit.workflows.job",
    "QuantizeSession": "lowbit.workflows.session",
    "TextOptions": "lowbit.workflows.session",
}
_SUBMODULES = {"formats", "scheme", "quantize", "packing", "sparsity", "profiling", "ops", "verify", "nn", "io",
               "recipes", "algorithms", "pipelines", "diagnosis", "evaluation", "experiments", "bench",
               "entrypoints", "workflows"}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"lowbit.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
