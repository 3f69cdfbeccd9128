"""assert_linear_close: a kernel author's test assertion, like torch.testing.assert_close, whose
failure message is lowbit's verdict with the named cause.

    from lowbit.testing import assert_linear_close
    out = my_int8_linear(x, w)                              # [..., N], any device
    assert_linear_close(out, x, w, x_scheme="int8_token", w_scheme="int8_channel", accumulator="int32")

The kernel is judged against the float64 quantization-aware reference with the tolerance derived
from the schemes, K and the accumulator (lowbit.verify.check_linear); no atol / rtol to choose.
"""
from __future__ import annotations

import torch

from lowbit.verify.check import Verdict, check_linear


def _rows(t, name: str, last: int | None = None) -> torch.Tensor:
    """t as a 2-D [rows, last axis] tensor: leading axes (batch, sequence) flattened."""
    t = torch.as_tensor(t)
    if t.ndim < 2:
        raise ValueError(f"assert_linear_close: {name} must have at least 2 dimensions ([..., "
                         f"{'N' if name == 'out' else 'K'}]), got shape {tuple(t.shape)}")
    return t.reshape(-1, t.shape[-1])


def summary(v: Verdict) -> str:
    """One line: the verdict and its first named cause."""
    if v.passed:
        return "PASS"
    head = f"FAIL ({v.kind})"
    if v.causes:
        c = v.causes[0]
        head += f": {c.name}{' (reproduced by simulation)' if c.confirmed else ''}"
    return head


def assert_linear_close(out, x, w, *, x_scheme, w_scheme, accumulator: str | None = None, bias=None,
                        out_dtype: torch.dtype | None = None, msg: str | None = None) -> Verdict:
    """Assert that `out` is what a kernel computing x @ w.T (+ bias) with x and w quantized by the
    schemes may return; raise AssertionError with the verdict and the named cause otherwise.

    out: [..., N]; x: [..., K] the ORIGINAL float activations; w: [N, K] the original float weights;
    bias: [N] or None. Leading axes of out and x are flattened to rows (they must agree).
    x_scheme / w_scheme: QuantScheme, preset name, or None for a side the kernel does not quantize.
        Both are required (keyword-only): a check that silently assumed "unquantized" would blame
        the quantization error on the kernel's arithmetic.
    accumulator: what the kernel promises ("int32", "fp32", "fp8_fast", "fp16", "bf16"); default
        int32 for two integer sides, fp32 otherwise.
    out_dtype: the output rounding; default out's dtype.
    msg: a line put before the verdict in the failure message.
    Returns the Verdict when the check passes (its metrics can be logged).
    """
    o = _rows(out, "out")
    xs = _rows(x, "x")
    if o.shape[0] != xs.shape[0]:
        raise ValueError(f"assert_linear_close: out has {o.shape[0]} rows after flattening its leading axes, x has "
                         f"{xs.shape[0]}; out must be [..., N] for x [..., K] with the same leading axes")
    v = check_linear(o, xs, w, x_scheme=x_scheme, w_scheme=w_scheme, bias=bias, accumulator=accumulator,
                     out_dtype=out_dtype)
    if not v.passed:
        lines = ([msg] if msg else []) + [f"lowbit: {summary(v)}", v.report()]
        raise AssertionError("\n".join(lines))
    return v
