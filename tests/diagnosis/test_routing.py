"""routing_flips: the fraction of tokens whose top-k expert set changes, per MoE layer."""
import copy

import pytest
import torch

from lowbit.diagnosis.routing import format_flips, routing_flips
from lowbit.pipelines.quantize_model import quantize_model
from moe_fixtures import ids, tiny_moe


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_flips_are_zero_for_the_same_model_and_counted_after_quantization(family, rng):
    model = tiny_moe(family, rng, dtype=torch.float32)
    batches = [ids(rng, 12), ids(rng, 7)]
    same = routing_flips(model, copy.deepcopy(model), batches)
    assert all(f.set_changed == 0 and f.tokens == 19 for f in same)
    q = copy.deepcopy(model)
    quantize_model(q, "w4a16-g32")
    flips = routing_flips(model, q, batches)
    assert [f.router for f in flips] == [f.router for f in same]
    assert all(0 <= f.set_changed <= f.tokens == 19 for f in flips)
    assert "top-k set changed" in format_flips(flips)


def test_a_changed_router_flips_only_its_own_layer_and_later(rng):
    """Reversing layer 1's router scores (negated weight) changes its top-2 set for every token
    whose top-2 differ from its bottom-2 (all of them with 8 experts); layer 0's router sees the
    same inputs, so it flips nothing."""
    model = tiny_moe("mixtral", rng, dtype=torch.float32)
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.model.layers[1].mlp.gate.weight.neg_()
    flips = routing_flips(model, bad, [ids(rng, 16)])
    assert flips[0].set_changed == 0
    assert flips[1].set_changed == flips[1].tokens == 16


def test_a_dense_model_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no MoE experts"):
        routing_flips(model, model, [torch.zeros(1, 4)])
