"""attention_tap: see every attention call of a transformers model, without changing what it runs.

    with attention_tap(model, tap) as implementation:
        model(ids)          # each attention call: the model's own implementation, then tap(...)

The model's attention implementation (sdpa, eager, flash, or lowbit's quantized attention) is
wrapped by a registered implementation that calls it unchanged and then
tap(module, query [B, Hq, T, D] post-RoPE, key, value [B, Hkv, Tk, D] as read, scaling,
out [B, T, Hq, D]); a tensor the tap returns replaces the output (a reference put in its place).
The wrapped implementation's mask function is registered with it, so it gets the mask it expects.
What the per-site report records and what verify-model checks go through here.
"""
from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lowbit.nn.kv_cache import attention_modules

TAP = "lowbit_tap"
Tap = Callable[..., "torch.Tensor | None"]


def _tapped(module, query, key, value, attention_mask, **kwargs):
    inner, tap = module.lowbit_tap
    out, weights = inner(module, query, key, value, attention_mask, **kwargs)
    new = tap(module, query, key, value, kwargs.get("scaling"), out)
    return (out if new is None else new), weights


def _inner(implementation: str, module):
    if implementation == "eager":     # each model file has its own eager function (no registry entry)
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, None)


@contextmanager
def attention_tap(model, tap: Tap):
    """Inside the block, every attention call of `model` runs its implementation, then tap(...).
    Yields the wrapped implementation's name, or None when this model cannot be tapped (its class
    does not dispatch attention through transformers' AttentionInterface; nothing is changed)."""
    implementation = model.config._attn_implementation or "eager"
    mods = [m for _, m in attention_modules(model).values()]
    inner = _inner(implementation, mods[0]) if mods else None
    if inner is None:
        yield None
        return
    name = f"{TAP}_{re.sub(r'[^A-Za-z0-9_]', '_', implementation)}"
    AttentionInterface.register(name, _tapped)
    if implementation in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    for m in mods:
        m.lowbit_tap = (inner, tap)
    model.set_attn_implementation(name)
    try:
        yield implementation if model.config._attn_implementation == name else None
    finally:
        model.set_attn_implementation(implementation)
        for m in mods:
            del m.lowbit_tap
