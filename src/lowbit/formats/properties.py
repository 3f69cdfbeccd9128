"""Format properties derived by enumerating codes through the codecs' decoders.

Nothing here is typed in: max, min_normal, min_subnormal, unit roundoff and the NaN / inf
encodings all come from decoding bit patterns.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch

from .integer import IntSpec
from .minifloat import MinifloatSpec


class CodeSet:
    """An immutable set of bit patterns kept as sorted inclusive ranges (fp32 has 2^24 NaNs).

    Supports ``in``, ``len``, iteration in increasing order, and ``==`` with another CodeSet
    or any sequence of ints (e.g. ``fmt.nan_codes == (0x7F, 0xFF)``).
    """

    __slots__ = ("ranges",)

    def __init__(self, ranges=()):
        self.ranges: tuple[tuple[int, int], ...] = tuple((int(a), int(b)) for a, b in ranges)

    @classmethod
    def from_codes(cls, codes) -> "CodeSet":
        ranges: list[list[int]] = []
        for c in sorted(codes):
            if ranges and c == ranges[-1][1] + 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
        return cls(ranges)

    def __contains__(self, code) -> bool:
        return any(a <= code <= b for a, b in self.ranges)

    def __len__(self) -> int:
        return sum(b - a + 1 for a, b in self.ranges)

    def __iter__(self):
        for a, b in self.ranges:
            yield from range(a, b + 1)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __eq__(self, other) -> bool:
        if isinstance(other, CodeSet):
            return self.ranges == other.ranges
        try:
            other = sorted(int(c) for c in other)
        except TypeError:
            return NotImplemented
        return len(other) == len(self) and other == list(self)

    def __hash__(self) -> int:
        return hash(self.ranges)

    def hex(self, width: int = 2) -> str:
        """'0x7F,0xFF' or '0x7D-0x7F,0xFD-0xFF'; '-' when empty."""
        if not self.ranges:
            return "-"
        f = f"0x{{:0{width}X}}"
        return ",".join(f.format(a) if a == b else f"{f.format(a)}-{f.format(b)}" for a, b in self.ranges)

    def __repr__(self) -> str:
        return f"CodeSet({self.hex()})"


@dataclass(frozen=True)
class Format:
    """An element format and its derived properties.

    max / min_normal / min_subnormal: largest finite value, smallest positive normal value,
    smallest positive value (python floats, exact). unit_roundoff u: the largest relative
    rounding error of a normal value: 2^-p with p = mbits + 1 for floats; 1/(2*qmax) for
    integers (an error of half a step relative to absmax).
    nan_codes / inf_codes: CodeSet of the bit patterns that decode to NaN / +-inf.
    Floats also carry ebits, mbits, bias, policy; integers qmin, qmax (int8: -128, 127).
    torch_dtype: torch's own dtype for the format where this torch has one, else None.
    """

    name: str
    kind: str  # "int" | "float"
    bits: int
    signed: bool
    max: float
    min_normal: float
    min_subnormal: float
    unit_roundoff: float
    has_inf: bool
    has_nan: bool
    nan_codes: CodeSet
    inf_codes: CodeSet
    ebits: int | None = None
    mbits: int | None = None
    bias: int | None = None
    policy: str | None = None
    qmin: int | None = None
    qmax: int | None = None
    torch_dtype: torch.dtype | None = None
    spec: MinifloatSpec | IntSpec | None = field(default=None, repr=False, compare=False)

    @property
    def min(self) -> float:
        """Smallest finite value: -max for signed floats, qmin for ints, 2^-127 for e8m0."""
        if self.kind == "int":
            return float(self.qmin)
        return -self.max if self.signed else self.min_subnormal

    def __str__(self) -> str:
        return self.name


def derive_float(name: str, spec: MinifloatSpec, torch_dtype: torch.dtype | None) -> Format:
    """Properties of a float format from the values of its enumerated codes."""
    codes = spec.codes_to_enumerate()
    vals = {c: spec.decode_code(c) for c in codes}
    emask = ((1 << spec.ebits) - 1) << spec.mbits

    def is_normal(c: int) -> bool:  # exponent field != 0; without mantissa bits every code is
        return spec.mbits == 0 or bool(c & emask)

    pos = {c: v for c, v in vals.items() if math.isfinite(v) and v > 0}
    # u: half the largest relative step from a positive normal code to the next code up.
    steps = [(vals[c + 1] - v) / v for c, v in pos.items()
             if is_normal(c) and c + 1 in pos and pos[c + 1] > v]
    nan = [c for c, v in vals.items() if math.isnan(v)]
    inf = [c for c, v in vals.items() if math.isinf(v)]
    return Format(name=name, kind="float", bits=spec.bits, signed=spec.signed,
                  max=max(pos.values()), min_normal=min(v for c, v in pos.items() if is_normal(c)),
                  min_subnormal=min(pos.values()), unit_roundoff=max(steps) / 2,
                  has_inf=bool(inf), has_nan=bool(nan),
                  nan_codes=_codeset(spec, nan), inf_codes=_codeset(spec, inf),
                  ebits=spec.ebits, mbits=spec.mbits, bias=spec.bias, policy=spec.policy,
                  torch_dtype=torch_dtype, spec=spec)


def _codeset(spec: MinifloatSpec, found: list[int]) -> CodeSet:
    """CodeSet of the enumerated codes ``found``. For a skeleton enumeration (fp32: mantissas
    0, 1, 2, max-1, max of every exponent field) two runs of special codes with no enumerated
    code between them are joined: the unenumerated gap lies inside one exponent field with a
    mantissa strictly between 2 and max-1, and the decoder classifies such codes alike."""
    runs = CodeSet.from_codes(found).ranges
    if spec.bits <= 16 or not runs:
        return CodeSet(runs)
    enumerated = sorted(spec.codes_to_enumerate())
    merged = [list(runs[0])]
    for a, b in runs[1:]:
        gap_enumerated = bisect.bisect_left(enumerated, a) - bisect.bisect_right(enumerated, merged[-1][1])
        if gap_enumerated == 0:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return CodeSet(merged)


def derive_int(name: str, spec: IntSpec) -> Format:
    """Integer format: the values are the codes; the smallest nonzero magnitude is 1."""
    return Format(name=name, kind="int", bits=spec.bits, signed=spec.signed, max=float(spec.qmax),
                  min_normal=1.0, min_subnormal=1.0, unit_roundoff=1.0 / (2 * spec.qmax),
                  has_inf=False, has_nan=False, nan_codes=CodeSet(), inf_codes=CodeSet(),
                  qmin=spec.qmin, qmax=spec.qmax, spec=spec)
