"""Routing flips: how often quantization changes which experts a token is sent to.

A changed top-k choice is a discrete error: the token's MoE output is then a
different function, not a slightly perturbed one. The routers stay in high precision, but
their inputs are the residual stream after every quantized layer before them, so a router can
still choose differently. `routing_flips(float_model, quantized_model, batches)` runs both
models on the same inputs, records each router's top-k indices (forward hooks on the router
modules that lowbit.archs.experts locates beside every experts module) and reports, per MoE
layer, the fraction of tokens whose top-k SET changed (DeepSeek-V3's router returns its top-k
unsorted, so only the set is compared).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.archs.experts import find_experts, router_of
from lowbit.archs.forward import run_batches


@dataclass
class LayerFlips:
    """One router: tokens seen and tokens whose top-k expert set changed."""
    router: str
    tokens: int
    set_changed: int

    @property
    def set_fraction(self) -> float:
        return self.set_changed / max(self.tokens, 1)


def routers(model: torch.nn.Module) -> list[str]:
    """Names of the routers beside every (float) experts module of `model`."""
    out = []
    for name, spec in find_experts(model).items():
        r = router_of(model, name, spec)
        if r is None:
            raise ValueError(f"experts {name} ({spec.family}) has no router {spec.router!r} beside it")
        out.append(r[0])
    return out


def _record(model: torch.nn.Module, names: list[str], batches) -> dict[str, list[torch.Tensor]]:
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = []
    for n in names:
        mod = model.get_submodule(n)

        def hook(_m, _inp, out, n=n):
            idx = out[-1] if isinstance(out, tuple) else out    # transformers 5 routers return (..., indices)
            seen[n].append(idx.detach().reshape(-1, idx.shape[-1]).cpu())
        hooks.append(mod.register_forward_hook(hook))
    run_batches(model, batches, hooks)
    return seen


def routing_flips(float_model: torch.nn.Module, quantized_model: torch.nn.Module, batches) -> list[LayerFlips]:
    """Per router of `float_model` (found by lowbit.archs.experts, before its experts were
    replaced), the tokens of `batches` (input-id tensors [B, T] or dicts of model kwargs) whose
    top-k expert set differs in `quantized_model` (the same architecture, routers
    at the same names). Raises ValueError when the float model has no MoE router."""
    names = routers(float_model)
    if not names:
        raise ValueError(f"{type(float_model).__name__} has no MoE experts with a router: nothing to compare")
    batches = list(batches)
    a, b = _record(float_model, names, batches), _record(quantized_model, names, batches)
    out = []
    for n in names:
        fa, fb = torch.cat(a[n]), torch.cat(b[n])
        if fa.shape != fb.shape:
            raise ValueError(f"router {n}: {tuple(fa.shape)} top-k choices in the float model, {tuple(fb.shape)} "
                             "in the quantized one; they must see the same tokens")
        same_set = (fa.sort(dim=1).values == fb.sort(dim=1).values).all(dim=1)
        out.append(LayerFlips(n, int(fa.shape[0]), int((~same_set).sum())))
    return out


def format_flips(flips: list[LayerFlips]) -> str:
    lines = ["router                                  tokens  top-k set changed"]
    for f in flips:
        lines.append(f"{f.router:<40}{f.tokens:>6}  {f.set_fraction:>17.2%}")
    return "\n".join(lines)
