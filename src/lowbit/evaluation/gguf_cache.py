"""The float model converted from a GGUF file, kept on disk: a load after the first reads it in
seconds instead of the ~20 s of CPU that transformers' GGUF path spends (it parses the file's
metadata in Python three times: for the config, the tokenizer and the weights).

The copy is the conversion's exact result: the float32 state dict load_gguf_llama built, its
config.json and its tokenizer files (save_pretrained), in a directory named by the sha256 of the
GGUF file's bytes and the torch and transformers versions that converted it, so a changed file or a
changed conversion is never read back. It is written into a temporary directory and renamed, so an
interrupted or concurrent write leaves no half copy; a cache that cannot be written (read-only,
full) costs only the time. Where: $LOWBIT_CACHE, else $XDG_CACHE_HOME/lowbit, else ~/.cache/lowbit;
LOWBIT_CACHE=off turns it off.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch


def cache_root() -> Path | None:
    """The cache directory, or None when LOWBIT_CACHE=off."""
    env = os.environ.get("LOWBIT_CACHE")
    if env is not None and env.strip().lower() == "off":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lowbit"


def converted_dir(path: Path) -> Path | None:
    """Where the converted copy of the GGUF file `path` lives (it may not exist yet)."""
    root = cache_root()
    if root is None:
        return None
    import transformers
    h = hashlib.sha256(f"torch {torch.__version__}|transformers {transformers.__version__}|".encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return root / "gguf" / f"{path.stem}-{h.hexdigest()[:24]}"


# The conversion's own config (to_dict()), beside the copy: from_pretrained adds fields the GGUF
# path leaves unset (dtype, architectures, the directory's name), which would reach the configs
# lowbit writes; they are put back as the conversion had them.
CONFIG = "gguf_config.json"


def load_converted(d: Path | None, path: Path):
    """(model, tokenizer) from the converted copy of the GGUF file `path`, float32 in eval mode, its
    config as the conversion made it; None when there is no copy (or its config cannot be made
    the conversion's)."""
    if d is None or not (d / CONFIG).is_file():
        return None
    from transformers import AutoTokenizer, LlamaForCausalLM
    want = json.loads((d / CONFIG).read_text(encoding="utf-8"))
    want["_name_or_path"] = str(path.parent)
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    _restore(model.config, want)
    if _json(model.config.to_dict()) != _json(want):
        return None
    return model, AutoTokenizer.from_pretrained(d)


def store_converted(d: Path | None, model, tokenizer) -> None:
    """Write the converted copy (nothing when caching is off or the cache cannot be written)."""
    if d is None:
        return
    tmp = None
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=d.name + ".", dir=d.parent))
        config = _json(model.config.to_dict())      # before save_pretrained, which adds fields to it
        model.save_pretrained(tmp)
        _restore(model.config, json.loads(config))
        tokenizer.save_pretrained(tmp)
        (tmp / CONFIG).write_text(config, encoding="utf-8")
        tmp.rename(d)
        tmp = None
    except OSError:
        pass            # another process renamed its copy first, or the cache is not writable
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _json(value) -> str:
    """A config value's JSON form (int dict keys become strings, as in config.json)."""
    return json.dumps(value, sort_keys=True, default=str)


def _restore(config, want: dict) -> None:
    """Set the fields of `config` whose JSON form differs from `want`'s (config.to_dict() values)."""
    have = config.to_dict()
    for k, v in want.items():
        if _json(have.get(k)) != _json(v):
            setattr(config, k, v)
