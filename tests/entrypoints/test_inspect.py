"""`lowbit inspect`: schemes and scale shapes of a checkpoint, and the failure modes it flags,
on checkpoints lowbit writes and on deliberately broken copies of them."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.entrypoints.main import main
from lowbit.entrypoints.inspect import inspect_checkpoint
from lowbit.pipelines.checkpoint import save_compressed

transformers = pytest.importorskip("transformers")


def checkpoint(rng, path, recipe, overrides=None):
    from lowbit.pipelines.quantize_model import quantize_model
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    quantize_model(model, recipe, overrides=overrides)
    return save_compressed(model, path, recipe)  # one shard: model.safetensors


def codes(report, level=None):
    return sorted({f.code for f in report.findings if level is None or f.level == level})


def edit_tensors(path, fn):
    t = load_file(path / "model.safetensors")
    fn(t)
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def test_clean_checkpoint_lists_every_layer(rng, tmp_path, capsys):
    out = checkpoint(rng, tmp_path / "c", "w4a16-asym")
    r = inspect_checkpoint(out)
    # transformers 5.24 cannot load asymmetric pack-quantized layers (lowbit.recipes.loaders)
    assert [f.code for f in r.findings if f.level != "info"] == ["loader-transformers"]
    assert len(r.layers) == 7 and r.format == "pack-quantized"
    down = next(li for li in r.layers if li.name.endswith("down_proj"))
    assert down.shape == [128, 256]
    assert down.weight == "int4 group/128 asym static" and down.act == "-"
    assert down.tensors["weight_scale"] == "float32 [128, 2]"
    assert down.tensors["weight_zero_point"] == "int32 [16, 2]"  # 8 packed per int32 along N
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.mlp.down_proj" in text and "weight_scale=[128, 2]" in text
    assert main(["inspect", str(out), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert {li["name"] for li in js["layers"]} == {li.name for li in r.layers}


def test_per_tensor_activation_scales_are_flagged(rng, tmp_path):
    every = inspect_checkpoint(checkpoint(rng, tmp_path / "a", "w8a8-int8-tensor"))
    flagged = [f for f in every.findings if f.code == "per-tensor-activation"]
    assert len(flagged) == 7 and all("silent" not in f.message for f in flagged)
    mixed = inspect_checkpoint(checkpoint(rng, tmp_path / "b", "w8a8-int8",
                                          overrides={"model.layers.0.mlp.down_proj": "w8a8-int8-tensor"}))
    flagged = [f for f in mixed.findings if f.code == "per-tensor-activation"]
    assert [f.layer for f in flagged] == ["model.layers.0.mlp.down_proj"] and "silent" in flagged[0].message
    per_token = inspect_checkpoint(checkpoint(rng, tmp_path / "c", "w8a8-int8"))
    assert "per-tensor-activation" not in codes(per_token)


def test_missing_zero_point_is_an_error(rng, tmp_path):
    out = checkpoint(rng, tmp_path / "c", "w4a16-asym")
    edit_tensors(out, lambda t: t.pop("model.layers.0.mlp.up_proj.weight_zero_point"))
    r = inspect_checkpoint(out)
    bad = [f for f in r.findings if f.code == "missing-zero-point"]
    assert [f.layer for f in bad] == ["model.layers.0.mlp.up_proj"] and bad[0].level == "error"
    assert main(["inspect", str(out)]) == 1


def test_silent_per_tensor_weight_scale_is_an_error(rng, tmp_path):
    out = checkpoint(rng, tmp_path / "c", "w8a8-int8")
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    edit_tensors(out, lambda t: t.__setitem__(name, t[name].max().reshape(1)))
    r = inspect_checkpoint(out)
    bad = [f for f in r.findings if f.code == "scale-shape"]
    assert len(bad) == 1 and "one scale for the whole weight" in bad[0].message


def test_quantized_logits_and_dense_targets(rng, tmp_path):
    out = checkpoint(rng, tmp_path / "q", "w8a8-int8", overrides={"lm_head": "w8a8-int8"})
    r = inspect_checkpoint(out)
    assert [f.layer for f in r.findings if f.code == "quantized-high-precision-site"] == ["lm_head"]
    # lm_head stored dense but no longer ignored by the config: loaders would expect it quantized
    out2 = checkpoint(rng, tmp_path / "d", "w8a8-int8")
    edit_config(out2, lambda q: q.update(ignore=[]))
    r2 = inspect_checkpoint(out2)
    assert [(f.layer, f.level) for f in r2.findings if f.code == "targeted-but-dense"] == [("lm_head", "error")]


def test_config_level_problems(rng, tmp_path):
    out = checkpoint(rng, tmp_path / "c", "w8a8-fp8", overrides={"model.layers.0.self_attn.k_proj": "w8a8-int8"})
    r = inspect_checkpoint(out)
    assert [f.layer for f in r.findings if f.code == "fused-mismatch"] == ["model.layers.0.self_attn"]

    def static_acts_and_outputs(q):
        for g in q["config_groups"].values():
            g["input_activations"].update(dynamic=False, strategy="tensor")
            g["output_activations"] = dict(g["weights"])
    edit_config(out, static_acts_and_outputs)
    r = inspect_checkpoint(out)
    assert "missing-input-scale" in codes(r, "error") and "output-activations" in codes(r, "warning")


def test_not_a_checkpoint(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_nvfp4_dynamic_activations_noted(rng, tmp_path):
    r = inspect_checkpoint(checkpoint(rng, tmp_path / "c", "nvfp4"))
    # per layer, and per loader: vLLM reads a calibrated input_global_scale (lowbit.recipes.loaders)
    assert codes(r, "warning") == ["loader-vllm", "nvfp4-act-global-scale"]
    vllm = next(f for f in r.findings if f.code == "loader-vllm")
    assert "input_global_scale" in vllm.message and "recipes it loads here: w8a8-int8" in vllm.message
    assert all(li.tensors["weight_scale"] == "float8_e4m3fn [%d, %d]" % (li.shape[0], li.shape[1] // 16)
               for li in r.layers)


def test_float_checkpoint_and_other_formats_are_named(rng, tmp_path, capsys):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "float")
    assert main(["inspect", str(tmp_path / "float")]) == 2
    err = capsys.readouterr().err
    assert "no quantization_config" in err and "float (unquantized) checkpoint" in err and "lowbit quantize" in err
    c = json.loads((tmp_path / "float" / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "gptq"}
    (tmp_path / "float" / "config.json").write_text(json.dumps(c))
    assert main(["inspect", str(tmp_path / "float")]) == 2
    err = capsys.readouterr().err
    assert "not compressed-tensors (quant_method 'gptq')" in err, err

