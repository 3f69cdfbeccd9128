"""A model id (``ORG/NAME``) resolved to its folder in the local Hugging Face cache, without network.

The cache is where huggingface_hub keeps downloads: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``, read when asked (not when imported, so a changed environment counts).
A model lies at ``models--ORG--NAME/snapshots/<revision>/``, the revision named by
``refs/main``. huggingface_hub's own ``snapshot_download(local_files_only=True)`` resolves it (it
never touches the network with that flag); a model that is not there is refused in one line that
says where lowbit looked and how to get it."""
from __future__ import annotations

import os
import re
from pathlib import Path

# ORG/NAME as the hub spells repository ids (letters, digits, '-', '_', '.'; one slash)
MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")


def looks_like_model_id(spec: str) -> bool:
    """True for 'ORG/NAME' (that is not an existing path)."""
    return bool(MODEL_ID.match(spec)) and ".." not in spec and not Path(spec).exists()


def hub_cache_dir() -> Path:
    """The folder huggingface_hub caches models in, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def cached_model(model_id: str, flag: str = "--model") -> Path:
    """The snapshot folder of `model_id` in the local cache. FileNotFoundError naming the cache
    folder and the fix when it is not there."""
    cache = hub_cache_dir()
    absent = (f"{flag} {model_id}: not in the local Hugging Face cache ({cache}, which HF_HUB_CACHE or HF_HOME "
              f"set); download it first (`hf download {model_id}`) or give the model's folder")
    try:
        from huggingface_hub import snapshot_download   # comes with transformers (the [models] extra)
    except ModuleNotFoundError:
        return _snapshot_by_layout(cache, model_id, absent)
    from huggingface_hub.errors import IncompleteSnapshotError
    try:
        return Path(snapshot_download(model_id, cache_dir=cache, local_files_only=True))
    except (OSError, IncompleteSnapshotError):      # LocalEntryNotFoundError is a FileNotFoundError
        raise FileNotFoundError(absent) from None


def _snapshot_by_layout(cache: Path, model_id: str, absent: str) -> Path:
    """The cache's documented layout read directly (huggingface_hub not installed)."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    try:
        rev = (repo / "refs" / "main").read_text().strip()
    except OSError:
        raise FileNotFoundError(absent) from None
    snap = repo / "snapshots" / rev
    if not snap.is_dir():
        raise FileNotFoundError(absent)
    return snap
