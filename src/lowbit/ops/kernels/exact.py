"""The paths a QuantLinear runs without a prepared kernel, last in the dense registry's order.

  triton_gemm        on CUDA: lowbit.ops.linear's GEMM of the two QTensors (the activations quantized
                     per call; lowbit.ops.kernels.gemm), for scheme pairs the prepared kernels do not take
                     (fp8 1x128 / 128x128 blocks) and calls they do not (check=True, float32 inputs)
  exact_int8         int8 symmetric per-token / tensor activations x int8 symmetric per-channel / tensor
                     weights: the exact integer accumulator, then y = float32(acc) * s_x * s_w (seed 004's
                     integer GEMM). The accumulator is a float64 matmul of the codes on the CPU (every
                     product <= 127^2 < 2^14 and every partial sum < 2^53 for K < 2^39: the exact integer,
                     bit-identical to torch._int_mm's int32), torch._int_mm on CUDA
  exact_dequantized  every scheme pair: both operands dequantized by QTensor.dequantize and multiplied in
                     float32 (the emulation of the quantized arithmetic, not a different quantization)
Each is exact; QuantLinear runs them on the CPU, and on CUDA where no prepared kernel takes a call.
"""
from __future__ import annotations

import torch

from lowbit.ops.kernels.base import Kernel
from lowbit.ops.kernels.gemm import GEMM


class QTensorGemm(Kernel):
    name = "triton_gemm"
    kind = "gemm"
    summary = "lowbit.ops.linear's Triton GEMM of the quantized operands (activations quantized per call)"

    @classmethod
    def refuses(cls, layer):
        if layer.static_scale:
            return "static activation scales run the emulation"
        if GEMM.choose(layer, None).kernel is None:
            return (f"lowbit.ops.linear has no GEMM for x {layer.act} x w {layer.weight} (its GEMMs: "
                    f"{', '.join(GEMM.names())}; lowbit.ops.kernels.gemm)")
        return None

    @classmethod
    def can_run(cls, layer, device):
        why = super().can_run(layer, device)
        if why is None and device is not None:      # the pair's GEMM needs its tensor-core path here
            gemm = GEMM.choose(layer, None).kernel
            why = gemm.device_refusal(device)
            why = why and f"its GEMM {gemm.name} {why}"
        return why


def _int8_sym(s, strategies: tuple[str, ...]) -> bool:
    return (s is not None and s.format == "int8" and s.symmetric and s.strategy in strategies
            and s.scale_format == "fp32")


class ExactInt8(Kernel):
    name = "exact_int8"
    kind = "int8-intmm"
    triton = False
    summary = "exact integer accumulator (float64 on the CPU, torch._int_mm on CUDA), scales in float32"

    @classmethod
    def refuses(cls, layer):
        if _int8_sym(layer.act, ("token", "tensor")) and _int8_sym(layer.weight, ("channel", "tensor")):
            return None
        return ("this path takes int8 symmetric activations per token / tensor and int8 symmetric weights per "
                "channel / tensor (fp32 scales)")

    @staticmethod
    def apply(codes: torch.Tensor, scale: torch.Tensor, w_t: torch.Tensor, w_scale_row: torch.Tensor) -> torch.Tensor:
        """float32 [M, N] of int8 codes [M, K], their scales ([M, 1] or [1, 1]), the weight's codes
        transposed (int8 [K, N]) and its scales as a row ([1, N])."""
        acc = torch._int_mm(codes.to(torch.int8).contiguous(), w_t) if codes.is_cuda else \
            codes.to(torch.float64) @ w_t.to(torch.float64)
        return acc.to(torch.float32) * scale.to(torch.float32) * w_scale_row


class ExactDequantized(Kernel):
    name = "exact_dequantized"
    kind = "dequantized"
    triton = False
    summary = "both operands dequantized (QTensor.dequantize), multiplied in float32"

    @classmethod
    def refuses(cls, layer):
        return None

    @staticmethod
    def apply(x_deq: torch.Tensor, w_deq: torch.Tensor) -> torch.Tensor:
        return x_deq @ w_deq.t()
