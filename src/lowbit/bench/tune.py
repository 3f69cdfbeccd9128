"""`lowbit tune`: time every path of every prepared layer kind at a model's shapes on this GPU and
write the tuning table dispatch reads (lowbit.ops.tuning).

For each recipe, Linear shape and M bucket it times, as CUDA-graph replays (GPU time, the same
measure for every candidate), bf16 `F.linear` and each candidate path of the quantized layer:
  weight-only and emulated kinds (W4A16, W8A16, fp4, MXFP8)  the kernel, and the weight dequantized
                                                              into the scratch buffer + bf16 GEMM;
  W8A8 int8 / fp8                                             the kernel under its default tiles and
                                                              the alternatives in W8A8_TILES; fp8 at
                                                              prefill sizes also torch._scaled_mm and
                                                              lowbit's CUTLASS GEMM (its precise tiles);
  the native decode kernels (sm_90a, where the library runs)  each launch variant of NATIVE_VARIANTS
                                                              against the layer's Triton path (tune_native).
Grouped MoE GEMMs (tune_grouped) are timed against torch._grouped_mm over bf16 weights, per recipe
(each grouped kernel with the weight format it runs: int4 g128 / g32 / zero points, MXFP4, NVFP4 get
cells of their own): the kernel under its candidate configurations and, for the weight-only kinds,
the bf16 path (the experts' weights dequantized into the scratch buffer, then torch._grouped_mm).
A candidate whose output strays from the default path's (a broken configuration) is dropped
before it can win. The fastest remaining candidate is the cell's path; its ratio to bf16 is
recorded, so a cell below 1.0x says that no lowbit path beat bf16 there.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lowbit.bench.attention import quantized_cache
from lowbit.nn import QuantLinear
from lowbit.ops import attention as attn
from lowbit.ops import attention_reference as ar
from lowbit.ops import prepared as runtime
from lowbit.ops import tuning
from lowbit.ops.grouped_configs import WEIGHT_ONLY, grouped_candidates, m_bucket
from lowbit.ops.grouped_dequant import grouped_bf16_refusal
from lowbit.ops.grouped_tune import grouped_bf16_case, grouped_case
from lowbit.ops.kernels.attention import ATTENTION
from lowbit.ops.kernels.grouped import grouped_kernel
from lowbit.ops.kernels.dense import prepared_class
from lowbit.ops.kernels.dense_w8 import CutlassW8A8Fp8, ScaledMMW8A8Fp8
from lowbit.ops.kernels.native import native_refusal, opted_in
from lowbit.ops.native.prefill import ROWWISE_CONFIGS
from lowbit.profiling.timing import bench_ms
from lowbit.workflows.job import parse_recipe

# Llama-3-8B's Linear shapes as lowbit runs them: q/k/v and gate/up merged (lowbit.nn.shared_input)
SHAPES = {"8b": (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)),
          "tiny": (("a", 256, 384), ("b", 512, 256))}
RECIPES = ("w4a16", "w8a16-int8", "w8a8-int8", "w8a8-fp8")


def _cfg(bm, bn, bk, warps, stages):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


# W8A8 tile alternatives per bucket (the default is lowbit.ops.triton.common.pick_config's): decode
# reads the weights once, so BLOCK_N and BLOCK_K trade programs in flight against loads per program; at
# decode sizes also the one-launch kernel (W8A8_FUSED), which saves the activation quantizer's launch
def _fused(bn, bk, warps, stages):
    """A one-launch W8A8 decode configuration (lowbit.ops.triton.gemm_w8a8_small: the per-token quantization
    in the GEMM's prologue)."""
    return dict(FUSED_QUANT=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


W8A8_FUSED = [_fused(32, 128, 4, 4), _fused(64, 128, 4, 4), _fused(32, 256, 4, 3), _fused(64, 256, 8, 3)]
W8A8_TILES = {
    "1": [_cfg(16, 32, 512, 4, 3), _cfg(16, 64, 128, 4, 6), _cfg(16, 128, 128, 4, 4), _cfg(16, 32, 128, 2, 8),
          _cfg(16, 64, 256, 8, 4)] + W8A8_FUSED,
    "2-16": [_cfg(16, 32, 512, 4, 3), _cfg(16, 64, 128, 4, 6), _cfg(16, 128, 128, 4, 4), _cfg(16, 64, 256, 8, 4)]
    + W8A8_FUSED,
    "17-64": [_cfg(32, 64, 256, 4, 4), _cfg(64, 64, 128, 4, 4), _cfg(64, 128, 128, 4, 4)],
    "65-512": [_cfg(64, 128, 128, 4, 4), _cfg(128, 128, 128, 8, 3), _cfg(128, 64, 128, 4, 4)],
    "513+": [],
}


# buckets where the fp8 W8A8 kind also times its prefill paths (lowbit.ops.kernels.dense_w8: torch._scaled_mm row-wise
# and lowbit's CUTLASS GEMM under each precise tile configuration)
FP8_PREFILL_BUCKETS = ("65-512", "513+")


def fp8_prefill_candidates() -> list[tuple[str, dict | None]]:
    """The fp8 class's prefill paths this machine can run: ("scaled_mm", None), ("cutlass", {"config": i}) for the
    CUTLASS configurations that promote the accumulator (the fast-accumulation ones change the arithmetic)."""
    cands = [("scaled_mm", None)] if ScaledMMW8A8Fp8.usable() is None else []
    if CutlassW8A8Fp8.usable() is None:
        cands += [("cutlass", {"config": i}) for i, c in enumerate(ROWWISE_CONFIGS) if not c.fast_accum]
    return cands


def candidates(kind: str, bucket: str) -> list[tuple[str, dict | None]]:
    """The (path, config) pairs `lowbit tune` times for a layer kind in an M bucket."""
    if kind.startswith("w8a8/"):
        cands = [("kernel", None)] + [("kernel", c) for c in W8A8_TILES[bucket]]
        if kind == "w8a8/fp8_e4m3fn" and bucket in FP8_PREFILL_BUCKETS:
            cands += fp8_prefill_candidates()
        return cands
    return [("kernel", None), ("dequant", None)]


def _label(path, cfg) -> str:
    if cfg is None:
        return path
    if isinstance(cfg, dict) and "BLOCK_M" in cfg:
        return f"{path}:" + "/".join(str(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
    if isinstance(cfg, dict):    # a native launch variant, a fused W8A8 configuration
        return f"{path}:" + ",".join(f"{k}={v}" for k, v in cfg.items())
    return f"{path}:{cfg}"   # GroupedConfig / PrefillConfig: their own short names


def _time_candidates(cands, make_call, tol: float, where: str, log) -> tuple[dict, tuple | None]:
    """Time each (path, config) candidate's call (make_call(path, config) -> a no-argument callable) as
    a CUDA-graph replay. A candidate whose output strays more than tol (relative L2) from the first
    candidate's -- a broken configuration -- or that fails to build is logged and skipped. Returns
    ({label: microseconds}, (microseconds, path, config) of the fastest, or None)."""
    us, best, ref = {}, None, None
    for path, cfg in cands:
        label = _label(path, cfg)
        try:
            call = make_call(path, cfg)
            y = call().float()
            if ref is None:
                ref = y
            elif (y - ref).norm() > tol * ref.norm():
                log(f"  {where} {label}: output strays from the first candidate's; dropped")
                continue
            t = _graph_us(call)
        except Exception as err:  # noqa: BLE001 -- a configuration that fails to build is a row, not the end
            log(f"  {where} {label}: {type(err).__name__}: {str(err)[:120]}")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            continue
        us[label] = round(t, 2)
        if best is None or t < best[0]:
            best = (t, path, cfg)
    return us, best


def _graph_us(fn, reps: int = 50) -> float:
    """Median GPU microseconds of fn() replayed from a CUDA graph (warmed up outside it)."""
    return bench_ms(lambda: fn(), [()], cuda_graph=True, warmup=10, rep=reps) * 1e3


def _layers(shape: str, recipes, device: str, native: bool = False):
    """(shape name, K, N, the bf16 Linear, recipe, its QuantLinear, a generator) for each Linear shape and
    recipe, the weights drawn once per shape; quantized with the native classes opted in (native) or out (the
    Triton classes the linear cells are for, whatever LOWBIT_NATIVE says). The generator drops its reference
    and empties the CUDA cache before it builds the next."""
    gen = torch.Generator().manual_seed(0)
    for sname, K, N in SHAPES[shape]:
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=gen)
        lin = lin.to(device)
        for name in recipes:
            r = parse_recipe(name)
            with opted_in(native):
                q = QuantLinear.from_linear(lin, r.weight, r.act, backend="kernel").to(device)
            yield sname, K, N, lin, name, q, gen
            del q
            if device == "cuda":
                torch.cuda.empty_cache()


def tune_linear(shape: str = "8b", recipes=RECIPES, buckets=tuning.BUCKET_NAMES, log=print,
                device: str = "cuda") -> list[tuning.Cell]:
    cells = []
    for sname, K, N, lin, name, q, gen in _layers(shape, recipes, device):
        if q.fast_spec is None:
            log(f"  {sname} {name}: no prepared fast path, nothing to tune")
            continue
        spec = q.fast_spec
        kind = tuning.kind_key(spec)
        ops = {n: getattr(q, "fast_" + n) for n in spec.operands}
        for b in buckets:
            M = tuning.BUCKET_M[b]
            x = torch.randn(M, K, dtype=torch.bfloat16, generator=gen).to(device)
            base = _graph_us(lambda: F.linear(x, lin.weight))

            def run_candidate(path, cfg):
                tuning.reset(tuning.Table(tuning.environment(), {
                    ("linear", kind, N, K, b): tuning.Cell("linear", kind, N, K, b, path, cfg)}), "tuning")
                return lambda: runtime.run(spec, x, ops, None)

            us, best = _time_candidates(candidates(kind, b), run_candidate, 2e-2,
                                        f"{sname} {name} M={M}", log)
            us["bf16"] = round(base, 2)
            tuning.reset()
            if best is None:
                continue
            cell = tuning.Cell("linear", kind, N, K, b, best[1], best[2], round(base / best[0], 3), us)
            cells.append(cell)
            log(f"{sname:8s} {kind:20s} M={M:<5d} bf16 {base:8.1f} us  best {best[0]:8.1f} us "
                f"({cell.path}{'' if cell.config is None else ' tiles'})  {cell.ratio:5.2f}x")
    return cells


# Launch variants of the native decode kernels timed per cell (lowbit.ops.native.kernels: each gives the
# default launch's bits): row tiles per CTA, the weight prefetch, and splits with the in-kernel fixup
NATIVE_VARIANTS = ({"prefetch": True}, {"nt": 2}, {"nt": 2, "prefetch": True}, {"nt": 4}, {"splits": 1},
                   {"splits": 2, "fixup": True}, {"splits": 2, "nt": 2, "fixup": True}, {"splits": 4, "fixup": True},
                   {"splits": 4, "nt": 2, "fixup": True, "prefetch": True})


def tune_native(shape: str = "8b", recipes=RECIPES, buckets=tuning.BUCKET_NAMES, log=print, device: str = "cuda",
                linear: dict | None = None) -> list[tuning.Cell]:
    """The native kernels (lowbit.ops.kernels.native) where the native library runs here, at the buckets where
    their GEMV may run (the class's gemv_buckets): each launch variant (a variant whose output is not the default
    launch's, bit for bit, is dropped) against the class's alternative -- the weight-only classes' dequant path
    (their one layout dequantized, the float GEMM), W8A8's Triton class (under `linear`'s cells, the dense part's
    results) -- and bf16. A cell's path is "kernel" (the fastest variant, its config) where that beats the
    alternative, else the alternative; only layers opted in to the native classes read these cells."""
    with opted_in():                       # the opt-in is this function's to give: the library and GPU decide
        why = native_refusal()
    if why is not None:
        log(f"# native decode kernels not tuned: {why}")
        return []
    cells = []
    for sname, K, N, lin, name, q, gen in _layers(shape, recipes, device, native=True):
        spec = q.fast_spec
        if spec is None or not spec.kernel.startswith("native_"):
            log(f"  {sname} {name}: no native kernel ({'no prepared path' if spec is None else spec.kernel})")
            continue
        kind, cls = tuning.kind_key(spec), prepared_class(spec)
        ops = {n: getattr(q, "fast_" + n) for n in spec.operands}
        for b in (b for b in cls.gemv_buckets if b in buckets):
            M = tuning.BUCKET_M[b]
            x = torch.randn(M, K, dtype=torch.bfloat16, generator=gen).to(device)
            kept = {k: c for k, c in (linear or {}).items() if k[1:] == (kind, N, K, b)}

            def install(path, cfg, kept=kept, kind=kind, N=N, K=K, b=b):
                tuning.reset(tuning.Table(tuning.environment(), {
                    **kept, ("native", kind, N, K, b): tuning.Cell("native", kind, N, K, b, path, cfg)}), "tuning")

            def run_candidate(path, cfg, x=x, spec=spec, ops=ops, install=install):
                install(path, cfg)
                return lambda: runtime.run(spec, x, ops, None)

            cands = [("kernel", None)] + [("kernel", v) for v in NATIVE_VARIANTS]
            us, best = _time_candidates(cands, run_candidate, 0.0, f"{sname} {name} native M={M}", log)
            alt = cls.alternative
            t_alt = _graph_us(run_candidate(alt, None))
            base = _graph_us(lambda x=x: F.linear(x, lin.weight))
            tuning.reset()
            us.update({alt: round(t_alt, 2), "bf16": round(base, 2)})
            if best is None:
                continue
            path, t, cfg = ("kernel", best[0], best[2]) if best[0] < t_alt else (alt, t_alt, None)
            cell = tuning.Cell("native", kind, N, K, b, path, cfg, round(base / t, 3), us)
            cells.append(cell)
            log(f"{sname:8s} {kind:20s} M={M:<5d} bf16 {base:8.1f} us  {alt} {t_alt:8.1f} us  native best "
                f"{best[0]:8.1f} us ({_label('kernel', best[2])})  -> {path} {cell.ratio:5.2f}x")
    return cells


# attention prefill is tuned at Llama-3-8B's heads (32 query heads over 8 KV heads, head_dim 128)
# over an fp8 cache with fp8 Q and P, lowbit's default attention recipe
ATTN_HEADS = {"8b": (32, 8, 128), "tiny": (4, 2, 64)}
ATTN_BUCKETS = ("65-512", "513+")
ATTN_T = {"65-512": 256, "513+": 2048}   # tokens timed per bucket (Tq = Tk)


def tune_attention(shape: str = "8b", buckets=ATTN_BUCKETS, log=print, device: str = "cuda") -> list[tuning.Cell]:
    """Prefill attention over an fp8 KV cache (Tq = Tk = the bucket's M): each prefill-kernel tiling,
    the general flash kernel and SDPA over the dequantized cache, against bf16 SDPA."""

    hq, hkv, d = ATTN_HEADS[shape]
    spec = ar.AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn", p_block=64, causal=True)
    gen = torch.Generator(device=device).manual_seed(1)
    cells = []
    for b in buckets:
        if b not in ATTN_BUCKETS:
            continue
        T = ATTN_T[b]
        q, k, v = (torch.randn(1, h, T, d, generator=gen, device=device).to(torch.bfloat16) for h in (hq, hkv, hkv))
        kq, vq = quantized_cache("fp8", k.float(), v.float())
        kind = attn.attention_kind(kq, vq, spec)
        base = _graph_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

        # Q quantized once, outside the timed call (as a model's attention gets it): quantizing it in
        # the call synchronises with the host, which a CUDA-graph capture refuses
        q_vals, q_scale = ar.quantize_q_parts(q, spec.q_format)

        def run_candidate(which, cfg):
            if ATTENTION.get(which).float_queries:    # SDPA over the dequantized cache
                return lambda: attn.attention_triton(q, kq, vq, spec, out_dtype=torch.bfloat16, kernel=which)
            return lambda: attn.attention_triton(q_vals, kq, vq, spec, q_scale=q_scale, out_dtype=torch.bfloat16,
                                                 kernel=which, config=cfg)

        us, best = _time_candidates(attn.prefill_options(d, T, spec.p_block), run_candidate, 5e-2,
                                    f"attention T={T}", log)
        us["bf16"] = round(base, 2)
        if best is None:
            continue
        t, which, cfg = best
        path, config = ATTENTION.get(which).cell(cfg)
        cell = tuning.Cell("attention", kind, d, hq // hkv, b, path, config, round(base / t, 3), us)
        cells.append(cell)
        log(f"attention {kind} T={T}: bf16 SDPA {base:8.1f} us  best {t:8.1f} us ({which})  {cell.ratio:5.2f}x")
    return cells


# grouped MoE GEMMs: (name, E experts, top_k, hidden, intermediate) and the recipes whose grouped
# kernels (each with its weight format: a table cell of its own) are timed
MOE_SHAPES = {"mixtral": ("mixtral", 8, 2, 4096, 14336), "qwen3-30b-a3b": ("qwen3-30b-a3b", 128, 8, 2048, 768),
              "tiny": ("tiny", 4, 2, 256, 128)}
GROUPED_RECIPES = ("w4a16", "w4a16-asym", "w4a16-g32", "mxfp4", "nvfp4", "w8a8-int8", "w8a8-fp8")
MOE_TOKENS = (1, 16, 2048)        # decode b1, decode b16, a prefill chunk: M = tokens x top_k sorted rows
GROUPED_MAX_CANDIDATES = 4


def grouped_candidates_of(kind: str, E: int, N: int, K: int, M: int) -> list[tuple[str, object]]:
    """The (path, config) pairs `lowbit tune` times for a grouped cell: the kernel under its first
    GROUPED_MAX_CANDIDATES configurations (the default first) and, for the weight-only kinds where the
    bf16 path takes bf16 activations of this K here, ("dequant", None)."""
    cands = [("kernel", c) for c in grouped_candidates(kind, E, N, K, m_bucket(M))[:GROUPED_MAX_CANDIDATES]]
    cap = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
    if kind in WEIGHT_ONLY and grouped_bf16_refusal(torch.bfloat16, K, cap) is None:
        cands.append(("dequant", None))
    return cands


def grouped_formats(recipes, E: int, log=print) -> list[tuple]:
    """(grouped kind, 4-bit weight format or None, table key over E experts) of each recipe's grouped
    kernel, one per key (recipes that differ only in activations share a cell), in recipe order."""
    out = {}
    for name in recipes:
        r = parse_recipe(name)
        cls = grouped_kernel(r.weight, r.act)
        if cls is None:
            log(f"  {name}: no grouped kernel (the experts run the exact path), nothing to tune")
            continue
        key = cls.table_key(r.weight, E)
        out.setdefault(key, (cls.kind, cls.weight_format(r.weight), key))
    return list(out.values())


def tune_grouped(moe: str, recipes=GROUPED_RECIPES, log=print, device: str = "cuda") -> list[tuning.Cell]:
    """The grouped MoE GEMMs of a model's gate_up and down projections: per recipe's grouped kernel and
    weight format (grouped_formats) and M bucket, each candidate of grouped_candidates_of (kernel
    configurations; the bf16 path of the weight-only kinds), timed on weights of that format, and
    torch._grouped_mm over bf16 weights; the cell takes the fastest, its ratio against the grouped
    bf16 time (None where this torch has no torch._grouped_mm)."""

    _, E, top_k, H, inter = MOE_SHAPES[moe]
    kinds = grouped_formats(recipes, E, log)
    have_bf16 = getattr(torch, "_grouped_mm", None) is not None
    cells = []
    for proj, N, K, identity in (("gate_up", 2 * inter, H, False), ("down", H, inter, True)):
        for tokens in MOE_TOKENS:
            M = tokens * top_k
            b = tuning.bucket(M)
            base = _graph_us(grouped_bf16_case(E, N, K, M, device, top_k=top_k, identity=identity)) \
                if have_bf16 else None
            for kind, weight, key in kinds:
                def make(path, cfg):
                    return grouped_case(kind, E, N, K, M, cfg, device, top_k=top_k, weight=weight, identity=identity,
                                        path=path)

                us, best = _time_candidates(grouped_candidates_of(kind, E, N, K, M), make, 2e-2,
                                            f"{moe} {proj} {key} M={M}", log)
                if best is None:
                    continue
                t, path, cfg = best
                if base is not None:
                    us["bf16"] = round(base, 2)
                cell = tuning.Cell("grouped", key, N, K, b, path, None if cfg is None else cfg.to_dict(),
                                   None if base is None else round(base / t, 3), us)
                cells.append(cell)
                log(f"{moe:14s} {proj:8s} {key:22s} M={M:<6d} best {t:9.1f} us ({_label(path, cfg)})"
                    + ("" if base is None else f"  {cell.ratio:5.2f}x grouped bf16"))
    return cells


def run_tune(shape: str = "8b", recipes=RECIPES, buckets=tuning.BUCKET_NAMES, log=print,
             moe=("mixtral", "qwen3-30b-a3b"), out=None, moe_recipes=GROUPED_RECIPES) -> tuning.Table:
    """Every part in turn (dense Linears, the native decode kernels where they run, attention prefill,
    each MoE shape's grouped GEMMs of
    `moe_recipes`); with `out`, the table so far is written after each part, so a run stopped by a
    time limit keeps what it measured."""
    if not torch.cuda.is_available():
        raise ValueError("lowbit tune measures kernels on a CUDA GPU; none is visible here (the CPU runs the "
                         "exact paths, which need no table)")
    t0 = time.time()
    table = tuning.Table(tuning.environment(), {})
    parts = [lambda: tune_linear(shape, recipes, buckets, log),
             lambda: tune_native(shape, recipes, buckets, log, linear=dict(table.cells)),
             lambda: tune_attention(shape, buckets, log)]
    parts += [lambda m=m: tune_grouped(m, moe_recipes, log=log) for m in moe]
    for part in parts:
        for c in part():
            table.cells[(c.op, c.kind, c.N, c.K, c.bucket)] = c
        if out is not None:
            tuning.save_table(table, out)
    log(f"# tuned {len(table.cells)} cells in {time.time() - t0:.0f} s")
    return table


def summary(table: tuning.Table) -> str:
    """One line per cell: kind, shape, bucket, path, ratio to bf16 (met / below 1.0x)."""
    lines = [f"# lowbit tune: {table.environment.get('gpu')} (torch {table.environment.get('torch')}, "
             f"triton {table.environment.get('triton')})",
             f"{'kind':24s} {'N x K':>13s} {'M':>7s} {'path':8s} {'vs bf16':>8s}"]
    for c in sorted(table.cells.values(), key=lambda c: (c.kind, c.N, c.K, tuning.BUCKET_NAMES.index(c.bucket))):
        ratio = "" if c.ratio is None else f"{c.ratio:7.2f}x{'' if c.ratio >= 1.0 else ' below'}"
        lines.append(f"{c.kind:24s} {c.N:>6d}x{c.K:<6d} {c.bucket:>7s} {c.path:8s} {ratio}")
    return "\n".join(lines)
