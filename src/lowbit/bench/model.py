"""`lowbit bench model`: a whole Llama-shaped model, bf16 against every lowbit recipe (and
torchao's configs where torchao imports), in one process on one GPU; or a mixture-of-experts
model (`--shape mixtral | qwen3-30b-a3b`, lowbit.bench.moe_model) against two bf16 baselines.

For each variant (the bf16 baseline first, then each recipe applied to a deep copy of it with
lowbit.pipelines.quantize_model, followed by lowbit.nn.prepare_model where that exists):
  prefill   2048 tokens, batch 1, no KV cache, logits of the last token only
  decode    one token per sequence at batch 1 and 16 against a KV cache holding 512 tokens
            (a transformers StaticCache; the same step is repeated, see lowbit.bench.llama)
in three modes (`modes`; each compared with the baseline in the same mode):
  eager     the model as transformers runs it (lowbit's own per-layer decode graphs included,
            lowbit.ops.prepared: what a user gets without compiling)
  compile   torch.compile(dynamic=False), mode "default": prefill and decode
  graphs    torch.compile(dynamic=False), mode "reduce-overhead", i.e. inductor's CUDA graphs
            (cudagraph trees) around the whole decode step (decode only)
A compile failure is that row's error; the run goes on.
Variants (lowbit.bench.model_variants): lowbit recipes, `RECIPE+lm_head=KIND` (the recipe with
quantize_model's quantized LM head, KIND int8 / fp8 / w4a16), `RECIPE+native` (its layers prepared
with lowbit's native sm_90a decode classes opted in: lowbit.ops.kernels.native.opted_in, scoped to
that variant's build; a variant without the suffix is built opted out, whatever LOWBIT_NATIVE says)
and torchao's configs (torchao-int4: int4 weight-only, groups of 128; torchao-int8wo: int8
weight-only; torchao-int8: int8 dynamic; torchao-fp8-row: fp8 dynamic per row), the last where
torchao imports. A `+native` variant whose kernels cannot run here (native_unavailable: no library,
no sm_90 GPU, a model off the GPU) or whose layers all passed the native classes over is not timed:
its rows are skipped with "n/a: " and the reason, never timed on the Triton kernels under its name.

Timing: lowbit.profiling.timing.bench_ms (triton.testing.do_bench median, L2 flushed between
calls) after warm-up calls; peak memory is read around one extra call, outside the timer (the
timer's own L2-flush buffer would count otherwise). On the CPU (`--device cpu`, a dry run of
the plumbing, what the tests use) a wall-clock median stands in; CPU times mean nothing.

Each row: name, variant, kind (baseline|lowbit|torchao), mode, phase, batch, tokens (processed
per call), shape, ms, tokens_per_s, speedup (baseline ms / ms, same mode, phase and batch: > 1
is faster), weight_bytes (bytes of every tensor the model holds on the device: parameters,
buffers and tensors kept in module attributes such as QTensors and per-device caches,
each storage once, counted after the eager calls so lazily built caches show),
weight_alloc_bytes (torch.cuda.memory_allocated growth from building the variant, after the
eager calls), weights_ratio, peak_bytes (torch.cuda.max_memory_allocated during one call
above the memory in use before the variant was built: weights + KV cache + activations),
peak_ratio, logits_rel_err (||logits - logits_baseline|| / ||logits_baseline|| over all
positions of a fixed 256-token prompt, eager), out_rel_err (the timed call's own output
against the baseline's eager output for the same inputs), vs_eager_rel (compiled rows: against
the same variant's eager output), compile_s, graph_breaks, cudagraph_skips, build_s,
prepared, paths (QuantLinear.last_path counts), kernels (lowbit variants: how many QuantLinears took
each kernel class when prepared, e.g. {"native_w4a16": 14}), cache (static|dynamic); decode rows:
bytes_per_step and roof (lowbit.bench.model_targets: the step's bytes per second over the copy
bandwidth measured at the start, `copy_bw` in the environment); must / met and weights_must /
weights_met at the targets' shape (model_targets); a row that did not run has ms None and
`error` or `skipped` saying why.

torch.compile runs with torch's defaults (its recompile limit included: what a user gets);
graph breaks and cudagraph skips are counted per row, so a model that falls back shows it.

MoE shapes (lowbit.bench.moe_model): two baselines run first, transformers' expert loop
("bf16", kind baseline: every other row's reference outputs and speedup / weights_ratio) and
the grouped bf16 baseline ("bf16-grouped", kind grouped: torch._grouped_mm; its rows say n/a
where torch has none). Rows add expert_bytes (the experts modules' own tensors), and
lowbit.bench.moe_report adds vs_grouped, vs_loop, expert_ratio and the must targets. A recipe
whose experts would run their exact float64 path on CUDA (no grouped kernel for it) is not
timed: its rows are skipped with that reason. The loop baseline's eager rows always run (they
are the reference); its compiled rows get `loop_budget` seconds from its start (default: the
recipes' budget), since dynamo breaks the graph and recompiles per expert there, which can take
minutes; the grouped baseline has no budget.

Budget: each non-baseline variant gets `budget` seconds; with a `time_limit` for the whole run, at
most an equal share of the time left when it starts (so every variant gets its turn inside one
call), and that share alone when no budget is given (default without a time limit: 30 s). Steps
run in the order of `_plan` (the eager rows, then graphs decode b1 and compile decode b1: the rows
that decide a recipe), and a step that would start after the budget is spent is skipped with that
reason. A step is not interrupted: one slow compile can overrun. The baseline has no budget (every
ratio needs it); variants not started by the time limit are skipped.
"""
from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import lowbit.nn as lnn
from lowbit.bench import llama, model_report, moe_model, moe_report
from lowbit.bench.common import environment as base_env, write_run
from lowbit.bench.model_measure import (CACHE_SLACK, CUDA_BROKEN, Inputs, Skipped, allocated, describe_failure,
                                        free, kernel_classes, quant_paths, refusal_of, rel_err, reset_compiler,
                                        run_step, weight_memory)
from lowbit.bench.model_targets import add_musts, add_roofline, copy_bandwidth, decode_bytes
from lowbit.bench.model_variants import TORCHAO, all_variants, check_variants, native_kernel_names, parse_variant
from lowbit.bench.moe_report import add_moe_ratios
from lowbit.ops import scratch, tuning
from lowbit.ops.kernels import native as native_kernels
from lowbit.ops.native import library as native_library

MODES = ("eager", "compile", "graphs")
NATIVE_NAMES = frozenset(cls.name for cls in native_kernels.NATIVE)   # the kernel classes +native opts in
DEFAULT_BUDGET = 30.0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Options:
    """One run. Token counts are per sequence; batches are the decode batch sizes."""
    shape: str = "8b"
    layers: int | None = None               # None: 32 (dense shapes: full depth), 2 (MoE shapes)
    dtype: str = "bf16"
    device: str = "cuda"
    seed: int = 0
    prefill: int = 2048
    context: int = 512
    batches: tuple[int, ...] = (1, 16)
    error_tokens: int = 256
    variants: tuple[str, ...] = ()          # lowbit recipe / torchao names; () = all
    modes: tuple[str, ...] = MODES
    compile_backend: str = "inductor"       # another torch.compile backend (aot_eager): CPU dry runs
    budget: float | None = None             # seconds per variant; None: see the module docstring
    loop_budget: float | None = None        # MoE: seconds for the expert loop's compiled rows (None: budget)
    time_limit: float | None = None         # seconds for the whole run; later variants are skipped
    quick: bool = False
    log: Callable[[str], None] = field(default=lambda msg: print(msg, flush=True))

    def __post_init__(self):
        if self.layers is None:
            self.layers = 2 if moe_model.is_moe(self.shape) else 32

    @classmethod
    def quick_run(cls, **kw) -> "Options":
        """--quick: 512-token prefill, 128-token context, batch 1 only, 15 s per variant."""
        return cls(**{**dict(prefill=512, context=128, batches=(1,), error_tokens=64, budget=15.0, quick=True), **kw})


def check_modes(modes: tuple[str, ...]) -> tuple[str, ...]:
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes={','.join(modes)}: choose from {', '.join(MODES)}")
    return tuple(dict.fromkeys(modes))


# ------------------------------------------------------------------------------ variants
def native_unavailable(device: torch.device) -> str | None:
    """Why a `+native` variant cannot run its native kernels in this run (None: it can): the library's
    reason (no built library or toolchain, no sm_90 GPU), else a model that is not on a CUDA device."""
    why = native_library.unavailable_reason()
    if why is None and device.type != "cuda":
        why = f"the native kernels run on a CUDA GPU; this run's model is on {device}"
    return why


def _build(name: str, kind: str, master: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """A deep copy of the baseline model quantized as `name` (or run by grouped GEMMs, kind
    "grouped"), and facts about how."""
    if kind == "grouped":
        return moe_model.build_grouped(master), dict(experts_impl="torch._grouped_mm")
    v = parse_variant(name)
    if v.torchao:
        return _build_torchao(name, master)
    device = next(master.parameters()).device
    if v.native:
        why = native_unavailable(device)
        if why:
            raise Skipped(f"n/a: {why}")
        native_library.load()   # a first build lands in build_s, not in the first timed step's warm-up
    model = copy.deepcopy(master)
    # every lowbit variant is built with the native classes opted in or out by its name alone (not by
    # LOWBIT_NATIVE): dispatch decides when a layer is prepared, so the scope covers quantize + prepare
    with native_kernels.opted_in(v.native):
        lnn.quantize_model(model, v.recipe, lm_head=v.lm_head)
        prepare = getattr(lnn, "prepare_model", None)  # the GPU runtime's hook, where it exists
        if prepare is not None:
            prepare(model)
    kernels = kernel_classes(model)
    if v.native and not NATIVE_NAMES & set(kernels):   # never the Triton kernels under the native name
        why = refusal_of(model, native_kernel_names(v.recipe))
        del model
        raise Skipped(f"n/a: no layer took a native kernel ({why or 'no layer was quantized'})")
    info = dict(prepared=prepare is not None, kernels=kernels, **moe_model.describe_experts(model))
    untimed = moe_model.untimed_experts(model, device)
    if untimed:
        del model
        raise Skipped(f"experts would run the exact float64 path (no grouped kernel for {name}: "
                      f"{info.get('expert_weight')}); a reference, not timed ({len(untimed)} modules)")
    return model, info


def _build_torchao(name: str, master: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    try:
        import torchao.quantization as tq
    except ImportError as exc:
        # exc.name is "torchao" or a submodule ("torchao.quantization") depending on where the
        # import stopped (some Python builds name the submodule)
        absent = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torchao"
        raise Skipped("torchao not installed" if absent else f"torchao not importable ({exc})") from None
    if name == "torchao-int8":
        cfg = tq.Int8DynamicActivationInt8WeightConfig()
    elif name == "torchao-int8wo":
        cfg = tq.Int8WeightOnlyConfig()
    elif name == "torchao-fp8-row":
        per_row = getattr(tq, "PerRow", None) or __import__("torchao.quantization.granularity",
                                                            fromlist=["PerRow"]).PerRow
        cfg = tq.Float8DynamicActivationFloat8WeightConfig(granularity=per_row())
    else:
        cfg = tq.Int4WeightOnlyConfig(group_size=128)   # lowbit's w4a16: int4, groups of 128
    model = copy.deepcopy(master)
    # the layers lowbit quantizes: every Linear but the LM head
    tq.quantize_(model, cfg, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head")
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    targets = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    done = sum(is_traceable_wrapper_subclass(m.weight) for m in targets)
    if not done:   # some configs leave a dtype / device they do not support as it was, silently
        raise RuntimeError(f"torchao's {type(cfg).__name__} left all {len(targets)} Linears unquantized "
                           f"({master.dtype if hasattr(master, 'dtype') else ''} on {targets[0].weight.device})")
    return model, dict(torchao_config=type(cfg).__name__, torchao_quantized=f"{done}/{len(targets)}")


# ------------------------------------------------------------------------------ one variant
# (mode, phase, batch) in the order they run; batch None: every decode batch of the run
# (eager first: no compile, seconds, and every compiled row is then checked against its eager output)
ORDER = (("eager", "decode", 1), ("eager", "decode", None), ("eager", "prefill", 1), ("graphs", "decode", 1),
         ("compile", "decode", 1), ("graphs", "decode", None), ("compile", "prefill", 1), ("compile", "decode", None))


def _plan(opts: Options) -> list[tuple[str, str, int]]:
    """(mode, phase, batch) in the order they run (see the module docstring)."""
    out = []
    for mode, phase, b in ORDER:
        if mode not in opts.modes:
            continue
        for x in ([b] if b is not None else opts.batches):
            if (phase == "prefill" or x in opts.batches) and (mode, phase, x) not in out:
                out.append((mode, phase, x))
    return out


def _base_row(opts: Options, variant: str, kind: str, mode: str, phase: str, batch: int) -> dict:
    tokens = opts.prefill if phase == "prefill" else batch
    where = f"T={opts.prefill}" if phase == "prefill" else f"B={batch} ctx={opts.context}"
    name = f"{variant} {mode} {phase}" + (f" b{batch}" if phase == "decode" else "")
    return dict(name=name, variant=variant, kind=kind, mode=mode, phase=phase, batch=batch, tokens=tokens,
                shape=f"{opts.shape} L{opts.layers} {where}", ms=None)


def _try_step(model, r: dict, inp: Inputs, opts: Options, ref: dict, eager_out: dict, mem0: int | None,
              state: dict) -> None:
    """run_step for row r; a failure (compile included) becomes that row's error or skip."""
    try:
        run_step(model, r["mode"], r["phase"], r["batch"], inp, opts, r, ref, eager_out, mem0, inp.prefill.device)
        opts.log(_progress(r))
    except Skipped as exc:
        r["skipped"] = str(exc)
        opts.log(f"  {r['name']}: skipped ({exc})")
    except Exception as exc:
        r["error"] = describe_failure(exc)
        opts.log(f"  {r['name']}: FAILED {r['error']}")
        if any(s in str(exc) for s in CUDA_BROKEN):
            state["cuda_broken"] = r["error"]
        elif r["mode"] != "eager":
            reset_compiler()


def measure_variant(name: str, kind: str, master: torch.nn.Module, inp: Inputs, opts: Options,
                    ref: dict, state: dict, budget: float | None = None) -> list[dict]:
    """Every row of one variant; `ref` holds the baseline's outputs (filled by the baseline),
    `state` carries `cuda_broken` (why nothing can run any more) between variants and
    `experts` (the MoE experts modules' names; empty for a dense model); budget: seconds for this
    variant (default opts.budget)."""
    log, device = opts.log, inp.prefill.device
    plan = _plan(opts)
    rows = [_base_row(opts, name, kind, *p) for p in plan]

    def fail_all(key: str, why: str) -> list[dict]:
        """Every row not yet measured, failed or skipped gets `key` = why."""
        for r in rows:
            if r["ms"] is None and "error" not in r and "skipped" not in r:
                r[key] = why
        log(f"  {name}: {key} ({why})")
        return rows

    if state.get("cuda_broken"):
        return fail_all("skipped", f"CUDA context broken by an earlier error ({state['cuda_broken']})")
    t0 = time.perf_counter()
    if budget is None:
        budget = DEFAULT_BUDGET if opts.budget is None else opts.budget
    experts = state.get("experts") or []
    if kind == "grouped" or (kind == "baseline" and not experts):   # see the module docstring
        deadlines, spent = dict(eager=math.inf, compiled=math.inf), ""
    elif kind == "baseline":
        loop = budget if opts.loop_budget is None else opts.loop_budget
        deadlines = dict(eager=math.inf, compiled=t0 + loop)
        spent = (f"loop budget ({loop:.0f} s) spent" if loop > 0 else
                 "not run: --loop-budget 0 (under torch.compile the loop breaks the graph and recompiles per expert)")
    else:
        deadlines = dict(eager=t0 + budget, compiled=t0 + budget)
        spent = f"variant time budget ({budget:.0f} s) spent"
    scratch.release()   # each variant's peak counts the dequantized-weight buffers it makes itself
    mem0 = allocated(device)
    model, info = None, {}
    try:
        if kind == "baseline":
            model = copy.deepcopy(master)
            if experts:
                info["experts_impl"] = moe_model.experts_implementation(model) or "eager"
        else:
            model, built = _build(name, kind, master)
            info.update(built)
        info["build_s"] = round(time.perf_counter() - t0, 2)
        log(f"  {name}: built in {info['build_s']:.1f} s")
        if experts and kind == "lowbit":     # the grouped path of each row's sorted rows (moe_model)
            for r in rows:
                r["expert_paths"] = moe_model.expert_paths(model, r["tokens"], DTYPES[opts.dtype], device)
        with torch.no_grad():
            logits = llama.full_logits(model, inp.error).float().cpu()
            if kind == "baseline":
                ref["logits"] = logits
            info["logits_rel_err"] = rel_err(logits, ref["logits"])
            del logits
            eager_out: dict = {}
            for r, (mode, phase, batch) in zip(rows, plan):
                if state.get("cuda_broken"):
                    continue
                if mode != "eager" and "weight_bytes" not in info:
                    # the eager model's memory, before compiled graphs hold their own
                    info.update(_memory(model, device, mem0, experts), paths=quant_paths(model))
                if time.perf_counter() > deadlines["eager" if mode == "eager" else "compiled"]:
                    r["skipped"] = spent
                    continue
                if mode != "eager":
                    reset_compiler()
                _try_step(model, r, inp, opts, ref, eager_out, mem0, state)
            if state.get("cuda_broken"):   # nothing more can run in this process
                fail_all("skipped", "not run: the CUDA context broke")
            elif "weight_bytes" not in info:
                info.update(_memory(model, device, mem0, experts), paths=quant_paths(model))
            if "weight_bytes" in info:
                for r in rows:
                    if r["phase"] == "decode":
                        r["bytes_per_step"] = decode_bytes(info["weight_bytes"], model, r["batch"], opts.context)
    except Skipped as exc:
        fail_all("skipped", str(exc))
    except Exception as exc:
        why = describe_failure(exc)
        if any(s in str(exc) for s in CUDA_BROKEN):
            state["cuda_broken"] = why
        fail_all("error", why)
    finally:
        del model
        free(device)
    for r in rows:
        r.update(info)
    return rows


def _memory(model: torch.nn.Module, device: torch.device, mem0: int | None, experts: list[str]) -> dict:
    """weight_memory, and expert_bytes where the model has MoE experts."""
    out = weight_memory(model, device, mem0)
    if experts:
        out["expert_bytes"] = moe_model.expert_bytes(model, experts, device)
    return out


def _progress(r: dict) -> str:
    s = f"  {r['name']:36s} {r['ms']:9.3f} ms {r['tokens_per_s']:12.0f} tok/s"
    if "peak_bytes" in r:
        s += f"  peak {r['peak_bytes'] / 2**30:6.2f} GiB"
        if r.get("scratch_bytes"):
            s += f" (+ {r['scratch_bytes'] / 2**20:.0f} MiB scratch held)"
    if "compile_s" in r:
        s += f"  compile {r['compile_s']:.1f} s, {r['graph_breaks']} graph breaks"
    return s


def add_ratios(rows: list[dict]) -> None:
    """speedup / weights_ratio / peak_ratio against the baseline row of the same mode, phase, batch."""
    base = {(r["mode"], r["phase"], r["batch"]): r for r in rows if r["kind"] == "baseline"}
    for r in rows:
        b = base.get((r["mode"], r["phase"], r["batch"]))
        if not b:
            continue
        r["baseline"] = b["variant"]
        for key, num, den in (("speedup", b.get("ms"), r.get("ms")),
                              ("weights_ratio", r.get("weight_bytes"), b.get("weight_bytes")),
                              ("peak_ratio", r.get("peak_bytes"), b.get("peak_bytes"))):
            if num and den:
                r[key] = num / den


def run_bench(opts: Options, on_variant: Callable[[list[dict], float], None] | None = None) -> list[dict]:
    """Build the baseline model, measure it and every variant in `opts.variants`; rows with
    ratios. on_variant(rows so far, copy bandwidth in B/s) runs first and after each variant
    (main writes the JSON there, so a run killed from outside keeps what it measured)."""
    device = torch.device(opts.device)
    if opts.dtype not in DTYPES:
        raise ValueError(f"dtype={opts.dtype!r}; choose one of {', '.join(DTYPES)}")
    if opts.context < 1 or opts.prefill < 1 or opts.error_tokens < 1 or not opts.batches or min(opts.batches) < 1:
        raise ValueError("prefill, context, error_tokens and every decode batch must be >= 1")
    moe = moe_model.is_moe(opts.shape)
    variants = [v.name for v in check_variants(opts.variants, moe)]
    check_modes(opts.modes)
    need = max(opts.prefill, opts.error_tokens, opts.context + CACHE_SLACK)
    build = moe_model.build_moe if moe else llama.build_llama
    master = build(opts.shape, opts.layers, DTYPES[opts.dtype], opts.device, opts.seed, max_positions=max(8192, need))
    inp = Inputs.make(opts, master.config.vocab_size, device)
    opts.log(f"# model: {opts.shape} x {opts.layers} layers, {opts.dtype} on {device}; prefill {opts.prefill}, "
             f"decode at batch {','.join(map(str, opts.batches))} after {opts.context} tokens; "
             f"modes {', '.join(opts.modes)}")
    copy_bw = copy_bandwidth(device)
    opts.log(f"# copy bandwidth (device to device, read + write): {copy_bw / 1e9:.0f} GB/s")
    if on_variant is not None:
        on_variant([], copy_bw)
    ref: dict = {}
    state: dict = dict(experts=moe_model.expert_names(master) if moe else [])
    rows: list[dict] = []
    todo = [(opts.dtype, "baseline")] + ([(f"{opts.dtype}-grouped", "grouped")] if moe else [])
    todo += [(v, "torchao" if v in TORCHAO else "lowbit") for v in variants]
    t0 = time.perf_counter()
    for i, (name, kind) in enumerate(todo):
        opts.log(f"[{i + 1}/{len(todo)}] {name}")
        if opts.time_limit and time.perf_counter() - t0 > opts.time_limit:
            why = f"run time limit ({opts.time_limit:.0f} s) reached"
            rows += [dict(_base_row(opts, name, kind, *p), skipped=why) for p in _plan(opts)]
            opts.log(f"  {name}: skipped ({why})")
            continue
        budget = DEFAULT_BUDGET if opts.budget is None else opts.budget
        if opts.time_limit and kind != "baseline":   # an equal share of what is left, so every variant gets a turn
            share = (opts.time_limit - (time.perf_counter() - t0)) / (len(todo) - i)
            budget = share if opts.budget is None else min(opts.budget, share)
        rows += measure_variant(name, kind, master, inp, opts, ref, state, budget=budget)
        _finish(rows, opts, copy_bw)
        if on_variant is not None:
            on_variant(rows, copy_bw)
    _finish(rows, opts, copy_bw)
    return rows


def _finish(rows: list[dict], opts: Options, copy_bw: float) -> None:
    add_ratios(rows)
    add_roofline(rows, copy_bw)
    add_musts(rows, opts.shape, opts.layers)
    if moe_model.is_moe(opts.shape):
        add_moe_ratios(rows)


# ------------------------------------------------------------------------------ command line
def register(p) -> None:
    """Arguments of `lowbit bench model`."""
    d = Options()
    p.add_argument("--shape", choices=list(llama.SHAPES) + list(moe_model.SHAPES), default=d.shape,
                   help="8b: Llama-3-8B layers, 1b: Llama-3.2-1B, smollm2: SmolLM2-135M, tiny: a CPU dry run; "
                        "MoE: mixtral (Mixtral-8x7B layers), qwen3-30b-a3b (Qwen3-30B-A3B), tiny-mixtral and "
                        "tiny-qwen3-moe (CPU dry runs)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 32: full depth; 2 for MoE shapes)")
    p.add_argument("--recipes", default=None, metavar="A,B,...",
                   help="lowbit recipes (RECIPE+lm_head=int8|fp8|w4a16: with the quantized LM head; RECIPE+native: "
                        "with lowbit's native sm_90a decode kernels) and "
                        f"{' / '.join(TORCHAO)} to run (default: every recipe and torchao's); the baseline always runs")
    p.add_argument("--modes", default=None, metavar="M,M",
                   help=f"of {', '.join(MODES)} (default: all): eager, torch.compile's default mode, its "
                        "reduce-overhead mode (CUDA graphs, decode only)")
    p.add_argument("--no-compile", action="store_true", help="eager rows only (--modes eager)")
    p.add_argument("--compile-backend", default=None, metavar="NAME",
                   help="torch.compile backend (default inductor; aot_eager for a CPU dry run without a C++ compiler)")
    p.add_argument("--quick", action="store_true",
                   help="prefill 512, context 128, decode batch 1 only, 15 s per variant (a smoke run)")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help=f"seconds per non-baseline variant (default {DEFAULT_BUDGET:.0f}, --quick 15; with --time-limit: "
                        "at most an equal share of the time left, and that share without --budget)")
    p.add_argument("--loop-budget", type=float, default=None, metavar="S",
                   help="MoE shapes: seconds for the compiled rows of transformers' expert loop (default: --budget; "
                        "0 runs its eager rows only)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="seconds for the whole run: variants not started by then are skipped (default: none)")
    p.add_argument("--dtype", choices=list(DTYPES), default=d.dtype, help="the baseline's dtype")
    p.add_argument("--device", default=d.device, help="cuda (default) or cpu: a dry run of the plumbing")
    p.add_argument("--seed", type=int, default=d.seed, help="weights and prompts (default %(default)s)")
    p.add_argument("--prefill", type=int, default=None, metavar="T", help=f"prefill tokens (default {d.prefill})")
    p.add_argument("--context", type=int, default=None, metavar="T",
                   help=f"tokens in the KV cache before the timed decode step (default {d.context})")
    p.add_argument("--batches", default=None, metavar="B,B",
                   help=f"decode batch sizes (default {','.join(map(str, d.batches))})")
    p.add_argument("--error-tokens", type=int, default=None, metavar="T",
                   help=f"prompt length of the logits' relative error (default {d.error_tokens})")
    p.add_argument("--json", metavar="PATH", default=None, help="write the rows and the environment as JSON")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG (needs matplotlib)")


def options_from_args(args) -> Options:
    kw = dict(shape=args.shape, layers=args.layers, dtype=args.dtype, device=args.device, seed=args.seed)
    if args.no_compile and args.modes:
        raise ValueError("--no-compile means --modes eager: give one of them")
    if args.no_compile or args.modes:
        kw["modes"] = check_modes(("eager",) if args.no_compile else
                                  tuple(m.strip() for m in args.modes.split(",") if m.strip()))
    if args.compile_backend:
        kw["compile_backend"] = args.compile_backend
    if args.recipes:
        kw["variants"] = tuple(x.strip() for x in args.recipes.split(",") if x.strip())
    for name in ("prefill", "context", "budget", "loop_budget", "error_tokens", "time_limit"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.batches:
        try:
            kw["batches"] = tuple(int(b) for b in args.batches.split(","))
        except ValueError:
            raise ValueError(f"--batches={args.batches!r}: give comma-separated integers, e.g. 1,16") from None
    return Options.quick_run(**kw) if args.quick else Options(**kw)


def environment(opts: Options) -> dict:
    env = base_env()
    from importlib import metadata
    for dist in ("transformers", "torchao"):   # versions without importing (torchao takes seconds)
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    env["options"] = {k: v for k, v in vars(opts).items() if k != "log"}
    env["tuning"] = tuning.active()[1]   # which table chose the kernel paths (or why none did)
    if any(parse_variant(v).native for v in opts.variants):
        env["native_library"] = native_library.status()   # the file the +native rows loaded, or why none
    if moe_model.is_moe(opts.shape):
        env["moe_shape"] = moe_model.SHAPES[opts.shape]
        env["torch_grouped_mm"] = moe_model.grouped_mm_op() is not None
    return env


def main(args) -> int:
    """`lowbit bench model`: rows as they come, the table last; 1 if the baseline did not run."""
    opts = options_from_args(args)
    report = moe_report if moe_model.is_moe(opts.shape) else model_report
    check_variants(opts.variants, moe_model.is_moe(opts.shape))
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        print("lowbit bench model: no CUDA GPU here; the benchmark times a model on the GPU "
              "(--device cpu runs the plumbing, with meaningless times).", file=sys.stderr)
        return 2
    env = environment(opts)

    def write_json(rows: list[dict], copy_bw: float | None = None) -> None:
        if copy_bw is not None:
            env["copy_bw"] = copy_bw
        if args.json:
            write_run(args.json, env, rows)

    rows = run_bench(opts, on_variant=write_json)
    write_json(rows)
    notes = []
    if args.json:
        print(f"# wrote {args.json}")
    if args.plot:
        try:
            report.plot(rows, args.plot)
            print(f"# wrote {args.plot}")
        except ImportError as exc:  # matplotlib is optional on the GPU machine
            notes.append(f"# no plot ({exc}); redraw later: python -m {report.__name__} JSON PNG")
    print("\n# lowbit bench model")
    print(report.table(rows))
    for n in notes:
        print(n)
    print(model_report.targets(rows, opts.shape, opts.layers))
    return 1 if any(r["kind"] == "baseline" and r["ms"] is None for r in rows) else 0


def run(only: str | None = None, quick: bool = False, log=print) -> list[dict]:
    """The `lowbit bench` hook: the default model run (8b, 32 layers; --quick as above); `only`
    keeps the variants whose name contains one of its comma-separated parts."""
    variants = tuple(v for v in all_variants() if only is None or any(o in v for o in only.split(",")))
    if not variants:
        return []
    opts = (Options.quick_run if quick else Options)(variants=variants, log=log)
    rows = run_bench(opts)
    log(model_report.table(rows))
    return rows
