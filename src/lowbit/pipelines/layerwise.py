"""Layer-by-layer calibration and quantization of a decoder checkpoint that need not fit in memory.

The model is built on the meta device (no memory) from config.json; only the embedding rows
of the calibration tokens are read, to compute the first decoder layer's inputs, and then freed.
Each decoder layer is then, in turn: loaded from its (sharded) safetensors checkpoint onto the
device (lowbit.pipelines.layer_loader), calibrated on the cached activations, quantized, written to
the output checkpoint, and freed; its outputs become the next layer's inputs. The embedding,
the final norm and lm_head are copied from the input shards to the output file to file, never
loaded onto the device.

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

Llama-family models from transformers (LlamaForCausalLM and the models sharing its layout:
model.embed_tokens, model.layers[i], model.norm, lm_head), and the MoE families of MOE_FAMILIES
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3) in that layout. Their routed experts are
planned as quantize_model plans them (ignore patterns may name experts modules; routers and
shared-expert gates stay in high precision; shared experts are Linears), quantized per expert
by lowbit.nn.experts.QuantExperts (round to nearest, on rank 0) or lowbit.algorithms.gptq.experts
(GPTQ on the tokens routed to each expert of the quantized model so far, every rank; few-token
experts keep round to nearest, reported in result["experts"]), and written one Linear per expert
and projection under the family's checkpoint names (lowbit.pipelines.moe_checkpoint), the files
save_compressed writes. The loader reads each fused experts weight from the per-expert tensors
transformers saves (layer_loader.model_sources); an experts layout it cannot map, another MoE
family (gpt-oss), SmoothQuant and static scales with experts are refused by name. Tensors that
from_pretrained keeps in float32 under a 16-bit dtype (DeepSeek-V3's router) stay float32 here.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lowbit.algorithms import distributed
from lowbit.algorithms.gptq import solver as gptq_solver
from lowbit.algorithms.gptq.model import gptq_handler
from lowbit.algorithms.sequential import as_kwargs, capture_block_inputs, decoder_blocks, next_block_inputs, run_stage
from lowbit.algorithms.smoothquant import refuse_experts
from lowbit.algorithms.static_scales import calibrate_act_absmax
from lowbit.archs.decoders import decoder_for
from lowbit.archs.experts import find_experts
from lowbit.io import ct_layout as L
from lowbit.io.st_format import ShardedWriter
from lowbit.nn.quant_linear import QuantLinear
from lowbit.pipelines import layer_loader, moe_checkpoint as MC
from lowbit.pipelines.checkpoint import (atomic_dir, build_quantization_config, config_dict, DEFAULT_SHARD_BYTES,
                                         describe_qlayer, describe_qtensor, expand_deferred, module_tensors, read_json,
                                         write_metadata)
from lowbit.pipelines.layer_loader import tensors
from lowbit.pipelines.layer_rtn import rtn_split
from lowbit.pipelines.moe import build_experts, keep_routers, swap_in
from lowbit.pipelines.quantize_model import split_patterns
from lowbit.pipelines.steps import LayerRun, Step
from lowbit.pipelines.tensorwise import copy_side_files
from lowbit.profiling import memtrace
from lowbit.quantize import static_scheme
from lowbit.recipes.plan import plan
from lowbit.recipes.presets import get_recipe
from lowbit.progress import progress_bar


# The MoE families whose layers this path quantizes: per-expert checkpoint names it maps
# (lowbit.archs.experts.checkpoint_sources) and one attention mask for every layer, each checked
# against the whole-model path by tests/pipelines/test_layerwise.py.
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


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


def _fp32_tensors(model: torch.nn.Module, dtype: torch.dtype, layer: torch.nn.Module, prefix: str) -> set[str]:
    """The tensors of `layer` (names relative to it) that transformers keeps in float32 when it
    loads the model in `dtype` (the model's _keep_in_fp32_modules(_strict) plan, as
    from_pretrained matches it: e.g. DeepSeek-V3's router weight and e_score_correction_bias
    under bf16), so that the layer computes and stores what the whole-model path does."""
    get = getattr(model, "_get_dtype_plan", None)
    pats = [re.compile(p.replace("*", ".*")) for p, d in (get(dtype) if get is not None else {}).items()
            if d == torch.float32]
    return {n for n in tensors(layer) if any(p.search(prefix + n) for p in pats)}


# The phases of quantize_layerwise that belong to one layer (result["phase_seconds_per_layer"]).
_LAYER_PHASES = ("load", "calibrate", "quantize", "write")


# Layers whose tensors may wait on the host for the writer thread (each up to one quantized
# layer: 218 MB for a W8A8 Llama-8B layer): 2 absorbs a slow write without stalling the layer loop
# (on two GPUs a layer can be produced about as fast as one is written).
WRITE_QUEUE = 2


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


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """t on the host (page-locked when pin: a GPU's copy runs at full speed)."""
    if not pin or t.device.type == "cpu":
        return t.to("cpu")
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t)
    return buf


@torch.no_grad()
def quantize_layerwise(in_dir: str | os.PathLike, out_dir: str | os.PathLike | None, recipe, calib, *,
                       steps=(),
                       ignore=None, device="cpu", dtype: torch.dtype = torch.float32, overwrite: bool = False,
                       max_shard_bytes: int | None = None, method_options: dict | None = None,
                       progress: bool = False, memory_trace_layer: int | None = None,
                       profile_layer: int | None = None) -> dict:
    """Quantize the Llama-family or MoE (MOE_FAMILIES) checkpoint in `in_dir` one decoder layer at
    a time and write a compressed-tensors checkpoint to `out_dir` (rank 0 only under
    torch.distributed; None writes nothing, e.g. to measure): the files quantize_model +
    save_compressed write for the same model, recipe and ignore list.

    calib: input-id tensors [B, T] (this rank's share under torch.distributed). steps: the job's
    steps (lowbit.pipelines.steps), the same objects the whole-model workflow runs: SmoothQuant(alpha),
    StaticScales() (calibrated per-tensor activation scales, W8A8 recipes) and GPTQ() (gptq_model's
    options in method_options); any other step is refused by name, none is round to nearest. device / dtype: where and in which
    dtype the layers run (float32 on the CPU reproduces the whole-model path of `lowbit quantize`).
    memory_trace_layer: on CUDA, record the allocator's trace over that layer and name the
    blocks alive at its peak (lowbit.profiling.memtrace; result["memory_trace"]).
    profile_layer: run torch.profiler over that layer (CPU and CUDA activity) and put its top
    operators by self device time and by self CPU time in result["profile"] (a diagnostic: the
    profiler slows the layer).
    Returns a summary: quantized / kept layers, seconds per layer, seconds per phase (setup,
    first_inputs, load, calibrate, quantize, write, finish, barrier: they add up to the wall
    time) and per layer (load, calibrate, quantize, write and, for GPTQ, gptq_hessian /
    gptq_factor / gptq_solve / gptq_losses), peak memory (RSS bytes over the start; on CUDA max_memory_allocated overall and per
    phase, with the layer where each phase peaked and what was allocated when it began), one
    layer's bytes and the activation bytes; for MoE models, "experts": each experts module's
    action, recipe, reason and GPTQ's per-expert report (lowbit.algorithms.gptq.experts)."""
    import transformers          # an optional dependency: the model skeleton is built from its config

    t_start = time.time()
    rss0 = memtrace.rss_bytes()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the memory-stat calls need an index
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    if cuda:
        # the caching allocator starts lazily: before its first allocation, reset_peak_memory_stats
        # raises "Invalid device argument" (in a single process; under torchrun NCCL allocates first)
        torch.empty(1, device=device)
        torch.cuda.reset_peak_memory_stats(device)
    # Seconds of every phase, each ended by lap(): together they are the whole call. On CUDA
    # also each phase's peak of allocated bytes (the peak counter is reset at every boundary).
    phases = {k: 0.0 for k in ("setup", "first_inputs", "load", "calibrate", "quantize", "write", "finish", "barrier")}
    mem: dict[str, dict] = {}
    clock, at_start, where, overall = [t_start], [torch.cuda.memory_allocated(device) if cuda else 0], [None], [0]

    def lap(phase):      # the device's queue drained at each boundary
        if cuda:
            torch.cuda.synchronize(device)
            pk = torch.cuda.max_memory_allocated(device)
            rec = mem.setdefault(phase, {"peak": -1})
            if pk > rec["peak"]:
                rec.update(peak=pk, layer=where[0], allocated_at_start=at_start[0])
            overall[0] = max(overall[0], pk)
            torch.cuda.reset_peak_memory_stats(device)
            at_start[0] = torch.cuda.memory_allocated(device)
        now = time.time()
        phases[phase] += now - clock[0]
        clock[0] = now

    r = get_recipe(recipe)
    steps = sorted(steps, key=lambda s: s.order)
    other = [type(s).__name__ for s in steps if not isinstance(s, Step) or s.stream is None]
    if other:
        raise ValueError(f"steps: {', '.join(other)} not available layer by layer (the steps it runs: SmoothQuant, "
                         "StaticScales, GPTQ); quantize the whole model for them")
    read = {s.stream for s in steps}            # the activation streams the steps read (module docstring)
    need_f, need_s, need_q = "F" in read, "S" in read, "Q" in read
    static_scales = need_s
    if static_scales and r.act is None:
        raise ValueError(f"static_scales needs a recipe with activation quantization; {r.name} is weight-only")
    method = "gptq" if need_q else "rtn"
    calib = list(calib or [])
    if (need_f or need_s or need_q) and not calib:
        raise ValueError("calibration batches are needed for SmoothQuant, static scales and GPTQ: pass calib=[...]")
    in_dir = Path(in_dir)
    raw = read_json(in_dir / "config.json", "the model config")
    if "quantization_config" in raw:
        raise ValueError(f"{in_dir} is already quantized (config.json has a quantization_config); "
                         "give the float checkpoint")
    cfg = config_dict(raw)
    arch = (cfg.get("architectures") or [None])[0]
    if arch is None or not hasattr(transformers, arch):
        raise ValueError(f"config.json names architecture {arch!r}, which transformers does not have")
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = getattr(transformers, arch)(config).eval()
    # experts first: a family outside the list below is refused by name (a MoE family is not in
    # the dense decoder map either)
    experts = find_experts(model)       # fused experts the map does not know are refused by name
    moe = sorted({s.family for s in experts.values()})
    if moe:
        family = moe[0]
        other = [f for f in moe if f not in MOE_FAMILIES]
        if other:
            raise NotImplementedError(
                f"{arch}: layer-by-layer quantization does not support {other[0]} experts "
                f"({next(n for n, s in experts.items() if s.family == other[0])}, ...): it covers the families "
                f"{', '.join(MOE_FAMILIES)} (per-expert checkpoint names it maps, one attention mask for every "
                "layer); quantize the whole model instead (lowbit quantize without --sequential, or "
                "lowbit.pipelines.quantize_model + save_compressed)")
        if need_f:
            refuse_experts(model, "SmoothQuant", "lowbit.algorithms.experts_fold.smooth_experts folds it into the "
                           "experts' down side on a whole model (lowbit quantize --smoothquant without --sequential); "
                           "the layer-by-layer path does not run it yet.")
        if need_s:
            raise NotImplementedError("static_scales: static activation scales are not supported for MoE experts "
                                      f"({next(iter(experts))}, ...), as in quantize_model; use a dynamic recipe")
        if getattr(config, "layer_types", None) and len(set(config.layer_types)) > 1:
            raise NotImplementedError(f"{arch}: its layers mix attention types {sorted(set(config.layer_types))}; "
                                      "layer-by-layer quantization passes every layer the first one's mask")
        blocks = decoder_blocks(model)      # the experts map stands for the decoder map's family check
        layout = blocks is not None and blocks[0] == "model.layers" and hasattr(getattr(model, "model", None),
                                                                                "embed_tokens")
    else:
        fam = decoder_for(model)            # a family not in lowbit.archs.decoders is refused by name
        family = fam.family
        layout = fam.layers == "model.layers" and fam.embed == "model.embed_tokens"
    inner = getattr(model, "model", None)
    if not layout or inner is None or not hasattr(inner, "rotary_emb"):
        raise NotImplementedError(f"{arch}: layer-by-layer quantization knows the Llama layout (model.embed_tokens, "
                                  "model.layers, model.norm, model.rotary_emb); quantize it whole instead")
    bname, blist = "model.layers", inner.layers
    built = [f"model.embed_tokens.{n}" for n, _ in inner.embed_tokens.named_buffers()]
    if built:      # e.g. Gemma's embed_scale: set at construction, on the meta device here
        raise NotImplementedError(f"{family}: layer-by-layer quantization rebuilds the embedding from its "
                                  f"weight alone, but {built} are set at construction; quantize it whole instead")
    # the plan of quantize_model: an ignore pattern may name experts modules, routers and
    # shared-expert gates stay in high precision
    lin_ignore, _, found, exp_decisions, _ = split_patterns(model, experts, r, ignore, None)
    summary = plan(model, r, lin_ignore or None)
    summary.experts = exp_decisions
    routers = keep_routers(model, found, summary)      # Linear routers / shared-expert gates
    exp_quantized = [d for d in exp_decisions if d.action == "quantized"]
    outside = [d.name for d in summary.quantized + exp_quantized if not d.name.startswith(bname + ".")]
    if outside:
        raise NotImplementedError(f"Linears outside the decoder layers would be quantized ({outside[:3]}): the "
                                  "layer-by-layer path keeps them in high precision; ignore=[...] them")
    short = [f"{d.name} {list(d.shape)}" for d in summary.quantized if d.shape[1] % summary.recipe_of(d).weight.k_width]
    short += [f"{d.name} (E, 2I, H = {d.shape})" for d in exp_quantized
              if d.shape[2] % summary.recipes[d.recipe].weight.k_width or
              (d.shape[1] // 2) % summary.recipes[d.recipe].weight.k_width]
    # save_compressed's check of per-expert storage, before any layer is read (a rank that failed
    # it alone, later, would leave the others waiting in a collective)
    for d in exp_quantized:
        w = summary.recipes[d.recipe].weight
        if w.strategy == "block" and (d.shape[1] // 2) % w.block_size[0]:
            raise ValueError(f"{d.name}: {w} blocks of {w.block_size[0]} rows straddle gate and up (I = "
                             f"{d.shape[1] // 2}); a per-expert checkpoint needs I to be a multiple of the block rows")
    if short:
        raise ValueError(f"{len(short)} weight(s) have an in_features that {r.name}'s group does not divide, which "
                         f"compressed-tensors cannot store: {', '.join(short[:3])}; ignore=[...] them or choose a "
                         "smaller group")
    # checkpoint names: the families' own (Mixtral's block is block_sparse_moe on disk, its
    # experts one tensor per expert and projection), as save_compressed writes them
    sites = MC.experts_sites(model)
    renamed = MC.renames(sites)
    unquantized = [MC.rename(d.name, renamed) for d in summary.skipped] + [MC.rename(n, renamed) for n in routers]
    unquantized += [MC.block_pattern(sites[d.name]) for d in exp_decisions
                    if d.action != "quantized" and sites[d.name].spec.ckpt_projs is not None]
    L.scheme_to_args(r.weight)          # unsupported schemes fail before anything is read
    if r.act is not None:
        L.scheme_to_args(static_scheme(r.act) if static_scales else r.act)
    world = distributed.world_size()
    ckpt = layer_loader.Checkpoint(in_dir)

    try:                                 # every layer's tensors found, with the shapes config.json's model has
        sources = layer_loader.model_sources(model, ckpt)
        plans = [layer_loader.plan(blist[i], f"{bname}.{i}.", ckpt, world, sources) for i in range(len(blist))]
    except BaseException:
        ckpt.close()
        raise
    own = {n for n in ckpt.files if n.startswith(bname + ".")}
    keep_fp32 = [_fp32_tensors(model, dtype, blist[i], f"{bname}.{i}.") for i in range(len(blist))]
    result = {"recipe": r.name, "method": method, "layers": len(blist), "seconds_per_layer": [],
              "quantized": [d.name for d in summary.quantized + exp_quantized],
              "kept": [d.name for d in summary.skipped + exp_decisions if d.action == "skipped"],
              "world_size": world, "phase_seconds": phases}
    writer_rank = distributed.rank() == 0 and out_dir is not None
    busy = result["thread_seconds"] = {"read": 0.0, "copy_rest": 0.0, "write": 0.0}

    def run(tmp: Path | None):
        # each shard's header written in the space kept for it at its start (no copy of the data
        # behind a header at the end): room for ~6 output tensors per input tensor
        writer = (ShardedWriter(tmp, max_shard_bytes or DEFAULT_SHARD_BYTES,
                                header_reserve=-(-256 * 6 * len(ckpt.files) // 8) * 8)
                  if tmp is not None else None)
        # the tensors outside the layers go to shards of their own, written by a thread of their
        # own from the start (embedding and lm_head: 2 GB for Llama-8B), beside the layers'
        rest_writer = (ShardedWriter(tmp, max_shard_bytes or DEFAULT_SHARD_BYTES, tag="rest",
                                     header_reserve=-(-256 * len(ckpt.files) // 8) * 8)
                       if tmp is not None else None)
        lap("setup")
        # the first layer's share is read (reader thread) while the first inputs are computed
        io = ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)
        chunks = ThreadPoolExecutor(max_workers=layer_loader.read_threads())
        pin = cuda
        pin_for = device if pin else None

        def fetch(i):                # reader thread: this rank's share of layer i, on the host
            pieces = plans[i]
            host, secs = layer_loader.read_pieces(pieces, ckpt, dtype, chunks, pin_for,
                                                  dict.fromkeys(keep_fp32[i], torch.float32))
            busy["read"] += secs
            return pieces, host

        def write(ts):
            t0 = time.time()
            for n, t in expand_deferred(ts):
                writer.add(MC.rename(n, renamed), t)
            busy["write"] += time.time() - t0

        try:
            nxt = io[0].submit(fetch, 0)
            emb = inner.embed_tokens
            inner.rotary_emb = type(inner.rotary_emb)(config=config).to(device)
            if calib and all(isinstance(b, torch.Tensor) and not b.is_floating_point() for b in calib):
                # Only the calibration tokens' rows of the embedding are read (ranged reads, on the
                # host); the ids are renumbered into that small table (an exact row gather either way)
                ids = torch.cat([b.reshape(-1) for b in calib]).to(torch.int64)
                rows, inv = torch.unique(ids, sorted=True, return_inverse=True)
                table = layer_loader.read_rows(ckpt, "model.embed_tokens.weight", rows)
                emb.weight = torch.nn.Parameter(table.to(dtype), requires_grad=False)
                batches, at = [], 0
                for b in calib:
                    batches.append(inv[at:at + b.numel()].reshape(b.shape))
                    at += b.numel()
            else:                        # kwargs batches: the whole table, on the host
                emb.weight = torch.nn.Parameter(ckpt.get("model.embed_tokens.weight").to(dtype), requires_grad=False)
                batches = calib
            to_dev = emb.register_forward_hook(lambda mod, args, out: out.to(device))
            try:
                first = capture_block_inputs(model, blist[0], batches) if batches else []
            finally:
                to_dev.remove()
            emb.to("meta")               # freed: only the first inputs need it
            del batches
        except BaseException:
            for ex in (*io, chunks):
                ex.shutdown(wait=True)
            raise
        # Reading layer i + 1 from the shards (host) overlaps layer i's work, and writing layer
        # i's tensors (host) overlaps layer i + 1's: one reader and one writer thread, each
        # working in order, so the files are the same bytes; a third thread copies the tensors
        # outside the layers into their own shards meanwhile (so the first layer's write does not
        # wait behind that copy).
        written, rested = [], None        # the layers' write futures, oldest first
        if writer is not None:       # the tensors outside the layers, streamed (never on the device)
            def copy_rest():
                t0 = time.time()
                for n in sorted(ckpt.files):
                    if n not in own:
                        path, begin, fdtype, shape = ckpt.span(n)
                        if fdtype.is_floating_point and fdtype != dtype:
                            rest_writer.add(n, ckpt.get(n).to(dtype))
                        else:        # bytes as they are: copied file to file by the kernel
                            rest_writer.add_from_file(n, fdtype, shape, path, begin)
                busy["copy_rest"] += time.time() - t0
            rested = io[2].submit(copy_rest)
        # each stream its own list (they share the first layer's inputs), advanced in place
        streams = {k: list(first) for k, want in (("F", need_f), ("S", need_s), ("Q", need_q)) if want}
        del first
        scales: dict[str, torch.Tensor] = {}
        layer_schemes, sidecar, targets = {}, {}, {}
        static = scales if need_s else None      # filled layer by layer, before each layer is quantized
        # GPTQ's W4A16 layers keep their codes on the device (no host twin): rank 0 packs them
        # there for the checkpoint and copies the packed words (half the bytes) to the host
        handle = gptq_handler(model, summary, static, host_twin=False, **(method_options or {})) if need_q else None
        groups_of: dict[tuple, list] = {}     # execution groups by the layer's Linear names (Llama layers: one entry)
        result["activation_bytes"] = sum(_stream_bytes(s) for s in streams.values())
        bar = None
        if progress:
            bar = progress_bar(total=len(blist), desc=f"layer by layer {r.name}", unit="layer")
        lap("first_inputs")
        result["phase_seconds_per_layer"] = []
        profiled = None
        before = {**phases, **({"gptq_" + k: v for k, v in handle.timings.items()} if handle else {})}

        try:
            for i in range(len(blist)):
                t0 = time.time()
                where[0] = i
                tracing = memtrace.start(device) if memory_trace_layer == i else None
                prof = _profile_start(cuda) if profile_layer == i else None
                prefix = f"{bname}.{i}."
                skeleton = blist[i]
                # the meta copy in the compute dtype first: the device then holds the layer once,
                # in that dtype (to_empty of the float32 meta layer had allocated it in float32)
                layer = copy.deepcopy(skeleton).to(dtype)
                for n, t in layer_loader.tensors(layer).items():
                    if n in keep_fp32[i]:   # as from_pretrained keeps them (meta tensors: no memory)
                        t.data = t.data.float()
                pieces, host = nxt.result()
                if i + 1 < len(blist):
                    nxt = io[0].submit(fetch, i + 1)
                layer.to_empty(device=device)
                layer_loader.fill(layer, pieces, host)
                blist[i] = layer
                lap("load")
                del host
                if i == 0:
                    result["layer_bytes"] = sum(p.numel() * p.element_size() for p in layer.parameters())
                mine = [d.name[len(prefix):] for d in summary.quantized if d.name.startswith(prefix)]
                mine_experts = [d for d in exp_quantized if d.name.startswith(prefix)]
                last = i + 1 == len(blist)
                # the folds on the float model as loaded (F), then the static scales after them (S)
                run_ = LayerRun(layer, i, prefix, mine, r, scales,
                                lambda k, names, per_channel: _observe(layer, streams[k], names, per_channel, not last))
                for s in steps:
                    if s.stream in ("F", "S"):
                        s.apply_layer(run_)
                del run_
                if need_q:               # GPTQ on the quantized model's activations
                    lap("calibrate")
                    # the experts modules among the Linears, each a group of its own (GPTQ per
                    # expert on the tokens routed to it: lowbit.algorithms.gptq.experts)
                    todo = mine + [d.name[len(prefix):] for d in mine_experts]
                    key = (type(layer).__name__, tuple(todo))
                    groups_of[key] = run_stage(layer, streams["Q"], todo, handle, _Dropping(), prefix, None,
                                               groups=groups_of.get(key))
                    lap("quantize")
                    if not last:
                        _advance(layer, streams["Q"])
                    lap("calibrate")
                else:
                    # round to nearest: each rank quantizes a share of the Linears and rank 0,
                    # which alone writes, receives the codes (nothing runs the quantized layer)
                    lap("calibrate")
                    rtn_split(layer, mine, {d.name: d for d in summary.quantized}, summary, static, prefix)
                    if mine_experts and distributed.rank() == 0:   # the experts on rank 0, which writes
                        # quantize_model's QuantExperts (blist[i] is this layer: the names resolve)
                        swap_in(model, build_experts(model, found, mine_experts, summary.recipes))
                    lap("quantize")
                formats, layer_sites = {}, {}
                for n, m in layer.named_modules():
                    full = prefix + n
                    if isinstance(m, QuantLinear):
                        stored = MC.rename(full, renamed)
                        formats[full], layer_schemes[stored], sidecar[stored] = describe_qlayer(stored, m)
                    elif full in sites:      # written per expert, as save_compressed writes them
                        site = layer_sites[full] = dataclasses.replace(sites[full], module=m)
                        if not site.quantized:
                            continue
                        MC.check_savable(site, cfg)
                        for lname, qt in MC.expert_qtensors(site):
                            formats[full], layer_schemes[lname], sidecar[lname] = describe_qtensor(
                                lname, qt, m.weight_scheme, m.act_scheme)
                            targets[lname] = MC.block_pattern(site)
                del m
                if writer is not None:
                    # tensors on the device are copied to the host here (the layer is freed below;
                    # GPTQ's W4A16 codes are packed into int32 words on the device first); the
                    # checkpoint layout of codes already on the host (a QuantLinear with its host
                    # twin: int4 packing on the CPU, ~0.35 s for a Llama-8B layer) is made by the
                    # writer thread while the next layer computes
                    out = [(n, t if callable(t) else _to_host(t, pin))
                           for n, t in module_tensors(layer, formats, set(), prefix[:-1], defer_host=True,
                                                      experts=layer_sites)]
                    while len(written) >= WRITE_QUEUE:   # at most WRITE_QUEUE layers wait on the host
                        written.pop(0).result()            # (and a writer's error surfaces here)
                    written.append(io[1].submit(write, out))
                    del out
                blist[i] = skeleton      # the layer is freed
                del layer
                lap("write")
                if tracing is not None:
                    result["memory_trace"] = {"layer": i, **(memtrace.stop(device, tracing) or {})}
                if prof is not None:
                    prof.stop()          # summarized after the loop (seconds of CPU work, not the layer's)
                    profiled = (i, prof)
                result["seconds_per_layer"].append(time.time() - t0)
                # this layer's share of the phase totals (the first layer also holds one-off costs:
                # kernel compilation, first allocations), from which a steady state can be read
                now = {**phases, **({"gptq_" + k: v for k, v in handle.timings.items()} if handle else {})}
                result["phase_seconds_per_layer"].append({k: v - before.get(k, 0.0) for k, v in now.items()
                                                          if k in _LAYER_PHASES or k.startswith("gptq_")})
                before = now
                if bar is not None:
                    bar.update(1)
        finally:
            for ex in (*io, chunks):
                ex.shutdown(wait=True)
        where[0] = None
        if bar is not None:
            bar.close()
        if profiled is not None:
            result["profile"] = {"layer": profiled[0], **_profile_summary(profiled[1])}
        for fut in (*written, rested):
            if fut is not None:
                fut.result()
        # what became of every experts module; GPTQ's per-expert report (the experts kept at
        # round to nearest for lack of routed tokens or by the loss check), as quantize_model's summary
        result["experts"] = {d.name: {"action": d.action, "recipe": d.recipe, "reason": d.reason,
                                      "calibration": None if d.calibration is None else str(d.calibration)}
                             for d in exp_decisions}
        if handle is not None:
            result["gptq_phase_seconds"] = dict(handle.timings)
            result["gptq_block_kernel"] = gptq_solver.BLOCK_KERNEL_STATUS
        if writer is not None:
            result["shards"] = rest_writer.finish(writer)     # the rest's shards first, as before
            out_cfg = dict(cfg)
            out_cfg["quantization_config"] = build_quantization_config(layer_schemes, sorted(set(unquantized)), targets)
            write_metadata(tmp, out_cfg, r.name, sidecar)
            copy_side_files(in_dir, tmp)

    try:
        if writer_rank:
            atomic_dir(Path(out_dir), overwrite, run)
            result["out_dir"] = str(out_dir)
        else:
            run(None)
        lap("finish")
    finally:
        ckpt.close()
    if distributed.active():
        import torch.distributed as dist
        dist.barrier()
    lap("barrier")
    result["seconds"] = time.time() - t_start
    result["peak_rss_over_start_bytes"] = max(0, memtrace.peak_rss_bytes() - rss0)
    if cuda:
        result["peak_device_bytes"] = overall[0]
        result["phase_peak_bytes"] = mem
    return result
