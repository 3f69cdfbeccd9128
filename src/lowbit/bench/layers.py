"""One QuantLinear against bf16 `F.linear` at Llama-3-8B's layer shapes, per recipe and M:
the whole call in eager mode (what a user's model pays) and the same call replayed from a
CUDA graph (the GPU time alone), so the per-call overhead is the difference of the two.

    python -m lowbit.bench.layers [--json PATH] [--recipes a,b] [--m 1,16,2048]
"""
from __future__ import annotations

import argparse
import json
import sys

from lowbit.nn import QuantLinear
from lowbit.ops import prepared as runtime
from lowbit.profiling.timing import bench_ms
from lowbit.recipes.presets import RECIPES
from lowbit.workflows.job import parse_recipe

# (name, K, N): the merged q/k/v and gate/up GEMMs, o_proj and down_proj of Llama-3-8B
SHAPES = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096))


def run(only: str | None = None, quick: bool = False, recipes=None, ms=(1, 16, 2048)) -> list[dict]:
    import torch
    import torch.nn.functional as F

    names = [parse_recipe(r).name for r in recipes] if recipes else list(RECIPES)   # any letter case
    shapes = SHAPES[:2] if quick else SHAPES
    rows = []
    gen = torch.Generator().manual_seed(0)  # CPU: a failed graph capture cannot poison its state
    for sname, K, N in shapes:
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=gen)
        lin = lin.cuda()
        for M in ms:
            x = torch.randn(M, K, dtype=torch.bfloat16, generator=gen).cuda()
            inputs = [(x,)]
            base = bench_ms(lambda a: F.linear(a, lin.weight), inputs)
            base_g = bench_ms(lambda a: F.linear(a, lin.weight), inputs, cuda_graph=True)
            rows.append(dict(bench="layer", shape=sname, M=M, K=K, N=N, recipe="bf16",
                             eager_us=base * 1e3, graph_us=base_g * 1e3, vs_bf16=1.0, vs_bf16_graph=1.0))
            for name in names:
                if only and only not in name:
                    continue
                r = RECIPES[name]
                row = dict(bench="layer", shape=sname, M=M, K=K, N=N, recipe=name)
                try:
                    q = QuantLinear.from_linear(lin, r.weight, r.act).cuda()
                    y = q(x)
                    row["path"] = q.last_path
                    ref = F.linear(x.float(), lin.weight.float())
                    row["rel_err"] = float((y.float() - ref).norm() / ref.norm())
                    t = bench_ms(q, inputs)
                    row.update(eager_us=t * 1e3, vs_bf16=base / t)
                    tg = bench_ms(q, inputs, cuda_graph=True)
                    row.update(graph_us=tg * 1e3, vs_bf16_graph=base_g / tg, overhead=t / tg)
                    del q
                except Exception as e:  # noqa: BLE001 -- one recipe's failure is a row, not the end of the run
                    import traceback
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    print(traceback.format_exc(), flush=True)
                    torch.cuda.synchronize()
                rows.append(row)
                print(_fmt(row), flush=True)
            torch.cuda.empty_cache()
    return rows


def probe(n: int = 2000) -> list[dict]:
    """Host time per call (microseconds, no synchronisation inside the loop) of each piece of a
    QuantLinear's fast path at M = 1, K = 4096, N = 6144: where eager overhead comes from."""
    import time

    import torch
    import torch.nn.functional as F

    from lowbit.ops.triton.act_quant import launch_act_quant    # optional: triton
    from lowbit.ops.triton.gemm_int8 import launch_int8_gemm    # optional: triton

    K, N = 4096, 6144
    lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    r = RECIPES["w8a8-int8"]
    q = QuantLinear.from_linear(lin, r.weight, r.act).cuda()
    codes, s, _ = launch_act_quant(x, "int8")
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    ops = {k: getattr(q, "fast_" + k) for k in q.fast_spec.operands}
    q4 = QuantLinear.from_linear(lin, RECIPES["w4a16"].weight, None).cuda()
    pieces = {
        "F.linear bf16": lambda: F.linear(x, lin.weight),
        "torch.empty": lambda: torch.empty(1, N, device="cuda", dtype=torch.bfloat16),
        "launch_act_quant": lambda: launch_act_quant(x, "int8"),
        "launch_int8_gemm": lambda: launch_int8_gemm(codes, ops["w"], out, s, ops["w_scale"], None, None, None),
        "runtime.run w8a8": lambda: runtime.run(q.fast_spec, x, ops, None),
        "QuantLinear w8a8": lambda: q(x),
        "QuantLinear w4a16": lambda: q4(x),
        "torch.compiler.is_compiling": lambda: torch.compiler.is_compiling(),
    }
    rows = []
    for name, fn in pieces.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        rows.append(dict(bench="probe", piece=name, host_us=dt))
        print(f"probe {name:30s} {dt:7.1f} us/call (host)", flush=True)
    return rows


def _fmt(r: dict) -> str:
    if "graph_us" not in r:
        return f"{r['shape']:8s} M={r['M']:<5d} {r['recipe']:17s} ERROR {r.get('error')} (eager {r.get('eager_us', 0):.1f} us)"
    return (f"{r['shape']:8s} M={r['M']:<5d} {r['recipe']:17s} {r.get('path', ''):12s} eager {r['eager_us']:8.1f} us "
            f"graph {r['graph_us']:8.1f} us  vs bf16 {r['vs_bf16']:5.2f}x (graph {r['vs_bf16_graph']:5.2f}x) "
            f"err {r.get('rel_err', 0):.1e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--recipes", default=None)
    p.add_argument("--m", default="1,16,2048")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--probe", action="store_true", help="first, the host time of each piece of the fast path")
    a = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("lowbit.bench.layers needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = probe() if a.probe else []
    rows += run(quick=a.quick, recipes=a.recipes.split(",") if a.recipes else None,
               ms=tuple(int(m) for m in a.m.split(",")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n# layer table (us; ratio = bf16 time / lowbit time)")
    for r in rows:
        if r["bench"] == "layer":
            print(_fmt(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
