"""The step that picks sites by the per-site diagnosis (OverrideWorst: it reads lowbit.diagnosis,
which sits above the pipelines), and every step class of lowbit.pipelines.steps, so that a job's
steps are imported from one place."""
from __future__ import annotations

from dataclasses import dataclass

from lowbit.diagnosis.site_kl import kl_pick
from lowbit.diagnosis.sites import override_count, pick_overrides, site_report
from lowbit.pipelines.steps import (AFTER, AWQ, AWQ_FOLD, CALIBRATE, FOLD, GPTQ, PICK, QUANTIZE, ROTATE,  # noqa: F401
                                    KVCache, MSEScales, Rotate, RunState, SmoothQuant, StaticScales, Step)
from lowbit.recipes.plan import linear_layers


def diagnose(state: RunState):
    """The per-site report of the run's recipe on its model as it is now."""
    return site_report(state.model, state.calib, state.recipe, ignore=state.ignore, overrides=state.overrides,
                       progress=state.progress)


OVERRIDE_BY = ("block", "kl")


@dataclass(frozen=True)
class OverrideWorst(Step):
    """Send the worst sites (at most `fraction` of the Linears: a handful of sites, not another
    recipe) to `to` ("skip": high precision, or a recipe name), picked by block SQNR in the
    per-site report ("block") or by the measured drop of the next-token KL ("kl":
    lowbit.diagnosis.site_kl; causal models), on round to nearest's codes after the folds."""
    fraction: float = 0.05
    to: str = "skip"
    by: str = "block"
    order = PICK

    def __post_init__(self):
        if self.by not in OVERRIDE_BY:
            raise ValueError(f"override_by={self.by!r}: choose 'block' (block SQNR) or 'kl' (measured KL)")

    def refuses(self, loaded) -> str | None:
        if self.by == "kl" and loaded.kind != "causal":
            return ("override_by='kl' measures next-token distributions: it needs a causal language model; "
                    "use override_by='block' for an encoder")
        return None

    def apply(self, state: RunState) -> None:
        n = len(linear_layers(state.model))
        state.override_to = self.to
        if self.by == "kl":
            state.kl_pick = kl_pick(state.model, state.calib, state.recipe, override_count(n, self.fraction),
                                    to=self.to, ignore=state.ignore, overrides=state.overrides,
                                    progress=state.progress)
            state.picked = {s: self.to for s in state.kl_pick.picked}
        else:
            state.picked = pick_overrides(state.sites_after or state.sites_before, n, self.fraction, self.to)

    def options(self) -> dict:
        return {"override_worst": self.fraction, **({"override_by": self.by} if self.by != "block" else {}),
                **({"override_to": self.to} if self.to != "skip" else {})}
