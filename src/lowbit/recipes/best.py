"""The best measured combination of measures per recipe: what `lowbit quantize` applies when no
measure flag is given (`--plain` for round-to-nearest alone). Every entry cites the measurement in
docs/perplexity.md (SmolLM2-135M, 8,192 Wikipedia tokens) that made it the choice; recipes without
a measured improvement within the override budget (<= 5% of Linears kept in bf16) stay plain."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Best:
    """Measures for one recipe (keyword arguments of lowbit.entrypoints.quantize_job.run_recipe) and why. calib_tokens:
    the calibration tokens the measurement used, when `lowbit quantize`'s default (1,024) is not
    what was measured; the CLI uses them unless --calib-tokens is given."""
    options: dict
    why: str
    calib_tokens: int | None = None


BEST: dict[str, Best] = {
    "w8a8-int8": Best({"smoothquant": 0.5, "override_worst": 0.05},
                      "SmoothQuant 0.5 + the 10 worst sites (4.8% of Linears) in bf16: +0.75% perplexity "
                      "(KL 0.0093) on 8,192 tokens vs +2.80% plain (docs/perplexity.md)"),
    "w8a8-fp8": Best({"method": "gptq", "override_worst": 0.05, "override_by": "kl"},
                     "GPTQ on the fp8 weights + the 10 sites (4.8% of Linears) whose bf16 lowers the measured "
                     "next-token KL most, 2,048 calibration tokens: +0.88% perplexity (KL 0.0192, top-1 93.38%) on "
                     "8,192 tokens vs +1.09% (KL 0.0190) with the 10 worst "
                     "sites by block SQNR, +1.07% (KL 0.0185) with those on 4,096 calibration tokens"
                     ", +1.92% for the sites alone and +2.83% plain; the rows differ by less than the "
                     "evaluation's standard error (~0.25 points) and the KL pick costs ~11 minutes of calibration "
                     "on 2 cores against ~2.5 (docs/perplexity.md)",
                     calib_tokens=2048),
    "w4a16-g32": Best({"awq": True, "method": "gptq"},
                      "AWQ scales folded, then GPTQ (damp 0.1, act-order, held-out check), 2,048 calibration "
                      "tokens: +18.42% perplexity (KL 0.174, top-1 80.30%) vs "
                      "+19.12% (KL 0.192) for GPTQ on MSE-optimal scales, +23.01% (KL 0.291) for GPTQ alone and "
                      "+40.20% round to nearest (docs/perplexity.md)",
                      calib_tokens=2048),
    "w4a16": Best({"method": "gptq", "mse": True},
                  "GPTQ (damp 0.1, act-order, held-out check) on MSE-optimal group scales (weighted by the "
                  "Hessian diagonal), 2,048 calibration tokens: +30.28% perplexity (KL 0.282) vs +38.01% for "
                  "GPTQ alone and +72.47% round to nearest (docs/perplexity.md)",
                  calib_tokens=2048),
    "nvfp4": Best({"smoothquant": 0.5, "method": "gptq", "override_worst": 0.05},
                  "SmoothQuant 0.5 + GPTQ on the NVFP4 weights + the 10 worst sites by block SQNR (4.8% of "
                  "Linears) in bf16: +23.57% perplexity (KL 0.2349, top-1 77.83%) on 8,192 tokens vs +29.58% "
                  "(KL 0.2798) without GPTQ and +55.93% plain (docs/perplexity.md)"),
    "mxfp4": Best({"smoothquant": 0.5, "override_worst": 0.05},
                  "SmoothQuant 0.5 + the 10 worst sites (4.8% of Linears) in bf16: +122.17% perplexity "
                  "vs +387.04% plain (docs/perplexity.md)"),
    "mxfp8": Best({"override_worst": 0.05},
                  "the 10 worst sites (4.8% of Linears) in bf16: +3.95% vs +7.83% plain (docs/perplexity.md)"),
    "w8a8-int8-tensor": Best({"smoothquant": 0.5, "override_worst": 0.05},
                             "SmoothQuant 0.5 + the 10 worst sites (4.8% of Linears) in bf16: +5.39% vs +108.61% "
                             "plain (docs/perplexity.md)"),
    "w4a16-asym": Best({"override_worst": 0.05},
                       "the 10 worst sites (4.8% of Linears) in bf16: +25.91% vs +33.16% plain (docs/perplexity.md)"),
}


def best_options(recipe: str) -> Best | None:
    """The measured best measures for `recipe`, or None (plain round-to-nearest)."""
    return BEST.get(recipe)
