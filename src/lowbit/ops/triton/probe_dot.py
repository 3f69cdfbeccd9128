"""The plainest Triton GEMM, for `lowbit probe` (verify/probe.py): out = a @ b.T in float32 with
tl.dot accumulating into a float32 tile over 32-wide K steps; nothing else (no scales, no
epilogue), so the probe sees tl.dot's own accumulation on this GPU."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 16      # M and N tile; the probe pads its rows to a multiple of 16
BLOCK_K = 32


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        b = tl.load(b_ptr + rn[:, None] * K + (k0 + rk)[None, :])
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def dot_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [N, K].T -> float32 [M, N]; M, N multiples of 16, K of 32, same dtype, contiguous."""
    M, K = a.shape
    N = b.shape[0]
    if M % BLOCK or N % BLOCK or K % BLOCK_K or b.shape[1] != K or a.dtype != b.dtype:
        raise ValueError(f"dot_f32: a {tuple(a.shape)} and b {tuple(b.shape)} must share K (a multiple of {BLOCK_K}) "
                         f"and dtype, with M and N multiples of {BLOCK}")
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    _dot_kernel[(M // BLOCK, N // BLOCK)](a.contiguous(), b.contiguous(), c, M, N, K, BLOCK, BLOCK, BLOCK_K)
    return c
