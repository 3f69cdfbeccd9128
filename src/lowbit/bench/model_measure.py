"""Measuring one (mode, phase, batch) step of one model variant for `lowbit bench model`
(lowbit.bench.model holds the what and the order; this module the how): the inputs, the timer,
the checks of each call's output, the peak and weight memory, torch.compile's counters."""
from __future__ import annotations

import gc
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from lowbit.nn.quant_linear import QuantLinear
from lowbit.ops.scratch import scratch_bytes

from lowbit.bench import llama
from lowbit.profiling.timing import bench_ms

CACHE_SLACK = 16    # StaticCache slots beyond the context: room for the step (and a runaway one)
CUDA_BROKEN = ("CUDA error", "device-side assert", "illegal memory access")


class Skipped(Exception):
    """A variant or step that cannot run here for a known reason (not a failure)."""


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf when b is all zeros)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else math.inf


def resident_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of every tensor storage `model` holds on `device` (see the module docstring), each
    storage once; tensor subclasses (torchao) are counted through their inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    storages: dict[int, int] = {}
    seen: set[int] = set()

    def add(t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            for inner in t.__tensor_flatten__()[0]:
                add(getattr(t, inner))
        elif t.device.type == device.type and t.numel():
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()

    def visit(obj, depth: int) -> None:
        if torch.is_tensor(obj):
            add(obj)
        elif depth == 0 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, type)) or callable(obj):
            return
        else:
            seen.add(id(obj))
            items = (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set))
                     else vars(obj).values() if hasattr(obj, "__dict__") else ())
            for v in items:
                visit(v, depth - 1)

    for m in model.modules():
        for k, v in vars(m).items():
            if k != "_modules":
                visit(v, 4)
    return sum(storages.values())


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(call: Callable[[], object], device: torch.device, quick: bool) -> float:
    if device.type == "cuda":
        return bench_ms(call, [()], warmup=10 if quick else 25, rep=40 if quick else 100)
    times = []
    for _ in range(1 if quick else 3):
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def dynamo_counts() -> tuple[int, int]:
    """(graph breaks, cudagraph skips) counted by dynamo / inductor since the last reset."""
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values()), int(counters["inductor"].get("cudagraph_skips", 0))


def reset_compiler() -> None:
    torch._dynamo.reset()   # also drops cudagraph trees on recent torch
    from torch._dynamo.utils import counters
    counters.clear()


def quant_paths(model: torch.nn.Module) -> dict[str, int]:
    return dict(Counter(m.last_path for m in model.modules() if getattr(m, "last_path", None)))


def _quant_linears(model: torch.nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def kernel_classes(model: torch.nn.Module) -> dict[str, int]:
    """How many QuantLinear layers took each kernel class (QuantLinear.kernel_choice, made when the layer
    was prepared; "none": no class, every call runs the exact path)."""
    return dict(Counter((m.kernel_choice.name if m.kernel_choice else None) or "none" for m in _quant_linears(model)))


def refusal_of(model: torch.nn.Module, names) -> str | None:
    """"CLASS: why" for the first QuantLinear that passed over one of the kernel classes `names` (None: none did)."""
    for m in _quant_linears(model):
        for name, why in (m.kernel_choice.refused if m.kernel_choice else ()):
            if name in names:
                return f"{name}: {why}"
    return None


# ------------------------------------------------------------------------------ one step
@dataclass
class Inputs:
    """The fixed prompts of a run, on the device."""
    prefill: torch.Tensor   # [1, prefill]
    error: torch.Tensor     # [1, error_tokens]
    context: torch.Tensor   # [max batch, context]
    step: torch.Tensor      # [max batch, 1]

    @classmethod
    def make(cls, opts, vocab: int, device: torch.device) -> "Inputs":
        """Token ids drawn from opts.seed + 1 (the weights use opts.seed), uniform in [0, vocab)."""
        g = torch.Generator().manual_seed(opts.seed + 1)
        draw = lambda *s: torch.randint(0, vocab, s, generator=g).to(device)  # noqa: E731
        return cls(draw(1, opts.prefill), draw(1, opts.error_tokens), draw(max(opts.batches), opts.context),
                   draw(max(opts.batches), 1))


def run_step(model, mode: str, phase: str, batch: int, inp: Inputs, opts, row: dict,
             ref: dict, eager_out: dict, mem0: int | None, device: torch.device) -> None:
    """Run, check and time one (mode, phase, batch) of one variant (opts: lowbit.bench.model's
    Options); fills `row`. `ref` holds the baseline's eager outputs by (phase, batch) (the
    baseline's own eager call fills it), `eager_out` this variant's; mem0 is the CUDA memory in
    use before the variant was built (None on the CPU)."""
    cache = None
    if phase == "prefill":
        fn = llama.prefill_step(model)
        args = (inp.prefill, torch.arange(opts.prefill, device=device)[None])
    else:
        cache, kind = llama.new_cache(model, batch, opts.context + CACHE_SLACK)
        row["cache"] = kind
        if mode != "eager" and kind != "static":
            raise Skipped("compiled decode needs transformers' StaticCache (not usable in this version)")
        llama.fill_cache(model, cache, inp.context[:batch])
        fn, args = llama.decode_step(model, cache, kind, inp.step[:batch], opts.context)
    if mode != "eager":
        breaks0, skips0 = dynamo_counts()
        backend = getattr(opts, "compile_backend", "inductor")
        if backend == "inductor":
            compiled = torch.compile(fn, mode="reduce-overhead" if mode == "graphs" else "default", dynamic=False)
        else:   # another backend takes no inductor mode (a CPU dry run of the plumbing)
            compiled = torch.compile(fn, backend=backend, dynamic=False)
        graphs = mode == "graphs" and backend == "inductor" and device.type == "cuda"

        def call():
            if graphs:   # each call starts a new cudagraph-tree step: the previous outputs are dead
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args)
        t = time.perf_counter()
        call()
        sync(device)
        row["compile_s"] = round(time.perf_counter() - t, 2)
        call()      # cudagraph trees: the second call records, later ones replay
    else:
        def call():
            return fn(*args)
        call()
    # at least two calls before the cache check; outputs are kept on the CPU, so the references
    # never count in a peak or in the weights' allocation
    out = call().float().cpu()
    if cache is not None:
        llama.check_repeatable(cache, opts.context)
    key = (phase, batch)
    if row["kind"] == "baseline" and mode == "eager":
        ref[key] = out
    elif key in ref:
        row["out_rel_err"] = rel_err(out, ref[key])
    if mode == "eager":
        eager_out[key] = out
    elif key in eager_out:
        row["vs_eager_rel"] = rel_err(out, eager_out[key])
    if mode != "eager":
        breaks, skips = dynamo_counts()
        row.update(graph_breaks=breaks - breaks0, cudagraph_skips=skips - skips0)
    if mem0 is not None:
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        sync(device)
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - mem0
        # the reusable buffers of the dequantized-weight path (lowbit.ops.scratch): held between
        # calls, so mem0 of a later row counts them; each row reports what is held after its call
        row["scratch_bytes"] = scratch_bytes()
    row["ms"] = time_ms(call, device, opts.quick)
    row["tokens_per_s"] = row["tokens"] / (row["ms"] * 1e-3)


def describe_failure(exc: BaseException) -> str:
    """Exception type and the first line of its message (300 characters at most)."""
    msg = str(exc).strip()
    return f"{type(exc).__name__}: {msg.splitlines()[0][:300] if msg else ''}"


def weight_memory(model: torch.nn.Module, device: torch.device, mem0: int | None) -> dict:
    """weight_bytes (resident_bytes) and, on CUDA, weight_alloc_bytes (allocated above mem0)."""
    out = dict(weight_bytes=resident_bytes(model, device))
    if mem0 is not None:
        sync(device)
        out["weight_alloc_bytes"] = allocated(device) - mem0
    return out


def free(device: torch.device) -> None:
    """Drop compiled graphs and give the variant's memory back before the next one is built
    (gc.collect costs a second in a process holding transformers: only where memory counts)."""
    try:
        reset_compiler()
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    except Exception as exc:  # a broken CUDA context fails here too; the rows already say why
        print(f"  (could not free the variant: {describe_failure(exc)})", flush=True)
