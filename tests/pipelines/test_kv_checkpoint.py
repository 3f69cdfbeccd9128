"""KV-cache quantization through quantize_model and compressed-tensors checkpoints (lowbit and
transformers + compressed-tensors as the independent reader)."""
import json

import pytest
import torch

from lowbit.nn.kv_cache import KVCacheQuant, kv_cache_disabled, kv_cache_from_tensors
from lowbit.ops.kv_quant import KVScheme
from lowbit.pipelines.checkpoint import load_compressed, save_compressed
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.io.st_format import CheckpointError

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


def tiny_llama(rng):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    return transformers.LlamaForCausalLM(cfg).float().eval()


@pytest.fixture
def kv_model(rng):
    model = tiny_llama(rng)
    calib = [torch.randint(0, 96, (2, 16), generator=rng)]
    summary = quantize_model(model, "w8a16-int8", kv_cache="fp8-head", kv_calib=calib)
    return model, summary


def test_quantize_model_quantizes_the_cache(kv_model, rng):
    model, summary = kv_model
    assert summary.kv_cache.scheme == KVScheme("fp8", "head") and "KV cache: fp8_e4m3fn head" in str(summary)
    attn = model.model.layers[1].self_attn
    assert attn.k_scale.shape == (2, 1, 1) and attn.v_scale.dtype == torch.float32
    ids = torch.randint(0, 96, (1, 12), generator=rng)
    with torch.no_grad():
        q = model(ids).logits
        with kv_cache_disabled(model):
            plain = model(ids).logits
        again = model(ids).logits
    assert not torch.equal(q, plain)          # the forward really read a quantized cache
    assert torch.equal(q, again)              # and the switch restores it


def test_static_kv_cache_needs_calibration(rng):
    with pytest.raises(ValueError, match="kv_calib"):
        quantize_model(tiny_llama(rng), "w8a16-int8", kv_cache="fp8")
    with pytest.raises(ValueError, match="unknown format"):
        quantize_model(tiny_llama(rng), "w8a16-int8", kv_cache="fp7")
    enc = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(ValueError, match="no decoder attention modules"):
        quantize_model(enc, "w8a16-int8", kv_cache="fp8-token")
    assert type(enc[0]) is torch.nn.Linear                          # refused before any layer changed


def test_checkpoint_round_trip_through_lowbit(kv_model, rng, tmp_path):
    model, summary = kv_model
    out = save_compressed(model, tmp_path / "ckpt", "w8a16-int8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "attn_head",
                                     "group_size": None, "dynamic": False, "observer": "minmax"}
    ck = load_compressed(out)
    for i in range(2):
        assert torch.equal(ck.kv_cache.k_scales[i], summary.kv_cache.k_scales[i])
        assert torch.equal(ck.kv_cache.v_scales[i], summary.kv_cache.v_scales[i])
    ids = torch.randint(0, 96, (2, 9), generator=rng)
    with torch.no_grad():
        assert torch.equal(ck.to_model()(ids).logits, model(ids).logits)


def test_compressed_tensors_reads_the_kv_cache_scheme_and_scale_shapes(kv_model, tmp_path):
    """compressed-tensors as the oracle for the config and the tensors' names and shapes. (Its
    0.20 load path does not attach KV scales to transformers 5.24's attention: it looks for a
    `past_key_value(s)` forward argument, which transformers renamed to `cache`; from_pretrained
    then reports the k_scale / v_scale tensors as unexpected. So the pieces are checked directly.)"""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
    from safetensors import safe_open
    model, summary = kv_model
    out = save_compressed(model, tmp_path / "ckpt", "w8a16-int8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    cfg = QuantizationConfig.model_validate(qc)
    assert (cfg.kv_cache_scheme.num_bits, cfg.kv_cache_scheme.type, cfg.kv_cache_scheme.strategy) == \
        (8, "float", "attn_head")
    probe = torch.nn.Module()
    initialize_qparams(probe, "k", QuantizationArgs(**qc["kv_cache_scheme"]), observed_shape=(2, None, 32),
                       observed_dtype=torch.float32, force_zero_point=False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for i in range(2):
            for side, scales in (("k", summary.kv_cache.k_scales), ("v", summary.kv_cache.v_scales)):
                t = f.get_tensor(f"model.layers.{i}.self_attn.{side}_scale")    # vLLM's names
                assert t.shape == probe.k_scale.shape                             # compressed-tensors' shape
                assert torch.equal(t.reshape(1, -1, 1, 1), scales[i])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert hf.hf_quantizer.quantization_config.quantization_config.kv_cache_scheme.strategy == "attn_head"


def test_scales_that_disagree_with_the_scheme_are_refused(kv_model, tmp_path):
    model, _ = kv_model
    out = save_compressed(model, tmp_path / "ckpt", "w8a16-int8")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"]["strategy"] = "tensor"   # per tensor declared, per head stored
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"needs a float tensor of shape \[1\]"):
        load_compressed(out)
    cfg["quantization_config"]["kv_cache_scheme"] = None
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="kv_cache_scheme is null"):
        load_compressed(out)


def test_kv_cache_from_tensors_checks():
    fp8 = KVScheme("fp8").to_ct_args()
    good = {"m.layers.0.self_attn.k_scale": torch.tensor([0.5]), "m.layers.0.self_attn.v_scale": torch.tensor([0.25])}
    kv = kv_cache_from_tensors(fp8, dict(good), 1, 2, "ckpt")
    assert isinstance(kv, KVCacheQuant) and float(kv.k_scales[0]) == 0.5
    with pytest.raises(ValueError, match="one k_scale per layer"):
        kv_cache_from_tensors(fp8, dict(good), 2, 2, "ckpt")
    with pytest.raises(ValueError, match="finite and positive"):
        kv_cache_from_tensors(fp8, {**good, "m.layers.0.self_attn.k_scale": torch.tensor([float("nan")])}, 1, 2, "c")
    with pytest.raises(ValueError, match="dynamic"):
        kv_cache_from_tensors(KVScheme.parse("fp8-token").to_ct_args(), dict(good), 1, 2, "ckpt")
    assert kv_cache_from_tensors(None, {}, 1, 2, "ckpt") is None


def test_generate_on_a_quantized_model_uses_the_quantized_cache(kv_model, rng):
    from lowbit.nn.kv_cache import LowbitKVCache
    model, _ = kv_model
    ids = torch.randint(1, 96, (1, 6), generator=rng)
    model.generation_config.eos_token_id = None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    assert isinstance(out.past_key_values, LowbitKVCache) and out.past_key_values.get_seq_length() == 8


def test_a_cache_that_disagrees_with_the_models_kv_cache_scheme_is_refused(kv_model, rng):
    model, summary = kv_model
    ids = torch.randint(0, 96, (1, 8), generator=rng)
    from lowbit.nn.kv_cache import cache_kwarg
    kw = cache_kwarg(model)
    with torch.no_grad():
        model(ids, **{kw: summary.kv_cache.new_cache()})                        # its own: accepted
        other = KVCacheQuant("int8-token", 2)                                   # another scheme
        with pytest.raises(ValueError, match="other scales than the model's kv_cache_scheme"):
            model(ids, **{kw: other.new_cache()})
        halved = KVCacheQuant(summary.kv_cache.scheme, 2, [s / 2 for s in summary.kv_cache.k_scales],
                              summary.kv_cache.v_scales)                        # the same scheme, other scales
        with pytest.raises(ValueError, match="lowbit_kv_cache.new_cache"):
            model(ids, **{kw: halved.new_cache()})


def test_per_head_scales_for_another_head_count_are_refused(rng):
    from lowbit.nn.kv_cache import attach_kv_cache
    model = tiny_llama(rng)                                                      # 2 KV heads
    three = [torch.ones(1, 3, 1, 1)] * 2
    with pytest.raises(ValueError, match="3 per-head scales, the model has 2 KV heads"):
        attach_kv_cache(model, KVCacheQuant("fp8-head", 2, three, three))
