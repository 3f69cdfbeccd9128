"""Per-site SQNR diagnosis: finding the quantized Linear that hurts the model most.

Forward pre-hooks on every Linear the recipe would quantize measure, on the float model's own
inputs (each layer sees exactly what the unquantized model feeds it):
  act SQNR     x against the recipe's activation quantizer applied to x;
  weight SQNR  W against its dequantized quantization;
  output SQNR  the float layer's output against the QuantLinear's output on the same x.
SQNR = 10 log10(sum signal^2 / sum noise^2), summed over all batches. Rows sort worst output
SQNR first, each with a suggested action.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from lowbit.algorithms import distributed
from lowbit.algorithms.smoothquant import fold_plan
from lowbit.archs.decoders import UnsupportedArchitecture
from lowbit.nn.quant_linear import QuantLinear, linear_float
from lowbit.recipes.plan import linear_layers, plan
from lowbit.recipes.presets import Recipe, get_recipe
from lowbit.progress import progress_bar

# Typical of W8A8 on decoders: most sites above about 30 dB, a few down-projection inputs well below.
GOOD_DB = 30.0
SITE_KINDS = {"q_proj": "q/k/v", "k_proj": "q/k/v", "v_proj": "q/k/v", "o_proj": "o",
              "gate_proj": "gate/up", "up_proj": "gate/up", "down_proj": "down",
              "qkv_proj": "q/k/v", "gate_up_proj": "gate/up",              # Phi-3's fused projections
              "query": "q/k/v", "key": "q/k/v", "value": "q/k/v"}


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) in dB; +inf for a noiseless site."""
    if noise <= 0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-300) / noise)


@dataclass
class SiteRow:
    """One Linear's diagnosis. layer: decoder-block index (-1 if none); kind: q/k/v, o, gate/up,
    down or the module's own name; outlier_ratio: largest per-channel input max over the median one."""
    name: str
    layer: int
    kind: str
    recipe: str
    act_db: float
    weight_db: float
    out_db: float
    outlier_ratio: float
    block_db: float = math.nan
    action: str = ""


@dataclass
class SiteReport:
    recipe: str
    rows: list[SiteRow] = field(default_factory=list)
    tokens: int = 0

    def worst(self, n: int = 10) -> list[SiteRow]:
        return self.rows[:n]

    def by_name(self) -> dict[str, SiteRow]:
        return {r.name: r for r in self.rows}

    def to_markdown(self, n: int = 10) -> str:
        lines = [f"| site | recipe | act SQNR dB | weight SQNR dB | output SQNR dB | block SQNR dB | outlier ratio "
                 "| suggested action |", "|---|---|---:|---:|---:|---:|---:|---|"]
        for r in self.rows[:n]:
            lines.append(f"| {r.name} | {r.recipe} | {r.act_db:.1f} | {r.weight_db:.1f} | {r.out_db:.1f} | "
                         f"{r.block_db:.1f} | {r.outlier_ratio:.0f} | {r.action} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        head = f"per-site SQNR under {self.recipe} ({len(self.rows)} sites, {self.tokens} tokens), worst first:"
        body = [f"  {r.block_db:6.1f} dB block  {r.out_db:6.1f} out  {r.act_db:6.1f} act  {r.weight_db:6.1f} weight  "
                f"{r.name}  -> {r.action}"
                for r in self.worst(10)]
        return "\n".join([head] + body)


def suggest(row: SiteRow, smoothable: bool = True) -> str:
    """The suggested action for a site, from which quantizer limits it. smoothable: whether
    SmoothQuant has an exact fold point for this site (lowbit.algorithms.smoothquant.fold_plan);
    where it has none (MoE experts, a family outside the decoder map, a Linear reading the residual
    stream without a norm in front) it is not suggested."""
    amplified = math.isfinite(row.block_db) and row.block_db < GOOD_DB
    if row.out_db >= GOOD_DB and not amplified:
        return "ok"
    if row.out_db >= GOOD_DB:
        return (f"its block amplifies this site's noise into the residual stream (block SQNR "
                f"{row.block_db:.0f} dB): keep it in bf16 or switch it to fp8")
    if row.act_db <= row.weight_db:
        return (f"activation outliers (max channel {row.outlier_ratio:.0f}x the median): "
                + ("SmoothQuant, switch" if smoothable else "switch") + " this site to fp8 (w8a8-fp8), or keep it in bf16"
                + ("" if smoothable else " (SmoothQuant has no exact fold point here)"))
    return "weight quantization limits it: finer granularity (smaller groups) or keep it in bf16"


def _smoothable(model: torch.nn.Module) -> set[str]:
    """Names of the Linears SmoothQuant can smooth exactly (the consumers of fold_plan's groups);
    none for a model it refuses (MoE experts, a family outside lowbit.archs.decoders)."""
    try:
        groups, _ = fold_plan(model)
    except UnsupportedArchitecture:
        return set()
    return {c for g in groups for c in g.consumers}


def _layer_and_kind(name: str) -> tuple[int, str]:
    m = re.search(r"(?:layers|layer|h|blocks)\.(\d+)\.", name)
    leaf = name.rsplit(".", 1)[-1]
    return (int(m.group(1)) if m else -1), SITE_KINDS.get(leaf, leaf)


_BLOCK = re.compile(r"^(.*\.(?:layers|layer|h|blocks)\.\d+)\.")


def _first_tensor(out):
    return out if isinstance(out, torch.Tensor) else out[0]


@torch.no_grad()
def site_report(model: torch.nn.Module, batches: Iterable, recipe: str | Recipe, *, ignore=None,
                overrides=None, block: bool = True, progress: bool = False,
                quantized: dict[str, QuantLinear] | None = None) -> SiteReport:
    """Diagnose every Linear that quantize_model(model, recipe, ignore, overrides) would quantize,
    on the FLOAT model (it is not changed). batches: input-id tensors [B, T] or dicts of kwargs.

    block=True adds `block_db` for sites inside a numbered block (`...layers.N.`): the SQNR of
    that block's output (the residual stream) when ONLY this site is quantized, on the block's
    float input. A layer-output SQNR says how noisy a site is; the block SQNR says how much of
    that noise reaches the residual stream, which is what the model's output feels. Rows sort
    worst block SQNR first when it was measured, else worst output SQNR first.
    quantized: name -> QuantLinear whose stored weight replaces round-to-nearest's for that site
    (e.g. the layers GPTQ chose), to diagnose a calibrated model's codes on the float model's inputs."""
    base = get_recipe(recipe)
    summary = plan(model, base, ignore, overrides)
    layers = linear_layers(model)
    sites = {d.name: (layers[d.name], summary.recipe_of(d)) for d in summary.quantized}
    stats = {n: [0.0] * 6 + [None] for n in sites}   # act sig/noise, out sig/noise, block sig/noise, chan max
    qlayers: dict[str, QuantLinear] = {}
    wdb: dict[str, float] = {}
    for n, (lin, r) in sites.items():
        q = quantized[n] if quantized and n in quantized else QuantLinear.from_linear(lin, r.weight, r.act, pad=True)
        w = lin.weight.detach().float()
        wdb[n] = sqnr_db(float(w.pow(2).sum()), float((w - q.weight_dequantized()).pow(2).sum()))
        qlayers[n] = q
    busy = [False]                                  # True while a block is re-run with one site quantized
    # The float pass's input and output of each site of the block being run, and its quantized
    # output (forward_2d, what QuantLinear's CPU path returns): a block re-run for site n reuses
    # them for every site whose input is unchanged (those that do not read n's output), so only
    # what lies downstream of n is computed again. Equality of the input is checked, not assumed.
    seen: dict[str, tuple] = {}

    def make(name):
        def hook(mod, args):
            if busy[0]:
                return
            x = args[0].detach().float().reshape(-1, mod.in_features)
            q, st = qlayers[name], stats[name]
            yq, deq = q.forward_2d(x)
            if block:
                seen[name] = (args[0], yq)
            if q.act_scheme is not None:
                if deq is None:                      # kernel path: quantize once more to see the input
                    deq = q.quantize_input(x)[2]
                st[0] += float(x.pow(2).sum())
                st[1] += float((x - deq[:, :x.shape[1]]).pow(2).sum())
            y = linear_float(mod, x)
            st[2] += float(y.pow(2).sum())
            st[3] += float((y - yq).pow(2).sum())
            cm = x.abs().amax(dim=0)
            st[6] = cm if st[6] is None else torch.maximum(st[6], cm)
        return hook

    def make_out(name):
        def hook(mod, args, output):
            if not busy[0] and name in seen:
                seen[name] = seen[name] + (output,)
        return hook

    def replay(name, quantized):
        """A stand-in forward for site `name` in a re-run: on the float pass's input, its float
        output or (quantized) its quantized one, without computing either again."""
        lin = layers[name]
        x0, yq, *out = seen[name]
        q = qlayers[name]

        def fwd(x):
            if x.shape == x0.shape and torch.equal(x, x0) and not (quantized and q._fast_ok(x)):
                if quantized:
                    return yq.reshape(*x.shape[:-1], q.out_features).to(x.dtype)
                if out:
                    return out[0]
            if quantized:
                return q(x).to(x.dtype)
            return type(lin).forward(lin, x)
        return fwd

    def make_block(names):
        def hook(mod, args, kwargs, output):
            if busy[0]:
                return
            ref = _first_tensor(output).detach().float()
            busy[0] = True
            try:
                for n in names:
                    for m in names:
                        if m in seen:
                            layers[m].forward = replay(m, m == n)
                    try:
                        out = _first_tensor(mod(*args, **kwargs)).float()
                    finally:
                        for m in names:
                            layers[m].__dict__.pop("forward", None)
                    stats[n][4] += float(ref.pow(2).sum())
                    stats[n][5] += float((out - ref).pow(2).sum())
            finally:
                busy[0] = False
                for m in names:
                    seen.pop(m, None)
        return hook

    hooks = [lin.register_forward_pre_hook(make(n)) for n, (lin, _) in sites.items()]
    if block:
        hooks += [lin.register_forward_hook(make_out(n)) for n, (lin, _) in sites.items()]
    blocks: dict[str, list[str]] = {}
    if block:
        for n in sites:
            m = _BLOCK.match(n)
            if m:
                blocks.setdefault(m.group(1), []).append(n)
        hooks += [model.get_submodule(b).register_forward_hook(make_block(ns), with_kwargs=True)
                  for b, ns in blocks.items()]
    # A re-run block must not append to a KV cache: run HF models without one.
    extra = {"use_cache": False} if getattr(getattr(model, "config", None), "use_cache", None) is not None else {}
    tokens = 0
    try:
        it = list(batches)
        if progress:
            it = progress_bar(it, desc=f"per-site SQNR ({base.name})", unit="batch", leave=False)
        for b in it:
            model(**b, **extra) if isinstance(b, dict) else model(b, **extra)
            ids = b["input_ids"] if isinstance(b, dict) else b
            tokens += ids.numel() // (ids.shape[-1] if ids.is_floating_point() else 1)   # float inputs: [..., K]
    finally:
        for h in hooks:
            h.remove()
        seen.clear()
    if distributed.active():
        # this rank ran its share of the batches: the SQNR sums are all ranks' (float64 SUM, equal
        # to one process's up to float64 rounding), the channel maxima MAX (exact)
        for n in sorted(sites):
            st, lin = stats[n], sites[n][0]
            st[:6] = distributed.all_sum(torch.tensor(st[:6], dtype=torch.float64)).tolist()
            cm = st[6] if st[6] is not None else torch.zeros(lin.in_features, device=lin.weight.device)
            st[6] = distributed.all_max(cm)
        tokens = distributed.all_count(tokens)
    report = SiteReport(base.name, tokens=tokens)
    smoothable = _smoothable(model)
    for n, (lin, r) in sites.items():
        a_s, a_n, o_s, o_n, b_s, b_n, cm = stats[n]
        if cm is None:
            raise ValueError(f"layer {n} saw no input: the batches never reach it")
        layer, kind = _layer_and_kind(n)
        ratio = float(cm.max() / cm.median().clamp_min(1e-30))
        row = SiteRow(n, layer, kind, r.name, sqnr_db(a_s, a_n) if r.act is not None else math.inf,
                      wdb[n], sqnr_db(o_s, o_n), ratio, block_db=sqnr_db(b_s, b_n) if b_s > 0 else math.nan)
        row.action = suggest(row, n in smoothable)
        report.rows.append(row)
    if any(math.isfinite(r.block_db) for r in report.rows):
        report.rows.sort(key=lambda r: (not math.isfinite(r.block_db), r.block_db if math.isfinite(r.block_db)
                                        else r.out_db))
    else:
        report.rows.sort(key=lambda r: r.out_db)
    return report


def override_count(n_linear: int, max_fraction: float) -> int:
    """How many of a model's n_linear Linear layers a budget of max_fraction may override."""
    return int(math.floor(max_fraction * n_linear))


def pick_overrides(report: SiteReport, n_linear: int, max_fraction: float = 0.05,
                   to: str = "skip", below_db: float | None = None) -> dict[str, str]:
    """The worst sites in the report's order (block SQNR when measured), at most max_fraction of
    the model's n_linear Linear layers, mapped to `to` ("skip" keeps them in high precision, or a
    recipe). below_db: only sites whose layer-output SQNR is below it. (lowbit.diagnosis.site_kl picks
    by the measured effect on the model's next-token distribution instead.)"""
    k = override_count(n_linear, max_fraction)
    rows = [r for r in report.rows if below_db is None or r.out_db < below_db]
    return {r.name: to for r in rows[:k]}


def plot_sites(reports: list[SiteReport], path: str, labels: list[str] | None = None) -> str:
    """PNG of SQNR by decoder layer, one line per projection name: one row of panels (act, weight, output, block SQNR)
    per report (e.g. before/after SmoothQuant). Returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = labels or [r.recipe for r in reports]
    fig, axes = plt.subplots(len(reports), 4, figsize=(20, 3.6 * len(reports)), squeeze=False)
    for i, (rep, lab) in enumerate(zip(reports, labels)):
        leaf = lambda r: r.name.rsplit(".", 1)[-1]  # noqa: E731  one line per projection (q, k, v, ...)
        kinds = sorted({leaf(r) for r in rep.rows})
        for j, (attr, title) in enumerate([("act_db", "input activation"), ("weight_db", "weight"),
                                           ("out_db", "layer output"), ("block_db", "block output, this site only")]):
            ax = axes[i][j]
            drawn = False
            for kind in kinds:
                pts = sorted((r.layer, getattr(r, attr)) for r in rep.rows if leaf(r) == kind)
                pts = [(l, v) for l, v in pts if math.isfinite(v)]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=kind)
                    drawn = True
            if not drawn:   # e.g. the input activations of a weight-only recipe: exact, infinite SQNR
                ax.text(0.5, 0.5, "no finite SQNR (not quantized)", ha="center", va="center",
                        transform=ax.transAxes, color="gray")
            if attr != "block_db":               # the 30 dB rule of thumb is about a site's own SQNR
                ax.axhline(GOOD_DB, color="gray", ls="--", lw=0.8)
            ax.set_title(f"{lab}\n{title} SQNR", fontsize=10)
            ax.set_xlabel("decoder layer")
            ax.set_ylabel("dB")
            ax.grid(alpha=0.3)
        # the legend on the row's first panel with lines (a weight-only recipe's first panel has none)
        ax = next((a for a in axes[i] if a.get_legend_handles_labels()[0]), None)
        if ax is not None:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
