"""verify_model: does a deployed quantized checkpoint still compute what its codes and scales say?
(`lowbit verify-model DIR`)

The check a serving team runs after a driver, library or kernel change. The checkpoint (lowbit's or
any compressed-tensors one: lowbit.pipelines.checkpoint.load_compressed) is built as a model on this
machine's fast paths (lowbit.nn.QuantLinear / QuantExperts: the prepared kernels on CUDA, the exact
CPU twins elsewhere), run on a few calibration sequences (random token ids of the model's vocabulary,
seeded), and every quantized layer's inputs and outputs are captured:
- dense (QuantLinear): the output against the float64 quantization-aware reference of the same
  activation quantization and stored weight codes, gated and diagnosed by verify.check_quantized
  (pass / numerical / logic with the cause);
- experts (QuantExperts): the output against the module's own float64 exact path on the same
  tokens and routing, within the output rounding of the model's dtype (a comparison with the exact
  twin, not a derived gate: the block chains two GEMMs and an activation);
- attention over a quantized KV cache: each layer's post-RoPE q, the K / V it read (which must be
  the cache's codes x scales, bit for bit) and its output, for the last `rows` queries of every
  sequence, against the float64 attention reference of what the model's attention implementation
  computes, gated and diagnosed by verify.check_attention (pipelines/verify_attention.py); with
  `attention="fp8"` / `"int8"` the model runs lowbit's quantized attention (Q and P codes) instead
  of its own implementation.
End to end, the same sequences run through the fast model and through the exact one (every
quantized layer's output, and every attention output over a quantized cache, replaced by its
reference): KL(exact || fast) per token and top-1 agreement. Time is bounded by `samples`
(sequences), `tokens` and `rows` (captured rows per layer; attention: queries per sequence).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

import lowbit as lb
from lowbit.pipelines.attention_tap import attention_tap
from lowbit.nn.experts import PROJECTIONS, QuantExperts
from lowbit.ops.grouped import sort_tokens
from lowbit.nn.kv_cache import attention_modules, cache_kwarg, enable_quantized_attention
from lowbit.nn.quant_linear import QuantLinear
from lowbit.ops.kernels.base import fp8_dot_accumulator
from lowbit.ops.reference import qlinear_reference
from lowbit.pipelines import verify_attention as va
from lowbit.pipelines.checkpoint import load_compressed
from lowbit.verify.check import Verdict, check_quantized
from lowbit.verify.grouped import check_grouped_linear
from lowbit.verify.metrics import kl_sum
from lowbit.verify.tolerance import ACCUMULATORS

KINDS = ("dense", "experts", "attention")
ORDER = {"ok": 0, "numerical": 1, "logic": 2}


@dataclass
class LayerResult:
    name: str
    kind: str                     # "dense" | "experts" | "attention"
    verdict: str                  # "ok" | "numerical" | "logic"
    worst_over_gate: float        # worst |out - reference| / gate (experts: / the rounding bound)
    rel_err: float
    cause: str = ""               # the first cause's text ("" when ok)


@dataclass
class ModelReport:
    directory: str
    device: str
    layers: list[LayerResult]
    kl: float                     # mean KL(exact || fast) per token, nats
    top1: float                   # share of tokens whose argmax agrees
    tokens: int
    not_checked: list[str] = field(default_factory=list)

    def kind_verdict(self, kind: str) -> str:
        rs = [r.verdict for r in self.layers if r.kind == kind]
        return max(rs, key=ORDER.get) if rs else "absent"

    @property
    def logic(self) -> bool:
        return any(r.verdict == "logic" for r in self.layers)

    def report(self) -> str:
        lines = [f"verify-model {self.directory} on {self.device}: {len(self.layers)} quantized layers, "
                 f"{self.tokens} tokens"]
        for kind in KINDS:
            rs = [r for r in self.layers if r.kind == kind]
            if not rs:
                continue
            worst = max(rs, key=lambda r: (ORDER[r.verdict], r.worst_over_gate))
            lines.append(f"  {kind:9s} {self.kind_verdict(kind):9s} {len(rs)} layers, worst {worst.name} "
                         f"(err/gate {worst.worst_over_gate:.3g}, rel err {worst.rel_err:.2e})")
            for r in rs:
                if r.verdict != "ok":
                    lines.append(f"    {r.name}: {r.verdict}: {r.cause}")
        for n in self.not_checked:
            lines.append(f"  not checked: {n}")
        lines.append(f"  end to end vs the exact path: KL {self.kl:.3e} nats/token, top-1 agreement {self.top1:.2%}")
        return "\n".join(lines)


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.detach().reshape(-1, t.shape[-1])[:rows].cpu()


def _dense_reference(layer, x2: torch.Tensor):
    """(activation operand, reference out fn): the activations quantized as the layer does (a QTensor
    for dynamic schemes, the dequantized values of a static scale), float when weight-only."""
    if layer.act_scheme is None:
        return x2.double()
    if layer.act_static_scale is None:
        return lb.quantize(x2.float(), layer.act_scheme, pad=True)
    return layer.quantize_input(x2.float())[2].double()


def kernel_accumulator(layer) -> str | None:
    """The accumulator the kernel that ran declares, where it is not fp32: lowbit's W8A8 fp8 GEMM on
    a GPU (lowbit.ops.kernels.base.fp8_dot_accumulator)."""
    dev = next((b.device for b in layer.buffers() if b.is_cuda), None)
    if dev is not None and layer.last_path == "fast:w8a8" and layer.act_scheme is not None \
            and layer.act_scheme.format == "fp8_e4m3fn":
        return fp8_dot_accumulator(dev)
    return None


def check_dense(name: str, layer, x: torch.Tensor, out: torch.Tensor) -> tuple[LayerResult, Verdict]:
    xq = _dense_reference(layer, x)
    v = check_quantized(out, xq, layer.weight_q, bias=layer.bias, out_dtype=out.dtype,
                        accumulator=kernel_accumulator(layer))
    cause = str(v.causes[0]) if v.causes else ""
    return LayerResult(name, "dense", v.kind, v.metrics["impl_gate_frac"], v.metrics["rel_l2"], cause), v


def check_experts(name: str, module, inputs: tuple, out: torch.Tensor) -> LayerResult:
    """A layer that ran its grouped kernels: each projection's kernel output against the float64
    grouped reference given the same input (the kernel's own GLU output feeds the down projection's
    check, as the dense check takes the layer's captured input), within check_grouped_linear's
    derived gate. A layer that ran its exact path: its output against the module's float64 exact
    path on the same tokens and routing; bound: 4 output roundings of the model dtype (the GLU input,
    each GEMM's output, the sum) of each row's largest exact value, plus float32's accumulation of K
    products."""
    if module.last_path not in (None, "exact"):
        return _check_expert_projections(name, module, inputs)
    saved = module.backend
    module.backend = "exact"
    try:
        with torch.no_grad():
            exact = module(*(t.detach().cpu().double() if t.is_floating_point() else t.cpu() for t in inputs))
    finally:
        module.backend = saved
    exact, got = exact.double(), out.detach().cpu().double()
    u = torch.finfo(out.dtype).eps / 2
    K = max(module.hidden_dim, module.intermediate_dim)
    bound = (4 * u + K * ACCUMULATORS["fp32"]) * exact.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    worst = float(torch.nan_to_num((got - exact).abs() / bound, nan=math.inf).max())
    rel = float(torch.linalg.vector_norm(got - exact) / torch.linalg.vector_norm(exact).clamp(min=1e-300))
    verdict = "ok" if worst <= 1 else ("numerical" if worst <= 16 and math.isfinite(worst) else "logic")
    cause = "" if verdict == "ok" else (f"the fast path differs from the exact float64 path by {worst:.3g}x the "
                                        f"rounding bound (rel err {rel:.2e})")
    return LayerResult(name, "experts", verdict, worst, rel, cause)


def _check_expert_projections(name: str, module, inputs: tuple) -> LayerResult:
    hidden, top_k_index = inputs[0], inputs[1]
    routing = sort_tokens(top_k_index, module.num_experts)
    with torch.no_grad():
        pairs = module.kernel_projections(hidden, routing)
    acc = fp8_dot_accumulator(hidden.device) if module.kernel == "fp8" else None
    worst = (-1.0, None, None)
    E, H, I = module.num_experts, module.hidden_dim, module.intermediate_dim
    for proj, (inp, got), (N, K) in zip(PROJECTIONS, pairs, ((2 * I, H), (H, I))):
        rows = inp[routing.token] if proj == "gate_up" else inp      # the sorted buffer the kernel read
        bias = getattr(module, f"{proj}_bias")
        # the bf16 ("dequant") path multiplies the weights dequantized into a bf16 buffer (the exact
        # values rounded once to bf16: integer codes x float32 scales are not bf16 values; e2m1 x
        # e8m0 / e4m3 are) and rounds torch._grouped_mm's product to bf16 before its float32
        # epilogue: its reference is those bf16 weights, its output rounding bf16's
        bf16 = module.kernel_class.for_rows(module.weight_scheme, E, N, K, routing.rows, inp.dtype).bf16_path
        w = module.weight_dequantized(proj, torch.float64)
        if bf16 and module.weight_scheme.fmt.kind == "int":
            w_q, w = None, w.to(torch.bfloat16).double()
        else:
            w_q = [q.to("cpu") for q in module.weights_q(proj)]
        v = check_grouped_linear(got, rows.float(), w, routing.offsets, x_scheme=module.act_scheme, bias=bias,
                                 accumulator=acc, out_dtype=torch.bfloat16 if bf16 else got.dtype, w_q=w_q)
        frac = v.metrics["impl_gate_frac"]
        if frac > worst[0]:
            worst = (frac, v, proj)
    frac, v, proj = worst
    cause = "" if v.passed else f"{proj}: " + (f"{v.causes[0][0]}: {v.causes[0][1]}" if v.causes else
                                               f"over the gate {frac:.3g}x, no cause fits")
    return LayerResult(name, "experts", "ok" if v.passed else v.kind, frac, v.metrics["rel_l2"], cause)


def verify_model(directory, *, samples: int = 2, tokens: int = 32, rows: int = 64, device: str = "cpu",
                 seed: int = 0, attention: str | None = None,
                 progress: Callable[[str], None] | None = None) -> ModelReport:
    """Load the checkpoint in `directory`, run `samples` sequences of `tokens` random ids through it
    on `device` (bf16 on CUDA: the prepared fast paths; float32 on the CPU), and check every
    quantized layer (the first `rows` rows it saw), the attention over a quantized KV cache (the
    last `rows` queries of every sequence) and the logits. attention: None runs the model's own
    attention implementation; "fp8" / "int8" lowbit's quantized attention with Q and P in that
    format (needs a quantized KV cache). See the module docstring."""
    say = progress or (lambda m: None)
    if samples < 1 or tokens < 2 or rows < 1:
        raise ValueError(f"samples ({samples}), tokens ({tokens}) and rows ({rows}) must be >= 1, >= 2 and >= 1")
    if attention is not None and attention not in va.QUANTIZED:
        raise ValueError(f"attention must be None (the model's own) or one of {sorted(va.QUANTIZED)}, got {attention!r}")
    ck = load_compressed(directory)
    if attention is not None and ck.kv_cache is None:
        raise ValueError(f"attention={attention!r}: {directory} quantizes no KV cache, and verify-model checks "
                         "attention over a quantized cache only; quantize one (lowbit quantize --kv-cache fp8)")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = ck.to_model(device=device, dtype=dtype, share_inputs=False).to(device).eval()
    if attention is not None:
        enable_quantized_attention(model, va.QUANTIZED[attention])
    say(f"loaded {directory} ({len(ck.qtensors)} quantized tensors) on {device} in {dtype}")
    vocab = int(ck.config.get("vocab_size") or model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, tokens), generator=g).to(device)

    quantized = {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantExperts))}
    seen: dict[str, tuple] = {}

    def capture(name):
        def hook(module, args, out):
            if name not in seen:
                if isinstance(module, QuantLinear):
                    seen[name] = (_rows(args[0], rows), _rows(out, rows))
                else:
                    seen[name] = (tuple(a.detach()[:rows] for a in args), out.detach()[:rows])
        return hook

    attn_seen, attn_rec = va.recorder(rows)
    handles = [m.register_forward_hook(capture(n)) for n, m in quantized.items()]
    try:
        with torch.no_grad():
            fast, cache, implementation = _run(model, ids, attn_rec if ck.kv_cache is not None else None)
    finally:
        for h in handles:
            h.remove()
    say(f"ran {samples} x {tokens} tokens; checking {len(seen)} layers")
    results = []
    for i, (name, module) in enumerate(quantized.items()):
        if name not in seen:
            continue
        x, out = seen[name]
        if isinstance(module, QuantLinear):
            results.append(check_dense(name, module, x, out)[0])
        else:
            results.append(check_experts(name, module, x, out))
        say(f"[{i + 1}/{len(quantized)}] {name}: {results[-1].verdict}")
    not_checked = []
    if ck.kv_cache is not None:
        results += _check_attention_layers(model, cache, attn_seen, implementation, not_checked, say)
    exact = _exact_logits(model, quantized, ids, implementation)
    # in float64 (a bf16 log-softmax made the KL of near-equal logits negative); KL >= 0, and what
    # float64 rounding leaves below zero for equal distributions is reported as 0
    lp_e = torch.log_softmax(exact.double().reshape(-1, exact.shape[-1]), -1)
    kl = max(0.0, kl_sum(lp_e, fast.reshape(-1, fast.shape[-1])) / lp_e.shape[0])
    top1 = float((exact.argmax(-1) == fast.argmax(-1)).double().mean())
    return ModelReport(str(directory), device, results, kl, top1, samples * tokens, not_checked)


def _run(model, ids: torch.Tensor, tap):
    """(logits, the quantized KV cache the forward filled or None, the attention implementation
    tapped or None): one forward, through the model's quantized cache and `tap` when given."""
    if tap is None:
        return model(ids).logits.float().cpu(), None, None
    cache = model.lowbit_kv_cache.new_cache()
    with attention_tap(model, tap) as implementation:
        logits = model(ids, **{cache_kwarg(model): cache}).logits.float().cpu()
    return logits, cache, implementation


def _check_attention_layers(model, cache, seen: dict, implementation, not_checked: list, say) -> list[LayerResult]:
    """verify_attention.check_layer for every attention module the tap saw; what it could not see
    is listed in not_checked."""
    if implementation is None:
        not_checked.append(f"attention over the quantized KV cache: {type(model).__name__} does not dispatch "
                           "attention through transformers' AttentionInterface (check its kernel: lowbit audit "
                           "--attention)")
        return []
    out = []
    for i, (name, module) in sorted(attention_modules(model).items()):
        why = va.unsupported(module)
        if why is not None or module not in seen:
            not_checked.append(f"{name}: attention with {why} (the reference is causal softmax attention over "
                               "every cached key)" if why else f"{name}: its attention was not called")
            continue
        s = seen[module]
        c = va.check_layer(s, cache.layers[i].quantized(), va.layer_spec(module, implementation, s.scaling))
        out.append(LayerResult(name, "attention", c.verdict, c.worst_over_gate, c.rel_err, c.cause))
        say(f"[attention {i + 1}/{len(seen)}] {name} ({implementation}): {c.verdict}")
    return out


def _exact_logits(model, quantized: dict, ids: torch.Tensor, implementation: str | None) -> torch.Tensor:
    """The logits with every quantized layer's output replaced by its float64 reference (dense) or
    the exact path (experts), and every attention output over the quantized cache by its float64
    reference (when the fast run tapped it), cast back to the layer's output dtype."""
    def dense(module, args, out):
        x2 = args[0].detach().reshape(-1, args[0].shape[-1]).cpu()
        ref = qlinear_reference(_dense_reference(module, x2), module.weight_q, module.bias)
        return ref.to(out.dtype).reshape(out.shape).to(out.device)

    def experts(module, args, out):
        saved = module.backend
        module.backend = "exact"
        try:
            return module.forward(*args)          # forward, not __call__: this hook would run again
        finally:
            module.backend = saved

    handles = [m.register_forward_hook(dense if isinstance(m, QuantLinear) else experts) for m in quantized.values()]
    try:
        with torch.no_grad():
            if implementation is None:
                return model(ids).logits.float().cpu()
            return _run(model, ids, va.exact_tap(implementation))[0]
    finally:
        for h in handles:
            h.remove()


def plot(report: ModelReport, path: str) -> None:
    """Per-layer worst error over its gate (log scale), coloured by verdict."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = {"ok": "tab:green", "numerical": "tab:orange", "logic": "tab:red"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(report.layers)), 4))
    vals = [max(r.worst_over_gate, 1e-6) if math.isfinite(r.worst_over_gate) else 1e6 for r in report.layers]
    ax.bar(range(len(vals)), vals, color=[colours[r.verdict] for r in report.layers])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xticks(range(len(vals)), [r.name for r in report.layers], rotation=90, fontsize=6)
    ax.set_ylabel("worst |out - reference| / gate")
    ax.set_title(f"lowbit verify-model: KL {report.kl:.2e}, top-1 {report.top1:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
