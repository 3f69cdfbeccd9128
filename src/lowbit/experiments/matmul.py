"""`lowbit experiment matmul`: the scale-policy table (int8 scale policies, 2:4, fp8, MX) on the CPU.

Each row changes one decision. A "kernel" here is the quantization-aware float64 reference
(exact integer accumulation, scales in the epilogue) rounded to float32: exactly what a correct
int8 kernel with an int32 accumulator and a float32 epilogue returns, up to its last bits;
the error measured is the quantization's, against x @ w.T of the ORIGINAL float inputs in
float64 (never dequantized copies: they would forgive the quantization error).

Every row is measured against the same yardstick, the per-column gate of an int8
kernel with one scale for A and one per column of B (lowbit.verify.tolerance.reference_gate):
"k_gate_frac" = max |err| / (4 K max|A| max|B[:,c]| / 127), "sqrtk_frac" the same with sqrt(K).
"""
from __future__ import annotations

import time

import torch

import lowbit as lb
from lowbit.experiments.inputs import matmul_inputs
from lowbit.ops.reference import qlinear_reference
from lowbit.verify import metrics as mt
from lowbit.verify.tolerance import reference_gate

SIZES = (256, 1024, 2048)
_T = lambda fmt: lb.QuantScheme(format=fmt, strategy="tensor")  # noqa: E731
_INT8_CH = lb.QuantScheme(format="int8", strategy="channel")
_INT8_TOK = lb.QuantScheme(format="int8", strategy="token")
_UINT8_ASYM = lb.QuantScheme(format="uint8", strategy="tensor", symmetric=False)

# name -> (A scheme, B scheme, prune B 2:4, use the A with one 20x row)
KERNELS = {
    "int8 one scale": (_T("int8"), _T("int8"), False, False),
    "int8 per-column": (_T("int8"), _INT8_CH, False, False),
    "int8 per-col + zp": (_UINT8_ASYM, _INT8_CH, False, False),
    "int8 per-token A": (_INT8_TOK, _INT8_CH, False, False),
    "int8 per-column, A 20x row": (_T("int8"), _INT8_CH, False, True),
    "int8 per-token A, A 20x row": (_INT8_TOK, _INT8_CH, False, True),
    "int8 2:4 pruned": (_T("int8"), _INT8_CH, True, False),
    # fp8 rows quantize B only, (what the format costs the weights); MX scales
    # use rceil (ceil_to_ue8m0(amax / 448)), which never clips an outlier block.
    "fp8 e4m3 one scale (B)": (None, _T("fp8_e4m3fn"), False, False),
    "fp8 e4m3 MX e8m0/32 (B)": (None, lb.QuantScheme(format="fp8_e4m3fn", strategy="group", group_size=32,
                                                     scale_format="e8m0", scale_rounding="rceil"),
                                False, False),
}


def _available(scheme) -> int:
    f = scheme.fmt
    if f.kind == "int":
        return f.qmax - f.qmin + 1 - (1 if (scheme.symmetric and f.signed) else 0)
    return 2 ** f.bits - len(f.nan_codes)


def _row(size, kernel, out, ref, det, stat, ms, wq=None, scheme=None):
    err = (out.double() - ref).abs()
    r = {"size": size, "kernel": kernel, "max_err": float(err.max()),
         "rms_err": float(torch.sqrt((err ** 2).mean())),
         "k_gate_frac": float((err / det).max()), "sqrtk_frac": float((err / stat).max()), "ms": ms}
    if wq is not None:
        cen = mt.code_census(wq.codes, _available(scheme))
        r["codes_used_worst"] = cen.worst
        r["codes_available"] = cen.available
        r["codes_used_per_col"] = cen.used.tolist()
    return r


def run(sizes=SIZES, seed: int = 1, progress=None) -> dict:
    """Rows for each size S (M = K = N = S). progress: callable(str) for long runs."""
    rows = []
    for S in sizes:
        a, w = matmul_inputs(S, S, S, seed)
        a20 = a.clone()
        a20[S // 2] *= 20.0           # the exercise's second input: one row 20x the rest
        refs, gates = {}, {}
        for key, A in (("shipped", a), ("20x", a20)):
            refs[key] = A.double() @ w.double().T
            gates[key] = reference_gate(A, w)
        t0 = time.perf_counter()
        out = a @ w.T                  # fp32 baseline (torch's CPU GEMM, fp32 accumulation)
        ms = 1e3 * (time.perf_counter() - t0)
        rows.append(_row(S, "fp32 baseline", out, refs["shipped"], *gates["shipped"], ms))
        for name, (xs, ws, prune, use20) in KERNELS.items():
            if progress:
                progress(f"size {S}: {name}")
            A = a20 if use20 else a
            key = "20x" if use20 else "shipped"
            t0 = time.perf_counter()
            W = lb.prune_2_4(w) if prune else w
            xq, wq = (A if xs is None else lb.quantize(A, xs)), lb.quantize(W, ws)
            out = qlinear_reference(xq, wq).float()
            ms = 1e3 * (time.perf_counter() - t0)
            rows.append(_row(S, name, out, refs[key], *gates[key], ms, wq, ws))
    return {"experiment": "matmul", "seed": seed, "rows": rows,
            "notes": ["kernels are lowbit's exact CPU reference (int32-exact accumulation, float32 out); "
                      "time is CPU quantize + reference, not a GPU kernel time",
                      "k_gate_frac / sqrtk_frac: against the per-column int8 gate on that input"]}


def format_table(result: dict) -> str:
    lines = [f"{'size':>5} {'kernel':<28} {'max err':>10} {'rms err':>10} {'K gate':>7} {'sqrtK':>7} "
             f"{'codes (worst col)':>17} {'time ms':>9}"]
    for r in result["rows"]:
        codes = f"{r['codes_used_worst']} of {r['codes_available']}" if "codes_used_worst" in r else "-"
        lines.append(f"{r['size']:>5} {r['kernel']:<28} {r['max_err']:>10.3e} {r['rms_err']:>10.3e} "
                     f"{r['k_gate_frac']:>7.3f} {r['sqrtk_frac']:>7.3f} {codes:>17} {r['ms']:>9.1f}")
    return "\n".join(lines + ["note: " + n for n in result["notes"]])


def plot(result: dict, path: str) -> None:
    """Two panels: distinct codes per column of B (largest size; one scale vs per column vs MX),
    and rms error vs K for every kernel (log-log, with a sqrt(K) guide)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    S = max(r["size"] for r in rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ("int8 one scale", "int8 per-column", "fp8 e4m3 one scale (B)", "fp8 e4m3 MX e8m0/32 (B)"):
        r = next((r for r in rows if r["size"] == S and r["kernel"] == name), None)
        if r is not None:
            ax1.plot(r["codes_used_per_col"], label=f"{name} (worst {r['codes_used_worst']})", lw=0.8)
    ax1.set_yscale("log")
    ax1.set_xlabel("column of B (gain falls 64x left to right)")
    ax1.set_ylabel("distinct codes used")
    ax1.set_title(f"code usage per column, K = {S}")
    ax1.legend(fontsize=7)
    for name in ["fp32 baseline"] + list(KERNELS):
        pts = sorted((r["size"], r["rms_err"]) for r in rows if r["kernel"] == name)
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, lw=1)
    ks = sorted({r["size"] for r in rows})
    base = next(r["rms_err"] for r in rows if r["kernel"] == "int8 per-column" and r["size"] == ks[0])
    ax2.plot(ks, [base * (k / ks[0]) ** 0.5 for k in ks], "k--", lw=0.8, label="~ sqrt(K)")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("K (= M = N)")
    ax2.set_ylabel("rms error vs float64 of the original inputs")
    ax2.set_title("error vs K")
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
