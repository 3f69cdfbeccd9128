"""Verification: quantization-aware references, derived tolerances, metrics, diagnosis.

    verdict = lowbit.verify.check_linear(out, x, w, x_scheme=..., w_scheme=..., bias=None)
    verdict.passed, verdict.kind, verdict.first_failure, verdict.metrics, verdict.causes
    print(verdict.report())
"""
from __future__ import annotations

from lowbit.ops.reference import qlinear_reference
from lowbit.verify.check import Verdict, check_linear
from lowbit.verify.diagnose import Cause

__all__ = ["check_linear", "Verdict", "Cause", "qlinear_reference"]
