"""The dense registry: every kernel that can run a QuantLinear, in preference order, and the two
questions asked of it -- which kernel a layer gets (once, when it is quantized or loaded) and which
class runs M rows of a prepared layer (once per layer and M, cached; lowbit.ops.prepared's per-call
path reads the answer).

Order: the prepared kernels (W8A8 int8, W8A8 fp8, W8A16, W4A16, fp4 x fp4, MXFP8: their conditions are
disjoint; each native sm_90a decode class, opt-in, ahead of the Triton class it stands in for), then the per-call QTensor GEMM (CUDA), then the exact twins. Adding a
kernel: a PreparedKernel subclass and `LINEAR.register(cls, before=<the class it beats>)`.
"""
from __future__ import annotations

import torch

from lowbit.ops import tuning
from lowbit.ops.kernels.base import Choice, Device, LinearLayer, Registry, kernel_device
from lowbit.ops.kernels.dense_mx import TritonMXFP8
from lowbit.ops.kernels.dense_w4 import TritonFP4, TritonW4A16
from lowbit.ops.kernels.dense_w8 import TritonW8A8Fp8, TritonW8A8Int8, TritonW8A16
from lowbit.ops.kernels.exact import ExactDequantized, ExactInt8, QTensorGemm
from lowbit.ops.kernels.native import NativeW4A16, NativeW8A8Fp8, NativeW8A8Int8, NativeW8A16
from lowbit.ops.kernels.prepared_kernel import PreparedKernel, Spec
from lowbit.quantize import QTensor
from lowbit.scheme import QuantScheme

LINEAR = Registry("dense layer", (NativeW8A8Int8, TritonW8A8Int8, NativeW8A8Fp8, TritonW8A8Fp8, NativeW8A16,
                                  TritonW8A16, NativeW4A16, TritonW4A16, TritonFP4, TritonMXFP8,
                                  QTensorGemm, ExactInt8, ExactDequantized))


def layer_of(weight_q: QTensor, act_scheme: QuantScheme | None, static_scale: bool = False) -> LinearLayer:
    return LinearLayer(weight_q.scheme, act_scheme, int(weight_q.shape[0]), int(weight_q.shape[1]),
                       bool(weight_q.padded), bool(static_scale))


def choose_linear(weight_q: QTensor, act_scheme: QuantScheme | None, static_scale: torch.Tensor | None = None,
                  device: Device | None = None) -> Choice:
    """The kernel of one layer on `device` (default: kernel_device()), its weight laid out by that
    kernel when it is a prepared one (Choice.prepared: a Prepared, else None), and why each kernel ahead
    of it was refused."""
    def prepare(cls):
        return cls.prepare(weight_q, act_scheme, static_scale) if issubclass(cls, PreparedKernel) else None
    return LINEAR.choose(layer_of(weight_q, act_scheme, static_scale is not None), device or kernel_device(), prepare)


def prepared_class(spec: Spec) -> type[PreparedKernel]:
    """The class that laid out a prepared layer (its Spec names it)."""
    return LINEAR.get(spec.kernel)


@tuning.per_table
def resolve(spec: Spec, M: int):
    """(apply, config) of the class that runs M rows of a prepared layer: its kernel, or the kernel's
    dequant path where the tuning table sends this bucket there. Cached per (layer, M) until the table
    or the registry changes, so a call pays one cache lookup for the choice."""
    cls, cfg = prepared_class(spec).for_rows(spec, M)
    return cls.apply, cfg


def class_for_rows(spec: Spec, M: int) -> type[PreparedKernel]:
    """The class resolve() runs M rows of a prepared layer with (for reports and tests)."""
    return prepared_class(spec).for_rows(spec, M)[0]
