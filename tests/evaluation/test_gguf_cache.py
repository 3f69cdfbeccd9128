"""The converted GGUF model kept on disk (lowbit.evaluation.gguf_cache): read back, it is the model
the conversion made (weights, tied head, config fields from_pretrained would add, tokenizer); a
changed file gets another directory; LOWBIT_CACHE=off keeps nothing."""
import pytest
import torch

from lowbit.evaluation import gguf_cache

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _converted(rng):
    """A tiny Llama as the GGUF path leaves it: no architectures, no dtype in its config."""
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return model, transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def test_the_copy_is_the_conversion(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(torch.randint(0, 256, (1000,), generator=rng, dtype=torch.uint8).numpy().tobytes())
    model, tok = _converted(rng)
    config = model.config.to_dict()
    d = gguf_cache.converted_dir(gguf)
    assert d.parent == tmp_path / "cache" / "gguf" and gguf_cache.load_converted(d, gguf) is None
    gguf_cache.store_converted(d, model, tok)
    assert gguf_cache._json(model.config.to_dict()) == gguf_cache._json(config)   # save_pretrained's additions undone
    got, got_tok = gguf_cache.load_converted(d, gguf)
    want = {**config, "_name_or_path": str(gguf.parent)}
    assert gguf_cache._json(got.config.to_dict()) == gguf_cache._json(want)
    a, b = model.state_dict(), got.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
    text = " ".join(f"w{int(i)}" for i in torch.randint(0, 32, (20,), generator=rng))
    assert got_tok(text)["input_ids"] == tok(text)["input_ids"]
    ids = torch.randint(0, 32, (1, 11), generator=rng)
    with torch.no_grad():
        assert torch.equal(got(ids).logits, model(ids).logits)
    gguf.write_bytes(gguf.read_bytes() + b"\0")          # another file: another copy
    assert gguf_cache.converted_dir(gguf) != d
    assert [p.name for p in d.parent.iterdir()] == [d.name]     # no temporary directory left


def test_off(monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE", "off")
    assert gguf_cache.cache_root() is None and gguf_cache.converted_dir(None) is None
