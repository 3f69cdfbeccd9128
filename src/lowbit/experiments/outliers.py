"""`lowbit experiment outliers`: per-site SQNR of activations with outlier channels, per scale policy.

x [16, 4096] ~ N(0, 1) with (or without) channel 7 scaled 40x (a systematic outlier channel),
w [1024, 4096] ~ 0.02 N(0, 1) quantized int8 per output channel; x quantized int8 per tensor or
per token, and per token after SmoothQuant smoothing (x / s, w * s with
s_j = max|x_j|^0.5 / max|w_j|^0.5, lowbit.algorithms.smoothquant.smoothing_factors). SQNR in dB of the
quantized linear (lowbit's exact reference) against x @ w.T in float64.
"""
from __future__ import annotations

import torch

import lowbit as lb
from lowbit.algorithms.smoothquant import smoothing_factors
from lowbit.ops.reference import qlinear_reference
from lowbit.verify.metrics import sqnr_db

_X = {"per-tensor": lb.QuantScheme(format="int8", strategy="tensor"),
      "per-token": lb.QuantScheme(format="int8", strategy="token")}
_W = lb.QuantScheme(format="int8", strategy="channel")


def run(tokens: int = 16, K: int = 4096, N: int = 1024, alpha: float = 0.5, seed: int = 0, progress=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(tokens, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.02
    rows = []
    for outlier in (False, True):
        x = x0.clone()
        if outlier:
            x[:, 7] *= 40
        ref = x.double() @ w.double().T
        variants = [(name, x, w, sch) for name, sch in _X.items()]
        s = smoothing_factors(x.abs().amax(dim=0), [w], alpha)
        variants.append((f"per-token + smoothing (alpha={alpha})", x / s, w * s, _X["per-token"]))
        for name, xv, wv, sch in variants:
            if progress:
                progress(f"outlier={outlier}: {name}")
            out = qlinear_reference(lb.quantize(xv, sch), lb.quantize(wv, _W))
            rows.append({"outlier_channel": outlier, "x_scales": name, "sqnr_db": sqnr_db(ref, out)})
    return {"experiment": "outliers", "seed": seed, "rows": rows,
            "notes": ["w int8 per output channel in every row; SQNR of the linear's output in dB"]}


def format_table(result: dict) -> str:
    lines = [f"{'outlier channel':<16} {'x scales':<36} {'SQNR dB':>8}"]
    for r in result["rows"]:
        lines.append(f"{str(r['outlier_channel']):<16} {r['x_scales']:<36} {r['sqnr_db']:>8.2f}")
    return "\n".join(lines + ["note: " + n for n in result["notes"]])
