"""Quantized matmuls: the float64 reference and the dispatching `linear` (lowbit.ops.linear; it
imports no kernel until one runs, so importing it costs no Triton)."""
from __future__ import annotations

# The function shares its module's name: bound here, so that `lowbit.ops.linear` is the function
# whether or not the submodule was imported first.
from lowbit.ops.linear import linear
from lowbit.ops.reference import qlinear_reference

__all__ = ["qlinear_reference", "linear"]
