"""End-to-end evaluation of a (quantized) model: perplexity over non-overlapping windows,
sentence-embedding cosine for encoders, stored bytes, and tokens/s on CUDA."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: torch.Tensor, window: int = 512, progress: bool = False,
               desc: str = "perplexity") -> float:
    """exp(mean next-token negative log-likelihood) over non-overlapping windows of `window`
    tokens of the 1-D id tensor `ids` (each window predicts its tokens 2..window; a tail shorter
    than a window is dropped). The NLL sum is accumulated in float64."""
    from lowbit.nn.embedded import windows
    if ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D token-id tensor, got shape {tuple(ids.shape)}")
    device = next(model.parameters()).device
    ws = windows(ids, window)
    if progress:
        from tqdm import tqdm
        ws = tqdm(ws, desc=desc, unit="window", leave=False)
    total, count = 0.0, 0
    for w in ws:
        w = w.to(device)
        logits = model(w).logits[0, :-1].float()
        nll = F.cross_entropy(logits, w[0, 1:], reduction="sum")
        if not torch.isfinite(nll):
            raise FloatingPointError("the model produced NaN/Inf logits: a quantized site overflows")
        total += float(nll.double())
        count += w.shape[1] - 1
    return math.exp(total / count)


@torch.no_grad()
def sentence_embeddings(model: torch.nn.Module, tokenizer, sentences: list[str]) -> torch.Tensor:
    """Mean-pooled, L2-normalised last hidden states (the sentence-transformers recipe of
    all-MiniLM-L6-v2): float32 [len(sentences), hidden]."""
    enc = tokenizer(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt")
    device = next(model.parameters()).device
    enc = {k: v.to(device) for k, v in enc.items()}
    h = model(**enc).last_hidden_state.float()
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return F.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)


def embedding_cosine(model_ref: torch.nn.Module, model_q: torch.nn.Module, tokenizer,
                     sentences: list[str]) -> torch.Tensor:
    """Cosine similarity, per sentence (float32 [n]), between the reference and the quantized
    encoder's sentence embeddings."""
    a = sentence_embeddings(model_ref, tokenizer, sentences)
    b = sentence_embeddings(model_q, tokenizer, sentences)
    return (a * b).sum(-1)


def model_bytes(model: torch.nn.Module, float_bytes: int = 2) -> int:
    """Bytes the model's weights occupy when stored: every high-precision parameter at
    `float_bytes` per element (2: bf16, the usual serving baseline), tied parameters once; each
    QuantLinear as its element codes (bits per element / 8, int4/fp4 packed two per byte), its
    scales (fp32 4 bytes, e8m0/fp8 codes 1 byte, + a 4-byte global scale), zero points (1 byte)
    and bias."""
    from lowbit.nn.quant_linear import QuantLinear
    total = 0
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            qt = mod.weight_q
            total += math.ceil(qt.codes.numel() * mod.weight_scheme.fmt.bits / 8)
            total += qt.scale.numel() * (1 if getattr(qt, "scale_codes", None) is not None else 4)
            total += 4 if getattr(qt, "global_scale", None) is not None else 0
            total += 0 if getattr(qt, "zero_point", None) is None else qt.zero_point.numel()
            total += 0 if mod.act_static_scale is None else 4
        for p in mod.parameters(recurse=False):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * (float_bytes if p.is_floating_point() else p.element_size())
    return total


@torch.no_grad()
def tokens_per_second(model: torch.nn.Module, ids: torch.Tensor, window: int = 512) -> float | None:
    """Prefill throughput (tokens/s) of one window on CUDA, timed by lowbit.bench.timing; None on
    a machine without CUDA (CPU timings of the emulated paths would mislead)."""
    if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
        return None
    from lowbit.bench.timing import bench_ms
    w = ids[:window][None].cuda()
    ms = bench_ms(lambda x: model(x), [(w,)], warmup=3, rep=10)
    return w.numel() / (ms / 1e3)
