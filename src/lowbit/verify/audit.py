"""`lowbit audit`: every linear kernel found on this machine, checked by check_linear over an
adversarial case set, as a conformance table (kernel x case: pass / numerical / logic + cause).

Kernels (each gets lowbit's canonical QTensors of x and w; what it returns is checked against the
quantization-aware float64 reference with the accumulator it promises):
- lowbit's own paths: the exact float64 reference (a sanity row), the torch path
  (torch._int_mm with an int32 accumulator), the Triton kernels (int8, fp8 row-wise, fp8
  1x128/128x128 blocks, MXFP8; W4A16 for int4 / MXFP4 / NVFP4 weights). Without CUDA the Triton
  kernels run in Triton's CPU interpreter, at the small sizes the cases use.
- torch's: torch._int_mm + a float32 epilogue; torch._scaled_mm tensor-wise and row-wise, with
  and without fast accumulation (CUDA with fp8 support only).
- torchao's quantized linears when torchao is importable (verify/audit_torchao.py).
- a user's kernel: `--kernel module:function`, called as function(xq, wq, bias) with QTensors (or
  plain tensors for an unquantized side), returning out [M, N].
Cases: outlier channels, zero rows / columns / K blocks, subnormal and huge scales, K not a
multiple of any tile, M = 1, non-contiguous codes, and K = 4096 with positive products (where a
narrower accumulator than promised shows: the table then names the one simulated to match). A kernel refusing a case (NotImplementedError /
ValueError: its documented limits) is shown as n/a with the reason, never as a failure.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

import lowbit as lb
from lowbit.ops.weight_only import prepare_w4, w4a16_linear
from lowbit.verify import audit_torchao, check_linear
from lowbit.verify.kernel_spec import KernelSpec, int_mm_shape, padded, round_up


@dataclass
class Cell:
    kernel: str
    case: str
    verdict: str          # "pass" | "numerical" | "logic" | "n/a" | "error"
    cause: str = ""       # first cause's name, or the refusal
    detail: str = ""
    seconds: float = 0.0
    worst_err_over_gate: float | None = None
    expected: bool = False  # the verdict the kernel's row documents (a bf16 baseline's numerical)


def refused_cell(kernel: str, case: str, e: Exception, t0: float) -> Cell:
    """The Cell of a kernel that raised instead of returning (started at perf_counter t0): n/a for a
    documented refusal (NotImplementedError, ValueError), error for anything else, a TypeError too
    (a crash is a finding, not a reason to stop the audit)."""
    verdict = "n/a" if isinstance(e, (NotImplementedError, ValueError)) else "error"
    return Cell(kernel, case, verdict, type(e).__name__, str(e)[:300], time.perf_counter() - t0)


def verdict_cell(kernel: str, case: str, v, t0: float) -> Cell:
    """The Cell of a checker's verdict v (check_linear, check_attention, check_grouped_linear): pass or
    v.kind, the first cause's name and text. check_grouped_linear's causes are (name, text, share)
    tuples, the others diagnose.Cause (text: str(cause), its name and detail)."""
    first = v.causes[0] if v.causes else None
    if first is None:
        cause, detail = "", ""
    elif isinstance(first, tuple):
        cause, detail = first[0], first[1]
    else:
        cause, detail = first.name, str(first)
    return Cell(kernel, case, "pass" if v.passed else v.kind, cause, detail, time.perf_counter() - t0,
                v.metrics["impl_gate_frac"])


@dataclass
class Case:
    name: str
    M: int
    N: int
    make: Callable        # (rng, M, K, N) -> x [M, K], w [N, K]
    k_kind: str = "base"  # "base" | "odd": K not a multiple of any tile
    noncontig: bool = False


def _randn(rng, *shape):
    return torch.randn(*shape, generator=rng)


def _plain(rng, M, K, N):
    return _randn(rng, M, K), _randn(rng, N, K) * torch.exp(torch.rand(N, 1, generator=rng) * 3)


def _outliers(rng, M, K, N):
    x, w = _plain(rng, M, K, N)
    cols = torch.randperm(K, generator=rng)[:3]
    x[:, cols] *= 60.0                      # LLM-style activation outlier channels
    return x, w


def _zeros(rng, M, K, N):
    x, w = _plain(rng, M, K, N)
    x[M // 2] = 0.0
    w[N // 3] = 0.0
    x[:, : min(32, K)] = 0.0                # a zero K block: scales of an all-zero group
    return x, w


def _tiny(rng, M, K, N):
    x, w = _plain(rng, M, K, N)
    return x * 2.0 ** -118, w               # x's scales fall to fp32's subnormal range


def _huge(rng, M, K, N):
    x, w = _plain(rng, M, K, N)
    return x * 2.0 ** 50, w * 2.0 ** 40     # outputs ~2^95: within fp32 / bf16, far from fp16


def _same_sign(rng, M, K, N):
    # positive products: partial sums grow with K, so an accumulator that keeps fewer bits than it
    # promises (fp8 fast accumulation, fp16) shows, and the diagnosis says which one it is
    return torch.rand(M, K, generator=rng) + 0.5, torch.rand(N, K, generator=rng) + 0.5


CASES = [Case("random", 13, 19, _plain), Case("M=1", 1, 24, _plain), Case("outlier channels", 11, 17, _outliers),
         Case("zero rows/cols/block", 12, 18, _zeros), Case("subnormal scales", 9, 16, _tiny),
         Case("huge scales", 9, 16, _huge), Case("K not a tile multiple", 10, 21, _plain, k_kind="odd"),
         Case("non-contiguous codes", 14, 20, _plain, noncontig=True),
         Case("long K, same sign", 8, 16, _same_sign, k_kind="long")]


def k_for(specs_group: int, kind: str) -> int:
    """K for a case: a multiple of the schemes' K group; "odd": not a multiple of 64 where the group
    allows (a tile tail for every common BLOCK_K), else one more group than a power of two;
    "long": 4096 (accumulation precision shows)."""
    g = max(1, specs_group)
    if kind == "long":
        return 4096 // max(g, 1) * max(g, 1)
    if kind == "odd":
        if g == 1:
            return 203
        k = g * 3
        return k if k % 64 else g * 5
    return max(g, 32) * max(1, 256 // max(g, 32))


def _group(s) -> int:
    return 1 if s is None else s.k_width


def _noncontig(q):
    """The same QTensor with column-major (non-contiguous) codes."""
    if hasattr(q, "codes"):
        return dataclasses.replace(q, codes=q.codes.T.contiguous().T)
    return q.T.contiguous().T


# ------------------------------------------------------------------------------------------
# Kernels found on this machine
# ------------------------------------------------------------------------------------------
def _linear(backend, out_dtype=torch.float32):
    def fn(xq, wq, bias):
        return lb.ops.linear(xq, wq, bias=bias, backend=backend, out_dtype=out_dtype)
    return fn


def _int_mm(xq, wq, bias):
    """torch._int_mm, then (acc * s_x) * s_w (+ bias) in fp32. On CUDA _int_mm needs M > 16 and
    K, N multiples of 8 (cuBLASLt's int8 GEMM): the codes are padded with zeros, as a caller must
    (exact: zero products; the padded rows and columns are dropped)."""
    M, K = xq.codes.shape
    N = wq.codes.shape[0]
    Mp, Kp, Np = max(M, 17), round_up(K, 8), round_up(N, 8)
    acc = torch._int_mm(padded(xq.codes, Mp, Kp), padded(wq.codes, Np, Kp).t())[:M, :N]   # exact int32
    out = (acc.to(torch.float32) * xq.scale.reshape(-1, 1).to(acc.device)) * wq.scale.reshape(1, -1).to(acc.device)
    return out if bias is None else out + bias


def _pad_q(q, rows: int, cols: int):
    """A per-row-scaled QTensor padded with zero codes and unit scales to [rows, cols]."""
    return dataclasses.replace(q, codes=padded(q.codes, rows, cols),
                               scale=padded(q.scale.reshape(-1, 1).expand(q.codes.shape[0], 1), rows, 1, 1.0),
                               shape=(rows, cols))


def _torch_int8(xq, wq, bias):
    """lowbit's torch path (torch._int_mm) with the codes padded, as a caller must on CUDA, to the
    shapes torch._int_mm takes (int_mm_shape): exact, zero products; the padding is dropped."""
    (M, K), N = xq.codes.shape, wq.codes.shape[0]
    Mp, Kp, Np = int_mm_shape(M, K, N, xq.codes.device)
    if (Mp, Kp, Np) != (M, K, N):
        xq, wq = _pad_q(xq, Mp, Kp), _pad_q(wq, Np, Kp)
        bias = None if bias is None else padded(bias.reshape(1, -1), 1, Np).reshape(-1)
    return lb.ops.linear(xq, wq, bias=bias, backend="torch", out_dtype=torch.float32)[:M, :N]


def _scaled_mm(fast: bool):
    """torch._scaled_mm (cuBLAS's fp8 GEMM) with the schemes' tensor-wise or row-wise scales, fp32
    out. It needs row-major A, column-major B and K, N multiples of 16: the codes are copied into
    those layouts and padded with zero codes (exact; padded columns get scale 1, then dropped)."""
    def fn(xq, wq, bias):
        M, K = xq.codes.shape
        N = wq.codes.shape[0]
        Kp, Np = round_up(K, 16), round_up(N, 16)
        a = padded(xq.codes.view(torch.uint8), M, Kp).view(torch.float8_e4m3fn)
        b = padded(wq.codes.view(torch.uint8), Np, Kp).view(torch.float8_e4m3fn)
        if xq.scale.numel() > 1 or wq.scale.numel() > 1:     # row-wise: [M, 1] and [1, N] (M = 1 too)
            sa = xq.scale.reshape(-1, 1).float().expand(M, 1).contiguous()
            sb = padded(wq.scale.reshape(1, -1).float().expand(1, N), 1, Np, fill=1.0)
        else:
            sa, sb = xq.scale.reshape(()).float(), wq.scale.reshape(()).float()
        # float32 out and the bias added after in float32: cuBLAS's fused bias is bf16 (a rounding of
        # the bias the check does not model: otherwise it shows as errors just over the gate)
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32,
                               use_fast_accum=fast)[:, :N]
        return out if bias is None else out + bias.float()
    return fn


def _w4a16(xq, wq, bias):
    return w4a16_linear(xq.to(torch.bfloat16), prepare_w4(wq), bias, backend="triton")


def scaled_mm_ok(device: str) -> bool:
    """torch._scaled_mm rows: CUDA with fp8 tensor cores (sm_89+). (torch's CPU kernel exists
    too; the tests run these rows through it, but on a CPU they would audit a reference loop.)"""
    return device == "cuda" and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9)


def scaled_mm_specs() -> list[KernelSpec]:
    """torch._scaled_mm tensor-wise and row-wise, with and without fast accumulation (use_fast_accum).
    All are held to fp32 accumulation, the precision torch's API suggests, so that the table shows
    what cuBLAS really keeps: on an H200 neither keeps it (docs/diagnosis.md) -- fp8 tensor-core
    steps of 14 significant bits, promoted into fp32 every 128 K ("precise") or never ("fast")."""
    ft, fr = lb.get_preset("fp8_tensor"), lb.get_preset("fp8_row")
    specs = []
    for fast in (False, True):
        tag = "fast accumulation" if fast else "precise"
        specs.append(KernelSpec(f"torch._scaled_mm tensorwise, {tag}", ft, ft, _scaled_mm(fast), "fp32"))
        specs.append(KernelSpec(f"torch._scaled_mm rowwise, {tag}", fr, fr, _scaled_mm(fast), "fp32"))
    return specs


def discover(device: str, triton_ok: bool) -> list[KernelSpec]:
    """Every kernel this machine can run, with the schemes it computes."""
    P = lb.get_preset
    i8t, i8c = P("int8_token"), P("int8_channel")
    fp8r = P("fp8_row")
    specs = [KernelSpec("lowbit reference (float64)", i8t, i8c, _linear("reference", torch.float64),
                        note="the exact reference itself: must always pass")]
    if hasattr(torch, "_int_mm"):
        specs.append(KernelSpec("torch._int_mm + fp32 epilogue", i8t, i8c, _int_mm, "int32",
                                note="int8 x int8 -> exact int32, then (acc * s_x) * s_w in fp32"))
        specs.append(KernelSpec("lowbit torch path (int8)", i8t, i8c, _torch_int8, "int32",
                                note="torch._int_mm, epilogue in float64 (codes padded on CUDA to M > 16, "
                                     "K, N multiples of 8)"))
    if scaled_mm_ok(device):
        specs += scaled_mm_specs()
    if triton_ok:
        specs += [KernelSpec("lowbit triton int8", i8t, i8c, _linear("triton"), "int32"),
                  KernelSpec("lowbit triton fp8 rowwise", fp8r, fp8r, _linear("triton"), "fp32"),
                  KernelSpec("lowbit triton fp8 blockwise", P("fp8_block1x128"), P("fp8_block128"),
                             _linear("triton"), "fp32"),
                  KernelSpec("lowbit triton mxfp8", P("mxfp8"), P("mxfp8"), _linear("triton"), "fp32")]
        for w in ("int4_g128", "mxfp4", "nvfp4"):
            specs.append(KernelSpec(f"lowbit triton w4a16 {w}", None, P(w), _w4a16, "fp32",
                                    note="bf16 activations (the check sees the same bf16 values)",
                                    x_dtype=torch.bfloat16))
    return specs + audit_torchao.specs(device)


def user_kernel(spec: str, x_scheme, w_scheme, accumulator) -> KernelSpec:
    """`module:function` -> KernelSpec; the module is imported, the function must exist."""
    import importlib
    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn:
        raise ValueError(f"--kernel must be MODULE:FUNCTION (e.g. mypkg.kernels:w8a8), got {spec!r}")
    f = getattr(importlib.import_module(mod), fn, None)
    if not callable(f):
        raise ValueError(f"--kernel {spec}: {mod} has no callable {fn!r}")
    return KernelSpec(spec, x_scheme, w_scheme, f, accumulator, note="user kernel: fn(xq, wq, bias) -> out")


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------
def run_cell(spec: KernelSpec, case: Case, device: str, seed: int) -> Cell:
    rng = torch.Generator().manual_seed(seed)
    K = k_for(math.lcm(_group(spec.x_scheme), _group(spec.w_scheme)), case.k_kind)
    x, w = case.make(rng, case.M, K, case.N)
    if spec.x_dtype is not None:
        x = x.to(spec.x_dtype).float()     # what the kernel reads is what the check sees
    bias = torch.randn(case.N, generator=rng)
    t0 = time.perf_counter()
    try:
        xq = lb.quantize(x, spec.x_scheme) if spec.x_scheme is not None else x
        wq = lb.quantize(w, spec.w_scheme) if spec.w_scheme is not None else w
        if spec.float_x:
            xq = x
        if case.noncontig:
            xq, wq = _noncontig(xq), _noncontig(wq)
        to = lambda q: q.to(device)  # noqa: E731
        out = spec.fn(to(xq), to(wq), bias.to(device))
    except Exception as e:      # a refusal (n/a) or a crash (error): refused_cell
        return refused_cell(spec.name, case.name, e, t0)
    v = check_linear(out.detach().cpu(), x, w,
                     x_scheme=spec.x_scheme, w_scheme=spec.w_scheme, bias=bias, accumulator=spec.accumulator)
    return verdict_cell(spec.name, case.name, v, t0)


def audit(specs: list[KernelSpec], cases: list[Case] = CASES, *, device: str = "cpu", seed: int = 0,
          progress: Callable[[str], None] | None = None) -> list[Cell]:
    """Run every kernel on every case; returns one Cell per pair (row-major: kernel, then case)."""
    return audit_grid(run_cell, specs, cases, device, seed, progress)


def audit_grid(run: Callable, specs: list, cases: list, device: str, seed: int,
               progress: Callable[[str], None] | None, tag: str = "") -> list[Cell]:
    """run(spec, case, device, seed) -> Cell for every kernel on every case (kernel-major), with a
    progress line per cell: the loop of every audit table (linear, grouped, attention)."""
    cells = []
    for i, spec in enumerate(specs):
        for case in cases:
            c = run(spec, case, device, seed)
            cells.append(c)
            if progress:
                progress(f"[{tag}{i + 1}/{len(specs)}] {spec.name} / {case.name}: {c.verdict} {c.cause} "
                         f"({c.seconds:.1f}s)")
    return cells


def table(cells: list[Cell]) -> str:
    """Plain-text conformance table: one row per kernel, one column per case."""
    kernels = list(dict.fromkeys(c.kernel for c in cells))
    cases = list(dict.fromkeys(c.case for c in cells))
    at = {(c.kernel, c.case): c for c in cells}

    def short(c: Cell) -> str:
        if c.verdict == "pass":
            return "pass"
        return f"{c.verdict}: {c.cause}"
    width = max(len(k) for k in kernels)
    colw = {cs: max(len(cs), *(len(short(at[k, cs])) for k in kernels if (k, cs) in at)) for cs in cases}
    lines = [" | ".join([" " * width] + [cs.ljust(colw[cs]) for cs in cases])]
    lines.append("-+-".join(["-" * width] + ["-" * colw[cs] for cs in cases]))
    for k in kernels:
        lines.append(" | ".join([k.ljust(width)] + [short(at[k, cs]).ljust(colw[cs]) if (k, cs) in at else ""
                                                    for cs in cases]))
    return "\n".join(lines)


COLORS = {"pass": "#7fc97f", "numerical": "#fdc086", "logic": "#f0027f", "n/a": "#d9d9d9", "error": "#666666"}


def plot(cells: list[Cell], path: str, title: str = "lowbit audit") -> None:
    """The table as a coloured grid PNG (green pass, orange numerical, red logic, grey n/a)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kernels = list(dict.fromkeys(c.kernel for c in cells))
    cases = list(dict.fromkeys(c.case for c in cells))
    at = {(c.kernel, c.case): c for c in cells}
    fig, ax = plt.subplots(figsize=(2.0 + 1.9 * len(cases), 0.9 + 0.55 * len(kernels)))
    for i, k in enumerate(kernels):
        for j, cs in enumerate(cases):
            c = at.get((k, cs))
            if c is None:
                continue
            ax.add_patch(plt.Rectangle((j, len(kernels) - 1 - i), 1, 1, color=COLORS[c.verdict], ec="white"))
            label = c.verdict if c.verdict == "pass" else f"{c.verdict}\n{c.cause[:24]}"
            ax.text(j + 0.5, len(kernels) - 0.5 - i, label, ha="center", va="center", fontsize=6.5)
    ax.set_xlim(0, len(cases))
    ax.set_ylim(0, len(kernels))
    ax.set_xticks([j + 0.5 for j in range(len(cases))], cases, rotation=25, ha="right", fontsize=8)
    ax.set_yticks([len(kernels) - 0.5 - i for i in range(len(kernels))], kernels, fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def environment(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__,
            "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info
