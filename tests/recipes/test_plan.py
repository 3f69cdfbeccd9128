"""The typed plan: made once by plan(), consumed as it is by quantize_model (and GPTQ behind it)."""
import pytest
import torch

from lowbit.pipelines.quantize_model import quantize_model
from lowbit.recipes.plan import QuantSummary, plan


def _mlp(hidden: int = 64) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(hidden, 96), torch.nn.ReLU(), torch.nn.Linear(96, hidden))


def test_a_plan_is_used_as_it_is(rng):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = _mlp()
    p = plan(model, "w8a8-int8", ignore=["2"])
    assert isinstance(p, QuantSummary) and [d.action for d in p.layers] == ["quantized", "skipped"]
    assert plan(model, p) is p
    x = torch.randn(3, 64, generator=rng)
    ref = _mlp()
    ref.load_state_dict(model.state_dict())
    assert quantize_model(model, p) is p
    quantize_model(ref, "w8a8-int8", ignore=["2"])      # the same decisions from names: the same model
    assert type(model[0]).__name__ == "QuantLinear" and isinstance(model[2], torch.nn.Linear)
    assert torch.equal(model(x), ref(x))


def test_a_plan_refuses_another_model_and_second_options():
    p = plan(_mlp(), "w4a16-g32")
    with pytest.raises(ValueError, match="another model"):
        plan(torch.nn.Sequential(torch.nn.Linear(64, 64)), p)
    with pytest.raises(ValueError, match="already a plan"):
        plan(_mlp(), p, ignore=["0"])
