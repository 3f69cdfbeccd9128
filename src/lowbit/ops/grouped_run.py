"""The fast path of a grouped (MoE) GEMM: operands prepared once per expert stack, then one
grouped Triton launch per call, with no validation and no host synchronisation (CUDA graphs and
torch.compile capture it). Which kernel runs is the grouped registry's answer
(lowbit.ops.kernels.grouped: one class per kernel, its table of kinds there); the functions here
take that class.

Under torch.compile the call is one opaque custom op, lowbit::grouped_gemm (grouped_forward), as
lowbit.ops.prepared's lowbit::qlinear is for a Linear.
Tiles: a GroupedConfig per call (kernel.tile_config: the registered or the GPU's tuning table's
cell for the kernel's kind and weight format, else the heuristic's), or the caller's `config`. Output: fp32, or
the activations' 16-bit dtype with out="input" (one rounding of the fp32 result, + bias first).
The kernels decode their weights tile by tile in the K loop; where the tuning table (or its
heuristic) sends a bucket of rows to the bf16 path (kernel.for_rows: the weight-only kinds at
prefill sizes), the projection's experts that received rows are dequantized once per call into
one reusable bf16 buffer and torch._grouped_mm runs them (lowbit.ops.grouped_dequant).
"""
from __future__ import annotations

import json
from functools import lru_cache

import torch

from lowbit.ops.grouped import Routing
from lowbit.ops.grouped_configs import GroupedConfig
from lowbit.ops.kernels.grouped import GROUPED, GroupedKernel
from lowbit.scheme import QuantScheme


def prepare_grouped(kernel: type[GroupedKernel], weight_scheme: QuantScheme, stacked: dict,
                    act_scheme: QuantScheme | None = None) -> dict[str, torch.Tensor]:
    """The kernel's operands (weights; act_qmax for per-tensor int8 activations) from stacked
    per-expert fields ("codes" [E, N, K], "scale" [E, N, G], "zero", "scale_codes", "global" [E];
    None where the scheme has none)."""
    return kernel.prepare(weight_scheme, stacked, act_scheme)


def out_dtype_of(x: torch.Tensor, out: str) -> torch.dtype:
    """The output dtype of a call: out "float32", or "input" (x's dtype if 16-bit, else float32)."""
    if out not in ("float32", "input"):
        raise ValueError(f"out={out!r}; choose 'float32' or 'input'")
    return x.dtype if out == "input" and x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def run_grouped(kernel: type[GroupedKernel], ops: dict, weight_scheme: QuantScheme, act_scheme: QuantScheme | None,
                x: torch.Tensor, routing: Routing, *, bias: torch.Tensor | None = None, identity: bool = False,
                config: GroupedConfig | None = None, out: str = "float32") -> torch.Tensor:
    """out [R, N] of the sorted rows (fp32, or x's 16-bit dtype with out="input"): x [T, K]
    gathered by routing.token (identity: x is the sorted buffer [R, K] itself) times each row's
    expert weight (+ bias [E, N]). The class that runs is kernel.for_rows' (the tuning table's path
    for R sorted rows: the kernel, or its bf16 path); config: the kernel's tiles (given: the kernel
    runs under them; None = kernel.tile_config(weight_scheme, E, N, K, R))."""
    od = out_dtype_of(x, out)
    E, N = ops["w"].shape[:2]
    K = x.shape[1]
    cls = kernel if config is not None else kernel.for_rows(weight_scheme, E, N, K, routing.rows, x.dtype)
    c = None if cls.bf16_path else config or kernel.tile_config(weight_scheme, E, N, K, routing.rows)
    return cls.apply(ops, weight_scheme, act_scheme, x, routing, dict(bias=bias, identity=identity, config=c, out_dtype=od))


# ---------------------------------------------------------------------------- custom op
def grouped_spec(kernel: type[GroupedKernel], weight_scheme: QuantScheme, act_scheme: QuantScheme | None,
                 names: list[str], N: int, identity: bool, out: str = "float32",
                 config: GroupedConfig | None = None) -> str:
    """The op's static description (JSON): everything but tensors and their shapes (config None:
    chosen per call by kernel.tile_config)."""
    a = None if act_scheme is None else act_scheme.to_json()
    return json.dumps({"kernel": kernel.name, "w": weight_scheme.to_json(), "a": a, "names": list(names),
                       "N": int(N), "identity": bool(identity), "out": out,
                       "config": None if config is None else config.to_dict()})


@lru_cache(maxsize=256)
def _parsed(spec: str) -> tuple:
    """(kernel, weight scheme, act scheme, operand names, N, identity, out, config) of a spec, parsed
    once (a compiled decode step calls the op per projection per layer)."""
    sp = json.loads(spec)
    a = None if sp["a"] is None else QuantScheme.from_json(sp["a"])
    c = None if sp.get("config") is None else GroupedConfig.from_dict(sp["config"])
    return (GROUPED.get(sp["kernel"]), QuantScheme.from_json(sp["w"]), a, tuple(sp["names"]), int(sp["N"]),
            bool(sp["identity"]), sp.get("out", "float32"), c)


def _grouped_gemm(x: torch.Tensor, operands: list[torch.Tensor], token: torch.Tensor, slot: torch.Tensor,
                  offsets: torch.Tensor, bias: torch.Tensor | None, spec: str) -> torch.Tensor:
    """run_grouped as one opaque op for torch.compile / CUDA graphs (spec: grouped_spec)."""
    kernel, w, a, names, _, identity, out, c = _parsed(spec)
    return run_grouped(kernel, dict(zip(names, operands)), w, a, x, Routing(token, slot, offsets, x.shape[0]),
                       bias=bias, identity=identity, config=c, out=out)


# torch.library.Library rather than torch.library.custom_op, as lowbit::qlinear (lowbit.ops.prepared):
# custom_op's Python autograd wrapper and aliasing check cost several microseconds a call on the host
_LIB = torch.library.Library("lowbit", "FRAGMENT")
_LIB.define("grouped_gemm(Tensor x, Tensor[] operands, Tensor token, Tensor slot, Tensor offsets, Tensor? bias, "
            "str spec) -> Tensor")
_LIB.impl("grouped_gemm", _grouped_gemm, "CompositeExplicitAutograd")


@torch.library.register_fake("lowbit::grouped_gemm")
def _(x, operands, token, slot, offsets, bias, spec):
    _, _, _, _, N, _, out, _ = _parsed(spec)
    return x.new_empty((token.shape[0], N), dtype=out_dtype_of(x, out))


grouped_gemm_op = torch.ops.lowbit.grouped_gemm.default


def grouped_forward(kernel: type[GroupedKernel], ops: dict, weight_scheme: QuantScheme,
                    act_scheme: QuantScheme | None, x: torch.Tensor, routing: Routing, *,
                    bias: torch.Tensor | None = None, identity: bool = False, spec: str | None = None,
                    out: str = "float32") -> torch.Tensor:
    """run_grouped, eagerly; under torch.compile the lowbit::grouped_gemm op (spec: grouped_spec,
    made once per layer by the caller, or here; a given spec's "out" and "config" win over `out`)."""
    if not torch.compiler.is_compiling():
        c = None
        if spec is not None:
            out, c = _parsed(spec)[6:]
        return run_grouped(kernel, ops, weight_scheme, act_scheme, x, routing, bias=bias, identity=identity,
                           config=c, out=out)
    names = list(ops)
    if spec is None:
        N = ops["w"].shape[1]
        spec = grouped_spec(kernel, weight_scheme, act_scheme, names, N, identity, out)
    return grouped_gemm_op(x, [ops[n] for n in names], routing.token, routing.slot, routing.offsets, bias, spec)
