"""GPTQ's statistics of a layer's inputs: the Hessian H = X^T X / n (accumulated in float64, reduced
across ranks in a fixed order), the output loss tr((W - Q) H (W - Q)^T) on fixed row panels, the
held-out check, and how a job's rows are shared between ranks (whole PANEL_ROWS panels)."""
from __future__ import annotations

import math

import torch

from lowbit.algorithms import distributed
from lowbit.algorithms.distributed import ChunkedSum, OrderedSum


class HessianAccumulator:
    """Running H = X^T X / n (float64 [K, K]) over calibration inputs X of any shape [..., K].

    The sum lives on the inputs' device (`device` overrides). Under torch.distributed each rank
    adds its own batches and `hessian()` returns the Hessian of ALL ranks' batches, bit-identical
    to one process adding them in order; it is then a collective call that every rank makes.
    counts: None -- one term X_b^T X_b per batch, added in batch order (lowbit.algorithms.distributed.
    OrderedSum: ranks > 0 hold one K x K term per batch until the chain reaches them); or every
    rank's number of add() calls (distributed.counts(len(batches)), a collective) -- the batches'
    products accumulated in place (addmm_) into chunks of consecutive batches, the chunks added in
    order (distributed.ChunkedSum): no K x K term per batch, and ranks > 0 hold a few chunk sums.
    The two orders give different bits; each is the same for any number of ranks."""

    def __init__(self, in_features: int, device=None, counts: list[int] | None = None):
        self.in_features = in_features
        self.device = device
        self._counts = counts
        self._sum = OrderedSum() if counts is None else None
        self.n = 0
        self._dist = distributed.active()
        self._total = None              # the ranks' combined sum, once reduce() ran (distributed)

    def _prep(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.detach().reshape(-1, x.shape[-1]).to(device=self.device or x.device, dtype=torch.float64)
        if x2.shape[1] != self.in_features:
            raise ValueError(f"calibration input has {x2.shape[1]} features, the layer has {self.in_features}")
        return x2

    def add(self, x: torch.Tensor) -> None:
        if self._total is not None:
            raise RuntimeError("HessianAccumulator.add after hessian(): the ranks' sums were already combined")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"calibration input has {x.shape[-1]} features, the layer has {self.in_features}")
        if self._counts is None:
            x2 = self._prep(x)
            self._sum.add(x2.T @ x2)
        else:
            if self._sum is None:
                dev = self.device or x.device
                self._sum = ChunkedSum(self._counts, (self.in_features, self.in_features), dev)

            def into(s, x=x):             # on the chain for a batch whose chunk began on an earlier rank
                x2 = self._prep(x)
                s.addmm_(x2.T, x2)
            self._sum.add(into)
        self.n += x.reshape(-1, x.shape[-1]).shape[0]

    def _combined(self) -> torch.Tensor | None:
        if self._counts is None:
            return self._sum.total((self.in_features, self.in_features), self.device)
        if self._sum is None:           # no batch on this rank (a collective all the same)
            self._sum = ChunkedSum(self._counts, (self.in_features, self.in_features),
                                   self.device or distributed.comm_device())
        return self._sum.total()

    def reduce(self) -> None:
        """Combine the ranks' sums (a collective; a no-op in one process); idempotent."""
        if self._dist and self._total is None:
            total = self._combined()
            self.n = distributed.all_count(self.n)
            self._total = total if total is not None else torch.zeros(
                self.in_features, self.in_features, dtype=torch.float64, device=self.device)

    @property
    def sum(self) -> torch.Tensor:
        """X^T X over all inputs so far (all ranks': a collective under torch.distributed)."""
        if self._dist:
            self.reduce()
            return self._total
        s = self._combined() if self._sum is not None else None
        return torch.zeros(self.in_features, self.in_features, dtype=torch.float64, device=self.device) if s is None else s

    def hessian(self) -> torch.Tensor:
        s = self.sum
        if self.n == 0:
            raise ValueError("no calibration input reached this layer: GPTQ needs calibration batches")
        return s / self.n


def output_loss(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) in float64: the summed squared output error over the calibration
    inputs (divided by n when H = X^T X / n)."""
    return float(_quad(w.double() - q.double(), h.double()))


def _quad(d: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """tr(D H D^T) of float64 D [n, K] and H [K, K], as a 0-dim tensor (no device sync)."""
    return ((d @ h) * d).sum()


def panel_losses(d: torch.Tensor, h: torch.Tensor, world: int = 1, me: int = 0) -> float:
    """tr(D H D^T) (float64 D [N, K], H [K, K]) as the correctly rounded sum (math.fsum) of its
    PANEL_ROWS-row panels' values: the same float whatever the number of ranks. With world > 1
    each rank computes its share of the panels (_rows_of) and the panel values are broadcast (a
    collective), so one [N, K] x [K, K] product is divided among the ranks."""
    N = d.shape[0]
    npan = -(-N // PANEL_ROWS)
    vals = torch.zeros(npan, dtype=torch.float64, device=d.device)
    lo, hi = distributed.share(npan, world, me)
    for p in range(lo, hi):
        vals[p] = _quad(d[p * PANEL_ROWS:(p + 1) * PANEL_ROWS], h)
    if world > 1:
        for r in range(world):
            a, b = distributed.share(npan, world, r)
            if b > a:
                distributed.broadcast_(vals[a:b], src=r)
    return math.fsum(vals.tolist())


def held_out_losses(inputs, holdout: int, deltas: list[torch.Tensor]) -> torch.Tensor | None:
    """float64 [len(deltas)]: for each D = W - Q [N, K] (float64) the summed squared output error
    over the held-out calibration tokens, sum_t ||D x_t||^2, i.e. tr(D Hv D^T) with Hv = X^T X of
    those tokens (output_loss on the un-normalized held-out Hessian), computed from the tokens:
    inputs are this rank's batches (tensors [..., K]); the held-out tokens of a batch are every
    holdout-th row of it flattened to [-1, K]. One [tokens, K] x [K, N] product per batch and D,
    the batches' terms summed in batch order over all ranks (OrderedSum: bit-identical to one
    process; a collective). No K x K Hessian is built. None when no rank has a held-out token."""
    acc = OrderedSum()
    for x in inputs:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= holdout:       # rows holdout-1, 2 holdout-1, ...: a strided view
            xv = x2[holdout - 1::holdout].to(torch.float64)
            acc.add(torch.stack([(xv @ d.T).square().sum() for d in deltas]))
    return acc.total((len(deltas),), deltas[0].device)


def _fit_rows(x2: torch.Tensor, holdout: int) -> torch.Tensor:
    """The rows of x2 [rows, K] that are not held out (all but every holdout-th: row r is held out
    when r % holdout == holdout - 1), in order; all rows when holdout is 0. One gather by an
    index computed on the device (the j-th fit row is row j + j // (holdout - 1)): the rows a
    boolean mask would select, without its host synchronization."""
    if not holdout:
        return x2
    nfit = x2.shape[0] - x2.shape[0] // holdout
    j = torch.arange(nfit, device=x2.device)
    return x2.index_select(0, j + j // (holdout - 1))


# Rows per lazy-update matrix product (W[:, later] -= Err @ Hinv[block, later]). GPTQ's rows are
# independent, so a weight's rows can be solved in pieces (the Linears reading one input as one
# concatenated weight, a weight's rows split across ranks); the per-column steps are elementwise,
# but a matrix product's rounding may depend on the shape it is given (a BLAS picks its kernel by
# shape). The products therefore always run on these fixed panels of rows, counted from the
# job's first row: one process and N ranks (each holding whole panels) give them the same
# operands and shapes, so the codes are bit-identical whatever the split.
PANEL_ROWS = 512


def _rows_of(n: int, world: int, r: int) -> tuple[int, int]:
    """Rank r's rows of an n-row job: whole PANEL_ROWS panels, contiguous, counts differing by
    at most one panel."""
    lo, hi = distributed.share(-(-n // PANEL_ROWS), world, r)
    return min(lo * PANEL_ROWS, n), min(hi * PANEL_ROWS, n)
