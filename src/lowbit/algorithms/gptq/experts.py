"""GPTQ for the routed experts of one MoE block, per expert, on the tokens routed to it.

The statistics of expert e are those of its own tokens: the rows of the block's hidden states
whose top-k choice holds e (the experts module's own inputs hidden_states [T, H] and
top_k_index [T, k], captured as transformers passes them, so the routing is the router's,
not recomputed). Per expert and projection, as for a dense MLP:
    gate_up: H_e = X_e^T X_e / n_e, X_e the hidden states of e's tokens;
    down:    H_e of act(gate) * up of e's tokens, computed with e's gate_up as GPTQ just
             quantized it (and the activation quantization of the recipe), the inputs the
             quantized model feeds down_proj -- the sequential order of dense GPTQ.
Each is solved by lowbit.algorithms.gptq.solver (the one column loop), and the result is written
into lowbit.nn.experts.QuantExperts' per-expert codes and scales.

Few or no tokens (a documented rule, listed in the report): an expert with fewer than
`min_tokens` routed calibration tokens (default 32, counted over all batches) keeps round to
nearest's codes for both projections. Below that the held-out check (every holdout-th token,
4: fewer than 8 tokens) cannot tell GPTQ's fit to a handful of tokens from a real gain, and
an expert with no token has no Hessian at all. An expert with enough tokens keeps GPTQ's codes
only when GPTQ's output loss tr((W - Q) H (W - Q)^T) on its fit tokens is <= round to
nearest's and, where it has held-out tokens, its summed squared output error on them is too;
otherwise round to nearest's codes (named in the report). So every expert's codes have an
output loss on its own fit Hessian no larger than round to nearest's, by construction.

Under torch.distributed (each rank holding its share of the calibration batches) the routed
token counts are summed over ranks before the rule applies, each expert's Hessian and held-out
losses are the ranks' ordered sums (lowbit.algorithms.distributed: bit-identical to one process
holding all batches), and every rank solves every expert (same Hessian, same codes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lowbit.algorithms import distributed
from lowbit.algorithms.gptq.hessian import HessianAccumulator, _fit_rows, held_out_losses, output_loss
from lowbit.algorithms.gptq.options import GPTQOptions
from lowbit.algorithms.gptq.solver import gptq_quantize_group
from lowbit.archs.experts import ExpertsSpec
from lowbit.nn.experts import QuantExperts, _as_enk
from lowbit.ops.grouped import Routing, sort_tokens
from lowbit.algorithms.scale_search import search_scales
from lowbit.quantize import QTensor, quantize
from lowbit.scheme import QuantScheme



@dataclass
class ExpertFit:
    """One expert of one block: routed calibration tokens (fit + held out), and per projection
    the codes kept ("gptq", "rtn: few tokens", "rtn: fit loss", "rtn: held-out loss") and
    GPTQ's fit loss as a multiple of round to nearest's (nan when GPTQ did not run)."""
    expert: int
    tokens: int
    choice: dict[str, str] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)


@dataclass
class ExpertsCalibration:
    """What GPTQ did with every expert of one experts module."""
    name: str
    min_tokens: int
    experts: list[ExpertFit]

    def few(self) -> list[tuple[int, int]]:
        """(expert, routed tokens) of the experts kept at round to nearest for lack of tokens."""
        return [(f.expert, f.tokens) for f in self.experts if f.tokens < self.min_tokens]

    def fallbacks(self) -> list[tuple[int, str, str]]:
        """(expert, projection, why) of the enough-token experts that kept round to nearest."""
        return [(f.expert, p, c) for f in self.experts if f.tokens >= self.min_tokens
                for p, c in f.choice.items() if c != "gptq"]

    def __str__(self) -> str:
        gptq = sum(all(c == "gptq" for c in f.choice.values()) for f in self.experts)
        few = self.few()
        s = f"{self.name}: GPTQ on {gptq} of {len(self.experts)} experts"
        if few:
            s += (f"; round to nearest for {len(few)} with < {self.min_tokens} routed calibration tokens (expert: "
                  "tokens) " + ", ".join(f"{e}: {n}" for e, n in few))
        fb = self.fallbacks()
        if fb:
            s += "; round to nearest by the loss check: " + ", ".join(f"{e}.{p} ({c[5:]})" for e, p, c in fb)
        return s


def mse_weights(module: torch.nn.Module, spec: ExpertsSpec, scheme: QuantScheme) -> dict[str, list[QTensor]]:
    """Per projection, each expert's round-to-nearest QTensor on MSE-optimal (unweighted) scales
    (lowbit.algorithms.scale_search), for QuantExperts.from_module(quantized=...)."""
    out = {}
    for p, n in zip(("gate_up", "down"), spec.weights):
        w = _as_enk(getattr(module, n).detach(), spec.layout)
        out[p] = [quantize(w[e].float(), scheme, pad=True, scales=search_scales(w[e], scheme)) for e in range(w.shape[0])]
    return out


def expert_rows(routing: Routing, e: int) -> slice:
    """The rows of the sorted buffer that belong to expert e."""
    return slice(int(routing.offsets[e]), int(routing.offsets[e + 1]))


def _solve(w: torch.Tensor, xs: list[list[torch.Tensor]], rtn: list[QTensor], scheme: QuantScheme,
           tokens: list[int], fits: list[ExpertFit], proj: str, *, min_tokens: int, holdout: int, mse: bool,
           counts: list[int], **opts) -> list[QTensor]:
    """Per expert e of w [E, N, K]: GPTQ on xs[e] (its inputs, one [m, K] tensor per batch), or
    round to nearest's rtn[e] under the rule of the module docstring; fills fits[e]. mse: GPTQ and
    its round-to-nearest comparison on MSE-optimal scales weighted by e's Hessian diagonal.
    tokens: every rank's routed tokens per expert (summed); counts: every rank's batch count
    (one add per batch, empty ones included, so the ranks' chunked sums line up)."""
    out = []
    for e in range(w.shape[0]):
        fit = fits[e]
        if tokens[e] < min_tokens:
            fit.choice[proj], fit.ratio[proj] = "rtn: few tokens", math.nan
            out.append(rtn[e])
            continue
        K = w.shape[2]
        acc = HessianAccumulator(K, counts=counts)
        for x in xs[e]:
            acc.add(_fit_rows(x.reshape(-1, K), holdout))
        acc.reduce()      # a collective: every rank, same experts, same order
        h = acc.hessian()
        w64 = w[e].detach().double()
        sc, r_e = None, rtn[e]
        if mse:
            sc = search_scales(w[e].detach(), scheme, hdiag=torch.diagonal(h))
            r_e = quantize(w[e].detach().float(), scheme, pad=True, scales=sc)
        qg = gptq_quantize_group([w[e]], h, [scheme], split=False, scales=[sc], **opts)[0]
        dg, dr = w64 - qg.dequantize(torch.float64), w64 - r_e.dequantize(torch.float64)
        lq, lr = output_loss(w64, w64 - dg, h), output_loss(w64, w64 - dr, h)
        fit.ratio[proj] = lq / lr if lr > 0 else 1.0
        hv = held_out_losses([x for x in xs[e] if x.shape[0]], holdout, [dg, dr]) if holdout else None
        if lq > lr:
            fit.choice[proj] = "rtn: fit loss"
        elif hv is not None and float(hv[0]) > float(hv[1]):
            fit.choice[proj] = "rtn: held-out loss"
        else:
            fit.choice[proj] = "gptq"
        out.append(qg if fit.choice[proj] == "gptq" else r_e)
    return out


@torch.no_grad()
def gptq_experts(module: torch.nn.Module, spec: ExpertsSpec, weight_scheme: QuantScheme,
                 act_scheme: QuantScheme | None, inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 options: GPTQOptions | None = None, *, name: str = "experts",
                 **changes) -> tuple[QuantExperts, ExpertsCalibration]:
    """GPTQ of every expert of `module` (a family's fused experts module, `spec` its entry of
    lowbit.archs.experts) on `inputs`: per calibration batch the module's own call arguments
    (hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]). Returns the QuantExperts
    and the per-expert report. options: a GPTQOptions or its fields as keywords (as
    lowbit.algorithms.gptq.model.gptq_model's); min_tokens: the few-token rule (module docstring);
    mse: MSE-optimal scales (lowbit.algorithms.scale_search), weighted by each expert's Hessian
    diagonal for GPTQ, unweighted for the round-to-nearest experts (as quantize_model's mse).
    The module is not changed."""
    o = GPTQOptions.merge(options, changes, "gptq_experts")
    if o.targets != "quantized":
        raise NotImplementedError(f"{name}: GPTQ of MoE experts fits each expert's own weight; targets={o.targets!r} "
                                  "is not supported for experts")
    min_tokens, holdout, mse, backend = o.min_tokens, o.holdout, o.mse, o.backend
    if not inputs:          # (every rank holds at least one batch: lowbit.algorithms.distributed.shard)
        raise ValueError(f"{name}: no calibration batch reached the experts")
    kw = dict(spec.module_kwargs(), name=name)
    rtn = QuantExperts.from_module(module, weight_scheme, act_scheme, backend="exact", **kw)
    E = rtn.num_experts
    if mse:
        rtn_q = mse_weights(module, spec, weight_scheme)
    else:       # on the weights' device: a 4-bit module keeps its exact twin on the host
        dev = getattr(module, spec.gate_up).device
        rtn_q = {p: [q.to(dev) for q in rtn.weights_q(p)] for p in ("gate_up", "down")}
    routings = [sort_tokens(idx, E) for _, idx, _ in inputs]
    local = torch.stack([r.counts().cpu() for r in routings]).sum(0)
    tokens = distributed.all_sum(local.to(torch.int64)).tolist()      # every rank's tokens
    fits = [ExpertFit(e, tokens[e]) for e in range(E)]
    opts = dict(min_tokens=min_tokens, holdout=holdout, mse=mse, counts=distributed.counts(len(inputs)), damp=o.damp,
                block_size=o.block_size, act_order=o.act_order, static_groups=o.static_groups)
    w_gu = _as_enk(getattr(module, spec.gate_up).detach(), spec.layout)
    xs = [[x.reshape(-1, x.shape[-1])[r.token[expert_rows(r, e)]] for (x, _, _), r in zip(inputs, routings)]
          for e in range(E)]
    q_gu = _solve(w_gu, xs, rtn_q["gate_up"], weight_scheme, tokens, fits, "gate_up", **opts)
    # down's inputs through the gate_up just chosen (with the recipe's activation quantization)
    mid = QuantExperts.from_module(module, weight_scheme, act_scheme, backend="exact", quantized={"gate_up": q_gu},
                                   **kw)
    w_dn = _as_enk(getattr(module, spec.down).detach(), spec.layout)
    acts = [mid.glu(mid.gate_up_rows(x.reshape(-1, x.shape[-1]), r)).to(w_dn.device)   # the exact path: host
            for (x, _, _), r in zip(inputs, routings)]
    xs = [[a[expert_rows(r, e)] for a, r in zip(acts, routings)] for e in range(E)]
    q_dn = _solve(w_dn, xs, rtn_q["down"], weight_scheme, tokens, fits, "down", **opts)
    out = QuantExperts.from_module(module, weight_scheme, act_scheme, backend=backend,
                                   quantized={"gate_up": q_gu, "down": q_dn}, **kw)
    return out, ExpertsCalibration(name, min_tokens, fits)
