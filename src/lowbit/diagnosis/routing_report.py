"""The MoE routing report: per MoE layer of a quantized model, what quantization did to routing
and to each expert (a changed top-k choice is a discrete error, reported as one).

- Top-k flips: the tokens whose top-k expert SET differs between the float and the quantized
  model, with the router kept in high precision (what lowbit does) and, for comparison, with
  the router quantized as well (its weight by the experts' weight scheme, its input by their
  activation scheme: lowbit.quantize, applied in place for the run and restored). A flip is a
  discrete error -- the token's MoE output comes from other experts -- so each one is listed with
  its layer, batch, row and token position and both expert sets, not averaged into an SQNR.
- Expert load: routed tokens per expert in the float and the quantized model.
- Per-expert SQNR: of each quantized projection's weight against the float weight, and of each
  expert's output on the tokens the FLOAT router sends to it (the same inputs for both: the
  experts' own error, apart from routing), the quantized output from QuantExperts' exact path.

`routing_report(float_model, quantized_model, batches)` builds it; `plot_routing` draws the load
histograms and flip fractions to a PNG.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch

from lowbit.archs.experts import find_experts, router_of
from lowbit.archs.forward import run_batches
from lowbit.diagnosis.report import optional_png
from lowbit.nn.experts import PROJECTIONS, QuantExperts, _as_enk
from lowbit.ops.grouped import sort_tokens
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.quantize import quantize
from lowbit.verify.metrics import sqnr_db


@dataclass
class Flip:
    """One token whose top-k expert set changed: batch index, row within the batch, token
    position, and the float / quantized expert sets."""
    batch: int
    row: int
    position: int
    float_set: tuple[int, ...]
    quant_set: tuple[int, ...]


@dataclass
class LayerRouting:
    """One MoE layer. flips: with the router in high precision; flips_router_quantized: the
    count with the router quantized too. load_*: routed tokens per expert. weight_db:
    {projection: SQNR per expert}; output_db: per expert, on the float router's tokens (nan:
    the expert got none)."""
    router: str
    experts: str
    tokens: int
    flips: list[Flip]
    flips_router_quantized: int
    load_float: list[int]
    load_quant: list[int]
    weight_db: dict[str, list[float]] = field(default_factory=dict)
    output_db: list[float] = field(default_factory=list)
    quantized: bool = True      # False: the experts were kept in high precision (flips come from other layers)

    @property
    def flip_fraction(self) -> float:
        return len(self.flips) / max(self.tokens, 1)

    @property
    def flip_fraction_router_quantized(self) -> float:
        return self.flips_router_quantized / max(self.tokens, 1)


@dataclass
class RoutingReport:
    layers: list[LayerRouting]
    router_scheme: str          # how the router was quantized for the comparison

    def to_markdown(self, max_flips: int = 10) -> str:
        lines = ["| MoE layer | tokens | top-k set changed (router high precision) | (router quantized) | "
                 "worst expert output SQNR dB | worst expert weight SQNR dB | load per expert, float (min-max) |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for L in self.layers:
            finite = [v for v in L.output_db if not math.isnan(v)]
            wdb = min((v for vs in L.weight_db.values() for v in vs), default=math.nan)
            sqnr = (f"{min(finite, default=math.nan):.1f} | {wdb:.1f}" if L.quantized
                    else "kept in high precision | kept in high precision")
            lines.append(f"| {L.experts} | {L.tokens} | {len(L.flips)} ({L.flip_fraction:.2%}) | "
                         f"{L.flips_router_quantized} ({L.flip_fraction_router_quantized:.2%}) | {sqnr} | "
                         f"{min(L.load_float)}-{max(L.load_float)} |")
        lines += ["", f"Router quantized for the comparison as: {self.router_scheme}. A flip is a discrete "
                  "error (the token's MoE output comes from other experts); each is listed below.", ""]
        if not any(L.flips for L in self.layers):
            lines.append("- no token's top-k expert set changed (router high precision)")
        for L in self.layers:
            if L.flips:
                shown = ", ".join(f"batch {f.batch} row {f.row} position {f.position}: {list(f.float_set)} -> "
                                  f"{list(f.quant_set)}" for f in L.flips[:max_flips])
                more = f" (+{len(L.flips) - max_flips} more)" if len(L.flips) > max_flips else ""
                lines.append(f"- {L.experts}: {shown}{more}")
        lines += ["", "Expert load (routed tokens per expert, float -> quantized):", ""]
        for L in self.layers:
            lines.append(f"- {L.experts}: " + " ".join(f"{a}->{b}" if a != b else f"{a}"
                                                        for a, b in zip(L.load_float, L.load_quant)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def _batch_rows(b) -> int:
    """Token positions per row of a batch (input ids [B, T] or a dict holding them)."""
    x = b["input_ids"] if isinstance(b, dict) else b
    return int(x.shape[-1])


def _run(model, routers: list[str], experts: list[str], batches, want_inputs: bool):
    """Per router, the top-k indices of every batch; per experts module (want_inputs) its call's
    hidden states and top-k index."""
    idx = {r: [] for r in routers}
    inp = {e: [] for e in experts}
    hooks = []
    for r in routers:
        hooks.append(model.get_submodule(r).register_forward_hook(
            lambda m, a, out, r=r: idx[r].append(out[-1].detach().reshape(-1, out[-1].shape[-1]).cpu())))
    if want_inputs:
        for e in experts:
            def pre(m, a, kw, e=e):
                args = list(a) + [v for v in kw.values()]     # (hidden_states, top_k_index, top_k_weights)
                inp[e].append((args[0].detach(), args[1].detach()))
            hooks.append(model.get_submodule(e).register_forward_pre_hook(pre, with_kwargs=True))
    run_batches(model, batches, hooks)
    return idx, inp


@contextlib.contextmanager
def _routers_quantized(model, routers: list[str], schemes: dict[str, tuple]):
    """Each router's weight replaced by its round-to-nearest value under the weight scheme, and
    its input quantized by the activation scheme (if any), for the duration; restored after."""
    saved, hooks = {}, []
    try:
        with torch.no_grad():
            for r in routers:
                w_s, a_s = schemes[r]
                w = model.get_submodule(r).weight
                saved[r] = w.detach().clone()
                w.copy_(quantize(w.detach().float(), w_s, pad=True).dequantize(torch.float32).to(w.dtype))
                if a_s is not None:
                    def pre(m, a, a_s=a_s):
                        x = a[0]
                        q = quantize(x.reshape(-1, x.shape[-1]).float(), a_s).dequantize(torch.float32)
                        return (q.reshape(x.shape).to(x.dtype),) + tuple(a[1:])
                    hooks.append(model.get_submodule(r).register_forward_pre_hook(pre))
        yield
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for r, w in saved.items():
                model.get_submodule(r).weight.copy_(w)


def _sets(t: torch.Tensor) -> torch.Tensor:
    return t.sort(dim=1).values


def _float_weights(fmod, spec) -> dict[str, torch.Tensor]:
    # on the host, in float64, where QuantExperts' exact path computes its side
    return {p: _as_enk(getattr(fmod, n).detach(), spec.layout).double().cpu() for p, n in zip(PROJECTIONS, spec.weights)}


def expert_weight_sqnr(fmod, spec, q: QuantExperts, ws: dict[str, torch.Tensor] | None = None
                       ) -> dict[str, list[float]]:
    """{projection: SQNR dB per expert} of q's quantized weights against the float experts module
    `fmod` they were quantized from. After a fold (SmoothQuant / AWQ on the experts' down side)
    that is the folded module, not the original model's: the weights differ by the fold's
    factors, which are no quantization error. ws: fmod's _float_weights, when already made."""
    ws = _float_weights(fmod, spec) if ws is None else ws
    return {p: [sqnr_db(ws[p][e], q.weight_q(p, e).dequantize(torch.float64).cpu()) for e in range(q.num_experts)]
            for p in PROJECTIONS}


def _output_sqnr(fmod, spec, q: QuantExperts, inputs, ws: dict[str, torch.Tensor]) -> list[float]:
    """Per-expert output SQNR on the inputs [(hidden, idx)] (ws: fmod's _float_weights)."""
    bs = {p: (None if n is None else getattr(fmod, n).detach().double().cpu())
          for p, n in zip(PROJECTIONS, (spec.gate_up_bias, spec.down_bias))}
    sig, noise = [0.0] * q.num_experts, [0.0] * q.num_experts
    for x, idx in inputs:
        x = x.reshape(-1, x.shape[-1])
        r = sort_tokens(idx, q.num_experts)
        yq = q.sorted_forward(x, r).cpu()
        xs = x.double().cpu()[r.token.cpu()]
        for e in range(q.num_experts):
            a, b = int(r.offsets[e]), int(r.offsets[e + 1])
            if b == a:
                continue
            h = xs[a:b] @ ws["gate_up"][e].T + (0 if bs["gate_up"] is None else bs["gate_up"][e])
            yf = q.glu(h) @ ws["down"][e].T + (0 if bs["down"] is None else bs["down"][e])
            sig[e] += float(yf.square().sum())
            noise[e] += float((yf - yq[a:b]).square().sum())
    return [math.nan if s == 0 and n == 0 else (math.inf if n == 0 else 10 * math.log10(max(s, 1e-300) / n))
            for s, n in zip(sig, noise)]


def routing_report(float_model: torch.nn.Module, quantized_model: torch.nn.Module, batches,
                   weight_db: dict[str, dict[str, list[float]]] | None = None) -> RoutingReport:
    """The report of the module docstring for every MoE layer of `float_model` (its experts found
    by lowbit.archs.experts) against `quantized_model` (the same architecture, its experts
    replaced by QuantExperts at the same names). batches: input-id tensors [B, T] or dicts of
    model kwargs. weight_db: {experts module: expert_weight_sqnr(...)} measured against the
    weights actually quantized, where a fold made them differ from float_model's (the output
    SQNR needs no such care: the fold is exact). ValueError for a model without MoE experts or
    with no experts quantized."""
    found = find_experts(float_model)
    if not found:
        raise ValueError(f"{type(float_model).__name__} has no MoE experts with a router: no routing report")
    batches = list(batches)
    if not batches:
        raise ValueError("routing_report needs at least one batch of inputs")
    names, routers, schemes = list(found), [], {}
    for n, spec in found.items():
        r = router_of(float_model, n, spec)
        if r is None:
            raise ValueError(f"experts {n} ({spec.family}) has no router {spec.router!r} beside it")
        routers.append(r[0])
        q = quantized_model.get_submodule(n)
        if isinstance(q, QuantExperts):
            schemes[r[0]] = (q.weight_scheme, q.act_scheme)
    if not schemes:
        raise ValueError(f"no experts module of {type(float_model).__name__} is QuantExperts in the quantized model "
                         f"(e.g. {names[0]} is {type(quantized_model.get_submodule(names[0])).__name__}): quantize "
                         "the experts (quantize_model) before asking for their routing report")
    # experts kept in high precision (an ignore pattern) still route: their flips come from the
    # layers quantized before them; their routers are quantized for the comparison as the others'
    first = next(iter(schemes.values()))
    schemes = {r: schemes.get(r, first) for r in routers}
    f_idx, f_in = _run(float_model, routers, names, batches, want_inputs=True)
    q_idx, _ = _run(quantized_model, routers, names, batches, want_inputs=False)
    with _routers_quantized(quantized_model, routers, schemes):
        rq_idx, _ = _run(quantized_model, routers, names, batches, want_inputs=False)
    per_batch = [t.shape[0] for t in f_idx[routers[0]]]
    layers = []
    for n, r in zip(names, routers):
        fa, fb, fc = (torch.cat(d[r]) for d in (f_idx, q_idx, rq_idx))
        if fa.shape != fb.shape or fa.shape != fc.shape:
            raise ValueError(f"router {r}: top-k shapes differ between the models ({tuple(fa.shape)}, "
                             f"{tuple(fb.shape)}): they must see the same tokens")
        sa, sb, sc = _sets(fa), _sets(fb), _sets(fc)
        changed = (sa != sb).any(dim=1)
        flips = []
        starts = [sum(per_batch[:i]) for i in range(len(per_batch))]
        for t in torch.nonzero(changed).reshape(-1).tolist():
            bi = max(i for i, s in enumerate(starts) if s <= t)
            local, T = t - starts[bi], _batch_rows(batches[bi])
            flips.append(Flip(bi, local // T, local % T, tuple(sa[t].tolist()), tuple(sb[t].tolist())))
        q = quantized_model.get_submodule(n)
        quantized = isinstance(q, QuantExperts)
        E = int(getattr(float_model.get_submodule(n), found[n].gate_up).shape[0])
        load = lambda t: torch.bincount(t[t < E].reshape(-1), minlength=E).tolist()  # noqa: E731
        wdb, odb = {}, []
        if quantized:
            fmod = float_model.get_submodule(n)
            ws = _float_weights(fmod, found[n])
            wdb = weight_db[n] if weight_db and n in weight_db else expert_weight_sqnr(fmod, found[n], q, ws)
            odb = _output_sqnr(fmod, found[n], q, f_in[n], ws)
        layers.append(LayerRouting(r, n, int(fa.shape[0]), flips, int((sa != sc).any(dim=1).sum()),
                                   load(fa), load(fb), wdb, odb, quantized))
    desc = {r: f"weight {w}, input {a if a is not None else 'high precision'}" for r, (w, a) in schemes.items()}
    kinds = list(dict.fromkeys(desc.values()))
    # one scheme for every router, or each router's own where overrides mix recipes
    said = kinds[0] if len(kinds) == 1 else "; ".join(f"{r}: {d}" for r, d in desc.items())
    return RoutingReport(layers, said)


def plot_routing(report: RoutingReport, path: str) -> str:
    """PNG: top-k flip fraction per MoE layer (router high precision / quantized), and the
    expert-load histograms (float model; quantized minus float) as layer x expert maps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(report.layers)
    fig, axes = plt.subplots(1, 3, figsize=(17, 0.35 * n + 3.2))
    x = torch.arange(n).float()
    ax = axes[0]
    ax.barh(x - 0.2, [100 * L.flip_fraction for L in report.layers], height=0.4, label="router high precision")
    ax.barh(x + 0.2, [100 * L.flip_fraction_router_quantized for L in report.layers], height=0.4,
            label="router quantized")
    ax.set_yticks(x.tolist(), [L.experts.replace(".mlp.experts", "") for L in report.layers], fontsize=7)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel("% tokens whose top-k expert set changed")
    ax.set_title("routing flips vs the float model", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="x")
    load_f = torch.tensor([L.load_float for L in report.layers], dtype=torch.float64)
    load_q = torch.tensor([L.load_quant for L in report.layers], dtype=torch.float64)
    tokens = torch.tensor([max(L.tokens, 1) for L in report.layers], dtype=torch.float64)[:, None]
    im = axes[1].imshow((load_f / tokens).numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    axes[1].set_title("expert load, float model (routed tokens / tokens)", fontsize=10)
    fig.colorbar(im, ax=axes[1])
    diff = ((load_q - load_f) / tokens).numpy()
    lim = max(float(abs(diff).max()), 1e-9)
    im = axes[2].imshow(diff, aspect="auto", cmap="coolwarm", vmin=-lim, vmax=lim, interpolation="nearest")
    axes[2].set_title("expert load, quantized minus float", fontsize=10)
    fig.colorbar(im, ax=axes[2])
    labels = [L.experts.replace(".mlp.experts", "") for L in report.layers]
    for ax in axes[1:]:
        ax.set_xlabel("expert")
        ax.set_yticks(list(range(n)), labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def moe_routing(model: torch.nn.Module, recipe, batches, png: str | None, quantized: torch.nn.Module | None = None
                ) -> tuple[str, str | None] | None:
    """(markdown, PNG path or None) of the routing report of `model` (float) against `quantized`
    (default: a round-to-nearest copy under `recipe`, quantize_model); None for a model without
    MoE experts. What `lowbit sites` and `lowbit quantize` put in their reports."""
    if not find_experts(model):
        return None
    if quantized is None:
        quantized = copy.deepcopy(model)
        quantize_model(quantized, recipe, on_untouched="warn")
    rep = routing_report(model, quantized, batches)
    return rep.to_markdown(), (optional_png(plot_routing, rep, png) if png else None)
