"""Quantized attention inside a transformers model: an attention implementation named "lowbit".

    enable_quantized_attention(model, AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn"))

Every attention module then computes lowbit.ops.attention (Q quantized per token and head, P per
(row, key block), O in fp32 across the online-softmax rescales) on the keys and values its cache
returns (a LowbitKVCache's dequantized values, in the model's dtype). Causal masks only:
a padding mask is refused (NotImplementedError), never ignored.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from lowbit.ops import attention_reference as ar
from lowbit.ops.attention import attention

NAME = "lowbit"


def _check_causal(mask, Tq: int, Tk: int) -> None:
    if mask is None:
        return                                      # transformers skipped the mask: plain causal
    m = mask if mask.dtype == torch.bool else (mask == 0)
    want = ar.allowed_mask(Tq, Tk, True, m.device)
    if not bool((m == want).all()):
        raise NotImplementedError("lowbit attention takes causal masks only; this batch has a padding (or other) "
                                  "mask: run it unpadded, or use the model's own attention implementation")


def lowbit_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature; returns ([B, T, Hq, D], None)."""
    if dropout:
        raise NotImplementedError("lowbit attention is for inference: dropout must be 0 (call model.eval())")
    spec = getattr(module, "lowbit_attn_spec", None) or ar.AttnSpec()
    spec = dataclasses.replace(spec, causal=True, sm_scale=scaling)
    _check_causal(attention_mask, query.shape[2], key.shape[2])
    out = attention(query, key, value, spec)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, lowbit_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def enable_quantized_attention(model, spec: ar.AttnSpec | None = None) -> None:
    """Switch `model` to lowbit's quantized attention with `spec` (default AttnSpec())."""
    spec = spec or ar.AttnSpec()
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "k_proj"):
            m.lowbit_attn_spec = spec
    model.set_attn_implementation(NAME)
