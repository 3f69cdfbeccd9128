"""What `lowbit bench model` rows are judged against: the memory roofline of a decode step
(bytes it must move / its time, against this GPU's copy bandwidth measured in the same process)
and the speed-up and weight-memory targets a recipe must meet to be worth running on a GPU.

Roofline. A decode step reads every weight once (the input embedding only for the B rows it
looks up, unless the LM head shares it) and the KV cache (2 tensors per layer of B x context x
KV heads x head dim elements); what it writes (one KV slot, the logits) and its activations are
left out, so the figure is a lower bound of the bytes moved. `roof` = bytes / time / copy
bandwidth, where the copy bandwidth is (read + write bytes) / time of one large
device-to-device copy: 1.0 is a step at the speed of a memcpy over the same bytes.

Targets (the "must" column): speed-ups over the bf16 model in the same mode, phase and batch,
and weight bytes over the bf16 model's (embeddings and LM head included), for the full-depth
Llama-3-8B shape (`--shape 8b --layers 32`); other shapes get no verdict.
"""
from __future__ import annotations

import time

import torch

from lowbit.bench.model_variants import parse_variant
from lowbit.profiling.timing import bench_ms
from lowbit.recipes.presets import RECIPES

# (mode, phase, batch) -> {variant: the speed-up it must reach}; "*": every lowbit recipe
SPEEDUP_MUSTS: dict[tuple[str, str, int | None], dict[str, float]] = {
    ("graphs", "decode", 1): {"w4a16": 2.5, "w8a16-int8": 1.7, "w8a8-int8": 1.6, "w8a8-fp8": 1.6},
    ("graphs", "decode", 16): {"w4a16": 2.0, "w8a8-int8": 1.5, "w8a8-fp8": 1.5},
    ("eager", "decode", 1): {"*": 1.0},
    ("compile", "decode", 1): {"*": 1.0},
    ("compile", "prefill", None): {"w8a8-int8": 1.5, "w8a8-fp8": 1.4, "w4a16": 1.0},
}
# weight bytes over the bf16 model's, by the recipe's weight bits
WEIGHT_MUSTS = {4: 0.37, 8: 0.57}
MUST_SHAPE = ("8b", 32)


def base_recipe(variant: str) -> str:
    """The recipe of a variant name ("w4a16+lm_head=int8" -> "w4a16")."""
    return parse_variant(variant).recipe


def speedup_must(variant: str, kind: str, mode: str, phase: str, batch: int) -> float | None:
    """The speed-up a lowbit variant must reach in this row, or None (no target)."""
    if kind != "lowbit":
        return None
    table = SPEEDUP_MUSTS.get((mode, phase, batch if phase == "decode" else None), {})
    r = base_recipe(variant)
    return table.get(r, table.get("*"))


def weight_must(variant: str, kind: str) -> float | None:
    """The weight-bytes ratio a lowbit variant must stay under, by its weight format's bits."""
    if kind != "lowbit":
        return None
    r = RECIPES.get(base_recipe(variant))
    return None if r is None else WEIGHT_MUSTS.get(r.weight.fmt.bits)


def add_musts(rows: list[dict], shape: str, layers: int) -> None:
    """must / met (speed-up) and weights_must / weights_met on every lowbit row that has a target,
    when the run is the targets' shape; met is None for a row that did not run."""
    if (shape, layers) != MUST_SHAPE:
        return
    for r in rows:
        m = speedup_must(r["variant"], r["kind"], r["mode"], r["phase"], r["batch"])
        if m is not None:
            r["must"] = m
            r["met"] = None if r.get("speedup") is None else bool(r["speedup"] >= m)
        w = weight_must(r["variant"], r["kind"])
        if w is not None:
            r["weights_must"] = w
            r["weights_met"] = None if r.get("weights_ratio") is None else bool(r["weights_ratio"] <= w)


# ------------------------------------------------------------------------------ roofline
def embedding_bytes(model: torch.nn.Module) -> tuple[int, bool]:
    """(bytes of the input embedding table, whether the LM head reads the same storage)."""
    emb = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    shared = isinstance(head, torch.Tensor) and head.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()
    return emb.numel() * emb.element_size(), shared


def kv_bytes(config, batch: int, context: int, itemsize: int) -> int:
    """Bytes of a bf16 / fp16 KV cache holding `context` tokens for `batch` sequences."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * batch * context * kv_heads * head_dim * itemsize


def decode_bytes(weight_bytes: int, model: torch.nn.Module, batch: int, context: int) -> int:
    """The bytes one decode step must read (see the module docstring). weight_bytes: every
    tensor the model holds on the device (lowbit.bench.model_measure.resident_bytes)."""
    emb, shared = embedding_bytes(model)
    p = model.get_input_embeddings().weight
    rows = 0 if shared else emb - batch * p.shape[1] * p.element_size()   # the rows looked up are read
    return weight_bytes - rows + kv_bytes(model.config, batch, context, p.element_size())


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes per second of a device-to-device copy of `nbytes` (default 1 GiB on CUDA, 64 MiB
    on the CPU), counting the read and the write: the median of triton.testing.do_bench on
    CUDA, a wall-clock median of 3 on the CPU (meaningless there, like every CPU time here)."""
    n = nbytes or (1 << 30 if device.type == "cuda" else 1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        ms = bench_ms(lambda: dst.copy_(src), [()], warmup=10, rep=50)
    else:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - t) * 1e3)
        ms = sorted(times)[1]
    del src, dst
    return 2 * n / (ms * 1e-3)


def add_roofline(rows: list[dict], copy_bw: float) -> None:
    """roof (fraction of the copy bandwidth) on every timed decode row with bytes_per_step."""
    for r in rows:
        if r.get("bytes_per_step") and r.get("ms"):
            r["roof"] = r["bytes_per_step"] / (r["ms"] * 1e-3) / copy_bw
