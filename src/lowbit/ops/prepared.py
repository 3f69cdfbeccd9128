"""The prepared fast path of QuantLinear: what a served quantized model runs on the GPU.

`prepare(weight_q, act_scheme, static_scale)` is called once, when a layer is
quantized or loaded. It checks everything (schemes, shapes, encodability) and returns a
`Prepared`: the weight's operands in the layout its kernel reads (registered by QuantLinear
as buffers, so `.to(device)` moves them) and a `Spec` of plain Python values. The forward,
`run(spec, x2, operands, bias)`, then only launches kernels: no validation, no host
synchronisation, no float32 round trip (bf16 / fp16 in, the same dtype out), no dequantized
copy of any weight. Under `torch.compile` the same function is one custom op,
`torch.ops.lowbit.qlinear`, with a fake (meta) implementation, so a quantized model traces
without graph breaks and decode can be captured in a CUDA graph.

Which kernel lays a layer out is lowbit.ops.kernels' choice (the dense registry asked in
preference order: W8A8 int8 / fp8, W8A16, W4A16, fp4 x fp4, MXFP8; each kernel class's module
docstring states its arithmetic); the Spec names that class. Which class runs M rows is the tuning
table's path mapped onto classes (the kernel, or its dequant path: the weight dequantized into
lowbit.ops.scratch's reusable buffer + the bf16 GEMM), resolved once per layer and M.
Exactness of each kind is the kernel's own (see each kernel module's docstring);
tests/ops/test_runtime.py compares each kind with the float64 reference (lowbit.ops.reference)
within a bound derived there.

NaN / Inf in an activation is NOT checked on this path (a check costs a host sync per call):
QuantLinear(check=True) runs the exact path, which raises on them.
"""
from __future__ import annotations

import torch

from lowbit.ops import bound, tuning
from lowbit.ops.kernels.dense import choose_linear, prepared_class, resolve
from lowbit.ops.kernels.dense_w8 import quantize_tensor_int8
from lowbit.ops.kernels.prepared_kernel import ACT_DTYPES, Prepared, Spec, spec_from_json
from lowbit.quantize import QTensor
from lowbit.scheme import QuantScheme

__all__ = ["ACT_DTYPES", "PER_LAYER_OPERANDS", "Prepared", "Spec", "spec_from_json", "prepare", "run", "forward",
           "input_dtypes", "graphable", "quantize_tensor_int8", "GraphCache", "qlinear_op"]

# Operands that are one value per layer, not per output row (equal across layers sharing one
# input, so a merged GEMM takes the first member's rather than a concatenation).
PER_LAYER_OPERANDS = ("global_scale", "act_qmax", "act_scale")


def prepare(weight_q: QTensor, act_scheme: QuantScheme | None,
            static_scale: torch.Tensor | None = None) -> Prepared | None:
    """The kernel operands of one layer, or None when no prepared kernel takes it (the layer runs its
    exact path; lowbit.ops.kernels.choose_linear says which and why).
    weight_q: the layer's quantized weight [N, K] (unpadded along K for the 4-bit kinds)."""
    return choose_linear(weight_q, act_scheme, static_scale).prepared


def input_dtypes(spec: Spec) -> tuple[torch.dtype, ...]:
    """Activation dtypes the layer's kernel takes (others run QuantLinear's exact path)."""
    return prepared_class(spec).input_dtypes(spec)


# ---------------------------------------------------------------------------- the forward
def run(spec: Spec, x2: torch.Tensor, ops: dict[str, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """out [M, N] in x2's dtype for x2 [M, K] (bf16 / fp16, unit stride along K): the class that
    runs M rows of this layer (its kernel, or the dequant path the tuning table names; resolved once
    per layer and M) applied with the table's tiles."""
    apply, config = resolve(spec, x2.shape[0])
    return apply(spec, x2, ops, bias, config)


def _choice(spec: Spec, M: int):
    """The tuning table's (path, kernel config or None) for this layer at M rows (lowbit.ops.tuning)."""
    return tuning.choose("linear", tuning.kind_key(spec), spec.N, spec.K, M)


# ---------------------------------------------------------------------------- custom op
def _qlinear(x2: torch.Tensor, operands: list[torch.Tensor], bias: torch.Tensor | None, spec: str) -> torch.Tensor:
    """`run` as one opaque op for torch.compile / CUDA graphs (spec: Spec.to_json()). Decode-sized
    calls on the default stream replay a recorded plan shared by every layer of this spec (the layer's
    operands and bias are the plan's slots): a compiled model without CUDA graphs pays a few
    microseconds a kernel instead of the launchers' tens. CUDA-graph trees (mode="reduce-overhead")
    warm up and capture on a stream of their own, where the plain launches run: a plan's kept
    buffers would sit in the graph's memory pool."""
    sp = spec_from_json(spec)
    if x2.is_cuda and x2.shape[0] <= PLAN_MAX_M and sp.graphable \
            and torch._C._cuda_getCurrentRawStream(x2.get_device()) == 0:
        slots = tuple(operands) if bias is None else (*operands, bias)
        # a plan's kernels were specialised on its slots' 16-byte alignment and read them whole
        if all(t.data_ptr() & 15 == 0 and t.is_contiguous() for t in slots):
            key = (spec, x2.shape[0], x2.dtype, x2.stride(0), x2.data_ptr() & 15 == 0, bias is None or bias.dtype)
            # the operand dict is built only by a call that launches directly, not by a replay
            return _planned(_OP_PLANS, key, x2, lambda a: run(sp, a, dict(zip(sp.operands, operands)), bias),
                            slots)
    return run(sp, x2, dict(zip(sp.operands, operands)), bias)


# Defined with torch.library.Library rather than torch.library.custom_op: the latter's Python
# autograd wrapper and per-call aliasing check cost ~8 us a call on the host (12 vs 4 us measured
# on a 2-core CPU with an empty body), which a compiled decode step pays once per Linear.
_LIB = torch.library.Library("lowbit", "FRAGMENT")
_LIB.define("qlinear(Tensor x2, Tensor[] operands, Tensor? bias, str spec) -> Tensor")
_LIB.impl("qlinear", _qlinear, "CompositeExplicitAutograd")


@torch.library.register_fake("lowbit::qlinear")
def _(x2, operands, bias, spec):
    return x2.new_empty((x2.shape[0], spec_from_json(spec).N))


qlinear_op = torch.ops.lowbit.qlinear.default


# Eager calls with at most this many rows (decode) replay the layer's recorded launches
# (lowbit.ops.bound: an output allocation and one launcher call per kernel), or where the call
# cannot be recorded, a CUDA graph of its launches captured on first use: on the H200's host going
# through the launchers costs 45-100 us a call, a graph replay with its input copy and output clone
# about 60 us, a recorded plan a few microseconds per kernel.
PLAN_MAX_M = 64
GRAPH_MAX_M = 16
# the custom op's plans, one per (spec, input rows / dtype / stride / alignment, bias dtype or none): they
# hold no layer's tensors (those are slots), only the kernels and the calls' intermediate buffers
_OP_PLANS: dict = {}


def _planned(cache: dict, key, x2: torch.Tensor, call, slots: tuple = ()):
    """call(x2) through the plan cached under key: the first call runs directly (so one-time set-up --
    compiling, cached configurations, counters -- is not recorded), the second records, later ones
    replay; a call that cannot be recorded is stored as False and runs directly from then on."""
    plan = cache.get(key)
    if plan:
        return plan(x2, torch._C._cuda_getCurrentRawStream(x2.get_device()), slots)
    if plan is None:
        cache[key] = 0
        return call(x2)
    if plan is False or torch.cuda.is_current_stream_capturing():
        return call(x2)
    out, plan, _why = bound.record(call, x2, slots)
    cache[key] = plan or False
    return out


class GraphCache(dict):
    """A layer's recorded plans and captured decode graphs, keyed by (rows, dtype, ...). Never
    copied (deepcopy / pickling give an empty cache: plans and graphs hold device pointers)."""

    def __deepcopy__(self, memo):
        return GraphCache()

    def __reduce__(self):
        return (GraphCache, ())


def forward(spec: Spec, spec_json: str, x2: torch.Tensor, operands: list[torch.Tensor],
            bias: torch.Tensor | None, graphs: GraphCache | None = None) -> torch.Tensor:
    """Eager: replay the layer's recorded launches (decode sizes on CUDA), else call the launches
    directly (a custom op's dispatch costs microseconds a call) or replay the layer's graph; under
    torch.compile: the custom op (whose CUDA-graph capture is then torch's own)."""
    if torch.compiler.is_compiling():
        return qlinear_op(x2, operands, bias, spec_json)
    if graphs is not None and x2.is_cuda and x2.shape[0] <= PLAN_MAX_M and spec.graphable:
        key = (x2.shape[0], x2.dtype, x2.stride(0), x2.data_ptr() & 15 == 0)
        plan = graphs.get(key)
        if plan:                               # the common decode call: nothing else on the host
            return plan(x2, torch._C._cuda_getCurrentRawStream(x2.get_device()))
        if plan is not False or torch.cuda.is_current_stream_capturing():
            ops = dict(zip(spec.operands, operands))
            return _planned(graphs, key, x2, lambda a: run(spec, a, ops, bias))
        if x2.shape[0] <= GRAPH_MAX_M:
            return _replay(spec, x2, operands, bias, graphs)
    return run(spec, x2, dict(zip(spec.operands, operands)), bias)


def graphable(spec: Spec) -> bool:
    """Whether the layer's launches never synchronise with the host (its kernel class's graph_safe,
    read into the Spec when it was prepared). The fp4 / MXFP8 emulations are not captured until a GPU
    run has shown them capture-safe."""
    return spec.graphable


def _replay(spec, x2, operands, bias, graphs):
    key = ("graph", x2.shape[0], x2.dtype, x2.device, operands[0].data_ptr())
    entry = graphs.get(key)
    if entry is None:
        ops = dict(zip(spec.operands, operands))
        xs = x2.clone()
        run(spec, xs, ops, bias)              # compiles every kernel outside the capture
        g = torch.cuda.CUDAGraph()
        # each graph has its own memory pool (the default): a pool handle shared by all layers hits
        # a CUDA caching-allocator assert once the graphs first holding it are freed; a private
        # pool reserves one small segment per layer and M instead
        with torch.cuda.graph(g):
            ys = run(spec, xs, ops, bias)
        entry = graphs[key] = (g, xs, ys)
    g, xs, ys = entry
    xs.copy_(x2)
    g.replay()
    return ys.clone()                          # the static output is overwritten by the next replay
