"""QuantScheme: one typed, serializable description of how a tensor is quantized.

A scheme names the element format, the granularity of the scales (strategy), the scale
format and its rounding rule, and whether a zero point is used. Everything downstream
(quantize, references, tolerances, kernels, checkpoints) reads only this description.

Scales always reduce along the LAST axis (K, the contraction axis): per-channel on a weight
[N, K] and per-token on an activation [M, K] are the same reduction (one scale per row);
the two names are kept because checkpoints and users distinguish them.

Field names follow compressed-tensors' QuantizationArgs where they overlap (num_bits, type,
strategy, group_size, block_structure, symmetric, dynamic); `format`, `scale_format` and
`scale_rounding` are lowbit's own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from lowbit.formats import get_format

STRATEGIES = ("tensor", "channel", "token", "group", "block")
SCALE_FORMATS = ("fp32", "e8m0", "fp8_e4m3fn")
# torchao's ScaleCalculationMode names (torchao/prototype/mx_formats/config.py), same meanings:
#   floor: 2^(floor(log2 amax) - emax_elem)         OCP MX spec; the largest values may saturate
#   ceil:  2^(ceil(log2 amax) - emax_elem)          never saturates; up to 2x coarser than needed
#   rceil: 2^ceil(log2(amax / elem_max))            the smallest power of two that avoids
#                                                    saturation; cuBLAS / NVIDIA's rule, i.e.
#                                                    ceil_to_ue8m0(amax / max)
#   even:  floor rule applied to amax rounded (half up) to the element's mantissa width
# (emax_elem = floor(log2 elem_max), e.g. 8 for fp8_e4m3fn whose max is 448.)
# Note: ceil_to_ue8m0(amax/max) is torchao's RCEIL, not torchao's CEIL.
SCALE_ROUNDINGS = ("floor", "rceil", "ceil", "even")

# compressed-tensors keys that carry no arithmetic lowbit needs; accepted and dropped by from_dict.
_IGNORED_CT_KEYS = ("observer", "observer_kwargs", "actorder")


@dataclass(frozen=True)
class QuantScheme:
    """How to quantize one tensor.

    format:         element format name (see `lowbit formats`): int8 uint8 int4 uint4 int2,
                    fp8_e4m3fn fp8_e4m3fnuz fp8_e5m2 fp8_e5m2fnuz fp6_e2m3fn fp6_e3m2fn fp4_e2m1fn.
    strategy:       "tensor" (one scale), "channel" / "token" (one per row, reduced over K),
                    "group" (one per `group_size` consecutive K elements), "block" (one per
                    `block_size` = (rows, cols) tile of the last two axes).
    group_size:     K elements per scale; required for and only for strategy="group".
    block_size:     (rows, cols); required for and only for strategy="block".
    symmetric:      False adds an integer zero point (integer formats only; unsigned integer
                    formats need it).
    scale_format:   "fp32"; "e8m0" (power-of-two scales, MX); "fp8_e4m3fn" (two-level: fp8
                    block scales times one fp32 tensor scale, as NVFP4). The last two need
                    strategy group or block and a float element format.
    scale_rounding: e8m0 only: "floor" | "rceil" | "ceil" | "even" (torchao's meanings, see
                    SCALE_ROUNDINGS above).
    dynamic:        scales computed at run time from the live tensor (activations); recorded
                    for checkpoints, it does not change quantize's arithmetic.
    """

    format: str
    strategy: str
    group_size: int | None = None
    block_size: tuple[int, int] | None = None
    symmetric: bool = True
    scale_format: str = "fp32"
    scale_rounding: str | None = None
    dynamic: bool = False

    def __post_init__(self):
        fmt_name = getattr(self.format, "name", self.format)  # a Format object is accepted too
        if not isinstance(fmt_name, str):
            raise TypeError(f"QuantScheme: format must be a format name string, got {type(self.format).__name__}")
        object.__setattr__(self, "format", fmt_name)
        try:
            fmt = get_format(fmt_name)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"QuantScheme: unknown format {fmt_name!r} ({exc}); "
                             "`lowbit formats` lists the names") from None
        if fmt.bits > 8 or fmt_name == "e8m0fnu":
            raise ValueError(f"QuantScheme: format {fmt_name!r} cannot hold quantized elements "
                             "(element formats have at most 8 bits and e8m0fnu is a scale-only format)")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"QuantScheme: strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        self._check_granularity()
        for flag in ("symmetric", "dynamic"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"QuantScheme: {flag} must be True or False, got {getattr(self, flag)!r}")
        if not self.symmetric and fmt.kind != "int":
            raise ValueError(f"QuantScheme: symmetric=False (zero point) is only defined for integer "
                             f"formats; {fmt_name} is a float format, use symmetric=True")
        if self.symmetric and fmt.kind == "int" and not fmt.signed:
            raise ValueError(f"QuantScheme: unsigned format {fmt_name} needs symmetric=False "
                             "(a zero point); symmetric quantization needs a signed format such as int8")
        self._check_scale_format(fmt)

    def _check_granularity(self):
        g, b = self.group_size, self.block_size
        if self.strategy == "group":
            if isinstance(g, bool) or not isinstance(g, int) or g < 1:
                raise ValueError(f"QuantScheme: strategy='group' needs group_size, a positive int "
                                 f"(e.g. 32 or 128), got {g!r}")
        elif g is not None:
            raise ValueError(f"QuantScheme: group_size={g} only applies to strategy='group' "
                             f"(strategy is {self.strategy!r}); drop group_size")
        if self.strategy == "block":
            if isinstance(b, (list, tuple)) and len(b) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in b):
                object.__setattr__(self, "block_size", (int(b[0]), int(b[1])))
            else:
                raise ValueError(f"QuantScheme: strategy='block' needs block_size=(rows, cols) of positive "
                                 f"ints, e.g. (128, 128) for weights or (1, 128) for activations; got {b!r}")
        elif b is not None:
            raise ValueError(f"QuantScheme: block_size={b} only applies to strategy='block' "
                             f"(strategy is {self.strategy!r}); drop block_size")

    def _check_scale_format(self, fmt):
        sf, rule = self.scale_format, self.scale_rounding
        if sf not in SCALE_FORMATS:
            raise ValueError(f"QuantScheme: scale_format must be one of {SCALE_FORMATS}, got {sf!r}")
        if sf != "fp32":
            if self.strategy not in ("group", "block"):
                raise ValueError(f"QuantScheme: scale_format={sf!r} needs strategy 'group' or 'block' "
                                 f"(got {self.strategy!r}); per-tensor/row scales use scale_format='fp32'")
            if fmt.kind != "float":
                raise ValueError(f"QuantScheme: scale_format={sf!r} is defined for float element formats "
                                 f"(MX / NVFP4); {fmt.name} is an integer format, use scale_format='fp32'")
        if sf == "e8m0":
            if rule not in SCALE_ROUNDINGS:
                raise ValueError(f"QuantScheme: scale_format='e8m0' needs scale_rounding, one of "
                                 f"{SCALE_ROUNDINGS} (torchao's meanings; 'floor' is the OCP MX spec), "
                                 f"got {rule!r}")
        elif rule is not None:
            raise ValueError(f"QuantScheme: scale_rounding={rule!r} only applies to scale_format='e8m0' "
                             f"(scale_format is {sf!r}); drop scale_rounding")

    # ---- derived properties -------------------------------------------------------------
    @property
    def fmt(self):
        """The element Format object."""
        return get_format(self.format)

    @property
    def num_bits(self) -> int:
        return self.fmt.bits

    @property
    def type(self) -> str:
        """'int' or 'float' (compressed-tensors' QuantizationType)."""
        return self.fmt.kind

    @property
    def k_width(self) -> int:
        """Elements along K (the last axis) that one scale covers: group_size, the block's
        columns, else 1 (one scale per row or tensor: any K fits). A K that is not a multiple of
        it leaves a short last group, which checkpoints and stacked expert scales cannot hold."""
        if self.strategy == "group":
            return self.group_size
        return self.block_size[1] if self.strategy == "block" else 1

    @property
    def two_level(self) -> bool:
        """True when block scales are fp8 codes times one fp32 tensor scale (NVFP4 style)."""
        return self.scale_format == "fp8_e4m3fn"

    def __str__(self) -> str:
        gran = {"group": f"group{self.group_size}",
                "block": f"block{self.block_size[0]}x{self.block_size[1]}" if self.block_size else "block"}
        parts = [self.format, gran.get(self.strategy, self.strategy)]
        if not self.symmetric:
            parts.append("asym")
        if self.scale_format != "fp32":
            parts.append(f"scale={self.scale_format}" + (f"/{self.scale_rounding}" if self.scale_rounding else ""))
        return " ".join(parts)

    # ---- serialization ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; compressed-tensors names where they overlap."""
        return {
            "num_bits": self.num_bits,
            "type": self.type,
            "strategy": self.strategy,
            "group_size": self.group_size,
            "block_structure": list(self.block_size) if self.block_size is not None else None,
            "symmetric": self.symmetric,
            "dynamic": self.dynamic,
            "format": self.format,
            "scale_format": self.scale_format,
            "scale_rounding": self.scale_rounding,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantScheme":
        """Inverse of to_dict. `format` may be omitted for the formats compressed-tensors can
        name unambiguously (int N -> intN, float 8 -> fp8_e4m3fn, float 4 -> fp4_e2m1fn);
        when both are present they must agree. Unknown keys are an error."""
        if not isinstance(d, dict):
            raise TypeError(f"QuantScheme.from_dict: expected a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)} | {"num_bits", "type", "block_structure"} | set(_IGNORED_CT_KEYS)
        unknown = sorted(set(d) - known - {"block_size"})
        if unknown:
            raise ValueError(f"QuantScheme.from_dict: unknown keys {unknown}; known keys are {sorted(known)}")
        num_bits, typ = d.get("num_bits"), d.get("type")
        fmt_name = d.get("format")
        if fmt_name is None:
            guess = {("int", 8): "int8", ("int", 4): "int4", ("int", 2): "int2",
                     ("float", 8): "fp8_e4m3fn", ("float", 4): "fp4_e2m1fn"}
            fmt_name = guess.get((typ, num_bits))
            if fmt_name is None:
                raise ValueError(f"QuantScheme.from_dict: no 'format' key and type={typ!r}, num_bits="
                                 f"{num_bits!r} does not name one format; add 'format' (e.g. 'fp6_e2m3fn')")
        if "strategy" not in d:
            raise ValueError("QuantScheme.from_dict: missing 'strategy' (tensor|channel|token|group|block)")
        block = d.get("block_structure", d.get("block_size"))
        if isinstance(block, str):  # compressed-tensors also writes "128x128"
            block = [int(v) for v in block.lower().split("x")]
        scheme = cls(format=fmt_name, strategy=d["strategy"], group_size=d.get("group_size"),
                     block_size=tuple(block) if block is not None else None,
                     symmetric=d.get("symmetric", True), scale_format=d.get("scale_format", "fp32"),
                     scale_rounding=d.get("scale_rounding"), dynamic=bool(d.get("dynamic", False)))
        if num_bits is not None and num_bits != scheme.num_bits:
            raise ValueError(f"QuantScheme.from_dict: num_bits={num_bits} contradicts format "
                             f"{scheme.format!r} ({scheme.num_bits} bits)")
        if typ is not None and typ != scheme.type:
            raise ValueError(f"QuantScheme.from_dict: type={typ!r} contradicts format {scheme.format!r} "
                             f"(a {scheme.type} format)")
        return scheme

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "QuantScheme":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"QuantScheme.from_json: not valid JSON ({exc})") from None
        return cls.from_dict(d)


def _mx(fmt: str) -> QuantScheme:
    # OCP MX: 32 elements per power-of-two scale; 'floor' is the spec's rule and torchao's default.
    return QuantScheme(fmt, "group", group_size=32, scale_format="e8m0", scale_rounding="floor")


PRESETS: dict[str, QuantScheme] = {
    "mxfp8": _mx("fp8_e4m3fn"),
    "mxfp6_e2m3": _mx("fp6_e2m3fn"),
    "mxfp6_e3m2": _mx("fp6_e3m2fn"),
    "mxfp4": _mx("fp4_e2m1fn"),
    # NVFP4: 16 elements per fp8_e4m3fn scale, times one fp32 tensor scale.
    "nvfp4": QuantScheme("fp4_e2m1fn", "group", group_size=16, scale_format="fp8_e4m3fn"),
    "int8_channel": QuantScheme("int8", "channel"),
    "int8_token": QuantScheme("int8", "token", dynamic=True),
    "int4_g128": QuantScheme("int4", "group", group_size=128),
    "int4_g128_asym": QuantScheme("int4", "group", group_size=128, symmetric=False),
    "fp8_tensor": QuantScheme("fp8_e4m3fn", "tensor"),
    "fp8_row": QuantScheme("fp8_e4m3fn", "channel"),
    # DeepSeek-V3 style: 128x128 tiles for weights, 1x128 for activations, fp32 scales.
    "fp8_block128": QuantScheme("fp8_e4m3fn", "block", block_size=(128, 128)),
    "fp8_block1x128": QuantScheme("fp8_e4m3fn", "block", block_size=(1, 128), dynamic=True),
}


def get_preset(name: str) -> QuantScheme:
    """The preset scheme called `name` (see PRESETS)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; presets are: {', '.join(PRESETS)}") from None
