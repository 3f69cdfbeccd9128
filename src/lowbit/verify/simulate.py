"""The machinery every bug hypothesis uses: a simulated output and the gate a kernel with the bug
must meet (verify/hypotheses.py lists the bugs; diagnose.py decides).

Hyp: one simulated bug. Sim: computes the output and gate of edited operands for a diagnose.Context.
explained(): does a simulation reproduce the kernel's output within its gate, and how much of the
error does it explain.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lowbit.ops.reference import as_operand
from lowbit.verify import tolerance as tol


@dataclass
class Hyp:
    """A simulated bug: its output `pred` [M, N] float64 and the gate [M, N] a kernel with the bug
    must meet; `mask` [M, N] bool limits the comparison (outputs the bug leaves undefined)."""

    name: str
    detail: str
    pred: torch.Tensor
    gate: torch.Tensor
    mask: torch.Tensor | None = None
    kind: str = "logic"           # "numerical" for precision bugs (rounded inputs)
    general: bool = False         # a fitted family that contains more specific hypotheses
    ulp_sized: bool = False       # a scale off by a few units in its last place: on same-sign data
                                  # indistinguishable from a truncating accumulator's shrinkage
    exact: bool = True            # False: a random process (stochastic rounding) simulated by its mean
                                  # and a bound; it can be consistent with the output, never confirmed


def _q(t) -> bool:
    return hasattr(t, "codes") and hasattr(t, "scheme")


def _side(name: str) -> str:
    return "activations x" if name == "x" else "weights w"


class Sim:
    """Computes the output and gate of edited operands. ctx: diagnose.Context."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.n, self.u = tol.rounding_count(ctx.xq, ctx.wq, ctx.accumulator, ctx.bias is not None)
        self.bias = None if ctx.bias is None else torch.as_tensor(ctx.bias).detach().cpu().double()
        self.M, self.N = ctx.out.shape
        self._d = {}

    def deq(self, side: str) -> torch.Tensor:
        """Float64 dequantized operand [R, K] of the unedited side."""
        if side not in self._d:
            self._d[side] = as_operand(self.ctx.xq if side == "x" else self.ctx.wq, side).dequantized()
        return self._d[side]

    def gate(self, T: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        return tol.gate_from_sum(T, pred, self.n, self.u, self.ctx.out_dtype)

    def linear(self, X=None, W=None, bias="keep") -> tuple[torch.Tensor, torch.Tensor]:
        """(pred, gate) of X @ W.T + bias for dequantized float64 X [M, K], W [N, K]
        (None = the unedited side)."""
        X = self.deq("x") if X is None else X
        W = self.deq("w") if W is None else W
        b = self.bias if isinstance(bias, str) else bias
        pred, T = X @ W.T, X.abs() @ W.abs().T
        if b is not None:
            pred, T = pred + b, T + b.abs()
        return pred, self.gate(T, pred)

    def with_side(self, side: str, qt) -> tuple[torch.Tensor, torch.Tensor]:
        D = as_operand(qt, side).dequantized()
        return self.linear(X=D) if side == "x" else self.linear(W=D)

    def hyp(self, name, detail, side, qt, kind="logic", ulp_sized=False) -> Hyp | None:
        try:
            pred, gate = self.with_side(side, qt)
        except ValueError:          # e.g. a twin format decodes a code as NaN: not simulable here
            return None
        return Hyp(name, detail, pred, gate, kind=kind, ulp_sized=ulp_sized)


def _rescale(qt, scale: torch.Tensor):
    return dataclasses.replace(qt, scale=scale.contiguous())


def _unit_scale(qt) -> torch.Tensor:
    return torch.ones_like(qt.scale)


def sides(sim: Sim):
    for side, other in (("x", "w"), ("w", "x")):
        qt = sim.ctx.xq if side == "x" else sim.ctx.wq
        if _q(qt) and qt.scale.ndim == 2:
            yield side, other, qt


def explained(out, ref, pred, gate, mask=None) -> tuple[bool, float, float]:
    """(within gate everywhere, share of the error's energy explained, worst |out - pred| / gate).
    Non-finite outputs count as explained only where the simulation is non-finite too."""
    if mask is not None:
        out, ref, pred, gate = out[mask], ref[mask], pred[mask], gate[mask]
    fo, fp = torch.isfinite(out), torch.isfinite(pred)
    both = fo & fp
    e0, e1 = (out - ref)[both], (out - pred)[both]
    n0 = float((e0 * e0).sum())
    n1 = float((e1 * e1).sum())
    share = 1.0 - n1 / n0 if n0 > 0 else -math.inf
    if not torch.equal(fo, fp):
        return False, share if bool(fo.all()) else -math.inf, math.inf
    worst = float(torch.nan_to_num(e1.abs() / gate[both], nan=math.inf).max()) if e1.numel() else 0.0
    return worst <= 1.0, share, worst

