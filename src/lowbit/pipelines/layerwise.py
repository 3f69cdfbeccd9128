"""Layer-by-layer calibration and quantization of a decoder checkpoint that need not fit in memory.

The model is built on the meta device (no memory) from config.json and every refusal made before
a layer is read (lowbit.pipelines.layerwise_plan); only the embedding rows of the calibration
tokens are read, to compute the first decoder layer's inputs, and then freed. Each decoder layer
is then, in turn: loaded from its (sharded) safetensors checkpoint onto the device
(lowbit.pipelines.layer_loader), calibrated on the cached activations, quantized, written to the
output checkpoint (lowbit.pipelines.layerwise_writer), and freed; its outputs become the next
layer's inputs. The embedding, the final norm and lm_head are copied from the input shards to the
output file to file, never loaded onto the device.

It computes what the whole-model path computes (smooth_model -> calibrate_static_scales ->
quantize_model RTN or GPTQ on the loaded model), bit for bit, by carrying one activation stream
per kind of statistic:
  F  the float model as loaded        SmoothQuant's per-channel maxima (smooth_model runs first)
  S  the float model after the folds  static activation scales (calibrate_static_scales)
  Q  the quantized model so far       GPTQ's Hessians (gptq_model: each layer on the quantized
                                      outputs of the layers before it)
Only the streams a recipe needs are kept. tests/pipelines/test_layerwise.py checks the equality.

Peak device memory (reported in the result; docs/distributed.md, "Layer by layer"):
  one decoder layer's weights in the compute dtype (allocated once, in that dtype, and filled in
    place; quantized Linears replace them one by one)
  + the streams' activations: streams x tokens x hidden x dtype bytes (each stream advances in
    place, one batch at a time; + one group's Linear inputs, tokens x K, while GPTQ calibrates)
  + one batch's forward temporaries and one 4M-element chunk's quantization temporaries
  + for GPTQ: the Hessian and its factor, 2 x K^2 x 8 bytes for the largest K (one Linear
    group at a time; the factor is made in place in one matrix), and on ranks > 0 at the
    Hessian's chain the total so far + their chunk sums (distributed.ChunkedSum: ~CHAIN_CHUNKS
    / world of them, K^2 x 8 bytes each).
Reading the next layer (host), writing the last one (host) and copying the tensors outside the
layers into shards of their own run in three threads meanwhile (GPTQ's W4A16 codes are packed
on the device and only the packed words come to the host).
Under torch.distributed each rank holds its share of the tokens and reads its share of every
layer (the pieces are broadcast: layer_loader), the statistics are reduced (lowbit.algorithms.distributed;
one collective per statistic kind and layer), each rank quantizes a share of the Linears
(round to nearest: the codes go to rank 0; GPTQ: rows of every weight and panels of every
Hessian's inverse factor, every rank gets all) and rank 0 writes.

The families (lowbit.pipelines.layerwise_plan): Llama-family models and the MoE families of
MOE_FAMILIES in that layout. Their routed experts are quantized per expert by
lowbit.nn.experts.QuantExperts (round to nearest, on rank 0) or lowbit.algorithms.gptq.experts
(GPTQ on the tokens routed to each expert of the quantized model so far, every rank; few-token
experts keep round to nearest, reported in result["experts"]).
"""
from __future__ import annotations

import copy
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lowbit.algorithms import distributed
from lowbit.algorithms.gptq import solver as gptq_solver
from lowbit.algorithms.gptq.model import gptq_handler
from lowbit.algorithms.sequential import as_kwargs, capture_block_inputs, next_block_inputs, run_stage
from lowbit.algorithms.static_scales import calibrate_act_absmax
from lowbit.options import Options
from lowbit.pipelines import layer_loader
from lowbit.pipelines.checkpoint import atomic_dir
from lowbit.pipelines.layer_rtn import rtn_split
from lowbit.pipelines.layerwise_plan import LAYERS, MOE_FAMILIES, LayerwisePlan, plan_layerwise
from lowbit.pipelines.layerwise_writer import LayerwiseWriter
from lowbit.pipelines.moe import build_experts, swap_in
from lowbit.pipelines.steps import LayerRun
from lowbit.profiling import memtrace
from lowbit.progress import progress_bar
from lowbit.recipes.presets import get_recipe

__all__ = ["LayerwiseOptions", "MOE_FAMILIES", "quantize_layerwise"]


@dataclass(frozen=True)
class LayerwiseOptions(Options):
    """Everything quantize_layerwise takes besides the checkpoint, the output, the recipe and the
    calibration batches, typed in one place. Pass one as `options=`, or the same names as keywords,
    which replace the options' fields.

    steps:              the job's steps (lowbit.pipelines.steps), the same objects the whole-model
                        workflow runs: SmoothQuant(alpha), StaticScales() (calibrated per-tensor
                        activation scales, W8A8 recipes) and GPTQ(); any other step is refused by
                        name; none is round to nearest.
    ignore:             patterns of Linears or experts modules kept in high precision (as quantize_model).
    device / dtype:     where and in which dtype the layers run (float32 on the CPU reproduces the
                        whole-model path of `lowbit quantize`).
    overwrite:          replace a non-empty out_dir (only files lowbit wrote: lowbit.io.outdir).
    max_shard_bytes:    the output's shard size (None: Hugging Face's 5 GiB).
    method_options:     gptq_model's keyword arguments (damp, act_order, ...), for GPTQ().
    progress:           a progress bar over the layers.
    memory_trace_layer: on CUDA, record the allocator's trace over that layer and name the blocks
                        alive at its peak (lowbit.profiling.memtrace; result["memory_trace"]).
    profile_layer:      run torch.profiler over that layer (CPU and CUDA activity) and put its top
                        operators by self device time and by self CPU time in result["profile"] (a
                        diagnostic: the profiler slows the layer)."""
    steps: Sequence = ()
    ignore: Sequence[str] | None = None
    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32
    overwrite: bool = False
    max_shard_bytes: int | None = None
    method_options: Mapping[str, object] | None = None
    progress: bool = False
    memory_trace_layer: int | None = None
    profile_layer: int | None = None


class _Phases:
    """Seconds of every phase of a run, each ended by lap(): together they are the whole call. On
    CUDA also each phase's peak of allocated bytes (the peak counter is reset at every boundary),
    with the layer where it peaked (`layer`, set by the runner) and what was allocated when it began."""
    NAMES = ("setup", "first_inputs", "load", "calibrate", "quantize", "write", "finish", "barrier")

    def __init__(self, start: float, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:
            # the caching allocator starts lazily: before its first allocation, reset_peak_memory_stats
            # raises "Invalid device argument" (in a single process; under torchrun NCCL allocates first)
            torch.empty(1, device=device)
            torch.cuda.reset_peak_memory_stats(device)
        self.seconds = {k: 0.0 for k in self.NAMES}
        self.peaks: dict[str, dict] = {}
        self.layer: int | None = None
        self.overall = 0
        self._clock = start
        self._at_start = torch.cuda.memory_allocated(device) if self.cuda else 0

    def lap(self, phase: str) -> None:
        if self.cuda:        # the device's queue drained at each boundary
            torch.cuda.synchronize(self.device)
            pk = torch.cuda.max_memory_allocated(self.device)
            rec = self.peaks.setdefault(phase, {"peak": -1})
            if pk > rec["peak"]:
                rec.update(peak=pk, layer=self.layer, allocated_at_start=self._at_start)
            self.overall = max(self.overall, pk)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._at_start = torch.cuda.memory_allocated(self.device)
        now = time.time()
        self.seconds[phase] += now - self._clock
        self._clock = now


def _stream_bytes(inputs) -> int:
    """Bytes of a stream's hidden states (the shared kwargs such as position embeddings not counted)."""
    return sum((a[0] if a else k["hidden_states"]).numel() * (a[0] if a else k["hidden_states"]).element_size()
               for a, k in inputs)


def _observe(layer: torch.nn.Module, stream: list, names: list[str], per_channel: bool, advance: bool) -> dict:
    """calibrate_act_absmax of `names` over the stream, and (advance) the stream moved on to the
    layer's outputs in the same forward passes: one pass per batch gives both (the hooks only
    read), the outputs are those _advance computes, each batch replaced as soon as it is done."""
    if not advance:
        return calibrate_act_absmax(layer, as_kwargs(stream), names=names, per_channel=per_channel)

    def run(m, b):
        stream[b] = next_block_inputs(m, [stream[b]])[0]
    return calibrate_act_absmax(layer, range(len(stream)), names=names, per_channel=per_channel, run=run)


def _advance(layer: torch.nn.Module, stream: list) -> None:
    """Replace each batch of `stream` by the layer's output on it, one batch at a time: the old
    and the new stream are never both alive (one batch's output is the only extra memory)."""
    for b in range(len(stream)):
        stream[b] = next_block_inputs(layer, [stream[b]])[0]


# The phases of quantize_layerwise that belong to one layer (result["phase_seconds_per_layer"]).
_LAYER_PHASES = ("load", "calibrate", "quantize", "write")


def _profile_start(cuda: bool):
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts)
    prof.start()
    return prof


def _profile_summary(prof, rows: int = 30) -> dict:
    """The profiled layer's operators (prof stopped): the top `rows` by self device time and by
    self CPU time (microseconds, counts), and the seconds the profiler saw in all."""
    ev = prof.key_averages()
    dev = lambda e: float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))  # noqa: E731
    row = lambda e: {"op": e.key, "count": int(e.count), "self_device_us": dev(e),  # noqa: E731
                     "self_cpu_us": float(e.self_cpu_time_total)}
    return {"by_device_time": [row(e) for e in sorted(ev, key=dev, reverse=True)[:rows]],
            "by_cpu_time": [row(e) for e in sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]],
            "total_self_device_s": sum(dev(e) for e in ev) / 1e6,
            "total_self_cpu_s": sum(float(e.self_cpu_time_total) for e in ev) / 1e6,
            "launches": int(sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                   "cudaLaunchKernelExC", "cuLaunchKernelEx")))}


class _Dropping(dict):
    """run_stage's record of the Linears it replaced, which frees each one's weight instead of
    keeping the module (nothing restores a layer here: it is written and freed): the float
    weights of a layer's quantized Linears are not alive beside the later groups' Hessians (nor
    the fused weights of an experts module, once its QuantExperts is in)."""

    def __setitem__(self, name, module) -> None:
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor):
            w.data = w.data.new_empty(0)
        for p in module.parameters(recurse=False):
            if p.ndim >= 3:
                p.data = p.data.new_empty(0)




@torch.no_grad()
def quantize_layerwise(in_dir: str | os.PathLike, out_dir: str | os.PathLike | None, recipe, calib,
                       options: LayerwiseOptions | None = None, **changes) -> dict:
    """Quantize the Llama-family or MoE (MOE_FAMILIES) checkpoint in `in_dir` one decoder layer at
    a time and write a compressed-tensors checkpoint to `out_dir` (rank 0 only under
    torch.distributed; None writes nothing, e.g. to measure): the files quantize_model +
    save_compressed write for the same model, recipe and ignore list.

    calib: input-id tensors [B, T] (this rank's share under torch.distributed). The options (a
    LayerwiseOptions, or its fields as keywords: steps, ignore, device, dtype, overwrite,
    max_shard_bytes, method_options, progress, memory_trace_layer, profile_layer) are described
    in LayerwiseOptions; an unknown name is refused with the nearest one.
    Returns a summary: quantized / kept layers, seconds per layer, seconds per phase (setup,
    first_inputs, load, calibrate, quantize, write, finish, barrier: they add up to the wall
    time) and per layer (load, calibrate, quantize, write and, for GPTQ, gptq_hessian /
    gptq_factor / gptq_solve / gptq_losses), peak memory (RSS bytes over the start; on CUDA max_memory_allocated overall and per
    phase, with the layer where each phase peaked and what was allocated when it began), one
    layer's bytes and the activation bytes; for MoE models, "experts": each experts module's
    action, recipe, reason and GPTQ's per-expert report (lowbit.algorithms.gptq.experts)."""
    o = LayerwiseOptions.merge(options, changes, "quantize_layerwise")
    t_start = time.time()
    rss0 = memtrace.rss_bytes()
    device = torch.device(o.device)
    if device.type == "cuda" and device.index is None:  # the memory-stat calls need an index
        device = torch.device("cuda", torch.cuda.current_device())
    phases = _Phases(t_start, device)
    plan = plan_layerwise(in_dir, get_recipe(recipe), o.steps, calib, o.ignore, o.dtype)
    summary, exp_quantized = plan.summary, plan.experts_quantized
    result = {"recipe": plan.recipe.name, "method": plan.method, "layers": len(plan.layers), "seconds_per_layer": [],
              "quantized": [d.name for d in summary.quantized + exp_quantized],
              "kept": [d.name for d in summary.skipped + plan.experts if d.action == "skipped"],
              "world_size": distributed.world_size(), "phase_seconds": phases.seconds}
    result["thread_seconds"] = {"read": 0.0, "copy_rest": 0.0, "write": 0.0}
    run = _Run(plan, o, device, phases, result)
    try:
        if distributed.rank() == 0 and out_dir is not None:
            atomic_dir(Path(out_dir), o.overwrite, run)
            result["out_dir"] = str(out_dir)
        else:
            run(None)
        phases.lap("finish")
    finally:
        plan.ckpt.close()
    if distributed.active():
        dist.barrier()
    phases.lap("barrier")
    result["seconds"] = time.time() - t_start
    result["peak_rss_over_start_bytes"] = max(0, memtrace.peak_rss_bytes() - rss0)
    if phases.cuda:
        result["peak_device_bytes"] = phases.overall
        result["phase_peak_bytes"] = phases.peaks
    return result


class _Run:
    """One pass over the decoder layers of a plan, called with the staging directory of the output
    (None: this rank writes nothing). Fills `result` as it goes."""

    def __init__(self, plan: LayerwisePlan, o: LayerwiseOptions, device: torch.device, phases: _Phases,
                 result: dict):
        self.plan, self.o, self.device, self.phases, self.result = plan, o, device, phases, result
        self.busy = result["thread_seconds"]
        self.pin = phases.cuda           # page-locked host buffers for a GPU's copies
        self.exp_quantized = plan.experts_quantized
        self.scales: dict[str, torch.Tensor] = {}    # static activation scales, filled layer by layer
        self.groups_of: dict[tuple, list] = {}     # execution groups by the layer's Linear names
        self.handle = None
        self.streams: dict[str, list] = {}
        self.profiled = None

    def __call__(self, tmp: Path | None) -> None:
        writer = LayerwiseWriter(self.plan, tmp, self.o.dtype, self.o.max_shard_bytes, self.busy)
        self.phases.lap("setup")
        # the first layer's share is read (reader thread) while the first inputs are computed
        reader = ThreadPoolExecutor(max_workers=1)
        chunks = ThreadPoolExecutor(max_workers=layer_loader.read_threads())
        try:
            nxt = reader.submit(self._fetch, 0, chunks)
            first = self._first_inputs()
            # Reading layer i + 1 from the shards (host) overlaps layer i's work, and writing layer
            # i's tensors (host) overlaps layer i + 1's: one reader and one writer thread, each
            # working in order, so the files are the same bytes; a third thread copies the tensors
            # outside the layers into their own shards meanwhile (so the first layer's write does not
            # wait behind that copy).
            writer.copy_rest()
            self._start(first)
            del first
            bar = None
            if self.o.progress:
                bar = progress_bar(total=len(self.plan.layers), desc=f"layer by layer {self.plan.recipe.name}",
                                   unit="layer")
            self.phases.lap("first_inputs")
            self.result["phase_seconds_per_layer"] = []
            before = self._phase_totals()
            for i in range(len(self.plan.layers)):
                nxt = self._layer(i, nxt, reader, chunks, writer)
                before = self._account(before)
                if bar is not None:
                    bar.update(1)
        finally:
            reader.shutdown(wait=True)
            writer.shutdown()
            chunks.shutdown(wait=True)
        self._finish(writer, bar)

    def _fetch(self, i: int, chunks: ThreadPoolExecutor):
        """Reader thread: this rank's share of layer i, on the host."""
        plan = self.plan
        pieces = plan.reads[i]
        host, secs = layer_loader.read_pieces(pieces, plan.ckpt, self.o.dtype, chunks, self.device if self.pin else None,
                                              dict.fromkeys(plan.keep_fp32[i], torch.float32))
        self.busy["read"] += secs
        return pieces, host

    def _first_inputs(self) -> list:
        """The first decoder layer's inputs on the calibration batches, from the embedding rows of
        their tokens alone (the embedding is freed again)."""
        plan, dtype = self.plan, self.o.dtype
        inner = plan.model.model
        emb = inner.embed_tokens
        inner.rotary_emb = type(inner.rotary_emb)(config=plan.config).to(self.device)
        calib = plan.calib
        if calib and all(isinstance(b, torch.Tensor) and not b.is_floating_point() for b in calib):
            # Only the calibration tokens' rows of the embedding are read (ranged reads, on the
            # host); the ids are renumbered into that small table (an exact row gather either way)
            ids = torch.cat([b.reshape(-1) for b in calib]).to(torch.int64)
            rows, inv = torch.unique(ids, sorted=True, return_inverse=True)
            table = layer_loader.read_rows(plan.ckpt, "model.embed_tokens.weight", rows)
            emb.weight = torch.nn.Parameter(table.to(dtype), requires_grad=False)
            batches, at = [], 0
            for b in calib:
                batches.append(inv[at:at + b.numel()].reshape(b.shape))
                at += b.numel()
        else:                        # kwargs batches: the whole table, on the host
            emb.weight = torch.nn.Parameter(plan.ckpt.get("model.embed_tokens.weight").to(dtype), requires_grad=False)
            batches = calib
        to_dev = emb.register_forward_hook(lambda mod, args, out: out.to(self.device))
        try:
            first = capture_block_inputs(plan.model, plan.layers[0], batches) if batches else []
        finally:
            to_dev.remove()
        emb.to("meta")               # freed: only the first inputs need it
        return first

    def _start(self, first: list) -> None:
        """The activation streams (each its own list, sharing the first layer's inputs, advanced in
        place) and GPTQ's handler."""
        plan = self.plan
        self.streams = {k: list(first) for k in ("F", "S", "Q") if k in plan.streams}
        # GPTQ's W4A16 layers keep their codes on the device (no host twin): rank 0 packs them
        # there for the checkpoint and copies the packed words (half the bytes) to the host
        if "Q" in plan.streams:
            self.handle = gptq_handler(plan.model, plan.summary, self._static(), host_twin=False,
                                       **(self.o.method_options or {}))
        self.result["activation_bytes"] = sum(_stream_bytes(s) for s in self.streams.values())

    def _static(self) -> dict | None:
        return self.scales if "S" in self.plan.streams else None

    def _layer(self, i: int, nxt, reader: ThreadPoolExecutor, chunks: ThreadPoolExecutor, writer: LayerwiseWriter):
        """Load, calibrate, quantize and hand layer i to the writer; returns the read of the next layer."""
        t0 = time.time()
        self.phases.layer = i
        tracing = memtrace.start(self.device) if self.o.memory_trace_layer == i else None
        prof = _profile_start(self.phases.cuda) if self.o.profile_layer == i else None
        prefix = f"{LAYERS}.{i}."
        blist = self.plan.layers
        skeleton = blist[i]
        # the meta copy in the compute dtype first: the device then holds the layer once,
        # in that dtype (to_empty of the float32 meta layer had allocated it in float32)
        layer = copy.deepcopy(skeleton).to(self.o.dtype)
        for n, t in layer_loader.tensors(layer).items():
            if n in self.plan.keep_fp32[i]:   # as from_pretrained keeps them (meta tensors: no memory)
                t.data = t.data.float()
        pieces, host = nxt.result()
        if i + 1 < len(blist):
            nxt = reader.submit(self._fetch, i + 1, chunks)
        layer.to_empty(device=self.device)
        layer_loader.fill(layer, pieces, host)
        blist[i] = layer
        self.phases.lap("load")
        del host
        if i == 0:
            self.result["layer_bytes"] = sum(p.numel() * p.element_size() for p in layer.parameters())
        self._quantize(i, layer, prefix)
        formats, layer_sites = writer.describe(layer, prefix)
        writer.write(layer, prefix, formats, layer_sites, self.pin)
        blist[i] = skeleton      # the layer is freed
        del layer, formats, layer_sites
        self.phases.lap("write")
        if tracing is not None:
            self.result["memory_trace"] = {"layer": i, **(memtrace.stop(self.device, tracing) or {})}
        if prof is not None:
            prof.stop()          # summarized after the loop (seconds of CPU work, not the layer's)
            self.profiled = (i, prof)
        self.result["seconds_per_layer"].append(time.time() - t0)
        return nxt

    def _quantize(self, i: int, layer: torch.nn.Module, prefix: str) -> None:
        """The steps on layer i (the folds on the float model as loaded, F, then the static scales
        after them, S), then its quantization: GPTQ on the quantized model's activations (Q), or
        round to nearest."""
        plan, phases, summary = self.plan, self.phases, self.plan.summary
        mine = [d.name[len(prefix):] for d in summary.quantized if d.name.startswith(prefix)]
        mine_experts = [d for d in self.exp_quantized if d.name.startswith(prefix)]
        last = i + 1 == len(plan.layers)
        streams = self.streams
        run_ = LayerRun(layer, i, prefix, mine, plan.recipe, self.scales,
                        lambda k, names, per_channel: _observe(layer, streams[k], names, per_channel, not last))
        for s in plan.steps:
            if s.stream in ("F", "S"):
                s.apply_layer(run_)
        del run_
        if "Q" in plan.streams:
            phases.lap("calibrate")
            # the experts modules among the Linears, each a group of its own (GPTQ per
            # expert on the tokens routed to it: lowbit.algorithms.gptq.experts)
            todo = mine + [d.name[len(prefix):] for d in mine_experts]
            key = (type(layer).__name__, tuple(todo))
            self.groups_of[key] = run_stage(layer, streams["Q"], todo, self.handle, _Dropping(), prefix, None,
                                            groups=self.groups_of.get(key))
            phases.lap("quantize")
            if not last:
                _advance(layer, streams["Q"])
            phases.lap("calibrate")
        else:
            # round to nearest: each rank quantizes a share of the Linears and rank 0,
            # which alone writes, receives the codes (nothing runs the quantized layer)
            phases.lap("calibrate")
            rtn_split(layer, mine, {d.name: d for d in summary.quantized}, summary, self._static(), prefix)
            if mine_experts and distributed.rank() == 0:   # the experts on rank 0, which writes
                # quantize_model's QuantExperts (blist[i] is this layer: the names resolve)
                swap_in(plan.model, build_experts(plan.model, plan.found, mine_experts, summary.recipes))
            phases.lap("quantize")

    def _phase_totals(self) -> dict:
        return {**self.phases.seconds,
                **({"gptq_" + k: v for k, v in self.handle.timings.items()} if self.handle else {})}

    def _account(self, before: dict) -> dict:
        """This layer's share of the phase totals (the first layer also holds one-off costs: kernel
        compilation, first allocations), from which a steady state can be read; returns the totals."""
        now = self._phase_totals()
        self.result["phase_seconds_per_layer"].append({k: v - before.get(k, 0.0) for k, v in now.items()
                                                       if k in _LAYER_PHASES or k.startswith("gptq_")})
        return now

    def _finish(self, writer: LayerwiseWriter, bar) -> None:
        """After the last layer: the reports, then (a writing rank) the checkpoint's last files."""
        result = self.result
        self.streams = {}            # the activations freed before the last files are written
        self.phases.layer = None
        if bar is not None:
            bar.close()
        if self.profiled is not None:
            result["profile"] = {"layer": self.profiled[0], **_profile_summary(self.profiled[1])}
        writer.wait()
        # what became of every experts module; GPTQ's per-expert report (the experts kept at
        # round to nearest for lack of routed tokens or by the loss check), as quantize_model's summary
        result["experts"] = {d.name: {"action": d.action, "recipe": d.recipe, "reason": d.reason,
                                      "calibration": None if d.calibration is None else str(d.calibration)}
                             for d in self.plan.experts}
        if self.handle is not None:
            result["gptq_phase_seconds"] = dict(self.handle.timings)
            result["gptq_block_kernel"] = gptq_solver.BLOCK_KERNEL_STATUS
            self.handle = None
        if writer.layers is not None:
            result["shards"] = writer.finish()     # the shards' names, the rest's first
