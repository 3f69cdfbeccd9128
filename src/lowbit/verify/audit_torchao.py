"""torchao's quantized linears as `lowbit audit` kernels, when torchao is importable.

lowbit never imports torchao anywhere else (it is a test oracle here: scripts/setup.sh keeps it
out of site-packages; `PYTHONPATH=src:.venv/oracles lowbit audit` adds these rows). Each row
runs torchao's own `F.linear` implementation for its quantized weight tensor:
- int8 W8A8 (torchao's Int8DynamicActivationInt8WeightConfig kernel: Int8Tensor, per-row
  int8 activations, int_scaled_matmul then the weight scale): built from lowbit's codes and
  scales, with lowbit's per-token activation scales given as the tensor's activation scale
  (torchao's own int8 rule, amax / 127.5 over [-128, 127], is not one of lowbit's schemes:
  requantizing would only show that difference, not the kernel's arithmetic);
- int8 weight-only (Int8WeightOnlyConfig's kernel): float activations x int8 codes, then the scale;
- fp8 weight-only (Float8WeightOnlyConfig's Float8Tensor, per-row e4m3 scales);
- fp8 W8A8 row-wise (Float8DynamicActivationFloat8WeightConfig's Float8Tensor, torch
  kernel preference, with and without fast accumulation): torchao quantizes the float
  activations itself (amax / 448 per row, lowbit's fp8 token rule), so this row also checks
  its activation quantizer. torchao's config refuses CPUs; its tensor runs there through
  torch._scaled_mm's CPU kernel.
A row torchao cannot run here is n/a with torchao's reason.

The GEMMs under these rows take only some shapes: torch._scaled_mm (cuBLASLt's fp8 GEMM, and
the CPU kernel of some builds) K and N multiples of 16, torch._int_mm on CUDA M > 16 and K, N
multiples of 8. The adapters pad as a caller must (torchao's own pad_inner_dim for the fp8 K;
zero codes with unit scales elsewhere): exact, since padded products are zero, and the padded
rows and columns are sliced off before the check.
"""
from __future__ import annotations

import importlib.util

import torch

import lowbit as lb
from lowbit.verify.kernel_spec import KernelSpec, int_mm_shape, padded, round_up


def available() -> bool:
    """torchao can be imported (without importing it)."""
    return importlib.util.find_spec("torchao") is not None


def _quiet_import():
    """Import the torchao pieces the rows use. torchao prints warnings about its optional
    CUDA extensions on import; they say nothing about these rows."""
    import logging
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            from torchao.float8.inference import Float8MMConfig
            from torchao.quantization.granularity import PerRow
            from torchao.quantization.quantize_.common import KernelPreference
            from torchao.quantization.quantize_.workflows.float8.float8_tensor import (
                Float8Tensor, QuantizeTensorToFloat8Kwargs)
            from torchao.quantization.quantize_.workflows.int8.int8_tensor import (
                Int8Tensor, QuantizeTensorToInt8Kwargs)
        finally:
            logging.disable(level)
    return dict(Float8MMConfig=Float8MMConfig, PerRow=PerRow, KernelPreference=KernelPreference,
                Float8Tensor=Float8Tensor, QuantizeTensorToFloat8Kwargs=QuantizeTensorToFloat8Kwargs,
                Int8Tensor=Int8Tensor, QuantizeTensorToInt8Kwargs=QuantizeTensorToInt8Kwargs)


def _rows(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A per-row fp32 scale as torchao's [n, 1] (a tensor-wise one expanded)."""
    return scale.reshape(-1, 1).float().expand(n, 1).contiguous()


def _pad_bias(bias, n: int):
    return None if bias is None else torch.cat([bias, bias.new_zeros(n - bias.shape[0])])


def _int8_weight(ao, codes, scale, act_kwargs=None, act_scale=None):
    N, K = codes.shape
    return ao["Int8Tensor"](codes.contiguous(), scale, [1, K], torch.float32,
                            act_quant_scale=act_scale, act_quant_kwargs=act_kwargs)


def int8_w8a8(xq, wq, bias):
    """torchao's int8 x int8 linear on lowbit's codes and scales (x as its float values on
    lowbit's grid, which torchao's quantizer maps back to the same codes with the given scales)."""
    ao = _quiet_import()
    (M, K), N = xq.codes.shape, wq.codes.shape[0]
    Mp, Kp, Np = int_mm_shape(M, K, N, xq.codes.device)
    w = _int8_weight(ao, padded(wq.codes, Np, Kp), padded(_rows(wq.scale, N), Np, 1, 1.0),
                     ao["QuantizeTensorToInt8Kwargs"](granularity=ao["PerRow"]()),
                     padded(_rows(xq.scale, M), Mp, 1, 1.0))
    return torch.nn.functional.linear(padded(xq.dequantize(), Mp, Kp), w, _pad_bias(bias, Np))[:M, :N]


def int8_weight_only(x, wq, bias):
    """torchao's float x int8 linear (x unquantized, float32)."""
    N = wq.codes.shape[0]
    return torch.nn.functional.linear(x, _int8_weight(_quiet_import(), wq.codes, _rows(wq.scale, N)), bias)


def _fp8_weight(ao, wq, act_kwargs=None, fast=False, n_pad: int | None = None):
    """torchao's Float8Tensor of lowbit's codes and row scales; n_pad: rows padded with zero codes
    (unit scales) to that count, for torch._scaled_mm's N multiple of 16."""
    N, K = wq.codes.shape
    Np = n_pad or N
    codes = padded(wq.codes.view(torch.uint8), Np, K).view(torch.float8_e4m3fn)
    mm = ao["Float8MMConfig"](use_fast_accum=fast, pad_inner_dim=n_pad is not None)
    return ao["Float8Tensor"](codes, padded(_rows(wq.scale, N), Np, 1, 1.0), [1, K],
                              mm_config=mm, act_quant_kwargs=act_kwargs,
                              kernel_preference=ao["KernelPreference"].TORCH, dtype=torch.float32)


def fp8_weight_only(x, wq, bias):
    """torchao's float x fp8 (per-row scales) linear."""
    return torch.nn.functional.linear(x, _fp8_weight(_quiet_import(), wq), bias)


def fp8_w8a8(fast: bool):
    def fn(x, wq, bias):
        """torchao quantizes x (float) per row itself, then torch._scaled_mm: K padded by
        torchao (pad_inner_dim: zero columns leave each row's amax, so its scale, unchanged),
        N by zero weight rows sliced off."""
        ao = _quiet_import()
        N = wq.codes.shape[0]
        Np = round_up(N, 16)
        act = ao["QuantizeTensorToFloat8Kwargs"](granularity=ao["PerRow"](),
                                                 mm_config=ao["Float8MMConfig"](use_fast_accum=fast,
                                                                                pad_inner_dim=True),
                                                 kernel_preference=ao["KernelPreference"].TORCH)
        w = _fp8_weight(ao, wq, act, fast, n_pad=Np)
        try:
            return torch.nn.functional.linear(x, w, _pad_bias(bias, Np))[..., :N]
        except RuntimeError as e:
            if x.device.type == "cpu" and "per-tensor scaling for CPU" in str(e):
                # a documented limit of this torch build's CPU fp8 GEMM, not a finding about torchao
                raise NotImplementedError(f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor "
                                          "scales only; torchao's row-wise fp8 runs on CUDA here") from e
            raise
    return fn


def specs(device: str) -> list:
    """The torchao rows of `lowbit audit` for this device (empty when torchao is absent)."""
    if not available():
        return []
    P = lb.get_preset
    fp8_token = lb.QuantScheme("fp8_e4m3fn", "token", dynamic=True)
    rows = [KernelSpec("torchao int8 W8A8 (Int8Tensor)", P("int8_token"), P("int8_channel"), int8_w8a8, "int32",
                       note="torchao's int_scaled_matmul kernel on lowbit's codes and scales"),
            KernelSpec("torchao int8 weight-only (Int8Tensor)", None, P("int8_channel"), int8_weight_only, "fp32",
                       note="float32 x int8 codes, then the per-channel scale"),
            KernelSpec("torchao fp8 weight-only (Float8Tensor)", None, P("fp8_row"), fp8_weight_only, "fp32",
                       note="float32 x e4m3 with per-row scales")]
    for fast in ((False, True) if device == "cuda" else (False,)):
        tag = "fast accumulation" if fast else "fp32 accumulation"
        rows.append(KernelSpec(f"torchao fp8 W8A8 rowwise, {tag} (Float8Tensor)", fp8_token, P("fp8_row"),
                               fp8_w8a8(fast), "fp32", float_x=True,
                               note="torchao quantizes the activations itself (amax/448 per row), "
                                    "then torch._scaled_mm"))
    return rows
