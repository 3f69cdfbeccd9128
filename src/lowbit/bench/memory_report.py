"""Reports for lowbit.bench.memory that need no GPU: the PNG of a run's JSON (`plot`) and
a compile check of the kernels for sm_90 with SASS sizes and shared memory (`sass_report`).
Both are reached through `python -m lowbit.bench.memory --plot JSON PNG` / `--sass`."""
from __future__ import annotations

import json

from lowbit.bench.memory_w4a16 import W4_MS, sass_rows_gemv8
from lowbit.bench.sm90 import compile_sm90
from lowbit.ops.fused import tile_config
from lowbit.ops.weight_only import PAIRS_DEQUANT, pick_config


def plot(rows: list[dict], path: str) -> None:
    """PNG of a run, horizontal bars with one readable label each: the activation quantizers'
    bandwidth as % of the Triton copy (left; each kernel with torch.compile's row beside it where
    the run timed one; the tile sweep's variants stay in the JSON), and the default W4A16 kernels'
    speed-up over bf16 torch.mm per weight format and decode shape (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["name"], r["shape"]): r for r in rows if r.get("ms")}
    copy = max((r["GBps"] for r in rows if r["name"].startswith("copy") and r.get("GBps")), default=None)
    quant = [r for r in rows if r.get("ms") and r["name"].startswith("lowbit_")
             and not r["name"].startswith(("lowbit_w4a16", "lowbit_sparse"))
             and "_tile_r" not in r["name"] and "_tile_p" not in r["name"]]
    w4_kinds = [k for k in ("int4_g128", "int4_g128_asym", "int4_g32", "mxfp4", "nvfp4")
                if any(r["name"] == "lowbit_w4a16_" + k for r in rows)]
    w4_shapes = list(dict.fromkeys(r["shape"] for r in rows if r["name"].startswith("lowbit_w4a16_") and r.get("ms")))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, max(6.0, 0.22 * len(quant) + 1.5)),
                                   gridspec_kw={"width_ratios": [1.15, 1]})
    ref = copy or 1.0
    y = list(range(len(quant)))[::-1]
    labels, lows, comps = [], [], []
    for r in quant:
        label = r["name"][len("lowbit_"):]
        labels.append(f"{label}  {r['shape']}")
        lows.append(100 * r["GBps"] / ref)
        b = by.get(("compile_" + label.removesuffix("_tile"), r["shape"]))
        comps.append(100 * b["GBps"] / ref if b else 0.0)
    ax1.barh([v + 0.2 for v in y], lows, height=0.4, label="lowbit (fused)")
    ax1.barh([v - 0.2 for v in y], comps, height=0.4, label="torch.compile")
    ax1.axvline(100, color="k", lw=1)
    ax1.axvline(80, color="r", ls=":", lw=1, label="80% (int8 / fp8 target)")
    ax1.set_yticks(y, labels, fontsize=7)
    ax1.set_xlabel(f"% of the Triton copy ({ref:.0f} GB/s; bytes that must move / time)")
    ax1.set_title("activation quantizers (_tile: the tile kernel, unsuffixed: the row kernel;\n"
                  "fused.DEFAULT_KERNEL picks per entry point)", fontsize=10)
    ax1.legend(fontsize=8, loc="lower right")
    n = max(1, len(w4_kinds))
    y2 = list(range(len(w4_shapes)))[::-1]
    for i, k in enumerate(w4_kinds):
        vals = [by.get(("lowbit_w4a16_" + k, sh), {}).get("vs_bf16", 0.0) for sh in w4_shapes]
        ax2.barh([v + (i - (n - 1) / 2) * 0.8 / n for v in y2], vals, height=0.8 / n, label=k)
    ax2.axvline(1.0, color="k", lw=1)
    ax2.axvline(2.5, color="r", ls=":", lw=1, label="2.5x (int4 target at M = 1)")
    ax2.set_yticks(y2, w4_shapes, fontsize=8)
    ax2.set_xlabel("speed-up over bf16 torch.mm (baseline time / lowbit time)")
    ax2.set_title("W4A16 decode GEMMs, default kernel per weight format")
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sass_report() -> list[dict]:
    """Compile the fused quantizer and the W4A16 kernel for sm_90 without a GPU (Triton's
    bundled ptxas / cuobjdump) and report static SASS instruction counts and shared memory
    per variant: a check for compile errors and resource limits (the H200 allows 232448
    bytes of shared memory per block) when no H200 is at hand. Integer arguments are marked
    divisible by 16, as Triton specializes them at launch. `reg` / `local`: registers per thread
    and spill bytes, from the fused quantizers' compiles. The static count includes paths
    rarely taken (the IEEE-division fallback for subnormal scales)."""
    from lowbit.ops.triton import fused_quant as fq    # optional: triton
    from lowbit.ops.triton import w4a16 as w4    # optional: triton

    def compile_count(fn, sig, consts, no_div, **opts):
        """(static SASS instructions, shared bytes, {reg, local} as ptxas allotted them)"""
        r = compile_sm90(fn, sig, consts, no_div, **opts)
        return r["sass"], r["shared"], {k: r[k] for k in ("reg", "local") if r[k] is not None}

    rows = []
    sig = {"X": "*bf16", "X_stride": "i32", "W": "*bf16", "R": "*bf16", "R_stride": "i32", "R_OUT": "*bf16",
           "R_OUT_stride": "i32", "Y": "*fp32", "CODES": "*i8", "SCALE": "*fp32", "SCALE_CODES": "*u8",
           "GSCALE": "*fp32", "GOUT": "*fp32", "AMAX": "*fp32", "K": "i32", "NGROUPS": "i32", "eps": "fp32"}
    base = dict(PRE=1, HAS_RES=False, STORE_Y=False, AMAX_ONLY=False, FMT=0, SCALE_KIND=0, E8M0_ROUND=0, QMAX=127.0,
                EMAX=0, MBITS=0, HW_FP8=True, FAST_DIV=True, G_DIV=1.0, NG=1, G=4096, EVEN=True, G_GIVEN=False)
    for name, extra in (("norm_int8 K=4096", {}), ("norm_fp8 K=4096", dict(FMT=1, QMAX=448.0)),
                        ("norm_res_int8 K=4096", dict(HAS_RES=True)), ("silu_int8 H=4096", dict(PRE=2)),
                        ("quant_mxfp8 K=4096", dict(PRE=0, FMT=1, QMAX=448.0, SCALE_KIND=1, EMAX=8, MBITS=3,
                                                    NG=128, G=32))):
        n, smem, regs = compile_count(fq._row_quant_kernel, sig, {**base, **extra}, ("eps", "NGROUPS"), num_warps=8)
        # static count: the rarely taken IEEE-division fallback for subnormal scales is included
        rows.append(dict(kernel="row_quant", variant=name, sass_static=n, shared=smem, **regs))
    # the "tile" kernel at the tiles fused.tile_config picks for the benchmark's hidden sizes

    tsig = {"X": "*bf16", "X_stride": "i32", "W": "*bf16", "R": "*bf16", "R_stride": "i32", "R_OUT": "*bf16",
            "R_OUT_stride": "i32", "Y": "*fp32", "CODES": "*i8", "SCALE": "*fp32", "n_rows": "i32", "K": "i32",
            "eps": "fp32"}
    tbase = dict(PRE=1, HAS_RES=False, STORE_Y=False, FMT=0, QMAX=127.0, HW_FP8=True, FAST_DIV=True, EVEN=True,
                 FULL=True)
    for name, K, extra in (("norm_int8", 4096, {}), ("norm_fp8", 4096, dict(FMT=1, QMAX=448.0)),
                           ("norm_int8", 8192, {}), ("norm_fp8", 8192, dict(FMT=1, QMAX=448.0)),
                           ("norm_res_int8", 4096, dict(HAS_RES=True))):
        R, W, *P = tile_config(K, 1, fp8=extra.get("FMT") == 1)
        nprog = 528 if P else 0  # persistent: 2 programs on each of the H200's 132 SMs (a constexpr)
        consts = {**tbase, **extra, "ROWS": R, "BLOCK": K, "NPROG": nprog // 2 if P else 0}
        n, smem, regs = compile_count(fq._token_tile_kernel, tsig, consts, ("eps",), num_warps=W)
        rows.append(dict(kernel="token_tile", variant=f"{name} K={K} ROWS={R} warps={W}" + (" persistent" if P else ""),
                         sass_static=n, per_element=round(n / (R * K / (32 * W)), 1), shared=smem, **regs))
    # the group variant (MX / NVFP4) at the 8192 x 4096 benchmark's tile; per_element = static
    # instructions / elements per thread (the rare subnormal-scale branch included)
    gsig = dict(sig, CODES="*u8", INV="*fp32", n_rows="i32")
    gbase = {**base, "PRE": 0, "FMT": 2, "SCALE_KIND": 1, "QMAX": 6.0, "EMAX": 2, "MBITS": 1, "NG": 128, "G": 32,
             "PACK": False}
    nv = dict(SCALE_KIND=2, G=16, NG=256, G_DIV=2688.0)
    for name, extra in (("quant_mxfp4", {}), ("quant_mxfp4 packed", dict(PACK=True)), ("norm_mxfp4", dict(PRE=1)),
                        ("quant_mxfp8", dict(FMT=1, QMAX=448.0, EMAX=8, MBITS=3)),
                        # NVFP4: a given tensor scale (one pass), or both passes over this tensor
                        # (the first's loads kept in L2, the second in reverse tile order)
                        ("quant_nvfp4 given scale", dict(nv, G_GIVEN=True)),
                        ("quant_nvfp4 pass 1", dict(nv, AMAX_ONLY=True, TWO_PASS=True)),
                        ("quant_nvfp4 pass 2", dict(nv, TWO_PASS=True))):
        R, W = tile_config(4096, 0, mx=extra.get("SCALE_KIND", 1) == 1)  # the default tile of each format
        n, smem, regs = compile_count(fq._group_tile_kernel, gsig, {**gbase, **extra, "ROWS": R}, ("eps", "NGROUPS"),
                                      num_warps=W)
        rows.append(dict(kernel="group_tile", variant=f"{name} K=4096 ROWS={R} warps={W}", sass_static=n,
                         per_element=round(n / (R * 4096 / (32 * W)), 1), shared=smem, **regs))
    # the W4A4 emulation's activation at decode sizes (fused.qdq_rows): both launches, MXFP4 and NVFP4
    from lowbit.ops.triton.dequant import _qdq_rows_kernel    # optional: triton

    qsig = {"X": "*bf16", "s_x": "i32", "OUT": "*bf16", "s_o": "i32", "AMAX": "*fp32", "WG": "*fp32",
            "GPROD": "*fp32", "M": "i32", "K": "i32"}
    for name, extra in (("mxfp4", dict(SCALE_KIND=1, E8M0_ROUND=0, G=32, NG=128)),
                        ("nvfp4", dict(SCALE_KIND=2, G_DIV=2688.0, G=16, NG=256)),
                        ("nvfp4 absmax", dict(SCALE_KIND=2, G_DIV=2688.0, G=16, NG=256, AMAX_ONLY=True))):
        consts = {**dict(FMT=2, E8M0_ROUND=0, QMAX=6.0, EMAX=2, MBITS=1, HW_FP8=True, FAST_DIV=True, G_DIV=1.0,
                         EVEN=True, AMAX_ONLY=False, ONE=False, MP2=16, HAS_WG=True), **extra}
        n, smem, regs = compile_count(_qdq_rows_kernel, qsig, consts, ("M", "K"), num_warps=8)
        rows.append(dict(kernel="qdq_rows", variant=f"{name} K=4096", sass_static=n, shared=smem, **regs))
    # the group dequantization (MXFP8 operands from 256 rows, gemm_blockscaled.mxfp8_dequant_gemm), as
    # dequantize_groups launches it; per_element = static instructions / codes per thread
    from lowbit.ops.triton.dequant import _group_dequant_kernel    # optional: triton

    gdsig = {"C": "*u8", "SC": "*u8", "OUT": "*bf16", "R": "i32", "K": "i32", "s_c": "i32", "s_sc": "i32",
             "s_o": "i32"}
    for name, ef, sf, G in (("mxfp8 e4m3 x e8m0", 0, 2, 32), ("nvfp4 e2m1 x e4m3", 1, 3, 16)):
        n, smem, regs = compile_count(_group_dequant_kernel, gdsig,
                                      dict(EFMT=ef, SFMT=sf, G=G, BLOCK_R=16, GROUPS=256 // G), ("R",), num_warps=4)
        rows.append(dict(kernel="group_dequant", variant=f"{name} 16 x 256", sass_static=n,
                         per_element=round(n / (16 * 256 / 128), 1), shared=smem, **regs))
    # the large-M W4A16 path's passes: the pairs dequantization (at PAIRS_DEQUANT) and the NVFP4 output scale

    bn, chunks, warps = PAIRS_DEQUANT
    dsig = {"W": "*i32", "S": "*fp32", "Z": "*i8", "OUT": "*bf16", "N": "i32", "s_wn": "i32", "s_sn": "i32",
            "s_on": "i32"}
    for name, wf, G in (("int4 g128", 0, 128), ("mxfp4", 2, 32), ("nvfp4", 3, 16)):
        n, smem, regs = compile_count(w4._pairs_dequant_kernel, dict(dsig, S="*fp32" if wf == 0 else "*u8"),
                                      dict(WFMT=wf, HAS_Z=False, G=G, BLOCK_N=bn, CHUNKS=chunks), ("N",),
                                      num_warps=warps)
        rows.append(dict(kernel="pairs_dequant", variant=f"{name} {PAIRS_DEQUANT}", sass_static=n, shared=smem,
                         **regs))
    osig = {"Y": "*bf16", "S": "*fp32", "BIAS": "*bf16", "OUT": "*bf16", "M": "i32", "N": "i32", "s_y": "i32",
            "s_o": "i32"}
    n, smem, regs = compile_count(w4._scale_output_kernel, osig,
                                  dict(ROWS=True, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=256, INTERP=False), ("M", "N"),
                                  num_warps=4)
    rows.append(dict(kernel="scale_output", variant="per-row scale + bias", sass_static=n, shared=smem, **regs))
    sig = {"X": "*bf16", "W": "*u8", "S": "*fp32", "Z": "*i8", "SC": "*u8", "GS": "*fp32", "BIAS": "*fp32",
           "OUT": "*bf16", "M": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32", "s_xm": "i32", "s_wn": "i32",
           "s_sn": "i32", "s_om": "i32"}

    # what pick_config chooses for the benchmark's decode shapes, per weight format
    for M in W4_MS:
        for wf, kind, G, C in ((0, "int4", 128, 128), (0, "int4", 32, 32), (2, "mxfp4", 32, 128),
                               (3, "nvfp4", 16, 128)):
            cfg = pick_config(M, 8192, 8192, kind, G, C)
            consts = dict(WFMT=wf, HAS_Z=False, HAS_BIAS=False, G=G, C=C, BLOCK_M=cfg["BLOCK_M"],
                          BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PARTIAL=cfg["split"] > 1,
                          USE_DOT=cfg["kernel"] == "dot", INTERP=False)
            if consts["PARTIAL"]:
                sig = dict(sig, OUT="*fp32")
            try:
                n, smem, _ = compile_count(w4._w4a16_kernel, sig, consts, ("M", "N"), num_warps=cfg["num_warps"],
                                           num_stages=cfg["num_stages"])
            except Exception as exc:  # noqa: BLE001 -- reported
                n, smem = None, f"{type(exc).__name__}: {str(exc)[-400:]}"
            sig = dict(sig, OUT="*bf16")
            rows.append(dict(kernel=f"w4a16 {kind} g{G}", variant=f"M{M} {cfg}", sass_static=n, shared=smem,
                             fits=isinstance(smem, int) and smem <= 232448))

    rows += sass_rows_gemv8()  # the gemv8 W4A16 kernel, with its K loop's instructions per weight
    for r in rows:
        print(json.dumps(r))
    return rows
