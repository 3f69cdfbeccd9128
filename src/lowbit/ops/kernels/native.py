"""lowbit's native (CUDA C++, sm_90a) decode kernels as dense kernel classes: opt-in.

  native_w4a16     int4 weights in groups of 32-256 (symmetric or with zero points), bf16 activations
  native_w8a16     int8 weights, one scale per output channel, bf16 activations
  native_w8a8_int8 / native_w8a8_fp8   per-token symmetric int8 / e4m3 activations x per-channel weights

Each stands in for the Triton class it extends (same kind, so the same tuning-table cells).
The weight-only classes (native_w4a16, native_w8a16) hold the native layout alone, the weight once: rows the
GEMV takes (bf16; a bias in float32 or bf16) run it 16 rows a launch, up to 64 rows without a table cell;
every other call (more rows, fp16 / fp32 activations, an fp16 bias, a cell's "dequant") dequantizes the
weight from the native layout into the scratch buffer (lowbit.ops.native.kernels.dequantize: each value
rounded once to x's dtype) and runs the float GEMM, the Triton classes' dequant arithmetic. The W8A8 classes
keep the Triton layout beside the native one (their weight twice: no exact dequantized path exists for
quantized activations): decode calls (1-16 rows) run the native GEMV, every other call the Triton class.
Which path runs M rows, and with which launch variant (splits, nt, prefetch, fixup), is the tuning table's
"native" cell for the kind, shape and bucket (`lowbit tune` times the variants against the dequant path /
the Triton class); without a cell, the Linear heuristic's path with the default launch.

Opt-in because the native kernels have not yet been timed on a GPU: LOWBIT_NATIVE=1 for the process, or
`with opted_in():` around the quantization (or loading) of one model; without it, and
where the library cannot run (no sm_90 GPU, no built library and no toolchain: library.unavailable_reason),
the class refuses with that reason and dispatch takes the Triton class. Their launches go through ctypes,
which lowbit.ops.bound's recorded plans cannot hold (the launch says so: note_unrecordable); the classes are
graph-safe (no host synchronisation), so an opted-in layer's eager decode calls replay its CUDA graph.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass

import torch

from lowbit.ops.kernels.base import LinearLayer, Refused
from lowbit.ops.kernels.dense_w4 import TritonW4A16
from lowbit.ops.kernels.dense_w8 import TritonW8A8Fp8, TritonW8A8Int8, TritonW8A16
from lowbit.ops import tuning
from lowbit.ops.kernels.prepared_kernel import Prepared, Spec
from lowbit.ops.native import kernels as native
from lowbit.ops.native import library
from lowbit.ops.native.layout import TILE_N
from lowbit.ops.float_gemm import bf16_gemm
from lowbit.ops.scratch import scratch
from lowbit.ops.kernels.schemes import w4a16_kind

OPT_IN = "LOWBIT_NATIVE"
# opted_in()'s setting for the current context (thread / task); None: the environment decides
_SCOPED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("lowbit_native_opt_in", default=None)


@contextlib.contextmanager
def opted_in(enabled: bool = True):
    """Inside the block the native classes are opted in (enabled=False: opted out), whatever LOWBIT_NATIVE
    says; in the calling context only (another thread keeps the environment's answer). Dispatch asks once,
    when a layer is prepared (quantized or loaded), and never again per call: a layer prepared inside keeps
    its native class after the block, and a layer prepared after it gets what LOWBIT_NATIVE says."""
    token = _SCOPED.set(bool(enabled))
    try:
        yield
    finally:
        _SCOPED.reset(token)


def native_refusal() -> str | None:
    """Why the native classes do not run here (None: opted in and the library can run)."""
    scoped = _SCOPED.get()
    if scoped is False:
        return "opt-in: opted out in this block (lowbit.ops.kernels.native.opted_in(False))"
    if scoped is None and os.environ.get(OPT_IN) != "1":
        return (f"opt-in: set {OPT_IN}=1 (or quantize inside lowbit.ops.kernels.native.opted_in()) to use the "
                "native sm_90a decode kernels (not yet timed on a GPU)")
    return library.unavailable_reason()


def covering(weight, act) -> list[type]:
    """The native classes that take layers of these schemes (weight: QuantScheme; act: QuantScheme or
    None), the device and the layer's shape aside."""
    layer = LinearLayer(weight, act)
    return [cls for cls in NATIVE if cls.refuses(layer) is None]


def _layout(prepare, weight_q):
    """The native layout of weight_q; Refused (dispatch moves on) where it cannot hold it."""
    try:
        w = prepare(weight_q)
    except ValueError as err:
        raise Refused(str(err)) from None
    extra = {"n_packed": w.packed, "n_scale": w.scale, "n_counters": w.counters}
    if getattr(w, "zero", None) is not None:
        extra["n_zero"] = w.zero
    return extra


def _with_native(cls, prepared: Prepared, extra: dict[str, torch.Tensor]) -> Prepared:
    """The Triton class's operands plus the native layout's, under a Spec naming `cls`."""
    t = {**prepared.tensors, **extra}
    spec = Spec(**{**prepared.spec.__dict__, "operands": tuple(t), "kernel": cls.name})
    return Prepared(Spec(**{**spec.__dict__, "graphable": cls.graph_safe(spec)}), t)


def _gemv_ok(x2: torch.Tensor, bias, N: int) -> bool:
    """Whether the native GEMV reads this call's rows (16 at a time): contiguous, 16-byte aligned rows of bf16, and
    no bias or one it reads (native.bias_refusal)."""
    return (x2.dtype == torch.bfloat16 and x2.shape[0] > 0 and x2.is_contiguous() and x2.data_ptr() % 16 == 0
            and (bias is None or native.bias_refusal(bias, N, x2.device) is None))


@dataclass(frozen=True)
class NativeCall:
    """How a weight-only native layer runs M rows (for_rows' answer): "kernel", the GEMV (16 rows per launch)
    with the launch variant's keywords, or "dequant", the weight dequantized from the native layout into the
    scratch buffer, then the float GEMM. variant: the launch keywords as sorted (name, value) pairs."""
    path: str
    variant: tuple = ()


class _Native:
    """Mixed in ahead of a Triton class: the native refusal, the native layout beside the Triton one (W8A8) and the
    decode call.
    Subclasses set triton_cls (the class they stand in for), native_layout (QTensor -> native weight)
    and native_call(spec, x2, ops, bias, variant) (the decode launch; variant: launch_variant's keywords)."""
    triton_cls = None
    native_layout = None
    native_call = None
    row_tile = TILE_N    # the native layouts pad N to tiles of 16 rows
    # what a native cell weighs the GEMV against, and the buckets (lowbit.ops.tuning) where the GEMV may run
    alternative, gemv_buckets = "triton", ("1", "2-16")

    @classmethod
    def prepare(cls, weight_q, act_scheme, static_scale):
        extra = _layout(cls.native_layout, weight_q)
        return _with_native(cls, super().prepare(weight_q, act_scheme, static_scale), extra)

    @classmethod
    def for_rows(cls, spec, M):
        """(this class, its launch variant) where the tuning table's native cell for this kind, shape and
        bucket says the native kernel (no cell: it does, up to MAX_M rows), else the Triton class's own
        answer (its kernel or dequant path and tiles, from its linear cell)."""
        path, cfg = tuning.choose("native", tuning.kind_key(spec), spec.N, spec.K, M)
        if path == "kernel" and M <= native.MAX_M:
            return cls, launch_variant(cfg)
        return cls.triton_cls.for_rows(spec, M)

    @classmethod
    def apply(cls, spec, x2, ops, bias, config):
        if x2.shape[0] <= native.MAX_M and _gemv_ok(x2, bias, spec.N):
            return cls.native_call(spec, x2, ops, bias, {} if config is None else config)
        tcls, tcfg = cls.triton_cls.for_rows(spec, x2.shape[0])   # fp16 / fp32 rows or a bias it cannot read
        return tcls.apply(spec, x2, ops, bias, tcfg)

    @classmethod
    def can_run(cls, layer, device):
        # the scheme first: a layer of another kind hears why, not the opt-in
        return cls.refuses(layer) or (None if device is None else cls.device_refusal(device))

    @classmethod
    def device_refusal(cls, device):
        why = super().device_refusal(device)
        if why is None and device.kind != "cuda":
            why = "the native kernels need a CUDA GPU (sm_90)"
        if why is None and device.capability != library.NEEDS_CAPABILITY:
            why = f"the native kernels hold sm_90a code only; this GPU is {device}"
        return why or native_refusal()

    @classmethod
    def graph_safe(cls, spec):
        # no host synchronisation in a call: a layer's decode calls may be captured in a CUDA graph (its
        # ctypes launches on the capturing stream); a recorded plan cannot hold them (bound.note_unrecordable)
        return True


class _NativeWeightOnly(_Native):
    """A weight-only native class: the native layout alone, so the layer holds its weight once. Rows the table
    (or, without a cell, the heuristic: up to 64 rows) gives the kernel run the GEMV, 16 rows per launch; other
    calls (more rows, fp16 / fp32 activations, a bias the GEMV cannot read) the weight dequantized from the
    native layout into the scratch buffer (each value rounded once to x's dtype) and the float GEMM, as the
    Triton classes' dequant path. Subclasses set kind, native_layout, gemv (native.w4a16 / w8a16) and
    spec_fields(weight_q)."""
    gemv = None
    alternative, gemv_buckets = "dequant", ("1", "2-16", "17-64")

    @classmethod
    def prepare(cls, weight_q, act_scheme, static_scale):
        t = _layout(cls.native_layout, weight_q)
        N, K = int(weight_q.shape[0]), int(weight_q.shape[1])
        return Prepared(cls.spec(cls.kind, N, K, t, **cls.spec_fields(weight_q)), t)

    @classmethod
    def for_rows(cls, spec, M):
        path, cfg = tuning.choose("native", tuning.kind_key(spec), spec.N, spec.K, M)
        if path == "kernel":
            return cls, NativeCall("kernel", tuple(sorted(launch_variant(cfg).items())))
        return cls, NativeCall("dequant")      # "dequant", or a "triton" cell: no Triton layout here

    @classmethod
    def apply(cls, spec, x2, ops, bias, config):
        call = config if isinstance(config, NativeCall) else cls.for_rows(spec, x2.shape[0])[1]
        w, M, variant = cls.native_weight(spec, ops), x2.shape[0], dict(call.variant)
        if call.path == "kernel" and _gemv_ok(x2, bias, spec.N):
            if M <= native.MAX_M:
                return cls.gemv(x2, w, bias=bias, **variant)
            out = torch.empty(M, spec.N, dtype=torch.bfloat16, device=x2.device)
            for m0 in range(0, M, native.MAX_M):
                cls.gemv(x2[m0:m0 + native.MAX_M], w, bias=bias, out=out[m0:m0 + native.MAX_M], **variant)
            return out
        return bf16_gemm(x2, native.dequantize(w, x2.dtype, scratch((spec.N, spec.K), x2.dtype, x2.device)), bias,
                         x2.dtype)


def launch_variant(config) -> dict:
    """The keyword arguments of a native launch from a tuning table's native cell config (None: the default
    launch); ValueError naming the key for anything else (lowbit.ops.native.kernels checks the values)."""
    if config is None:
        return {}
    unknown = sorted(set(config) - set(native.VARIANT_KEYS))
    if unknown:
        raise ValueError(f"tuning table: a native cell's config has {unknown}; a native launch takes "
                         f"{list(native.VARIANT_KEYS)} (re-run `lowbit tune`)")
    return dict(config)


def _w4(spec: Spec, ops) -> native.NativeW4:
    return native.NativeW4(ops["n_packed"], ops["n_scale"], ops.get("n_zero"), spec.N, spec.K, spec.group,
                           ops["n_counters"])


def _w8(spec: Spec, ops, fp8: bool) -> native.NativeW8:
    return native.NativeW8(ops["n_packed"], ops["n_scale"], spec.N, spec.K, fp8, ops["n_counters"])


class NativeW4A16(_NativeWeightOnly, TritonW4A16):
    name = "native_w4a16"
    native_layout = staticmethod(native.prepare_w4)
    gemv = staticmethod(lambda *a, **kw: native.w4a16(*a, **kw))   # looked up per call (tests stand the twin in)
    native_weight = staticmethod(_w4)
    summary = ("int4 groups, bf16 MMA on 128-bit weight loads, split-K (CUDA C++, sm_90a; 16 rows a launch); "
               "more rows: dequantized from the same layout")

    @classmethod
    def spec_fields(cls, weight_q):
        return dict(w4kind=w4a16_kind(weight_q.scheme), group=weight_q.scheme.group_size)

    @classmethod
    def refuses(cls, layer):
        ws = layer.weight
        if ws.format != "int4" or ws.strategy != "group" or ws.group_size not in native.W4_GROUPS:
            return f"the weight is {ws.format} {ws.strategy}; this kernel takes int4 in groups of {native.W4_GROUPS}"
        return super().refuses(layer)


class NativeW8A16(_NativeWeightOnly, TritonW8A16):
    name = "native_w8a16"
    native_layout = staticmethod(native.prepare_w8)
    gemv = staticmethod(lambda *a, **kw: native.w8a16(*a, **kw))
    native_weight = staticmethod(lambda spec, ops: _w8(spec, ops, False))
    summary = ("int8 weights per channel, bf16 MMA on 128-bit weight loads, split-K (CUDA C++, sm_90a; 16 rows a "
               "launch); more rows: dequantized from the same layout")

    @classmethod
    def spec_fields(cls, weight_q):
        return {}

    @classmethod
    def refuses(cls, layer):
        ws = layer.weight
        if ws.format != "int8" or ws.strategy != "channel":
            return f"the weight is {ws.format} per {ws.strategy}; this kernel takes int8 with one scale per channel"
        return super().refuses(layer)


def _w8a8_refusal(layer) -> str | None:
    xs, ws = layer.act, layer.weight
    if layer.static_scale or xs is None or xs.strategy != "token" or not xs.symmetric:
        return "this kernel quantizes activations per token, symmetric and dynamic"
    if ws.strategy != "channel":
        return f"the weight has {ws.strategy} scales; this kernel takes one scale per channel"
    return None


class _NativeW8A8(_Native):
    native_layout = staticmethod(native.prepare_w8)

    @classmethod
    def native_call(cls, spec, x2, ops, bias, variant):
        return native.w8a8(x2, _w8(spec, ops, cls.fmt == "fp8_e4m3fn"), bias=bias, **variant)

    @classmethod
    def refuses(cls, layer):
        return _w8a8_refusal(layer) or super().refuses(layer)


class NativeW8A8Int8(_NativeW8A8, TritonW8A8Int8):
    name = "native_w8a8_int8"
    triton_cls = TritonW8A8Int8
    summary = "per-token int8 x int8 per channel, int32 MMA, split-K (CUDA C++, sm_90a; 1-16 rows)"


class NativeW8A8Fp8(_NativeW8A8, TritonW8A8Fp8):
    name = "native_w8a8_fp8"
    triton_cls = TritonW8A8Fp8
    summary = "per-token e4m3 x e4m3 per channel, fp32 per 32-k tile, split-K (CUDA C++, sm_90a; 1-16 rows)"


NATIVE = (NativeW8A8Int8, NativeW8A8Fp8, NativeW8A16, NativeW4A16)
