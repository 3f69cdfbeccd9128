"""AWQ (Lin et al., 2023): activation-aware per-channel weight scaling, folded exactly.

Input channels that carry large activations matter most for the output; scaling their weight
columns up by s_j (and the activations down by 1/s_j, folded into the op that produces them)
gives those columns a finer share of the weight grid. For each fold group (a norm or Linear
whose output feeds some Linears, lowbit.algorithms.smoothquant.fold_plan, read from the decoder map
lowbit.archs.decoders; a family where one norm feeds attention and MLP in parallel is refused) and calibration inputs X:
    s(alpha) = mean|X_j|^alpha, normalised by sqrt(max s * min s)
    loss(alpha) = sum over consumers  tr((W - Q(W s) / s) H (W - Q(W s) / s)^T),  H = X^T X / n
with Q the recipe's weight quantizer (lowbit.quantize, round to nearest); alpha is searched on
a grid (default 0, 0.05, ..., 0.95; alpha = 0 is s = 1, no change) and the best s is folded with
smoothquant.fold. The model stays a float model computing the same function; quantize it
afterwards (quantize_model, RTN or GPTQ). Blocks are visited in order (lowbit.algorithms.sequential), so
each group's X comes from the already-scaled layers before it. Runs wherever torch runs (CPU).

Meant for weight-only recipes: the loss does not see activation quantization (for W8A8 use
SmoothQuant, whose factors target the activations).
"""
from __future__ import annotations

import warnings

import torch

from lowbit.algorithms.distributed import OrderedSum
from lowbit.algorithms.gptq.hessian import HessianAccumulator, output_loss
from lowbit.algorithms.sequential import calibrate_sequentially
from lowbit.algorithms.smoothquant import FoldGroup, fold, fold_plan, refuse_experts
from lowbit.archs.decoders import UnsupportedArchitecture, decoder_for
from lowbit.quantize import quantize
from lowbit.recipes.presets import get_recipe
from lowbit.scheme import QuantScheme

GRID = tuple(i / 20 for i in range(20))


def awq_factors(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] = x_mean^alpha / sqrt(max * min) over the channels that are active (others keep 1)."""
    s = x_mean.double().clamp(min=1e-8).pow(alpha)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(x_mean > 0, s, torch.ones_like(s)).float()


# Weight elements quantized at once in candidate_losses (a chunk of candidates stacked along a
# leading axis; its temporaries hold ~20 bytes per element: ~80 MB at this size).
CHUNK_ELEMENTS = 1 << 22


def _row_local(scheme: QuantScheme) -> bool:
    """Whether a weight's scales depend on its own row only, so that candidates stacked along a
    leading axis quantize exactly as each alone (a tensor or two-level scale would span them)."""
    return scheme.strategy in ("channel", "group") and not scheme.two_level


def scaled_quantized(w: torch.Tensor, factors: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """float64 [C, N, K]: Q(W s)/s for each row s of factors [C, K] (w [N, K]), Q the scheme's
    round to nearest (lowbit.quantize, groups zero-padded along K)."""
    ws = w.float()[None] * factors[:, None, :]
    return quantize(ws, scheme, pad=True).dequantize(torch.float64) / factors.double()[:, None, :]


def scaled_loss(weights: list[torch.Tensor], h: torch.Tensor, s: torch.Tensor, scheme: QuantScheme) -> float:
    """sum over weights [N, K] of tr((W - Q(W s)/s) H (W - Q(W s)/s)^T), all in float64: the
    reference twin of candidate_losses."""
    total = 0.0
    for w in weights:
        total += output_loss(w, scaled_quantized(w, s[None], scheme)[0], h)
    return total


def candidate_losses(weights: list[torch.Tensor], h: torch.Tensor, factors: torch.Tensor,
                     scheme: QuantScheme) -> torch.Tensor:
    """scaled_loss of every row s of factors [C, K], float64 [C], with the candidates quantized
    together and the product D H in float32 (D = W - Q(W s)/s in float64, rounded to float32).

    Why float32 is enough: the losses only rank the candidates. With u = 2^-24, rounding D and H
    to float32 and a K-term float32 dot product per entry of D H move each term D_ij (D H)_ij by at
    most (gamma_K + 3u) |D_ij| (|D| |H|)_ij, gamma_K = K u / (1 - K u) (the products and their
    float64 sum add O(u) more), so the loss by at most (gamma_K + 3u) tr(|D| |H| |D|^T)
    (tests/algorithms/test_awq.py checks that gate). Two candidates trade places only when their
    float64 losses lie within that bound of each other: either is then as good as the other to
    that accuracy. The product is half the float64 one's time, and it was most of AWQ's."""
    h32 = h.to(torch.float32)
    out = torch.zeros(factors.shape[0], dtype=torch.float64, device=factors.device)
    for w in weights:
        step = max(1, CHUNK_ELEMENTS // w.numel()) if _row_local(scheme) else 1
        for c0 in range(0, factors.shape[0], step):
            d = (w.double()[None] - scaled_quantized(w, factors[c0:c0 + step], scheme)).to(torch.float32)
            out[c0:c0 + step] += (torch.matmul(d, h32) * d).sum(dim=(1, 2), dtype=torch.float64)
            del d
    return out


def search_scale(weights: list[torch.Tensor], xs: list[torch.Tensor], scheme: QuantScheme,
                 grid=GRID) -> tuple[torch.Tensor, float, dict]:
    """Best s over the grid for Linears with weights [N, K] fed by inputs xs ([..., K] each).
    Returns (s [K] float32, best alpha, {alpha: loss}); losses by candidate_losses."""
    K = weights[0].shape[1]
    acc, x_sum = HessianAccumulator(K), OrderedSum()    # all ranks' batches under torch.distributed
    for x in xs:
        acc.add(x)
        x_sum.add(x.detach().reshape(-1, K).double().abs().sum(0))
    h = acc.hessian()
    x_mean = (x_sum.total((K,)) / acc.n).float()
    factors = torch.stack([awq_factors(x_mean, a) for a in grid]).to(weights[0].device)
    losses = dict(zip(grid, candidate_losses(weights, h, factors, scheme).tolist()))
    best = min(losses, key=losses.get)
    return awq_factors(x_mean, best), best, losses


@torch.no_grad()
def awq_model(model: torch.nn.Module, recipe, calib, *, grid=GRID, progress: bool = False) -> dict[str, float]:
    """Search and fold AWQ factors into every exact fold point of `model` (float, in place) for the
    weight scheme of `recipe`. calib: input-id tensors [B, T] or dicts. Returns {producer: alpha}.
    ValueError for recipes that quantize activations or models without fold points."""
    r = get_recipe(recipe)
    if r.act is not None:
        raise ValueError(f"AWQ is for weight-only recipes; {r.name} also quantizes activations "
                         "(use SmoothQuant for those, or a w4a16 / w8a16 recipe)")
    refuse_experts(model, "AWQ", "lowbit.algorithms.experts_fold.awq_experts folds AWQ into the experts' down side, "
                   "where it is exact per expert (lowbit quantize --awq does so for MoE models).")
    d = decoder_for(model)
    if d.parallel:
        raise UnsupportedArchitecture(
            f"AWQ on {d.family}: one norm feeds attention and MLP in parallel ({', '.join(d.feeds[0].linears)}), "
            "but sequential calibration reaches them as separate groups, so one factor cannot be searched "
            "on all its consumers; use SmoothQuant or GPTQ alone for this family")
    groups, why = fold_plan(model)
    for w in why:
        warnings.warn("AWQ: " + w, stacklevel=2)
    by_first: dict[str, FoldGroup] = {g.consumers[0]: g for g in groups}
    chosen: dict[str, float] = {}

    def handle(names, xs):
        g = by_first.get(names[0])
        if g is not None:
            if set(g.consumers) != set(names):
                raise ValueError(f"fold group {g.consumers} does not match the Linears sharing one input {names}")
            s, alpha, _ = search_scale([model.get_submodule(c).weight for c in g.consumers], xs, r.weight, grid)
            fold(model, g, s)  # s may be limited on 1 + w norms (smoothquant.offset_gain_limit)
            chosen[g.producer] = alpha
        return {n: model.get_submodule(n) for n in names}

    names = [c for g in groups for c in g.consumers]
    calibrate_sequentially(model, names, calib, handle, progress=progress, desc=f"AWQ {r.name}")
    return chosen
