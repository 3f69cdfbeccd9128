"""QuantExperts: the routed experts of one MoE block with per-expert quantized weights.

It replaces a family's experts module (transformers 5 keeps all experts of a block in fused
3-D parameters: gate_up [E, 2I, H] and down [E, H, I], or their transposes) and keeps its
forward contract, forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) ->
[T, H] in hidden_states' dtype, so the family's own block (router, shared experts) calls it
unchanged. The router is not part of it and stays in high precision.

Per expert e and projection p (gate_up, down): codes [N, K] and scales quantized by
lowbit.quantize with the weight scheme, exactly as QuantLinear quantizes an nn.Linear weight
(two-level schemes such as NVFP4 get one tensor scale per expert). They are stacked into
buffers `{p}_codes` [E, N, K], `{p}_scale` [E, N, G] (and `{p}_scale_codes`, `{p}_zero`,
`{p}_global` [E] where the scheme has them); `weight_q(p, e)` gives expert e's QTensor.

Exact path (every device): the tokens are sorted by expert (lowbit.ops.grouped.sort_tokens);
activations are quantized once per input by the activation scheme (the hidden states before
the gate_up GEMM, the whole sorted intermediate buffer before the down GEMM: per-token and
per-group scales are row-local, a per-tensor scale spans the concatenated buffer as a grouped
kernel's A operand does); each expert's block is the float64 reference
lowbit.ops.grouped.grouped_reference; the activation (silu(gate) * up, gpt-oss's clamped
swiglu) runs in float64; outputs are weighted by the routing weights and summed per token in
float64, then cast to hidden_states' dtype once.

Kernel path (CUDA with backend="auto", or backend="kernel" anywhere, e.g. Triton's CPU
interpreter): one grouped Triton launch per projection for all experts (lowbit.ops.grouped_run;
lowbit.ops.kernels.grouped's classes, asked in preference order, pick it): W8A8 int8 / fp8 (per-channel weights, per-token or
per-tensor activations), W8A16 int8, W4A16 int4 (groups, zero points) / MXFP4 / NVFP4 weights,
MXFP4 / NVFP4 activations and weights, MXFP8 (scales read through the SFA / SFB words). Its
weight operands are laid out once, when the module is built. The tokens are sorted on the device
(lowbit.ops.grouped.route: shapes fixed by T, top_k and E; one launch at decode sizes), so the path
does no host synchronisation and CUDA graphs / torch.compile capture it; it trusts the router's expert ids
(the exact path checks their range). With float32 hidden states everything runs in float32 (the
kernels' fp32 dots); with bf16 / fp16 hidden states the gate_up GEMM rounds its fp32 result to
that dtype once and the activation runs there (the down GEMM's input, on the tensor cores), the
down GEMM, routing weights and the sum per token run in float32 (in slot order,
lowbit.ops.grouped.combine: deterministic for any top_k). A scheme pair with no grouped
kernel runs the exact path, on CUDA with a one-time
warning. The weight-only kinds (W4A16, fp4, W8A16) also have a bf16 path per projection: the
experts' weights dequantized into one reusable bf16 buffer and torch._grouped_mm, which the tuning
table (or its heuristic: from 65 sorted rows, i.e. prefill) picks per number of sorted rows
(lowbit.ops.grouped_dequant). `last_path` says which ran ("exact", "kernel:<kind>",
"dequant:<kind>", or "<gate_up's>/<down's>:<kind>" when the projections differ; under
torch.compile "kernel:<kind>" names the op, which picks its path per call: `path_for`).

Memory: 8-bit kernels read the stacked codes themselves (one copy). 4-bit kernels read a packed
copy (two codes per byte); the stacked fields are then the exact twin that `weight_q`, the exact
path and checkpoints read, kept on the host (`.to("cuda")` leaves them there) unless
host_twin=False, so the device holds the 4-bit weight once.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from lowbit.ops.kernels.grouped import GroupedKernel, choose_grouped
from lowbit.ops.grouped import Routing, combine, grouped_reference, route, sort_tokens, take_rows
from lowbit.ops.grouped_run import grouped_forward, grouped_spec, prepare_grouped
from lowbit.options import Options
from lowbit.quantize import QTensor, quantize
from lowbit.scheme import QuantScheme

PROJECTIONS = ("gate_up", "down")
BACKENDS = ("auto", "exact", "kernel")
LAYOUTS = ("enk", "ekn")
GLU_SPLITS = ("chunk", "interleave")
ACTIVATIONS = ("act_fn", "gpt_oss")
_FIELDS = (("codes", "codes"), ("scale", "scale"), ("zero", "zero_point"), ("scale_codes", "scale_codes"))


@dataclass(frozen=True, kw_only=True)
class ExpertsLayout:
    """How a family's fused experts module stores and runs its experts (lowbit.archs.experts'
    ExpertsSpec is one per family).

    gate_up / down:           the module's fused weight attributes ([E, 2I, H] / [E, H, I] as "enk").
    layout:                   "enk" ([E, out, in]) or "ekn" ([E, in, out], e.g. gpt-oss).
    gate_up_bias / down_bias: the module's bias attributes ([E, 2I] / [E, H]), None: no bias.
    glu_split:                gate and up in gate_up's rows: "chunk" (first half gate) or "interleave".
    activation:               "act_fn" (act_fn(gate) * up, the module's own act_fn) or "gpt_oss"
                              (gpt-oss's clamped swiglu, with the module's alpha and limit)."""
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    layout: str = "enk"
    gate_up_bias: str | None = None
    down_bias: str | None = None
    glu_split: str = "chunk"
    activation: str = "act_fn"

    def __post_init__(self):
        if self.layout not in LAYOUTS or self.glu_split not in GLU_SPLITS or self.activation not in ACTIVATIONS:
            raise ValueError(f"{type(self).__name__}: layout {self.layout!r} / glu_split "
                             f"{self.glu_split!r} / activation {self.activation!r} not among {LAYOUTS} / {GLU_SPLITS} / "
                             f"{ACTIVATIONS}")


@dataclass(frozen=True, kw_only=True)
class ExpertsOptions(ExpertsLayout, Options):
    """QuantExperts' settings: the family's ExpertsLayout fields (lowbit.archs.experts'
    ExpertsSpec.module_kwargs() gives them with `family`), and

    family:    the family's name, for reports.
    name:      the module's name, for errors.
    backend:   "auto", "exact" or "kernel" (the module docstring).
    host_twin: keep the exact twin of packed 4-bit codes on the host (module docstring)."""
    family: str = ""
    name: str = "experts"
    backend: str = "auto"
    host_twin: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; choose one of {BACKENDS}")


def _as_enk(w: torch.Tensor, layout: str) -> torch.Tensor:
    """[E, N, K] (out, in) view of a fused expert weight stored as `layout`."""
    return w if layout == "enk" else w.transpose(1, 2)


class QuantExperts(torch.nn.Module):
    """Quantized routed experts (see the module docstring).

    Attributes: num_experts, hidden_dim (H), intermediate_dim (I), weight_scheme, act_scheme
    (None: weight-only), glu_split ("chunk" | "interleave"), activation ("act_fn" |
    "gpt_oss"), act_fn (the replaced module's activation, for "act_fn"), alpha / limit
    (gpt-oss), family, last_path ("exact"), kernel (the grouped kernel's kind, e.g. "int8", or None:
    the exact path), kernel_class (its lowbit.ops.kernels.grouped class), kernel_choice (which class the
    grouped registry chose and why the ones ahead of it were refused)."""

    def __init__(self, stacked: dict[str, dict], biases: dict[str, torch.Tensor | None], weight_scheme: QuantScheme,
                 act_scheme: QuantScheme | None, options: ExpertsOptions | None = None, *, act_fn=None,
                 alpha: float | None = None, limit: float | None = None, **changes):
        """stacked: {"gate_up" | "down": {field: [E, ...] buffer}}; biases: {projection: [E, N] or None};
        options: an ExpertsOptions or its fields as keywords (glu_split, activation, family, backend and
        host_twin are read here); act_fn / alpha / limit: the replaced module's activation."""
        super().__init__()
        o = ExpertsOptions.merge(options, changes, "QuantExperts")
        glu_split, activation, family, backend, host_twin = o.glu_split, o.activation, o.family, o.backend, o.host_twin
        self.backend = backend
        self.weight_scheme, self.act_scheme = weight_scheme, act_scheme
        self.glu_split, self.activation, self.family = glu_split, activation, family
        if activation == "act_fn" and act_fn is None:
            raise ValueError("activation='act_fn' needs the replaced module's act_fn")
        self.act_fn = act_fn
        self.alpha, self.limit = alpha, limit
        for p in PROJECTIONS:
            for field, _ in _FIELDS:
                t = stacked[p].get(field)
                self.register_buffer(f"{p}_{field}", t)
            self.register_buffer(f"{p}_global", stacked[p].get("global"))
            b = biases.get(p)
            self.register_buffer(f"{p}_bias", None if b is None else b.detach().float().clone())
        E, N2, H = self.gate_up_codes.shape
        self.num_experts, self.hidden_dim, self.intermediate_dim = int(E), int(H), int(N2) // 2
        self.last_path: str | None = None
        # the grouped kernel, or None where the exact twin runs every call (no grouped kernel for the
        # pair, or no Triton: the CPU-only install); kernel_choice says which and why the others were not
        self.kernel_choice = choose_grouped(weight_scheme, act_scheme, int(N2), int(H))
        k = self.kernel_choice.kernel
        self.kernel_class: type[GroupedKernel] | None = k if issubclass(k, GroupedKernel) else None
        self.kernel: str | None = None if self.kernel_class is None else self.kernel_class.kind   # e.g. "int8"
        self._kernel_path = None if self.kernel is None else "kernel:" + self.kernel
        self._warned = False
        self._ops: dict[str, dict[str, str]] = {}      # projection -> operand -> buffer name
        self._specs: dict[str, str] = {}
        # 4-bit kernels read their own packed copy of the codes; the stacked per-expert fields
        # (one code per byte: what weight_q, the exact path and checkpoints read) are then the
        # exact twin and stay on the host, so the device holds the weight once (as QuantLinear)
        self.host_twin = bool(host_twin and self.kernel_class is not None and self.kernel_class.packs_weights)
        self._twin = {f"{p}_{f}" for p in PROJECTIONS for f in [f for f, _ in _FIELDS] + ["global"]} \
            if self.host_twin else set()
        if self.kernel is not None:     # the kernel's operands, laid out once (not saved: derived)
            for p in PROJECTIONS:
                fields = {f: getattr(self, f"{p}_{f}") for f, _ in _FIELDS}
                fields["global"] = getattr(self, f"{p}_global")
                names = {}
                for k, t in prepare_grouped(self.kernel_class, weight_scheme, fields, act_scheme).items():
                    same = [f"{p}_{f}" for f, v in fields.items() if v is t]
                    if same and self.host_twin:     # the twin stays on the host: the kernel gets its own
                        t = t.clone()
                        same = []
                    if same:            # the stacked buffer itself: one copy on every device
                        names[k] = same[0]
                    else:
                        names[k] = f"{p}_k_{k}"
                        self.register_buffer(names[k], t, persistent=False)
                self._ops[p] = names
                # gate_up writes the activations' 16-bit dtype (the intermediate then feeds the
                # down GEMM's tensor cores as bf16 / fp16, as a bf16 model's does); down writes
                # fp32 for the routing-weighted sum
                self._specs[p] = grouped_spec(self.kernel_class, weight_scheme, act_scheme, list(names),
                                              getattr(self, f"{p}_codes").shape[1], identity=p == "down",
                                              out="input" if p == "gate_up" else "float32")
        for n in self._twin:
            if self._buffers.get(n) is not None:
                self._buffers[n] = self._buffers[n].cpu()

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the codes, scales and biases; `.to(dtype)` / `.half()` never
        convert them (int codes, fp32 scales and biases are the arithmetic's formats, not the
        model's dtype): each buffer goes only where fn sends a probe of its own dtype. The host
        twin of 4-bit weights (host_twin) goes only to the CPU."""
        bufs = {n: b for n, b in self._buffers.items() if b is not None}
        for n in bufs:
            del self._buffers[n]
        try:
            out = super()._apply(fn, recurse)
        finally:
            for n, b in bufs.items():
                dev = fn(torch.empty(0, dtype=b.dtype, device=b.device)).device
                self._buffers[n] = b if n in self._twin and dev.type != "cpu" else b.to(dev)
        return out

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_module(cls, module: torch.nn.Module, weight_scheme: QuantScheme, act_scheme: QuantScheme | None,
                    options: ExpertsOptions | None = None, *, quantized: dict[str, list[QTensor]] | None = None,
                    **changes) -> "QuantExperts":
        """Quantize the fused expert weights of `module` per expert. options: an ExpertsOptions or its
        fields as keywords (lowbit.archs.experts' ExpertsSpec.module_kwargs() gives the family's). Raises
        ValueError naming the module and parameter for a dynamic weight scheme, a dynamic-less (static)
        activation scheme, NaN/Inf weights, or a K the weight / activation group size does not divide.
        quantized: {"gate_up" | "down": one QTensor [N, K] per expert under weight_scheme} that
        a calibration chose (lowbit.algorithms.gptq.experts) instead of round to nearest's codes."""
        o = ExpertsOptions.merge(options, changes, "QuantExperts.from_module")
        name = o.name
        if weight_scheme.dynamic:
            raise ValueError(f"{name}: weight_scheme must be static (dynamic=False): expert weights are quantized once")
        if act_scheme is not None and not act_scheme.dynamic:
            raise ValueError(f"{name}: act_scheme must be dynamic; static (calibrated) activation scales are not "
                             "supported for experts: use a dynamic recipe or keep the experts in high precision")
        stacked, biases = {}, {}
        for p, pname, bname in (("gate_up", o.gate_up, o.gate_up_bias), ("down", o.down, o.down_bias)):
            w = _as_enk(getattr(module, pname).detach(), o.layout)
            where = f"{name}.{pname} {tuple(getattr(module, pname).shape)}"
            _check_k(w.shape[2], weight_scheme, f"{where}: K = {w.shape[2]} under the weight scheme")
            if act_scheme is not None:
                _check_k(w.shape[2], act_scheme, f"{where}: K = {w.shape[2]} under the activation scheme")
            if not torch.isfinite(w).all():
                raise ValueError(f"{where} holds {int((~torch.isfinite(w)).sum())} NaN/Inf values: fix the "
                                 "checkpoint before quantizing")
            given = (quantized or {}).get(p)
            stacked[p] = _quantize_stack(w, weight_scheme) if given is None else \
                _stack_given(given, tuple(w.shape), weight_scheme, where)
            biases[p] = None if bname is None else getattr(module, bname).detach()
        return cls._of_module(module, stacked, biases, weight_scheme, act_scheme, o)

    @classmethod
    def from_qtensors(cls, module: torch.nn.Module, gate_up: list[QTensor], down: list[QTensor],
                      act_scheme: QuantScheme | None, options: ExpertsOptions | None = None,
                      **changes) -> "QuantExperts":
        """Rebuild quantized experts from per-expert QTensors (gate_up [2I, H] and down [H, I] of
        each expert, e.g. read from a checkpoint), stacked as from_module stacks them; `module`
        (the family's float experts module being replaced) gives the activation and the biases.
        options: an ExpertsOptions or its fields as keywords (the weight attributes and layout are
        not read: the weights are the QTensors). Raises ValueError naming `name` when the experts
        disagree in scheme or shape."""
        o = ExpertsOptions.merge(options, changes, "QuantExperts.from_qtensors")
        name = o.name
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"{name}: {len(gate_up)} gate_up and {len(down)} down weights; one of each per expert")
        scheme = gate_up[0].scheme
        stacked = {}
        for p, qs in (("gate_up", gate_up), ("down", down)):
            bad = [e for e, q in enumerate(qs) if q.scheme != scheme or tuple(q.shape) != tuple(qs[0].shape)
                   or q.padded]
            if bad:
                raise ValueError(f"{name}: expert {bad[0]}'s {p} is {qs[bad[0]].scheme} {tuple(qs[bad[0]].shape)}, "
                                 f"expert 0's gate_up is {scheme} {tuple(qs[0].shape)}; experts of one block share "
                                 "one scheme and shape")
            stacked[p] = _stack(qs)
        biases = {p: None if b is None else getattr(module, b).detach()
                  for p, b in (("gate_up", o.gate_up_bias), ("down", o.down_bias))}
        return cls._of_module(module, stacked, biases, scheme, act_scheme, o)

    @classmethod
    def _of_module(cls, module, stacked, biases, weight_scheme, act_scheme, o: ExpertsOptions) -> "QuantExperts":
        """The QuantExperts of stacked codes, with `module`'s activation (act_fn, gpt-oss's alpha / limit)."""
        act_fn = getattr(module, "act_fn", None) if o.activation == "act_fn" else None
        return cls(stacked, biases, weight_scheme, act_scheme, o, act_fn=act_fn, alpha=getattr(module, "alpha", None),
                   limit=getattr(module, "limit", None))

    def weight_q(self, proj: str, e: int) -> QTensor:
        """Expert e's QTensor [N, K] of projection "gate_up" or "down" (views of the buffers)."""
        if proj not in PROJECTIONS:
            raise ValueError(f"proj={proj!r}; choose one of {PROJECTIONS}")
        kw = {f: (None if getattr(self, f"{proj}_{b}") is None else getattr(self, f"{proj}_{b}")[e])
              for b, f in _FIELDS}
        g = getattr(self, f"{proj}_global")
        return QTensor(scheme=self.weight_scheme, shape=tuple(kw["codes"].shape),
                       global_scale=None if g is None else g[e], **kw)

    def weights_q(self, proj: str) -> list[QTensor]:
        return [self.weight_q(proj, e) for e in range(self.num_experts)]

    def weight_dequantized(self, proj: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] dequantized weights of one projection (float64: exact)."""
        return torch.stack([q.dequantize(dtype) for q in self.weights_q(proj)])

    def extra_repr(self) -> str:
        a = "none (weight-only)" if self.act_scheme is None else str(self.act_scheme)
        return (f"family={self.family}, num_experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, weight={self.weight_scheme}, act={a}")

    # ------------------------------------------------------------------ forward
    def glu(self, h: torch.Tensor) -> torch.Tensor:
        """The family's gated activation of the gate_up output h [M, 2I] -> [M, I]."""
        if self.glu_split == "chunk":
            gate, up = h.chunk(2, dim=-1)
        else:
            gate, up = h[..., ::2], h[..., 1::2]
        if self.activation == "act_fn":
            return self.act_fn(gate) * up
        gate = gate.clamp(max=self.limit)               # gpt-oss: clamped swiglu with a +1 on up
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _quantize_act(self, x: torch.Tensor):
        return x if self.act_scheme is None else quantize(x, self.act_scheme)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        T = hidden_states.shape[0]
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_dim:
            raise ValueError(f"hidden_states must be [tokens, {self.hidden_dim}], got {tuple(hidden_states.shape)}")
        if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != T:
            raise ValueError(f"top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                             f"{tuple(top_k_weights.shape)} must both be [{T}, top_k]")
        if self._use_kernel(hidden_states):
            return self._kernel_forward(hidden_states, route(top_k_index, self.num_experts), top_k_weights)
        routing = sort_tokens(top_k_index, self.num_experts)
        y = self.sorted_forward(hidden_states, routing)
        w = top_k_weights[routing.token, routing.slot].to("cpu", torch.float64)
        out = torch.zeros(T, self.hidden_dim, dtype=torch.float64)
        out.index_add_(0, routing.token.cpu(), y * w[:, None])
        self.last_path = "exact"
        return out.to(hidden_states.device, hidden_states.dtype)

    def _use_kernel(self, x: torch.Tensor) -> bool:
        if self.backend == "exact" or not (x.is_cuda or self.backend == "kernel"):
            return False
        if self.kernel is None:
            if self.backend == "kernel":
                raise NotImplementedError(f"backend='kernel': no grouped kernel for weight {self.weight_scheme}, "
                                          f"act {self.act_scheme} "
                                          f"({self.kernel_choice.report()}); "
                                          "use backend='auto' or 'exact'")
            if not self._warned:
                warnings.warn(f"QuantExperts: no grouped kernel for weight {self.weight_scheme}, act "
                              f"{self.act_scheme} ({self.kernel_choice.report()}); running the exact float64 path",
                              stacklevel=3)
                self._warned = True
            return False
        return True

    def path_for(self, rows: int, dtype: torch.dtype, device: torch.device | str = "cuda") -> str:
        """The path a forward of `rows` sorted rows (tokens x top_k) of `dtype` hidden states on
        `device` takes: "exact", or the kernel path's per projection ("kernel:<kind>",
        "dequant:<kind>", "<gate_up's>/<down's>:<kind>")."""
        on_kernel = self.backend == "kernel" or (self.backend == "auto" and torch.device(device).type == "cuda")
        if self.kernel_class is None or not on_kernel:
            return "exact"
        E, H, I = self.num_experts, self.hidden_dim, self.intermediate_dim
        runs = [self.kernel_class.for_rows(self.weight_scheme, E, N, K, rows, dtype) for N, K in ((2 * I, H), (H, I))]
        names = ["dequant" if c.bf16_path else "kernel" for c in runs]
        return f"{names[0] if names[0] == names[1] else '/'.join(names)}:{self.kernel}"

    def kernel_projections(self, hidden_states: torch.Tensor, routing: Routing) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The grouped kernels' (input, output) of each projection in PROJECTIONS order: gate_up reads
        hidden_states [T, H] through routing's token order, down reads the GLU of gate_up's sorted
        output [M_total, I]; outputs are float32 [M_total, N]. lowbit verify-model checks each against
        the exact path given the same input."""
        x, h, seen = hidden_states.detach(), None, []
        for proj in PROJECTIONS:
            ops = {k: getattr(self, b) for k, b in self._ops[proj].items()}
            inp, identity = (x, False) if proj == "gate_up" else (self.glu(h), True)
            h = grouped_forward(self.kernel_class, ops, self.weight_scheme, self.act_scheme, inp, routing,
                                bias=getattr(self, f"{proj}_bias"), identity=identity, spec=self._specs[proj])
            seen.append((inp, h))
        return seen

    def _kernel_forward(self, hidden_states: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor):
        x = hidden_states.detach()
        h = self.kernel_projections(x, routing)[-1][1]
        out = combine(h, top_k_weights, routing, hidden_states.dtype)
        self.last_path = self._kernel_path if torch.compiler.is_compiling() else \
            self.path_for(routing.rows, hidden_states.dtype, hidden_states.device)
        return out

    def sorted_forward(self, hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Float64 [M_total, H]: each sorted row's expert output before the routing weight."""
        return self.down_rows(self.glu(self.gate_up_rows(hidden_states, routing)), routing)

    def gate_up_rows(self, hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Float64 [M_total, 2I]: the first grouped GEMM (+ bias) of every sorted row; the
        activations are quantized once, over all T tokens, then gathered."""
        x = hidden_states.detach().to(self.gate_up_codes.device)     # the host twin's device, if any
        a1 = take_rows(self._quantize_act(x.float()) if self.act_scheme is not None else x.double(),
                       routing.token.to(x.device))
        return grouped_reference(a1, routing.offsets.cpu(), self.weights_q("gate_up"), self._exact_bias("gate_up"))

    def down_rows(self, a: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Float64 [M_total, H]: the second grouped GEMM (+ bias) of the sorted intermediate a
        [M_total, I], quantized once as one buffer."""
        a = a.to(self.down_codes.device)
        a2 = self._quantize_act(a) if self.act_scheme is not None else a.double()
        return grouped_reference(a2, routing.offsets.cpu(), self.weights_q("down"), self._exact_bias("down"))

    def _exact_bias(self, proj: str) -> torch.Tensor | None:
        b = getattr(self, f"{proj}_bias")
        return None if b is None else b.to(getattr(self, f"{proj}_codes").device)


def _check_k(K: int, scheme: QuantScheme, where: str) -> None:
    width = scheme.k_width
    if K % width:
        raise ValueError(f"{where} is not a multiple of the group size {width} ({scheme}): stacked expert scales "
                         "need whole groups; choose a recipe whose group divides K")


def _quantize_stack(w: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor | None]:
    """Quantize each expert of w [E, N, K] on its own (per-expert tensor scales) and stack."""
    return _stack([quantize(w[e].float(), scheme) for e in range(w.shape[0])])


def _stack_given(qs: list[QTensor], shape: tuple[int, int, int], scheme: QuantScheme, where: str):
    """Stack per-expert QTensors a calibration chose, checked against the weight [E, N, K]."""
    E, N, K = shape
    bad = [e for e, q in enumerate(qs) if q.scheme != scheme or tuple(q.codes.shape) != (N, K)]
    if len(qs) != E or bad:
        raise ValueError(f"{where}: quantized= needs {E} QTensors [{N}, {K}] under {scheme}; got {len(qs)}, "
                         f"experts {bad} differ")
    return _stack(qs)


def _stack(qs: list[QTensor]) -> dict[str, torch.Tensor | None]:
    """The stacked buffers ({field: [E, ...]}) of one QTensor per expert."""
    out = {}
    for field, attr in _FIELDS:
        vals = [getattr(q, attr) for q in qs]
        out[field] = None if vals[0] is None else torch.stack(vals)
    out["global"] = None if qs[0].global_scale is None else torch.stack([q.global_scale.reshape(()) for q in qs])
    return out
