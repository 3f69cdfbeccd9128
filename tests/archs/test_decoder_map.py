"""The decoder map against the real transformers models: every declared feed is what the layer's
forward does (a norm's output is the very input of its Linears), every declared gain rule is the
norm's arithmetic, and an unknown family is refused by name."""
import pytest
import torch
from family_fixtures import FAMILIES, ids, tiny_decoder

from lowbit.archs.decoders import (DECODERS, UnsupportedArchitecture, decoder_for, decoder_layers,
                                   sibling_groups)


@pytest.mark.parametrize("family", FAMILIES)
def test_feeds_and_gains_match_the_forward(family, rng):
    model = tiny_decoder(family, rng)
    d = decoder_for(model)
    assert family in d.model_types
    layers = decoder_layers(model, d)
    assert [n for n, _ in layers] == [f"{d.layers}.{i}" for i in range(2)]
    _, layer = layers[0]
    seen, hooks = {}, []
    for f in d.feeds:
        hooks.append(layer.get_submodule(f.norm).register_forward_hook(
            lambda m, a, out, k=f.norm: seen.__setitem__(k, out)))
    for p in d.readers() + d.writers:
        hooks.append(layer.get_submodule(p).register_forward_pre_hook(
            lambda m, a, k=p: seen.__setitem__(k, a[0])))
    with torch.no_grad():
        model(ids(rng, 1, 7))
    for h in hooks:
        h.remove()
    for f in d.feeds:                      # a feed's Linears read exactly its norm's output
        assert all(seen[c] is seen[f.norm] for c in f.linears), (family, f)
    norm_outs = {id(seen[f.norm]) for f in d.feeds}
    for u in d.unfed:                      # un-normed readers read no norm's output
        assert all(id(seen[c]) not in norm_outs for c in u)
    # the gain rule: with w = 0 a "w" norm outputs 0, a "1 + w" norm the normalized input itself
    norm = layer.get_submodule((d.feeds[0].norm if d.feeds else d.post_norms[0]))
    x = torch.randn(3, 64, generator=rng, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.zero_()
        y = norm(x)
    if d.gain == "w":
        assert torch.equal(y, torch.zeros_like(y))
    else:
        # normalized in float32 by transformers: rms(y) = 1 within float32 rounding (64 terms: 64 u32)
        rms = y.pow(2).mean(-1).sqrt()
        assert (rms - 1).abs().max() <= 64 * 2.0 ** -24


def test_entries_are_distinct_and_name_real_classes():
    import importlib
    types = [t for d in DECODERS for t in d.model_types]
    classes = [c for d in DECODERS for c in d.layer_classes]
    assert len(set(types)) == len(types) and len(set(classes)) == len(classes)
    for d in DECODERS:
        for c in d.layer_classes:
            mod = c.removesuffix("DecoderLayer").lower()
            # imported by name: transformers' lazy package lists only the model modules imported so far
            modeling = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
            assert hasattr(modeling, c), f"{c}: not in transformers.models.{mod}"


def test_unknown_family_is_refused_by_name(rng):
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=32))
    with pytest.raises(UnsupportedArchitecture, match=r"GPT2LMHeadModel \(model_type='gpt2'.*Known families: Llama"):
        decoder_for(m)
    with pytest.raises(UnsupportedArchitecture, match="Sequential"):
        decoder_for(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert sibling_groups(m) is None


def test_mismatched_layer_is_refused(rng):
    model = tiny_decoder("llama", rng)
    del model.model.layers[1].mlp.up_proj
    with pytest.raises(UnsupportedArchitecture, match=r"LlamaDecoderLayer is mapped as Llama but lacks \['mlp.up_proj'"):
        decoder_for(model)


def test_sibling_groups(rng):
    assert sibling_groups(tiny_decoder("llama", rng)) == (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    assert sibling_groups(tiny_decoder("phi3", rng)) == ()


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2", "olmo2", "cohere"])
def test_shared_groups_are_gptqs_execution_groups(family, rng):
    """GPTQ (lowbit.algorithms.sequential) groups Linears by the very input tensor they receive; the
    map's sibling groups must be exactly such groups (and Phi-3's fused projections have none)."""
    from lowbit.algorithms.sequential import _execution_groups, capture_block_inputs
    model = tiny_decoder(family, rng)
    d = decoder_for(model)
    _, layer = decoder_layers(model, d)[0]
    inputs = capture_block_inputs(model, layer, [ids(rng, 1, 9)])
    names = [n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    groups = _execution_groups(layer, inputs, names)
    assert sorted(n for g in groups for n in g) == sorted(names)
    assert all(list(s) in groups for s in d.shared)
    assert [g for g in groups if len(g) > 1] == [list(s) for s in d.shared]
