"""The layer-by-layer job's inputs, for `lowbit quantize --sequential` and any Python caller of
lowbit.pipelines.layerwise.quantize_layerwise: the calibration windows, tokenized by the checkpoint's
own tokenizer (the model is never loaded whole), and the loaders that cannot read the checkpoint a
recipe will write, from config.json alone.

    from lowbit.pipelines.layerwise import quantize_layerwise
    from lowbit.workflows.sequential import calibration_windows, loader_lines
    calib = calibration_windows("/path/to/model", tokens=1024, window=512)
    for line in loader_lines("/path/to/model", "w4a16", ignore=()):
        print("warning:", line)
    quantize_layerwise("/path/to/model", "out", "w4a16", calib, device="cuda")
"""
from __future__ import annotations

import json
from pathlib import Path

from lowbit.evaluation import text_files as T
from lowbit.evaluation.embedded import _offline, wiki_token_ids, windows
from lowbit.evaluation.workload import tokenizer_files
from lowbit.pipelines.layerwise import MOE_FAMILIES
from lowbit.progress import say_flushed
from lowbit.recipes.loaders import add_form, loader_warnings, recipe_form
from lowbit.recipes.plan import match
from lowbit.recipes.presets import RECIPES


def loader_lines(model_dir: str, recipe: str, ignore) -> list[str]:
    """The loaders that cannot read the checkpoint this run writes (lowbit.recipes.loaders), from
    config.json and the recipe alone: --sequential writes layer by layer, so this is said first."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    experts = "model.layers.0.mlp.experts"      # layer 0's experts module in every MoE family transformers ships
    parts = ["dense"] + (["experts"] if model_type in MOE_FAMILIES
                         and not any(match(p, experts) for p in ignore or ()) else [])
    forms: dict = {}
    for part in parts:
        add_form(forms, part, *recipe_form(RECIPES[recipe]), recipe)
    return list(loader_warnings(forms).values())


def calibration_windows(model_dir: str, tokens: int, window: int, calib_data: str | None = None, *,
                        text_column: str | None = None, chat: str = "auto", exact: bool = True,
                        say=say_flushed) -> list:
    """[1, window] id tensors of the calibration text (Wikipedia's calib split, as the whole-model
    path, or the calib_data file), tokenized by the checkpoint's own tokenizer. exact False:
    `tokens` is a default, and a file holding fewer gives its whole windows (a line to `say` says so,
    as does one about a chat template)."""
    _offline()
    tokenizer_files(Path(model_dir))
    from transformers import AutoTokenizer     # optional: transformers, after _offline() (its env is read at import)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if calib_data is not None:
        ids, chat_line = T.read_token_ids(calib_data, tok, "--calib-data", text_column=text_column, chat=chat)
        ids, fit_line = T.fit_tokens(ids, tokens, window, "--calib-data", calib_data, "--calib-tokens", exact)
        for line in (chat_line, fit_line):
            if line:
                say(line)
        return windows(ids, window)
    return windows(wiki_token_ids(tok, tokens, split="calib"), window)
