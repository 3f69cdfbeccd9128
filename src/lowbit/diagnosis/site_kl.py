"""Overrides picked by their measured effect on the model's output (`override_by="kl"`).

The per-site report ranks a site by its block SQNR: how much of its noise reaches the residual
stream. That says nothing of how much the later blocks and the logits care about that noise. This
module measures it instead, on the CALIBRATION batches (never evaluation text), as a mean
next-token KL divergence from the float model, in one of two ways (`effect`):

- "alone" (default): the float model with only that site quantized: the site's own noise as the
  output distribution feels it; the n largest are picked.
- "restore": the fully quantized model with only that site overridden: how much the KL drops;
  picked by lazy greedy (the shortlisted site with the largest drop is re-measured with the sites
  picked so far overridden; picked if still the largest, else put back with its new drop). Such a
  drop also holds the site's cross terms with every other site's noise, which a few thousand
  calibration tokens do not average out (docs/perplexity.md measures both).

Both first screen every candidate on the first `screen` batches, then measure a shortlist (3 n)
on all of them. A candidate in decoder block b re-runs only blocks b.. (the block outputs of the
model it is measured in are cached per batch and replayed), so one measurement costs (L - b) / L
of a forward. Causal language models only (the KL is of next-token distributions); sites outside
a numbered block re-run the whole model.
"""
from __future__ import annotations

import copy
import heapq
import math
import re
from dataclasses import dataclass, field

import torch

from lowbit.nn.quant_linear import QuantLinear
from lowbit.options import Options
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.progress import progress_bar
from lowbit.recipes.plan import linear_layers, plan
from lowbit.recipes.presets import get_recipe
from lowbit.verify.metrics import kl_sum

EFFECTS = ("alone", "restore")
_BLOCK = re.compile(r"^(.*\.(?:layers|layer|h|blocks))\.(\d+)\.")


@dataclass
class KLPick:
    """picked: site names in the order chosen; gains: name -> KL drop (nats per token, on all
    calibration batches) when it was picked; screened: name -> KL drop on the screening batches
    (every candidate); kl_quantized / kl_picked: mean KL(float || model) on the calibration batches
    of the fully quantized model and of the model with the picked sites overridden (effect "restore";
    NaN for "alone", which never runs the fully quantized model)."""
    picked: list[str] = field(default_factory=list)
    gains: dict[str, float] = field(default_factory=dict)
    screened: dict[str, float] = field(default_factory=dict)
    kl_quantized: float = 0.0
    kl_picked: float = 0.0
    measurements: int = 0

    def __str__(self) -> str:
        if math.isnan(self.kl_quantized):     # effect "alone": each site's own KL, nothing summed
            lines = [f"sites picked by measured KL, each quantized alone in the float model ({self.measurements} "
                     "measurements): mean KL on the calibration text"]
            lines += [f"  {n}: {self.gains[n]:.5f}" for n in self.picked]
            return "\n".join(lines)
        lines = [f"sites picked by measured KL: mean KL on the calibration text {self.kl_quantized:.5f} -> "
                 f"{self.kl_picked:.5f} nats ({self.measurements} measurements)"]
        lines += [f"  {n}: -{self.gains[n]:.5f}" for n in self.picked]
        return "\n".join(lines)


def _logits(out) -> torch.Tensor:
    return out.logits[0, :-1].double()


class _Replay(torch.nn.Module):
    """Stands in for blocks 0..b-1: returns their cached output for the current batch."""

    def __init__(self, outputs: list):
        super().__init__()
        self.outputs, self.i = outputs, 0

    def forward(self, *args, **kwargs):
        return self.outputs[self.i]


class _Runner:
    """The quantized model with per-batch caches of every block's output, re-run from a block."""

    def __init__(self, model: torch.nn.Module, batches: list, ref_logp: list, container: str | None):
        self.model, self.batches, self.ref_logp = model, batches, ref_logp
        self.container = container
        self.blocks = model.get_submodule(container) if container else None
        self.cache: list[list] = []           # cache[i][w]: output of block i on batch w
        self.kl = self.run(0, range(len(batches)), capture=True)

    def run(self, start: int, which, capture: bool = False) -> float:
        """Sum over the batches `which` of the per-token KL sums, re-running blocks start.. (start
        0 or no container: the whole model); capture: store the block outputs (start.. only)."""
        hooks, total, cur = [], 0.0, [0]
        extra = {"use_cache": False}
        if capture and self.blocks is not None:
            if not self.cache:
                self.cache = [[None] * len(self.batches) for _ in self.blocks]
            for i in range(start, len(self.blocks)):
                def hook(mod, args, out, i=i):
                    self.cache[i][cur[0]] = out
                hooks.append(self.blocks[i].register_forward_hook(hook))
        swapped = None
        if self.blocks is not None and start > 0:
            parent, _, attr = self.container.rpartition(".")
            holder = self.model.get_submodule(parent) if parent else self.model
            replay = _Replay(self.cache[start - 1])
            swapped = (holder, attr, self.blocks)
            setattr(holder, attr, torch.nn.ModuleList([replay] + list(self.blocks)[start:]))
        try:
            for w in which:
                cur[0] = w
                if swapped is not None:
                    replay.i = w
                total += kl_sum(self.ref_logp[w], _logits(self.model(self.batches[w], **extra)))
        finally:
            for h in hooks:
                h.remove()
            if swapped is not None:
                setattr(*swapped)
        return total


@dataclass(frozen=True)
class KLPickOptions(Options):
    """How kl_pick measures and picks (kl_pick's docstring says what each means)."""
    to: str = "skip"
    effect: str = "alone"
    screen: int = 1
    shortlist: int | None = None

    def __post_init__(self):
        if self.effect not in EFFECTS:
            raise ValueError(f"effect={self.effect!r}: choose 'alone' (site quantized alone in the float model) or "
                             "'restore' (site overridden alone in the quantized model)")


@torch.no_grad()
def kl_pick(model: torch.nn.Module, batches: list, recipe, n: int, options: KLPickOptions | None = None, *,
            ignore=None, overrides=None, progress: bool = False, **changes) -> KLPick:
    """Pick `n` of the Linears that quantize_model(model, recipe, ignore, overrides) would quantize,
    to be overridden to `to` ("skip": kept in high precision, or a recipe name), by a measured
    next-token KL(model || ...) on `batches` (input-id tensors [1, T] of calibration text). The model
    is not changed. options: a KLPickOptions (to, effect, screen, shortlist) or its fields as keywords.
    effect:
      "alone"    the float model with ONLY that site quantized (minus the same with the site under
                 `to`): how much of the site's own noise reaches the output distribution; the n
                 largest are picked (the block SQNR's question, asked of the logits);
      "restore"  the fully quantized model minus the same with that site overridden, picked greedily
                 (lazy greedy: each pick given the ones before). Its single-site drops hold the site's
                 cross terms with the other sites' noise, which do not average out on a few thousand
                 tokens (docs/perplexity.md: noisier picks than "alone").
    screen: how many batches rank every candidate before the shortlist (default 3 n) is measured on
    all of them."""
    o = KLPickOptions.merge(options, changes, "kl_pick")
    to, effect, screen, shortlist = o.to, o.effect, o.screen, o.shortlist
    if n <= 0:
        return KLPick()
    batches = list(batches)
    if not batches or not all(isinstance(b, torch.Tensor) and b.dim() == 2 and b.shape[0] == 1 for b in batches):
        raise ValueError("kl_pick needs calibration batches of input ids [1, T] of a causal language model")
    if not 1 <= screen <= len(batches):
        raise ValueError(f"screen={screen}: give 1..{len(batches)} (the number of calibration batches)")
    shortlist = 3 * n if shortlist is None else shortlist
    if shortlist < n:
        raise ValueError(f"shortlist={shortlist} < n={n}: the shortlist must hold the sites to pick")
    floats = linear_layers(model)
    ref_logp = [torch.log_softmax(_logits(model(b, use_cache=False)), dim=-1) for b in batches]
    base = copy.deepcopy(model)
    if effect == "restore":
        summary = quantize_model(base, recipe, ignore=ignore, overrides=overrides, share_inputs=False)
    else:
        summary = plan(model, recipe, ignore, overrides)
    names = [d.name for d in summary.quantized]
    if n > len(names):
        raise ValueError(f"n={n} but only {len(names)} Linears are quantized")
    alt = None if to == "skip" else get_recipe(to)
    alts: dict = {}
    quants = {d.name: d for d in summary.quantized}

    def kept(name):               # the site as the override makes it
        if alt is None:
            return floats[name]
        if name not in alts:
            alts[name] = QuantLinear.from_linear(floats[name], alt.weight, alt.act, pad=True)
        return alts[name]

    def quantized(name):          # the site as the recipe makes it (effect "alone": built when measured)
        r = summary.recipe_of(quants[name])
        return QuantLinear.from_linear(floats[name], r.weight, r.act, pad=True)

    m = _BLOCK.match(names[0])
    container = m.group(1) if m else None
    block = {s: (int(_BLOCK.match(s).group(2)) if container and _BLOCK.match(s)
                 and _BLOCK.match(s).group(1) == container else 0) for s in names}
    runner = _Runner(base, batches, ref_logp, container)
    tokens = sum(b.shape[1] - 1 for b in batches)
    mods = {k: v for k, v in base.named_modules() if k in block}
    out = KLPick(kl_quantized=runner.kl / tokens if effect == "restore" else math.nan,
                 kl_picked=math.nan)

    def setsite(name, mod):
        parent, _, attr = name.rpartition(".")
        setattr(base.get_submodule(parent), attr, mod)

    def with_site(name, mod, which):   # KL sum on `which` with `name` replaced by mod
        setsite(name, mod)
        try:
            out.measurements += 1
            return runner.run(block[name], which)
        finally:
            setsite(name, mods[name])

    def score(name, which, kl_base):   # how much overriding `name` lowers the KL sum on `which`
        if effect == "restore":
            return kl_base - with_site(name, kept(name), which)
        q = quantized(name)
        return with_site(name, q, which) - (kl_base if alt is None else with_site(name, kept(name), which))

    it = names
    if progress:
        it = progress_bar(names, desc=f"KL screen ({len(names)} sites)", unit="site", leave=False)
    first = range(screen)
    base_screen = runner.run(0, first) if screen < len(batches) else runner.kl
    scr_tokens = sum(batches[w].shape[1] - 1 for w in first)
    out.screened = {s: score(s, first, base_screen) / scr_tokens for s in it}
    short = sorted(names, key=lambda s: -out.screened[s])[:shortlist]
    every = range(len(batches))
    if effect == "alone":             # independent effects: the n largest on every batch
        full = {s: score(s, every, runner.kl) for s in short}
        out.picked = sorted(short, key=lambda s: -full[s])[:n]
        out.gains = {s: full[s] / tokens for s in out.picked}
        return out
    heap = [(-score(s, every, runner.kl), s, 0) for s in short]   # (-drop, name, picks when measured)
    heapq.heapify(heap)
    while len(out.picked) < n:
        neg, s, when = heapq.heappop(heap)
        if when == len(out.picked):
            out.picked.append(s)
            out.gains[s] = -neg / tokens
            mods[s] = kept(s)
            setsite(s, mods[s])
            runner.kl = runner.run(block[s], every, capture=True)   # later blocks' cached outputs change
        else:
            heapq.heappush(heap, (-score(s, every, runner.kl), s, len(out.picked)))
    out.kl_picked = runner.kl / tokens
    return out
