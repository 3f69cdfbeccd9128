"""End-to-end evaluation of a (quantized) model: perplexity over non-overlapping windows, the
next-token KL divergence from and top-1 agreement with a reference (float) model, sentence-embedding
cosine for encoders, stored bytes, and tokens/s on CUDA."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.evaluation.embedded import windows
from lowbit.nn.experts import PROJECTIONS, QuantExperts
from lowbit.nn.quant_linear import QuantLinear
from lowbit.profiling.timing import bench_ms
from lowbit.progress import progress_bar


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: torch.Tensor, window: int = 512, progress: bool = False,
               desc: str = "perplexity") -> float:
    """exp(mean next-token negative log-likelihood) over non-overlapping windows of `window`
    tokens of the 1-D id tensor `ids` (each window predicts its tokens 2..window; a tail shorter
    than a window is dropped). The NLL sum is accumulated in float64."""
    return _perplexity_pass(model, ids, window, progress, desc, None)


def _perplexity_pass(model: torch.nn.Module, ids: torch.Tensor, window: int, progress: bool, desc: str,
                     keep: list | None) -> float:
    """perplexity(); with `keep` a list, each window's float32 logits [window - 1, vocab] are also
    appended to it on the CPU (reference_logits' values: the same forward, the same cast)."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D token-id tensor, got shape {tuple(ids.shape)}")
    device = next(model.parameters()).device
    ws = windows(ids, window)
    if progress:
        ws = progress_bar(ws, desc=desc, unit="window", leave=False)
    total, count = 0.0, 0
    for w in ws:
        w = w.to(device)
        logits = model(w).logits[0, :-1].float()
        total += _window_nll(logits, w[0, 1:])
        count += w.shape[1] - 1
        if keep is not None:
            keep.append(logits.cpu())
    return math.exp(total / count)


# Bytes of float32 reference logits (4 x vocab per evaluated token) that float_reference keeps in
# memory for later comparisons; above it the float model is run again beside each quantized one.
REFERENCE_BYTES = 4 << 30


@torch.no_grad()
def float_reference(model: torch.nn.Module, ids: torch.Tensor, window: int = 512, progress: bool = False,
                    desc: str = "float eval") -> tuple[float, list[torch.Tensor] | torch.nn.Module]:
    """The float model's perplexity and the reference token_metrics compares quantized models
    with, from ONE pass over the windows: its logits (reference_logits' values; the perplexity is
    perplexity()'s, bit for bit) when they fit in REFERENCE_BYTES, else the model itself (run
    again per quantized model, holding no logits)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    rows = (ids.numel() // window) * (window - 1)
    if vocab is None or 4 * vocab * rows > REFERENCE_BYTES:
        return perplexity(model, ids, window, progress, desc), model
    logits: list[torch.Tensor] = []
    return _perplexity_pass(model, ids, window, progress, desc, logits), logits


def _window_nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum of next-token negative log-likelihoods of one window: logits float32 [n, vocab], targets [n]."""
    nll = F.cross_entropy(logits, targets, reduction="sum")
    if not torch.isfinite(nll):
        raise FloatingPointError("the model produced NaN/Inf logits: a quantized site overflows")
    return float(nll.double())


@dataclass(frozen=True)
class TokenMetrics:
    """Next-token metrics of a model on a text, beside a reference model (the float one):
    perplexity: exp(mean NLL) as `perplexity()` computes it; kl: mean over predicted tokens of
    KL(P_ref || P_model) in nats (the reference's distribution first, as llama.cpp's KL divergence);
    kl_max: the largest per-token KL; top1: fraction of tokens whose argmax equals the reference's;
    tokens: how many next-token predictions were scored."""
    perplexity: float
    kl: float
    kl_max: float
    top1: float
    tokens: int


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: torch.Tensor, window: int = 512) -> list[torch.Tensor]:
    """The reference model's next-token logits per window (the windows of `perplexity()`), float32
    [window - 1, vocab] each, kept in memory: 4 x vocab bytes per token (1.6 GB for 8,192 tokens of
    SmolLM2's 49,152-token vocabulary), so that every quantized model is compared to one float pass."""
    device = next(model.parameters()).device
    return [model(w.to(device)).logits[0, :-1].float().cpu() for w in windows(ids, window)]


def _reference_key(model: torch.nn.Module, ids: torch.Tensor, window: int) -> str:
    """sha256 of what the reference logits depend on: the ids, the window, the model's parameters and
    buffers (names, dtypes, shapes, bytes) and the torch version (its kernels' summation order)."""
    import hashlib
    h = hashlib.sha256(f"{torch.__version__}|{window}|{tuple(ids.shape)}|".encode())
    h.update(ids.detach().cpu().to(torch.int64).contiguous().numpy().tobytes())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        t = t.detach().cpu().contiguous()
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def cached_reference_logits(model: torch.nn.Module, ids: torch.Tensor, window: int, cache_dir) -> list[torch.Tensor]:
    """reference_logits, kept on disk in `cache_dir` as one safetensors file per (model, ids, window,
    torch version) (no pickles; the key is the file's name and is checked again inside it): a later
    run reads the float32 logits back instead of running the model (~60 s for 8,192 SmolLM2 tokens
    on one core; the file holds 4 x vocab bytes per token)."""
    from pathlib import Path
    from safetensors.torch import load_file, save_file
    key = _reference_key(model, ids, window)
    path = Path(cache_dir) / f"reference-{key[:32]}.safetensors"
    if path.is_file():
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("key") == key:
            stacked = load_file(str(path))["logits"]
            return list(stacked.unbind(0))
    logits = reference_logits(model, ids, window)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temporary name of this process's own: the measure driver's parallel jobs all compute the same
    # reference at start, and with one shared name a job's rename could take away the file another was
    # about to rename (FileNotFoundError), which cost a whole table run once
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save_file({"logits": torch.stack(logits)}, str(tmp), metadata={"key": key, "window": str(window)})
    tmp.replace(path)
    return logits


@dataclass(frozen=True)
class PreparedReference:
    """The reference side of token_metrics, computed once for many quantized models: per window,
    logp = float64 log-softmax [window - 1, vocab] of the reference's float32 logits and top = their
    argmax, int64 [window - 1] (8 bytes x vocab per token: 3.2 GB for 8,192 SmolLM2 tokens). The
    same arithmetic token_metrics applies to raw logits (`_reference_side`), so the metrics are
    bit-identical to those computed from reference_logits."""
    logp: list
    top: list


def _reference_side(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 log-softmax, argmax) of one window's float32 reference logits [n, vocab]."""
    return torch.log_softmax(logits.double(), dim=-1), logits.argmax(-1)


def prepare_reference(logits: list[torch.Tensor]) -> PreparedReference:
    """PreparedReference from reference_logits' per-window float32 logits."""
    sides = [_reference_side(x) for x in logits]
    return PreparedReference([lp for lp, _ in sides], [t for _, t in sides])


@torch.no_grad()
def token_metrics(model: torch.nn.Module, ids: torch.Tensor,
                  reference: list[torch.Tensor] | PreparedReference | torch.nn.Module,
                  window: int = 512, progress: bool = False, desc: str = "eval") -> TokenMetrics:
    """Perplexity, mean/max KL divergence and top-1 agreement of `model` on the windows of `ids`,
    against `reference`: reference_logits of the float model on the same ids and window (or those
    logits prepared once by prepare_reference), or the float model itself (then run on each window
    beside `model`: no memory held, one more forward).
    KL per token = sum_v p_v (log p_v - log q_v), p = softmax(reference), q = softmax(model), both
    log-softmaxes in float64 from the float32 logits (so identical logits give exactly 0), summed in
    float64; top-1 compares argmaxes of the float32 logits (first index on ties, both sides alike)."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D token-id tensor, got shape {tuple(ids.shape)}")
    ws = windows(ids, window)
    if isinstance(reference, torch.nn.Module):
        ref_model, ref_device = reference, next(reference.parameters()).device
        rows = [w.shape[1] - 1 for w in ws]
        sides = (_reference_side(ref_model(w.to(ref_device)).logits[0, :-1].float().cpu()) for w in ws)
    elif isinstance(reference, PreparedReference):
        rows = [t.shape[0] for t in reference.top]
        sides = zip(reference.logp, reference.top)
    else:
        rows = [r.shape[0] for r in reference]
        sides = (_reference_side(r) for r in reference)
    if rows != [w.shape[1] - 1 for w in ws]:
        raise ValueError("reference does not match ids/window: compute it with reference_logits(float_model, ids, "
                         "window) on the same ids and window")
    device = next(model.parameters()).device
    it = zip(ws, sides)
    if progress:
        it = progress_bar(it, total=len(ws), desc=desc, unit="window", leave=False)
    nll = kl = 0.0
    kl_max, agree, count = 0.0, 0, 0
    for w, (lp, ref_top) in it:
        w = w.to(device)
        logits = model(w).logits[0, :-1].float()
        nll += _window_nll(logits, w[0, 1:])
        logits = logits.cpu()
        lq = torch.log_softmax(logits.double(), dim=-1)
        per_token = (lp.exp() * (lp - lq)).sum(-1)
        kl += float(per_token.sum())
        kl_max = max(kl_max, float(per_token.max()))
        agree += int((logits.argmax(-1) == ref_top).sum())
        count += w.shape[1] - 1
    return TokenMetrics(math.exp(nll / count), kl / count, kl_max, agree / count, count)


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
    and bias; each QuantExperts likewise per expert (its biases at `float_bytes`)."""
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
        if isinstance(mod, QuantExperts):
            for p in PROJECTIONS:
                codes, scale = getattr(mod, f"{p}_codes"), getattr(mod, f"{p}_scale")
                total += math.ceil(codes.numel() * mod.weight_scheme.fmt.bits / 8)
                total += scale.numel() * (1 if getattr(mod, f"{p}_scale_codes") is not None else 4)
                g, z, b = getattr(mod, f"{p}_global"), getattr(mod, f"{p}_zero"), getattr(mod, f"{p}_bias")
                total += 0 if g is None else 4 * g.numel()
                total += 0 if z is None else z.numel()
                total += 0 if b is None else b.numel() * float_bytes
        for p in mod.parameters(recurse=False):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * (float_bytes if p.is_floating_point() else p.element_size())
    return total


@torch.no_grad()
def tokens_per_second(model: torch.nn.Module, ids: torch.Tensor, window: int = 512) -> float | None:
    """Prefill throughput (tokens/s) of one window on CUDA, timed by lowbit.profiling.timing; None on
    a machine without CUDA (CPU timings of the emulated paths would mislead)."""
    if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
        return None
    w = ids[:window][None].cuda()
    ms = bench_ms(lambda x: model(x), [(w,)], warmup=3, rep=10)
    return w.numel() / (ms / 1e3)
