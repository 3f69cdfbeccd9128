"""Fixtures of the command-line tests."""
import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture
def tiny(monkeypatch, rng):
    """`lowbit quantize` on a 1-layer random Llama and random token windows."""
    from lowbit.evaluation import workload as pipeline
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (128,), generator=rng)
    monkeypatch.setattr(pipeline, "load_model", lambda spec: pipeline.Loaded("tiny", model, None, "causal"))
    monkeypatch.setattr(pipeline, "prepare_texts", lambda loaded, tokens, calib, window, **data: pipeline.Texts(
        ids[:tokens], [ids[None, :window]], [ids[None, -window:]]))
    return ["quantize", "--tokens", "64", "--calib-tokens", "32", "--window", "32"]
