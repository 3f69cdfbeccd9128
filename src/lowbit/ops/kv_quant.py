"""Quantized keys and values: the KV-cache scheme and the arithmetic on [B, H, T, D] states.

A cached key or value tensor has shape [batch, kv_heads, tokens, head_dim]. Its scales:
  tensor  one static scale per layer (calibrated)           scale [1, 1, 1, 1]
  head    one static scale per KV head (calibrated)         scale [1, H, 1, 1]
  token   one dynamic scale per (batch, head, token)        scale [B, H, T, 1]
  group   one dynamic scale per group_size head-dim values  scale [B, H, T, D // group_size]
Every quantization goes through lowbit.quantize on a 2-D view whose rows are exactly the
scale's reach (tensor: one row; head: one row per head; token / group: one row per token), so
the codes are the canonical ones bit for bit; static scales are passed in as
lowbit.quantize.Scales (values beyond a static scale's range saturate (fp8) or clamp (int)).

The dequantized value is decode(code) * scale (vLLM's k_scale / v_scale convention: the scale
multiplies the stored code), in float32 or float64.

int4 codes are stored two per byte along head_dim (lowbit.packing.pack_int4: element 2j in the
low nibble, 2j+1 in the high), so the cache holds [B, H, T, D / 2] uint8 and head_dim must be
even; KVQuant.unpacked() gives the one-code-per-byte int8 form.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.formats import decode
import lowbit.quantize as Q
from lowbit.packing import pack_int4, unpack_int4
from lowbit.scheme import QuantScheme

FORMAT_ALIASES = {"fp8": "fp8_e4m3fn", "fp8_e4m3fn": "fp8_e4m3fn", "int8": "int8", "int4": "int4"}
GRANULARITIES = ("tensor", "head", "token", "group")
STATIC = ("tensor", "head")


@dataclass(frozen=True)
class KVScheme:
    """How a layer's keys and values are stored.

    format: "fp8_e4m3fn" | "int8" | "int4" (symmetric; int4 codes nibble-packed, two per byte).
    granularity: "tensor" / "head" (static: scales calibrated once) or "token" / "group"
                 (dynamic: computed from each new token's values as it is written).
    group_size: head-dim values per scale, for and only for granularity "group".
    """

    format: str = "fp8_e4m3fn"
    granularity: str = "tensor"
    group_size: int | None = None

    def __post_init__(self):
        fmt = FORMAT_ALIASES.get(self.format)
        if fmt is None:
            raise ValueError(f"KVScheme: format must be one of {sorted(FORMAT_ALIASES)}, got {self.format!r}")
        object.__setattr__(self, "format", fmt)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"KVScheme: granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if (self.granularity == "group") != (self.group_size is not None):
            raise ValueError("KVScheme: group_size is required for granularity='group' and only for it "
                             f"(got granularity={self.granularity!r}, group_size={self.group_size!r})")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"KVScheme: group_size must be a positive int, got {self.group_size!r}")

    @property
    def dynamic(self) -> bool:
        return self.granularity not in STATIC

    @property
    def element_scheme(self) -> QuantScheme:
        """The QuantScheme applied to the 2-D view (see module docstring)."""
        strategy = {"tensor": "tensor", "head": "channel", "token": "token", "group": "group"}[self.granularity]
        return QuantScheme(format=self.format, strategy=strategy, group_size=self.group_size,
                           dynamic=self.dynamic)

    @property
    def fmt(self):
        return self.element_scheme.fmt

    def __str__(self) -> str:
        g = f"group{self.group_size}" if self.granularity == "group" else self.granularity
        return f"{self.format} {g}"

    @classmethod
    def parse(cls, spec) -> "KVScheme":
        """'fp8' | 'int8' (static per tensor), '<fmt>-head' (static per head), '<fmt>-token'
        (dynamic per token and head), 'int4-g32' (dynamic per group of 32 head-dim values)."""
        if isinstance(spec, KVScheme):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"kv_cache must be a KVScheme or a name like 'fp8', 'int8-head', 'int4-g32'; "
                            f"got {type(spec).__name__}")
        fmt, _, gran = spec.partition("-")
        if fmt not in FORMAT_ALIASES:
            raise ValueError(f"kv_cache={spec!r}: unknown format {fmt!r}; use fp8, int8 or int4, optionally "
                             "with -head, -token or -g<N> (e.g. 'fp8', 'fp8-head', 'int8-token', 'int4-g32')")
        if gran.startswith("g") and gran[1:].isdigit():
            return cls(fmt, "group", int(gran[1:]))
        if gran == "" and fmt == "int4":
            raise ValueError("kv_cache='int4' needs a group size: 4-bit codes with one scale per tensor lose "
                             "every small value; use e.g. 'int4-g32'")
        gran = gran or "tensor"
        if gran not in ("tensor", "head", "token"):
            raise ValueError(f"kv_cache={spec!r}: unknown granularity {gran!r}; use -head, -token or -g<N>")
        return cls(fmt, gran)

    # ---- compressed-tensors kv_cache_scheme (QuantizationArgs fields) ----------------------
    def to_ct_args(self) -> dict:
        """compressed-tensors' kv_cache_scheme dict. Static tensor / head scales are stored as
        `self_attn.k_scale` / `v_scale` tensors of shape [1] / [H, 1, 1] ("attn_head")."""
        strategy = {"tensor": "tensor", "head": "attn_head", "token": "token", "group": "group"}[self.granularity]
        return {"num_bits": self.fmt.bits, "type": self.fmt.kind, "symmetric": True, "strategy": strategy,
                "group_size": self.group_size, "dynamic": self.dynamic, "observer": None if self.dynamic else "minmax"}

    @classmethod
    def from_ct_args(cls, d: dict) -> "KVScheme":
        if not isinstance(d, dict):
            raise TypeError(f"kv_cache_scheme must be a dict, got {type(d).__name__}")
        bits, typ = d.get("num_bits"), d.get("type")
        fmt = {(8, "float"): "fp8_e4m3fn", (8, "int"): "int8", (4, "int"): "int4"}.get((bits, typ))
        if fmt is None:
            raise ValueError(f"kv_cache_scheme: num_bits={bits}, type={typ!r} is not a KV format lowbit reads "
                             "(8-bit float, 8-bit int, 4-bit int)")
        if d.get("symmetric", True) is not True:
            raise ValueError("kv_cache_scheme: asymmetric KV caches are not supported (vLLM refuses them too)")
        strategy = d.get("strategy")
        gran = {"tensor": "tensor", "attn_head": "head", "token": "token", "group": "group"}.get(strategy)
        if gran is None:
            raise ValueError(f"kv_cache_scheme: strategy {strategy!r} is not one of tensor, attn_head, token, group")
        scheme = cls(fmt, gran, d.get("group_size") if gran == "group" else None)
        if bool(d.get("dynamic", False)) != scheme.dynamic:
            raise ValueError(f"kv_cache_scheme: dynamic={d.get('dynamic')} disagrees with strategy {strategy!r} "
                             f"(lowbit's {gran} scales are {'dynamic' if scheme.dynamic else 'static'})")
        return scheme


@dataclass(eq=False)
class KVQuant:
    """Quantized keys or values. codes: uint8 fp8 bit patterns or int8 values [B, H, T, D]; for
    int4, uint8 [B, H, T, D / 2] nibble-packed (as stored) or int8 [B, H, T, D] one code per byte
    (the unpacked form, `unpacked()`). scale float32 shaped as the module docstring says."""

    codes: torch.Tensor
    scale: torch.Tensor
    scheme: KVScheme

    def __post_init__(self):
        c, s, sch = self.codes, self.scale, self.scheme
        kind = sch.fmt.kind
        want_dt = (torch.uint8,) if kind == "float" else (torch.uint8, torch.int8) if sch.fmt.bits == 4 \
            else (torch.int8,)
        if not isinstance(c, torch.Tensor) or c.ndim != 4 or c.dtype not in want_dt:
            what = " or ".join(str(d) for d in want_dt)
            raise ValueError(f"KVQuant: {sch} codes must be a 4-D {what} tensor [B, H, T, D]"
                             f"{' (uint8: two int4 codes per byte, [B, H, T, D / 2])' if len(want_dt) == 2 else ''}, "
                             f"got {getattr(c, 'dtype', type(c).__name__)} {tuple(getattr(c, 'shape', ()))}")
        B, H, T, D = self.shape
        want = {"tensor": (1, 1, 1, 1), "head": (1, H, 1, 1), "token": (B, H, T, 1),
                "group": (B, H, T, D // sch.group_size if sch.group_size else 0)}[sch.granularity]
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"KVQuant: {sch} with codes {tuple(c.shape)} needs a float32 scale of shape {want}, got "
                             f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))} (a scale "
                             "that disagrees with the declared scheme)")

    @property
    def packed(self) -> bool:
        """int4 codes two per byte (the stored form)."""
        return self.scheme.fmt.bits == 4 and self.codes.dtype == torch.uint8

    def unpacked(self) -> "KVQuant":
        """The same cache with one code per byte (int4: int8 [B, H, T, D]); self when already so."""
        if not self.packed:
            return self
        return KVQuant(unpack_int4(self.codes), self.scale, self.scheme)

    @property
    def shape(self) -> tuple[int, ...]:
        """[B, H, T, D]: the states' shape (D counts int4 codes, not bytes)."""
        B, H, T, D = self.codes.shape
        return (B, H, T, 2 * D if self.packed else D)

    def scale_bhtg(self) -> torch.Tensor:
        """The scale broadcast (stride 0, no copy) to [B, H, T, G] (G = D // group_size, else 1)."""
        B, H, T, _ = self.codes.shape
        return self.scale.expand(B, H, T, self.scale.shape[-1])

    def decoded(self) -> torch.Tensor:
        """Element values before scaling, float32 [B, H, T, D]."""
        if self.scheme.fmt.kind == "int":
            return self.unpacked().codes.to(torch.float32)
        return decode(self.codes, self.scheme.fmt)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """decode(code) * scale, computed in float32 (float64 when asked: then exact), as dtype."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        s = self.scale.to(work)
        if self.scheme.granularity == "group":
            s = s.repeat_interleave(self.scheme.group_size, dim=-1)
        return (self.decoded().to(work) * s).to(dtype)

    def nbytes(self) -> int:
        """Bytes as stored here (codes as held: int4 packed two per byte) plus the scales."""
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * 4

    def to(self, device) -> "KVQuant":
        return KVQuant(self.codes.to(device), self.scale.to(device), self.scheme)

    def select_tokens(self, sl: slice) -> "KVQuant":
        s = self.scale[:, :, sl] if self.scheme.dynamic else self.scale
        return KVQuant(self.codes[:, :, sl], s, self.scheme)


def _check_states(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 4:
        raise ValueError(f"{name} must be a [batch, kv_heads, tokens, head_dim] tensor, got "
                         f"{type(x).__name__ if not isinstance(x, torch.Tensor) else tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {x.dtype}")
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        b, h, t, d = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} holds {int(bad.sum())} NaN/Inf value(s), first at batch {b}, head {h}, token "
                         f"{t}, dim {d}: a quantized cache cannot store them (and one would poison a "
                         "shared scale); fix the model's activations before caching")


def _view2d(x: torch.Tensor, scheme: KVScheme) -> torch.Tensor:
    B, H, T, D = x.shape
    if scheme.granularity == "tensor":
        return x.reshape(1, -1)
    if scheme.granularity == "head":
        return x.transpose(0, 1).reshape(H, -1)
    return x.reshape(-1, D)


def _from2d(codes: torch.Tensor, shape, scheme: KVScheme) -> torch.Tensor:
    B, H, T, D = shape
    if scheme.granularity == "head":
        return codes.reshape(H, B, T, D).transpose(0, 1).contiguous()
    return codes.reshape(B, H, T, D)


def observe_amax(x: torch.Tensor, scheme: KVScheme, name: str = "states") -> torch.Tensor:
    """max |x| over what one static scale covers: [1, 1, 1, 1] (tensor) or [1, H, 1, 1] (head)."""
    _check_states(x, name)
    if scheme.dynamic:
        raise ValueError(f"{scheme} scales are dynamic; there is nothing to calibrate")
    a = Q.reduce_amax(_view2d(x.float(), scheme), scheme.element_scheme)
    return a.reshape(1, 1, 1, 1) if scheme.granularity == "tensor" else a.reshape(1, -1, 1, 1)


def static_scale(amax: torch.Tensor, scheme: KVScheme) -> torch.Tensor:
    """Static scale from calibrated amax (shape [1,1,1,1] or [1,H,1,1]): lowbit.quantize's rule
    (amax / fmt max; an all-zero head gets scale 1.0, so its codes are 0, never NaN)."""
    if scheme.dynamic:
        raise ValueError(f"{scheme} scales are dynamic: static_scale does not apply")
    flat = amax.detach().to(torch.float32).reshape(-1, 1)
    return Q.compute_scale(flat, scheme.element_scheme).scale.reshape(amax.shape)


def quantize_kv(x: torch.Tensor, scheme: KVScheme, scale: torch.Tensor | None = None,
                name: str = "states") -> KVQuant:
    """Quantize key or value states x [B, H, T, D] (any float dtype). Static schemes need `scale`
    (from static_scale; [1,1,1,1] or [1,H,1,1]); dynamic ones compute theirs and refuse one."""
    _check_states(x, name)
    B, H, T, D = x.shape
    es = scheme.element_scheme
    if scheme.granularity == "group" and D % scheme.group_size:
        raise ValueError(f"{name}: head_dim {D} is not a multiple of the KV group size {scheme.group_size}; "
                         f"choose a divisor of {D}")
    if scheme.fmt.bits == 4 and D % 2:
        raise ValueError(f"{name}: head_dim {D} is odd; int4 KV codes are packed two per byte along head_dim, "
                         "so it must be even: use an 8-bit KV cache (fp8, int8) for this model")
    if scheme.dynamic:
        if scale is not None:
            raise ValueError(f"{scheme} scales are dynamic (computed per token); do not pass a static scale")
        qt = Q.quantize(_view2d(x, scheme), es)
        G = qt.scale.shape[-1]
        return KVQuant(_stored(_from2d(qt.codes, x.shape, scheme), scheme), qt.scale.reshape(B, H, T, G).contiguous(),
                       scheme)
    want = (1, 1, 1, 1) if scheme.granularity == "tensor" else (1, H, 1, 1)
    if scale is None:
        raise ValueError(f"{scheme} is static: pass the calibrated scale (shape {want}; "
                         "lowbit.ops.kv_quant.static_scale(observe_amax(...)))")
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: static scale has shape {tuple(scale.shape)}, {scheme} with {H} KV heads "
                         f"needs {want} (a per-tensor scale where per-head was declared, or the other way round?)")
    s2 = scale.detach().to(device=x.device, dtype=torch.float32).reshape(-1, 1)
    qt = Q.quantize(_view2d(x, scheme), es, scales=Q.Scales(s2, None, None, None))
    return KVQuant(_stored(_from2d(qt.codes, x.shape, scheme), scheme), scale.detach().to(x.device, torch.float32),
                   scheme)


def _stored(codes: torch.Tensor, scheme: KVScheme) -> torch.Tensor:
    """Codes as the cache holds them: int4 nibble-packed along head_dim, the rest as they are."""
    return pack_int4(codes) if scheme.fmt.bits == 4 else codes


def alloc_tokens(like: KVQuant, capacity: int) -> KVQuant:
    """A zeroed cache for `capacity` tokens with like's batch, heads, head_dim, scheme, code layout
    and device (static scales: like's, shared). Positions not yet written hold code 0 and (dynamic)
    scale 0, so a kernel that reads past the filled tokens under a mask reads zeros, never NaN."""
    B, H, _, Dc = like.codes.shape
    codes = torch.zeros(B, H, capacity, Dc, dtype=like.codes.dtype, device=like.codes.device)
    if like.scheme.dynamic:
        scale = torch.zeros(B, H, capacity, like.scale.shape[-1], dtype=torch.float32, device=like.scale.device)
    else:
        scale = like.scale
    return KVQuant(codes, scale, like.scheme)


def write_tokens(cache: KVQuant, new: KVQuant, start: int) -> None:
    """Copy new's codes (and dynamic scales) into cache's token positions [start, start + T) in
    place: the append of a preallocated cache (lowbit.nn.kv_cache). A static scheme's scale is the
    cache's: new must have been quantized with it (not checked: that would read the device)."""
    if cache.scheme != new.scheme:
        raise ValueError(f"cannot append {new.scheme} states to a {cache.scheme} cache")
    if cache.codes.dtype != new.codes.dtype:
        raise ValueError(f"cannot append {new.codes.dtype} codes to a cache holding {cache.codes.dtype} codes "
                         "(int4: append packed codes to packed ones)")
    B, H, cap, Dc = cache.codes.shape
    b, h, T, dc = new.codes.shape
    if (b, h, dc) != (B, H, Dc):
        raise ValueError(f"cannot append states of shape {new.shape} to a cache of shape {cache.shape}: batch, "
                         "KV heads and head_dim must agree (reset the cache, or reorder / select its batch first)")
    if not 0 <= start <= cap - T:
        raise ValueError(f"tokens [{start}, {start + T}) do not fit a cache of capacity {cap}")
    cache.codes[:, :, start:start + T].copy_(new.codes)
    if cache.scheme.dynamic:
        cache.scale[:, :, start:start + T].copy_(new.scale)
