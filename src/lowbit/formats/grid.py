"""Round to nearest onto a float format's value grid by one sorted search: the values
decode(encode(x, fmt, saturate=True)) of float32 x, for the float formats of <= 8 bits, in a handful
of tensor operations instead of encode's ~20 plus decode's lookup.

For loops that fake-quantize small vectors many times, where the per-call overhead is the cost:
GPTQ's column loop (lowbit.nn.gptq) quantizes one weight column per call, ~150,000 calls for
SmolLM2-135M under NVFP4, and spent most of its time in encode's elementwise passes.

The arithmetic is encode's, restated on the grid. For the fn / ieee / fnuz policies under saturation
the finite magnitude codes 0..M (M = max_finite_magcode) have increasing values v_0 = 0 < v_1 < ...
< v_M (a code is (biased exponent, mantissa) read as one integer). encode rounds |x| once to the
nearest of them, half to even on the mantissa, and clamps to v_M: so |x| < b_k gives v_k and
|x| > b_k gives v_{k+1}, with b_k = (v_k + v_{k+1}) / 2, and |x| = b_k gives the even code of the two
(a carry out of the top mantissa lands on the next binade's code, whose mantissa 0 is even: the
same rule). searchsorted(bnd, |x|) (right=False) counts the boundaries strictly below |x|; a
boundary whose tie goes UP is stored as the next float32 below it, so that |x| = b_k counts it and
nothing else changes (no float32 lies between the two). Every b_k is exact in float32: values of an
<= 8-bit format have at most 4 significant bits and lie within 2^-17 .. 57,344, so their midpoints
have at most 5. |x| beyond the last boundary, inf included, gives v_M (saturation). The sign is
x's (copysign: a negative value that rounds to zero is -0.0, what its sign-bit code decodes to),
except under fnuz, which has no negative zero (its 0x80 is NaN): there -0.0 becomes +0.0.
NaN is not a value of the grid: the result of a NaN is unspecified (check finiteness where it can
occur). tests/test_format_grid.py compares nearest() with decode(encode()) bit for bit on every
boundary, its float32 neighbours, every grid value, and random values of every magnitude.
"""
from __future__ import annotations

import math

import torch

from lowbit.formats import get_format
from lowbit.formats.properties import Format

POLICIES = ("fn", "ieee", "fnuz")

_CACHE: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}


def supported(fmt: str | Format) -> bool:
    """Whether nearest() applies: a float format of <= 8 bits whose policy is fn, ieee or fnuz."""
    f = get_format(fmt)
    return f.kind == "float" and f.bits <= 8 and f.policy in POLICIES


def _grid(f: Format, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bnd, vals): float32 [M] boundaries (ties-up ones moved one float32 down) and float32
    [M + 1] values v_0..v_M, on `device`."""
    key = (f.name, str(device))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    spec = f.spec
    M = spec.max_finite_magcode
    vals = [spec.decode_code(c) for c in range(M + 1)]
    if any(not b > a for a, b in zip(vals, vals[1:])):     # the premise of the search: codes ordered like values
        raise RuntimeError(f"{f.name}: magnitude codes are not ordered like their values; nearest() does not apply")
    bnd = []
    for k in range(M):
        b = (vals[k] + vals[k + 1]) / 2     # exact in float64
        if float(torch.tensor(b, dtype=torch.float32)) != b:
            raise RuntimeError(f"{f.name}: boundary {b!r} is not a float32; nearest() does not apply")
        if (k + 1) % 2 == 0:      # the tie goes to the even code k + 1: store the next float32 below
            b = float(torch.nextafter(torch.tensor(b, dtype=torch.float32), torch.tensor(-math.inf)))
        bnd.append(b)
    out = (torch.tensor(bnd, dtype=torch.float32, device=device),
           torch.tensor(vals, dtype=torch.float32, device=device))
    _CACHE[key] = out
    return out


def nearest(x: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """float32 tensor of x's shape: decode(encode(x, fmt, saturate=True)) for float32 x (finite
    or +-inf; NaN unspecified) in a float format of <= 8 bits (supported(fmt))."""
    f = get_format(fmt)
    if not supported(f):
        raise ValueError(f"nearest: {f.name} is not a float format of <= 8 bits with policy in {POLICIES}; "
                         "use decode(encode(x, fmt)) for it")
    if x.dtype != torch.float32:
        raise TypeError(f"nearest: x must be float32 (the rounding of a float32 value), got {x.dtype}")
    bnd, vals = _grid(f, x.device)
    q = torch.copysign(vals[torch.searchsorted(bnd, x.abs())], x)
    if f.policy == "fnuz":
        q = q + 0.0     # -0.0 + 0.0 = +0.0 (round to nearest); every other value unchanged
    return q
