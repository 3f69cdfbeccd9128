"""SmoothQuant: migrate activation outliers into the weights where the migration folds exactly.

For a Linear fed by an op that scales its input channels, y = (x / s) @ (W * s).T is the same
function as x @ W.T; folding 1/s into the producing op leaves the float model unchanged (up to
float rounding) while the quantized inputs lose their outlier channels. Per input channel j:
    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)      (W over all consumers of that input)
Fold points come from the decoder map (lowbit.archs.decoders), per family:
    a pre-norm feeding only Linears      -> those Linears   (gain w: w /= s; gain 1 + w (Gemma):
                                                              w = (1 + w) / s - 1)
    the Linear writing up's rows         -> mlp.down_proj   (down's input is act(gate) * up, linear
                                                              in up's output row j; Phi-3's fused
                                                              gate_up_proj: its second half)
A norm applied to a branch's output (Gemma 2/3, OLMo 2 post-norms) feeds the residual stream, and
Linears reading the residual stream without a norm (OLMo 2's q/k/v, gate/up) have no producer to
fold into: they are left unsmoothed and named (fold_plan). A family not in the map is refused.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable

import torch

from lowbit.algorithms.static_scales import calibrate_act_absmax
from lowbit.archs.decoders import UnsupportedArchitecture, decoder_for, decoder_layers
from lowbit.archs.experts import find_experts
from lowbit.progress import progress_bar


@dataclass
class FoldGroup:
    """producer: name of the norm (gain vector) or Linear (output rows) whose output feeds `consumers`.
    gain_offset: c of a norm computing x_hat * (c + w) (1 for Gemma). rows: the producer's output
    rows [a, b) that feed the consumers (a Linear producer; None: all of them)."""
    producer: str
    consumers: list[str]
    kind: str                   # "norm" | "linear"
    gain_offset: float = 0.0
    rows: tuple[int, int] | None = None


def refuse_experts(model: torch.nn.Module, what: str, hint: str | None = None) -> None:
    """UnsupportedArchitecture naming the fused MoE experts of `model`, if it has any: a fold for
    them is not exact. Their gate_up input is the post-attention norm's output, which the router
    (and shared experts) read too, and a norm gain carries one factor s for all of them, not one
    per expert: folding 1/s into it changes the router's input, and rescaling the router's
    columns to compensate changes its logits' rounding, so a token's top-k choice can flip (a
    discrete error). Only the down side (each expert's up rows / down columns) folds exactly."""
    moe = find_experts(model)
    if moe:
        name, spec = next(iter(moe.items()))
        raise UnsupportedArchitecture(
            f"{what} on {spec.family}: the fused MoE experts ({name}, {len(moe)} modules) have no exact fold point -- "
            "their gate_up input is the post-attention norm's output, which the router also reads, and one norm "
            "gain cannot carry a factor per expert (folding it changes the router's input and can flip its top-k "
            f"choice). " + (hint or f"{what} of the experts' down side is not implemented.") + f" Quantize without "
            f"{what} (GPTQ per expert: method='gptq', --gptq on the command line), or keep the experts in high "
            "precision with ignore=[...] (--ignore)")


def fold_plan(model: torch.nn.Module, include_down: bool = True) -> tuple[list[FoldGroup], list[str]]:
    """(the exact fold points of a mapped decoder model or decoder layer, why the other Linears
    reading the residual stream have none). UnsupportedArchitecture for a family not in the map,
    and for a model with fused MoE experts (refuse_experts says why)."""
    refuse_experts(model, "SmoothQuant / AWQ")
    d = decoder_for(model)
    groups, layers = [], decoder_layers(model, d)
    for name, layer in layers:
        pre = f"{name}." if name else ""
        for f in d.feeds:
            groups.append(FoldGroup(pre + f.norm, [pre + c for c in f.linears], "norm", d.gain_offset))
        if include_down and d.gated is not None:
            rows = None
            if d.gated.rows == "second_half":
                n = layer.get_submodule(d.gated.producer).out_features
                rows = (n // 2, n)
            groups.append(FoldGroup(pre + d.gated.producer, [pre + d.gated.consumer], "linear", rows=rows))
    left = [c for u in d.unfed for c in u]
    why = [f"{d.family}: {', '.join(left)} of each of the {len(layers)} decoder layers read the residual stream "
           f"without a norm in front (the family normalizes branch outputs: {', '.join(d.post_norms)}): no op "
           "to fold 1/s into, left unsmoothed"] if left and layers else []
    return groups, why


def fold_groups(model: torch.nn.Module, include_down: bool = True) -> list[FoldGroup]:
    """The exact fold points of a mapped decoder (fold_plan); ValueError when there are none."""
    groups, why = fold_plan(model, include_down)
    if not groups:
        raise ValueError(f"SmoothQuant found no exact fold point in {type(model).__name__}: " + "; ".join(why))
    return groups


# Elements per float32 temporary when a weight is read or rescaled: the maxima and the folds
# are elementwise / order-free, so working on row chunks gives the same bits and keeps a float32
# copy of a chunk, not of a [14336, 4096] weight, alive (the layer-by-layer path's peak memory).
_CHUNK = 1 << 22


def _row_steps(w: torch.Tensor):
    step = max(1, _CHUNK // max(1, w[0].numel()))
    return ((r, min(r + step, w.shape[0])) for r in range(0, w.shape[0], step))


def _col_absmax(w: torch.Tensor) -> torch.Tensor:
    """max |W[:, j]| (float32 [K]) of a weight [N, K], by row chunks."""
    return torch.stack([w[a:b].detach().float().abs().amax(dim=0) for a, b in _row_steps(w)]).amax(dim=0)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in float32, or float64 when t is float64 (a float64 model folds in float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _rescale_(w: torch.Tensor, fn) -> None:
    """w[a:b] = fn(w[a:b] in float32 (float64 for float64 w), a, b) cast back to w's dtype, in place,
    by row chunks."""
    for a, b in _row_steps(w):
        w[a:b].copy_(fn(_wide(w[a:b]), a, b).to(w.dtype))


def smoothing_factors(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float,
                      pow2: bool = False) -> torch.Tensor:
    """s [K] = act_max^alpha / w_max^(1 - alpha), w_max = max |W[:, j]| over the consumers' [N, K]
    weights; channels never active or with zero weights keep s = 1. pow2=True rounds s to the
    nearest power of two: multiplying and dividing by it is exact in floating point, so the
    folded float model computes bit-identical outputs."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must lie in [0, 1] (0: no migration, 1: all difficulty to the weights)")
    w_max = torch.stack([_col_absmax(w) for w in weights]).amax(dim=0)
    a = act_max.float()
    s = a.pow(alpha) / w_max.pow(1.0 - alpha)
    ok = (a > 0) & (w_max > 0) & torch.isfinite(s)
    s = torch.where(ok, s.clamp(min=1e-5), torch.ones_like(s))
    return torch.exp2(torch.round(torch.log2(s))) if pow2 else s


@torch.no_grad()
def smooth_model(model: torch.nn.Module, batches: Iterable, alpha: float = 0.5, include_down: bool = True,
                 pow2: bool = False, progress: bool = False) -> dict[str, torch.Tensor]:
    """Calibrate per-channel input maxima on `batches` (float model) and fold the smoothing
    factors in place. Run it BEFORE quantize_model. Returns {producer name: s [K]}.
    Linears must still be nn.Linear (not yet quantized). Linears with no fold point in their
    family (fold_plan) are named in a warning and left as they are."""
    refuse_experts(model, "SmoothQuant", "lowbit.algorithms.experts_fold.smooth_experts folds SmoothQuant into the "
                   "experts' down side, where it is exact per expert (lowbit quantize --smoothquant does so for MoE "
                   "models).")
    groups = fold_groups(model, include_down)
    for why in fold_plan(model, include_down)[1]:
        warnings.warn("SmoothQuant: " + why, stacklevel=2)
    consumers = [c for g in groups for c in g.consumers]
    it = batches
    if progress:
        it = progress_bar(list(batches), desc="SmoothQuant calibration", unit="batch", leave=False)
    amax = calibrate_act_absmax(model, it, names=consumers, per_channel=True)
    return fold_from_stats(model, groups, amax, alpha, pow2)


@torch.no_grad()
def fold_from_stats(model: torch.nn.Module, groups: list[FoldGroup], amax: dict[str, torch.Tensor],
                    alpha: float, pow2: bool = False) -> dict[str, torch.Tensor]:
    """Fold the smoothing factors of `groups` given each consumer's per-channel input maxima
    `amax` ({name: [K]}, calibrate_act_absmax); returns {producer: s [K]}."""
    out = {}
    for g in groups:
        lins = [model.get_submodule(c) for c in g.consumers]
        s = smoothing_factors(amax[g.consumers[0]], [l.weight for l in lins], alpha, pow2)
        out[g.producer] = fold(model, g, s)
    return out


def offset_gain_limit(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest s_j a norm of gain g_j = c + w_j (c != 0) may take. Its folded weight
    w'_j = g_j / s_j - c is stored in `dtype` with an absolute error <= u |w'_j|, so the realized gain
    g_j / s_j is off by a relative u |1 - c s_j / g_j| <= u A when s_j <= (A - 1) |g_j|. A = 2^-16 / u
    (at least 4) keeps that error 2^8 below the finest relative step (2^-8) of the 8-bit formats the
    fold prepares for: s <= 255 |g| in float32, no limit that matters in float64, s <= 3 |g| in bf16."""
    u = torch.finfo(dtype).eps / 2
    a = max(4.0, 2.0 ** -16 / u)
    return (a - 1.0) * g.abs()


@torch.no_grad()
def fold(model: torch.nn.Module, group: FoldGroup, s: torch.Tensor) -> torch.Tensor:
    """Divide the producer's output channels by s [K] and multiply the consumers' input columns
    by s, in place: the float model computes the same function (exactly up to float rounding;
    bit-exactly for powers of two with a gain w). A gain c + w is folded as w' = (c + w) / s - c,
    with s limited by offset_gain_limit. Returns the s folded. Shared by SmoothQuant and AWQ
    (lowbit.algorithms.awq)."""
    prod = model.get_submodule(group.producer)
    if group.kind == "norm":
        w = prod.weight
        c = group.gain_offset
        if c:
            g = w.double() + c
            lim = offset_gain_limit(g, w.dtype).clamp(min=torch.finfo(torch.float32).tiny)
            s = torch.minimum(s.double(), lim).to(_wide(w).dtype)    # the consumers get these very values
            w.copy_((g / s.double() - c).to(w.dtype))
        else:
            w.copy_((_wide(w) / s).to(w.dtype))
        if getattr(prod, "bias", None) is not None:
            prod.bias.copy_((_wide(prod.bias) / s).to(prod.bias.dtype))
    else:
        a0, b0 = group.rows or (0, prod.weight.shape[0])
        if b0 - a0 != s.shape[0]:
            raise ValueError(f"{group.producer}: rows [{a0}, {b0}) do not match the {s.shape[0]} factors")
        _rescale_(prod.weight[a0:b0], lambda x, a, b: x / s[a:b, None])
        if getattr(prod, "bias", None) is not None:
            bias = prod.bias[a0:b0]
            bias.copy_((_wide(bias) / s).to(bias.dtype))
    for c in group.consumers:
        l = model.get_submodule(c)
        _rescale_(l.weight, lambda x, a, b: x * s.to(x.dtype)[None, :])
    return s
