"""The reduction of a split-K launch: float32 partials [split, M, N] (one per K slice, written
with plain stores by the GEMM's programs into a workspace from torch.empty) summed into the
output [M, N] by one small kernel, instead of atomic adds into a zeroed buffer followed by torch's
bias add and cast. Why: the call is then Triton launches and allocations only, so lowbit.ops.bound
can record and replay it (a zero fill, an add or a cast between launches refuses a plan), and the
sum is deterministic.

Rounding, in this order (float32 throughout, then one rounding to the output dtype):
    y = ((p[0] + p[1]) + p[2]) + ... + p[split - 1]    (split - 1 float32 roundings, always this
                                                        order; atomics summed in arrival order)
    y = y + bias[n]                                     (one float32 rounding, if a bias is given)
    out = y rounded to out's dtype                      (round-to-nearest-even, common.cast_out)
The same number of roundings as the atomic form had (split - 1 adds into the zeroed buffer beyond
the first, the bias, the cast), so the error bounds that counted `split` extra roundings hold.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast_out, interpreting, launch


@triton.jit
def _split_k_reduce_kernel(P, BIAS, OUT, M, N, s_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). P float32 [SPLIT, M, N] contiguous; BIAS [N];
    OUT [M, N] (row stride s_om)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    ok = (offs_m < M)[:, None] & n_ok[None, :]
    p = P + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    y = tl.load(p, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):   # fixed order: split 0 first, then 1, 2, ...
        y += tl.load(p + s * M * N, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :], cast_out(y, OUT.dtype.element_ty), mask=ok)


def reduce_split_k(part: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """out [M, N] in `dtype` = the fixed-order float32 sum of part [split, M, N] (+ bias [N]),
    rounded once (module docstring)."""
    split, M, N = part.shape
    out = torch.empty(M, N, dtype=dtype, device=part.device)
    # decode rows (M <= 64): 16-row tiles, 128 columns on the GPU (a row of 128 float32 values is
    # one 512-byte load per split); 64 in the interpreter, so test shapes have several column tiles
    bm, bn = (16, 64) if interpreting() else (16, 128)
    launch(_split_k_reduce_kernel, (triton.cdiv(M, bm), triton.cdiv(N, bn)), part,
           bias if bias is not None else part, out, M, N, out.stride(0), SPLIT=split, HAS_BIAS=bias is not None,
           BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out
