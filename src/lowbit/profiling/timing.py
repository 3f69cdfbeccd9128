"""The one timer every benchmark uses: median of triton.testing.do_bench (warm-up, L2 flush),
over rotating input sets so no run reads operands the previous run left in L2, optionally
inside a CUDA graph so small-M launches are not dominated by launch overhead."""
from __future__ import annotations

import itertools
from typing import Callable, Sequence


def bench_ms(fn: Callable[..., object], inputs: Sequence[tuple], *, cuda_graph: bool = False,
             warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of `fn(*args)`, cycling through `inputs` (a list of argument tuples)."""
    import torch
    import triton.testing as tt

    if not inputs:
        raise ValueError("inputs must hold at least one argument tuple")
    cycle = itertools.cycle(inputs)
    if cuda_graph:
        # One graph per input set; replaying rotates through them.
        graphs = []
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for args in inputs:
                fn(*args)  # warm-up / compile outside capture
        torch.cuda.synchronize()
        for args in inputs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(*args)
            graphs.append(g)
        gcycle = itertools.cycle(graphs)
        return float(tt.do_bench(lambda: next(gcycle).replay(), warmup=warmup, rep=rep,
                                 return_mode="median"))
    return float(tt.do_bench(lambda: fn(*next(cycle)), warmup=warmup, rep=rep, return_mode="median"))


def rotating_count(bytes_per_set: int, l2_bytes: int = 60 * 2**20) -> int:
    """How many input sets make the working set exceed L2 (H200: 60 MiB), at least 2, at most 16."""
    return max(2, min(16, -(-2 * l2_bytes // max(bytes_per_set, 1))))
