"""Coverage of a quantization: which parameters were quantized, which were kept in high
precision by a rule, and which were left untouched -- for every architecture, never silent.

Rules (a parameter kept by one of them is not "untouched"):
  embedding   nn.Embedding weights (the token table: a lookup, kept in high precision)
  norm        parameters of normalization modules (class name containing "Norm")
  router      MoE routers (lowbit.archs.experts.ROUTERS, and shared-expert gates): a changed
              top-k choice is a discrete error, not a small one
  vector      any other 1-D parameter (biases, attention sinks, per-channel gains): small, and
              read in float by every kernel
  skipped     a Linear or experts module the quantization plan kept on purpose (lm_head, an
              ignore pattern, a tied embedding, an override to "skip"), with the plan's reason
Everything else that is still a float parameter of >= 2 dimensions is "untouched": a weight
tensor nothing quantized and no rule explains. `check_coverage` raises when such a tensor
holds at least `min_fraction` of the model's parameters (a silently half-quantized model, as
fused MoE experts were before lowbit.nn.experts), or warns when asked to.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from lowbit.archs.experts import EXPERTS, ROUTERS
from lowbit.nn.experts import PROJECTIONS, QuantExperts
from lowbit.nn.quant_linear import QuantLinear

STATUSES = ("quantized", "kept", "untouched")


@dataclass(frozen=True)
class Row:
    """One parameter (or one quantized weight): its module, the module's class, element count,
    status and the rule or recipe behind it."""
    name: str
    module: str
    kind: str
    numel: int
    ndim: int
    status: str
    reason: str


@dataclass
class Coverage:
    rows: list[Row] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(r.numel for r in self.rows)

    def elements(self, status: str) -> int:
        return sum(r.numel for r in self.rows if r.status == status)

    def by_kind(self) -> dict[tuple[str, str], int]:
        """(module class, status) -> parameter elements."""
        out: dict[tuple[str, str], int] = {}
        for r in self.rows:
            out[(r.kind, r.status)] = out.get((r.kind, r.status), 0) + r.numel
        return out

    def by_reason(self, status: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            if r.status == status:
                out[r.reason] = out.get(r.reason, 0) + r.numel
        return out

    def untouched(self, min_fraction: float = 0.0) -> list[Row]:
        """Untouched tensors of >= 2 dimensions holding >= min_fraction of all parameters."""
        return [r for r in self.rows if r.status == "untouched" and r.ndim >= 2
                and r.numel >= min_fraction * self.total]

    def __str__(self) -> str:
        tot = max(self.total, 1)
        pct = lambda n: f"{n:,} ({100 * n / tot:.1f}%)"  # noqa: E731
        kept = ", ".join(f"{k} {v:,}" for k, v in sorted(self.by_reason("kept").items(), key=lambda kv: -kv[1]))
        lines = [f"coverage: {pct(self.elements('quantized'))} of {self.total:,} parameters quantized; "
                 f"kept in high precision by rule {pct(self.elements('kept'))}; "
                 f"untouched {pct(self.elements('untouched'))}"]
        if kept:
            lines.append(f"  kept: {kept}")
        for r in self.untouched():
            lines.append(f"  UNTOUCHED {r.name} ({r.kind}, {r.numel:,} elements)")
        return "\n".join(lines)


def _rule(mod: torch.nn.Module, p: torch.nn.Parameter, skipped: dict[str, str], mname: str) -> tuple[str, str]:
    cls = type(mod).__name__
    if mname in skipped:
        return "kept", skipped[mname]
    if isinstance(mod, torch.nn.Embedding):
        return "kept", "embedding"
    if "Norm" in cls:
        return "kept", "norm"
    if cls in ROUTERS:
        return "kept", "router"
    if p.ndim < 2:
        return "kept", "vector"
    return "untouched", "no rule"


def coverage(model: torch.nn.Module, skipped: dict[str, str] | None = None, routers: tuple[str, ...] = (),
             planned: dict[str, str] | None = None) -> Coverage:
    """The coverage of `model` as it is now, or as a plan would leave it. skipped: {module name:
    reason} of Linears / experts the plan kept on purpose; routers: names of further modules
    kept as routers (e.g. the shared-expert gate Linears of Qwen2-MoE); planned: {module name:
    recipe} of float modules a plan will quantize (their weights >= 2-D count as quantized, so
    coverage is checked before the model is touched). Tied parameters are counted once."""
    planned = dict(planned or {})
    skipped = dict(skipped or {})
    skipped.update({r: "router" for r in routers})
    cov, seen = Coverage(), set()
    for mname, mod in model.named_modules():
        cls = type(mod).__name__
        if isinstance(mod, QuantLinear):
            cov.rows.append(Row(f"{mname}.weight", mname, cls, mod.out_features * mod.in_features, 2, "quantized",
                                str(mod.weight_scheme)))
        elif isinstance(mod, QuantExperts):
            for p in PROJECTIONS:
                n = getattr(mod, f"{p}_codes").numel()
                cov.rows.append(Row(f"{mname}.{p}", mname, f"QuantExperts({mod.family})", n, 3, "quantized",
                                    str(mod.weight_scheme)))
        for pname, p in mod.named_parameters(recurse=False):
            key = id(p)
            if key in seen:
                continue
            seen.add(key)
            status, reason = _rule(mod, p, skipped, mname)
            if mname in planned and p.ndim >= 2:
                status, reason = "quantized", planned[mname]
            if cls in EXPERTS and status == "untouched":
                reason = "fused MoE experts left in float"
            cov.rows.append(Row(f"{mname}.{pname}" if mname else pname, mname, cls, p.numel(), p.ndim, status, reason))
    return cov


def check_coverage(cov: Coverage, *, min_fraction: float = 0.01, on_untouched: str = "raise") -> None:
    """Raise ValueError (on_untouched="raise") or warn ("warn") when untouched weight tensors of
    >= 2 dimensions each hold >= min_fraction of the model's parameters; "ignore" does neither
    (the printed coverage still lists them)."""
    if on_untouched not in ("raise", "warn", "ignore"):
        raise ValueError(f"on_untouched={on_untouched!r}; choose 'raise', 'warn' or 'ignore'")
    if not 0 <= min_fraction <= 1:
        raise ValueError(f"min_fraction={min_fraction} must be a fraction in [0, 1]")
    bad = cov.untouched(min_fraction)
    if not bad or on_untouched == "ignore":
        return
    share = sum(r.numel for r in bad) / max(cov.total, 1)
    names = ", ".join(f"{r.name} ({r.kind}, {r.numel:,})" for r in bad[:8]) + (" ..." if len(bad) > 8 else "")
    msg = (f"{len(bad)} weight tensors holding {100 * share:.1f}% of the parameters would stay in float, "
           f"untouched by the recipe and explained by no rule: {names}. Teach lowbit where they are "
           "(lowbit.archs), or keep them on purpose with ignore=[...] (or on_untouched='warn')")
    if on_untouched == "raise":
        raise ValueError(msg)
    warnings.warn(msg, stacklevel=3)
