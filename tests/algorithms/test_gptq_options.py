"""GPTQOptions reach GPTQ the same way as an object or as keywords, in gptq_model, in gptq_handler's
keyword form (the layer-by-layer pipeline's) and in quantize_model's method_options."""
from __future__ import annotations

import copy

import pytest
import torch

from lowbit.algorithms.gptq.model import gptq_handler, gptq_model
from lowbit.algorithms.gptq.options import GPTQOptions
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.recipes.plan import plan


def _tiny_llama(rng):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    return LlamaForCausalLM(cfg).eval()


def _codes(model, summary):
    return {d.name: model.get_submodule(d.name).weight_q.codes for d in summary.quantized}


def test_options_object_and_keywords_are_one_path(rng):
    """The same non-default settings as an object, as keywords and through quantize_model give the same
    codes bit for bit; holdout=0 reached the handler (no held-out verdict in any reason), the default
    did not (every reason has one: the setting is not ignored)."""
    base = _tiny_llama(rng)
    batches = [torch.randint(0, 97, (1, 21), generator=rng) for _ in range(2)]
    settings = dict(damp=0.05, block_size=16, act_order=False, holdout=0)
    a, b, c, d = (copy.deepcopy(base) for _ in range(4))
    sa = gptq_model(a, "w4a16-g32", batches, GPTQOptions(**settings))
    sb = gptq_model(b, "w4a16-g32", batches, **settings)
    sc = quantize_model(c, "w4a16-g32", method="gptq", calib=batches, method_options=settings, share_inputs=False)
    sd = gptq_model(d, "w4a16-g32", batches, GPTQOptions(damp=0.5), holdout=4)
    ca, cb, cc = _codes(a, sa), _codes(b, sb), _codes(c, sc)
    assert len(ca) == 7 and ca.keys() == cb.keys() == cc.keys()
    assert all(torch.equal(ca[n], cb[n]) and torch.equal(ca[n], cc[n]) for n in ca)
    assert not any("held-out" in x.reason for x in sa.quantized + sb.quantized + sc.quantized)
    assert all("held-out" in x.reason for x in sd.quantized)


def test_handler_keyword_form_and_its_refusals(rng):
    model = _tiny_llama(rng)
    summary = plan(model, "w4a16-g32")
    handle = gptq_handler(model, summary, None, host_twin=False, **{"holdout": 0, "damp": 0.05})
    assert callable(handle) and set(handle.timings) == {"hessian", "factor", "solve", "losses", "build"}
    with pytest.raises(TypeError, match=r"gptq_handler got an unknown option 'dmap' \(did you mean 'damp'"):
        gptq_handler(model, summary, None, host_twin=False, dmap=0.05)
    with pytest.raises(ValueError, match="targets='float'.*gptq_model"):
        gptq_handler(model, summary, None, targets="float")
    with pytest.raises(TypeError, match="gptq_model got an unknown option 'act_ordr'"):
        gptq_model(model, "w4a16-g32", [], act_ordr=False)
