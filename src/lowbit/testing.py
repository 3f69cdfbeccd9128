"""Test assertions for kernel authors (the implementation lives in lowbit.verify.testing).

    from lowbit.testing import assert_linear_close
"""
from lowbit.verify.testing import assert_linear_close

__all__ = ["assert_linear_close"]
