"""SmoothQuant: migrate activation outliers into the weights where the migration folds exactly.

For a Linear fed by an op that scales its input channels, y = (x / s) @ (W * s).T is the same
function as x @ W.T; folding 1/s into the producing op leaves the float model unchanged (up to
float rounding) while the quantized inputs lose their outlier channels. Per input channel j:
    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)      (W over all consumers of that input)
Fold points in a pre-norm decoder block (Llama, Mistral, Qwen2, SmolLM2 naming):
    input_layernorm           -> self_attn.q_proj, k_proj, v_proj   (norm gain /= s)
    post_attention_layernorm  -> mlp.gate_proj, up_proj              (norm gain /= s)
    mlp.up_proj (output rows) -> mlp.down_proj                       (down's input is
                                 act(gate) * up, linear in up's output row j)
Post-norm encoders (BERT) have no exact fold: their norm output is also the residual stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from lowbit.algorithms.static_scales import calibrate_act_absmax


@dataclass
class FoldGroup:
    """producer: name of the norm (gain vector) or Linear (output rows) whose output feeds `consumers`."""
    producer: str
    consumers: list[str]
    kind: str                   # "norm" | "linear"


def fold_groups(model: torch.nn.Module, include_down: bool = True) -> list[FoldGroup]:
    """The exact fold points of a pre-norm decoder; ValueError when there are none."""
    groups = []
    for name, m in model.named_modules():
        attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
        pre = f"{name}." if name else ""
        if hasattr(m, "input_layernorm") and attn is not None and all(
                isinstance(getattr(attn, p, None), torch.nn.Linear) for p in ("q_proj", "k_proj", "v_proj")):
            groups.append(FoldGroup(pre + "input_layernorm",
                                    [pre + f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")], "norm"))
        if hasattr(m, "post_attention_layernorm") and mlp is not None and all(
                isinstance(getattr(mlp, p, None), torch.nn.Linear) for p in ("gate_proj", "up_proj")):
            groups.append(FoldGroup(pre + "post_attention_layernorm",
                                    [pre + "mlp.gate_proj", pre + "mlp.up_proj"], "norm"))
            if include_down and isinstance(getattr(mlp, "down_proj", None), torch.nn.Linear):
                groups.append(FoldGroup(pre + "mlp.up_proj", [pre + "mlp.down_proj"], "linear"))
    if not groups:
        raise ValueError(f"SmoothQuant found no exact fold point in {type(model).__name__}: it needs a pre-norm "
                         "decoder (input_layernorm -> self_attn.q/k/v_proj, post_attention_layernorm -> "
                         "mlp.gate/up_proj); post-norm encoders such as BERT have none")
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


def _rescale_(w: torch.Tensor, fn) -> None:
    """w[a:b] = fn(float32 w[a:b], a, b) cast back to w's dtype, in place, by row chunks."""
    for a, b in _row_steps(w):
        w[a:b].copy_(fn(w[a:b].float(), a, b).to(w.dtype))


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
    Linears must still be nn.Linear (not yet quantized)."""
    groups = fold_groups(model, include_down)
    consumers = [c for g in groups for c in g.consumers]
    it = batches
    if progress:
        from tqdm import tqdm
        it = tqdm(list(batches), desc="SmoothQuant calibration", unit="batch", leave=False)
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
        fold(model, g, s)
        out[g.producer] = s
    return out


@torch.no_grad()
def fold(model: torch.nn.Module, group: FoldGroup, s: torch.Tensor) -> None:
    """Divide the producer's output channels by s [K] and multiply the consumers' input columns
    by s, in place: the float model computes the same function (exactly up to float rounding;
    bit-exactly for powers of two). Shared by SmoothQuant and AWQ (lowbit.algorithms.awq)."""
    prod = model.get_submodule(group.producer)
    if group.kind == "norm":
        w = prod.weight
        w.copy_((w.float() / s).to(w.dtype))
    else:
        _rescale_(prod.weight, lambda x, a, b: x / s[a:b, None])
    if getattr(prod, "bias", None) is not None:
        prod.bias.copy_((prod.bias.float() / s).to(prod.bias.dtype))
    for c in group.consumers:
        l = model.get_submodule(c)
        _rescale_(l.weight, lambda x, a, b: x * s[None, :])
