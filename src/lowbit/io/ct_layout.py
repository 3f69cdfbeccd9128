"""compressed-tensors' on-disk layout of one quantized Linear, to and from lowbit's QTensor.

compressed-tensors (the format vLLM loads) names a layer's tensors after the module
(``<layer>.weight_scale``, ...) and picks a *compression format* per scheme:

==========================  ============================================================
format                      tensors of a layer (shapes for a weight [N, K])
==========================  ============================================================
naive- / int- / float-      ``weight`` int8 or float8_e4m3fn codes [N, K]; ``weight_scale``;
quantized                   ``weight_zero_point`` int8 (asymmetric only)
pack-quantized              ``weight_packed`` int32 [N, ceil(K*b/32)] (code + 2^(b-1), element
                            i at bit i*b of the row); ``weight_shape`` int64 [2];
                            ``weight_scale``; ``weight_zero_point`` packed the same way along
                            dim 0 (asymmetric group/channel)
mxfp8-quantized             ``weight`` float8_e4m3fn; ``weight_scale`` uint8 e8m0 codes [N, K/32]
mxfp4-pack-quantized        ``weight_packed`` uint8 [N, K/2] (element 2j low nibble, 2j+1 high);
                            ``weight_scale`` uint8 e8m0 codes [N, K/32]
nvfp4-pack-quantized        ``weight_packed`` as mxfp4; ``weight_scale`` float8_e4m3fn [N, K/16];
                            ``weight_global_scale`` float32 [1] with effective scale
                            = weight_scale / weight_global_scale
==========================  ============================================================

``weight_scale`` shapes: tensor [1], channel [N, 1], group [N, K/g], block
[ceil(N/br), ceil(K/bc)]. Static activation scales are ``input_scale`` [1].
These follow compressed-tensors 0.20's compressors (compressors/*/base.py); the tests
decompress lowbit's tensors with that package and compare bit for bit.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from lowbit.formats import decode
from lowbit.quantize import QTensor
from lowbit.scheme import QuantScheme

# The tensor names a layer may carry; anything else under a quantized layer is an error.
WEIGHT_KEYS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
               "weight_global_scale")
ACT_KEYS = ("input_scale", "input_zero_point", "input_global_scale")


class UnsupportedScheme(NotImplementedError):
    """A lowbit scheme with no compressed-tensors encoding (or the reverse)."""


# ---------------------------------------------------------------- scheme <-> QuantizationArgs
def _nvfp4_like(s: QuantScheme) -> bool:
    return s.scale_format == "fp8_e4m3fn"


def scheme_to_args(s: QuantScheme) -> dict:
    """compressed-tensors QuantizationArgs (as its JSON dict) for a lowbit scheme.

    Raises UnsupportedScheme for what compressed-tensors cannot express: unsigned integer
    formats, fp8 e5m2 / fnuz variants, fp6, e8m0 scales on groups other than 32, fp8
    block scales on groups other than 16.
    """
    fmt = s.fmt
    if fmt.kind == "int":
        if not fmt.signed:
            raise UnsupportedScheme(f"{s}: compressed-tensors stores signed integer codes; use "
                                    f"int{fmt.bits} with symmetric=False instead of {s.format}")
    elif s.format not in ("fp8_e4m3fn", "fp4_e2m1fn"):
        raise UnsupportedScheme(f"{s}: compressed-tensors has float formats fp8_e4m3fn and "
                                f"fp4_e2m1fn only, not {s.format}")
    args = {"num_bits": fmt.bits, "type": fmt.kind, "symmetric": s.symmetric,
            "group_size": s.group_size, "strategy": s.strategy, "dynamic": s.dynamic}
    if s.strategy == "block":
        args["block_structure"] = list(s.block_size)
    if s.scale_format == "e8m0":
        if s.strategy != "group" or s.group_size != 32:
            raise UnsupportedScheme(f"{s}: compressed-tensors' MX formats need e8m0 scales per group of 32")
        args["scale_dtype"] = "torch.uint8"
    elif _nvfp4_like(s):
        if s.format != "fp4_e2m1fn" or s.strategy != "group" or s.group_size != 16:
            raise UnsupportedScheme(f"{s}: compressed-tensors' two-level (fp8-scaled) format is NVFP4 "
                                    "only: fp4_e2m1fn, groups of 16")
        args["strategy"] = "tensor_group"
        args["scale_dtype"] = "torch.float8_e4m3fn"
    elif s.format == "fp4_e2m1fn":
        raise UnsupportedScheme(f"{s}: fp4 needs e8m0 (MXFP4) or fp8 (NVFP4) group scales in compressed-tensors")
    return args


def args_to_scheme(args: dict) -> QuantScheme:
    """The lowbit scheme of a compressed-tensors QuantizationArgs dict (the inverse of
    scheme_to_args for everything it writes). MX scales are read as scale_rounding='floor'
    (compressed-tensors does not record the rule; it does not change stored codes)."""
    a = dict(args)
    typ, bits, strategy = a.get("type", "int"), a.get("num_bits", 8), a.get("strategy")
    scale_dtype = str(a.get("scale_dtype") or "")
    kw: dict = {"symmetric": bool(a.get("symmetric", True)), "dynamic": a.get("dynamic", False) is not False}
    if typ == "int":
        fmt = f"int{bits}"
    elif (typ, bits) == ("float", 8):
        fmt = "fp8_e4m3fn"
    elif (typ, bits) == ("float", 4):
        fmt = "fp4_e2m1fn"
    else:
        raise UnsupportedScheme(f"compressed-tensors args type={typ!r} num_bits={bits!r} have no lowbit reader")
    if strategy is None:  # compressed-tensors infers it from group_size
        g = a.get("group_size")
        strategy = "tensor" if g is None else ("channel" if g == -1 else "group")
    if strategy == "tensor_group":
        strategy, kw["scale_format"] = "group", "fp8_e4m3fn"
    elif scale_dtype.endswith("uint8"):
        kw["scale_format"], kw["scale_rounding"] = "e8m0", "floor"
    if strategy == "group":
        kw["group_size"] = int(a["group_size"])
    if strategy == "block":
        kw["block_size"] = tuple(int(v) for v in a["block_structure"])
    if strategy not in ("tensor", "channel", "token", "group", "block"):
        raise UnsupportedScheme(f"compressed-tensors strategy {strategy!r} has no lowbit equivalent")
    return QuantScheme(format=fmt, strategy=strategy, **kw)


def ct_format(weight: QuantScheme, act: QuantScheme | None) -> str:
    """The compression format compressed-tensors itself infers for this scheme pair
    (compressors/format.py: its priority list and each compressor's can_compress)."""
    if weight.format == "fp4_e2m1fn" and weight.group_size == 32:
        return "mxfp4-pack-quantized"
    if weight.format == "fp4_e2m1fn" and weight.group_size == 16:
        return "nvfp4-pack-quantized"
    if weight.format == "fp8_e4m3fn" and weight.group_size == 32 and weight.scale_format == "e8m0":
        return "mxfp8-quantized"
    if weight.type == "int":
        # int-quantized outranks pack-quantized whenever activations are quantized at all
        return "int-quantized" if act is not None else "pack-quantized"
    return "float-quantized" if act is not None else "naive-quantized"


# ---------------------------------------------------------------- bit packing (CT layouts)
def pack_int32(codes: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack signed b-bit codes (int8 [R, C]) into int32 words along `dim` as
    compressed-tensors' pack_to_int32: value = code + 2^(b-1), element i of a row at bit
    i*b of the row's little-endian bit stream, the last word zero-padded. b in {2, 4, 8}."""
    if bits not in (2, 4, 8):
        raise UnsupportedScheme(f"packing {bits}-bit codes into int32 is implemented for 2, 4 and 8 bits")
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D, got shape {tuple(codes.shape)}")
    src = codes.t() if dim == 0 else codes
    per = 32 // bits
    rows, cols = src.shape
    shifts = torch.arange(per, dtype=torch.int64, device=codes.device) * bits
    out = torch.empty(rows, -(-cols // per), dtype=torch.int32, device=codes.device)
    # int64 temporaries of ~8 MiB at most on the host, ~128 MiB on a GPU (fewer launches)
    step = max(1, (1 << (20 if codes.device.type == "cpu" else 24)) // max(cols, 1))
    for r0 in range(0, rows, step):
        v = src[r0:r0 + step].to(torch.int64) + (1 << (bits - 1))
        v = torch.nn.functional.pad(v, (0, -cols % per)).reshape(v.shape[0], -1, per)
        words = (v << shifts).sum(-1)  # < 2^32, exact in int64
        out[r0:r0 + step] = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return (out.t() if dim == 0 else out).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: int8 codes with `n` elements along `dim`."""
    if bits not in (2, 4, 8):
        raise UnsupportedScheme(f"unpacking {bits}-bit codes is implemented for 2, 4 and 8 bits")
    if words.dtype != torch.int32 or words.ndim != 2:
        raise ValueError(f"packed words must be a 2-D int32 tensor, got {words.dtype} {tuple(words.shape)}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:
        w = w.t()
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    v = ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], -1)
    if v.shape[1] < n:
        raise ValueError(f"packed tensor holds {v.shape[1]} elements per row, fewer than the {n} expected")
    out = (v[:, :n] - (1 << (bits - 1))).to(torch.int8)
    return (out.t() if dim == 0 else out).contiguous()


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two e2m1 bit patterns per byte, element 2j in the low nibble (compressed-tensors'
    pack_fp4_to_uint8). codes: uint8 [R, K] with K even -> uint8 [R, K/2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---------------------------------------------------------------- QTensor <-> tensors
def _ct_scale_shape(s: QuantScheme, shape) -> tuple:
    n, k = int(shape[0]), int(shape[1])
    if s.strategy == "tensor":
        return (1,)
    if s.strategy in ("channel", "token"):
        return (n, 1)
    if s.strategy == "group":
        return (n, k // s.group_size)
    br, bc = s.block_size
    return (-(-n // br), -(-k // bc))


def check_encodable(qt: QTensor) -> None:
    """Raise (ValueError / UnsupportedScheme) unless qtensor_to_ct can store `qt`."""
    if len(qt.shape) != 2:
        raise ValueError(f"compressed-tensors stores 2-D Linear weights; got shape {tuple(qt.shape)}")
    if tuple(qt.codes.shape) != tuple(qt.shape):
        raise UnsupportedScheme(f"{qt.scheme}: the weight [{qt.shape[0]}, {qt.shape[1]}] was quantized with K "
                                "padded to the group size; compressed-tensors needs K to be a multiple of it")
    scheme_to_args(qt.scheme)


def qtensor_to_ct(qt: QTensor, fmt: str) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors (local names, e.g. 'weight_scale') of a quantized
    2-D weight in compression format `fmt`. Every value is lowbit's own code or scale,
    re-laid out, never recomputed, so the round trip is exact."""
    s = qt.scheme
    check_encodable(qt)
    scale_shape = _ct_scale_shape(s, qt.shape)
    out: dict[str, torch.Tensor] = {}
    if fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        out["weight_packed"] = pack_fp4(qt.codes)
    elif fmt == "pack-quantized":
        out["weight_packed"] = pack_int32(qt.codes.to(torch.int8), s.num_bits)
        out["weight_shape"] = torch.tensor(list(qt.shape), dtype=torch.int64)
    elif s.type == "float":
        out["weight"] = qt.codes.to(torch.uint8).view(torch.float8_e4m3fn)
    else:
        out["weight"] = qt.codes.to(torch.int8)
    if s.scale_format == "e8m0":
        out["weight_scale"] = qt.scale_codes.to(torch.uint8).reshape(scale_shape)
    elif s.scale_format == "fp8_e4m3fn":
        out["weight_scale"] = qt.scale_codes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(scale_shape)
        # compressed-tensors divides by its global scale; lowbit multiplies by its own.
        out["weight_global_scale"] = (1.0 / qt.global_scale.to(torch.float32)).reshape(1)
    else:
        out["weight_scale"] = qt.scale.to(torch.float32).reshape(scale_shape)
    if not s.symmetric:
        zp = qt.zero_point.to(torch.int8).reshape(scale_shape)
        if fmt == "pack-quantized" and s.strategy in ("group", "channel"):
            zp = pack_int32(zp, s.num_bits, dim=0)
        out["weight_zero_point"] = zp
    return out


def ct_to_qtensor(t: dict[str, torch.Tensor], scheme: QuantScheme, fmt: str,
                  global_scale: torch.Tensor | None = None, where: str = "layer") -> QTensor:
    """Rebuild lowbit's QTensor from a layer's compressed-tensors tensors (local names).

    `global_scale`: lowbit's exact float32 tensor scale for two-level schemes when the
    checkpoint recorded it; otherwise it is 1 / weight_global_scale (compressed-tensors'
    convention). Raises CheckpointError-style ValueError naming `where` on any mismatch.
    """

    def need(key):
        if key not in t:
            raise ValueError(f"{where}: missing tensor {key!r} required by format {fmt!r} and scheme {scheme}")
        return t[key]

    if fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        packed = need("weight_packed")
        if packed.dtype != torch.uint8 or packed.ndim != 2:
            raise ValueError(f"{where}: weight_packed is {packed.dtype} {list(packed.shape)}; fp4 codes are "
                             "packed two per uint8 byte, [N, K / 2]")
        codes = unpack_fp4(packed)
    elif fmt == "pack-quantized":
        ws, packed = need("weight_shape"), need("weight_packed")
        shape = [int(v) for v in ws.tolist()] if ws.dtype in (torch.int32, torch.int64) and ws.ndim == 1 else []
        per_word = 32 // scheme.num_bits
        if (len(shape) != 2 or min(shape) < 1 or packed.dtype != torch.int32 or packed.ndim != 2
                or list(packed.shape) != [shape[0], -(-shape[1] // per_word)]):
            raise ValueError(f"{where}: weight_shape {ws.tolist() if ws.numel() < 8 else list(ws.shape)} and "
                             f"weight_packed {packed.dtype} {list(packed.shape)} disagree (int32 words of "
                             f"{per_word} codes each along K)")
        codes = unpack_int32(packed, scheme.num_bits, shape[1])
        if list(codes.shape) != shape:
            raise ValueError(f"{where}: weight_shape {shape} does not match weight_packed {tuple(packed.shape)}")
    else:
        w = need("weight")
        want = torch.float8_e4m3fn if scheme.type == "float" else torch.int8
        if w.dtype != want:
            raise ValueError(f"{where}: weight has dtype {w.dtype}, scheme {scheme} stores {want}")
        codes = w.view(torch.uint8) if scheme.type == "float" else w
    shape = tuple(codes.shape)
    scale_shape = _ct_scale_shape(scheme, shape)
    raw = need("weight_scale")
    if tuple(raw.shape) != scale_shape:
        raise ValueError(f"{where}: weight_scale has shape {tuple(raw.shape)}, scheme {scheme} on a "
                         f"{list(shape)} weight needs {list(scale_shape)}")
    lb_shape = _lowbit_scale_shape(scale_shape, scheme)
    scale_codes = gscale = None
    if scheme.scale_format == "e8m0":
        if raw.dtype != torch.uint8:
            raise ValueError(f"{where}: MX weight_scale must be uint8 e8m0 codes, got {raw.dtype}")
        scale_codes = raw.reshape(lb_shape).clone()
        scale = decode(scale_codes, "e8m0fnu")
    elif scheme.scale_format == "fp8_e4m3fn":
        if raw.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{where}: NVFP4 weight_scale must be float8_e4m3fn, got {raw.dtype}")
        scale_codes = raw.view(torch.uint8).reshape(lb_shape).clone()
        if global_scale is None:
            gscale = (1.0 / need("weight_global_scale").to(torch.float32)).reshape(())
        else:
            gscale = global_scale.to(torch.float32).reshape(())
        scale = decode(scale_codes, "fp8_e4m3fn") * gscale
    else:
        if raw.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{where}: weight_scale has dtype {raw.dtype}; expected a float32/bf16/fp16 scale")
        # Other tools often store bf16/fp16 scales; widening them to float32 is exact.
        scale = raw.reshape(lb_shape).to(torch.float32).clone()
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        # (a zero scale, which some tools write for an all-zero group, dequantizes to zeros: allowed)
        raise ValueError(f"{where}: weight_scale holds NaN, infinite or negative scales; the checkpoint "
                         "is corrupt (a scale multiplies every code of its group)")
    zp = None
    if not scheme.symmetric:
        z = need("weight_zero_point")
        if fmt == "pack-quantized" and scheme.strategy in ("group", "channel"):
            if z.dtype != torch.int32 or z.ndim != 2 or z.shape[1] != scale_shape[1]:
                raise ValueError(f"{where}: weight_zero_point is {z.dtype} {list(z.shape)}; packed int32 words "
                                 f"with {scale_shape[1]} columns expected")
            z = unpack_int32(z, scheme.num_bits, scale_shape[0], dim=0)
        if z.numel() != math.prod(lb_shape) or z.is_floating_point():
            raise ValueError(f"{where}: weight_zero_point is {z.dtype} {list(z.shape)}; integer zero points of "
                             f"shape {list(scale_shape)} expected")
        zp = z.reshape(lb_shape).to(torch.int32)
        fmt_q = scheme.fmt
        if bool((zp < fmt_q.qmin).any()) or bool((zp > fmt_q.qmax).any()):
            raise ValueError(f"{where}: weight_zero_point outside [{fmt_q.qmin}, {fmt_q.qmax}] of {scheme.format}")
    return _make_qtensor(codes=codes.clone(), scale=scale, zero_point=zp, scale_codes=scale_codes,
                         global_scale=gscale, scheme=scheme, shape=tuple(shape))


def _lowbit_scale_shape(ct_shape: tuple, scheme: QuantScheme) -> tuple:
    # lowbit keeps the scale's ndim equal to the weight's: tensor -> [1, 1]
    return (1, 1) if scheme.strategy == "tensor" else ct_shape


def _make_qtensor(**fields) -> QTensor:
    names = {f.name for f in dataclasses.fields(QTensor)}
    return QTensor(**{k: v for k, v in fields.items() if k in names})
