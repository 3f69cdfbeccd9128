"""Checks of `lowbit quantize` / `lowbit sites` arguments that run before any model is loaded:
a mistake costs the user no minutes of loading and quantizing. Each raises ValueError naming
the flag and the fix (lowbit.entrypoints.main prints it as one line, exit status 2)."""
from __future__ import annotations

import difflib
import math
from pathlib import Path

from lowbit.evaluation import text_files as T
from lowbit.recipes.presets import RECIPES
from lowbit.workflows.job import parse_kv_cache, parse_recipe


def recipe_names(text: str, flag: str = "--recipe") -> list[str]:
    """A comma-separated recipe list, every name checked (a misspelt one gets "did you mean")."""
    names = [r.strip() for r in text.split(",") if r.strip()]
    if not names:
        raise ValueError(f"{flag} is empty; name a recipe")
    out = []
    for r in names:
        try:
            out.append(parse_recipe(r).name)
        except ValueError as err:
            near = difflib.get_close_matches(r.lower().replace("_", "-"), list(RECIPES), n=1, cutoff=0.6)
            raise ValueError(f"{flag}: " + (f"did you mean {near[0]}? " if near else "") + str(err)) from err
    return out


def recipe_or_skip(text: str, flag: str) -> str:
    """One recipe name, or "skip" (keep in high precision)."""
    if text.strip().lower() == "skip":
        return "skip"
    if "," in text:
        raise ValueError(f"{flag} {text!r}: give one recipe (or skip), not a list")
    return recipe_names(text, flag)[0]


def overrides(items: list[str] | None) -> dict[str, str]:
    """--override PATTERN=RECIPE items -> {pattern: recipe or "skip"}, every recipe checked."""
    out = {}
    for it in items or []:
        pattern, sep, recipe = it.partition("=")
        if not sep or not pattern or not recipe:
            raise ValueError(f"--override {it!r}: write PATTERN=RECIPE (or PATTERN=skip)")
        out[pattern] = recipe_or_skip(recipe, f"--override {it!r}")
    return out


def positive(value, flag: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ValueError(f"{flag} must be a positive number, got {value}")


def fraction(value: float, flag: str, hi: float = 1.0) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= hi):
        raise ValueError(f"{flag} must lie in [0, {hi}], got {value}")


def text_sizes(tokens: int, window: int, flag: str = "--tokens") -> None:
    """Perplexity runs over whole non-overlapping windows: at least one must fit."""
    positive(window, "--window")
    if window < 2:
        raise ValueError(f"--window {window}: a perplexity window needs at least 2 tokens")
    positive(tokens, flag)
    if tokens < window:
        raise ValueError(f"{flag} {tokens} is less than one --window of {window}; give {flag} >= {window} "
                         "or a smaller --window")


def png_path(path: str, flag: str = "--png") -> None:
    """A PNG destination in a directory that exists (or can be made) and is writable."""
    if Path(path).suffix.lower() != ".png":
        raise ValueError(f"{flag} {path}: the figure is a PNG; give a path ending in .png")
    probe_writable_file(path, flag)


def probe_writable_file(path: str, flag: str) -> None:
    """A file destination (not a directory) in a writable directory."""
    from lowbit.io.outdir import OutputDirError, probe_writable
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    try:
        probe_writable(p.parent, f"{flag} {path}")
    except OutputDirError as err:
        raise ValueError(str(err)) from err


def kv_cache(text: str | None) -> str | None:
    """--kv-cache NAME: checked by the job's parser (lowbit.workflows.job) before any model loads."""
    if text is None:
        return None
    try:
        parse_kv_cache(text)
    except ValueError as err:
        raise ValueError(f"--kv-cache: {err}") from err
    return text


def device(text: str | None, flag: str = "--device") -> None:
    """A torch device lowbit can run on here: cpu, or cuda / cuda:N with that GPU visible."""
    if text is None:
        return
    import torch
    try:
        d = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {text!r} is not a device name; give cpu or cuda (cuda:N for one GPU)") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} {text}: lowbit runs on cpu or cuda, not {d.type}")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {text}: no CUDA GPU is visible on this machine (torch "
                             f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'}); use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {text}: this machine has {torch.cuda.device_count()} GPU(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def data_file(path: str | None, flag: str, *, text_column: str | None, chat: str, template: bool | None,
              count: int, count_flag: str, given: bool, window: int, vocab_size: int | None) -> None:
    """--calib-data / --eval-data, read before any model loads: the file kind, its rows and
    columns (text_files.read_samples), --chat-template against its conversations and the model's
    template (when known), and for token ids the count against an explicit count flag, one
    --window and the vocabulary. Texts are tokenized once the tokenizer is loaded."""
    if path is None:
        return
    T.check_kind(path, flag)
    if T.is_token_file(path):
        if text_column is not None:
            raise ValueError(f"{flag} {path} holds token ids, not text columns; drop --text-column")
        ids = T.stored_ids(Path(path), flag)
        T.check_vocab(ids, vocab_size, flag, path)
        T.fit_tokens(ids, count, window, flag, path, count_flag, exact=given)
        return
    T.check_chat(T.read_samples(path, flag, text_column).chats, chat, template, flag, path)
