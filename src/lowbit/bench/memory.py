"""Memory-bound kernels next to their baselines, in one process on one GPU:

  copy          x.copy_(y), the bandwidth ceiling every row's `frac_copy` is measured against
  norm_quant    fused RMSNorm (+ residual) + per-token int8 / fp8 (and MXFP8 / MXFP4 / NVFP4)
                vs the unfused function (HF-style RMSNorm to bf16, then per-token quant) in
                eager PyTorch and under torch.compile. Per-token int8 / fp8 rows time both
                kernels of lowbit.ops.fused: `lowbit_<x>` = kernel "row", `lowbit_<x>_tile` =
                kernel "tile" (heuristic tile), `lowbit_<x>_tile_r{ROWS}w{WARPS}` = other tiles
                (norm_quant int8 / fp8 only); tile rows carry vs_row and codes_diff_vs_row
  silu_quant    fused SiLU-and-multiply + per-token int8 / fp8 vs eager / compiled unfused
  quant         standalone dynamic quantization vs eager / compiled
  w4a16         int4 g128 (sym / asym), int4 g32, MXFP4, NVFP4 weight-only decode GEMM vs
                bf16 torch.mm and tinygemm (torch._weight_int4pack_mm, group 128), M in 1, 16, 64
  sparse24      2:4 sparse linear (torch semi-structured, cuSPARSELt) vs dense bf16 linear

Each row: name, shape, ms (median, CUDA-graph replay, operands rotated past the 60 MiB L2),
GB/s = bytes that must move / time (each input read once, each output written once),
frac_copy = GB/s over the copy row's GB/s, and ratios vs_<baseline> = baseline ms / ms
(> 1: faster than the baseline). `check` is a relative L2 difference to a baseline's output,
so a fast wrong kernel shows. Run: python -m lowbit.bench.memory [--quick] [--json PATH].
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from lowbit.bench.common import log as _log, rel_l2 as _rel_l2, environment, write_run
from lowbit.bench.memory_report import plot, sass_report
from lowbit.bench.memory_w4a16 import w4a16_section
from lowbit.ops.fused import default_tile, quantize_rows, rmsnorm_quant, silu_mul_quant
from lowbit.ops.sparse import prepare_2_4, sparse_linear
from lowbit.profiling.timing import bench_ms, rotating_count
from lowbit.scheme import QuantScheme, get_preset
from lowbit.sparsity import prune_2_4

NORM_SHAPES = ((8192, 4096), (8192, 8192))
QUANT_SHAPE = (8192, 4096)
COPY_ELEMS = 512 * 2**20                 # bf16: 1 GiB read + 1 GiB written, far past the L2
SILU_SHAPES = ((8192, 14336),)           # tokens, intermediate size (input is [T, 2H])
SPARSE_SHAPES = ((8192, 8192, 8192), (2048, 14336, 4096), (2048, 4096, 14336), (16, 14336, 4096))
EPS = 1e-6
DEV = "cuda"  # the device every operand lives on (a CPU dry run of the plumbing sets "cpu")


class _Bench:
    """Collects rows; times with the shared timer inside CUDA graphs."""

    def __init__(self, only: str | None):
        self.only, self.rows, self.copy_gbps = only, [], None

    def wanted(self, name: str) -> bool:
        return self.only is None or any(o in name for o in self.only.split(","))

    def time(self, name: str, shape: str, fn, inputs, nbytes: float, **extra) -> dict | None:
        try:
            ms = bench_ms(fn, inputs, cuda_graph=True)
        except Exception as exc:  # a baseline PyTorch lacks here is reported, not hidden
            row = dict(name=name, shape=shape, ms=None, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            self.rows.append(row)
            _log(f"  {name:34s} {shape:>22s}  unavailable: {row['error']}")
            return row
        gbps = nbytes / ms / 1e6
        row = dict(name=name, shape=shape, ms=ms, GBps=gbps, bytes=int(nbytes), **extra)
        if self.copy_gbps:
            row["frac_copy"] = gbps / self.copy_gbps
        self.rows.append(row)
        _log(f"  {name:34s} {shape:>22s} {ms * 1e3:9.1f} us {gbps:8.0f} GB/s"
             + (f" {100 * row['frac_copy']:5.1f}% copy" if "frac_copy" in row else ""))
        return row

    @staticmethod
    def ratios(row: dict | None, bases: dict[str, dict | None]) -> None:
        if not row or not row.get("ms"):
            return
        for bname, b in bases.items():
            if b and b.get("ms"):
                row[f"vs_{bname}"] = b["ms"] / row["ms"]


# ------------------------------------------------------------------------------------------
# Unfused baselines, as a user writes them (HF LlamaRMSNorm, then per-token quantization)
# ------------------------------------------------------------------------------------------
def _rmsnorm_hf(x, w, r=None):
    if r is not None:
        x = x + r
        r = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype), r


def _quant_token(y, fmt: str):
    yf = y.float()
    qmax = 127.0 if fmt == "int8" else 448.0
    s = yf.abs().amax(-1, keepdim=True) / qmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    if fmt == "int8":
        return torch.round(yf / s).clamp(-127, 127).to(torch.int8), s
    return (yf / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def _norm_quant_unfused(fmt):
    def f(x, w, r=None):
        y, r2 = _rmsnorm_hf(x, w, r)
        return _quant_token(y, fmt), r2
    return f


def _silu_quant_unfused(fmt):
    def f(x):
        H = x.shape[-1] // 2
        y = torch.nn.functional.silu(x[..., :H]) * x[..., H:]
        return _quant_token(y, fmt)
    return f


def _quant_unfused(fmt):
    return lambda x: _quant_token(x, fmt)


def _deq(q, s):
    return q.float() * s


# ------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------
def _warm_up(seconds: float = 2.0) -> None:
    """Run matrix products until the clocks have left idle (straight after start the copy runs
    below what later kernels reach, which would flatter every row's frac_copy)."""
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t = time.time()
    while time.time() - t < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize() if DEV == "cuda" else None


def _triton_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    import triton

    from lowbit.ops.triton.fused_quant import copy_kernel    # optional: triton

    n = src.numel()
    copy_kernel[(triton.cdiv(n, 8192),)](src, dst, n, BLOCK=8192, num_warps=8)


def _copy(b: _Bench, name: str = "copy") -> None:
    """The ceiling: the faster of torch's copy_ and a plain vectorized Triton copy (torch's copy_
    alone can be slower than the fused kernels here, which would put them above 100%)."""
    n = COPY_ELEMS
    src = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    row = b.time(name, f"{2 * n >> 20} MiB", lambda: dst.copy_(src), [()], 4.0 * n)
    rows = [row]
    if DEV == "cuda":
        rows.append(b.time(name + "_triton", f"{2 * n >> 20} MiB", lambda: _triton_copy(dst, src), [()], 4.0 * n))
    best = max((r.get("GBps") or 0.0) for r in rows)
    if b.copy_gbps is None:
        b.copy_gbps = best
        for r in rows:
            if r.get("GBps"):
                r["frac_copy"] = r["GBps"] / best


def _tile_variants(K: int, pre: int, quick: bool, scheme, residual: bool = False,
                   persist: bool = False) -> list[tuple[str, tuple[int, ...] | None]]:
    """Row-name suffixes and tiles of the fused quantizer's "tile" kernel: "_tile" = its heuristic
    (fused.default_tile for `scheme`), then "_tile_r{ROWS}w{WARPS}" for 32 / 64 elements per thread with one row
    per program and 64 with two rows (16 per thread is the "row" kernel's shape), so a run shows
    which configuration to make the default. Each new tile is one more Triton compile (~1-2 s)."""
    heur = tuple(default_tile(scheme, K, pre, residual)[:2])  # (a third entry: the persistent form's programs per SM)
    out, seen = [("_tile", None)], {heur}
    for R, W in ((1, K // 1024), (1, K // 2048), (2, K // 1024)):
        t = (R, max(1, min(16, W)))
        if not quick and t not in seen:
            seen.add(t)
            out.append((f"_tile_r{t[0]}w{t[1]}", t))
    if persist:  # the per-token kernel's persistent form: P programs per SM, each prefetching its next tile
        out += [(f"_tile_p{P}", heur + (P,)) for P in (2, 3, 4)]
    return out


def _time_tiles(b: _Bench, stem: str, shape: str, K: int, pre: int, quick: bool, scheme, make, sets, nbytes,
                bases: dict, row_out, out_of, residual: bool = False, persist: bool = False) -> None:
    """Time the "tile" kernel's variants next to the "row" kernel's row (`bases["row"]`); `make(tile)`
    returns the timed function, `out_of(result)` the QTensor; `codes_diff_vs_row` is the fraction of
    its codes that differ from the row kernel's `row_out` on the same input (same arithmetic; only
    a last-bit difference of y from another summation order of the RMSNorm may flip a rounding,
    so this is 0 or tiny; tests/ops/test_fused_quant.py checks both kernels against lowbit.quantize)."""
    for suffix, tile in _tile_variants(K, pre, quick, scheme, residual, persist):
        fn = make(tile)
        r = b.time(f"{stem}{suffix}", shape, fn, sets, nbytes, kernel="tile",
                   tile=list(tile) if tile else "heuristic (fused.tile_config)")
        b.ratios(r, bases)
        if r and r.get("ms"):
            r["codes_diff_vs_row"] = float((out_of(fn(*sets[0])).codes != row_out.codes).float().mean())


def _group_tiles(b: _Bench, stem: str, shape: str, K: int, pre: int, quick: bool, sch, sets, nbytes: float,
                 r_row: dict | None, row_fn, call, out_of) -> None:
    """Group-scaled schemes (MX, NVFP4): the "tile" kernel's group variant next to the "row" kernel
    (`call(scheme, **kwargs)` returns the timed function), and for fp4 the same with the codes
    packed two per byte ("_packed": half a byte per element written, counted as such)."""
    _time_tiles(b, stem, shape, K, pre, quick, sch, lambda t: call(sch, kernel="tile", tile=t), sets, nbytes,
                {"row": r_row}, out_of(row_fn(*sets[0])), out_of)
    if sch.two_level:  # NVFP4 with a calibrated tensor scale (compressed-tensors' input_global_scale): one pass
        g = out_of(row_fn(*sets[0])).global_scale.reshape(1).contiguous()
        r = b.time(f"{stem}_static_g", shape, call(sch, global_scale=g), sets, nbytes, kernel="tile",
                   global_scale="given")
        b.ratios(r, {"row": r_row})
    if sch.format == "fp4_e2m1fn":
        T = sets[0][0].shape[0]
        r = b.time(f"{stem}_packed", shape, call(sch, pack=True), sets, nbytes - T * K // 2, kernel="tile",
                   packed=True)
        b.ratios(r, {"row": r_row})


def _norm_quant(b: _Bench, quick: bool) -> None:
    schemes = {"int8": get_preset("int8_token"), "fp8": QuantScheme("fp8_e4m3fn", "token", dynamic=True)}
    for (T, K) in NORM_SHAPES[:1] if quick else NORM_SHAPES:
        shape = f"{T}x{K}"
        n = rotating_count(T * K * 2)
        sets = [(torch.randn(T, K, device=DEV, dtype=torch.bfloat16) * 2,
                 (1 + 0.1 * torch.randn(K, device=DEV)).to(torch.bfloat16)) for _ in range(n)]
        for fmt, sch in schemes.items():
            if not b.wanted(f"norm_quant_{fmt}"):
                continue
            nbytes = T * K * 2 + K * 2 + T * K * 1 + T * 4
            fused = lambda x, w, s=sch: rmsnorm_quant(x, w, EPS, s, check_finite=False, kernel="row")  # noqa: E731
            base = _norm_quant_unfused(fmt)
            comp = torch.compile(base, dynamic=False)
            r_l = b.time(f"lowbit_norm_quant_{fmt}", shape, fused, sets, nbytes, kernel="row")
            r_e = b.time(f"eager_norm_quant_{fmt}", shape, base, sets, nbytes)
            r_c = b.time(f"compile_norm_quant_{fmt}", shape, comp, sets, nbytes)
            b.ratios(r_l, {"eager": r_e, "compile": r_c})
            x, w = sets[0]
            qt, _ = fused(x, w)
            (q, s), _ = base(x, w)
            if r_l and r_l.get("ms"):
                r_l["check"] = _rel_l2(qt.dequantize(), _deq(q, s))
            _time_tiles(b, f"lowbit_norm_quant_{fmt}", shape, K, 1, quick, sch,
                        lambda t, s=sch: lambda x, w: rmsnorm_quant(x, w, EPS, s, check_finite=False, kernel="tile",
                                                                    tile=t),
                        sets, nbytes, {"eager": r_e, "compile": r_c, "row": r_l}, qt, lambda o: o[0], persist=True)
        if b.wanted("norm_quant_res_int8"):
            sets_r = [(x, w, torch.randn_like(x)) for x, w in sets]
            nbytes = T * K * 2 * 2 + K * 2 + T * K * 2 + T * K + T * 4
            sch = schemes["int8"]
            fused = lambda x, w, r: rmsnorm_quant(x, w, EPS, sch, residual=r, check_finite=False,  # noqa: E731
                                                  kernel="row")
            base = _norm_quant_unfused("int8")
            comp = torch.compile(base, dynamic=False)
            r_l = b.time("lowbit_norm_quant_res_int8", shape, fused, sets_r, nbytes, kernel="row")
            r_e = b.time("eager_norm_quant_res_int8", shape, base, sets_r, nbytes)
            r_c = b.time("compile_norm_quant_res_int8", shape, comp, sets_r, nbytes)
            b.ratios(r_l, {"eager": r_e, "compile": r_c})
            _time_tiles(b, "lowbit_norm_quant_res_int8", shape, K, 1, True, sch,  # heuristic tile only
                        lambda t: lambda x, w, r: rmsnorm_quant(x, w, EPS, sch, residual=r, check_finite=False,
                                                                kernel="tile", tile=t),
                        sets_r, nbytes, {"eager": r_e, "compile": r_c, "row": r_l}, fused(*sets_r[0])[0],
                        lambda o: o[0], residual=True, persist=True)
        for name in ("mxfp8", "mxfp4", "nvfp4"):
            if not b.wanted(f"norm_quant_{name}") or (quick and name != "mxfp8"):
                continue
            sch = get_preset(name)
            g = sch.group_size
            # codes are unpacked (one byte per element, QTensor's layout) plus one scale byte
            # per group and the float32 effective scale per group
            nbytes = T * K * 2 + K * 2 + T * K + T * (K // g) * 5
            fused = lambda x, w, s=sch: rmsnorm_quant(x, w, EPS, s, check_finite=False, kernel="row")  # noqa: E731
            r_l = b.time(f"lowbit_norm_quant_{name}", shape, fused, sets, nbytes, kernel="row")
            _group_tiles(b, f"lowbit_norm_quant_{name}", shape, K, 1, quick, sch, sets, nbytes, r_l, fused,
                         lambda s, **kw: lambda x, w: rmsnorm_quant(x, w, EPS, s, check_finite=False, **kw),
                         lambda o: o[0])
        del sets


def _silu_quant(b: _Bench, quick: bool) -> None:
    schemes = {"int8": get_preset("int8_token"), "fp8": QuantScheme("fp8_e4m3fn", "token", dynamic=True)}
    for (T, H) in SILU_SHAPES:
        T = T // 4 if quick else T
        shape = f"{T}x2x{H}"
        n = rotating_count(T * 2 * H * 2)
        sets = [(torch.randn(T, 2 * H, device=DEV, dtype=torch.bfloat16),) for _ in range(n)]
        for fmt, sch in schemes.items():
            if not b.wanted(f"silu_quant_{fmt}"):
                continue
            nbytes = T * 2 * H * 2 + T * H + T * 4
            fused = lambda x, s=sch: silu_mul_quant(x, s, check_finite=False, kernel="row")  # noqa: E731
            base = _silu_quant_unfused(fmt)
            comp = torch.compile(base, dynamic=False)
            r_l = b.time(f"lowbit_silu_quant_{fmt}", shape, fused, sets, nbytes, kernel="row")
            r_e = b.time(f"eager_silu_quant_{fmt}", shape, base, sets, nbytes)
            r_c = b.time(f"compile_silu_quant_{fmt}", shape, comp, sets, nbytes)
            b.ratios(r_l, {"eager": r_e, "compile": r_c})
            qt = fused(sets[0][0])
            if r_l and r_l.get("ms"):
                r_l["check"] = _rel_l2(qt.dequantize(), _deq(*base(sets[0][0])))
            _time_tiles(b, f"lowbit_silu_quant_{fmt}", shape, H, 2, True, sch,
                        lambda t, s=sch: lambda x: silu_mul_quant(x, s, check_finite=False, kernel="tile", tile=t),
                        sets, nbytes, {"eager": r_e, "compile": r_c, "row": r_l}, qt, lambda o: o)
        del sets


def _quant(b: _Bench, quick: bool) -> None:
    T, K = QUANT_SHAPE
    shape = f"{T}x{K}"
    n = rotating_count(T * K * 2)
    sets = [(torch.randn(T, K, device=DEV, dtype=torch.bfloat16),) for _ in range(n)]
    for fmt in ("int8", "fp8", "mxfp8", "mxfp4", "nvfp4"):
        if not b.wanted(f"quant_{fmt}") or (quick and fmt in ("mxfp4", "nvfp4")):
            continue
        if fmt in ("int8", "fp8"):
            sch = get_preset("int8_token") if fmt == "int8" else QuantScheme("fp8_e4m3fn", "token")
            nbytes = T * K * 2 + T * K + T * 4
        else:
            sch = get_preset(fmt)
            nbytes = T * K * 2 + T * K + T * (K // sch.group_size) * 5
        fused = lambda x, s=sch: quantize_rows(x, s, check_finite=False, kernel="row")  # noqa: E731
        r_l = b.time(f"lowbit_quant_{fmt}", shape, fused, sets, nbytes, kernel="row")
        if fmt not in ("int8", "fp8"):
            _group_tiles(b, f"lowbit_quant_{fmt}", shape, K, 0, quick, sch, sets, nbytes, r_l, fused,
                         lambda s, **kw: lambda x: quantize_rows(x, s, check_finite=False, **kw), lambda o: o)
        if fmt in ("int8", "fp8"):
            base = _quant_unfused(fmt)
            r_e = b.time(f"eager_quant_{fmt}", shape, base, sets, nbytes)
            r_c = b.time(f"compile_quant_{fmt}", shape, torch.compile(base, dynamic=False), sets, nbytes)
            b.ratios(r_l, {"eager": r_e, "compile": r_c})
            _time_tiles(b, f"lowbit_quant_{fmt}", shape, K, 0, True, sch,
                        lambda t, s=sch: lambda x: quantize_rows(x, s, check_finite=False, kernel="tile", tile=t),
                        sets, nbytes, {"eager": r_e, "compile": r_c, "row": r_l}, fused(sets[0][0]), lambda o: o,
                        persist=True)
    del sets


def _w4a16(b: _Bench, quick: bool, sweep: bool = True) -> None:
    """W4A16 rows: lowbit/bench/memory_w4a16.py (default kernel and "gemv8" side by side)."""
    w4a16_section(b, quick, sweep, dev=DEV)


def _sparse24(b: _Bench, quick: bool) -> None:
    if not b.wanted("sparse24"):
        return
    for (M, N, K) in SPARSE_SHAPES[:1] if quick else SPARSE_SHAPES:
        shape = f"M{M} N{N} K{K}"
        w = prune_2_4(torch.randn(N, K, device=DEV) * 0.02).to(torch.bfloat16)
        sw = prepare_2_4(w)
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        flops = 2.0 * M * N * K
        io = M * K * 2 + M * N * 2
        r_d = b.time("dense_linear_bf16", shape, lambda x, w: torch.nn.functional.linear(x, w), [(x, w)], N * K * 2 + io)
        r_s = b.time(f"lowbit_sparse24_{sw.backend}", shape, lambda x: sparse_linear(x, sw), [(x,)],
                     N * K + N * K // 8 + io)
        for r in (r_d, r_s):
            if r and r.get("ms"):
                r["TFLOPs_dense_equiv"] = flops / r["ms"] / 1e9
        b.ratios(r_s, {"dense": r_d})
        if r_s and r_s.get("ms"):
            r_s["check"] = _rel_l2(sparse_linear(x, sw), torch.nn.functional.linear(x, w))
        if (M, N, K) == SPARSE_SHAPES[0]:
            fp8_probe = (x, w, shape, r_d)
    if b.wanted("sparse24"):  # last: a failing cuSPARSELt fp8 call must not disturb other rows
        _sparse24_fp8(b, *fp8_probe)


def _sparse24_fp8(b: _Bench, x, w, shape, r_dense) -> None:
    """Optional fp8 2:4 through cuSPARSELt (torch._cslt_*), if this PyTorch supports it."""
    try:
        wf = w.to(torch.float8_e4m3fn)
        comp = torch._cslt_compress(wf)
        xf = x.to(torch.float8_e4m3fn)
        fn = lambda xf: torch._cslt_sparse_mm(comp, xf.t(), out_dtype=torch.bfloat16)  # noqa: E731
        out = fn(xf).t()
        chk = _rel_l2(out, torch.mm(xf.to(torch.bfloat16), wf.to(torch.bfloat16).t()))
    except Exception as exc:  # noqa: BLE001 -- reported as unsupported, never hidden
        b.rows.append(dict(name="sparse24_fp8_cslt", shape=shape, ms=None,
                           error=f"unsupported here: {type(exc).__name__}: {str(exc)[:160]}"))
        _log(f"  sparse24_fp8_cslt unsupported: {type(exc).__name__}: {str(exc)[:160]}")
        return
    r = b.time("sparse24_fp8_cslt", shape, fn, [(xf,)], x.numel() + w.numel() // 2 + w.numel() // 8
               + x.shape[0] * w.shape[0] * 2, check=chk)
    b.ratios(r, {"dense": r_dense})


_PARTIAL_JSON: str | None = None
SECTIONS = (("norm_quant", _norm_quant), ("silu_quant", _silu_quant), ("quant", _quant),
            ("w4a16", _w4a16), ("sparse24", _sparse24))


def run(only: str | None = None, quick: bool = False) -> list[dict]:
    """All rows (see module docstring). `only` keeps entries whose name contains it (a section
    name such as 'w4a16' selects that section); the copy row always runs."""
    if DEV == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("lowbit.bench.memory times GPU kernels; no CUDA device here")
    import traceback

    b = _Bench(only)
    _warm_up()
    _copy(b)
    for sec, fn in SECTIONS:
        if only is not None and not any(o in sec or any(o in n for n in _names(sec)) for o in only.split(",")):
            continue
        t = time.time()
        _log(f"# {sec}")
        try:
            fn(b, quick)
        except Exception as exc:  # noqa: BLE001 -- one broken section must not lose the others' rows
            traceback.print_exc()
            b.rows.append(dict(name=f"{sec}_error", shape="-", ms=None, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
        torch.cuda.empty_cache()
        _log(f"#   ({time.time() - t:.0f} s)")
        if _PARTIAL_JSON:  # rows so far, in case the run is stopped at its time limit
            with open(_PARTIAL_JSON, "w") as f:
                json.dump(dict(partial=True, rows=b.rows), f, indent=1, default=str)
    _copy(b, "copy_again")  # the ceiling measured once more at the end: clocks, thermal drift
    print_table(b.rows)
    return b.rows


def _names(sec: str) -> tuple[str, ...]:
    return {"norm_quant": ("norm_quant_int8", "norm_quant_fp8", "norm_quant_res_int8", "norm_quant_mxfp8",
                           "norm_quant_mxfp4", "norm_quant_nvfp4"),
            "silu_quant": ("silu_quant_int8", "silu_quant_fp8"),
            "quant": ("quant_int8", "quant_fp8", "quant_mxfp8", "quant_mxfp4", "quant_nvfp4"),
            "w4a16": ("w4a16_int4_g128", "w4a16_int4_g128_asym", "w4a16_int4_g32", "w4a16_mxfp4", "w4a16_nvfp4"),
            "sparse24": ("sparse24",)}[sec]


def print_table(rows: list[dict]) -> None:
    """Short table: lowbit rows with their bandwidth and ratios."""
    print("\n# memory-bound kernels (GB/s = bytes that must move / time; ratio = baseline ms / lowbit ms)")
    print(f"{'kernel':36s} {'shape':>22s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s}  ratios")
    for r in rows:
        if not (r["name"].startswith("lowbit_") or r["name"].startswith("copy") or r["name"] == "sparse24_fp8_cslt"
                or r["name"].endswith("_error")):
            continue
        if not r.get("ms"):
            print(f"{r['name']:36s} {r['shape']:>22s}  {r.get('error', '')}")
            continue
        rat = " ".join(f"{k[3:]}={v:.2f}" for k, v in r.items() if k.startswith("vs_"))
        print(f"{r['name']:36s} {r['shape']:>22s} {r['ms'] * 1e3:8.1f} {r['GBps']:7.0f} "
              f"{100 * r.get('frac_copy', 0):6.1f}  {rat}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lowbit.bench.memory", description=__doc__.split("\n")[0])
    p.add_argument("--only", default=None, help="comma-separated name parts (e.g. norm_quant_int8,w4a16)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, help="write rows and the environment as JSON")
    p.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), default=None,
                   help="no benchmark: draw the PNG of a JSON written earlier (no GPU needed)")
    p.add_argument("--sass", action="store_true",
                   help="no benchmark: compile the kernels for sm_90 and count SASS instructions (no GPU needed)")
    a = p.parse_args(argv)
    if a.sass:

        sass_report()
        return 0
    if a.plot:

        with open(a.plot[0]) as f:
            plot(json.load(f)["rows"], a.plot[1])
        print(f"# wrote {a.plot[1]}")
        return 0
    global _PARTIAL_JSON
    _PARTIAL_JSON = a.json
    rows = run(a.only, a.quick)
    if a.json:

        env = environment()
        env["command"] = "python -m lowbit.bench.memory " + " ".join(sys.argv[1:] if argv is None else argv)
        write_run(a.json, env, rows)
        print(f"# wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
