"""Where the time of one quantized Linear goes on the GPU: for each recipe (PROFILE_RECIPES, default
w4a16,mxfp4,nvfp4) and batch (PROFILE_M, default 1,16), the CUDA kernels of one eager forward of
a 4096 -> 14336 Linear (Llama-3-8B's gate_proj) under torch.profiler, per call, beside bf16's
one GEMM; then the CUDA-graph time of the same call (what a compiled decode pays). A device
script (bash scripts/gpu.sh profile); prints one table per case."""
import os

import torch

import lowbit.nn as lnn

N, K = int(os.environ.get("PROFILE_N", 14336)), int(os.environ.get("PROFILE_K", 4096))
recipes = os.environ.get("PROFILE_RECIPES", "w4a16,mxfp4,nvfp4").split(",")
Ms = [int(m) for m in os.environ.get("PROFILE_M", "1,16").split(",")]
dev = "cuda"
torch.manual_seed(0)
base = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False)).to(dev, torch.bfloat16)


def graph_us(fn, x, reps=200):
    """Mean time of fn(x) replayed from one CUDA graph (reps calls captured), in us."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1000 / (5 * reps)


for M in Ms:
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    bf = graph_us(base, x)
    print(f"== M={M} N={N} K={K}: bf16 graph {bf:.2f} us")
    for r in recipes:
        import copy
        m = copy.deepcopy(base)
        lnn.quantize_model(m, r)
        lnn.prepare_model(m)
        for _ in range(3):
            m(x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                m(x)
            torch.cuda.synchronize()
        ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        ev.sort(key=lambda e: -e.device_time_total)
        gu = graph_us(m, x)
        print(f"-- {r}: graph {gu:.2f} us ({bf / gu:.2f}x bf16); kernels per call:")
        for e in ev[:8]:
            print(f"   {e.count / 10:4.1f} x {e.device_time_total / e.count:8.2f} us  {e.key[:90]}")

if os.environ.get("PROFILE_DEQUANT") == "1":
    # the large-M path's weight dequantization (pairs layout) under a few (BLOCK_N, chunks, warps)
    from lowbit.ops import weight_only as wo
    from lowbit.ops.w4a16 import configs
    from lowbit.quantize import quantize
    from lowbit.scheme import get_preset

    def ev_us(fn, reps=50):
        fn()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps):
            fn()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) * 1000 / reps

    base_cfg = configs.PAIRS_DEQUANT
    for kind in ("int4_g128", "nvfp4"):
        for n, k in ((14336, 4096), (4096, 14336)):
            w4 = wo.prepare_w4(quantize(torch.randn(n, k, device=dev) * 0.02, get_preset(kind)))
            ref = wo.dequantize_w4(w4, torch.bfloat16)
            nbytes = n * k * 2 + w4.packed.numel() + w4.scale.numel() * 4
            line = []
            for cfg in ((64, 1, 4), (64, 4, 4), (128, 1, 4), (128, 2, 8), (32, 4, 4), (64, 2, 8), (128, 4, 8)):
                configs.PAIRS_DEQUANT = cfg
                ok = torch.equal(wo.dequantize_w4(w4, torch.bfloat16), ref)
                us = ev_us(lambda: wo.dequantize_w4(w4, torch.bfloat16))
                line.append(f"{cfg}: {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s{'' if ok else ' MISMATCH'}")
            configs.PAIRS_DEQUANT = base_cfg
            print(f"dequant {kind} {n}x{k}: " + " | ".join(line))
