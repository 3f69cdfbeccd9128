"""Long runs stay healthy: memory after many quantizations and many decode steps in one process.

    .venv/bin/python benchmarks/longrun_memory.py [--quantize 20] [--decode 10000] [--model smollm2|tiny]

Part 1 quantizes a copy of the model (`--model`: the embedded SmolLM2-135M, or a 4-layer random
Llama) `--quantize` times under w8a8-int8, dropping each copy, and prints the process's RSS
after each round. Part 2 runs `--decode` single-token decode steps (KV cache) of a quantized
tiny Llama (CPU; on CUDA also torch.cuda.memory_allocated). A leak shows as RSS growing with
the round or step count; allocator noise shows as a plateau. The verdict compares the last
quarter's mean with the second quarter's (the first rounds warm caches up).
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import time

import torch


def rss_mib() -> float:
    """Resident set size of this process (Linux /proc; the MiB the OS gives it now)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def tiny_llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)
    return LlamaForCausalLM(cfg).eval()


def growth(samples: list[float]) -> float:
    """MiB between the mean of the last quarter and of the second quarter of the samples."""
    q = max(len(samples) // 4, 1)
    mid, last = samples[q:2 * q] or samples[:1], samples[-q:]
    return sum(last) / len(last) - sum(mid) / len(mid)


def quantize_rounds(model, rounds: int) -> list[float]:
    from lowbit.nn.quantize_model import quantize_model
    out = []
    for i in range(rounds):
        m = copy.deepcopy(model)
        quantize_model(m, "w8a8-int8")
        del m
        gc.collect()
        out.append(rss_mib())
        print(f"quantize round {i + 1}/{rounds}: RSS {out[-1]:.1f} MiB", flush=True)
    return out


def decode_steps(steps: int, every: int) -> list[float]:
    from lowbit.nn.quantize_model import quantize_model
    model = tiny_llama()
    quantize_model(model, "w8a8-int8")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(dev)
    out, past = [], None
    tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
    t0 = time.time()
    with torch.no_grad():
        for i in range(steps):
            if i % 1024 == 0:
                past = None          # a fresh sequence every 1,024 tokens, as a server would
            r = model(tok, past_key_values=past, use_cache=True)
            past = r.past_key_values
            tok = r.logits[:, -1:].argmax(-1)
            if (i + 1) % every == 0:
                gc.collect()
                cuda = f", CUDA {torch.cuda.memory_allocated() / 2**20:.1f} MiB" if dev == "cuda" else ""
                out.append(rss_mib())
                print(f"decode step {i + 1}/{steps}: RSS {out[-1]:.1f} MiB{cuda} "
                      f"({(i + 1) / (time.time() - t0):.0f} steps/s)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantize", type=int, default=20, help="quantization rounds")
    p.add_argument("--decode", type=int, default=10000, help="decode steps")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    a = p.parse_args()
    if a.model == "smollm2":
        from lowbit.nn.embedded import load_smollm2
        model = load_smollm2()[0]
    else:
        model = tiny_llama()
    print(f"start: RSS {rss_mib():.1f} MiB", flush=True)
    q = quantize_rounds(model, a.quantize)
    d = decode_steps(a.decode, max(a.decode // 20, 1))
    print(f"\nquantize x{a.quantize} ({a.model}): RSS {q[0]:.1f} -> {q[-1]:.1f} MiB, "
          f"last quarter vs second quarter {growth(q):+.1f} MiB")
    print(f"decode x{a.decode} (tiny w8a8-int8): RSS {d[0]:.1f} -> {d[-1]:.1f} MiB, "
          f"last quarter vs second quarter {growth(d):+.1f} MiB")


if __name__ == "__main__":
    main()
