"""ExpertsOptions: QuantExperts.from_module and from_qtensors take the family's layout as one object
or as keywords, with the same result bit for bit."""
from __future__ import annotations

import pytest
import torch

from lowbit.archs.experts import find_experts
from lowbit.nn.experts import ExpertsOptions, QuantExperts
from lowbit.recipes.presets import get_recipe
from moe_fixtures import tiny_moe

_BUFFERS = ("gate_up_codes", "gate_up_scale", "down_codes", "down_scale", "gate_up_bias", "down_bias")


def _same(p, q):
    return all((getattr(p, b) is None and getattr(q, b) is None) or torch.equal(getattr(p, b), getattr(q, b))
               for b in _BUFFERS)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_object_and_keywords_build_the_same_experts(family, rng):
    """gpt-oss: the transposed layout, biases and its own activation, which the object must carry."""
    model = tiny_moe(family, rng, dtype=torch.float32)
    name, spec = next(iter(find_experts(model).items()))
    mod, r = model.get_submodule(name), get_recipe("w4a16-g32")
    by_kw = QuantExperts.from_module(mod, r.weight, r.act, name=name, **spec.module_kwargs())
    opts = ExpertsOptions(**spec.module_kwargs(), name=name)
    by_obj = QuantExperts.from_module(mod, r.weight, r.act, opts)
    assert _same(by_kw, by_obj) and (by_obj.activation, by_obj.glu_split) == (spec.activation, spec.glu_split)
    again = QuantExperts.from_qtensors(mod, by_obj.weights_q("gate_up"), by_obj.weights_q("down"), r.act, opts)
    assert _same(again, by_obj) and again.family == spec.family
    x = torch.randn(5, model.config.hidden_size, generator=rng)
    idx = torch.randint(0, by_obj.num_experts, (5, 2), generator=rng)
    w = torch.rand(5, 2, generator=rng)
    assert torch.equal(by_kw(x, idx, w), by_obj(x, idx, w))


def test_from_module_refuses_a_misspelt_option(rng):
    model = tiny_moe("mixtral", rng, dtype=torch.float32)
    name, spec = next(iter(find_experts(model).items()))
    r = get_recipe("w4a16-g32")
    with pytest.raises(TypeError, match=r"QuantExperts.from_module got an unknown option 'glu_splt' "
                                        r"\(did you mean 'glu_split'"):
        QuantExperts.from_module(model.get_submodule(name), r.weight, r.act, glu_splt="chunk")
