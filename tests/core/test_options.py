"""lowbit.options.Options, the base of the typed options objects: unknown names are refused with the
nearest valid one, a wrong type is refused, and each options class checks its values once."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from lowbit.algorithms.gptq.options import MIN_TOKENS, GPTQOptions
from lowbit.diagnosis.site_kl import KLPickOptions, kl_pick
from lowbit.evaluation.workload import TextSources, prepare_texts
from lowbit.nn.experts import ExpertsOptions
from lowbit.options import Options


@dataclass(frozen=True)
class Planted(Options):
    alpha: float = 0.5
    steps: int = 3


def test_merge_applies_keywords_over_the_object():
    assert Planted.merge(None, {}, "f") == Planted()
    assert Planted.merge(Planted(alpha=0.25), {"steps": 7}, "f") == Planted(0.25, 7)
    assert Planted.merge(Planted(alpha=0.25), {"alpha": 0.75}, "f") == Planted(0.75, 3)


def test_unknown_names_are_refused_with_the_nearest():
    with pytest.raises(TypeError, match=r"^f got an unknown option 'alpah' \(did you mean 'alpha'\?\); the options "
                                        r"are: alpha, steps$"):
        Planted.merge(None, {"alpah": 1.0}, "f")
    with pytest.raises(TypeError, match=r"unknown option 'zzz'; the options"):      # nothing near: no hint
        Planted().replace(zzz=1)
    with pytest.raises(TypeError, match=r"f: options must be a Planted .* not dict"):
        Planted.merge({"alpha": 1.0}, {}, "f")


@pytest.mark.parametrize("cls, fields", [(GPTQOptions, {"damp", "holdout", "min_tokens", "targets"}),
                                         (ExpertsOptions, {"gate_up", "layout", "backend", "host_twin"}),
                                         (KLPickOptions, {"to", "effect", "screen", "shortlist"}),
                                         (TextSources, {"calib_data", "eval_data", "chat", "fit"})])
def test_each_options_class_refuses_a_misspelt_field(cls, fields):
    for f in fields:
        typo = f + "s"
        with pytest.raises(TypeError, match=f"did you mean '{f}'"):
            cls.merge(None, {typo: None}, "owner")


def test_gptq_options_check_their_values():
    assert GPTQOptions(min_tokens=None).min_tokens == MIN_TOKENS == GPTQOptions().min_tokens
    for bad, match in (({"holdout": 1}, "holdout=1"), ({"holdout": -2}, "holdout=-2"),
                       ({"targets": "floats"}, "targets='floats'"), ({"min_tokens": 0}, "min_tokens=0")):
        with pytest.raises(ValueError, match=match):
            GPTQOptions(**bad)
    with pytest.raises(ValueError, match="backend='fast'"):
        ExpertsOptions(backend="fast")
    with pytest.raises(ValueError, match="effect='both'"):
        KLPickOptions(effect="both")


def test_functions_refuse_misspelt_keywords_before_any_work():
    """The keyword forms name the function; nothing is read (the model and data are placeholders)."""
    with pytest.raises(TypeError, match=r"kl_pick got an unknown option 'efect' \(did you mean 'effect'"):
        kl_pick(None, [], "w8a8-int8", 1, efect="restore")
    with pytest.raises(TypeError, match=r"prepare_texts got an unknown option 'calib_dat' \(did you mean 'calib_data'"):
        prepare_texts(None, 8, 8, 8, calib_dat="x.txt")
