"""The W4A16 section of lowbit.bench.memory: weight-only 4-bit decode GEMM next to bf16
torch.mm and tinygemm (torch._weight_int4pack_mm, group 128), in the same process.

Rows (shape "M{M} N{N} K{K}", M in W4_MS, (N, K) in W4_NK):
  bf16_mm, tinygemm_int4_g128                  baselines
  lowbit_w4a16_<kind>                          the library default (prepare_w4's "auto" layout: "pairs"
                                               for int4 g128 sym / asym and g32, planar chunks for
                                               MXFP4 / NVFP4)
  lowbit_w4a16_<int4 kind>_planar              int4 in the planar-chunks layout (the default before
                                               "pairs"; pick_config: tensor-core form)
  lowbit_w4a16_int4_g128_gemv8 (M = 1),         the same weights in the planar8 layout with its
  lowbit_w4a16_int4_g128_dot8 (M = 16, 64)     heuristic (pick_config_planar8: the "gemv8" kernel
                                               at M <= 4, the tensor-core "dot8" above)
  lowbit_w4a16_int4_g128_asym_gemv8 / _dot8    the same with zero points
  lowbit_w4a16_int4_g128_pairs_best            best of a small sweep of the "pairs" kernel (tensor
                                               cores fed from registers) at M = 1, 16 and 64
  (`sweep_us` of a _best row holds every point of its sweep)
Each lowbit row has vs_bf16 / vs_tinygemm (baseline ms / ms) and `check`, the relative L2
difference to bf16 torch.mm on the dequantized weight (bf16 rounding of that baseline, ~0.003).
"""
from __future__ import annotations

import torch

from lowbit.bench.common import log as _log, rel_l2
from lowbit.bench.sm90 import SHARED_LIMIT, compile_sm90
from lowbit.ops.weight_only import pick_config, pick_config_pairs, pick_config_planar8, prepare_w4, w4a16_linear
from lowbit.profiling.timing import bench_ms, rotating_count
from lowbit.quantize import quantize
from lowbit.scheme import QuantScheme, get_preset

W4_NK = ((8192, 8192), (28672, 8192))   # (N, K): Llama-3-8B's square and MLP-up shapes
W4_MS = (1, 16, 64)
# pairs sweep (M = 1, 16, 64): (BLOCK_N, BLOCK_K, num_warps, split, num_stages); None = the heuristic's
PAIRS_SWEEP = ((128, None, 4, None, None), (128, 128, 4, None, None), (128, None, 4, 4, None),
               (128, None, 4, 8, None), (128, 128, 4, 16, None), (128, None, 4, 16, None), (256, None, 8, None, None),
               (64, None, 4, None, None), (64, 128, 4, 8, None), (64, None, 2, None, None), (32, None, 2, 8, None),
               (128, None, 4, None, 1), (128, None, 4, None, 2))


def _tinygemm_inputs(N: int, K: int, dev: str, G: int = 128):
    codes = torch.randint(0, 16, (N, K), device=dev, dtype=torch.int32)
    packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    w = torch._convert_weight_to_int4pack(packed, 8)
    sz = torch.randn(K // G, N, 2, device=dev, dtype=torch.bfloat16) * 0.01
    return w, sz


def _best_row(b, name, shape, nbytes, points: dict, swept: str, bases: dict, check=None) -> None:
    """Append the fastest of `points` ({label: (ms, config)}) as one row; check(config), if
    given, is the winner's relative L2 difference to the bf16 baseline (a fast wrong
    configuration shows)."""

    if not points:
        return
    label, (ms, cfg) = min(points.items(), key=lambda kv: kv[1][0])
    rs = dict(name=name, shape=shape, ms=ms, GBps=nbytes / ms / 1e6, bytes=nbytes, config=cfg, swept=swept,
              sweep_us={k: round(v[0] * 1e3, 1) for k, v in points.items()})
    if b.copy_gbps:
        rs["frac_copy"] = rs["GBps"] / b.copy_gbps
    b.ratios(rs, bases)
    if check is not None:
        rs["check"] = check(cfg)
    b.rows.append(rs)
    _log(f"    sweep (us): {rs['sweep_us']}")
    _log(f"  {name:28s} {shape:>22s} {ms * 1e3:9.1f} us  ({label})")


def _sweep(sets, configs: dict) -> dict:
    """{label: (ms, config)} for each feasible config (short timings)."""
    out = {}
    for label, cfg in configs.items():
        try:
            ms = bench_ms(lambda x, w, c=cfg: w4a16_linear(x, w, config=c), sets, cuda_graph=True, warmup=10, rep=40)
        except Exception as exc:  # noqa: BLE001 -- an infeasible config is reported and skipped
            _log(f"    sweep {label}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        out[label] = (ms, cfg)
    return out


def w4a16_section(b, quick: bool, sweep: bool = True, dev: str = "cuda") -> None:
    """All W4A16 rows (module docstring) into the bench `b` (lowbit.bench.memory._Bench)."""
    kinds = {"int4_g128": get_preset("int4_g128"), "int4_g128_asym": get_preset("int4_g128_asym"),
             "int4_g32": QuantScheme("int4", "group", group_size=32), "mxfp4": get_preset("mxfp4"),
             "nvfp4": get_preset("nvfp4")}
    if quick:
        kinds = {"int4_g128": kinds["int4_g128"]}
    for (N, K) in W4_NK[:1] if quick else W4_NK:
        n = rotating_count(N * K // 2)
        ws, ws8, wsp = {}, {}, {}
        for name, sch in kinds.items():
            if b.wanted(f"w4a16_{name}"):
                qs = [quantize(torch.randn(N, K, device=dev) * 0.02, sch) for _ in range(n)]
                ws[name] = [prepare_w4(q) for q in qs]
                if name in ("int4_g128", "int4_g128_asym"):  # the same weights in the gemv8 layout
                    ws8[name] = [prepare_w4(q, layout="planar8") for q in qs]
                if ws[name][0].layout == "pairs":  # ... and in the planar-chunks layout (the earlier default)
                    wsp[name] = [prepare_w4(q, layout="planar_chunks") for q in qs]
                del qs
        wb = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
              for _ in range(rotating_count(N * K * 2))]
        try:
            tg, tg_err = [_tinygemm_inputs(N, K, dev) for _ in range(n)], None
        except Exception as exc:  # noqa: BLE001 -- reported in the tinygemm rows
            tg, tg_err = None, exc
        for M in W4_MS:
            shape = f"M{M} N{N} K{K}"
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(max(len(wb), n))]
            io = M * K * 2 + M * N * 2
            r_bf = b.time("bf16_mm", shape, lambda x, w: torch.mm(x, w.t()),
                          [(xs[i], wb[i]) for i in range(len(wb))], N * K * 2 + io)
            if tg is None:
                r_tg = dict(name="tinygemm_int4_g128", shape=shape, ms=None, error=f"unavailable: {str(tg_err)[:120]}")
                b.rows.append(r_tg)
            else:
                r_tg = b.time("tinygemm_int4_g128", shape, lambda x, w, sz: torch._weight_int4pack_mm(x, w, 128, sz),
                              [(xs[i], *tg[i]) for i in range(n)], N * K // 2 + (K // 128) * N * 4 + io)
            bases = {"bf16": r_bf, "tinygemm": r_tg}
            for name, wl in ws.items():
                w0 = wl[0]
                G = w0.group_size
                per_group = 4 + (1 if w0.zero_point is not None else 0) if name.startswith("int4") else 1
                nbytes = N * K // 2 + N * (K // G) * per_group + io
                ref = torch.mm(xs[0], w0.qtensor.dequantize(torch.bfloat16).t())
                sets = [(xs[i], wl[i]) for i in range(n)]
                r = b.time(f"lowbit_w4a16_{name}", shape, lambda x, w: w4a16_linear(x, w), sets, nbytes,
                           layout=w0.layout, config=pick_config_pairs(M, N, K, G, kind=w0.kind) if w0.layout == "pairs"
                           else pick_config(M, N, K, w0.kind, G, w0.chunk))
                b.ratios(r, bases)
                if r and r.get("ms"):  # against bf16 torch.mm on the dequantized weight
                    r["check"] = _rel(w4a16_linear(xs[0], w0), ref)
                if name in ws8:
                    sets8 = [(xs[i], ws8[name][i]) for i in range(n)]
                    cfg8 = pick_config_planar8(M, N, K, G)
                    r8 = b.time(f"lowbit_w4a16_{name}_{cfg8['kernel']}", shape, lambda x, w: w4a16_linear(x, w),
                                sets8, nbytes, config=cfg8)
                    b.ratios(r8, bases)
                    if r8 and r8.get("ms"):
                        r8["check"] = _rel(w4a16_linear(xs[0], ws8[name][0]), ref)
                if name in wsp:
                    setsp = [(xs[i], wsp[name][i]) for i in range(n)]
                    rp = b.time(f"lowbit_w4a16_{name}_planar", shape, lambda x, w: w4a16_linear(x, w), setsp,
                                nbytes, config=pick_config(M, N, K, w0.kind, G, wsp[name][0].chunk))
                    b.ratios(rp, bases)
                    if rp and rp.get("ms"):
                        rp["check"] = _rel(w4a16_linear(xs[0], wsp[name][0]), ref)
                    if sweep and name == "int4_g128" and w0.layout == "pairs":
                        base = pick_config_pairs(M, N, K, G, kind=w0.kind)
                        cfgs = {}
                        for bn, bk, warps, sp, st in PAIRS_SWEEP:
                            c = dict(base, BLOCK_N=bn, num_warps=warps, num_stages=base["num_stages"] if st is None else st)
                            c["BLOCK_K"] = base["BLOCK_K"] if bk is None else bk
                            c["split"] = base["split"] if sp is None else sp
                            cfgs[f"pairs/BN{bn}/BK{c['BLOCK_K']}/w{warps}/split{c['split']}/st{c['num_stages']}"] = c
                        pts = _sweep(sets, cfgs)
                        _best_row(b, "lowbit_w4a16_int4_g128_pairs_best", shape, nbytes, pts,
                                  "pairs BLOCK_N x BLOCK_K x num_warps x split x num_stages: " + ", ".join(cfgs), bases,
                                  check=lambda c: _rel(w4a16_linear(xs[0], w0, config=c), ref))
            del xs
        del ws, ws8, wsp, wb, tg


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return rel_l2(a, b)


def _inner_loop(sass: str) -> list[str]:
    """Opcodes of the SASS between the last backward branch and its target (the K loop)."""
    import re

    ins = [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines()
           for m in [re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line)] if m]
    loop = []
    for addr, text in ins:
        m = re.search(r"\bBRA\s+(?:`\([^)]*\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            loop = [re.sub(r"^@!?U?P\w+\s+", "", t).split(" ")[0].split(".")[0] for a, t in ins if lo <= a <= addr]
    return loop


def sass_rows_gemv8() -> list[dict]:
    """Compile the planar8 kernels (gemv8 / dot8) for sm_90 (no GPU: Triton's bundled ptxas) at the configurations
    pick_config_planar8 chooses for the bench's shapes and count the SASS of its K loop per
    weight (instructions one thread issues per loop step / weights it handles per step):
    how close the unpack + FMA work is to the design's ~3 per weight. Rows for
    `python -m lowbit.bench.memory --sass` (which the CI test checks: compiles, fits)."""
    import collections

    from lowbit.ops.triton import w4a16 as w4    # optional: triton

    rows = []
    N, K = W4_NK[0]
    # the heuristic's choice at each M, then dot8's packed-pair unpacking (inline PTX) at 16 rows
    variants = [(M, has_z, "*bf16", pick_config_planar8(M, N, K, 128)) for M in W4_MS for has_z in (False, True)]
    variants += [(16, has_z, xt, dict(pick_config_planar8(16, N, K, 128), unpack=1))
                 for has_z in (False, True) for xt in ("*bf16", "*fp16")]
    # the "pairs" kernel (layout="pairs") at the heuristic's choice for every M, and in fp16
    variants += [(M, has_z, "*bf16", pick_config_pairs(M, N, K, 128)) for M in W4_MS for has_z in (False, True)]
    variants += [(1, False, "*fp16", pick_config_pairs(1, N, K, 128))]
    variants = [v + ("int4",) for v in variants]
    # fp4 weights in the pairs kernel, block scales folded into the bf16 weights (MXFP4: one block
    # per plane; NVFP4: two), and MXFP4's unfolded fallback at one row
    variants += [(M, False, "*bf16", pick_config_pairs(M, N, K, G, kind=kind), kind)
                 for kind, G in (("mxfp4", 32), ("nvfp4", 16)) for M in W4_MS]
    variants += [(1, False, "*bf16", pick_config_pairs(1, N, K, 32, kind="mxfp4"), "mxfp4 unfolded")]
    # NVFP4 layers merged along N (lowbit.nn.shared_input): per-row weight and activation tensor scales
    variants += [(M, False, "*bf16", pick_config_pairs(M, N, K, 16, kind="nvfp4"), "nvfp4 merged") for M in (1, 16)]
    for M, has_z, xt, cfg, kind in variants:
        fn = {"gemv8": w4._w4a16_gemv8_kernel, "dot8": w4._w4a16_dot8_kernel,
              "pairs": w4._w4a16_pairs_kernel}[cfg["kernel"]]
        sig = {"X": xt, "W": "*i32", "S": "*fp32", "Z": "*i8", "BIAS": "*fp32",
               "OUT": "*fp32" if cfg["split"] > 1 else "*bf16", "M": "i32", "N": "i32", "K": "i32",
               "K_SPLIT": "i32", "s_xm": "i32", "s_wn": "i32", "s_sn": "i32", "s_om": "i32"}
        consts = dict(SIGNED=kind == "int4", HAS_Z=has_z, HAS_BIAS=False, C=128, BLOCK_M=cfg["BLOCK_M"],
                      BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PARTIAL=cfg["split"] > 1, INTERP=False)
        if cfg["kernel"] == "gemv8":
            consts.update(EVEN_N=True, EVEN_M=M % cfg["BLOCK_M"] == 0)
        elif cfg["kernel"] == "pairs":
            del consts["C"], consts["PARTIAL"], consts["SIGNED"]
            wk = kind.split()[0]
            consts.update(WFMT=w4.WFMT[wk], FOLD="unfolded" not in kind, GS_ROWS="merged" in kind, HAS_GX="merged" in kind,
                          G={"int4": 128, "mxfp4": 32, "nvfp4": 16}[wk],
                          SPLIT=cfg["split"], WARPS=cfg["num_warps"], V3=cfg["BLOCK_M"] >= 16,
                          XPF=bool(cfg.get("xpf")))
            sig = dict(sig, OUT=xt, PART="*fp32", LOCK="*i32", GS="*fp32", GX="*fp32", DEXP="i32",
                       S="*fp32" if kind == "int4" else "*i32")
            sig = {k: sig[k] for k in ("X", "W", "S", "Z", "GS", "GX", "BIAS", "OUT", "PART", "LOCK", "M", "N", "K",
                                       "K_SPLIT", "DEXP", "s_xm", "s_wn", "s_sn", "s_om")}
        else:
            consts.update(UNPACK=cfg.get("unpack", 0))
        row = dict(kernel=f"w4a16 {cfg['kernel']} {kind if kind != 'int4' else 'int4 g128'}" + (" asym" if has_z else "")
                   + f" x {xt[1:]}",
                   variant=f"M{M} {cfg}")
        try:
            c = compile_sm90(fn, sig, consts, ("M", "N", "DEXP"), num_warps=cfg["num_warps"],
                             num_stages=cfg["num_stages"], **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
        except Exception as exc:  # noqa: BLE001 -- reported (the CI test then fails on it)
            rows.append(dict(row, sass_static=None, shared=f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        loop = _inner_loop(c["sass_text"])
        # weights one thread handles per loop step: BLOCK_N x BLOCK_K over the threads
        per_step = cfg["BLOCK_N"] * cfg["BLOCK_K"] // (32 * cfg["num_warps"])
        row.update(sass_static=c["sass"], shared=c["shared"], fits=c["shared"] <= SHARED_LIMIT,
                   **{k: c[k] for k in ("reg", "local") if c[k] is not None},
                   # gemv8 handles BLOCK_M rows of x per weight (instructions per weight and row)
                   loop_instr=len(loop), loop_instr_per_weight=round(
                       len(loop) / per_step / (cfg["BLOCK_M"] if cfg["kernel"] == "gemv8" else 1), 2),
                   loop_top=dict(collections.Counter(loop).most_common(8)),
                   # register shuffles in the K loop: layout conversions the pairs relabelling avoids
                   loop_shuffles=sum(1 for op in loop if op in ("SHFL", "SEL", "PRMT")))
        rows.append(row)
    return rows
