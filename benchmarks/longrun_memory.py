"""Long runs stay healthy: memory after many quantizations and many decode steps in one process.

    PYTHONPATH=src python benchmarks/longrun_memory.py [--quantize 20] [--decode 10000] [--seq 500]
        [--model smollm2|tiny] [--device cpu|cuda] [--json F] [--png P]

Part 1 quantizes a copy of the model (`--model`: the embedded SmolLM2-135M, or a 4-layer random
Llama) `--quantize` times under w8a8-int8, dropping each copy, and records the process's RSS
(and, on CUDA, torch.cuda.memory_allocated) after each round. Part 2 runs `--decode`
single-token decode steps (KV cache) of a quantized 4-layer Llama, starting a fresh sequence
every `--seq` tokens as a server would, and records memory at the end of each sequence, so
that every sample is taken in the same state (one full KV cache of `--seq` tokens).
A leak shows as memory growing with the round or step count; allocator noise as a plateau.
The verdict compares the mean of the last quarter of the samples with the second quarter's
(the first quarter warms caches and allocator arenas up).
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import time

import torch

RECIPE = "w8a8-int8"


def rss_mib() -> float:
    """Resident set size of this process in MiB (what the OS gives it now)."""
    from lowbit.profiling.memtrace import rss_bytes

    return rss_bytes() / 2**20


def live_tensors() -> tuple[int, int]:
    """(count, bytes) of the torch tensors Python code holds now: a reference kept by mistake
    (a cache that grows with calls) shows here exactly, however small, where RSS cannot see it."""
    n = size = 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            n += 1
            size += o.untyped_storage().nbytes() if o.device.type != "meta" else 0
    return n, size


def _trim() -> None:
    """Hand the C heap's free pages back to the OS (glibc malloc_trim), so that RSS counts what
    is in use rather than what the allocator happens to keep cached; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def sample(device: str, tensors: bool = False) -> dict[str, float]:
    """Memory now, after a full garbage collection and a heap trim: RSS MiB, CUDA allocated MiB
    on CUDA, and with `tensors` the count and MiB of live tensors (see live_tensors)."""
    gc.collect()
    _trim()
    out = {"rss_mib": rss_mib()}
    if tensors:
        n, size = live_tensors()
        out.update(tensors=n, tensor_mib=size / 2**20)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        out["cuda_mib"] = torch.cuda.memory_allocated() / 2**20
    return out


def tiny_llama(layers: int = 4, hidden: int = 256, vocab: int = 512):
    """A random Llama (seeded: the same weights in every run), float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=16384)
    return LlamaForCausalLM(cfg).eval()


def growth(samples: list[float]) -> float:
    """MiB between the mean of the last quarter and of the second quarter of the samples."""
    q = max(len(samples) // 4, 1)
    mid, last = samples[q:2 * q] or samples[:1], samples[-q:]
    return sum(last) / len(last) - sum(mid) / len(mid)


def quantize_rounds(model, rounds: int, device: str = "cpu", log=print,
                    tensors: bool = False) -> list[dict[str, float]]:
    """Quantize a deep copy of `model` (already on `device`) `rounds` times, dropping each copy;
    memory after each round."""
    from lowbit.pipelines.quantize_model import quantize_model
    out = []
    for i in range(rounds):
        m = copy.deepcopy(model)
        quantize_model(m, RECIPE)
        del m
        out.append(sample(device, tensors))
        log(f"quantize round {i + 1}/{rounds}: " + fmt(out[-1]))
    return out


def decode_steps(model, steps: int, seq: int, device: str = "cpu", log=print,
                 tensors: bool = False) -> list[dict[str, float]]:
    """`steps` greedy single-token decode steps of `model` (quantized, on `device`) with a KV cache,
    a fresh sequence every `seq` tokens; memory at the end of each sequence (steps // seq samples)."""
    out, past = [], None
    tok = torch.zeros(1, 1, dtype=torch.long, device=device)
    t0 = time.time()
    with torch.no_grad():
        for i in range(steps):
            r = model(tok, past_key_values=past, use_cache=True)
            past = r.past_key_values
            tok = r.logits[:, -1:].argmax(-1)
            if (i + 1) % seq == 0:
                past = r = None                          # the sequence's cache dropped before the sample
                tok = torch.zeros_like(tok)
                out.append(sample(device, tensors))
                log(f"decode step {i + 1}/{steps}: " + fmt(out[-1]) + f" ({(i + 1) / (time.time() - t0):.0f} steps/s)")
    return out


def fmt(s: dict[str, float]) -> str:
    return ", ".join(f"{k} {v}" if k == "tensors" else f"{k.removesuffix('_mib').upper()} {v:.1f} MiB"
                     for k, v in s.items())


def summary(name: str, samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per measured quantity: first, last, min, max and growth (last quarter - second quarter), MiB."""
    res = {}
    for k in samples[0]:
        v = [s[k] for s in samples]
        res[k] = {"first": v[0], "last": v[-1], "min": min(v), "max": max(v), "growth": growth(v)}
        print(f"{name}: {k} {v[0]:.1f} -> {v[-1]:.1f} MiB (range {min(v):.1f}..{max(v):.1f}), "
              f"last quarter vs second quarter {growth(v):+.2f} MiB")
    return res


def plot(result: dict, path: str) -> None:
    """Memory over rounds (left) and decode steps (right); one line per measured quantity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    seq = result["seq"]
    parts = [(axes[0], result["quantize"], lambda i: i + 1, f"quantization round ({result['model']}, {RECIPE})"),
             (axes[1], result["decode"], lambda i: (i + 1) * seq,
              f"decode step (4-layer Llama, {RECIPE}, {seq}-token sequences)")]
    for ax, samples, x_of, xlabel in parts:
        for k in [k for k in samples[0] if k.endswith("_mib")]:
            ax.plot([x_of(i) for i in range(len(samples))], [s[k] for s in samples], marker=".",
                    label=k.replace("_mib", " MiB").replace("rss", "RSS").replace("cuda", "CUDA allocated"))
        lo = min(v for s in samples for k, v in s.items() if k.endswith("_mib"))
        hi = max(v for s in samples for k, v in s.items() if k.endswith("_mib"))
        pad = max(8.0, 0.1 * (hi - lo))         # a flat line still shows its scale
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"lowbit long run on {result['device']}: memory after each round / sequence")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quantize", type=int, default=20, help="quantization rounds")
    p.add_argument("--decode", type=int, default=10000, help="decode steps")
    p.add_argument("--seq", type=int, default=500, help="tokens per sequence (one memory sample each)")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"], help="model quantized in part 1")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default; 1 is far faster on a shared, loaded machine)")
    p.add_argument("--json", metavar="F", help="write the samples and the summary to F")
    p.add_argument("--png", metavar="P", help="plot memory over rounds and steps to P")
    a = p.parse_args()
    if a.quantize < 0 or a.decode < a.seq or a.seq < 1:
        p.error("--quantize >= 0, --seq >= 1 and --decode >= --seq (one sample per sequence)")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: CUDA is not available here; use --device cpu")
    t0 = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    q = []
    if a.quantize:
        if a.model == "smollm2":
            from lowbit.evaluation.embedded import load_smollm2
            model = load_smollm2()[0]
        else:
            model = tiny_llama()
        model.to(a.device)
        print(f"start: {fmt(sample(a.device))}", flush=True)
        q = quantize_rounds(model, a.quantize, a.device, log)
        del model
    from lowbit.pipelines.quantize_model import quantize_model
    small = tiny_llama()
    quantize_model(small, RECIPE)
    small.to(a.device)
    d = decode_steps(small, a.decode, a.seq, a.device, log)
    print(f"\n{time.time() - t0:.0f} s, torch {torch.__version__}")
    result = {"device": a.device, "model": a.model, "recipe": RECIPE, "seq": a.seq, "torch": torch.__version__,
              "seconds": time.time() - t0, "quantize": q, "decode": d,
              "threads": torch.get_num_threads(),
              "summary": {"quantize": summary(f"quantize x{a.quantize} ({a.model})", q) if q else None,
                          "decode": summary(f"decode x{a.decode} (4-layer Llama)", d)}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.png and q:
        plot(result, a.png)
    elif a.png:
        print("--png needs the quantization rounds too (--quantize >= 1); not written")


if __name__ == "__main__":
    main()
