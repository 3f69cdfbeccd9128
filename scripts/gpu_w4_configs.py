"""The W4A16 "pairs" kernel under a few configurations against bf16 torch.mm, on the GPU, in one
process (the memory bench's timer: CUDA graphs, rotating weights so that no run reads the last
one's from L2). Prints one line per (format, shape, M, config) and the best per row; writes JSON.

    PYTHONPATH=src python scripts/gpu_w4_configs.py OUT.json          # (bash scripts/gpu.sh w4configs)

Every configuration's output is compared with the default configuration's (the same sums up to
the split-K order: a relative difference above 1e-2 of the output's scale is reported as WRONG)."""
from __future__ import annotations

import json
import os
import sys

import torch

from lowbit.bench.memory import W4_MS, W4_NK
from lowbit.profiling.timing import bench_ms, rotating_count
from lowbit.ops.weight_only import pick_config_pairs, prepare_w4, w4a16_linear
from lowbit.quantize import quantize
from lowbit.scheme import QuantScheme, get_preset

KINDS = {"int4_g128": get_preset("int4_g128"), "int4_g32": QuantScheme("int4", "group", group_size=32),
         "mxfp4": get_preset("mxfp4"), "nvfp4": get_preset("nvfp4")}
# W4CONFIGS_KINDS=int4_g128,nvfp4 / W4CONFIGS_MS=1 narrow the run; W4CONFIGS_SET=xpf: the x prefetch's set
KINDS = {k: v for k, v in KINDS.items() if k in os.environ.get("W4CONFIGS_KINDS", ",".join(KINDS)).split(",")}
MS = tuple(int(m) for m in os.environ.get("W4CONFIGS_MS", ",".join(map(str, W4_MS))).split(","))


def configs(M: int, N: int, K: int, G: int) -> dict:
    """The default (pick_config_pairs) against a few registers-per-thread caps, splits and tiles."""
    if os.environ.get("W4CONFIGS_SET") == "xpf":  # the L1 prefetch of x on / off, and a split around it
        if M > 16:
            return {"default": {}, "xpf": dict(xpf=1)}
        return {"default": {}, "no-xpf": dict(xpf=0), "s8": dict(split=8),
                f"BN{64 if M == 1 else 128}": dict(BLOCK_N=64 if M == 1 else 128)}
    if M == 1:
        return {"default": {}, "r168": dict(maxnreg=168), "r128": dict(maxnreg=128), "s8": dict(split=8),
                "s8/r168": dict(split=8, maxnreg=168), "s2": dict(split=2), "BK128": dict(BLOCK_K=128),
                "BN256/w8/r168": dict(BLOCK_N=256, num_warps=8, maxnreg=168)}
    if M <= 16:
        return {"default": {}, "r128": dict(maxnreg=128), "BK128": dict(BLOCK_K=128), "BN128": dict(BLOCK_N=128),
                "st1": dict(num_stages=1)}
    return {"default": {}, "BK256": dict(BLOCK_K=256), "st1": dict(num_stages=1), "BN64": dict(BLOCK_N=64)}


def main(path: str) -> None:
    rows = []
    for N, K in W4_NK:
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(rotating_count(N * K * 2))]
        for name, sch in KINDS.items():
            n = rotating_count(N * K // 2)
            ws = [prepare_w4(quantize(torch.randn(N, K, device="cuda") * 0.02, sch), layout="pairs") for _ in range(n)]
            G = ws[0].group_size
            for M in MS:
                xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(n, len(wb)))]
                t_bf = bench_ms(lambda x, w: torch.mm(x, w.t()), [(xs[i], wb[i]) for i in range(len(wb))],
                                cuda_graph=True)
                ref = w4a16_linear(xs[0], ws[0]).float()
                scale = ref.abs().max().item()
                best = None
                for label, cfg in configs(M, N, K, G).items():
                    try:
                        out = w4a16_linear(xs[0], ws[0], config=cfg or None).float()
                        wrong = (out - ref).abs().max().item() > 1e-2 * scale
                        t = bench_ms(lambda x, w: w4a16_linear(x, w, config=cfg or None),
                                     [(xs[i], ws[i]) for i in range(n)], cuda_graph=True)
                    except Exception as exc:  # noqa: BLE001 -- one config must not hide the others
                        print(f"{name} N{N} K{K} M{M} {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                        continue
                    r = dict(kind=name, N=N, K=K, M=M, config=label, cfg=cfg, us=t * 1e3, vs_bf16=t_bf / t,
                             bf16_us=t_bf * 1e3, wrong=wrong)
                    rows.append(r)
                    if not wrong and (best is None or t < best["us"] / 1e3):
                        best = r
                    print(f"{name} N{N} K{K} M{M} {label}: {t * 1e3:.1f} us {t_bf / t:.2f}x bf16"
                          + (" WRONG" if wrong else ""), flush=True)
                d = next(r for r in rows if r["kind"] == name and r["N"] == N and r["M"] == M and r["config"] == "default")
                print(f"== {name} N{N} K{K} M{M}: default {d['vs_bf16']:.2f}x, best {best['config']} "
                      f"{best['vs_bf16']:.2f}x", flush=True)
                with open(path, "w") as f:
                    json.dump(rows, f, indent=1)
            del ws
        del wb
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "w4_configs.json")
