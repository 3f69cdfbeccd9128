"""lowbit.evaluation.text_files: the user's .txt / .jsonl / .safetensors text, read as written or
refused in one line naming the flag, the file and the fix."""
import json

import pytest
import torch
from safetensors.torch import save_file

from lowbit.evaluation.text_files import first_tokens, fit_tokens, read_texts, read_token_ids


class CharTokenizer:
    """One id per character (an independent stand-in for a real tokenizer)."""

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


def _words(rng, n):
    letters = "abcdefghij \u00e9"
    return ["".join(letters[i] for i in torch.randint(0, len(letters), (int(k),), generator=rng))
            for k in torch.randint(1, 40, (n,), generator=rng)]


def test_txt_and_jsonl_give_the_texts_as_written(tmp_path, rng):
    texts = _words(rng, 5)
    (tmp_path / "a.txt").write_text("\n".join(texts), encoding="utf-8")
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts))
                                      + "\n\n", encoding="utf-8")
    assert read_texts(tmp_path / "a.txt", "--calib-data") == ["\n".join(texts)]
    assert read_texts(tmp_path / "a.jsonl", "--calib-data") == texts
    ids, note = read_token_ids(tmp_path / "a.jsonl", CharTokenizer(), "--eval-data")
    assert note is None and ids.tolist() == [ord(c) for c in "\n\n".join(texts)]


def test_safetensors_ids_are_read_unchanged(tmp_path, rng):
    ids = torch.randint(0, 1000, (3, 17), generator=rng, dtype=torch.int64)
    save_file({"input_ids": ids.to(torch.int32)}, str(tmp_path / "ids.safetensors"))
    got, _ = read_token_ids(tmp_path / "ids.safetensors", None, "--calib-data", vocab_size=1000)
    assert got.dtype == torch.int64 and torch.equal(got, ids.reshape(-1))
    assert torch.equal(first_tokens(got, 20, "--calib-data", "ids.safetensors", "--calib-tokens"), got[:20])


@pytest.mark.parametrize("name, content, why", [
    ("bad.jsonl", '{"text": "ok"}\n{"txt": "no"}\n', 'line 2 has no field "text" (it has txt)'),
    ("bad.jsonl", '{"text": "ok"}\n{"text": 3}\n', "line 2's 'text' is int"),
    ("bad.jsonl", '{"text": "ok"}\nnot json\n', "line 2 is not JSON"),
    ("empty.txt", "  \n", "holds no text"),
    ("two.safetensors", {"a": torch.zeros(2, dtype=torch.int64), "b": torch.zeros(2, dtype=torch.int64)},
     "holds 2 tensors"),
    ("float.safetensors", {"a": torch.zeros(2)}, "token ids are integers"),
    ("big.safetensors", {"a": torch.tensor([1, 5000])}, "vocabulary is [0, 1000)"),
    ("cut.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":", "not a readable safetensors file"),
])
def test_bad_files_are_refused_with_the_reason(tmp_path, name, content, why):
    p = tmp_path / name
    if isinstance(content, dict):
        save_file(content, str(p))
    elif isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    with pytest.raises(ValueError, match="--calib-data") as e:
        read_token_ids(p, CharTokenizer(), "--calib-data", vocab_size=1000)
    assert why in str(e.value)


def test_too_few_tokens_names_the_count(tmp_path):
    with pytest.raises(ValueError, match="holds 3 tokens, fewer than --tokens 8; give --tokens 3 or less"):
        first_tokens(torch.arange(3), 8, "--eval-data", "x.txt", "--tokens")


# ------------------------------------------------------------------ data as saved by datasets / pyarrow
datasets = pytest.importorskip("datasets")

# A Jinja chat template simple enough to render by hand: "<role>content\n" per message.
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def _chat_tokenizer(template=TEMPLATE):
    """A real transformers tokenizer (one id per character) with or without a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10, "[UNK]": 0}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")
    tok.chat_template = template
    return tok


def _conversations(rng, n):
    words = _words(rng, 2 * n)
    return [[{"role": "user", "content": words[2 * i]}, {"role": "assistant", "content": words[2 * i + 1]}]
            for i in range(n)]


def test_parquet_and_saved_dataset_give_the_column_as_written(tmp_path, rng):
    texts = _words(rng, 7)
    other = _words(rng, 7)
    ds = datasets.Dataset.from_dict({"body": texts, "text": other})
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "a.parquet", tmp_path / "saved"):
        assert read_texts(path, "--calib-data") == other                 # 'text' by default
        assert read_texts(path, "--calib-data", "body") == texts         # --text-column body
        ids, _ = read_token_ids(path, CharTokenizer(), "--calib-data", text_column="body")
        assert ids.tolist() == [ord(c) for c in "\n\n".join(texts)]


def test_a_missing_column_lists_the_columns(tmp_path, rng):
    datasets.Dataset.from_dict({"body": _words(rng, 3), "id": [1, 2, 3]}).to_parquet(str(tmp_path / "a.parquet"))
    with pytest.raises(ValueError, match=r"no column 'text' \(or 'messages'\); its columns are body, id") as e:
        read_texts(tmp_path / "a.parquet", "--calib-data")
    assert "--text-column" in str(e.value)
    with pytest.raises(ValueError, match="no column 'txt'; its columns are body, id"):
        read_texts(tmp_path / "a.parquet", "--calib-data", "txt")
    with pytest.raises(ValueError, match="row 0's 'id' is int"):
        read_texts(tmp_path / "a.parquet", "--calib-data", "id")


def test_a_dataset_dict_folder_asks_for_one_split(tmp_path, rng):
    d = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": _words(rng, 2)}),
                              "test": datasets.Dataset.from_dict({"text": _words(rng, 2)})})
    d.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict of splits \(test, train\); give one split's folder"):
        read_texts(tmp_path / "dd", "--eval-data")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not one saved by datasets' save_to_disk"):
        read_texts(tmp_path / "plain", "--eval-data")


def test_chat_conversations_get_the_chat_template(tmp_path, rng):
    convs = _conversations(rng, 4)
    by_hand = ["".join(f"<{m['role']}>{m['content']}\n" for m in c) for c in convs]
    plain = ["\n".join(m["content"] for m in c) for c in convs]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in convs), encoding="utf-8")
    datasets.Dataset.from_dict({"messages": convs}).save_to_disk(str(tmp_path / "saved"))
    tok, bare = _chat_tokenizer(), _chat_tokenizer(None)
    for path in (tmp_path / "c.jsonl", tmp_path / "saved"):
        assert read_texts(path, "--calib-data", tokenizer=tok) == by_hand            # auto, with a template
        assert read_texts(path, "--calib-data", tokenizer=tok, chat="on") == by_hand
        assert read_texts(path, "--calib-data", tokenizer=tok, chat="off") == plain
        assert read_texts(path, "--calib-data", tokenizer=bare) == plain              # auto, without one
        ids, note = read_token_ids(path, tok, "--calib-data")
        assert ids.tolist() == tok("\n\n".join(by_hand))["input_ids"]
        assert "4 chat conversations rendered by the tokenizer's chat template" in note
        with pytest.raises(ValueError, match="--chat-template on: this model's tokenizer has no chat template"):
            read_texts(path, "--calib-data", tokenizer=bare, chat="on")
    (tmp_path / "t.txt").write_text("plain text", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no chat conversations"):
        read_texts(tmp_path / "t.txt", "--calib-data", tokenizer=tok, chat="on")


@pytest.mark.parametrize("window", [5, 8, 32])
def test_default_counts_fit_the_data_and_given_counts_are_refused(rng, window):
    n = int(torch.randint(window, 4 * window, (1,), generator=rng))
    ids = torch.randint(0, 100, (n,), generator=rng)
    got, line = fit_tokens(ids, 8192, window, "--eval-data", "e.txt", "--tokens", exact=False)
    use = (n // window) * window                        # whole windows, the way perplexity reads them
    assert torch.equal(got, ids[:use]) and f"holds {n} tokens" in line and f"using {use} ({n // window} windows" in line
    got, line = fit_tokens(ids, n, window, "--eval-data", "e.txt", "--tokens", exact=False)
    assert torch.equal(got, ids) and line is None       # enough text: the count asked for, nothing said
    with pytest.raises(ValueError, match=f"holds {n} tokens, fewer than --tokens 8192"):
        fit_tokens(ids, 8192, window, "--eval-data", "e.txt", "--tokens", exact=True)
    with pytest.raises(ValueError, match=f"less than one --window of {n + 1}"):
        fit_tokens(ids, 8192, n + 1, "--eval-data", "e.txt", "--tokens", exact=False)
