"""Quantization-aware float64 reference for a 2048 x 2048 x 2048 int8 linear (per-token x,
per-channel w) against a plain int64 numpy matmul of the same codes, on this machine's CPU.

    .venv/bin/python benchmarks/reference_bench.py [--size 2048] [--repeat 3]

Prints both timings and their ratio (measured in the same run), and checks that the two agree
bit for bit on the integer part (the reference's float64 BLAS products are exact: see
lowbit/ops/reference.py).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import lowbit as lb
from lowbit.ops.reference import qlinear_reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    S = a.size
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(S, S, generator=g), torch.randn(S, S, generator=g)
    xq = lb.quantize(x, lb.QuantScheme(format="int8", strategy="token"))
    wq = lb.quantize(w, lb.QuantScheme(format="int8", strategy="channel"))
    print(f"size {S}^3 int8, torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")

    times = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        ref = qlinear_reference(xq, wq)
        times.append(time.perf_counter() - t0)
    t_ref = min(times)
    print(f"qlinear_reference (float64 BLAS, exact):  {t_ref:8.3f} s  (best of {a.repeat})")

    qx, qw = xq.codes.numpy().astype(np.int64), wq.codes.numpy().astype(np.int64)
    t0 = time.perf_counter()
    acc = qx @ qw.T
    t_np = time.perf_counter() - t0
    print(f"numpy int64 matmul of the codes:           {t_np:8.3f} s  (one run)")
    print(f"ratio numpy int64 / reference:             {t_np / t_ref:8.1f}x")

    want = torch.from_numpy(acc).double() * (xq.scale.double() * wq.scale.double().T)
    print(f"reference equals int64 result x scales bit for bit: {bool(torch.equal(ref, want))}")


if __name__ == "__main__":
    main()
