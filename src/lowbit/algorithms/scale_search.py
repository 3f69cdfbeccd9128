"""MSE-optimal weight scales ("clipping"): for each scale of a weight (one per group / channel /
block), the range that the scale covers is multiplied by a factor p from a grid (shrunk; for MX's
power-of-two scales also widened by one exponent), and the p whose
quantized weight has the smallest squared error over that scale's elements, optionally weighted
per input column by the Hessian diagonal diag(X^T X / n) (how much each column's error reaches the
layer's output), is kept. Clipping a few large weights buys a finer step for all the others.

The grid search runs the scheme's own arithmetic: every candidate is `compute_scale` of the shrunk
statistics and `lowbit.quantize(w, scheme, scales=...)`, so the chosen codes and scales are exactly
what `lowbit.quantize` stores for those scales (values beyond a shrunk range saturate / clamp there);
the checkpoint layout does not change. Two-level schemes (NVFP4) keep the tensor scale of the
unshrunk weight; only the block scales are searched.

Used by GPTQ (lowbit.algorithms.gptq, `mse=True`: the static group scales come from here) and by
round-to-nearest (`quantize_model(..., mse=True)`).
"""
from __future__ import annotations

import torch

from lowbit.quantize import (Scales, _reduce, compute_scale, quantize, reduce_amax, reduce_minmax,
                             two_level_global_scale)
from lowbit.scheme import QuantScheme

GRID = tuple(1.0 - 0.025 * i for i in range(21))    # 1.0, 0.975, ..., 0.5
# e8m0 (MX) scales are powers of two: the only distinct candidates are the neighbouring exponents,
# and the OCP rule (floor) already clips a block's largest values, so the wider range (2.0) is one.
GRID_E8M0 = (2.0, 1.0, 0.5)


def _padded(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """w float32 [N, K] zero-padded along K to the group / block width (as quantize(pad=True))."""
    width = scheme.k_width
    return torch.nn.functional.pad(w.float(), (0, (-w.shape[1]) % width))


def search_scales(w: torch.Tensor, scheme: QuantScheme, *, hdiag: torch.Tensor | None = None,
                  grid=None) -> Scales:
    """The Scales of `w` ([N, K] float; y = x @ w.T) that minimise, per scale, the squared weight
    error sum_j hdiag_j (w_ij - Q(w)_ij)^2 over the grid of range factors p (default GRID, GRID_E8M0
    for e8m0 scales; 1.0 = round to nearest's scales, always a candidate and kept on ties: the result
    is never worse than round to nearest on that objective).
    hdiag: float [K] >= 0 (None: 1 for every column). Shapes as quantize(w, scheme, pad=True).scale;
    pass the result as `quantize(w, scheme, pad=True, scales=...)`."""
    if w.ndim != 2:
        raise ValueError(f"w must be a 2-D [out_features, in_features] weight, got shape {tuple(w.shape)}")
    if scheme.dynamic:
        raise ValueError("scheme must be static (dynamic=False): weight scales are searched once")
    if grid is None:
        grid = GRID_E8M0 if scheme.scale_format == "e8m0" else GRID
    if not grid or 1.0 not in grid or not all(p > 0.0 for p in grid):
        raise ValueError(f"grid={grid!r}: give positive range factors that include 1.0 (round to nearest's scales)")
    K = w.shape[1]
    if hdiag is None:
        hdiag = torch.ones(K, dtype=torch.float64, device=w.device)
    if tuple(hdiag.shape) != (K,) or not bool((hdiag >= 0).all()):
        raise ValueError(f"hdiag must be a non-negative [K={K}] vector (the Hessian's diagonal), "
                         f"got shape {tuple(hdiag.shape)}")
    xf = _padded(w, scheme)
    weight = torch.nn.functional.pad(hdiag.double().to(w.device), (0, xf.shape[1] - K))[None, :]
    x64 = xf.double()
    if scheme.symmetric:
        amax = reduce_amax(xf, scheme)
        glob = two_level_global_scale(amax.max(), scheme) if scheme.two_level else None
        candidate = lambda p: compute_scale(amax * p, scheme, global_scale=glob)  # noqa: E731
    else:
        lo, hi = reduce_minmax(xf, scheme)
        candidate = lambda p: compute_scale(hi * p, scheme, amin=lo * p)  # noqa: E731
    best, best_err = None, None
    for p in [1.0] + sorted(set(grid) - {1.0}, reverse=True):     # 1.0 first: ties keep round to nearest
        sc = candidate(p)
        deq = quantize(xf, scheme, scales=sc).dequantize(torch.float64)
        err = _reduce((x64 - deq) ** 2 * weight, scheme, torch.sum)
        if best is None:
            best, best_err = sc, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = Scales(*(None if b is None or b.ndim == 0 else torch.where(better, n, b)
                        for b, n in zip(best[:3], sc[:3])), best.global_scale)
    return best
