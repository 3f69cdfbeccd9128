"""The steps of a quantization job: one class per algorithm, each with the same small protocol.
(The step that picks sites by the per-site diagnosis, OverrideWorst, sits above the diagnosis in
lowbit.workflows.steps, which also re-exports every class here.)

    needs_calib          whether it reads calibration batches
    refuses(loaded)      why it cannot run on this model (a sentence naming the fix), or None;
                         asked for every step before the model is copied or changed
    check(job)           its refusals that depend on the rest of the job (the recipe, the other
                         steps, the LM head), raised as ValueError when the job is built
    apply(state)         what it does to the whole model (a copy the workflow owns), in place
    stream, apply_layer(run)   the layer-by-layer pipeline's side (lowbit.pipelines.layerwise): which
                         activation stream the step reads ("F" the float model as loaded, "S" after
                         the folds, "Q" the quantized model so far; None: not available layer by
                         layer) and what it does to one decoder layer on it
    quantize_options()   what it asks of the quantization itself (GPTQ's codes, MSE scales)
    options()            its settings in the keyword vocabulary of `lowbit quantize`'s report

A job runs its steps in `order` (ORDER below): rotation, the folds, the site picks, the static
scales, then the quantization (GPTQ and MSE scales choose its codes), then what reads the quantized
model (the KV cache's scales). lowbit.workflows.job sorts them, so a list may be written in any order.
The whole-model workflow (lowbit.workflows.quantize) runs every step; the layer-by-layer pipeline
(lowbit.pipelines.layerwise) runs the same SmoothQuant, StaticScales and GPTQ objects, one decoder
layer at a time, and refuses the others by name.

A new algorithm is one class here and its test; the job, the workflow and the report need no change.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lowbit.algorithms.awq import awq_model
from lowbit.algorithms.experts_fold import awq_experts, smooth_experts
from lowbit.algorithms.rotation import rotate_model
from lowbit.algorithms.smoothquant import fold_from_stats, fold_plan, smooth_model
from lowbit.algorithms.static_scales import calibrate_static_scales
from lowbit.archs.decoders import UnsupportedArchitecture
from lowbit.ops.kv_quant import KVScheme
from lowbit.quantize import scale_from_absmax, static_scheme
from lowbit.recipes.presets import Recipe

# Positions of the stages: a step's `order`; QUANTIZE is the quantization itself.
ROTATE, FOLD, AWQ_FOLD, PICK, CALIBRATE, QUANTIZE, AFTER = 0, 1, 2, 3, 4, 5, 6


@dataclass
class RunState:
    """What the steps of one run share: the model being quantized (a copy), the run's recipe and
    calibration batches, the Linear-only ignore / override patterns the site diagnosis takes (the
    patterns naming MoE experts modules go to quantize_model alone), and what steps leave for later
    ones and for the report."""
    model: torch.nn.Module
    recipe: Recipe
    calib: list
    kind: str = "causal"
    ignore: list | None = None
    overrides: dict | None = None
    experts: dict = field(default_factory=dict)   # the MoE experts modules found (lowbit.archs.experts)
    progress: bool = True
    want_sites: bool = False          # a per-site report is wanted (the report, or a pick by block SQNR)
    sites_before: object = None
    sites_after: object = None
    picked: dict = field(default_factory=dict)
    override_to: str = "skip"
    kl_pick: object = None
    act_static_scales: dict | None = None
    summary: object = None            # the quantization's QuantSummary, for the steps after it


@dataclass
class LayerRun:
    """One decoder layer of the layer-by-layer pipeline as a step sees it: the layer (loaded on the
    device), its index and name prefix ("model.layers.3."), its Linears to quantize (names relative to
    the layer), the recipe, the static activation scales by full name (filled by StaticScales), and
    observe(stream, names, per_channel) -> {name: absmax of its input} over that stream's batches
    (the stream moves on to the layer's outputs in the same passes)."""
    layer: torch.nn.Module
    index: int
    prefix: str
    linears: list
    recipe: Recipe
    scales: dict
    observe: Callable[[str, list, bool], dict]


class Step:
    """One algorithm of a job (the protocol of the module docstring); subclasses are frozen
    dataclasses, so two equal steps compare equal and a job's steps can be printed."""
    order: int = QUANTIZE
    needs_calib: bool = True
    diagnose_after: bool = False      # the report shows the sites again after this step
    stream: str | None = None         # the layer-by-layer activation stream it reads; None: not available

    def refuses(self, loaded) -> str | None:
        return None

    def check(self, job) -> None:
        return None

    def apply(self, state: RunState) -> None:
        return None

    def quantize_options(self, state: RunState) -> dict:
        return {}

    def apply_layer(self, run: LayerRun) -> None:
        return None

    def options(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class Rotate(Step):
    """Rotate the residual stream by a random Hadamard matrix, folded exactly
    (lowbit.algorithms.rotation; post-norm and LayerNorm families are refused)."""
    kind: str = "hadamard"
    order = ROTATE
    needs_calib = False

    def __post_init__(self):
        if self.kind != "hadamard":
            raise ValueError(f"rotate={self.kind!r}: the rotation lowbit knows is 'hadamard'")

    def apply(self, state: RunState) -> None:
        try:
            rotate_model(state.model)
        except UnsupportedArchitecture as err:
            raise ValueError(f"--rotate {self.kind} refused: {err}. Quantize without --rotate") from None

    def options(self) -> dict:
        return {"rotate": self.kind}


@dataclass(frozen=True)
class SmoothQuant(Step):
    """Fold SmoothQuant factors (alpha) where the decoder map says the fold is exact
    (lowbit.algorithms.smoothquant); on a MoE model, into each expert's down side
    (lowbit.algorithms.experts_fold)."""
    alpha: float = 0.5
    order = FOLD
    diagnose_after = True
    stream = "F"

    def __post_init__(self):
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ValueError(f"smoothquant={self.alpha!r}: alpha must lie in [0, 1] (0.5 is the usual choice)")

    def apply(self, state: RunState) -> None:
        name = state.recipe.name
        if state.experts:        # MoE: the one exact fold is each expert's down side
            done = smooth_experts(state.model, state.calib, alpha=self.alpha)
            _report_expert_fold(f"{name}: SmoothQuant (alpha {self.alpha})", [d["s"] for d in done.values()],
                                "smoothed")
            return
        # the decoder map says where the fold is exact: a family it does not know is refused here
        # (before anything is folded), Linears without a fold point are named and left unsmoothed
        try:
            _, why = fold_plan(state.model)
        except UnsupportedArchitecture as err:
            raise ValueError(f"SmoothQuant (alpha {self.alpha}, the flag or the recipe's best measures) refused: "
                             f"{err}. Run with --plain, or with other measure flags and no --smoothquant") from None
        for w in why:
            print(f"{name}: SmoothQuant: {w}", flush=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="SmoothQuant: ")   # printed above
            smooth_model(state.model, state.calib, alpha=self.alpha, progress=state.progress)

    def apply_layer(self, run: LayerRun) -> None:
        """The fold on one layer from its consumers' per-channel maxima on the float model as loaded."""
        groups, why = fold_plan(run.layer)
        if run.index == 0:
            for w in why:
                print("SmoothQuant: " + w, flush=True)
        amax = run.observe(self.stream, [c for g in groups for c in g.consumers], True)
        fold_from_stats(run.layer, groups, amax, self.alpha)

    def options(self) -> dict:
        return {"smoothquant": self.alpha}


def _report_expert_fold(what: str, per_block: list, verb: str) -> None:
    """One line for a fold into each expert's down side: per_block holds, per MoE block, the fold
    applied to each expert (None where too few tokens were routed to it to measure one)."""
    kept = sum(f is None for fs in per_block for f in fs)
    print(f"{what} folded into the down side of {sum(len(fs) for fs in per_block) - kept} experts ({kept} with "
          f"too few routed tokens kept s = 1); the experts' gate_up, attention and shared experts are not {verb} "
          "(no exact fold point for a MoE family)", flush=True)


@dataclass(frozen=True)
class AWQ(Step):
    """Fold activation-aware weight scales (lowbit.algorithms.awq); on a MoE model, into each
    expert's down side. Weight-only recipes."""
    order = AWQ_FOLD

    def apply(self, state: RunState) -> None:
        if state.experts:        # MoE: the one exact AWQ fold is each expert's down side
            done = awq_experts(state.model, state.recipe, state.calib)
            _report_expert_fold(f"{state.recipe.name}: AWQ", [d["alpha"] for d in done.values()], "folded")
            return
        awq_model(state.model, state.recipe, state.calib, progress=state.progress)

    def options(self) -> dict:
        return {"awq": True}


@dataclass(frozen=True)
class StaticScales(Step):
    """One calibrated per-tensor activation scale per Linear input (lowbit.algorithms.static_scales)
    instead of dynamic scales; recipes with activation quantization."""
    order = CALIBRATE
    stream = "S"

    def check(self, job) -> None:
        if job.recipe.act is None:
            raise ValueError(f"--static-scales needs a recipe with activation quantization; {job.recipe.name} is "
                             "weight-only")

    def apply(self, state: RunState) -> None:
        if state.override_to != "skip" and state.picked:
            raise ValueError("static scales are calibrated for the recipe's activation format; combine them only "
                             "with override_to='skip'")
        state.act_static_scales = calibrate_static_scales(state.model, state.calib, state.recipe.act)

    def quantize_options(self, state: RunState) -> dict:
        return {"act_static_scales": state.act_static_scales}

    def apply_layer(self, run: LayerRun) -> None:
        """One layer's scales from its Linears' input maxima on the float model after the folds."""
        act = static_scheme(run.recipe.act)
        for n, a in run.observe(self.stream, run.linears, False).items():
            run.scales[run.prefix + n] = scale_from_absmax(a, act)

    def options(self) -> dict:
        return {"static": True}


@dataclass(frozen=True)
class MSEScales(Step):
    """MSE-optimal weight scales (lowbit.algorithms.scale_search) instead of round to nearest's:
    unweighted with round to nearest, weighted by each layer's Hessian diagonal under GPTQ."""
    needs_calib = False

    def quantize_options(self, state: RunState) -> dict:
        return {"mse": True}

    def options(self) -> dict:
        return {"mse": True}


@dataclass(frozen=True)
class GPTQ(Step):
    """GPTQ's weight codes (lowbit.algorithms.gptq), calibrated on the job's calibration batches.
    Layer by layer it reads the quantized model's stream; the pipeline runs its solver there (the
    Hessians, the solve and the rows shared across ranks are lowbit.algorithms.gptq's)."""
    stream = "Q"

    def check(self, job) -> None:
        if job.lm_head is not None:
            raise ValueError("--lm-head with --gptq: GPTQ calibrates the decoder layers only; drop --lm-head or "
                             "--gptq")

    def quantize_options(self, state: RunState) -> dict:
        return {"method": "gptq", "calib": state.calib}

    def options(self) -> dict:
        return {"method": "gptq"}


@dataclass(frozen=True)
class KVCache(Step):
    """Quantize the KV cache too (lowbit.nn.kv_cache): static schemes calibrated on the job's
    calibration batches after the Linears are quantized; the checkpoint carries kv_cache_scheme."""
    scheme: KVScheme
    name: str                         # as the user wrote it, for reports and refusals
    order = AFTER

    @property
    def needs_calib(self) -> bool:
        return not self.scheme.dynamic

    def refuses(self, loaded) -> str | None:
        from lowbit.nn.kv_cache import attention_modules        # transformers: an optional dependency
        if not attention_modules(loaded.model):
            return (f"kv_cache={self.name!r}: {type(loaded.model).__name__} has no decoder attention modules that "
                    "keep a KV cache the way lowbit's quantized cache reads them (with layer_idx, k_proj and "
                    "v_proj: an encoder has none, and multi-head latent attention such as DeepSeek-V3's projects "
                    "K and V from a compressed latent); drop kv_cache")
        return None

    def apply(self, state: RunState) -> None:
        from lowbit.nn.kv_cache import attach_kv_cache, calibrate_kv_cache   # transformers: optional
        kv = calibrate_kv_cache(state.model, state.calib or [], self.scheme)
        attach_kv_cache(state.model, kv)
        state.summary.kv_cache = kv

    def options(self) -> dict:
        return {"kv_cache": self.name}
