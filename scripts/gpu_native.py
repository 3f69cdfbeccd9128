"""lowbit's native decode kernels on a Hopper GPU: each kernel checked, then timed against the copy bandwidth.

    LOWBIT_NATIVE_LIB=.native/liblowbit_native.so python scripts/gpu_native.py OUT.json   (scripts/gpu.sh native)

Checks (every kernel, odd shapes and the Llama-3-8B shapes; each launch variant's output against the default
launch's bits; the dequantization against torch's per-weight rounding): W4A16 / W8A16 / W8A8 fp8 against lowbit's float64
reference (check_quantized, float32-accumulator gate); W8A8 int8 bit for bit against torch's exact integer
product and the documented epilogue; the activation codes bit for bit against lowbit.quantize; at the odd
shapes, every kernel against its CPU twin (bit for bit for int8, the largest difference in bf16 ulps else).
Timing: one CUDA graph of back-to-back calls cycling through weight copies that together exceed L2, replayed;
time per call = replay time / calls (median of replays). Weight bytes (codes + scales + zero points) per second
over the device-to-device copy bandwidth (2 x bytes / time of a 1 GiB copy, same method, same process) is the
"fraction of copy"; bf16 F.linear on the same shapes is timed the same way. A short table last, JSON in OUT.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

import lowbit as lb
from lowbit.ops.native import kernels as nk
from lowbit.ops.native.library import unavailable_reason
from lowbit.verify.check import check_quantized

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (28672, 4096)]   # (N, K): qkv, o, up, down, gate_up
ODD = [(1, 40, 384), (7, 100, 1152), (13, 333, 2176)]                                   # (M, N, K) for the twin
ODD_VARIANTS = [{}, dict(nt=2, prefetch=True, fixup=True), dict(nt=4, fixup=True)]
MS = [int(m) for m in os.environ.get("NATIVE_MS", "1,16").split(",")]
L2_BYTES = 60 * 2**20
T0 = time.time()
BUDGET = float(os.environ.get("NATIVE_BUDGET", "400"))    # seconds: later timings are skipped past it


def graph_time_us(calls, reps: int = 10) -> float:
    """Median microseconds per call of `calls` (a list of no-argument callables) captured back to back."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(calls))
    return statistics.median(times)


def copy_gbps() -> float:
    n = 2**30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    us = graph_time_us([lambda: dst.copy_(src)] * 4)
    return 2 * n / us / 1e3


def copies(nbytes: int) -> int:
    return max(2, min(24, -(-3 * L2_BYTES // nbytes)))


def weight_bytes(w) -> int:
    ts = [w.packed, w.scale] + ([w.zero] if getattr(w, "zero", None) is not None else [])
    return sum(t.numel() * t.element_size() for t in ts)


KINDS = {  # name: (weight preset, activation preset or None, prepare, run, twin)
    "w4a16_g128": ("int4_g128", None, nk.prepare_w4, nk.w4a16, nk.twin_w4a16),
    "w4a16_g128_zp": ("int4_g128_asym", None, nk.prepare_w4, nk.w4a16, nk.twin_w4a16),
    "w4a16_g32": (lb.QuantScheme(format="int4", strategy="group", group_size=32), None, nk.prepare_w4, nk.w4a16,
                  nk.twin_w4a16),
    "w8a16_int8": ("int8_channel", None, nk.prepare_w8, nk.w8a16, nk.twin_w8a16),
    "w8a8_int8": ("int8_channel", "int8_token", nk.prepare_w8, nk.w8a8, nk.twin_w8a8),
    "w8a8_fp8": ("fp8_row", "fp8_row", nk.prepare_w8, nk.w8a8, nk.twin_w8a8),
}


def scheme(s):
    return lb.get_preset(s) if isinstance(s, str) else s


def check(kind: str, x: torch.Tensor, wq, y: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[bool, str]:
    wp, ap = KINDS[kind][:2]
    if kind == "w8a8_int8":
        xq = lb.quantize(x.float(), lb.get_preset(ap))
        acc = (xq.codes.double() @ wq.codes.double().T).float()
        want = (acc * xq.scale) * wq.scale.reshape(1, -1)
        want = (want if bias is None else want + bias.float()).bfloat16()
        diff = int((y != want).sum())
        return diff == 0, f"bit-exact: {diff} of {y.numel()} differ"
    xs = lb.quantize(x.float().cpu(), lb.get_preset(ap)) if ap else x.double().cpu()
    v = check_quantized(y.cpu(), xs, wq.to("cpu"), accumulator="fp32", bias=None if bias is None else bias.double())
    return v.passed, v.kind


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


def variant_name(v: dict) -> str:
    return (f"S={v['splits']} nt={v['nt']}" + (" pf" if v["prefetch"] else "") + (" fixup" if v["fixup"] else ""))


def sweep(run, x, w, ws, y_default):
    """Launch variants of one cell, searched coordinate by coordinate (the full product is ~60 per cell): the
    splits, then the prefetch, then 2 and 4 row tiles per CTA (with the splits doubled as well: fewer CTAs),
    then the in-kernel split fixup for every multi-split variant so far. Yields (variant, us per call, whether
    its output has the default launch's bits: every variant keeps the summation order)."""
    tiles, kb = -(-w.N // 16), w.kblocks
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_s = max(1, kb // 2)
    seen = {}

    def time_it(splits, nt=1, prefetch=False, fixup=False):
        v = dict(splits=splits, nt=nt, prefetch=prefetch, fixup=fixup)
        key = tuple(v.values())
        if splits > max_s or key in seen:
            return seen.get(key, (None, float("inf")))[1]
        kw = dict(nt=nt, prefetch=prefetch, fixup=fixup)
        same = torch.equal(run(x, w, splits, **kw).view(torch.int16), y_default.view(torch.int16))
        us = graph_time_us([lambda w=w_: run(x, w, splits, **kw) for w_ in ws])
        seen[key] = (same, us)
        return us

    for S in sorted({nk.default_splits(tiles, kb, sms), 1, 2, 4, 8}):
        time_it(S)
    best = lambda: min(seen.items(), key=lambda kv: kv[1][1])[0]   # noqa: E731
    S, _, _, _ = best()
    time_it(S, prefetch=True)
    pf = best()[2]
    for nt in (2, 4):
        for s2 in (S, 2 * S):
            time_it(s2, nt, pf)
    for (s2, nt, p, fx) in list(seen):
        if s2 > 1 and not fx:
            time_it(s2, nt, p, True)
    for (s2, nt, p, fx), (same, us) in seen.items():
        yield dict(splits=s2, nt=nt, prefetch=p, fixup=fx), us, same


def main(out_path: str) -> int:
    reason = unavailable_reason()
    if reason:
        print(f"native kernels unavailable: {reason}")
        return 1
    torch.manual_seed(0)
    bw = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bw:.0f} GB/s", flush=True)
    rows, checks = [], []
    for kind, (wp, ap, prep, run, twin) in KINDS.items():   # correctness: odd shapes vs the twin, quantizer
        for M, N, K in ODD:
            wq = lb.quantize(torch.randn(N, K), scheme(wp))
            x = torch.randn(M, K, dtype=torch.bfloat16)
            w_cpu, w_gpu = prep(wq), prep(wq.to("cuda"))
            biases = (None, None, torch.randn(N) * 4, (torch.randn(N) * 4).bfloat16())   # none, float32, bf16
            for splits, bias in zip((1, 3, 3, 1), biases):
                t = twin(x, w_cpu, splits, bias=bias)
                b = "none" if bias is None else str(bias.dtype).removeprefix("torch.")
                for var in ODD_VARIANTS:    # every launch variant keeps the order: the twin's bits on the GPU too
                    y = run(x.cuda(), w_gpu, splits, bias=None if bias is None else bias.cuda(), **var).cpu()
                    ok, how = check(kind, x, wq, y, bias)
                    d = ulps(y, t)
                    exact = kind == "w8a8_int8"
                    checks.append(dict(kernel=kind, M=M, N=N, K=K, splits=splits, bias=b, **var,
                                       passed=ok and (d == 0 or not exact), verdict=how, twin_max_ulps=d))
                    print(f"check {kind:14s} M={M:2d} N={N:4d} K={K:5d} S={splits} {var} bias {b:8s}: {how}, "
                          f"twin max {d} ulps", flush=True)
    for kind in ("w4a16_g128", "w4a16_g128_zp", "w4a16_g32", "w8a16_int8"):   # the large-M path's weights
        wp, _, prep = KINDS[kind][:3]
        for N, K in ((333, 2176), (4096, 4096)):
            wq = lb.quantize(torch.randn(N, K, device="cuda"), scheme(wp))
            z = 0 if wq.zero_point is None else wq.expanded_zero_point().float()
            sc = wq.expanded_scale().float() if kind.startswith("w4") else wq.scale.reshape(N, 1).float()
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                want = ((wq.codes.float() - z) * sc).to(dt)       # each weight rounded once, by torch
                ok = torch.equal(nk.dequantize(prep(wq), dt).view(torch.uint8), want.view(torch.uint8))
                checks.append(dict(kernel=f"dequant_{kind}", N=N, K=K, dtype=str(dt), passed=ok,
                                   verdict="bit-exact" if ok else "differs"))
                print(f"check dequantize {kind} {N}x{K} {dt}: {'bit-exact' if ok else 'DIFFERS'}", flush=True)
    for fp8, preset in ((False, "int8_token"), (True, "fp8_row")):
        x = torch.randn(16, 4096, dtype=torch.bfloat16, device="cuda") * 3
        codes, sa = nk.act_quant(x, fp8)
        q = lb.quantize(x.float(), lb.get_preset(preset))
        ok = torch.equal(codes, q.codes.view(torch.uint8)) and torch.equal(sa, q.scale.reshape(-1))
        checks.append(dict(kernel=f"act_quant_{'fp8' if fp8 else 'int8'}", passed=ok, verdict="bit-exact" if ok else "differs"))
        print(f"check act_quant {'fp8' if fp8 else 'int8'}: {'bit-exact' if ok else 'DIFFERS'}", flush=True)
    for N, K in SHAPES:
        wf = torch.randn(N, K, device="cuda") * 0.02
        wb = wf.bfloat16()
        for kind, (wp, ap, prep, run, _) in KINDS.items():
            wq = lb.quantize(wf, scheme(wp))
            w = prep(wq)
            nb = weight_bytes(w)
            ws = [w] + [prep(lb.quantize(torch.randn(N, K, device="cuda") * 0.02, scheme(wp))) for _ in range(copies(nb) - 1)]
            for M in MS:
                x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
                y = run(x, w)
                ok, how = check(kind, x, wq, y)
                if time.time() - T0 > BUDGET:
                    print(f"skip timing {kind} {N}x{K} M={M}: past NATIVE_BUDGET", flush=True)
                    continue
                bws = [wb] + [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies(N * K * 2) - 1)]
                us_b = graph_time_us([lambda w=w_: torch.nn.functional.linear(x, w) for w_ in bws])
                cell = []
                for v, us, same in sweep(run, x, w, ws, y):
                    cell.append(dict(kernel=kind, N=N, K=K, M=M, **v, us=us, weight_bytes=nb, frac_copy=nb / us / 1e3 / bw,
                                     check=how if same else f"{how}; differs from the default launch's bits",
                                     passed=ok and same, bf16_us=us_b, vs_bf16=us_b / us))
                rows += cell
                b = min(cell, key=lambda r: r["us"])
                print(f"{kind:14s} N={N:5d} K={K:5d} M={M:2d}: best {variant_name(b)} {b['us']:7.1f} us, "
                      f"{b['frac_copy']:5.1%} of copy, {b['vs_bf16']:.2f}x bf16 ({us_b:.1f} us); {how}; "
                      f"{sum(not r['passed'] for r in cell)} of {len(cell)} variants failed", flush=True)
            del ws
        json.dump(dict(device=torch.cuda.get_device_name(), copy_gbps=bw, checks=checks, rows=rows), open(out_path, "w"), indent=1)
    json.dump(dict(device=torch.cuda.get_device_name(), copy_gbps=bw, checks=checks, rows=rows), open(out_path, "w"), indent=1)
    print(f"\n# native decode kernels: the best launch variant per row; fraction of the {bw:.0f} GB/s copy in weight bytes/s")
    print(f"{'kernel':14s} {'N x K':>12s} {'M':>3s} {'variant':>22s} {'us':>8s} {'% copy':>7s} {'vs bf16':>8s}  check")
    best_rows = {}
    for r in rows:
        k = (r["kernel"], r["N"], r["K"], r["M"])
        if k not in best_rows or r["us"] < best_rows[k]["us"]:
            best_rows[k] = r
    for r in best_rows.values():
        print(f"{r['kernel']:14s} {r['N']:>5d}x{r['K']:<6d} {r['M']:3d} {variant_name(r):>22s} {r['us']:8.1f} {r['frac_copy']:7.1%} "
              f"{r.get('vs_bf16', float('nan')):7.2f}x  {r['check']}")
    bad = [c for c in checks if not c["passed"]] + [r for r in rows if not r["passed"]]
    print(f"checks: {len(checks) + len(rows) - len(bad)} passed, {len(bad)} failed (every timed variant's output included)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "native.json"))
