"""Quantized matmuls: the float64 reference (here, always importable) and the dispatching
`linear` (lowbit.ops.linear, imported on first use so that kernels are never loaded for the
reference alone)."""
from __future__ import annotations

from lowbit.ops.reference import qlinear_reference

__all__ = ["qlinear_reference", "linear"]


def __getattr__(name: str):
    if name == "linear":
        from lowbit.ops.linear import linear
        globals()["linear"] = linear
        return linear
    raise AttributeError(f"module 'lowbit.ops' has no attribute {name!r}")
