"""KernelSpec: one kernel under `lowbit audit` (verify/audit.py runs them; verify/audit_torchao.py
contributes torchao's), and the padding both modules' kernel wrappers do for their libraries' shape rules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class KernelSpec:
    """One kernel under audit. fn(xq, wq, bias) -> out [M, N]; schemes None = unquantized side."""

    name: str
    x_scheme: object
    w_scheme: object
    fn: Callable
    accumulator: str | None = None     # what the kernel promises (None: lowbit's default)
    note: str = ""
    x_dtype: torch.dtype | None = None  # the kernel reads x in this dtype (W4A16: bf16)
    float_x: bool = False               # the kernel quantizes x itself: it gets the float x, not xq


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


def padded(t: torch.Tensor, rows: int, cols: int, fill=0) -> torch.Tensor:
    """t [r, c] padded with `fill` (default zero) to [rows, cols], a fresh row-major tensor."""
    out = torch.full((rows, cols), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def int_mm_shape(M: int, K: int, N: int, device) -> tuple[int, int, int]:
    """The shapes torch._int_mm takes on CUDA (cuBLASLt's int8 GEMM): M > 16, K and N multiples of
    8; on the CPU any."""
    if torch.device(device).type != "cuda":
        return M, K, N
    return max(M, 17), round_up(K, 8), round_up(N, 8)
