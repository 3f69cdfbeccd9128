"""One QuantLinear against bf16 `F.linear` at Llama-3-8B's layer shapes, per recipe and M:
the whole call in eager mode (what a user's model pays) and the same call replayed from a
CUDA graph (the GPU time alone), so the per-call overhead is the difference of the two.

    python -m lowbit.bench.layers [--json PATH] [--recipes a,b] [--m 1,16,2048]
"""
from __future__ import annotations

import argparse
import json
import sys

# (name, K, N): the merged q/k/v and gate/up GEMMs, o_proj and down_proj of Llama-3-8B
SHAPES = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096))


def run(only: str | None = None, quick: bool = False, recipes=None, ms=(1, 16, 2048)) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from lowbit.bench.timing import bench_ms
    from lowbit.nn import QuantLinear
    from lowbit.nn.recipes import RECIPES

    names = list(recipes or RECIPES)
    shapes = SHAPES[:2] if quick else SHAPES
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for sname, K, N in shapes:
        lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=gen)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
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
                    tg = bench_ms(q, inputs, cuda_graph=True)
                    row.update(eager_us=t * 1e3, graph_us=tg * 1e3, vs_bf16=base / t, vs_bf16_graph=base_g / tg,
                               overhead=t / tg)
                    del q
                except Exception as e:  # noqa: BLE001 -- one recipe's failure is a row, not the end of the run
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(_fmt(row), flush=True)
            torch.cuda.empty_cache()
    return rows


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']:8s} M={r['M']:<5d} {r['recipe']:17s} ERROR {r['error']}"
    return (f"{r['shape']:8s} M={r['M']:<5d} {r['recipe']:17s} {r.get('path', ''):12s} eager {r['eager_us']:8.1f} us "
            f"graph {r['graph_us']:8.1f} us  vs bf16 {r['vs_bf16']:5.2f}x (graph {r['vs_bf16_graph']:5.2f}x) "
            f"err {r.get('rel_err', 0):.1e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--recipes", default=None)
    p.add_argument("--m", default="1,16,2048")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("lowbit.bench.layers needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(quick=a.quick, recipes=a.recipes.split(",") if a.recipes else None,
               ms=tuple(int(m) for m in a.m.split(",")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n# layer table (us; ratio = bf16 time / lowbit time)")
    for r in rows:
        print(_fmt(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
