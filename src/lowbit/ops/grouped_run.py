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
Under torch.compile the call is one opaque custom op, lowbit::grouped_gemm (grouped_forward), as
lowbit.ops.prepared's lowbit::qlinear is for a Linear.
Tiles: a GroupedConfig per call (lowbit.ops.grouped_configs.grouped_config(kind, E, N, K, rows):
the registered tuning table's, else the heuristic's), or the caller's `config`. Output: fp32, or
the activations' 16-bit dtype with out="input" (one rounding of the fp32 result, + bias first).
No path decodes a whole expert stack per call: every kind decodes its weights tile by tile in
the kernel's K loop.
Activation codes equal lowbit.quantize's (lowbit.ops.fused.quantize_rows / qdq_rows on CUDA; the
CPU runs their torch twins); a per-tensor scale spans all rows of the operand, as a grouped
kernel's A operand over the concatenated M does.
"""
from __future__ import annotations

import json
from functools import lru_cache

import torch

from lowbit.ops.dispatch import w4a16_kind
from lowbit.ops.grouped import Routing, scale_words_int32
from lowbit.ops.grouped_configs import GroupedConfig, grouped_config
from lowbit.packing import pack_fp4, pack_int4
from lowbit.ops.prepared import quantize_tensor_int8
from lowbit.quantize import quantize
from lowbit.scheme import QuantScheme


def prepare_grouped(kind: str, weight_scheme: QuantScheme, stacked: dict, act_scheme: QuantScheme | None = None
                    ) -> dict[str, torch.Tensor]:
    """The kernel's operands (weights; act_qmax for per-tensor int8 activations) from stacked
    per-expert fields ("codes" [E, N, K], "scale" [E, N, G], "zero", "scale_codes", "global" [E];
    None where the scheme has none)."""
    codes, scale = stacked["codes"], stacked["scale"]
    E, N = codes.shape[:2]
    if kind in ("int8", "fp8", "w8a16"):
        ops = {"w": codes.contiguous(), "s": scale.reshape(E, N).float().contiguous()}
        if act_scheme is not None and act_scheme.strategy == "tensor" and act_scheme.format == "int8":
            # the divisor as a device tensor (lowbit.ops.prepared.quantize_tensor_int8)
            ops["act_qmax"] = torch.full((1,), float(act_scheme.fmt.qmax), dtype=torch.float32, device=codes.device)
        return ops
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
        sc = stacked["scale_codes"]
        return {"w": codes.contiguous(), "sfb": scale_words_int32(sc.reshape(E * N, sc.shape[2]))}
    raise ValueError(f"kind={kind!r} is not a grouped kernel (lowbit.ops.dispatch.GROUPED_KERNELS)")


def _rows_quantized(x: torch.Tensor, scheme: QuantScheme, ops: dict):
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


def out_dtype_of(x: torch.Tensor, out: str) -> torch.dtype:
    """The output dtype of a call: out "float32", or "input" (x's dtype if 16-bit, else float32)."""
    if out not in ("float32", "input"):
        raise ValueError(f"out={out!r}; choose 'float32' or 'input'")
    return x.dtype if out == "input" and x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def run_grouped(kind: str, ops: dict, weight_scheme: QuantScheme, act_scheme: QuantScheme | None, x: torch.Tensor,
                routing: Routing, *, bias: torch.Tensor | None = None, identity: bool = False,
                config: GroupedConfig | None = None, out: str = "float32") -> torch.Tensor:
    """out [R, N] of the sorted rows (fp32, or x's 16-bit dtype with out="input"): x [T, K]
    gathered by routing.token (identity: x is the sorted buffer [R, K] itself) times each row's
    expert weight (+ bias [E, N]). config: None = grouped_config(kind, E, N, K, R)."""
    from lowbit.ops.triton import grouped as gk
    from lowbit.ops.triton.grouped_mx import grouped_mxfp8, sfa_for_tokens

    od = out_dtype_of(x, out)
    E, N = ops["w"].shape[:2]
    c = config or grouped_config(kind, E, N, x.shape[1], routing.rows)
    kw = dict(bias=bias, identity=identity, config=c, out_dtype=od)
    if kind in ("int8", "fp8"):
        codes, sa, _ = _rows_quantized(x, act_scheme, ops)
        fn = gk.grouped_int8 if kind == "int8" else gk.grouped_fp8
        return fn(codes, sa, ops["w"], ops["s"], routing, **kw)
    if kind == "w8a16":
        return gk.grouped_w8a16(x, ops["w"], ops["s"], routing, **kw)
    if kind in ("w4a16", "fp4"):
        w4 = w4a16_kind(weight_scheme)
        g = ops.get("g")
        if kind == "fp4":
            x, gx = _fp4_rows(x, act_scheme)
            if gx is not None:
                g = g * gx
        return gk.grouped_w4a16(x, ops["w"], ops["s"], routing, kind=w4, w_zero=ops.get("z"), w_global=g,
                                group_size=weight_scheme.group_size, **kw)
    if kind == "mxfp8":
        codes, _, scale_codes = _rows_quantized(x, act_scheme, ops)
        sfa = sfa_for_tokens(scale_codes.reshape(x.shape[0], -1), routing, identity)
        return grouped_mxfp8(codes, sfa, ops["w"], ops["sfb"], routing, **kw)
    raise ValueError(f"kind={kind!r} is not a grouped kernel (lowbit.ops.dispatch.GROUPED_KERNELS)")


# ---------------------------------------------------------------------------- custom op
def grouped_spec(kind: str, weight_scheme: QuantScheme, act_scheme: QuantScheme | None, names: list[str], N: int,
                 identity: bool, out: str = "float32", config: GroupedConfig | None = None) -> str:
    """The op's static description (JSON): everything but tensors and their shapes (config None:
    chosen per call by grouped_config)."""
    a = None if act_scheme is None else act_scheme.to_json()
    return json.dumps({"kind": kind, "w": weight_scheme.to_json(), "a": a, "names": list(names), "N": int(N),
                       "identity": bool(identity), "out": out,
                       "config": None if config is None else config.to_dict()})


@torch.library.custom_op("lowbit::grouped_gemm", mutates_args=())
def grouped_gemm_op(x: torch.Tensor, operands: list[torch.Tensor], token: torch.Tensor, slot: torch.Tensor,
                    offsets: torch.Tensor, bias: torch.Tensor | None, spec: str) -> torch.Tensor:
    """run_grouped as one opaque op for torch.compile / CUDA graphs (spec: grouped_spec)."""
    sp = json.loads(spec)
    a = None if sp["a"] is None else QuantScheme.from_json(sp["a"])
    c = None if sp.get("config") is None else GroupedConfig.from_dict(sp["config"])
    return run_grouped(sp["kind"], dict(zip(sp["names"], operands)), QuantScheme.from_json(sp["w"]), a, x,
                       Routing(token, slot, offsets, x.shape[0]), bias=bias, identity=sp["identity"], config=c,
                       out=sp.get("out", "float32"))


@grouped_gemm_op.register_fake
def _(x, operands, token, slot, offsets, bias, spec):
    sp = json.loads(spec)
    return x.new_empty((token.shape[0], sp["N"]), dtype=out_dtype_of(x, sp.get("out", "float32")))


@lru_cache(maxsize=256)
def _spec_call(spec: str) -> tuple[str, GroupedConfig | None]:
    """(out, config) of a spec, parsed once (an eager call's host time)."""
    sp = json.loads(spec)
    return sp.get("out", "float32"), None if sp.get("config") is None else GroupedConfig.from_dict(sp["config"])


def grouped_forward(kind: str, ops: dict, weight_scheme: QuantScheme, act_scheme: QuantScheme | None,
                    x: torch.Tensor, routing: Routing, *, bias: torch.Tensor | None = None,
                    identity: bool = False, spec: str | None = None, out: str = "float32") -> torch.Tensor:
    """run_grouped, eagerly; under torch.compile the lowbit::grouped_gemm op (spec: grouped_spec,
    made once per layer by the caller, or here; a given spec's "out" and "config" win over `out`)."""
    if not torch.compiler.is_compiling():
        c = None
        if spec is not None:
            out, c = _spec_call(spec)
        return run_grouped(kind, ops, weight_scheme, act_scheme, x, routing, bias=bias, identity=identity,
                           config=c, out=out)
    names = list(ops)
    if spec is None:
        N = ops["w"].shape[1]
        spec = grouped_spec(kind, weight_scheme, act_scheme, names, N, identity, out)
    return grouped_gemm_op(x, [ops[n] for n in names], routing.token, routing.slot, routing.offsets, bias, spec)
