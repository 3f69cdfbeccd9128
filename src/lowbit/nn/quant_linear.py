"""QuantLinear: a Linear layer whose weight is stored quantized and whose input is quantized
on every call by an activation scheme (dynamic per token / group / MX block, or one static
calibrated scale per tensor).

Execution paths, chosen per call and recorded in `last_path` (eager calls only: under
torch.compile the module's attributes are not written):
- "fast:<kind>"  the prepared runtime (lowbit.ops.prepared): CUDA, or backend="kernel" in
                 Triton's CPU interpreter, for bf16 / fp16 inputs (fp32 too for W8A8). The
                 kernel operands were laid out once, at construction (buffers `fast_*`, moved
                 by `.to()`); the call only launches kernels: no checks, no host sync, no
                 float32 round trip, output in x's dtype. check=True turns it off (the exact
                 path below then checks NaN/Inf and shapes on every call).
- "int8-intmm"   int8 symmetric activations x int8 symmetric weights on the CPU: the exact
                 integer accumulator, then the epilogue y = float32(acc) * s_x * s_w (+ bias),
                 as an integer GEMM does. The accumulator is a float64 matmul of the codes
                 on the CPU (every product <= 127^2 < 2^14 and every partial sum < 2^53 for
                 K < 2^39, so it is the exact integer: bit-identical to torch._int_mm's int32,
                 ~50x faster than CPU _int_mm), torch._int_mm on CUDA.
- "kernel"       CUDA, schemes the prepared runtime does not cover: `lowbit.ops.linear`.
- "dequantized"  every other case (fp8, MX, NVFP4 and weight-only recipes on the CPU): both
                 operands are dequantized to float32 by `QTensor.dequantize` and multiplied in
                 float32 -- the emulation of the quantized arithmetic, not a different
                 quantization. The dequantized weight is made per call, never kept.
On CUDA a scheme no kernel supports runs the dequantized path with a one-time warning and
`last_path == "dequantized"` (never silently).

Memory: the prepared operands are the weight's only copy on the GPU (8-bit codes are shared
with `weight_q`; for 4-bit weights, packed two per byte, `weight_q` -- the exact twin that
verification and checkpoints read -- is kept on the host, unless host_twin=False).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F

from lowbit.ops import prepared as runtime
from lowbit.ops.kernels import Choice, LinearLayer, choose_linear, kernel_device
from lowbit.ops.kernels.exact import ExactDequantized, ExactInt8, QTensorGemm
from lowbit.ops.kernels.schemes import have_triton
from lowbit.ops.linear import linear as ops_linear
from lowbit.quantize import QTensor, quantize, quantize_static
from lowbit.scheme import QuantScheme

_BACKENDS = ("auto", "dequantized", "int8-intmm", "kernel")


class QuantLinear(torch.nn.Module):
    """y = dequant(quant_act(x)) @ dequant(weight_q).T + bias, with x: [..., in_features] and
    y: [..., out_features] in x's dtype.

    Attributes: `in_features`, `out_features`, `weight_q` (QTensor of the [N, K] weight),
    `weight_scheme`, `act_scheme` (None: weight-only, inputs stay float), `bias` (Parameter or
    None), `act_static_scale` (float32 [1, 1] buffer or None: one calibrated activation scale),
    `kernel_choice` (lowbit.ops.kernels.Choice: the kernel class this layer got on the kernel device and
    why each one ahead of it was refused; None for backend "dequantized" / "int8-intmm").
    """

    def __init__(self, weight_q: QTensor, weight_scheme: QuantScheme, act_scheme: QuantScheme | None,
                 bias: torch.Tensor | None = None, act_static_scale: torch.Tensor | None = None,
                 backend: str = "auto", check: bool = False, host_twin: bool = True):
        super().__init__()
        if len(weight_q.shape) != 2:
            raise ValueError(f"weight_q must hold a 2-D [out_features, in_features] weight, got shape {tuple(weight_q.shape)}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend={backend!r}; choose one of {_BACKENDS}")
        self.out_features, self.in_features = int(weight_q.shape[0]), int(weight_q.shape[1])
        self.weight_q = weight_q
        self.weight_scheme = weight_scheme
        self.act_scheme = act_scheme
        self.backend = backend
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        if act_static_scale is not None:
            _check_static(act_scheme, act_static_scale)
            self.register_buffer("act_static_scale", act_static_scale.detach().float().reshape(1, 1).clone())
        else:
            self.act_static_scale = None
            if act_scheme is not None and not act_scheme.dynamic:
                raise ValueError("act_scheme has dynamic=False but no act_static_scale was given: calibrate one "
                                 "(lowbit.algorithms.static_scales.calibrate_static_scales) or use a dynamic scheme")
        self._cache: dict = {}
        # what the kernels decide on (lowbit.ops.kernels): schemes, shape, padding, a static scale
        self._layer = LinearLayer(weight_scheme, act_scheme, self.out_features, self.in_features,
                                  bool(weight_q.padded), act_static_scale is not None)
        self.check = check
        # 4-bit fast paths: whether `weight_q` (the exact twin of the packed kernel codes) moves to
        # the host (default); False keeps it where it is (a caller that writes the codes from the
        # device, or never reads them: lowbit.pipelines.layerwise's GPTQ)
        self.host_twin = host_twin
        self.last_path: str | None = None
        self._warned = False
        # Clipping statistics of the static scale (calibration.clipping_report reads them).
        self.track_clipping = False
        self.clip_stats = {"clipped": 0, "seen": 0, "max_ratio": 0.0}
        self._prepare()

    def _prepare(self) -> None:
        """Ask the kernels in preference order (lowbit.ops.kernels.choose_linear) and lay out the
        chosen prepared kernel's operands once. `kernel_choice` records the kernel this layer got on
        the kernel device and why the ones ahead of it were refused; a layer no prepared kernel takes
        leaves `fast_spec` None and every call runs the exact path."""
        self.fast_spec: runtime.Spec | None = None
        self.kernel_choice: Choice | None = None
        if self.backend not in ("auto", "kernel"):
            return
        if not have_triton() and self.backend == "kernel":
            raise ValueError("backend='kernel' runs Triton kernels, and triton is not installed: "
                             "pip install 'lowbit[gpu]', or use backend='auto'")
        choice = choose_linear(self.weight_q, self.act_scheme, self.act_static_scale)
        # the record keeps the kernel and the refusals, not the laid-out tensors: those live as
        # buffers (moved by .to(), dropped when a shared-input group takes the layer's operands);
        # a second reference here held every merged layer's weight twice on the GPU
        self.kernel_choice = dataclasses.replace(choice, prepared=None)
        prep = choice.prepared
        if prep is None:
            return
        for name, t in prep.tensors.items():
            self.register_buffer("fast_" + name, t, persistent=False)
        self.fast_spec, self._fast_json = prep.spec, prep.spec.to_json()
        self._fast_names = tuple("fast_" + n for n in prep.spec.operands)   # read on every call
        self._fast_dtypes = runtime.input_dtypes(prep.spec)   # derived once, read on every call
        self._fast_path_name = "fast:" + prep.spec.kind
        self._graphs = runtime.GraphCache()
        if prep.spec.kind in ("w4a16", "fp4") and self.host_twin:
            # the packed codes are the GPU's copy; the exact twin (one code per byte) stays on the host
            self.weight_q = self.weight_q.to("cpu")

    def attach_shared(self, shared, start: int, stop: int) -> None:
        """Serve this layer's fast path from columns [start, stop) of a SharedGEMM
        (lowbit.nn.shared_input): its own kernel operands are dropped, and 8-bit codes of
        `weight_q` become a view of the shared copy, so the weight is held once."""
        object.__setattr__(self, "_shared", (shared, start, stop))
        own_w = self._buffers.get("fast_w")
        for n in [n for n in self._buffers if n.startswith("fast_")]:
            del self._buffers[n]
        if own_w is not None and self.weight_q.codes.device == own_w.device:
            codes = shared.fast_w[start:stop].view(self.weight_q.codes.dtype)
            self.weight_q = dataclasses.replace(self.weight_q, codes=codes)

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the prepared operands; `.to(dtype)` / `.half()` never convert them
        (fp8 codes and fp32 scales are the kernel's format, not the model's dtype): each
        fast_* buffer goes only where fn sends a probe of its own dtype."""
        fast = {n: b for n, b in self._buffers.items() if n.startswith("fast_") and b is not None}
        if hasattr(self, "_graphs"):
            self._graphs.clear()  # captured graphs hold the old device pointers
        for n in fast:
            del self._buffers[n]
        try:
            out = super()._apply(fn, recurse)
        finally:
            for n, b in fast.items():
                dev = fn(torch.empty(0, dtype=b.dtype, device=b.device)).device
                self._buffers[n] = b.to(dev)
        return out

    def _fast_ok(self, x: torch.Tensor) -> bool:
        return (self.fast_spec is not None and not self.check and not self.track_clipping
                and (x.is_cuda or self.backend == "kernel")
                and x.dtype in self._fast_dtypes)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, weight_scheme: QuantScheme, act_scheme: QuantScheme | None = None,
                    *, act_static_scale: torch.Tensor | None = None, backend: str = "auto",
                    pad: bool = False, scales=None) -> "QuantLinear":
        """Quantize `linear.weight` [N, K] with `weight_scheme` (scales along K); keep the bias in
        float32. pad=True lets K be a non-multiple of the group size: the last group is shorter
        (zero-padded, zeros never raise its amax; weight_q.codes then has the padded width).
        Raises ValueError on a non-Linear module, NaN/Inf weights or (pad=False) a K that the
        group size does not divide. scales: lowbit.quantize.Scales to quantize the weight with
        (e.g. lowbit.algorithms.scale_search's) instead of the ones it would give."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if not torch.isfinite(w).all():
            bad = int((~torch.isfinite(w)).sum())
            raise ValueError(f"linear.weight holds {bad} NaN/Inf values: fix the checkpoint before quantizing "
                             "(a scale computed from them would poison the whole row)")
        if weight_scheme.dynamic:
            raise ValueError("weight_scheme must be static (dynamic=False): weights are quantized once")
        wq = quantize(w.float(), weight_scheme, pad=pad, scales=scales)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(wq, weight_scheme, act_scheme, bias=bias, act_static_scale=act_static_scale, backend=backend)

    def extra_repr(self) -> str:
        a = "none (weight-only)" if self.act_scheme is None else _describe(self.act_scheme)
        if self.act_static_scale is not None:
            a += f", static scale {float(self.act_static_scale):.4g}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight={_describe(self.weight_scheme)}, act={a}, bias={self.bias is not None}")

    # ------------------------------------------------------------------ cached operands
    def _weight_operand(self, kind: str, device: torch.device) -> torch.Tensor:
        """The weight in the form a path needs: "codes_t" (int8 [K, N], a transposed view, no
        copy), "scale_row" (float32 [1, N]), "deq" (float32 [N, K], made per call and never
        kept: a cached float copy would hold 2-8x the quantized weight's bytes)."""
        if kind == "deq":
            return self.weight_q.dequantize(torch.float32).to(device)
        key = (kind, str(device))
        if key not in self._cache:
            if kind == "codes_t":
                val = self.weight_q.codes.to(device=device, dtype=torch.int8).t()  # [K, N]
            else:
                val = self.weight_q.scale.to(device=device, dtype=torch.float32).reshape(1, self.out_features)
            self._cache[key] = val
        return self._cache[key]

    def weight_dequantized(self) -> torch.Tensor:
        """The dequantized weight, float32 [out_features, in_features] (what the layer multiplies by)."""
        return self.weight_q.dequantize(torch.float32)

    # ------------------------------------------------------------------ activations
    def quantize_input(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize a float32 [M, K] input by the activation scheme. Returns (codes, scale, deq):
        codes as QTensor.codes, scale broadcastable to [M, K] groups, deq float32 [M, K]."""
        if self.act_static_scale is not None:
            s = self.act_static_scale.to(x2d.device)
            if self.track_clipping:
                # what the quantizer sees: |x / s| beyond fmt.max saturates
                ratio = (x2d / s).abs() / self.act_scheme.fmt.max
                self.clip_stats["clipped"] += int((ratio > 1).sum())
                self.clip_stats["seen"] += ratio.numel()
                self.clip_stats["max_ratio"] = max(self.clip_stats["max_ratio"], float(ratio.max()))
            return quantize_static(x2d, self.act_scheme, s)
        # pad=True: an MX/group width that does not divide K gets a short last group, as the weight does.
        qt = quantize(x2d, self.act_scheme, pad=True)
        return qt.codes, qt.scale, qt.dequantize(torch.float32)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input's last dimension is {x.shape[-1]}, this layer expects in_features={self.in_features}")
        lead = x.shape[:-1]
        if self._fast_ok(x):
            x2 = x.reshape(-1, self.in_features)
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            shared = self.__dict__.get("_shared")
            if shared is not None:
                y = shared[0].output(x, x2)[:, shared[1]:shared[2]]
            else:
                # buffers and the bias read from their dicts: nn.Module.__getattr__ costs ~1 us each
                # on a decode call's host path
                bufs = self._buffers
                y = runtime.forward(self.fast_spec, self._fast_json, x2, [bufs[n] for n in self._fast_names],
                                    self._parameters.get("bias"), self._graphs)
            if not torch.compiler.is_compiling():
                self.__dict__["last_path"] = self._fast_path_name   # a plain attribute (not a tensor)
            return y.reshape(*lead, self.out_features)
        x2d = x.reshape(-1, self.in_features).float()
        y, _ = self.forward_2d(x2d)
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def forward_2d(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 [M, K] in; returns (float32 output [M, N] with bias, the dequantized input
        [M, K] the layer actually multiplied, or None on the kernel path / weight-only)."""
        y, deq = self._matmul(x2d)
        if self.bias is not None:
            y = y + self.bias.to(y.device, torch.float32)
        return y, deq

    def _matmul(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.act_scheme is None:
            self.last_path = "dequantized"
            return ExactDequantized.apply(x2d, self._weight_operand("deq", x2d.device)), None
        int_ok = ExactInt8.refuses(self._layer) is None
        want = self.backend
        if want == "auto":
            want = "kernel" if x2d.is_cuda else ("int8-intmm" if int_ok else "dequantized")
        if want == "int8-intmm" and not int_ok:
            raise NotImplementedError(f"backend='int8-intmm' needs int8 symmetric per-token/tensor activations and "
                                      f"per-channel/tensor weights; this layer has act={_describe(self.act_scheme)}, "
                                      f"weight={_describe(self.weight_scheme)}")
        if want == "kernel":
            y = self._kernel(x2d)
            if y is not None:
                self.last_path = "kernel"
                return y, None
            want = "int8-intmm" if (int_ok and not x2d.is_cuda) else "dequantized"
        codes, scale, deq = self.quantize_input(x2d)
        if want == "int8-intmm":
            self.last_path = "int8-intmm"
            # epilogue: per-token scale [M, 1] (or [1, 1]) times per-channel scale [1, N]
            y = ExactInt8.apply(codes, scale, self._weight_operand("codes_t", x2d.device),
                                self._weight_operand("scale_row", x2d.device))
            return y, deq
        self.last_path = "dequantized"
        return ExactDequantized.apply(deq, self._weight_operand("deq", x2d.device)), deq

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor | None:
        """lowbit.ops.linear on the quantized operands; None (after one warning naming why) when no
        kernel covers this layer, so the caller runs the dequantized emulation. The choice is made
        by lowbit.ops.kernels (QTensorGemm.can_run) before the call: an error inside a kernel propagates."""
        why = QTensorGemm.can_run(self._layer, kernel_device())
        if why is not None:
            if not self._warned:
                warnings.warn(f"QuantLinear: no kernel for act={_describe(self.act_scheme)}, "
                              f"weight={_describe(self.weight_scheme)} ({why}); running the dequantized emulation",
                              stacklevel=3)
                self._warned = True
            return None
        xq = _quantize_activations(x2d, self.act_scheme)
        wq = self._cache.get(("wq", str(x2d.device)))
        if wq is None:
            wq = self.weight_q.to(x2d.device)
            self._cache[("wq", str(x2d.device))] = wq
        return ops_linear(xq, wq, bias=None, out_dtype=torch.float32).float()


def _check_static(act_scheme: QuantScheme | None, scale: torch.Tensor) -> None:
    if act_scheme is None:
        raise ValueError("act_static_scale given but act_scheme is None (weight-only): drop the static scale")
    if act_scheme.strategy != "tensor" or act_scheme.scale_format != "fp32":
        raise ValueError(f"act_static_scale needs a per-tensor fp32-scale act_scheme, got {_describe(act_scheme)}; "
                         "static scales for per-token/group schemes would freeze what dynamic scaling measures")
    if scale.numel() != 1 or not torch.isfinite(scale).all() or float(scale) <= 0:
        raise ValueError(f"act_static_scale must be one finite positive number, got {scale}")


def _describe(s: QuantScheme) -> str:
    g = f"/{s.group_size}" if s.strategy == "group" else ""
    sc = "" if s.scale_format == "fp32" else f", {s.scale_format} scales"
    return f"{s.format} {s.strategy}{g}{'' if s.symmetric else ' asym'}{sc}"


def linear_float(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The unquantized float32 output of an nn.Linear on x (helper for diagnostics)."""
    return F.linear(x.float(), module.weight.float(), None if module.bias is None else module.bias.float())


def _quantize_activations(x2d: torch.Tensor, scheme: QuantScheme):
    """The activation QTensor for the kernel path. On CUDA, per-row int8 / fp8 schemes use the
    one-pass Triton quantizer (bit-identical to lowbit.quantize; its CUDA tests compare them), which
    avoids lowbit.quantize's several full-tensor passes; every other case is lowbit.quantize."""
    if x2d.is_cuda:
        from lowbit.ops.triton.act_quant import quantize_tokens    # optional: triton
        try:
            return quantize_tokens(x2d.contiguous(), scheme)
        except NotImplementedError:  # a scheme the one-pass kernel does not cover: same scheme, exact path
            pass
    return quantize(x2d, scheme)
