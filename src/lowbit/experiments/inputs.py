"""Deterministic inputs from a small linear congruential generator, so every run and every language sees the same operands.

Why an LCG and not a repeating pattern: the quantization errors of a periodic sequence are
periodic too, and correlated errors grow with K instead of sqrt(K), which would make the
statistical tolerance a lie. Why not torch's RNG: the stream is fully specified here
(x_{n+1} = (1664525 x_n + 1013904223) mod 2^32, Numerical Recipes' constants), so the
experiment's inputs are the same on every machine and library version.
"""
from __future__ import annotations

import numpy as np
import torch

_A, _C, _M = 1664525, 1013904223, 2 ** 32


def lcg_uniform(n: int, seed: int = 1) -> np.ndarray:
    """n float64 values in [0, 1): x_i / 2^32 for the LCG stream after `seed`. Vectorised by
    jumping ahead: x_{j*B+i} = A_i * s_j + C_i (mod 2^32) with A_i = a^i, C_i = c (a^i - 1)/(a - 1)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    B = 4096
    Ai = np.empty(B, dtype=np.uint64)
    Ci = np.empty(B, dtype=np.uint64)
    a, c = 1, 0
    for i in range(B):                       # (A_i, C_i) of the map applied i+1 times
        a, c = (a * _A) % _M, (c * _A + _C) % _M
        Ai[i], Ci[i] = a, c
    nb = -(-n // B)
    starts = np.empty(nb, dtype=np.uint64)
    s = seed % _M
    for j in range(nb):
        starts[j] = s
        s = (int(Ai[-1]) * s + int(Ci[-1])) % _M
    # products of two values < 2^32 fit uint64; & (2^32 - 1) is the modulus
    vals = (Ai[None, :] * starts[:, None] + Ci[None, :]) & np.uint64(_M - 1)
    return vals.reshape(-1)[:n].astype(np.float64) / _M


def matmul_inputs(M: int, K: int, N: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The matmul experiment's operands, float32: A [M, K] uniform in [0, 1) (what a ReLU hands over), and
    the weights as w = B.T [N, K] (out = A @ w.T): signed uniform in [-1, 1), column c of B scaled
    by a gain 2^(-6 c / (N - 1)) (gains span 64x), and every 37th element of B (row-major
    [K, N] order) multiplied by 8 (an outlier 8x its neighbours)."""
    u = lcg_uniform(M * K + K * N, seed)
    a = u[:M * K].reshape(M, K)
    b = 2.0 * u[M * K:].reshape(K, N) - 1.0
    gains = np.exp2(-6.0 * np.arange(N) / max(N - 1, 1))
    b = b * gains[None, :]
    flat = b.reshape(-1)
    flat[::37] *= 8.0
    return torch.from_numpy(a).float(), torch.from_numpy(np.ascontiguousarray(b.T)).float()
