"""GEMM benchmark: lowbit's Triton kernels next to their PyTorch baselines, in one process.

Shapes are LLM linear layers: M (tokens) in 1, 16, 128, 2048, 8192 against (N, K) in
(14336, 4096) (MLP up), (4096, 14336) (MLP down) and (8192, 8192). For every shape it times
  bf16         torch.mm(x, w.T)                                  (dense peak 989 TFLOP/s)
  int_mm       torch._int_mm(a, b.T) alone (refuses M <= 16)      (int8 peak 1979 TOPS)
  int_mm+epi   the same plus the scale epilogue in eager PyTorch
  scaled_row   torch._scaled_mm fp8, per-token x per-channel scales (use_fast_accum=False)
  scaled_ten   torch._scaled_mm fp8, tensor-wise scales
  scaled_row_fast  the row-wise one with use_fast_accum=True (no fp32 promotion in the MMA)
  lowbit_int8, lowbit_fp8_row, lowbit_fp8_tensor, lowbit_fp8_block, lowbit_mxfp8, and
  lowbit_fp8_row_fast (precise=False, compared with scaled_row_fast only)
and reports TFLOP/s, the fraction of the dense 8-bit peak (1979) and the ratio to each
baseline (baseline ms / kernel ms: > 1 means lowbit is faster). Operands rotate through enough
input sets to defeat the 60 MiB L2; M <= 128 runs inside CUDA graphs so launch overhead does
not dominate. Each lowbit kernel's output is also compared with a baseline's (column `check`,
the relative L2 difference) so a fast wrong kernel is visible in the table.
"""
from __future__ import annotations

import torch

from lowbit.bench.common import rel_l2
from lowbit.profiling.timing import bench_ms, rotating_count

PEAK_8BIT = 1979.0  # H100/H200 SXM dense int8 / fp8 tensor-core peak, TOPS / TFLOP/s
PEAK_BF16 = 989.0
MS = (1, 16, 128, 2048, 8192)
NK = ((14336, 4096), (4096, 14336), (8192, 8192))
QUICK_MS = (16, 2048, 8192)
GRAPH_MAX_M = 128


def _inputs(M: int, N: int, K: int, count: int, dev: str = "cuda") -> list[dict]:
    """`count` independent random operand sets (codes, scales) for every kernel of one shape."""
    sets = []
    for _ in range(count):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        a8 = torch.randint(-127, 128, (M, K), device=dev, dtype=torch.int8)
        b8 = torch.randint(-127, 128, (N, K), device=dev, dtype=torch.int8)
        af = (torch.randn(M, K, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        bf = (torch.randn(N, K, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        sets.append(dict(
            x=x, w=w, a8=a8, b8=b8, af=af, bf=bf,
            sa=torch.rand(M, device=dev) * 1e-2 + 1e-3, sb=torch.rand(N, device=dev) * 1e-3 + 1e-4,
            sa1=torch.rand(1, device=dev) * 1e-2, sb1=torch.rand(1, device=dev) * 1e-3,
            sa_blk=torch.rand(M, K // 128, device=dev) * 1e-2 + 1e-3,
            sb_blk=torch.rand(-(-N // 128), K // 128, device=dev) * 1e-3 + 1e-4,
            ea=torch.randint(118, 124, (M, K // 32), device=dev, dtype=torch.uint8),
            eb=torch.randint(110, 116, (N, K // 32), device=dev, dtype=torch.uint8),
        ))
    return sets


def _set_bytes(M: int, N: int, K: int) -> int:
    # the largest single kernel's operands: bf16 x and w
    return 2 * (M * K + N * K)


def _lowbit_gemms():
    """lowbit's Triton GEMMs: int8_gemm, fp8_gemm, fp8_block_gemm, mxfp8_gemm."""
    from lowbit.ops.triton import gemm_blockscaled, gemm_fp8, gemm_int8    # optional: triton

    return gemm_int8.int8_gemm, gemm_fp8.fp8_gemm, gemm_blockscaled.fp8_block_gemm, gemm_blockscaled.mxfp8_gemm


def kernels():
    """name -> (fn(set) -> output, family); family picks the peak and the baselines."""
    int8_gemm, fp8_gemm, fp8_block_gemm, mxfp8_gemm = _lowbit_gemms()

    def int_mm_epi(s):
        acc = torch._int_mm(s["a8"], s["b8"].t())
        return (acc.float() * s["sa"][:, None] * s["sb"][None, :]).to(torch.bfloat16)

    def scaled(s, row: bool, fast: bool = False):
        sa = s["sa"][:, None] if row else s["sa1"][0]
        sb = s["sb"][None, :] if row else s["sb1"][0]
        return torch._scaled_mm(s["af"], s["bf"].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    return {
        "bf16": (lambda s: torch.mm(s["x"], s["w"].t()), "bf16"),
        "int_mm": (lambda s: torch._int_mm(s["a8"], s["b8"].t()), "base8"),
        "int_mm+epi": (int_mm_epi, "base8"),
        "scaled_row": (lambda s: scaled(s, True), "base8"),
        "scaled_ten": (lambda s: scaled(s, False), "base8"),
        "scaled_row_fast": (lambda s: scaled(s, True, fast=True), "base8"),
        "lowbit_int8": (lambda s: int8_gemm(s["a8"], s["b8"], s["sa"], s["sb"]), "int8"),
        "lowbit_fp8_row": (lambda s: fp8_gemm(s["af"], s["bf"], s["sa"], s["sb"]), "fp8"),
        "lowbit_fp8_tensor": (lambda s: fp8_gemm(s["af"], s["bf"], s["sa1"], s["sb1"]), "fp8"),
        "lowbit_fp8_row_fast": (lambda s: fp8_gemm(s["af"], s["bf"], s["sa"], s["sb"], precise=False), "fp8"),
        "lowbit_fp8_block": (lambda s: fp8_block_gemm(s["af"], s["bf"], s["sa_blk"], s["sb_blk"]), "fp8"),
        "lowbit_mxfp8": (lambda s: mxfp8_gemm(s["af"], s["bf"], s["ea"], s["eb"]), "fp8"),
    }


# lowbit kernel -> the baseline whose output it must reproduce (for the `check` column)
_CHECK_AGAINST = {"lowbit_int8": "int_mm+epi", "lowbit_fp8_row": "scaled_row",
                  "lowbit_fp8_tensor": "scaled_ten", "lowbit_fp8_row_fast": "scaled_row_fast"}
_RATIOS = {"int8": ("bf16", "int_mm", "int_mm+epi"),
           "fp8": ("bf16", "scaled_row", "scaled_ten")}
# fast accumulation (no fp32 promotion inside the fp8 MMA) compares with its cuBLAS twin
_RATIOS_BY_NAME = {"lowbit_fp8_row_fast": ("bf16", "scaled_row_fast")}



def _blockscaled_check(name: str, s: dict, out: torch.Tensor) -> float:
    """Block-scaled kernels have no torch baseline: compare with the dequantized fp32 product."""
    A = s["af"].float()
    B = s["bf"].float()
    if name == "lowbit_fp8_block":
        A = A * s["sa_blk"].repeat_interleave(128, 1)
        B = B * s["sb_blk"].repeat_interleave(128, 1).repeat_interleave(128, 0)[: B.shape[0]]
    else:
        A = A * torch.exp2(s["ea"].float() - 127).repeat_interleave(32, 1)
        B = B * torch.exp2(s["eb"].float() - 127).repeat_interleave(32, 1)
    return rel_l2(out, A @ B.t())


def run_shape(M: int, N: int, K: int, only: str | None = None, log=print) -> list[dict]:
    if not torch.cuda.is_available():
        raise RuntimeError("the GEMM benchmark needs a CUDA GPU")
    count = rotating_count(_set_bytes(M, N, K))
    sets = _inputs(M, N, K, count)
    graph = M <= GRAPH_MAX_M
    flops = 2.0 * M * N * K
    rows, ms_of = [], {}
    table = kernels()
    for name, (fn, family) in table.items():
        is_base = family in ("bf16", "base8")
        if only and not is_base and only not in name:
            continue
        row = dict(name=name, shape=f"{M}x{N}x{K}", M=M, N=N, K=K, family=family, cuda_graph=graph)
        if name.startswith("int_mm") and M <= 16:
            row.update(ms=None, note="torch._int_mm refuses M <= 16")
            rows.append(row)
            continue
        try:
            out = fn(sets[0])
            if name == "lowbit_int8" and M <= 16:  # _int_mm refuses M <= 16: float64 product instead
                s0 = sets[0]
                ref = (s0["a8"].double() @ s0["b8"].double().t()) * s0["sa"].double()[:, None] * s0["sb"].double()
                row["check"] = rel_l2(out, ref)
            elif name in _CHECK_AGAINST:
                row["check"] = rel_l2(out, table[_CHECK_AGAINST[name]][0](sets[0]))
            elif name in ("lowbit_fp8_block", "lowbit_mxfp8") and M * N * K <= 2**36:
                row["check"] = _blockscaled_check(name, sets[0], out)
            del out
            ms = bench_ms(fn, [(s,) for s in sets], cuda_graph=graph)
        except Exception as exc:  # one failing entry must not hide the others' numbers
            row.update(ms=None, note=f"{type(exc).__name__}: {str(exc)[:160]}")
            rows.append(row)
            log(f"  {name:18s} {row['shape']:>18s}  FAILED {row['note']}")
            continue
        ms_of[name] = ms
        tflops = flops / (ms * 1e-3) / 1e12
        peak = PEAK_BF16 if family == "bf16" else PEAK_8BIT
        wbytes = N * K * (2 if family == "bf16" else 1)
        row.update(ms=ms, tflops=tflops, frac_peak=tflops / peak, weight_TBps=wbytes / (ms * 1e-3) / 1e12)
        for base in _RATIOS_BY_NAME.get(name, _RATIOS.get(family, ())):
            if base in ms_of:
                row[f"vs_{base}"] = ms_of[base] / ms
        rows.append(row)
        log(_fmt_row(row))
    del sets
    torch.cuda.empty_cache()
    return rows


def _fmt_row(r: dict) -> str:
    if r.get("ms") is None:
        return f"  {r['name']:18s} {r['shape']:>18s}  -- {r.get('note', '')}"
    ratios = " ".join(f"{k[3:]}={v:.2f}x" for k, v in r.items() if k.startswith("vs_"))
    chk = f" check={r['check']:.1e}" if "check" in r else ""
    return (f"  {r['name']:18s} {r['shape']:>18s} {r['ms'] * 1e3:9.1f} us {r['tflops']:7.1f} TF/s "
            f"{100 * r['frac_peak']:5.1f}% W {r['weight_TBps']:.2f} TB/s {ratios}{chk}")


def run(only: str | None = None, quick: bool = False, log=print) -> list[dict]:
    """All shapes (or QUICK_MS x NK with quick); `only` keeps lowbit kernels whose name contains
    it (the baselines always run, so ratios stay available)."""
    rows = []
    for N, K in NK:
        for M in (QUICK_MS if quick else MS):
            log(f"shape M={M} N={N} K={K}")
            rows += run_shape(M, N, K, only, log)
    return rows


def sweep(configs: dict[str, list[dict]], shapes=((8192, 8192, 8192),), log=print) -> list[dict]:
    """Time each lowbit kernel under several forced launch configs (for choosing pick_config)."""
    int8_gemm, fp8_gemm, fp8_block_gemm, mxfp8_gemm = _lowbit_gemms()

    fns = {"int8": lambda s, c: int8_gemm(s["a8"], s["b8"], s["sa"], s["sb"], config=c),
           "fp8_row": lambda s, c: fp8_gemm(s["af"], s["bf"], s["sa"], s["sb"], config=c),
           "fp8_block": lambda s, c: fp8_block_gemm(s["af"], s["bf"], s["sa_blk"], s["sb_blk"], config=c),
           "mxfp8": lambda s, c: mxfp8_gemm(s["af"], s["bf"], s["ea"], s["eb"], config=c)}
    rows = []
    for M, N, K in shapes:
        sets = _inputs(M, N, K, rotating_count(_set_bytes(M, N, K)))
        for kname, cfgs in configs.items():
            for cfg in cfgs:
                try:
                    ms = bench_ms(lambda s, c=cfg: fns[kname](s, c), [(s,) for s in sets],
                                  cuda_graph=M <= GRAPH_MAX_M)
                    tf = 2.0 * M * N * K / (ms * 1e-3) / 1e12
                except Exception as exc:
                    ms, tf = None, None
                    log(f"  sweep {kname} {cfg} FAILED {type(exc).__name__}: {str(exc)[:120]}")
                rows.append(dict(kernel=kname, shape=f"{M}x{N}x{K}", config=cfg, ms=ms, tflops=tf))
                if ms is not None:
                    log(f"  sweep {kname:9s} {M}x{N}x{K} {cfg} -> {tf:.0f} TF/s")
        del sets
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    """Markdown table of the lowbit rows: TF/s and the ratios to the baselines of the same run."""
    head = ("| kernel | M x N x K | TF/s | % of 1979 | vs bf16 | vs _int_mm | vs _int_mm+epi | "
            "vs _scaled_mm row | vs _scaled_mm tensor | vs _scaled_mm row fast |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    f = lambda r, k: f"{r[k]:.2f}" if k in r else ""  # noqa: E731
    for r in rows:
        if not str(r.get("name", "")).startswith("lowbit_") or not r.get("ms"):
            continue
        lines.append(f"| {r['name'][7:]} | {r['shape']} | {r['tflops']:.0f} | {100 * r['frac_peak']:.0f} | "
                     f"{f(r, 'vs_bf16')} | {f(r, 'vs_int_mm')} | {f(r, 'vs_int_mm+epi')} | "
                     f"{f(r, 'vs_scaled_row')} | {f(r, 'vs_scaled_ten')} | {f(r, 'vs_scaled_row_fast')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """PNG: per shape, each lowbit kernel's ratio to its main baseline (bf16 for M <= 16,
    torch._int_mm / torch._scaled_mm rowwise otherwise), with each kernel family's target floor drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kern = ["lowbit_int8", "lowbit_fp8_row", "lowbit_fp8_tensor", "lowbit_fp8_block", "lowbit_mxfp8"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r.get("name") in kern))
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    for ax, base_of, title in (
            (axes[0], lambda n: "vs_bf16", "ratio to bf16 torch.mm (same shape)"),
            (axes[1], lambda n: "vs_int_mm" if n == "lowbit_int8" else "vs_scaled_row",
             "ratio to torch._int_mm (int8) / torch._scaled_mm rowwise (fp8)")):
        width = 0.8 / len(kern)
        for i, k in enumerate(kern):
            vals = []
            for s in shapes:
                r = next((r for r in rows if r.get("name") == k and r["shape"] == s), {})
                vals.append(r.get(base_of(k), float("nan")))
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=k[7:])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=60, ha="right", fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("baseline ms / lowbit ms  (>1: lowbit faster)")
    for y, lab in ((1.25, "int8 floor 1.25x"), (0.95, "fp8 row floor"), (0.7, "block floor"), (0.5, "MX floor")):
        axes[1].axhline(y, ls=":", lw=0.8, color="gray")
        axes[1].text(-0.6, y, lab, fontsize=7, va="bottom", ha="left", color="gray")
    axes[0].legend(fontsize=8, loc="lower left", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
