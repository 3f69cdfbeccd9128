"""Layer-by-layer quantization from a sharded safetensors checkpoint (lowbit.nn.layerwise) gives the
checkpoint the whole-model path gives: the same codes, scales, static activation scales and
float tensors, bit for bit, for SmoothQuant + static scales + RTN and for GPTQ."""
import copy

import pytest
import torch

from llama_fixtures import outlier_llama


def _sharded(rng, tmp_path):
    model = outlier_llama(rng, intermediate_size=96)
    d = tmp_path / "float"
    model.save_pretrained(d, max_shard_size="40KB")      # several shards + index
    assert (d / "model.safetensors.index.json").is_file()
    batches = [torch.randint(0, 97, (2, 17), generator=rng) for _ in range(3)]
    return d, batches


def _whole_model(d, recipe, batches, out, *, smoothquant=None, static=False, method="rtn"):
    from transformers import LlamaForCausalLM
    from lowbit.io.compressed_tensors import save_compressed
    from lowbit.nn.calibration import calibrate_static_scales
    from lowbit.nn.quantize_model import quantize_model
    from lowbit.nn.recipes import get_recipe
    from lowbit.nn.smoothquant import smooth_model
    m = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    if smoothquant is not None:
        smooth_model(m, batches, alpha=smoothquant)
    scales = calibrate_static_scales(m, batches, get_recipe(recipe).act) if static else None
    quantize_model(m, recipe, act_static_scales=scales, method=method, calib=batches if method != "rtn" else None)
    save_compressed(m, out)


def _assert_same(a, b):
    from lowbit.io.compressed_tensors import load_compressed
    x, y = load_compressed(a), load_compressed(b)
    assert sorted(x.qtensors) == sorted(y.qtensors) and x.qtensors
    for n in x.qtensors:
        p, q = x.qtensors[n], y.qtensors[n]
        for f in ("codes", "scale", "zero_point", "scale_codes", "global_scale"):
            u, v = getattr(p, f), getattr(q, f)
            assert (u is None and v is None) or torch.equal(u, v), (n, f)
        assert p.scheme == q.scheme and x.act_schemes[n] == y.act_schemes[n]
    assert sorted(x.act_static_scales) == sorted(y.act_static_scales)
    for n in x.act_static_scales:
        assert torch.equal(x.act_static_scales[n], y.act_static_scales[n]), n
    assert sorted(x.tensors) == sorted(y.tensors)
    for n in x.tensors:
        assert torch.equal(x.tensors[n], y.tensors[n]), n
    assert x.quantization_config == y.quantization_config


# Two cases cover both quantizers (RTN, GPTQ) and all three activation streams (F, S, Q).
@pytest.mark.parametrize("recipe,opts", [
    ("w8a8-int8", {"smoothquant": 0.5, "static": True}),
    ("w8a8-int8", {"smoothquant": 0.5, "static": True, "method": "gptq"}),
])
def test_layerwise_equals_whole_model(rng, tmp_path, recipe, opts):
    from lowbit.nn.layerwise import quantize_layerwise
    d, batches = _sharded(rng, tmp_path)
    _whole_model(d, recipe, batches, tmp_path / "whole", **opts)
    res = quantize_layerwise(d, tmp_path / "layerwise", recipe, batches, method=opts.get("method", "rtn"),
                             smoothquant=opts.get("smoothquant"), static_scales=opts.get("static", False))
    _assert_same(tmp_path / "whole", tmp_path / "layerwise")
    assert res["layers"] == 2 and len(res["seconds_per_layer"]) == 2
    assert res["layer_bytes"] > 0 and res["activation_bytes"] > 0


def test_layerwise_refuses_bad_input(rng, tmp_path):
    from lowbit.nn.layerwise import quantize_layerwise
    d, batches = _sharded(rng, tmp_path)
    with pytest.raises(ValueError, match="weight-only"):
        quantize_layerwise(d, tmp_path / "o", "w4a16", batches, static_scales=True)
    with pytest.raises(ValueError, match="calibration batches"):
        quantize_layerwise(d, tmp_path / "o", "w4a16", [], method="gptq")
    with pytest.raises(ValueError, match="method"):
        quantize_layerwise(d, tmp_path / "o", "w4a16", batches, method="awq")
    assert not (tmp_path / "o").exists()
