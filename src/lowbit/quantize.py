"""Scale computation, quantize -> QTensor, dequantize: the ONE place for scale arithmetic.

Everything here is pure torch (CPU and CUDA alike). Kernels reproduce the canonical
arithmetic below bit for bit; tests check them against it.

Canonical arithmetic (x in float32; `/` is IEEE division x / s, never x * (1/s)):
- int symmetric:  s = amax / qmax;  q = clamp(round_half_even(x / s), -qmax, qmax)
  (clamp AFTER rounding, so 127.5 -> 128 -> 127 and never wraps to -128).
- int asymmetric: s = (max(x,0) - min(x,0)) / (qmax - qmin);
  z = clamp(round_half_even(qmin - min(x,0) / s), qmin, qmax);
  q = clamp(round_half_even(x / s) + z, qmin, qmax);  dequant (q - z) * s.
- float elements, fp32 scale: s = amax / fmt.max; codes = encode(x / s, fmt, saturate=True).
- e8m0 scales (MX): s = 2^e with e from amax by the scheme's scale_rounding (see e8m0_exponent).
- fp8_e4m3fn scales (NVFP4 two-level): g = tensor_amax / (448 * fmt.max);
  block code c = e4m3(clamp(amax / fmt.max / g, 2^-6, 448)); s = float32(decode(c) * g).
A group whose fp32 scale comes out 0 (all zeros, or amax / qmax underflows) gets s = 1.0,
so every group has a finite, non-zero scale and all-zero groups give zero codes.

Input dtypes float32 / float16 / bfloat16 / float64 are accepted; x is first converted to
float32 (float64 input is rounded to float32 there) and all reductions and scales are
float32, so the result does not depend on the input dtype beyond that rounding.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import types
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from lowbit.formats import decode, encode, get_format, grid
from lowbit.scheme import QuantScheme

NAN_POLICIES = ("raise", "propagate")
_ACCEPTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_F32_EXP_MASK = 0xFF
_E8M0_MIN_CODE, _E8M0_MAX_CODE = 1, 254  # 2^-126 .. 2^127; see e8m0_exponent for why not 0


# ------------------------------------------------------------------------------------------
# QTensor
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized tensor.

    codes:       shape of x (or x zero-padded along K when quantize(pad=True)); int formats:
                 int8 (signed) / uint8 (unsigned) integer values, int4 unpacked one per byte;
                 float formats: uint8 bit patterns.
    scale:       float32 effective scale (what multiplies decoded codes), same ndim as codes:
                 tensor -> all ones; channel/token -> [..., 1]; group -> [..., K // g];
                 block (br, bc) -> [..., ceil(R / br), K // bc].
    zero_point:  int32, shape of scale, or None (symmetric).
    scheme:      the QuantScheme used.
    shape:       the original (unpadded) shape of x.
    scale_codes: uint8 bit patterns of `scale` for e8m0 / fp8_e4m3fn scale formats, else None.
    global_scale: float32 0-d tensor of two-level (fp8_e4m3fn scale) schemes, else None.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    scheme: QuantScheme
    shape: tuple[int, ...]
    scale_codes: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def padded(self) -> bool:
        return tuple(self.codes.shape) != tuple(self.shape)

    def expanded_scale(self) -> torch.Tensor:
        """The effective scale broadcast to codes' shape (float32)."""
        return expand_scale(self.scale, self.scheme, tuple(self.codes.shape))

    def expanded_zero_point(self) -> torch.Tensor | None:
        if self.zero_point is None:
            return None
        return expand_scale(self.zero_point, self.scheme, tuple(self.codes.shape))

    def decoded(self) -> torch.Tensor:
        """Element values before scaling, float32, codes' shape (int codes as they are: the zero
        point is not subtracted)."""
        return _decode_elements(self.codes, self.scheme)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x_hat = (decode(codes) - z) * scale, cropped to `shape`, as `dtype`.

        Computed in float32 (float64 when dtype is float64, which makes the product exact)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        vals = self.codes.to(work) if self.scheme.type == "int" else self.decoded().to(work)
        if self.zero_point is not None:
            vals = vals - self.expanded_zero_point().to(work)
        out = vals * self.expanded_scale().to(work)
        if self.padded:
            out = out[tuple(slice(0, n) for n in self.shape)]
        return out.to(dtype)

    def to(self, device) -> "QTensor":
        return tensors_to(self, device)

    def __repr__(self) -> str:
        return f"QTensor({self.scheme}, shape={tuple(self.shape)}, scale={tuple(self.scale.shape)}, device={self.device})"


def tensors_to(obj, device):
    """A copy of the dataclass `obj` (QTensor, fused.PackedQTensor) with every tensor field
    moved to `device` (other fields, and None, as they are)."""
    return dataclasses.replace(obj, **{f.name: getattr(obj, f.name).to(device) for f in dataclasses.fields(obj)
                                       if isinstance(getattr(obj, f.name), torch.Tensor)})


def dequantize(qt: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same as qt.dequantize(dtype)."""
    return qt.dequantize(dtype)


def _decode_elements(codes: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    if scheme.type == "int":
        return codes.to(torch.float32)
    return decode(codes, scheme.fmt)


# ------------------------------------------------------------------------------------------
# Reductions and scale shapes
# ------------------------------------------------------------------------------------------
def scale_shape(shape: tuple[int, ...], scheme: QuantScheme) -> tuple[int, ...]:
    """Shape of the scale for codes of `shape` (K must already be a multiple of the group)."""
    shape = tuple(shape)
    s = scheme.strategy
    if s == "tensor":
        return (1,) * len(shape)
    if s in ("channel", "token"):
        return shape[:-1] + (1,)
    if s == "group":
        return shape[:-1] + (shape[-1] // scheme.group_size,)
    br, bc = scheme.block_size
    return shape[:-2] + (-(-shape[-2] // br), shape[-1] // bc)


def _blocked_view(x: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, tuple[int, ...]]:
    """View x so that each scale's elements lie along the trailing dims listed in the tuple."""
    if scheme.strategy == "group":
        g = scheme.group_size
        return x.reshape(*x.shape[:-1], x.shape[-1] // g, g), (-1,)
    br, bc = scheme.block_size
    R, K = x.shape[-2], x.shape[-1]
    Rp = -(-R // br) * br
    if Rp != R:  # partial last row-block: pad rows with zeros, which never raise an amax
        x = torch.nn.functional.pad(x, (0, 0, 0, Rp - R))
    v = x.reshape(*x.shape[:-2], Rp // br, br, K // bc, bc)
    return v, (-3, -1)


def reduce_amax(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """max |x| per scale, float32, shaped like the scale (see scale_shape).

    x: float tensor whose last dim is a multiple of the group / block width. NaN propagates
    (torch.amax semantics)."""
    a = x.to(torch.float32).abs()
    return _reduce(a, scheme, torch.amax)


def reduce_minmax(x: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(x, 0), max(x, 0)) per scale, float32, shaped like the scale: the range that
    asymmetric quantization covers (it always includes 0 so that 0 is exact)."""
    xf = x.to(torch.float32)
    lo = _reduce(xf, scheme, torch.amin).clamp(max=0.0)
    hi = _reduce(xf, scheme, torch.amax).clamp(min=0.0)
    return lo, hi


def _reduce(x: torch.Tensor, scheme: QuantScheme, op) -> torch.Tensor:
    s = scheme.strategy
    if s == "tensor":
        return op(x.reshape(-1), dim=0).reshape((1,) * x.ndim)
    if s in ("channel", "token"):
        return op(x, dim=-1, keepdim=True)
    v, dims = _blocked_view(x, scheme)
    return op(v, dim=dims)


def expand_scale(scale: torch.Tensor, scheme: QuantScheme, shape: tuple[int, ...]) -> torch.Tensor:
    """Broadcast a per-scale tensor (scale or zero point) to `shape` (the codes' shape)."""
    shape = tuple(shape)
    s = scheme.strategy
    if s == "group":
        scale = scale.repeat_interleave(scheme.group_size, dim=-1)
    elif s == "block":
        br, bc = scheme.block_size
        scale = scale.repeat_interleave(br, dim=-2)[..., : shape[-2], :].repeat_interleave(bc, dim=-1)
    return scale.expand(shape)


# ------------------------------------------------------------------------------------------
# Scale rules
# ------------------------------------------------------------------------------------------
class Scales(NamedTuple):
    """Everything a scheme's scales consist of; shapes as in QTensor."""

    scale: torch.Tensor               # float32 effective scale
    zero_point: torch.Tensor | None   # int32 or None
    scale_codes: torch.Tensor | None  # uint8 (e8m0 / fp8_e4m3fn) or None
    global_scale: torch.Tensor | None  # float32 0-d (two-level) or None


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """IEEE float32 t / c. On CUDA, `tensor / python_number` is computed as t * (1/c) (PyTorch's
    CPU-scalar optimization in div_true_kernel_cuda), which can differ by one ulp; dividing by a
    tensor on t's device keeps the true division on every device."""
    return t / torch.tensor(c, dtype=torch.float32, device=t.device)


def _nonzero_scale(s: torch.Tensor) -> torch.Tensor:
    # A zero group (or one whose amax / qmax underflows to 0) gets s = 1.0: zero codes, finite scale.
    return torch.where(s == 0, torch.ones_like(s), s)


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous().view(torch.int32)


def e8m0_exponent(amax: torch.Tensor, fmt, rounding: str) -> torch.Tensor:
    """Biased e8m0 scale code (uint8) per amax, by torchao's ScaleCalculationMode rules.

    amax: float32 >= 0. With emax = floor(log2(fmt.max)) (8 for fp8_e4m3fn, 2 for fp4_e2m1fn):
      floor: floor(log2 amax) - emax                      (OCP MX spec; may saturate)
      ceil:  ceil(log2 amax) - emax                       (torchao CEIL)
      rceil: ceil(log2(amax / fmt.max)), amax / fmt.max in float32 (torchao RCEIL, cuBLAS;
             = ceil_to_ue8m0(amax / max); never saturates)
      even:  floor rule on amax rounded half-up to fmt.mbits mantissa bits (torchao EVEN)
    log2 is read exactly from the float32 bits (exponent field, plus 1 for "ceil" when the
    mantissa is non-zero), as torchao does for floor/ceil/even and as the hardware
    cvt.rp.satfinite.ue8m0 does for rceil (torchao's eager rceil uses float32 torch.log2,
    which agrees except when amax/max exceeds a power of two by less than float32 log2
    resolution, a ~2^-22 event).
    The result is clamped to [1, 254] (2^-126 .. 2^127). torchao clamps to [0, ...] but then
    divides by max(2^(code-127), 2^-126), so for blocks that tiny it stores code 0 (2^-127)
    while having divided by 2^-126; lowbit stores the 2^-126 it divides by. Elements are the
    same; only such tiny blocks' scale codes differ (0 vs 1). A NaN amax gives 0xFF (NaN).
    """
    amax = amax.to(torch.float32)
    if rounding == "rceil":
        src = _div(amax, float(fmt.max))
    elif rounding == "even":
        bits = _f32_bits(amax)
        src = ((bits + (1 << (23 - fmt.mbits - 1))) & 0x7F800000).view(torch.float32)
    else:
        src = amax
    bits = _f32_bits(src)
    e = (bits >> 23) & _F32_EXP_MASK  # biased float32 exponent == biased e8m0 exponent
    if rounding in ("ceil", "rceil"):
        e = e + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    if rounding != "rceil":
        e = e - _emax(fmt)
    code = e.clamp(_E8M0_MIN_CODE, _E8M0_MAX_CODE).to(torch.uint8)
    return torch.where(torch.isnan(amax), torch.full_like(code, 0xFF), code)


def _emax(fmt) -> int:
    """floor(log2(fmt.max)): the exponent of the element format's largest power of two."""
    return math.frexp(float(fmt.max))[1] - 1


def e8m0_to_scale(codes: torch.Tensor) -> torch.Tensor:
    """float32 value 2^(code - 127) of e8m0 codes in [1, 254]; 0xFF -> NaN."""
    c = codes.to(torch.int32)
    s = (c.clamp(1, 254) << 23).view(torch.float32)
    return torch.where(c == 0xFF, torch.full_like(s, float("nan")), s)


def scale_from_codes(scale_codes: torch.Tensor, scheme: QuantScheme,
                     global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Effective float32 scale from stored scale codes: e8m0 -> 2^(code - 127);
    fp8_e4m3fn (two-level) -> float32(decode(code) * global_scale)."""
    if scheme.scale_format == "e8m0":
        return e8m0_to_scale(scale_codes)
    if scheme.scale_format == "fp8_e4m3fn":
        if global_scale is None:
            raise ValueError("scale_from_codes: two-level (fp8_e4m3fn) scales need global_scale")
        return (decode(scale_codes, scheme.scale_format) * global_scale.to(torch.float32)).to(torch.float32)
    raise ValueError(f"scale_from_codes: scale_format {scheme.scale_format!r} has no scale codes")


def two_level_global_scale(tensor_amax: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """NVFP4's fp32 tensor scale g = amax / (scale_fmt.max * fmt.max) (448 * 6 for NVFP4),
    float32 0-d; g = 1.0 when that is 0 (all-zero tensor), so block scales stay finite."""
    sfmt = get_format(scheme.scale_format)
    g = _div(tensor_amax.to(torch.float32).reshape(()), float(sfmt.max) * float(scheme.fmt.max))
    return _nonzero_scale(g)


def compute_scale(amax: torch.Tensor, scheme: QuantScheme, *, amin: torch.Tensor | None = None,
                  global_scale: torch.Tensor | None = None) -> Scales:
    """Scales from per-scale statistics (float32, shaped like the scale).

    amax:  max |x| per scale (symmetric), or max(x, 0) per scale for asymmetric schemes
           (then `amin` = min(x, 0) is required; see reduce_minmax).
    global_scale: two-level schemes only; defaults to two_level_global_scale(amax.max()),
           which is right when `amax` covers the whole tensor.
    """
    fmt = scheme.fmt
    amax = amax.to(torch.float32)
    if not scheme.symmetric:
        if amin is None:
            raise ValueError("compute_scale: asymmetric schemes need amin = min(x, 0) per scale "
                             "(use reduce_minmax)")
        amin = amin.to(torch.float32)
        s = _nonzero_scale(_div(amax - amin, float(fmt.qmax - fmt.qmin)))
        if not bool(torch.isfinite(s[~torch.isnan(s)]).all()):
            raise ValueError("compute_scale: max(x,0) - min(x,0) overflows float32; the range of x is "
                             "too wide for an asymmetric scheme, use symmetric=True")
        z = torch.clamp(torch.round(fmt.qmin - amin / s), fmt.qmin, fmt.qmax).to(torch.int32)
        return Scales(s, z, None, None)
    if scheme.scale_format == "e8m0":
        codes = e8m0_exponent(amax, fmt, scheme.scale_rounding)
        return Scales(scale_from_codes(codes, scheme), None, codes, None)
    if scheme.scale_format == "fp8_e4m3fn":
        sfmt = get_format(scheme.scale_format)
        g = two_level_global_scale(amax.max(), scheme) if global_scale is None else \
            global_scale.to(torch.float32).reshape(())
        # torchao nvfp4_quantize: block scales relative to g, clamped into e4m3's normal range.
        rel = torch.clamp(_div(amax, float(fmt.max)) / g, min=float(sfmt.min_normal), max=float(sfmt.max))
        codes = _encode_float(rel, sfmt)
        return Scales(scale_from_codes(codes, scheme, g), None, codes, g)
    qmax = fmt.qmax if fmt.kind == "int" else fmt.max
    return Scales(_nonzero_scale(_div(amax, float(qmax))), None, None, None)


# ------------------------------------------------------------------------------------------
# quantize
# ------------------------------------------------------------------------------------------
def _as_float_tensor(x) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "f":
            raise TypeError(f"quantize: x must be a floating array (float16/32/64), got numpy {x.dtype}; "
                            "convert it with x.astype(np.float32) if these are the values to quantize")
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize: x must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.is_complex():
        raise TypeError(f"quantize: x is complex ({x.dtype}); quantize real and imaginary parts "
                        "separately (torch.view_as_real)")
    if x.dtype not in _ACCEPTED_DTYPES:
        raise TypeError(f"quantize: x has dtype {x.dtype}; accepted are float32, float16, bfloat16 and "
                        "float64 (convert with x.float() if these are the values to quantize)")
    return x


def _check_finite(x: torch.Tensor, nan_policy: str, scheme: QuantScheme) -> None:
    if nan_policy not in NAN_POLICIES:
        raise ValueError(f"quantize: nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}")
    if torch.compiler.is_compiling() and nan_policy == "raise":
        # traced by torch.compile: a device-side check keeps the graph whole (reading the count
        # back to the host would break it); a NaN / Inf input still fails the call
        torch._assert_async(torch.isfinite(x).all(), "quantize: x has non-finite values (NaN / Inf); clean the "
                            "input, or run the layer eagerly for the count and the first index")
        return
    bad = ~torch.isfinite(x)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    if nan_policy == "raise":
        n_nan = int(torch.isnan(x).sum())
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        val = float(x[first])
        raise ValueError(f"quantize: x has {n_bad} non-finite value(s) ({n_nan} NaN, {n_bad - n_nan} Inf); "
                         f"first at index {first} = {val}. Clean the input, or pass nan_policy='propagate' "
                         "to let them through (the scale of each group that holds one becomes NaN).")
    fmt = scheme.fmt
    if fmt.kind != "float" or not fmt.has_nan:
        raise ValueError(f"quantize: nan_policy='propagate' needs an element format with a NaN code; "
                         f"{fmt.name} has none, so the {n_bad} non-finite value(s) cannot be carried. "
                         "Clean the input instead.")
    if scheme.two_level:
        raise ValueError("quantize: nan_policy='propagate' is not supported for two-level "
                         "(fp8_e4m3fn scale) schemes: one NaN would poison the tensor scale")


def _check_shape(x: torch.Tensor, scheme: QuantScheme, pad: bool) -> int:
    """Validate shape; return the number of zero columns to append along K."""
    if x.ndim == 0:
        raise ValueError("quantize: x is 0-d; scales reduce along the last axis, so give it at least "
                         "one dimension (x.reshape(1))")
    if x.numel() == 0:
        raise ValueError(f"quantize: x is empty (shape {tuple(x.shape)}); there is nothing to quantize")
    K = x.shape[-1]
    if scheme.strategy == "block":
        if x.ndim < 2:
            raise ValueError(f"quantize: strategy='block' tiles the last two axes; x has shape "
                             f"{tuple(x.shape)}, give it shape [rows, K]")
        width, what = scheme.block_size[1], f"block width {scheme.block_size[1]}"
    elif scheme.strategy == "group":
        width, what = scheme.group_size, f"group_size {scheme.group_size}"
    else:
        return 0
    extra = (-K) % width
    if extra and not pad:
        raise ValueError(f"quantize: K = x.shape[-1] = {K} is not a multiple of the {what} "
                         f"({scheme}); choose a divisor of {K}, or pass pad=True to zero-pad K to "
                         f"{K + extra} (codes then have the padded shape, qt.shape keeps {K})")
    return extra


def quantize(x, scheme: QuantScheme, *, nan_policy: str = "raise", pad: bool = False,
             scales: Scales | None = None) -> QTensor:
    """Quantize x with `scheme`; scales reduce along the last axis (see module docstring).

    x: float tensor (float32/float16/bfloat16/float64, CPU or CUDA; numpy accepted), >= 1-d,
       non-empty; any strides. K = x.shape[-1] must be a multiple of the group / block width
       unless pad=True, which zero-pads K (zeros never change an amax).
    nan_policy: "raise" (default) -> ValueError naming how many non-finite values and where;
       "propagate" -> float formats with a NaN code only: the scale of every group holding a
       NaN/Inf becomes NaN (e8m0 code 0xFF) and that group's codes become NaN.
    scales: precomputed Scales (static / calibrated scales: compute_scale on calibration
       statistics) instead of the ones x would give; shapes must be scale_shape(x.shape) (padded
       K), on x's device. Values beyond such a scale's range are clamped (ints: after rounding,
       so 127.5 -> 127, never a wrapped -128) or saturated (floats).
    Returns a QTensor (codes, scale, zero_point, scale_codes, global_scale, scheme, shape).
    """
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"quantize: scheme must be a QuantScheme (or lowbit.get_preset(name)), "
                        f"got {type(scheme).__name__}")
    x = _as_float_tensor(x)
    extra = _check_shape(x, scheme, pad)
    _check_finite(x, nan_policy, scheme)
    shape = tuple(x.shape)
    xf = x.to(torch.float32).contiguous()
    if extra:
        xf = torch.nn.functional.pad(xf, (0, extra))
    fmt = scheme.fmt

    if scales is not None:
        sc = _check_scales(scales, scheme, tuple(xf.shape), xf.device)
    elif scheme.symmetric:
        amax = reduce_amax(xf, scheme)
        sc = compute_scale(amax, scheme)
    else:
        lo, hi = reduce_minmax(xf, scheme)
        sc = compute_scale(hi, scheme, amin=lo)
    if nan_policy == "propagate":
        sc = _poison(sc, xf, scheme)

    s_full = expand_scale(sc.scale, scheme, tuple(xf.shape))
    z_full = None if sc.zero_point is None else expand_scale(sc.zero_point, scheme, tuple(xf.shape))
    codes = encode_scaled(xf / s_full, z_full, fmt)
    return QTensor(codes, sc.scale, sc.zero_point, scheme, shape, sc.scale_codes, sc.global_scale)


def encode_scaled(scaled: torch.Tensor, zero_point: torch.Tensor | None, fmt) -> torch.Tensor:
    """Codes of x / s (float32, already divided by the effective scale, IEEE division) with the
    zero point broadcast to its shape (int asymmetric) or None: the element step of `quantize`,
    also used by algorithms that quantize a weight column by column (lowbit.algorithms.gptq)."""
    if fmt.kind == "int":
        q = torch.round(scaled)  # round half to even
        if zero_point is None:
            q = torch.clamp(q, -fmt.qmax, fmt.qmax)
        else:
            q = torch.clamp(q + zero_point, fmt.qmin, fmt.qmax)
        return q.to(torch.int8 if fmt.signed else torch.uint8)
    return _encode_float(scaled, fmt)


def _encode_float(x: torch.Tensor, fmt) -> torch.Tensor:
    """encode(x, fmt, saturate=True) of a float tensor: by grid.nearest_code's table lookup (the same
    codes bit for bit, tests/core/test_format_grid.py) for float32 x in an <= 8-bit float format, else by
    encode (float64 arithmetic)."""
    if x.dtype == torch.float32 and grid.supported(fmt):
        return grid.nearest_code(x, fmt)
    return encode(x, fmt, saturate=True)


def _check_scales(sc, scheme: QuantScheme, shape: tuple[int, ...], device) -> Scales:
    """Validate caller-supplied Scales against the scheme and x's (padded) shape."""
    if not isinstance(sc, Scales):
        raise TypeError(f"quantize: scales must be a lowbit.quantize.Scales (from compute_scale), "
                        f"got {type(sc).__name__}")
    want = scale_shape(shape, scheme)
    need = {"scale": True, "zero_point": not scheme.symmetric,
            "scale_codes": scheme.scale_format != "fp32", "global_scale": scheme.two_level}
    for name, required in need.items():
        t = getattr(sc, name)
        if (t is not None) != required:
            raise ValueError(f"quantize: scales.{name} must be {'given' if required else 'None'} for {scheme}")
        if t is None:
            continue
        if name != "global_scale" and tuple(t.shape) != want:
            raise ValueError(f"quantize: scales.{name} has shape {tuple(t.shape)}; {scheme} on x of shape "
                             f"{shape} needs {want}")
        if t.device != device:
            raise ValueError(f"quantize: scales.{name} is on {t.device} but x is on {device}; move one of them")
    if sc.scale.dtype != torch.float32 or not bool((sc.scale > 0).all()) or not bool(torch.isfinite(sc.scale).all()):
        raise ValueError("quantize: scales.scale must be float32, finite and > 0 (compute_scale gives 1.0 "
                         "for zero groups)")
    return sc


def _poison(sc: Scales, xf: torch.Tensor, scheme: QuantScheme) -> Scales:
    """nan_policy='propagate': a group holding a non-finite value gets a NaN scale."""
    bad = _reduce((~torch.isfinite(xf)).to(torch.float32), scheme, torch.amax) > 0
    if not bool(bad.any()):
        return sc
    scale = torch.where(bad, torch.full_like(sc.scale, float("nan")), sc.scale)
    codes = sc.scale_codes
    if codes is not None:  # only e8m0 reaches here (two-level is refused earlier)
        codes = torch.where(bad, torch.full_like(codes, 0xFF), codes)
    return Scales(scale, sc.zero_point, codes, sc.global_scale)



# ------------------------------------------------------------------------------------------
# Static (calibrated) per-tensor activation scales
# ------------------------------------------------------------------------------------------
def static_scheme(act: QuantScheme) -> QuantScheme:
    """The per-tensor static twin of an activation scheme (same element format)."""
    if act.scale_format != "fp32":
        raise ValueError(f"static activation scales need an fp32-scale format; {act.format} with "
                         f"{act.scale_format} scales (MX/NVFP4) is dynamic by construction")
    return dataclasses.replace(act, strategy="tensor", group_size=None, block_size=None, dynamic=False)


def scale_from_absmax(absmax: float | torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """float32 [1, 1] scale for a per-tensor scheme whose tensor maximum is `absmax`, by
    lowbit.quantize.compute_scale (the one place of scale arithmetic)."""
    a = torch.as_tensor(absmax, dtype=torch.float32).reshape(1, 1)
    if not torch.isfinite(a).all():
        raise ValueError(f"calibrated activation maximum is {float(a)}: the calibration text produced NaN/Inf")
    return compute_scale(a, scheme).scale.reshape(1, 1).float()


def quantize_static(x2d: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor):
    """Quantize float32 [M, K] with a fixed per-tensor scale (float32 [1, 1]) by the canonical
    element rounding (round-half-even, saturating). Returns (codes, scale, dequantized float32)."""
    fmt = scheme.fmt
    y = x2d / scale                     # IEEE division, as the canonical arithmetic prescribes
    if fmt.kind == "int":
        if not scheme.symmetric:
            raise NotImplementedError("static asymmetric activation scales are not supported; use symmetric")
        codes = torch.clamp(torch.round(y), -fmt.qmax, fmt.qmax)   # half-even, symmetric [-qmax, qmax]
        return codes.to(torch.int8), scale, codes * scale
    codes = encode(y, fmt, saturate=True)
    return codes, scale, decode(codes, fmt).to(x2d.device) * scale


class _CallableModule(types.ModuleType):
    """Importing the submodule `lowbit.quantize` makes Python bind the package attribute
    `lowbit.quantize` to this module, shadowing the public function lb.quantize(x, scheme)
    (whichever is touched first wins). Calling the module forwards to the function, so
    `lb.quantize(x, scheme)` works in every import order."""

    def __call__(self, x, scheme, **kwargs) -> QTensor:
        return quantize(x, scheme, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
