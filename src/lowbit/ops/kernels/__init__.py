"""Kernels as classes, chosen in preference order (docs/architecture.md: adding a kernel).

Each kernel is a class that says whether it can run a layer on a device and, if not, why
(`can_run(layer, device) -> str | None`), lays the weight out once and applies it per call. Three
registries hold them in preference order: LINEAR (a QuantLinear: the prepared Triton kernels, the
per-call QTensor GEMM, the exact twins), GEMM (lowbit.ops.linear's QTensor x QTensor GEMMs) and
GROUPED (QuantExperts' grouped MoE kernels, then the exact twin). `explain` reports, for a scheme
pair, which kernel runs here and why the ones ahead of it were refused (`lowbit doctor` prints it).
ATTENTION (lowbit.ops.kernels.attention) holds the attention kernels that read a KV cache, asked per call;
`explain_attention` reports theirs per KV cache scheme and call kind.
"""
from lowbit.ops.kernels.attention import ATTENTION
from lowbit.ops.kernels.attention_call import AttentionCall
from lowbit.ops.kernels.base import Choice, Device, Kernel, LinearLayer, Refused, Registry, kernel_device
from lowbit.ops.kernels.dense import LINEAR, choose_linear, class_for_rows, prepared_class, resolve
from lowbit.ops.kernels.explain import explain, explain_attention
from lowbit.ops.kernels.gemm import GEMM
from lowbit.ops.kernels.grouped import GROUPED, GroupedKernel, choose_grouped
from lowbit.ops.kernels.prepared_kernel import Prepared, PreparedKernel, Spec

__all__ = ["Choice", "Device", "Kernel", "LinearLayer", "Refused", "Registry", "kernel_device", "LINEAR", "GEMM",
           "GROUPED", "GroupedKernel", "PreparedKernel", "Prepared", "Spec", "choose_linear", "choose_grouped",
           "class_for_rows", "prepared_class", "resolve", "explain", "ATTENTION", "AttentionCall", "explain_attention"]
