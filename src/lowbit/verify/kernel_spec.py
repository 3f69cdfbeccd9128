"""KernelSpec: one kernel under `lowbit audit` (verify/audit.py runs them; verify/audit_torchao.py
contributes torchao's)."""
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
