"""The grouped (MoE) kernels as classes: one grouped Triton launch per projection for all experts.

  class            kind    activations (quantized once per call, every row)       kernel
  grouped_int8     int8    int8 per token / per tensor (scale expanded to rows)  grouped_int8
  grouped_fp8      fp8     fp8 e4m3 per token / per tensor                       grouped_fp8
  grouped_w8a16    w8a16   float                                                  grouped_w8a16
  grouped_w4a16    w4a16   float                                                  grouped_w4a16 (int4 +- zero
                                                                                  points, MXFP4, NVFP4)
  grouped_fp4      fp4     MXFP4 / NVFP4, quantized and dequantized exactly       grouped_w4a16; NVFP4: the two
                           (bf16)                                                 tensor scales multiply the
                                                                                  accumulator
  grouped_mxfp8    mxfp8   MXFP8, scale codes laid out as SFA words over the      grouped_mxfp8
                           sorted rows
  exact            exact   QuantExperts' float64 exact path (every scheme pair)
Each weight-only class (and grouped_fp4) has a bf16 path over the same layout, its `dequant` class
(grouped_dequant_w4a16, grouped_dequant_fp4, grouped_dequant_w8a16; lowbit.ops.grouped_dequant):
the projection's expert weights dequantized into one reusable scratch buffer [E, N, K], then
torch._grouped_mm. `for_rows` says which class runs M sorted rows: the tuning table's cell
("grouped", table_key: "<kind>/E<E>", the 4-bit kinds "<kind>/<weight format>/E<E>", N, K, bucket
of M), else lowbit.ops.tuning's heuristic; the bf16 path only where it takes the activations (bf16,
K a multiple of 8, torch's grouped GEMM on this GPU). `tile_config` is the kernel's tiles from the
same key (lowbit.ops.grouped_configs.grouped_config).
The W8A8 kinds (int8, fp8, MXFP8) have no bf16 path: their kernels multiply 8-bit codes on the
8-bit tensor cores, which a dequantized bf16 weight would give up.
Weights: per-channel symmetric fp32 scales for the 8-bit kinds; the 4-bit kinds read their own packed
copy (two codes per byte), so their stacked fields become the host twin. Activation codes equal
lowbit.quantize's (lowbit.ops.fused.quantize_rows / qdq_rows on CUDA; the CPU runs their torch twins);
a per-tensor scale spans all rows of the operand, as a grouped kernel's A operand over the
concatenated M does.
"""
from __future__ import annotations

from functools import lru_cache
from typing import ClassVar

import torch

from lowbit.formats import decode
from lowbit.ops import tuning
from lowbit.ops.fused import qdq_rows, quantize_rows
from lowbit.ops.grouped import scale_words_int32
from lowbit.ops.grouped_configs import GroupedConfig, grouped_config
from lowbit.ops.grouped_dequant import grouped_bf16_refusal, grouped_dequant_w4, grouped_dequant_w8
from lowbit.ops.kernels.base import Choice, Device, Kernel, LinearLayer, Registry, kernel_device
from lowbit.ops.kernels.dense_w8 import quantize_tensor_int8
from lowbit.ops.kernels.schemes import PER_ROW, pair_refusal, w4a16_kind, w4a16_refusal, weight_only_refusal
from lowbit.ops.tuning import grouped_kind_key
from lowbit.ops.w4_formats import W4Format
from lowbit.packing import pack_fp4, pack_int4
from lowbit.quantize import quantize
from lowbit.scheme import QuantScheme


class GroupedKernel(Kernel):
    """A grouped kernel: `prepare` lays the stacked expert weights out once, `apply` runs the sorted rows."""
    packs_weights: ClassVar[bool] = False   # reads its own packed copy: the stacked fields are the host twin
    dequant: ClassVar[type[GroupedKernel] | None] = None   # the table's "dequant" path over this layout
    bf16_path: ClassVar[bool] = False       # a dequant class: apply dequantizes and runs torch._grouped_mm

    @classmethod
    def weight_format(cls, weight_scheme: QuantScheme) -> W4Format | None:
        """The 4-bit weight format the table's key names (None: an 8-bit kind, one weight format)."""
        return None

    @classmethod
    def table_key(cls, weight_scheme: QuantScheme, E: int) -> str:
        """The tuning table's kind of this kernel over E experts of `weight_scheme` (cached)."""
        return _table_key(cls, weight_scheme, E)

    @classmethod
    def for_rows(cls, weight_scheme: QuantScheme, E: int, N: int, K: int, M: int,
                 dtype: torch.dtype) -> type[GroupedKernel]:
        """The class that runs M sorted rows of a [E, N, K] projection of `weight_scheme` with `dtype`
        activations: this kernel, or its dequant class where the tuning table (or its heuristic) says
        "dequant" and the bf16 path takes the activations (cached until the table or the registry
        changes)."""
        return _for_rows(cls, cls.table_key(weight_scheme, E), N, K, M, dtype)

    @classmethod
    def tile_config(cls, weight_scheme: QuantScheme, E: int, N: int, K: int, M: int) -> GroupedConfig:
        """The kernel's launch configuration for M sorted rows (the table's cell, else the heuristic)."""
        return grouped_config(cls.kind, E, N, K, M, _weight_format(cls, weight_scheme))

    @classmethod
    def rows_refusal(cls, dtype: torch.dtype, K: int) -> str | None:
        """Why this class cannot run `dtype` activations with K columns on this process's kernel device
        (None: it can). Only the bf16 path has conditions beyond the layer's schemes."""
        if not cls.bf16_path:
            return None
        return grouped_bf16_refusal(dtype, K, kernel_device().capability)

    @classmethod
    def prepare(cls, weight_scheme: QuantScheme, stacked: dict, act_scheme: QuantScheme | None
                ) -> dict[str, torch.Tensor]:
        """The kernel's operands (weights; act_qmax for per-tensor int8 activations) from stacked
        per-expert fields ("codes" [E, N, K], "scale" [E, N, G], "zero", "scale_codes", "global" [E];
        None where the scheme has none)."""
        raise NotImplementedError

    @staticmethod
    def apply(ops, weight_scheme, act_scheme, x, routing, kw) -> torch.Tensor:
        """out [R, N] of the sorted rows; kw: bias, identity, config, out_dtype of the launch."""
        raise NotImplementedError


@lru_cache(maxsize=1024)
def _weight_format(cls, weight_scheme):
    return cls.weight_format(weight_scheme)


@lru_cache(maxsize=1024)
def _table_key(cls, weight_scheme, E):
    return grouped_kind_key(cls.kind, E, _weight_format(cls, weight_scheme))


@tuning.per_table
def _for_rows(cls, key, N, K, M, dtype):
    path, _ = tuning.choose("grouped", key, N, K, M)
    d = cls.dequant
    if path == "dequant" and d is not None and d.rows_refusal(dtype, K) is None:
        return d
    return cls


def _launchers():
    """lowbit.ops.triton.grouped, the grouped kernels' launchers (imported on first use)."""
    from lowbit.ops.triton import grouped as gk    # optional: triton

    return gk


def _channel_sym(ws: QuantScheme, fmt: str) -> str | None:
    if ws.format != fmt or ws.strategy != "channel" or not ws.symmetric or ws.scale_format != "fp32":
        return f"this kernel takes {fmt} weights per channel, symmetric, fp32 scales; got {ws}"
    return None


def rows_quantized(x: torch.Tensor, scheme: QuantScheme, ops: dict):
    """(codes [R, K], per-row fp32 scales [R], scale codes or None) of x [R, K], dynamically quantized
    by `scheme` with lowbit.quantize's arithmetic. No host synchronisation for per-row / per-group
    schemes (lowbit.ops.fused.quantize_rows) and per-tensor int8 (quantize_tensor_int8); other
    per-tensor schemes go through lowbit.quantize, which checks the input on the host."""
    R = x.shape[0]
    if scheme.strategy == "tensor":                         # one scale over all rows
        if "act_qmax" in ops:
            codes, s = quantize_tensor_int8(x.float(), ops["act_qmax"])
            return codes, s.expand(R), None
        q = quantize(x.float(), scheme)
        return q.codes, q.scale.reshape(1).expand(R).contiguous(), None
    q = quantize_rows(x, scheme, check_finite=False) if x.is_cuda else quantize(x.float(), scheme)
    return q.codes, q.scale.reshape(R, -1)[:, 0].contiguous(), q.scale_codes


def fp4_rows(x: torch.Tensor, scheme: QuantScheme):
    """(x dequantized exactly [R, K], NVFP4 activation tensor scale [1] or None)."""
    if x.is_cuda:
        return qdq_rows(x.contiguous(), scheme)
    q = quantize(x.float(), scheme)
    if q.global_scale is None:
        return q.dequantize(torch.float32), None
    # e2m1 * e4m3 block scale (exact), the tensor scale applied to the accumulator
    s = decode(q.scale_codes, scheme.scale_format).to(torch.float32)
    xd = decode(q.codes, scheme.format).to(torch.float32).reshape(x.shape[0], -1, scheme.group_size) * s[..., None]
    return xd.reshape(x.shape), q.global_scale.reshape(1).float()


def _eight_bit(stacked, act_scheme):
    codes, scale = stacked["codes"], stacked["scale"]
    E, N = codes.shape[:2]
    ops = {"w": codes.contiguous(), "s": scale.reshape(E, N).float().contiguous()}
    if act_scheme is not None and act_scheme.strategy == "tensor" and act_scheme.format == "int8":
        # the divisor as a device tensor (quantize_tensor_int8)
        ops["act_qmax"] = torch.full((1,), float(act_scheme.fmt.qmax), dtype=torch.float32, device=codes.device)
    return ops


class _GroupedW8A8(GroupedKernel):
    fmt = ""

    @classmethod
    def refuses(cls, layer):
        xs = layer.act
        if xs is None or xs.format != cls.fmt or not xs.symmetric or xs.strategy not in PER_ROW \
                or xs.scale_format != "fp32":
            return f"this kernel takes {cls.fmt} activations per token / tensor, symmetric, fp32 scales"
        return _channel_sym(layer.weight, cls.fmt)

    @classmethod
    def prepare(cls, weight_scheme, stacked, act_scheme):
        return _eight_bit(stacked, act_scheme)

    @classmethod
    def apply(cls, ops, weight_scheme, act_scheme, x, routing, kw):
        codes, sa, _ = rows_quantized(x, act_scheme, ops)
        return getattr(_launchers(), cls.name)(codes, sa, ops["w"], ops["s"], routing, **kw)   # the launcher's name


class GroupedInt8(_GroupedW8A8):
    name, kind, fmt = "grouped_int8", "int8", "int8"
    summary = "int8 x int8 grouped GEMM, one launch for all experts"


class GroupedFp8(_GroupedW8A8):
    name, kind, fmt = "grouped_fp8", "fp8", "fp8_e4m3fn"
    min_capability = (8, 9)
    summary = "fp8 e4m3 x fp8 e4m3 grouped GEMM, one launch for all experts"


class GroupedW8A16(GroupedKernel):
    name, kind = "grouped_w8a16", "w8a16"
    summary = "int8 weights converted in the tile, float activations"

    @classmethod
    def refuses(cls, layer):
        return weight_only_refusal(layer) or _channel_sym(layer.weight, "int8")

    @classmethod
    def prepare(cls, weight_scheme, stacked, act_scheme):
        return _eight_bit(stacked, act_scheme)

    @classmethod
    def apply(cls, ops, weight_scheme, act_scheme, x, routing, kw):
        if cls.bf16_path:
            return grouped_dequant_w8(x, ops["w"], ops["s"], routing, **_bf16_kw(kw))
        return _launchers().grouped_w8a16(x, ops["w"], ops["s"], routing, **kw)


class GroupedDequantW8A16(GroupedW8A16):
    name = "grouped_dequant_w8a16"
    bf16_path = True
    summary = "int8 expert weights rounded once to bf16 into a scratch buffer, then torch._grouped_mm"


def _bf16_kw(kw: dict) -> dict:
    """The launch keywords the bf16 path takes (it has no tile configuration)."""
    return dict(bias=kw["bias"], identity=kw["identity"], out_dtype=kw["out_dtype"])


def _four_bit_format(weight_scheme: QuantScheme) -> W4Format:
    """The 4-bit kinds' weight format (the tuning table tells int4 g128 / g32 / zero points, MXFP4 and
    NVFP4 apart: different kernels' speed and tiles)."""
    return W4Format(w4a16_kind(weight_scheme), weight_scheme.group_size, not weight_scheme.symmetric)


def _four_bit(weight_scheme, stacked):
    codes, scale = stacked["codes"], stacked["scale"]
    E, N = codes.shape[:2]
    if w4a16_kind(weight_scheme) == "int4":
        ops = {"w": pack_int4(codes), "s": scale.float().contiguous()}
        if stacked.get("zero") is not None:
            ops["z"] = stacked["zero"].to(torch.int32).contiguous()
        return ops
    ops = {"w": pack_fp4(codes.reshape(E * N, -1)).reshape(E, N, -1), "s": stacked["scale_codes"].contiguous()}
    if stacked.get("global") is not None:
        ops["g"] = stacked["global"].reshape(E).float().contiguous()
    return ops


def _four_bit_launch(ops, weight_scheme, x, routing, kw, g, bf16_path: bool):
    """The grouped W4A16 kernel, or (bf16_path) the weights dequantized into the scratch buffer and
    torch._grouped_mm; g multiplies each expert's output (NVFP4's tensor scales)."""
    w = dict(kind=w4a16_kind(weight_scheme), w_zero=ops.get("z"), w_global=g, group_size=weight_scheme.group_size)
    if bf16_path:
        return grouped_dequant_w4(x.to(torch.bfloat16), ops["w"], ops["s"], routing, **w, **_bf16_kw(kw))
    return _launchers().grouped_w4a16(x, ops["w"], ops["s"], routing, **w, **kw)


class GroupedW4A16(GroupedKernel):
    name, kind = "grouped_w4a16", "w4a16"
    packs_weights = True
    summary = "4-bit weights (int4 +- zero points, MXFP4, NVFP4) dequantized in the tile"

    @classmethod
    def refuses(cls, layer):
        why = weight_only_refusal(layer) or w4a16_refusal(layer.weight)
        if why is None and layer.weight.format == "uint4":
            why = "uint4 weights have no grouped kernel (int4 with zero points has)"
        return why

    @classmethod
    def weight_format(cls, weight_scheme):
        return _four_bit_format(weight_scheme)

    @classmethod
    def prepare(cls, weight_scheme, stacked, act_scheme):
        return _four_bit(weight_scheme, stacked)

    @classmethod
    def apply(cls, ops, weight_scheme, act_scheme, x, routing, kw):
        return _four_bit_launch(ops, weight_scheme, x, routing, kw, ops.get("g"), cls.bf16_path)


class GroupedDequantW4A16(GroupedW4A16):
    name = "grouped_dequant_w4a16"
    bf16_path = True
    summary = "4-bit expert weights dequantized into a bf16 scratch buffer [E, N, K], then torch._grouped_mm"


class GroupedFp4(GroupedKernel):
    name, kind = "grouped_fp4", "fp4"
    packs_weights = True
    summary = "fp4 activations dequantized exactly, then the grouped W4A16 kernel"

    @classmethod
    def refuses(cls, layer):
        return pair_refusal(layer.weight, layer.act, "fp4")

    @classmethod
    def weight_format(cls, weight_scheme):
        return _four_bit_format(weight_scheme)

    @classmethod
    def prepare(cls, weight_scheme, stacked, act_scheme):
        return _four_bit(weight_scheme, stacked)

    @classmethod
    def apply(cls, ops, weight_scheme, act_scheme, x, routing, kw):
        g = ops.get("g")
        x, gx = fp4_rows(x, act_scheme)     # e2m1 x block scale: exact in bf16 (the bf16 path's cast)
        if gx is not None:
            g = g * gx
        return _four_bit_launch(ops, weight_scheme, x, routing, kw, g, cls.bf16_path)


class GroupedDequantFp4(GroupedFp4):
    name = "grouped_dequant_fp4"
    bf16_path = True
    summary = "fp4 activations dequantized exactly, the weights into a bf16 scratch buffer, torch._grouped_mm"


class GroupedMXFP8(GroupedKernel):
    name, kind = "grouped_mxfp8", "mxfp8"
    min_capability = (8, 9)
    summary = "MXFP8 x MXFP8, e8m0 scales through the SFA / SFB words"

    @classmethod
    def refuses(cls, layer):
        return pair_refusal(layer.weight, layer.act, "mxfp8")

    @classmethod
    def prepare(cls, weight_scheme, stacked, act_scheme):
        codes, sc = stacked["codes"], stacked["scale_codes"]
        E, N = codes.shape[:2]
        return {"w": codes.contiguous(), "sfb": scale_words_int32(sc.reshape(E * N, sc.shape[2]))}

    @staticmethod
    def apply(ops, weight_scheme, act_scheme, x, routing, kw):
        from lowbit.ops.triton.grouped_mx import grouped_mxfp8, sfa_for_tokens    # optional: triton

        codes, _, scale_codes = rows_quantized(x, act_scheme, ops)
        sfa = sfa_for_tokens(scale_codes.reshape(x.shape[0], -1), routing, kw["identity"])
        return grouped_mxfp8(codes, sfa, ops["w"], ops["sfb"], routing, **kw)


class GroupedExact(Kernel):
    name = kind = "exact"
    triton = False
    summary = "QuantExperts' exact path: each expert's block through the float64 reference"

    @classmethod
    def refuses(cls, layer):
        return None


GroupedW8A16.dequant, GroupedW4A16.dequant, GroupedFp4.dequant = GroupedDequantW8A16, GroupedDequantW4A16, GroupedDequantFp4
GroupedDequantW8A16.dequant = GroupedDequantW4A16.dequant = GroupedDequantFp4.dequant = None

GROUPED = Registry("grouped experts", (GroupedInt8, GroupedFp8, GroupedW8A16, GroupedW4A16, GroupedFp4, GroupedMXFP8,
                                       GroupedExact))


def choose_grouped(weight_scheme: QuantScheme, act_scheme: QuantScheme | None, N: int = 0, K: int = 0,
                   device: Device | None = None) -> Choice:
    """The grouped kernel of an experts scheme pair on `device` (default: kernel_device()); the exact
    twin where no grouped kernel takes it."""
    return GROUPED.choose(LinearLayer(weight_scheme, act_scheme, N, K), device or kernel_device())


def grouped_kernel(weight_scheme: QuantScheme, act_scheme: QuantScheme | None) -> type[GroupedKernel] | None:
    """The grouped kernel class of an experts scheme pair, the scheme question only (no device), or None
    where only the exact twin takes it."""
    kernel = GROUPED.choose(LinearLayer(weight_scheme, act_scheme), None).kernel
    return None if kernel is GroupedExact else kernel
