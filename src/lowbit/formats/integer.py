"""Integer element formats (int8, uint8, int4, uint4, int2): two's complement or unsigned.

Codes are the integer values themselves, stored one per byte: int8 for signed formats,
uint8 for unsigned ones (int4 is NOT packed here; lowbit.packing does nibbles).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IntSpec:
    """An integer format of ``bits`` bits; ``signed`` means two's complement."""

    bits: int
    signed: bool

    def __post_init__(self):
        if not 1 < self.bits <= 8:
            raise ValueError(f"bits={self.bits}: integer formats here have 2..8 bits")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def storage(self) -> torch.dtype:
        return torch.int8 if self.signed else torch.uint8


def encode(x: torch.Tensor, spec: IntSpec, saturate: bool) -> torch.Tensor:
    """Round half to even, then clamp to [qmin, qmax] (rounding first, so 127.5 cannot wrap).

    x: float64 tensor. saturate=False refuses values that round outside the range instead of
    clamping them. NaN is always refused: an integer has no NaN to carry it.
    """
    nan = torch.isnan(x)
    if bool(nan.any()):
        raise ValueError(f"x holds {int(nan.sum())} NaN value(s); integer formats cannot encode NaN")
    q = torch.round(x)
    if not saturate:
        bad = (q < spec.qmin) | (q > spec.qmax)
        if bool(bad.any()):
            raise ValueError(f"{int(bad.sum())} value(s) round outside [{spec.qmin}, {spec.qmax}] "
                             "and saturate=False: scale them into range or pass saturate=True")
    return torch.clamp(q, spec.qmin, spec.qmax).to(spec.storage)


def decode(codes: torch.Tensor, spec: IntSpec) -> torch.Tensor:
    """float32 values of integer codes (int8/uint8/any integer dtype), checked to lie in range."""
    bad = (codes < spec.qmin) | (codes > spec.qmax)
    if bool(bad.any()):
        raise ValueError(f"codes: {int(bad.sum())} value(s) outside [{spec.qmin}, {spec.qmax}] for "
                         f"a {spec.bits}-bit {'signed' if spec.signed else 'unsigned'} format")
    return codes.to(torch.float32)
