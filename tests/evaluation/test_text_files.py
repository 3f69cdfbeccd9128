"""lowbit.evaluation.text_files: the user's .txt / .jsonl / .safetensors text, read as written or
refused in one line naming the flag, the file and the fix."""
import json

import pytest
import torch
from safetensors.torch import save_file

from lowbit.evaluation.text_files import first_tokens, read_texts, read_token_ids


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
