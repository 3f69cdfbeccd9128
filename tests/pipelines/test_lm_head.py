"""The opt-in quantized LM head (quantize_model(..., lm_head=KIND)): which layers it quantizes,
the bytes it saves (computed from the real tensors), tied embeddings kept exact, the logits'
error against a bound derived from the scheme, and the compressed-tensors checkpoint (lowbit's
own reload, and transformers + compressed-tensors as the independent reader)."""
import json
import math

import pytest
import torch

from lowbit.nn import QuantLinear
from lowbit.pipelines.checkpoint import load_compressed, save_compressed
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.recipes.plan import plan
from lowbit.recipes.presets import LM_HEAD

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 96, 128
KINDS = list(LM_HEAD)


def tiny_llama(rng, tie: bool) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of every distinct tensor storage a module holds (parameters, buffers, its QTensor)."""
    seen = {}
    ts = list(module.parameters()) + list(module.buffers())
    if isinstance(module, QuantLinear):
        ts += [t for t in (module.weight_q.codes, module.weight_q.scale, module.weight_q.zero_point) if t is not None]
    for t in ts:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tie", [False, True])
def test_lm_head_quantized_embedding_exact(rng, kind, tie):
    model = tiny_llama(rng, tie)
    ref = tiny_llama(rng, tie)
    ref.load_state_dict(model.state_dict())
    emb = model.model.embed_tokens.weight.detach().clone()
    float_head = model.lm_head.weight.detach().clone()
    summary = quantize_model(model, "w8a8-int8", lm_head=kind)
    head = model.lm_head
    assert isinstance(head, QuantLinear) and head.act_scheme is None
    assert head.weight_scheme == LM_HEAD[kind].weight
    d = next(d for d in summary.layers if d.name == "lm_head")
    assert d.action == "quantized" and d.recipe == LM_HEAD[kind].name and "lm_head option" in d.reason
    assert ("untied" in d.reason) == tie
    # the embedding keeps its weight bit for bit, is no longer shared with the head, and stays so
    assert torch.equal(model.model.embed_tokens.weight, emb)
    assert model.config.tie_word_embeddings is False
    model.tie_weights()
    assert isinstance(model.lm_head, QuantLinear) and not list(model.lm_head.parameters(recurse=False))
    ids = torch.randint(0, VOCAB, (2, 9), generator=rng)
    with torch.no_grad():
        assert torch.equal(model.model.embed_tokens(ids), ref.model.embed_tokens(ids))
        # the head's own output against the float head on the same hidden states: weight-only, so
        # the error is the weight rounding alone, |y - y_float| <= sum_k |x_k| |w_k - q_k s| <=
        # ||x||_1 * max|dw| per row; max|dw| is half a step: s/2 for int8 / int4 (s = amax / 127
        # per channel, amax / 7 per group of 128), and 2^-4 |w| for e4m3 (3 mantissa bits) or s 2^-9 / 2
        # (subnormal spacing) whichever is larger
        h = model.model(ids).last_hidden_state
        y = model.lm_head(h)
        y_float = h @ float_head.t()
        dw = (model.lm_head.weight_dequantized() - float_head).abs()
        per_row = h.abs().sum(-1, keepdim=True) * dw.amax(-1)[None, None, :]
        assert ((y - y_float).abs() <= per_row * (1 + 1e-5) + 1e-6).all()   # + fp32 summation slack
        assert (dw.amax() <= _max_step(float_head, kind) / 2 * (1 + 2.0 ** -20)).item()
        assert not torch.equal(y, y_float)            # the head was quantized


def _max_step(w: torch.Tensor, kind: str) -> float:
    """The largest quantization step of the head's weight under `kind` (see the test above)."""
    if kind == "int8":
        return float(w.abs().amax() / 127)
    if kind == "w4a16":
        return float(w.abs().reshape(w.shape[0], -1, 128).amax(-1).max() / 7)
    return float(w.abs().amax() * 2.0 ** -3)     # e4m3: spacing 2^(e-3) <= |w| 2^-3 within a binade


@pytest.mark.parametrize("kind", KINDS)
def test_weight_bytes_drop_by_the_head(rng, kind):
    """The model's tensor bytes drop by the float head's bytes minus the quantized head's, all
    read from the tensors the modules hold (codes: 1 byte per int8 / fp8 weight, int4 packed two per
    byte on the fast path's device, their fp32 scales)."""
    a, b = tiny_llama(rng, False), tiny_llama(rng, False)
    quantize_model(a, "w4a16")
    quantize_model(b, "w4a16", lm_head=kind)
    float_head = VOCAB * HIDDEN * 4
    q = b.lm_head
    held = _tensor_bytes(q)
    codes = {"int8": VOCAB * HIDDEN, "fp8": VOCAB * HIDDEN, "w4a16": VOCAB * HIDDEN}[kind]
    scales = {"int8": VOCAB * 4, "fp8": VOCAB * 4, "w4a16": VOCAB * HIDDEN // 128 * 4}[kind]
    assert held >= codes + scales        # the exact twin's codes and scales, at least
    from lowbit.evaluation.evaluate import model_bytes
    bits = 8 if kind != "w4a16" else 4
    assert model_bytes(a, 4) - model_bytes(b, 4) == float_head - (VOCAB * HIDDEN * bits // 8 + scales)


def test_plan_refusals(rng):
    model = tiny_llama(rng, False)
    with pytest.raises(ValueError, match="lm_head='int4'.*int8, fp8, w4a16"):
        plan(model, "w4a16", lm_head="int4")
    # a pattern naming the head wins over the option
    s = plan(model, "w4a16", ignore=["lm_head"], lm_head="int8")
    assert next(d for d in s.layers if d.name == "lm_head").action == "skipped"
    headless = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="no Linear named lm_head"):
        plan(headless, "w8a16-int8", lm_head="int8")
    with pytest.raises(NotImplementedError, match="lm_head with method='gptq'"):
        quantize_model(model, "w4a16", lm_head="int8", method="gptq", calib=[torch.zeros(1, 4, dtype=torch.long)])
    assert not any(isinstance(m, QuantLinear) for m in model.modules())   # refused before any change


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tie", [False, True])
def test_checkpoint_round_trip(rng, tmp_path, kind, tie):
    model = tiny_llama(rng, tie)
    quantize_model(model, "w8a16-int8", lm_head=kind)
    out = save_compressed(model, tmp_path / "ckpt", "w8a16-int8")
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["tie_word_embeddings"] is False
    assert "lm_head" not in qc["ignore"]
    assert any("lm_head" in g["targets"] for g in qc["config_groups"].values())
    ck = load_compressed(out)
    assert "lm_head" in ck.qtensors and "lm_head.weight" not in ck.tensors
    assert torch.equal(ck.qtensors["lm_head"].codes, model.lm_head.weight_q.codes)
    ids = torch.randint(0, VOCAB, (2, 7), generator=rng)
    back = ck.to_model()
    assert isinstance(back.lm_head, QuantLinear)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


@pytest.mark.parametrize("kind", ["int8", "w4a16"])
def test_transformers_reads_the_quantized_head(rng, tmp_path, kind):
    """compressed-tensors, as transformers loads the checkpoint, decompresses the head lowbit
    wrote to exactly lowbit's dequantized weight (int8 and int4 values times fp32 scales are
    exact in float32)."""
    pytest.importorskip("compressed_tensors")
    model = tiny_llama(rng, True)
    quantize_model(model, "w8a16-int8", lm_head=kind)
    out = save_compressed(model, tmp_path / "ckpt", "w8a16-int8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    hf.hf_quantizer.compressor.decompress_model(hf)
    head = hf.get_submodule("lm_head")
    assert torch.equal(head.weight.data, model.lm_head.weight_q.dequantize(head.weight.dtype))
    assert torch.equal(hf.get_submodule("model.embed_tokens").weight.data, model.model.embed_tokens.weight.data)
    assert math.isfinite(float(head.weight.data.abs().sum()))
