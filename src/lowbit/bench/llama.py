"""A Llama-shaped transformers model with random weights, and the three calls `lowbit bench model`
times on it: full logits of a prompt, a prefill that returns the last token's logits, and one
decode step against a KV cache. Everything that differs between transformers versions lives here.

transformers changed its calling convention between 4.4x and 5.x, and these functions follow
both (they read the installed version's signatures, they do not compare version numbers):
- the cache argument is `past_key_values` (4.x) or `cache` (5.x);
- 4.x takes explicit `cache_position`s and a StaticCache writes there, so repeating one decode
  step rewrites the same slot; 5.x StaticCache layers count the tokens they hold
  (`cumulative_length`, a tensor) and append there, so every timed step ends with
  `cache.crop(-1)` (one in-place subtraction per layer, also inside a compiled graph) to give
  the slot back. A DynamicCache appends on every version and is cropped the same way.
  `check_repeatable`, called after the warm-up steps, finds a cache that kept appending (an
  error, not a timing of ever longer contexts, nor an index past the cache on the GPU).
- StaticCache's constructor took (config, max_batch_size, max_cache_len, device, dtype) and now
  takes (config, max_cache_len) and sizes itself lazily on the first update: `new_cache` passes
  whichever arguments the installed constructor names. Without StaticCache (or when it cannot
  be built) the cache is a DynamicCache and compiled decode is skipped by the caller.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

# Llama-family shapes (hidden, intermediate, attention heads, KV heads, vocabulary, tied
# embeddings, rope theta) as in the released configs; `tiny` is the CPU test's.
SHAPES: dict[str, dict] = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),       # Llama-3-8B
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),        # Llama-3.2-1B
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),    # SmolLM2-135M
    "tiny": dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=256, tie_word_embeddings=False, rope_theta=10000.0),
}


def build_llama(shape: str, layers: int, dtype: torch.dtype, device: str, seed: int,
                max_positions: int = 8192) -> torch.nn.Module:
    """LlamaForCausalLM of `SHAPES[shape]` with `layers` decoder layers, eval mode, on `device`
    in `dtype`: random weights from transformers' own initialisation (normal, std
    initializer_range = 0.02), drawn after torch.manual_seed(seed) on `device` in float32, so
    the same (seed, device) gives the same model; nothing is downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is not known; choose one of {', '.join(SHAPES)}")
    if layers < 1:
        raise ValueError(f"layers={layers}: a model needs at least one decoder layer")
    cfg = LlamaConfig(**SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=max_positions,
                      rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype=dtype).eval()


@dataclass
class Calls:
    """How the installed transformers wants the base model called (see the module docstring)."""
    cache_kw: str             # "cache" or "past_key_values"
    explicit_positions: bool  # forward takes cache_position (4.x)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Calls":
        params = inspect.signature(model.model.forward).parameters
        return cls("cache" if "cache" in params else "past_key_values", "cache_position" in params)


def full_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] of every position of `ids` [B, T], no cache."""
    return model.lm_head(model.model(input_ids=ids, use_cache=False).last_hidden_state)


def prefill_step(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """fn(ids [B, T], position_ids [B, T]) -> last token's logits [B, vocab]: the prompt through
    every layer without writing a cache (a serving engine writes its own; the difference is one
    copy of K and V per layer), and the LM head on the last position only, as generation does."""
    def prefill(ids, pos):
        h = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        return model.lm_head(h[:, -1])
    return prefill


def new_cache(model: torch.nn.Module, batch: int, max_len: int, static: bool = True):
    """(cache, kind): a StaticCache of max_len tokens for `batch` sequences on the model's device
    and dtype (kind "static"), or a DynamicCache (kind "dynamic") when static=False or this
    transformers has no usable StaticCache."""
    import transformers

    p = next(model.parameters())
    if static and hasattr(transformers, "StaticCache"):
        cls = transformers.StaticCache
        params = inspect.signature(cls.__init__).parameters
        kw = dict(config=model.config, max_cache_len=max_len)
        batch_kw = "max_batch_size" if "max_batch_size" in params else "batch_size"
        for name, value in ((batch_kw, batch), ("device", p.device), ("dtype", p.dtype)):
            if name in params:
                kw[name] = value
        try:
            return cls(**kw), "static"
        except TypeError:  # a constructor this code does not know: fall back, the caller records it
            pass
    return transformers.DynamicCache(), "dynamic"


def fill_cache(model: torch.nn.Module, cache, ids: torch.Tensor) -> None:
    """Prefill `ids` [B, T] into `cache` at positions 0..T-1 (eager)."""
    calls = Calls.of(model)
    T = ids.shape[1]
    pos = torch.arange(T, device=ids.device)
    kw = {calls.cache_kw: cache}
    if calls.explicit_positions:
        kw["cache_position"] = pos
    model.model(input_ids=ids, position_ids=pos.expand(ids.shape[0], T), use_cache=True, **kw)


def decode_step(model: torch.nn.Module, cache, kind: str, tokens: torch.Tensor, context: int):
    """(fn, args): fn(*args) runs one decode step of `tokens` [B, 1] at position `context`
    against `cache`, which already holds `context` tokens (fill_cache), and returns the logits [B, vocab];
    calling it again repeats the same step (same slot, same context length)."""
    calls = Calls.of(model)
    rewind = not (kind == "static" and calls.explicit_positions)
    cache_kw = calls.cache_kw
    B = tokens.shape[0]
    pos = torch.full((B, 1), context, dtype=torch.long, device=tokens.device)
    cache_pos = pos[0] if calls.explicit_positions else None

    def decode(ids, pos, cache_pos):
        kw = {cache_kw: cache}
        if cache_pos is not None:
            kw["cache_position"] = cache_pos
        h = model.model(input_ids=ids, position_ids=pos, use_cache=True, **kw).last_hidden_state
        if rewind:
            rewind_cache(cache, ids.shape[1])
        return model.lm_head(h[:, -1])

    return decode, (tokens, pos, cache_pos)


def rewind_cache(cache, n: int) -> None:
    """Give back the last `n` tokens' slots. `cache.crop(-n)` where every layer can crop (4.x,
    DynamicCache, 5.24's StaticLayer); transformers 5.17's StaticLayer has no crop but counts its
    tokens in a `cumulative_length` tensor, which is decremented in place (graph-safe)."""
    layers = getattr(cache, "layers", None)
    if layers and not all(hasattr(layer, "crop") for layer in layers):
        for layer in layers:
            length = getattr(layer, "cumulative_length", None)
            if not isinstance(length, torch.Tensor):
                raise RuntimeError(f"cannot rewind {type(layer).__name__}: no crop() and no cumulative_length "
                                   "tensor in this transformers version")
            length.sub_(n)
        return
    cache.crop(-n)  # negative: remove that many tokens


def check_repeatable(cache, context: int) -> None:
    """After some decode steps at position `context`: the cache must hold `context` tokens, or
    context + 1 where the length is read from the written slots (4.x StaticCache)."""
    n = int(cache.get_seq_length())
    if n not in (context, context + 1):
        raise RuntimeError(f"the decode step is not repeatable with this transformers' {type(cache).__name__}: "
                           f"after repeated steps at position {context} it holds {n} tokens")
