"""The user's own calibration / evaluation text (`lowbit quantize --calib-data FILE --eval-data FILE`):

- ``.txt``: the whole file is one text;
- ``.jsonl``: one JSON object per line with a string field ``"text"`` (the layout of most
  Hugging Face text data sets); the texts are joined by a blank line, as the Wikipedia
  articles of lowbit.evaluation.embedded are;
- ``.safetensors``: already tokenized ids, one integer tensor (any shape; read row by row).

Each reader raises ValueError naming the flag, the file and the fix; nothing is skipped
silently (a .jsonl line without "text" is an error, not a gap)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from lowbit.io.st_format import TensorReader


def read_texts(path: str | Path, flag: str) -> list[str]:
    """The texts of a .txt (one text) or .jsonl ("text" per line) file."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {p}: cannot read it as UTF-8 text ({e})") from e
    if p.suffix.lower() == ".txt":
        texts = [raw] if raw.strip() else []
    elif p.suffix.lower() == ".jsonl":
        texts = []
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag} {p}: line {i} is not JSON ({e.msg}); a .jsonl file holds one object per "
                                 "line") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{flag} {p}: line {i} has no string field \"text\"; each line must be "
                                 "{\"text\": \"...\"}")
            texts.append(obj["text"])
    else:
        raise ValueError(f"{flag} {p}: text comes as .txt or .jsonl (token ids as .safetensors)")
    if not texts:
        raise ValueError(f"{flag} {p} holds no text")
    return texts


def read_token_ids(path: str | Path, tokenizer, flag: str, vocab_size: int | None = None) -> torch.Tensor:
    """int64 [n] token ids of the file: .txt / .jsonl tokenized by `tokenizer` (texts joined by
    a blank line), .safetensors read as they are. Ids outside [0, vocab_size) are refused."""
    p = Path(path)
    if p.suffix.lower() == ".safetensors":
        ids = _stored_ids(p, flag)
    else:
        if tokenizer is None:
            raise ValueError(f"{flag} {p}: this model has no tokenizer; give token ids as a .safetensors file")
        ids = torch.tensor(tokenizer("\n\n".join(read_texts(p, flag)))["input_ids"], dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError(f"{flag} {p} holds no tokens")
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{flag} {p}: token ids span [{int(ids.min())}, {int(ids.max())}] but the model's vocabulary "
                         f"is [0, {vocab_size}); were they made by another tokenizer?")
    return ids


def _stored_ids(p: Path, flag: str) -> torch.Tensor:
    try:
        with TensorReader(p) as r:
            names = r.keys()
            if len(names) != 1:
                raise ValueError(f"{flag} {p} holds {len(names)} tensors ({names[:4]}); give one tensor of token ids")
            t = r.get(names[0])
    except (ValueError, OSError) as e:
        if str(e).startswith(flag):
            raise
        raise ValueError(f"{flag} {p}: not a readable safetensors file ({e})") from e
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{flag} {p}: tensor {names[0]!r} is {t.dtype}; token ids are integers (int32 / int64)")
    return t.reshape(-1).to(torch.long)


def first_tokens(ids: torch.Tensor, n: int, flag: str, path, count_flag: str) -> torch.Tensor:
    """The first n ids; a file holding fewer is refused with the count it holds."""
    if ids.numel() < n:
        raise ValueError(f"{flag} {path} holds {ids.numel()} tokens, fewer than {count_flag} {n}; give "
                         f"{count_flag} {ids.numel()} or less, or more text")
    return ids[:n]
