"""Which kernel runs a scheme pair (or a KV cache's attention call) here, per batch-size bucket or
call kind, and why the better ones were refused."""
from __future__ import annotations

import torch

from lowbit.ops import tuning
from lowbit.ops.attention_reference import AttnSpec
from lowbit.ops.kernels.attention import resolve
from lowbit.ops.kernels.attention_call import AttentionCall, CacheOperand
from lowbit.ops.kernels.base import Device, kernel_device
from lowbit.ops.kernels.dense import choose_linear, class_for_rows
from lowbit.ops.kernels.grouped import GroupedKernel, choose_grouped
from lowbit.ops.kv_quant import KVScheme
from lowbit.quantize import quantize
from lowbit.scheme import QuantScheme


def explain(weight_scheme: QuantScheme, act_scheme: QuantScheme | None, *, N: int = 256, K: int = 256,
            E: int = 8, device: Device | None = None) -> dict:
    """For a layer of `weight_scheme` x `act_scheme` and shape [N, K] on `device` (default: this
    process's kernel device): {"device", "linear": {"kernel", "refused": [(name, reason)], "rows":
    {bucket: class}}, "grouped": {"kernel", "refused", "rows"}}. A random weight is laid out to answer
    (the W4A16 layout's own refusals depend on it); "rows" names the class the tuning table (or its
    heuristic) runs each bucket's M with: M rows of a prepared kernel, M sorted rows (tokens x top_k)
    of E experts' [N, K] projection with bf16 activations for a grouped one."""
    dev = device or kernel_device()
    gen = torch.Generator().manual_seed(0)
    wq = quantize(torch.randn(N, K, generator=gen) * 0.05, weight_scheme, pad=True)
    dense = choose_linear(wq, act_scheme, device=dev)
    rows = {}
    if dense.prepared is not None:
        spec = dense.prepared.spec
        rows = {b: class_for_rows(spec, tuning.BUCKET_M[b]).name for b in tuning.BUCKET_NAMES}
    grouped = choose_grouped(weight_scheme, act_scheme, N, K, dev)
    grows = {}
    if isinstance(grouped.kernel, type) and issubclass(grouped.kernel, GroupedKernel):
        grows = {b: grouped.kernel.for_rows(weight_scheme, E, N, K, tuning.BUCKET_M[b], torch.bfloat16).name
                 for b in tuning.BUCKET_NAMES}
    return {"device": str(dev),
            "linear": {"kernel": dense.name, "refused": list(dense.refused), "rows": rows},
            "grouped": {"kernel": grouped.name, "refused": list(grouped.refused), "rows": grows}}


# query tokens per head of each attention call kind explain_attention reports: a decode step, a prefill chunk
ATTENTION_CALLS = (("decode", 1), ("prefill", 256))


def explain_attention(kv_scheme: KVScheme | None, spec: AttnSpec | None = None, *, G: int = 4, D: int = 128,
                      device: Device | None = None) -> dict:
    """For a KV cache stored by `kv_scheme` (None: bf16 values), read under `spec` (default AttnSpec():
    Q and P in fp8) by G query heads per KV head at head_dim D on `device` (default: this process's
    kernel device): {"device", "G", "D", "spec", "calls": {call kind: {"kernel", "refused": [(name,
    reason)]}}} for each call kind of ATTENTION_CALLS, chosen as lowbit.ops.attention.attention_triton
    chooses for float queries (a tuning table's cell included)."""
    dev = device or kernel_device()
    spec = spec or AttnSpec()
    op = CacheOperand.of_scheme(kv_scheme)
    q = "quantized" if spec.q_format is not None else "bf16"
    calls = {}
    for what, Tq in ATTENTION_CALLS:
        choice, _ = resolve(AttentionCall(Tq, G, D, q, op, op, spec), device=dev)
        calls[what] = {"kernel": choice.name, "refused": list(choice.refused)}
    return {"device": str(dev), "G": G, "D": D, "spec": spec, "calls": calls}
