"""The 4-bit weight formats of the W4A16 and grouped (MoE) kernels as plain data, without Triton, so
that the Triton kernels (lowbit.ops.triton.w4a16.codes), the bf16 path (lowbit.ops.grouped_dequant),
the tuner (lowbit.ops.grouped_tune) and the tuning table's keys (lowbit.ops.tuning) name them alike.

  WFMT         the format code each Triton kernel takes as its WFMT constexpr
  GROUPED_W4   the grouped kernels' 4-bit weight formats (uint4 has none: int4 with zero points)
  FP4_GROUPS   MXFP4's and NVFP4's fixed block sizes (int4's group size is the scheme's)
  FP4_SCALES   the format of their block scales
  W4Format     one grouped 4-bit weight format (format, group size, zero points) and its table name
"""
from __future__ import annotations

import re
from dataclasses import dataclass

W_INT4, W_UINT4, W_MXFP4, W_NVFP4 = 0, 1, 2, 3
WFMT = {"int4": W_INT4, "uint4": W_UINT4, "mxfp4": W_MXFP4, "nvfp4": W_NVFP4}
GROUPED_W4 = ("int4", "mxfp4", "nvfp4")
FP4_GROUPS = {"mxfp4": 32, "nvfp4": 16}
FP4_SCALES = {"mxfp4": "e8m0fnu", "nvfp4": "fp8_e4m3fn"}

_KEY = re.compile(r"(int4|mxfp4|nvfp4)/g([1-9][0-9]*)(/zp)?")


@dataclass(frozen=True)
class W4Format:
    """A grouped kernel's 4-bit weights: `name` in GROUPED_W4, `group` codes per scale (MXFP4 32,
    NVFP4 16, int4 the scheme's), `zero`: int4 with zero points. Kernels differ in speed and best
    tiles across these, so the tuning table keeps a cell per format (`key`)."""
    name: str
    group: int
    zero: bool = False

    def __post_init__(self):
        if self.name not in GROUPED_W4:
            raise ValueError(f"4-bit weight format {self.name!r}; the grouped kernels take {GROUPED_W4}")
        fixed = FP4_GROUPS.get(self.name)
        if fixed is not None and (self.group != fixed or self.zero):
            raise ValueError(f"{self.name} has group size {fixed} and no zero points, got group {self.group}"
                             f"{' with zero points' if self.zero else ''}")
        if self.group < 2 or self.group % 2:
            raise ValueError(f"int4 group size {self.group}: an even number >= 2 (two codes per byte)")

    @property
    def key(self) -> str:
        """The tuning table's name: "int4/g128", "int4/g32/zp", "mxfp4/g32", "nvfp4/g16"."""
        return f"{self.name}/g{self.group}{'/zp' if self.zero else ''}"

    @classmethod
    def from_key(cls, key: str) -> W4Format | None:
        """The format `key` names, or None where it names none."""
        m = _KEY.fullmatch(key)
        if m is None:
            return None
        try:
            return cls(m[1], int(m[2]), m[3] is not None)
        except ValueError:
            return None
