"""The user's own calibration / evaluation data (`lowbit quantize --calib-data PATH --eval-data PATH`),
as it lies on disk:

- ``.txt``: the whole file is one text;
- ``.jsonl``: one JSON object per line with a string field ``"text"`` (the layout of most
  Hugging Face text data sets) or a chat conversation ``"messages"`` (a list of
  ``{"role": ..., "content": ...}``);
- ``.parquet``: a table with a ``text`` column (or ``messages``);
- a folder written by ``datasets.Dataset.save_to_disk`` (the same columns);
- ``.safetensors``: already tokenized ids, one integer tensor (any shape; read row by row).

``text_column`` names the column / field of the texts (``--text-column``); left at None it is
``text``, or ``messages`` where there is no ``text``. Chat conversations are rendered by the
tokenizer's chat template (``chat="on"``, or ``"auto"`` where the tokenizer has one) or, without
it, as their contents one per line. Texts are joined by a blank line, as the Wikipedia articles
of lowbit.evaluation.embedded are.

Each reader raises ValueError naming the flag, the file and the fix; nothing is skipped
silently (a .jsonl line without the field is an error, not a gap)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.io.st_format import TensorReader

TABLE_SUFFIXES = (".jsonl", ".parquet")
TEXT_SUFFIXES = (".txt",) + TABLE_SUFFIXES
ID_SUFFIX = ".safetensors"
KINDS = ("a .txt file, a .jsonl file (a \"text\" or \"messages\" field per line), a .parquet file, a folder saved "
         "by datasets' save_to_disk, or a .safetensors file of token ids")
CHAT_MODES = ("auto", "on", "off")
DEFAULT_COLUMNS = ("text", "messages")


@dataclass(frozen=True)
class Samples:
    """What a text file holds: each sample a text (str) or a chat conversation (a list of
    {"role", "content"} dicts). column: the column / field they came from (None for .txt)."""
    items: list
    column: str | None = None

    @property
    def chats(self) -> int:
        return sum(not isinstance(s, str) for s in self.items)


def is_token_file(path) -> bool:
    return Path(path).suffix.lower() == ID_SUFFIX


def check_kind(path, flag: str) -> None:
    """A path lowbit can read as data (by its name and existence only)."""
    p = Path(path)
    if p.is_dir():
        return _dataset_kind(p, flag)
    if p.suffix.lower() not in TEXT_SUFFIXES + (ID_SUFFIX,):
        raise ValueError(f"{flag} {path}: give {KINDS}")
    if not p.is_file():
        raise ValueError(f"{flag} {path}: no such file")


def _dataset_kind(p: Path, flag: str) -> None:
    """A folder saved by datasets: one Dataset (state.json), not a DatasetDict of splits."""
    if (p / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in p.iterdir() if (d / "state.json").is_file())
        raise ValueError(f"{flag} {p} holds a DatasetDict of splits ({', '.join(splits)}); give one split's folder, "
                         f"e.g. {p / (splits[0] if splits else 'train')}")
    if not (p / "state.json").is_file():
        raise ValueError(f"{flag} {p} is a folder but not one saved by datasets' save_to_disk (no state.json); give "
                         f"{KINDS}")


def sentences_file(path, flag: str) -> None:
    """An encoder's data: sentences, not token ids (None passes)."""
    if path is not None and is_token_file(path):
        raise ValueError(f"{flag} {path}: an encoder is evaluated on sentences; give a .txt (one sentence a "
                         "line), .jsonl, .parquet or saved datasets folder")


def read_samples(path: str | Path, flag: str, text_column: str | None = None) -> Samples:
    """The samples of a text file or saved dataset (see the module docstring)."""
    p = Path(path)
    check_kind(p, flag)
    if p.is_file() and p.suffix.lower() == ".txt":
        raw = _utf8(p, flag)
        if text_column is not None:
            raise ValueError(f"{flag} {p}: a .txt file is one text and has no columns; drop --text-column")
        items = [raw] if raw.strip() else []
    elif p.is_file() and p.suffix.lower() == ".jsonl":
        return _jsonl(p, flag, text_column)
    elif p.is_file() and p.suffix.lower() == ".parquet":
        return _table(p, flag, text_column, *_parquet(p, flag))
    elif p.is_dir():
        return _table(p, flag, text_column, *_saved_dataset(p, flag))
    else:
        raise ValueError(f"{flag} {p}: token ids (.safetensors) hold no text")
    if not items:
        raise ValueError(f"{flag} {p} holds no text")
    return Samples(items)


def _utf8(p: Path, flag: str) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {p}: cannot read it as UTF-8 text ({e})") from e


def _jsonl(p: Path, flag: str, text_column: str | None) -> Samples:
    items, column = [], text_column
    for i, line in enumerate(_utf8(p, flag).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {p}: line {i} is not JSON ({e.msg}); a .jsonl file holds one object per "
                             "line") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{flag} {p}: line {i} is not a JSON object; each line must be {{\"text\": \"...\"}}")
        col = column or next((c for c in DEFAULT_COLUMNS if c in obj), None)
        if col is None or col not in obj:
            want = f'"{column}"' if column else '"text" (or "messages")'
            raise ValueError(f"{flag} {p}: line {i} has no field {want} (it has {', '.join(obj) or 'none'}); "
                             "name the field of the text with --text-column")
        column = col          # one field for the whole file, fixed by its first line
        items.append(_sample(obj[col], flag, p, f"line {i}", col))
    if not items:
        raise ValueError(f"{flag} {p} holds no text")
    return Samples(items, column)


def _parquet(p: Path, flag: str) -> tuple[list[str], Callable[[str], list]]:
    import pyarrow.parquet as pq          # optional dependency (the [data] extra)
    try:
        table = pq.read_table(p)
    except Exception as e:   # noqa: BLE001  pyarrow's ArrowInvalid / ArrowException derive from Exception
        raise ValueError(f"{flag} {p}: not a readable parquet file ({e})") from e
    return table.column_names, lambda c: table.column(c).to_pylist()


def _saved_dataset(p: Path, flag: str) -> tuple[list[str], Callable[[str], list]]:
    import datasets                      # optional dependency (the [data] extra)
    try:
        ds = datasets.load_from_disk(str(p))
    except (OSError, ValueError, FileNotFoundError) as e:
        raise ValueError(f"{flag} {p}: datasets cannot load this folder ({e})") from e
    return ds.column_names, lambda c: ds[c]


def _table(p: Path, flag: str, text_column: str | None, columns: list[str], values) -> Samples:
    col = text_column or next((c for c in DEFAULT_COLUMNS if c in columns), None)
    if col is None or col not in columns:
        want = f"'{text_column}'" if text_column else "'text' (or 'messages')"
        raise ValueError(f"{flag} {p} has no column {want}; its columns are {', '.join(columns) or 'none'}: name the "
                         "text column with --text-column")
    items = [_sample(v, flag, p, f"row {i}", col) for i, v in enumerate(values(col))]
    if not items:
        raise ValueError(f"{flag} {p} holds no rows")
    return Samples(items, col)


def _sample(v, flag: str, p: Path, where: str, col: str):
    """A text, or a conversation: a list of {"role": str, "content": str}."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                         and isinstance(m.get("content"), str) for m in v):
        return [{"role": m["role"], "content": m["content"]} for m in v]
    raise ValueError(f"{flag} {p}: {where}'s {col!r} is {type(v).__name__}, neither a string nor a chat conversation "
                     "(a list of {\"role\": ..., \"content\": ...}); name the text column with --text-column")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat(chats: int, chat: str, template: bool | None, flag: str, path) -> None:
    """--chat-template against the data (`chats` conversations) and the model (template: whether
    its tokenizer has a chat template; None: not known yet)."""
    if chat not in CHAT_MODES:
        raise ValueError(f"--chat-template {chat!r}: choose {', '.join(CHAT_MODES)}")
    if chat == "on" and chats == 0:
        raise ValueError(f"--chat-template on: {flag} {path} holds no chat conversations (a 'messages' column of "
                         "role/content lists); drop --chat-template on")
    if chat == "on" and template is False:
        raise ValueError("--chat-template on: this model's tokenizer has no chat template; use --chat-template off "
                         "(the conversations' contents, one per line)")


def render(samples: Samples, tokenizer, chat: str, flag: str, path) -> tuple[list[str], str | None]:
    """The samples as texts, and a line saying how conversations were rendered (None without any):
    by the tokenizer's chat template (chat "on", or "auto" where it has one), else their contents
    one per line. chat "on" without a template, or without conversations, is refused."""
    n = samples.chats
    check_chat(n, chat, has_chat_template(tokenizer), flag, path)
    template = chat == "on" or (chat == "auto" and has_chat_template(tokenizer))
    texts = [s if isinstance(s, str) else
             tokenizer.apply_chat_template(s, tokenize=False) if template else "\n".join(m["content"] for m in s)
             for s in samples.items]
    if not n:
        return texts, None
    how = ("rendered by the tokenizer's chat template" if template else
           "as their contents one per line (" + ("--chat-template off" if chat == "off" else
                                                 "the tokenizer has no chat template") + ")")
    return texts, f"{flag} {path}: {n} chat conversations {how}"


def read_texts(path: str | Path, flag: str, text_column: str | None = None, tokenizer=None,
               chat: str = "auto") -> list[str]:
    """The texts of a text file or saved dataset, conversations rendered (see render)."""
    return render(read_samples(path, flag, text_column), tokenizer, chat, flag, path)[0]


def read_token_ids(path: str | Path, tokenizer, flag: str, vocab_size: int | None = None, *,
                   text_column: str | None = None, chat: str = "auto") -> tuple[torch.Tensor, str | None]:
    """(int64 [n] token ids of the file, the chat line of render or None): texts tokenized by
    `tokenizer` (joined by a blank line), .safetensors read as they are. Ids outside
    [0, vocab_size) are refused."""
    p = Path(path)
    note = None
    if is_token_file(p):
        ids = stored_ids(p, flag)
    else:
        if tokenizer is None:
            raise ValueError(f"{flag} {p}: this model has no tokenizer; give token ids as a .safetensors file")
        texts, note = render(read_samples(p, flag, text_column), tokenizer, chat, flag, p)
        ids = torch.tensor(tokenizer("\n\n".join(texts))["input_ids"], dtype=torch.long)
    check_vocab(ids, vocab_size, flag, p)
    return ids, note


def check_vocab(ids: torch.Tensor, vocab_size: int | None, flag: str, p) -> None:
    """Some ids, all inside the model's vocabulary [0, vocab_size) (None: not known)."""
    if ids.numel() == 0:
        raise ValueError(f"{flag} {p} holds no tokens")
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{flag} {p}: token ids span [{int(ids.min())}, {int(ids.max())}] but the model's vocabulary "
                         f"is [0, {vocab_size}); were they made by another tokenizer?")


def stored_ids(p: Path, flag: str) -> torch.Tensor:
    """The one integer tensor of a .safetensors token file, flattened to int64."""
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


def fit_tokens(ids: torch.Tensor, n: int, window: int, flag: str, path, count_flag: str,
               exact: bool) -> tuple[torch.Tensor, str | None]:
    """(the ids to use, a line saying so when fewer than n): the first n ids; where the file holds
    fewer and n is a default (exact False), its whole windows of `window` tokens, said in a line;
    an n the user gave (exact) is refused as first_tokens does, and so is less than one window."""
    if ids.numel() >= n or exact:
        return first_tokens(ids, n, flag, path, count_flag), None
    use = ids.numel() // window * window
    if use == 0:
        raise ValueError(f"{flag} {path} holds {ids.numel()} tokens, less than one --window of {window}; give more "
                         "text or a smaller --window")
    return ids[:use], (f"{flag} {path} holds {ids.numel()} tokens, fewer than the default {count_flag} {n}: using "
                       f"{use} ({use // window} windows of {window}; {count_flag} sets the count)")
