"""QuantizeJob: one typed description of a quantization run, built once and carried everywhere.

A job holds the resolved recipe, the ordered steps (lowbit.workflows.steps: rotation, SmoothQuant,
AWQ, override-worst-sites, static scales, MSE scales, GPTQ, KV-cache calibration), the LM-head
choice, and the ignore / override patterns. Building it is the one place where the names a user
types are parsed: a recipe name, an override's recipe or "skip", a KV-cache scheme, an LM-head
kind, a method name, a rotation, a site pick. Every refusal that needs no model is raised there
(ValueError naming the argument and the fix); the ones that need the model are each step's
`refuses(loaded)`, asked before the model is copied.

    import lowbit as lb
    from lowbit.workflows.steps import GPTQ, MSEScales
    job = lb.QuantizeJob.build("w4a16", [GPTQ(), MSEScales()], lm_head=None, ignore=["model.layers.0.*"])
    run = lb.quantize_job(loaded, texts, job)        # lowbit.workflows.quantize

`Measures` translates the keyword vocabulary of `lowbit quantize` (smoothquant=0.5, method="gptq",
awq=True, rotate="hadamard", mse=True, static=True, override_worst=..., override_by=...) into steps;
BEST holds the measured best steps per recipe (what `lowbit quantize` applies without a measure flag).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lowbit.diagnosis.sites import override_count
from lowbit.ops.kv_quant import KVScheme
from lowbit.recipes.presets import Recipe, get_lm_head_recipe, get_recipe
from lowbit.workflows.steps import (AWQ, GPTQ, KVCache, MSEScales, OverrideWorst, Rotate, SmoothQuant, StaticScales,
                                    Step)


def parse_recipe(name: str | Recipe) -> Recipe:
    """A recipe name in any letter case (a Recipe passes through); ValueError listing the known ones."""
    return get_recipe(name)


def parse_recipe_or_skip(text: str) -> str:
    """A recipe's canonical name, or "skip" (keep in high precision)."""
    if isinstance(text, str) and text.strip().lower() == "skip":
        return "skip"
    return get_recipe(text).name


def parse_kv_cache(text: str | KVScheme) -> KVCache:
    """The KV-cache step of a scheme name ('fp8', 'int8-head', 'int8-token', 'int4-g32', ...)."""
    scheme = KVScheme.parse(text)
    return KVCache(scheme, text if isinstance(text, str) else str(scheme))


def parse_lm_head(kind: str | Recipe) -> Recipe:
    """The weight-only recipe of an LM-head kind ("int8", "fp8", "w4a16")."""
    return get_lm_head_recipe(kind)


METHODS = ("rtn", "gptq")


def parse_method(name: str) -> tuple[Step, ...]:
    """The steps of a weight-code method: "rtn" (round to nearest: none) or "gptq"."""
    if name not in METHODS:
        raise ValueError(f"method={name!r}; choose 'rtn' (round to nearest) or 'gptq' (calibrated)")
    return (GPTQ(),) if name == "gptq" else ()


@dataclass(frozen=True)
class Measures:
    """The measures of `lowbit quantize`'s flags (and of the perplexity table's rows) in their
    keyword vocabulary; steps() is the job's list. smoothquant: alpha or None; override_worst:
    fraction of Linears (0: none) sent to override_to ("skip" or a recipe), picked by override_by
    ("block" SQNR or measured "kl"); method: "rtn" or "gptq"; rotate: "hadamard" or None."""
    smoothquant: float | None = None
    override_worst: float = 0.0
    override_to: str = "skip"
    override_by: str = "block"
    method: str = "rtn"
    awq: bool = False
    rotate: str | None = None
    mse: bool = False
    static: bool = False

    def steps(self) -> tuple[Step, ...]:
        out: list[Step] = []
        if self.rotate is not None:
            out.append(Rotate(self.rotate))
        if self.smoothquant is not None:
            out.append(SmoothQuant(self.smoothquant))
        if self.awq:
            out.append(AWQ())
        if self.override_worst > 0:
            out.append(OverrideWorst(self.override_worst, parse_recipe_or_skip(self.override_to), self.override_by))
        elif self.override_by != "block":    # a misspelt pick is refused even when no site is picked
            OverrideWorst(0.0, "skip", self.override_by)
        if self.static:
            out.append(StaticScales())
        if self.mse:
            out.append(MSEScales())
        return tuple(out) + parse_method(self.method)


def measures_of(steps) -> dict:
    """The steps' settings in the keyword vocabulary ({"smoothquant": 0.5, "method": "gptq", ...})."""
    out: dict = {}
    for s in steps:
        out.update(s.options())
    return out


@dataclass(frozen=True)
class QuantizeJob:
    """What one quantization run does (see the module docstring). Build it with QuantizeJob.build,
    which parses names and checks the combination; the fields are already resolved."""
    recipe: Recipe
    steps: tuple[Step, ...] = ()
    lm_head: Recipe | None = None
    lm_head_kind: str | None = None   # as the user named it ("int8", "fp8", "w4a16"), for reports
    ignore: tuple[str, ...] = ()
    overrides: dict = field(default_factory=dict)    # {pattern: recipe name or "skip"}, names canonical

    @classmethod
    def build(cls, recipe: str | Recipe, steps=(), *, kv_cache: str | KVScheme | None = None,
              lm_head: str | Recipe | None = None, ignore=None, overrides: dict | None = None) -> "QuantizeJob":
        """The job of `recipe` with `steps` (any order; a KV-cache step from kv_cache), the LM head
        quantized by the weight-only kind lm_head (None: high precision), `ignore` patterns kept in
        high precision and `overrides` {pattern: recipe or "skip"}. ValueError for a name that is not
        known or a combination that cannot run, before any model is loaded."""
        steps = tuple(steps) + ((parse_kv_cache(kv_cache),) if kv_cache is not None else ())
        for s in steps:
            if not isinstance(s, Step):
                raise TypeError(f"steps: {s!r} is not a lowbit.workflows.steps.Step; use e.g. SmoothQuant(0.5), "
                                "GPTQ()")
        kinds = [type(s) for s in steps]
        twice = sorted({k.__name__ for k in kinds if kinds.count(k) > 1})
        if twice:
            raise ValueError(f"steps: {', '.join(twice)} given more than once; give each step once")
        ordered = tuple(sorted(steps, key=lambda s: s.order))       # stable: GPTQ after MSEScales as given
        job = cls(parse_recipe(recipe), ordered, None if lm_head is None else parse_lm_head(lm_head),
                  None if lm_head is None else (lm_head if isinstance(lm_head, str) else lm_head.name),
                  tuple(ignore or ()), {p: parse_recipe_or_skip(r) for p, r in (overrides or {}).items()})
        for s in job.steps:
            s.check(job)
        return job

    def step(self, kind: type) -> Step | None:
        """The job's step of that class, or None."""
        return next((s for s in self.steps if isinstance(s, kind)), None)

    @property
    def kv_cache(self) -> KVCache | None:
        return self.step(KVCache)

    @property
    def needs_calib(self) -> bool:
        return any(s.needs_calib for s in self.steps)

    def measures(self) -> dict:
        """The steps' settings in the keyword vocabulary (the KV cache left out: it has its own line)."""
        return measures_of(s for s in self.steps if not isinstance(s, KVCache))


@dataclass(frozen=True)
class Best:
    """The measured best steps for one recipe and why. calib_tokens: the calibration tokens the
    measurement used, when `lowbit quantize`'s default (1,024) is not what was measured; the CLI
    uses them unless --calib-tokens is given."""
    steps: tuple[Step, ...]
    why: str
    calib_tokens: int | None = None

    @property
    def options(self) -> dict:
        return measures_of(self.steps)


# Every entry cites the measurement in docs/perplexity.md (SmolLM2-135M, 8,192 Wikipedia tokens) that
# made it the choice; recipes without a measured improvement within the override budget (<= 5% of
# Linears kept in bf16) stay plain.
BEST: dict[str, Best] = {
    "w8a8-int8": Best((SmoothQuant(0.5), OverrideWorst(0.05)),
                      "SmoothQuant 0.5 + the 10 worst sites (4.8% of Linears) in bf16: +0.75% perplexity "
                      "(KL 0.0093) on 8,192 tokens vs +2.80% plain (docs/perplexity.md)"),
    "w8a8-fp8": Best((GPTQ(), OverrideWorst(0.05, by="kl")),
                     "GPTQ on the fp8 weights + the 10 sites (4.8% of Linears) whose bf16 lowers the measured "
                     "next-token KL most, 2,048 calibration tokens: +0.88% perplexity (KL 0.0192, top-1 93.38%) on "
                     "8,192 tokens vs +1.09% (KL 0.0190) with the 10 worst "
                     "sites by block SQNR, +1.07% (KL 0.0185) with those on 4,096 calibration tokens"
                     ", +1.92% for the sites alone and +2.83% plain; the rows differ by less than the "
                     "evaluation's standard error (~0.25 points) and the KL pick costs ~11 minutes of calibration "
                     "on 2 cores against ~2.5 (docs/perplexity.md)",
                     calib_tokens=2048),
    "w4a16-g32": Best((AWQ(), GPTQ()),
                      "AWQ scales folded, then GPTQ (damp 0.1, act-order, held-out check), 2,048 calibration "
                      "tokens: +18.42% perplexity (KL 0.174, top-1 80.30%) vs "
                      "+19.12% (KL 0.192) for GPTQ on MSE-optimal scales, +23.01% (KL 0.291) for GPTQ alone and "
                      "+40.20% round to nearest (docs/perplexity.md)",
                      calib_tokens=2048),
    "w4a16": Best((GPTQ(), MSEScales()),
                  "GPTQ (damp 0.1, act-order, held-out check) on MSE-optimal group scales (weighted by the "
                  "Hessian diagonal), 2,048 calibration tokens: +30.28% perplexity (KL 0.282) vs +38.01% for "
                  "GPTQ alone and +72.47% round to nearest (docs/perplexity.md)",
                  calib_tokens=2048),
    "nvfp4": Best((SmoothQuant(0.5), GPTQ(), OverrideWorst(0.05)),
                  "SmoothQuant 0.5 + GPTQ on the NVFP4 weights + the 10 worst sites by block SQNR (4.8% of "
                  "Linears) in bf16: +23.57% perplexity (KL 0.2349, top-1 77.83%) on 8,192 tokens vs +29.58% "
                  "(KL 0.2798) without GPTQ and +55.93% plain (docs/perplexity.md)"),
    "mxfp4": Best((SmoothQuant(0.5), OverrideWorst(0.05)),
                  "SmoothQuant 0.5 + the 10 worst sites (4.8% of Linears) in bf16: +122.17% perplexity "
                  "vs +387.04% plain (docs/perplexity.md)"),
    "mxfp8": Best((OverrideWorst(0.05),),
                  "the 10 worst sites (4.8% of Linears) in bf16: +3.95% vs +7.83% plain (docs/perplexity.md)"),
    "w8a8-int8-tensor": Best((SmoothQuant(0.5), OverrideWorst(0.05)),
                             "SmoothQuant 0.5 + the 10 worst sites (4.8% of Linears) in bf16: +5.39% vs +108.61% "
                             "plain (docs/perplexity.md)"),
    "w4a16-asym": Best((OverrideWorst(0.05),),
                       "the 10 worst sites (4.8% of Linears) in bf16: +25.91% vs +33.16% plain (docs/perplexity.md)"),
}


def best_steps(recipe: str | Recipe) -> Best | None:
    """The measured best steps for `recipe`, or None (plain round to nearest)."""
    return BEST.get(parse_recipe(recipe).name)


def step_text(step: Step, n_linear: int) -> str:
    """What `step` will do on a model of n_linear Linear layers, in a clause (for the CLI's lines):
    the site pick names its count here (a fraction of a small model's Linears can be 0 sites)."""
    if isinstance(step, OverrideWorst):
        k = override_count(n_linear, step.fraction)
        by = "by measured next-token KL" if step.by == "kl" else "by block SQNR"
        to = "in high precision" if step.to == "skip" else f"in {step.to}"
        budget = f"{step.fraction:.0%} of this model's {n_linear} Linears"
        if k == 0:
            return f"no site kept {to} ({budget} is 0 sites)"
        return f"the {k} worst sites {by} kept {to} ({budget})"
    texts = {SmoothQuant: lambda s: f"SmoothQuant (alpha {s.alpha})", AWQ: lambda s: "AWQ scales",
             GPTQ: lambda s: "GPTQ weights", MSEScales: lambda s: "MSE-optimal scales",
             Rotate: lambda s: f"a {s.kind} rotation", StaticScales: lambda s: "static activation scales",
             KVCache: lambda s: f"a {s.name} KV cache"}
    return texts[type(step)](step)


def best_line(recipe: str | Recipe, best: Best, n_linear: int, calib_tokens: int) -> str:
    """The line `lowbit quantize` prints when it applies a recipe's best measured steps: what they
    do on this model (n_linear Linears, calib_tokens calibration tokens), and where they were
    measured (SmolLM2-135M; the figures are in docs/perplexity.md, not claimed for this model)."""
    what = "; ".join(step_text(s, n_linear) for s in best.steps)
    return (f"{parse_recipe(recipe).name}: applying the measures that measured best on SmolLM2-135M "
            f"(docs/perplexity.md): {what}; {calib_tokens} calibration tokens; --plain for round to nearest alone")
