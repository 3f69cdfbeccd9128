"""The fast path of a grouped (MoE) GEMM: operands prepared once per expert stack, then one
grouped Triton launch per call, with no validation and no host synchronisation (CUDA graphs and
torch.compile capture it). Which kernel runs is lowbit.ops.dispatch.grouped_kind's answer.

  kind    activations (quantized once per call, every row)              kernel
  int8    int8 per token / per tensor (scale expanded to the rows)      grouped_int8
  fp8     fp8 e4m3 per token / per tensor                               grouped_fp8
  w8a16   float                                                         grouped_w8a16
  w4a16   float                                                         grouped_w4a16 (int4 +- zero
                                                                        points, MXFP4, NVFP4)
  fp4     MXFP4 / NVFP4, quantized and dequantized exactly (bf16)       grouped_w4a16; NVFP4: the
                                                                        two tensor scales multiply
                                                                        the accumulator
  mxfp8   MXFP8, scale codes laid out as SFA words over the sorted rows grouped_mxfp8
Activation codes equal lowbit.quantize's (lowbit.ops.fused.quantize_rows / qdq_rows on CUDA; the
CPU runs their torch twins); a per-tensor scale spans all rows of the operand, as a grouped
kernel's A operand over the concatenated M does.
"""
from __future__ import annotations

import torch

from lowbit.ops.dispatch import w4a16_kind
from lowbit.ops.grouped import Routing
from lowbit.packing import pack_fp4, pack_int4
from lowbit.quantize import compute_scale, encode_scaled, expand_scale, quantize, reduce_amax
from lowbit.scheme import QuantScheme


def prepare_grouped(kind: str, weight_scheme: QuantScheme, stacked: dict) -> dict[str, torch.Tensor]:
    """The kernel's weight operands from stacked per-expert fields ("codes" [E, N, K], "scale"
    [E, N, G], "zero", "scale_codes", "global" [E]; None where the scheme has none)."""
    codes, scale = stacked["codes"], stacked["scale"]
    E, N = codes.shape[:2]
    if kind in ("int8", "fp8", "w8a16"):
        return {"w": codes.contiguous(), "s": scale.reshape(E, N).float().contiguous()}
    if kind in ("w4a16", "fp4"):
        w4 = w4a16_kind(weight_scheme)
        if w4 == "int4":
            ops = {"w": pack_int4(codes), "s": scale.float().contiguous()}
            if stacked.get("zero") is not None:
                ops["z"] = stacked["zero"].to(torch.int32).contiguous()
            return ops
        ops = {"w": pack_fp4(codes.reshape(E * N, -1)).reshape(E, N, -1), "s": stacked["scale_codes"].contiguous()}
        if stacked.get("global") is not None:
            ops["g"] = stacked["global"].reshape(E).float().contiguous()
        return ops
    if kind == "mxfp8":
        from lowbit.ops.triton.grouped_mx import sfb_for_experts
        return {"w": codes.contiguous(), "sfb": sfb_for_experts(stacked["scale_codes"])}
    raise ValueError(f"kind={kind!r} is not a grouped kernel (lowbit.ops.dispatch.GROUPED_KERNELS)")


def _rows_quantized(x: torch.Tensor, scheme: QuantScheme):
    """(codes [R, K], per-row fp32 scales [R], scale codes or None) of x [R, K], dynamically quantized
    by `scheme` with lowbit.quantize's arithmetic and no host synchronisation."""
    R = x.shape[0]
    if scheme.strategy == "tensor":                         # one scale over all rows (quantize's steps)
        xf = x.float()
        sc = compute_scale(reduce_amax(xf, scheme), scheme)
        codes = encode_scaled(xf / expand_scale(sc.scale, scheme, tuple(xf.shape)), None, scheme.fmt)
        return codes, sc.scale.reshape(1).expand(R).contiguous(), None
    if x.is_cuda:
        from lowbit.ops.fused import quantize_rows
        q = quantize_rows(x, scheme, check_finite=False)
    else:
        q = quantize(x.float(), scheme)
    return q.codes, q.scale.reshape(R, -1)[:, 0].contiguous(), q.scale_codes


def _fp4_rows(x: torch.Tensor, scheme: QuantScheme):
    """(x dequantized exactly [R, K], NVFP4 activation tensor scale [1] or None)."""
    if x.is_cuda:
        from lowbit.ops.fused import qdq_rows
        return qdq_rows(x.contiguous(), scheme)
    q = quantize(x.float(), scheme)
    if q.global_scale is None:
        return q.dequantize(torch.float32), None
    # e2m1 * e4m3 block scale (exact), the tensor scale applied to the accumulator
    from lowbit.formats import decode
    s = decode(q.scale_codes, scheme.scale_format).to(torch.float32)
    xd = decode(q.codes, scheme.format).to(torch.float32).reshape(x.shape[0], -1, scheme.group_size) * s[..., None]
    return xd.reshape(x.shape), q.global_scale.reshape(1).float()


def run_grouped(kind: str, ops: dict, weight_scheme: QuantScheme, act_scheme: QuantScheme | None, x: torch.Tensor,
                routing: Routing, *, bias: torch.Tensor | None = None, identity: bool = False) -> torch.Tensor:
    """out fp32 [R, N] of the sorted rows: x [T, K] gathered by routing.token (identity: x is the
    sorted buffer [R, K] itself) times each row's expert weight (+ bias [E, N])."""
    from lowbit.ops.triton import grouped as gk
    from lowbit.ops.triton.grouped_mx import grouped_mxfp8, sfa_for_tokens

    if kind in ("int8", "fp8"):
        codes, sa, _ = _rows_quantized(x, act_scheme)
        fn = gk.grouped_int8 if kind == "int8" else gk.grouped_fp8
        return fn(codes, sa, ops["w"], ops["s"], routing, bias=bias, identity=identity)
    if kind == "w8a16":
        return gk.grouped_w8a16(x, ops["w"], ops["s"], routing, bias=bias, identity=identity)
    if kind in ("w4a16", "fp4"):
        w4 = w4a16_kind(weight_scheme)
        g = ops.get("g")
        if kind == "fp4":
            x, gx = _fp4_rows(x, act_scheme)
            if gx is not None:
                g = g * gx
        return gk.grouped_w4a16(x, ops["w"], ops["s"], routing, kind=w4, w_zero=ops.get("z"), w_global=g,
                                group_size=weight_scheme.group_size, bias=bias, identity=identity)
    if kind == "mxfp8":
        codes, _, scale_codes = _rows_quantized(x, act_scheme)
        sfa = sfa_for_tokens(scale_codes.reshape(x.shape[0], -1), routing, identity)
        return grouped_mxfp8(codes, sfa, ops["w"], ops["sfb"], routing, bias=bias, identity=identity)
    raise ValueError(f"kind={kind!r} is not a grouped kernel (lowbit.ops.dispatch.GROUPED_KERNELS)")
