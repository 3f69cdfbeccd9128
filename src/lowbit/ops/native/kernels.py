"""lowbit's native decode kernels (csrc/decode_kernels.cu) as torch functions, and their CPU twin.

    w = prepare_w4(qtensor)          # int4 groups of 32/64/128/256, symmetric or with zero points
    w = prepare_w8(qtensor)          # int8 or fp8 e4m3 weights, one scale per row (per channel)
    y = w4a16(x, w, bias=b)          # x bf16 [M, K], M = 1..16, on an sm_90 GPU -> bf16 [M, N]; bias [N] optional
    y = w8a16(x, w);  y = w8a8(x, w) # W8A8: per-token activation codes by lb_act_quant, then the GEMV
    y = twin_w4a16(x, w, splits)     # the same program on the CPU (csrc/host_twin.cpp), CPU tensors

The rounding order of each kernel is in decode_kernels.cu's header comment (a bias, float32 or bfloat16
[N], is added in float32 after the scales, just before the bf16 rounding). Every argument is checked
here, once, before a launch; the C side trusts them. `splits` (CTAs per 16 output rows along K) defaults
to default_splits; any value >= 1 gives the documented summation order for that value. The launch
variants change the speed only, never a bit of the output:
  nt        row tiles of 16 per CTA (1, 2, 4): the tiles share each activation load (M > 1 reads x nt
            times less), with nt times fewer CTAs
  prefetch  each warp issues its next k-block's weight loads before it computes the current one
  fixup     with splits > 1, the last CTA of each column adds the splits' partials (same order) instead
            of a second kernel; it counts CTAs in the weight's `counters`, so two launches on one weight
            with fixup must not run at the same time (two streams): the default is the second kernel
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from lowbit.ops import bound
from lowbit.quantize import QTensor

from .layout import TILE_N, arrange_groups, arrange_w4, arrange_w8
from .library import load, load_twin

W4_GROUPS = (32, 64, 128, 256)
BIAS_KINDS = {torch.float32: 1, torch.bfloat16: 2}     # csrc/decode_math.h kBiasF32, kBiasBF16 (0: no bias)
WARPS, TILES_PER_BLOCK = 8, 4   # csrc/decode_math.h kWarps, decode_warp.h kTilesPerBlock
MAX_M = 16
ROW_TILES = (1, 2, 4)           # csrc/decode_warp.h with_variant's nt
VARIANT_KEYS = ("splits", "nt", "prefetch", "fixup")   # a launch variant's keywords (module docstring)


class _Tiled:
    """The k-tiles and 4-tile k-blocks (csrc/decode_warp.h) of a packed weight [N16, K tiles, 32, 16]."""
    packed: torch.Tensor

    @property
    def tiles_k(self) -> int:
        return self.packed.shape[1]

    @property
    def kblocks(self) -> int:
        return -(-self.tiles_k // TILES_PER_BLOCK)


@dataclass(frozen=True, eq=False)
class NativeW4(_Tiled):
    """An int4 weight [N, K] in the "w4" layout (lowbit.ops.native.layout)."""
    packed: torch.Tensor          # uint8 [N16, K64, 32, 16]
    scale: torch.Tensor           # float32 [N16, K / G, 16]
    zero: torch.Tensor | None     # int8 [N16, K / G, 16] or None
    N: int
    K: int
    group: int
    counters: torch.Tensor        # int32 [N16], zero: the fixup's per-column CTA counts (module docstring)


@dataclass(frozen=True, eq=False)
class NativeW8(_Tiled):
    """An int8 / fp8 e4m3 weight [N, K] in the "w8" layout with its per-row float32 scales [N]."""
    packed: torch.Tensor          # uint8 [N16, K32, 32, 16]
    scale: torch.Tensor           # float32 [N]
    N: int
    K: int
    fp8: bool
    counters: torch.Tensor        # int32 [N16], zero (as NativeW4's)


def prepare_w4(qt: QTensor) -> NativeW4:
    """The native layout of an int4 group-quantized weight (lowbit.quantize of a [N, K] weight)."""
    s = qt.scheme
    if s.format != "int4" or s.strategy != "group" or s.group_size not in W4_GROUPS:
        raise ValueError(f"prepare_w4: the native W4A16 kernel takes int4 weights in groups of {W4_GROUPS}, got {s}; "
                         "quantize with e.g. lowbit.get_preset('int4_g128')")
    if qt.codes.ndim != 2 or qt.padded:
        raise ValueError(f"prepare_w4: needs an unpadded 2-D weight [N, K], got codes {tuple(qt.codes.shape)} "
                         f"of shape {tuple(qt.shape)}")
    N, K = qt.codes.shape
    z = qt.zero_point
    if z is not None and (int(z.min()) < -8 or int(z.max()) > 7):
        raise ValueError("prepare_w4: zero points must lie in the int4 code range -8..7 (lowbit.quantize's do)")
    n16 = -(-N // TILE_N)
    return NativeW4(arrange_w4(qt.codes.to(torch.int8)), arrange_groups(qt.scale.to(torch.float32), n16),
                    None if z is None else arrange_groups(z.to(torch.int8), n16), N, K, s.group_size,
                    _counters(n16, qt.codes.device))


def prepare_w8(qt: QTensor) -> NativeW8:
    """The native layout of an int8 (symmetric) or fp8 e4m3 weight with one scale per row."""
    s = qt.scheme
    ok = s.strategy == "channel" and ((s.format == "int8" and s.symmetric) or s.format == "fp8_e4m3fn")
    if not ok or s.scale_format != "fp32":
        raise ValueError(f"prepare_w8: the native W8 kernels take int8 (symmetric) or fp8_e4m3fn weights with one "
                         f"float32 scale per row, got {s}; quantize with lowbit.get_preset('int8_channel') or 'fp8_row'")
    if qt.codes.ndim != 2:
        raise ValueError(f"prepare_w8: needs a 2-D weight [N, K], got codes {tuple(qt.codes.shape)}")
    N, K = qt.codes.shape
    if K % 8:
        raise ValueError(f"prepare_w8: K = {K} must be a multiple of 8 (the kernels read activations 8 at a time); "
                         "pad the weight's K with zeros")
    return NativeW8(arrange_w8(qt.codes), qt.scale.to(torch.float32).reshape(N).contiguous(), N, K,
                    s.format == "fp8_e4m3fn", _counters(-(-N // TILE_N), qt.codes.device))


def _counters(n16: int, device) -> torch.Tensor:
    return torch.zeros(n16, dtype=torch.int32, device=device)


def default_splits(n_tiles: int, kblocks: int, sms: int) -> int:
    """CTAs per 16 rows along K: enough for two CTAs per SM, at least one k-block per warp."""
    return max(1, min(math.ceil(2 * sms / n_tiles), kblocks // WARPS))


def _check_x(x: torch.Tensor, K: int, device_type: str, align: int, who: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.ndim != 2:
        raise ValueError(f"{who}: x must be a 2-D bfloat16 tensor [M, K], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}")
    M = x.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"{who}: the decode kernels take M = 1..{MAX_M} rows, got M = {M}; use the Triton GEMM for more")
    if x.shape[1] != K:
        raise ValueError(f"{who}: x has K = {x.shape[1]}, the weight K = {K}")
    if x.device.type != device_type:
        raise ValueError(f"{who}: x is on {x.device}, this path needs {device_type} tensors")
    if x.stride(1) != 1 or x.stride(0) % (align // 2) or x.data_ptr() % align:
        raise ValueError(f"{who}: x must have unit column stride, a row stride that is a multiple of {align // 2} "
                         f"and a {align}-byte aligned start (got strides {x.stride()}); pass x.contiguous()")


def bias_refusal(bias: torch.Tensor, N: int, device: torch.device) -> str | None:
    """Why the kernels cannot read `bias` as the bias of N outputs on `device` (None: they can)."""
    if not isinstance(bias, torch.Tensor) or bias.dtype not in BIAS_KINDS:
        return (f"bias must be a float32 or bfloat16 tensor, got {getattr(bias, 'dtype', type(bias).__name__)}; "
                "pass bias.float()")
    if tuple(bias.shape) != (N,) or not bias.is_contiguous():
        return (f"bias must be a contiguous [N] = [{N}] tensor, got shape {tuple(bias.shape)}; "
                "pass bias.reshape(-1).contiguous()")
    if bias.device != device:
        return f"bias is on {bias.device}, x on {device}; move one of them"
    return None


def _bias(bias: torch.Tensor | None, w, x: torch.Tensor, who: str) -> tuple[int | None, int]:
    """(the bias pointer or None, its csrc kind) after checking it."""
    if bias is None:
        return None, 0
    why = bias_refusal(bias, w.N, x.device)
    if why is not None:
        raise ValueError(f"{who}: {why}")
    return bias.data_ptr(), BIAS_KINDS[bias.dtype]


def _check_weight(w, x: torch.Tensor, who: str) -> None:
    if w.packed.device != x.device:
        raise ValueError(f"{who}: the weight is on {w.packed.device}, x on {x.device}; move one of them")


def _splits(w, splits: int | None, who: str) -> int:
    n_tiles = -(-w.N // TILE_N)
    if splits is None:
        return default_splits(n_tiles, w.kblocks, torch.cuda.get_device_properties(w.packed.device).multi_processor_count)
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"{who}: splits must be an int >= 1, got {splits!r}")
    return splits


@dataclass(frozen=True)
class _Launch:
    splits: int
    nt: int
    prefetch: int
    counters: int | None      # the counters' pointer where the splits are added by the fixup


def _launch(w, splits, nt, prefetch, fixup, who: str) -> _Launch:
    """The checked launch variant (module docstring)."""
    S = _splits(w, splits, who)
    if nt not in ROW_TILES or isinstance(nt, bool):
        raise ValueError(f"{who}: nt (row tiles per CTA) must be one of {ROW_TILES}, got {nt!r}")
    for name, v in (("prefetch", prefetch), ("fixup", fixup)):
        if not isinstance(v, bool):
            raise ValueError(f"{who}: {name} must be True or False, got {v!r}")
    return _Launch(S, nt, int(prefetch), w.counters.data_ptr() if fixup and S > 1 else None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _workspace(splits: int, M: int, N: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    return torch.empty(splits, M, N, dtype=dtype, device=device) if splits > 1 else None


def _raise(code: int, who: str) -> None:
    if code:
        raise RuntimeError(f"{who}: the native launch failed with code {code} (negative: an argument the C side refused; "
                           "positive: a cudaError_t)")


def _stream(x: torch.Tensor) -> int:
    """The current stream's handle, for a launch: a recorded plan (lowbit.ops.bound) cannot hold a ctypes launch,
    so a call being recorded is told so here (the layer then replays its CUDA graph instead)."""
    bound.note_unrecordable("a native sm_90a kernel launched through ctypes (a plan holds Triton launches only)")
    return torch.cuda.current_stream(x.device).cuda_stream


def _gemv_out(out: torch.Tensor | None, M: int, N: int, x: torch.Tensor, who: str) -> torch.Tensor:
    """A new bf16 [M, N] output, or the caller's `out` (bf16, [M, N], contiguous rows of N: the kernels write
    out[m * N + n]) after checking it."""
    if out is None:
        return torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != (M, N)
            or not out.is_contiguous() or out.device != x.device):
        raise ValueError(f"{who}: out must be a contiguous bfloat16 [M, N] = [{M}, {N}] tensor on {x.device}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}; "
                         "pass a row slice of a contiguous [*, N] tensor")
    return out


def w4a16(x: torch.Tensor, w: NativeW4, splits: int | None = None, bias: torch.Tensor | None = None, *, nt: int = 1,
          prefetch: bool = False, fixup: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = x @ W.T (+ bias) for bf16 x [M, K] (CUDA, sm_90) and a prepare_w4 weight."""
    _check_x(x, w.K, "cuda", 8, "w4a16")
    _check_weight(w, x, "w4a16")
    v = _launch(w, splits, nt, prefetch, fixup, "w4a16")
    b, kind = _bias(bias, w, x, "w4a16")
    M, out = x.shape[0], _gemv_out(out, x.shape[0], w.N, x, "w4a16")
    ws = _workspace(v.splits, M, w.N, torch.float32, x.device)
    _raise(load().lb_w4a16(w.packed.data_ptr(), w.scale.data_ptr(), _ptr(w.zero), x.data_ptr(), out.data_ptr(), _ptr(ws),
                           v.counters, b, M, w.N, w.K, x.stride(0), w.tiles_k, w.scale.shape[1], w.group, v.splits, v.nt,
                           v.prefetch, kind, _stream(x)), "w4a16")
    return out


def w8a16(x: torch.Tensor, w: NativeW8, splits: int | None = None, bias: torch.Tensor | None = None, *, nt: int = 1,
          prefetch: bool = False, fixup: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = (x @ codes.T) * scale (+ bias) for bf16 x [M, K] (CUDA, sm_90) and an int8 prepare_w8 weight."""
    if w.fp8:
        raise ValueError("w8a16: the weight is fp8 e4m3; the native W8A16 kernel takes int8 weights (w8a8 takes fp8)")
    _check_x(x, w.K, "cuda", 16, "w8a16")
    _check_weight(w, x, "w8a16")
    v = _launch(w, splits, nt, prefetch, fixup, "w8a16")
    b, kind = _bias(bias, w, x, "w8a16")
    M, out = x.shape[0], _gemv_out(out, x.shape[0], w.N, x, "w8a16")
    ws = _workspace(v.splits, M, w.N, torch.float32, x.device)
    _raise(load().lb_w8a16(w.packed.data_ptr(), w.scale.data_ptr(), x.data_ptr(), out.data_ptr(), _ptr(ws), v.counters, b,
                           M, w.N, w.K, x.stride(0), w.tiles_k, v.splits, v.nt, v.prefetch, kind, _stream(x)), "w8a16")
    return out


def act_quant(x: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token activation codes (uint8 [M, K]: int8 or e4m3 bits) and scales (float32 [M]) on the GPU."""
    _check_x(x, x.shape[1] if x.ndim == 2 else -1, "cuda", 2, "act_quant")
    M, K = x.shape
    codes = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    scales = torch.empty(M, dtype=torch.float32, device=x.device)
    _raise(load().lb_act_quant(x.data_ptr(), M, K, x.stride(0), int(fp8), codes.data_ptr(), scales.data_ptr(), _stream(x)),
           "act_quant")
    return codes, scales


def w8a8(x: torch.Tensor, w: NativeW8, splits: int | None = None, bias: torch.Tensor | None = None, *, nt: int = 1,
         prefetch: bool = False, fixup: bool = False) -> torch.Tensor:
    """bf16 [M, N]: x quantized per token (int8 or e4m3, as the weight), then the W8A8 GEMV with both scales
    (+ bias)."""
    _check_x(x, w.K, "cuda", 2, "w8a8")
    _check_weight(w, x, "w8a8")
    v = _launch(w, splits, nt, prefetch, fixup, "w8a8")
    b, kind = _bias(bias, w, x, "w8a8")
    codes, sa = act_quant(x, w.fp8)
    M, out = x.shape[0], torch.empty(x.shape[0], w.N, dtype=torch.bfloat16, device=x.device)
    ws = _workspace(v.splits, M, w.N, torch.float32 if w.fp8 else torch.int32, x.device)
    _raise(load().lb_w8a8(w.packed.data_ptr(), w.scale.data_ptr(), codes.data_ptr(), sa.data_ptr(), out.data_ptr(), _ptr(ws),
                          v.counters, b, M, w.N, w.K, codes.stride(0), w.tiles_k, v.splits, v.nt, v.prefetch, int(w.fp8),
                          kind, _stream(x)), "w8a8")
    return out


OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}     # csrc/decode_math.h kOut*


def _dequant_out(w, dtype, out, device_type: str, who: str) -> torch.Tensor:
    if dtype not in OUT_KINDS:
        raise ValueError(f"{who}: dtype must be one of {list(OUT_KINDS)}, got {dtype}")
    if out is None:
        return torch.empty(w.N, w.K, dtype=dtype, device=w.packed.device)
    if (not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != (w.N, w.K)
            or out.stride(1) != 1 or out.device != w.packed.device or out.device.type != device_type):
        raise ValueError(f"{who}: out must be a {dtype} [N, K] = [{w.N}, {w.K}] tensor with unit column stride on "
                         f"{w.packed.device}, got {getattr(out, 'dtype', type(out).__name__)} "
                         f"{tuple(getattr(out, 'shape', ()))}")
    return out


def _dequant_call(lib_fn, w, out, dtype, *tail):
    if isinstance(w, NativeW4):
        return lib_fn[0](w.packed.data_ptr(), w.scale.data_ptr(), _ptr(w.zero), out.data_ptr(), w.N, w.K, w.tiles_k,
                         w.scale.shape[1], w.group, out.stride(0), OUT_KINDS[dtype], *tail)
    return lib_fn[1](w.packed.data_ptr(), w.scale.data_ptr(), out.data_ptr(), w.N, w.K, w.tiles_k, out.stride(0),
                     OUT_KINDS[dtype], *tail)


def dequantize(w: NativeW4 | NativeW8, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight [N, K] in dtype (float32 / bfloat16 / float16) on its GPU from the native layout: each value
    dtype(float32(code - z) * scale), as lowbit's other dequantization paths (the large-M path: a float GEMM on it).
    out: a [N, K] buffer of dtype to write (e.g. lowbit.ops.scratch's), else a new tensor."""
    out = _dequant_out(w, dtype, out, "cuda", "dequantize")
    lib = load()
    _raise(_dequant_call((lib.lb_w4_dequant, lib.lb_w8_dequant), w, out, dtype, _stream(out)), "dequantize")
    return out


# ---- the CPU twin ---------------------------------------------------------------------------------

def _twin_out(x: torch.Tensor, N: int) -> torch.Tensor:
    return torch.empty(x.shape[0], N, dtype=torch.bfloat16)


def twin_w4a16(x: torch.Tensor, w: NativeW4, splits: int = 1, bias: torch.Tensor | None = None, *, nt: int = 1,
               prefetch: bool = False) -> torch.Tensor:
    """w4a16 run by the CPU twin: the kernel's warp program lane by lane (CPU tensors)."""
    _check_x(x, w.K, "cpu", 8, "twin_w4a16")
    _check_weight(w, x, "twin_w4a16")
    v = _launch(w, splits, nt, prefetch, False, "twin_w4a16")
    b, kind = _bias(bias, w, x, "twin_w4a16")
    out = _twin_out(x, w.N)
    _raise(load_twin().lb_twin_w4a16(w.packed.data_ptr(), w.scale.data_ptr(), _ptr(w.zero), x.data_ptr(), out.data_ptr(),
                                     b, x.shape[0], w.N, w.K, x.stride(0), w.tiles_k, w.scale.shape[1], w.group,
                                     v.splits, v.nt, v.prefetch, kind), "twin_w4a16")
    return out


def twin_w8a16(x: torch.Tensor, w: NativeW8, splits: int = 1, bias: torch.Tensor | None = None, *, nt: int = 1,
               prefetch: bool = False) -> torch.Tensor:
    """w8a16 run by the CPU twin."""
    _check_x(x, w.K, "cpu", 16, "twin_w8a16")
    _check_weight(w, x, "twin_w8a16")
    v = _launch(w, splits, nt, prefetch, False, "twin_w8a16")
    b, kind = _bias(bias, w, x, "twin_w8a16")
    out = _twin_out(x, w.N)
    _raise(load_twin().lb_twin_w8a16(w.packed.data_ptr(), w.scale.data_ptr(), x.data_ptr(), out.data_ptr(), b, x.shape[0],
                                     w.N, w.K, x.stride(0), w.tiles_k, v.splits, v.nt, v.prefetch, kind), "twin_w8a16")
    return out


def twin_act_quant(x: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant run on the CPU with the kernel's arithmetic."""
    _check_x(x, x.shape[1] if x.ndim == 2 else -1, "cpu", 2, "twin_act_quant")
    M, K = x.shape
    codes, scales = torch.empty(M, K, dtype=torch.uint8), torch.empty(M, dtype=torch.float32)
    _raise(load_twin().lb_twin_act_quant(x.data_ptr(), M, K, x.stride(0), int(fp8), codes.data_ptr(), scales.data_ptr()),
           "twin_act_quant")
    return codes, scales


def twin_w8a8(x: torch.Tensor, w: NativeW8, splits: int = 1, bias: torch.Tensor | None = None, *, nt: int = 1,
              prefetch: bool = False) -> torch.Tensor:
    """w8a8 (activation codes, then the GEMV) run by the CPU twin."""
    _check_x(x, w.K, "cpu", 2, "twin_w8a8")
    _check_weight(w, x, "twin_w8a8")
    v = _launch(w, splits, nt, prefetch, False, "twin_w8a8")
    b, kind = _bias(bias, w, x, "twin_w8a8")
    codes, sa = twin_act_quant(x, w.fp8)
    out = _twin_out(x, w.N)
    _raise(load_twin().lb_twin_w8a8(w.packed.data_ptr(), w.scale.data_ptr(), codes.data_ptr(), sa.data_ptr(),
                                    out.data_ptr(), b, x.shape[0], w.N, w.K, codes.stride(0), w.tiles_k,
                                    v.splits, v.nt, v.prefetch, int(w.fp8), kind), "twin_w8a8")
    return out


def twin_dequantize(w: NativeW4 | NativeW8, dtype: torch.dtype) -> torch.Tensor:
    """dequantize run by the CPU twin (CPU tensors)."""
    out = _dequant_out(w, dtype, None, "cpu", "twin_dequantize")
    lib = load_twin()
    _raise(_dequant_call((lib.lb_twin_w4_dequant, lib.lb_twin_w8_dequant), w, out, dtype), "twin_dequantize")
    return out


def twin_weights(w: NativeW4 | NativeW8) -> torch.Tensor:
    """The weights the kernels' mma instructions see, float32 [N, K]: code - z (W4) or the code (W8), decoded by the
    twin through the lanes' registers and the PTX fragment layout (the dequantization with unit scales)."""
    ones = replace(w, scale=torch.ones_like(w.scale))
    return twin_dequantize(ones, torch.float32)
