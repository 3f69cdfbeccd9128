"""8-bit dense kernels of the prepared path: W8A8 (int8, fp8 row-wise) and W8A16 (+ its bf16 path).

  triton_w8a8_int8   int8 activations (per token: the one-pass Triton quantizer, symmetric or with
                     zero points; per tensor / static: lowbit.quantize's arithmetic) x int8 weights per
                     channel / tensor -> the int8 GEMM with the scale epilogue fused
  triton_w8a8_fp8    the same with fp8 e4m3 codes (symmetric activations) -> the fp8 GEMM
  scaled_mm_w8a8_fp8 its prefill paths where the tuning table says so: the same quantizer, then
  cutlass_w8a8_fp8   torch._scaled_mm row-wise / lowbit's CUTLASS row-wise GEMM (same epilogue order)
  triton_w8a16       int8 or fp8 e4m3 weights per channel / tensor, float activations -> the W8A16
                     kernel (the codes converted to x's dtype in the tile: exact for both)
  dequant_w8a16      its bf16 path where the tuning table says so (large M): each weight rounded once
                     to x's dtype from its fp32 product code * scale into a reusable buffer, then the
                     bf16 GEMM (fp32 accumulation), the bias added in fp32
"""
from __future__ import annotations

import torch

from lowbit.ops import bound
from lowbit.ops.kernels.prepared_kernel import Prepared, PreparedKernel, act_json, row_vector
from lowbit.ops.kernels.schemes import per_row_fp32, weight_only_refusal
from lowbit.ops.float_gemm import bf16_gemm
from lowbit.ops.native.library import prefill_unavailable_reason
from lowbit.ops.native.prefill import fp8_rowwise_gemm
from lowbit.ops.scratch import scratch
from lowbit.quantize import quantize, quantize_static

# per-token activation modes the one-launch decode path (lowbit.ops.triton.gemm_w8a8_small) quantizes itself
FUSED_MODES = ("int8", "fp8_e4m3fn")


def quantize_tensor_int8(xf: torch.Tensor, qmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-tensor int8 of float32 xf on its device, lowbit.quantize's arithmetic
    without a host synchronisation: s = amax / qmax (IEEE division by the device tensor qmax, float32
    [1]; a zero amax gives s = 1), codes = clamp(rint(xf / s), -qmax, qmax). Returns (int8 codes, s [1])."""
    s = xf.abs().amax().reshape(1) / qmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    codes = torch.maximum(torch.minimum(torch.round(xf / s), qmax), -qmax).to(torch.int8)
    return codes, s


def _weight_8bit(layer, fmt: str) -> str | None:
    """Why an 8-bit kernel refuses the weight (None: `fmt` codes, symmetric, one fp32 scale per
    channel or tensor)."""
    ws = layer.weight
    if ws.format != fmt:
        return f"the weight is {ws.format}, this kernel reads {fmt} codes"
    if not per_row_fp32(ws) or ws.strategy == "token":
        return (f"the weight has {ws.strategy} {ws.scale_format} scales; this kernel takes one fp32 scale per "
                "output channel or per tensor")
    if not ws.symmetric:
        return "the weight has zero points; this kernel takes symmetric weights"
    return None


class _W8A8(PreparedKernel):
    kind = "w8a8"
    fmt = ""
    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    @classmethod
    def refuses(cls, layer):
        xs = layer.act
        if xs is None:
            return "weight-only layer: this kernel quantizes the activations"
        if xs.format != cls.fmt or not per_row_fp32(xs):
            return (f"the activations are {xs.format} {xs.strategy} ({xs.scale_format} scales); this kernel takes "
                    f"{cls.fmt} with one fp32 scale per token or tensor")
        return _weight_8bit(layer, cls.fmt)

    @classmethod
    def prepare(cls, weight_q, act_scheme, static_scale):
        N, K = int(weight_q.shape[0]), int(weight_q.shape[1])
        fp8 = cls.fmt == "fp8_e4m3fn"
        codes = weight_q.codes.contiguous()
        t = {"w": codes.view(torch.float8_e4m3fn) if fp8 else codes.to(torch.int8),
             "w_scale": row_vector(weight_q.scale, N)}
        per_token = act_scheme.strategy in ("token", "channel") and static_scale is None
        if per_token:
            mode = "fp8_e4m3fn" if fp8 else ("int8" if act_scheme.symmetric else "int8_asym")
        else:
            mode = "scheme"
            if static_scale is not None:
                t["act_scale"] = static_scale.detach().float().reshape(1).clone()
            elif act_scheme.format == "int8" and act_scheme.symmetric:
                # the divisor as a device tensor: `t / python_float` on CUDA multiplies by the
                # reciprocal (quantize._div), which is not lowbit.quantize's IEEE division
                t["act_qmax"] = torch.tensor(float(act_scheme.fmt.qmax), dtype=torch.float32,
                                             device=codes.device)
        if not fp8:
            from lowbit.ops.triton.gemm_int8 import check_int8_k    # optional: triton

            check_int8_k(K, asymmetric=not act_scheme.symmetric)
            if not act_scheme.symmetric:
                t["w_colsum"] = codes.to(torch.int8).sum(dim=1, dtype=torch.int32)
        return Prepared(cls.spec("w8a8", N, K, t, act_mode=mode, act=act_json(act_scheme)), t)

    @classmethod
    def graph_safe(cls, spec):
        # per-tensor activations other than symmetric int8 go through lowbit.quantize (host checks)
        return spec.act_mode != "scheme" or "act_qmax" in spec.operands

    @staticmethod
    def apply(spec, x2, ops, bias, config):
        return _w8a8(spec, x2, ops, bias, config)


def _w8a8(spec, x2, ops, bias, config, prefill: str | None = None):
    """The W8A8 call: the activations quantized (per token: the one-pass Triton quantizer; per tensor:
    _quantize_whole), then lowbit's GEMM under the table's tiles, or (prefill "scaled_mm" / "cutlass", fp8 per-token
    codes only: _prefill_fp8_ok) torch._scaled_mm row-wise / lowbit's CUTLASS row-wise GEMM on the same codes."""
    M = x2.shape[0]
    if M == 0:
        return torch.empty((M, spec.N), dtype=x2.dtype, device=x2.device)
    from lowbit.ops.triton import act_quant, gemm_fp8, gemm_int8, gemm_w8a8_small    # optional: triton

    if config is not None and config.get("FUSED_QUANT"):
        # the table's one-launch path at decode sizes: the same codes and epilogue, bit for bit; its tiles are
        # not the two-launch GEMM's, which takes its defaults where the fused kernel cannot run
        if spec.act_mode in FUSED_MODES and M <= gemm_w8a8_small.MAX_M:
            out = torch.empty((M, spec.N), dtype=x2.dtype, device=x2.device)
            return gemm_w8a8_small.launch_w8a8_small(x2, ops["w"], out, ops["w_scale"], bias, config)
        config = None
    if spec.act_mode == "scheme":
        q, s, z = _quantize_whole(spec, x2, ops)
    else:
        q, s, z = act_quant.launch_act_quant(x2, spec.act_mode)
    if prefill == "scaled_mm":
        return torch._scaled_mm(q.view(torch.float8_e4m3fn), ops["w"].t(), scale_a=s.reshape(-1, 1),
                                scale_b=ops["w_scale"].reshape(1, -1), bias=bias, out_dtype=x2.dtype,
                                use_fast_accum=False)
    if prefill == "cutlass":
        bound.note_unrecordable("lowbit's CUTLASS prefill GEMM (a ctypes launch)")
        return fp8_rowwise_gemm(q, ops["w"], s, ops["w_scale"], bias, config=int(config["config"]))
    # W8A8 has its kernel at every M; the table picks its tiles
    out = torch.empty((M, spec.N), dtype=x2.dtype, device=x2.device)
    if ops["w"].dtype == torch.float8_e4m3fn:
        return gemm_fp8.launch_fp8_gemm(q.view(torch.float8_e4m3fn), ops["w"], out, s, ops["w_scale"], bias,
                                        config=config)
    return gemm_int8.launch_int8_gemm(q, ops["w"], out, s, ops["w_scale"], z, ops.get("w_colsum"), bias,
                                      config=config)


class TritonW8A8Int8(_W8A8):
    name = "triton_w8a8_int8"
    fmt = "int8"
    min_capability = (7, 5)
    summary = "int8 x int8 Triton GEMM, scale epilogue fused (int32 accumulation)"


class TritonW8A8Fp8(_W8A8):
    name = "triton_w8a8_fp8"
    fmt = "fp8_e4m3fn"
    min_capability = (8, 9)
    summary = "fp8 e4m3 x fp8 e4m3 Triton GEMM, row-wise scales fused (fp32 accumulation)"

    @classmethod
    def refuses(cls, layer):
        why = super().refuses(layer)
        if why is None and not layer.act.symmetric:
            return "the activations have zero points; fp8 activations are symmetric"
        return why


def _prefill_fp8_ok(spec, x2) -> bool:
    """Whether a prefill alternative of the fp8 class takes this call: per-token activations (one scale per
    row), 16-bit rows on a GPU, N and K multiples of 16 (the row-wise CUTLASS kernels' alignment)."""
    return spec.act_mode == "fp8_e4m3fn" and x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16) \
        and spec.N % 16 == 0 and spec.K % 16 == 0


class ScaledMMW8A8Fp8(TritonW8A8Fp8):
    """torch._scaled_mm's row-wise fp8 GEMM (promoted accumulation: use_fast_accum=False) after the same per-token
    quantizer. PyTorch's row-wise CUTLASS kernel rounds in the Triton kernel's order, bf16(((acc * sa[m]) * sw[n]) +
    bias[n]) in float32 (read in ATen's RowwiseScaledMM.cu), so only the order of the tensor-core sums differs;
    whichever backend this torch picks, tests/ops/test_fp8_prefill_paths.py holds it to the float64 gate on the GPU.
    A prefill path the tuning table picks where it beats the Triton GEMM; calls it does not take run the Triton
    class."""
    name = "scaled_mm_w8a8_fp8"
    summary = "per-token fp8 activations, then torch._scaled_mm row-wise (a tuning-table prefill path)"

    @classmethod
    def usable(cls) -> str | None:
        return None if hasattr(torch, "_scaled_mm") else f"torch {torch.__version__} has no torch._scaled_mm"

    @staticmethod
    def apply(spec, x2, ops, bias, config):
        return _w8a8(spec, x2, ops, bias, None, "scaled_mm" if _prefill_fp8_ok(spec, x2) else None)


class CutlassW8A8Fp8(TritonW8A8Fp8):
    """lowbit's own CUTLASS row-wise fp8 GEMM (lowbit.ops.native.prefill, sm_90a, built ahead of time) after the
    same per-token quantizer, under the table's tile configuration (config {"config": i}, one of the precise
    ROWWISE_CONFIGS: partial sums promoted every 128 products); the same epilogue order as the Triton kernel.
    A prefill path the tuning table picks; bf16 rows only (the library writes bf16), others run the Triton class."""
    name = "cutlass_w8a8_fp8"
    summary = "per-token fp8 activations, then lowbit's CUTLASS row-wise GEMM (a tuning-table prefill path)"

    @classmethod
    def usable(cls) -> str | None:
        return prefill_unavailable_reason()

    @staticmethod
    def apply(spec, x2, ops, bias, config):
        ok = _prefill_fp8_ok(spec, x2) and x2.dtype == torch.bfloat16 and config is not None and "config" in config
        return _w8a8(spec, x2, ops, bias, config if ok else None, "cutlass" if ok else None)


# the tuning table's prefill paths of the fp8 class (lowbit.ops.tuning.PATHS)
TritonW8A8Fp8.alternatives = {"scaled_mm": ScaledMMW8A8Fp8, "cutlass": CutlassW8A8Fp8}


def _quantize_whole(spec, x2, ops):
    """Per-tensor activations (dynamic or a static calibrated scale) by lowbit.quantize's
    arithmetic; returns codes [M, K], a stride-0 fp32 scale vector [M], zero points or None.
    Symmetric int8 (the recipes' case) stays on the device: amax, s = amax / 127 (IEEE, a zero
    amax gives s = 1), codes = clamp(rint(x / s), -127, 127) -- no host synchronisation, so
    the call can be graph-captured; other schemes go through lowbit.quantize."""
    scheme = spec.act_scheme
    M = x2.shape[0]
    xf = x2.float()
    if "act_scale" in ops:
        codes, s, _ = quantize_static(xf, scheme, ops["act_scale"].reshape(1, 1))
        return codes, s.reshape(1).expand(M), None
    if "act_qmax" in ops:
        codes, s = quantize_tensor_int8(xf, ops["act_qmax"])
        return codes, s.expand(M), None
    qt = quantize(xf, scheme, nan_policy="propagate")
    z = None if qt.zero_point is None else qt.zero_point.reshape(1).to(torch.int32).expand(M)
    return qt.codes, qt.scale.reshape(1).expand(M), z


class TritonW8A16(PreparedKernel):
    name = "triton_w8a16"
    kind = "w8a16"
    min_capability = (8, 0)
    summary = "8-bit weights converted to x's dtype in the tile (exact), bf16/fp16 MMA"

    @classmethod
    def refuses(cls, layer):
        why = weight_only_refusal(layer)
        if why:
            return why
        ws = layer.weight
        if ws.format not in ("int8", "fp8_e4m3fn"):
            return f"the weight is {ws.format}; this kernel reads int8 or fp8 e4m3 codes"
        return _weight_8bit(layer, ws.format)

    @classmethod
    def prepare(cls, weight_q, act_scheme, static_scale):
        N, K = int(weight_q.shape[0]), int(weight_q.shape[1])
        codes = weight_q.codes.contiguous()
        w = codes.view(torch.float8_e4m3fn) if weight_q.scheme.format == "fp8_e4m3fn" else codes.to(torch.int8)
        t = {"w": w, "w_scale": row_vector(weight_q.scale, N)}
        return Prepared(cls.spec("w8a16", N, K, t), t)

    @classmethod
    def graph_safe(cls, spec):
        return True

    @staticmethod
    def apply(spec, x2, ops, bias, config):
        from lowbit.ops.triton.w8a16 import w8a16_gemm    # optional: triton

        return w8a16_gemm(x2, ops["w"], ops["w_scale"], bias)


class DequantW8A16(TritonW8A16):
    name = "dequant_w8a16"
    summary = "weight rounded once to x's dtype into a scratch buffer, then the bf16 GEMM"

    @staticmethod
    def apply(spec, x2, ops, bias, config):
        from lowbit.ops.triton.dequant import dequantize_rows    # optional: triton

        w = dequantize_rows(ops["w"], ops["w_scale"], scratch((spec.N, spec.K), x2.dtype, x2.device))
        return bf16_gemm(x2, w, bias, x2.dtype)


TritonW8A16.dequant = DequantW8A16
DequantW8A16.dequant = None
