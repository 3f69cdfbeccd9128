"""Round to nearest onto a float format's value grid by table lookup: the values
decode(encode(x, fmt, saturate=True)) of float32 x (nearest) and the codes encode(x, fmt,
saturate=True) themselves (nearest_code, lowbit.quantize's element step for these formats), for the
float formats of <= 8 bits, in a handful of elementwise tensor operations instead of encode's ~20
(float64) plus decode's lookup.

For loops that fake-quantize small vectors many times, where the per-call overhead is the cost:
GPTQ's column loop (lowbit.algorithms.gptq) quantizes one weight column per call, ~150,000 calls for
SmolLM2-135M under NVFP4, and spent most of its time in encode's elementwise passes. Every
operation here is elementwise (PyTorch runs vectors below its grain of 32,768 elements on one
thread); torch.searchsorted, the obvious tool, splits even a 576-element search over the intra-op
threads, which on a loaded machine makes one call up to ~100x slower than on one thread.

The arithmetic is encode's, restated on the grid. For the fn / ieee / fnuz policies under saturation
the finite magnitude codes 0..M (M = max_finite_magcode) have increasing values v_0 = 0 < v_1 < ...
< v_M (a code is (biased exponent, mantissa) read as one integer). encode rounds |x| once to the
nearest of them, half to even on the mantissa, and clamps to v_M: so |x| < b_k gives v_k and
|x| > b_k gives v_{k+1}, with b_k = (v_k + v_{k+1}) / 2, and |x| = b_k gives the even code of the two
(a carry out of the top mantissa lands on the next binade's code, whose mantissa 0 is even: the
same rule). The code of |x| is the number of boundaries below it, plus one at a tie that goes up.
Every b_k is a float32 with at most 5 significant bits (values of an <= 8-bit format have at most 4
and lie within 2^-17 .. 57,344), so its low 19 fraction bits are zero: it is the FIRST float32 of the
range of floats sharing its top 13 bits (exponent and 4 fraction bits; "key" = bits >> 19), and no
range holds a boundary anywhere else. So within one key the count is fixed except at the range's
first float: for |x| with key k it is base[k] + has[k] when |x| is above the range's first float,
base[k] + up[k] when equal (base: boundaries below the range; has: one starts it; up: that one's
tie goes up). One table of 2 x 4,096 values, indexed by 2 key + (low bits != 0), holds the answer;
|x| beyond the last boundary, inf included, gives v_M (saturation). The sign is x's (copysign: a
negative value that rounds to zero is -0.0, what its sign-bit code decodes to), except under fnuz,
which has no negative zero (its 0x80 is NaN): there -0.0 becomes +0.0. NaN is not a value of the
grid: the result of a NaN is unspecified (check finiteness where it can occur).
tests/core/test_format_grid.py compares nearest() with decode(encode()) bit for bit on every boundary,
its float32 neighbours, every grid value, and random values of every magnitude.
"""
from __future__ import annotations

import torch

from lowbit.formats import get_format
from lowbit.formats.properties import Format

POLICIES = ("fn", "ieee", "fnuz")

LOW_BITS = 19      # float32 fraction bits below a boundary's 4 (5 significant bits with the hidden one)

_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def supported(fmt: str | Format) -> bool:
    """Whether nearest() applies: a float format of <= 8 bits whose policy is fn, ieee or fnuz."""
    f = get_format(fmt)
    return f.kind == "float" and f.bits <= 8 and f.policy in POLICIES


def _f32_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32))


def _tables(f: Format, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, values float32), each [2 * 2^(31 - LOW_BITS)], on `device`: entry 2 key + above
    is the magnitude code (encode's, sign bit clear) and the value of a non-negative float32 with that
    key (bits >> LOW_BITS) that is above (1) or equal to (0) the first float32 of the key's range.
    NaN's keys (exponent all ones, fraction not 0: all entries of the keys above +inf's, and the
    "above" entry of +inf's own key) hold the format's NaN magnitude code (its largest finite one
    when it has none: nearest_code refuses NaN there) and, in the values, v_M."""
    key = (f.name, str(device))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    spec = f.spec
    M = spec.max_finite_magcode
    vals = [spec.decode_code(c) for c in range(M + 1)]
    if any(not b > a for a, b in zip(vals, vals[1:])):     # the premise: codes ordered like values
        raise RuntimeError(f"{f.name}: magnitude codes are not ordered like their values; nearest() does not apply")
    starts: dict[int, bool] = {}       # key of each boundary -> whether its tie goes up
    for k in range(M):
        b = (vals[k] + vals[k + 1]) / 2     # exact in float64
        bits = _f32_bits(b)
        if float(torch.tensor(b, dtype=torch.float32)) != b or bits & ((1 << LOW_BITS) - 1):
            raise RuntimeError(f"{f.name}: boundary {b!r} has more than 5 significant bits; nearest() does not apply")
        starts[bits >> LOW_BITS] = (k + 1) % 2 == 0      # tie to the even code: k + 1 when it is even
    n_keys = 1 << (31 - LOW_BITS)
    inf_key = _f32_bits(float("inf")) >> LOW_BITS
    nan_code = M if spec._nan_magcode is None else spec._nan_magcode
    codes = []
    base = 0
    for k in range(n_keys):
        has = k in starts
        codes += [min(base + int(has and starts[k]), M), min(base + int(has), M)]
        base += int(has)
    codes[2 * inf_key + 1:] = [nan_code] * (2 * n_keys - 2 * inf_key - 1)
    out = (torch.tensor(codes, dtype=torch.uint8, device=device),
           torch.tensor([vals[min(c, M)] for c in codes], dtype=torch.float32, device=device))
    _CACHE[key] = out
    return out


def _index(x: torch.Tensor, f: Format, what: str) -> torch.Tensor:
    """int32 table index of |x| (2 key + above) for float32 x, after checking f and x."""
    if not supported(f):
        raise ValueError(f"{what}: {f.name} is not a float format of <= 8 bits with policy in {POLICIES}; "
                         "use decode(encode(x, fmt)) for it")
    if x.dtype != torch.float32:
        raise TypeError(f"{what}: x must be float32 (the rounding of a float32 value), got {x.dtype}")
    bits = x.view(torch.int32) & 0x7FFFFFFF          # sign bit cleared: non-negative
    return ((bits >> LOW_BITS) << 1) | ((bits & ((1 << LOW_BITS) - 1)) != 0).to(torch.int32)


def _torch_cast(f: Format, x: torch.Tensor) -> bool:
    """fp8 e4m3fn from float32 on the CPU: torch's own cast gives the table's codes (below) in 2 passes
    instead of ~10 (512 x 1536: 0.7 ms against 6.2 ms for the codes, 3.0 against 7.1 ms for the values).
    Not on CUDA, whose conversion instruction is not checked here for NaN's sign bit."""
    return f.name == "fp8_e4m3fn" and x.dtype == torch.float32 and x.device.type == "cpu"


def _e4m3fn(x: torch.Tensor) -> torch.Tensor:
    """x as torch.float8_e4m3fn, saturated: torch's cast rounds to nearest even, subnormals included,
    keeps NaN's sign bit in the NaN codes 0x7F / 0xFF and turns only |x| >= 480 into NaN, so after the
    clamp (NaN passes through it, +-inf saturate) the codes are encode(x, saturate=True)'s
    (tests/core/test_format_grid.py: every table key, its neighbours and both signs)."""
    return torch.clamp(x, -448.0, 448.0).to(torch.float8_e4m3fn)


def nearest(x: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """float32 tensor of x's shape: decode(encode(x, fmt, saturate=True)) for float32 x (finite
    or +-inf; NaN unspecified) in a float format of <= 8 bits (supported(fmt))."""
    f = get_format(fmt)
    if _torch_cast(f, x):
        return _e4m3fn(x).to(torch.float32)
    idx = _index(x, f, "nearest")
    q = torch.copysign(_tables(f, x.device)[1][idx], x)
    if f.policy == "fnuz":
        q = q + 0.0     # -0.0 + 0.0 = +0.0 (round to nearest); every other value unchanged
    return q


def nearest_code(x: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """uint8 tensor of x's shape: encode(x, fmt, saturate=True) bit for bit for every float32 x
    (finite, +-inf to +-max, NaN to the format's NaN code with x's sign bit as encode gives it) in a
    float format of <= 8 bits (supported(fmt)); NaN in a format without a NaN code raises ValueError,
    as encode does. lowbit.quantize's element step for float formats: ~10 int32 passes instead of
    encode's float64 ones. The sign bit is x's, except that fnuz has no negative zero (its 0x80 is
    NaN): a magnitude code 0 stays 0x00 there, and its NaN code 0x80 already is the sign bit."""
    f = get_format(fmt)
    if _torch_cast(f, x):
        return _e4m3fn(x).view(torch.uint8)
    idx = _index(x, f, "nearest_code")
    spec = f.spec
    if spec._nan_magcode is None and torch.compiler.is_compiling():   # a device-side check keeps a graph whole
        torch._assert_async(~torch.isnan(x).any(), "x holds NaN values and this format has no NaN encoding")
    elif spec._nan_magcode is None:
        nan = torch.isnan(x)
        if bool(nan.any()):
            raise ValueError(f"x holds {int(nan.sum())} NaN value(s) and this format has no NaN "
                             "encoding: remove them, or pass saturate=False to get ml_dtypes' zeros")
    mag = _tables(f, x.device)[0][idx]
    code = mag | (torch.signbit(x).to(torch.uint8) << (spec.bits - 1))
    if f.policy == "fnuz":
        code = torch.where(mag == 0, mag, code)
    return code
