"""check_attention: verify a quantized attention kernel's output and name the bug when it is wrong.

    verdict = check_attention(out, q, k, v, spec)     # k, v: the cache as stored (KVQuant)
    verdict.passed, verdict.kind, verdict.first_failure, verdict.metrics, verdict.causes

The reference is lowbit.ops.attention_reference (float64, same codes and scales as the kernel);
the gate is derived there. When the output fails, every bug below is simulated exactly (the
float64 reference with that one edit, gated like a kernel with the bug) and the first whose
simulation reproduces the output everywhere within its gate is named, most specific first:
  k_scale_per_tensor / v_scale_per_tensor  per-head scales declared, head 0's read for every head
  v_scale_missing                          V's scale never applied
  kv_scale_wrong_layer                     K and V scales of another layer (other_layer_scales)
  causal_mask_after_p                      block max and P codes taken before the causal mask
  p_scale_per_tensor                       one scale for all of P: the softmax tail rounds to zero
  rescale_skipped / rescale_wrong_accumulator   the online-softmax rescale of O missing
Then the accumulators narrower than the spec promises, the closest simulation named (numerical):
  o_accumulated_fp16 / o_accumulated_bf16  O kept in a 16-bit accumulator across the rescales
  accumulator_narrower_than_promised       P.V summed in fp8-fast / bf16 / fp16 across more keys than
                                           promised (never promoted into fp32: vLLM's fp8 FA3 at 128k)
With P unquantized (p_format None), an output no simulation reproduces but within the bound of
bf16 scores and P (bf16_intermediates_bound) is named `computed_in_bf16`, numerical: what a bf16
attention such as torch's SDPA in bf16 does, held to the fp32 gate it does not promise.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lowbit.ops import attention_reference as ar
from lowbit.ops.kv_quant import KVQuant
from lowbit.verify import attention_accumulate as pvacc
from lowbit.verify import metrics as mt
from lowbit.verify.check import Verdict
from lowbit.verify.diagnose import Cause
from lowbit.verify.simulate import explained
from lowbit.verify.tolerance import gamma


@dataclass
class AttnVerdict(Verdict):
    """Result of check_attention: check_linear's Verdict, its report for attention.

    first_failure: (batch, head, query, dim) of the first failing output, or None.
    metrics: rel_l2 / max error vs the reference, mismatch ratio, worst err / gate, P zero
             fraction, and (when the float k, v are given) SQNR against unquantized attention.
    """

    def report(self) -> str:
        m = self.metrics
        lines = [f"check_attention: {'PASS' if self.passed else 'FAIL'} ({self.kind})  [q {m['shape']}, "
                 f"Tk={m['Tk']}, K/V: {m['kv_scheme']}, {m['spec']}]",
                 f"  vs quantization-aware reference: rel L2 {m['rel_l2']:.3e}, max |err| {m['max_abs_err']:.3e}, "
                 f"{m['mismatch_ratio']:.2%} of outputs over the gate, worst err/gate {m['impl_gate_frac']:.3g}; "
                 f"P codes at zero {m['p_zero_fraction']:.2%}"]
        if "sqnr_db" in m:
            lines.append(f"  vs unquantized attention of the original inputs: SQNR {m['sqnr_db']:.1f} dB")
        if self.first_failure is not None:
            d = self.details
            lines.append(f"  first failure at {self.first_failure}: got {d['got']:.9g}, reference {d['ref']:.9g}, "
                         f"gate {d['gate']:.3e}; worst (batch, head) {d['worst_bh']}, worst query {d['worst_query']}")
        lines += [f"  cause: {c}" for c in self.causes]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)



def _deq(t) -> torch.Tensor:
    return t.dequantize(torch.float32) if isinstance(t, KVQuant) else t.detach().float()


def _with_scale(t: KVQuant, scale: torch.Tensor) -> torch.Tensor:
    return dataclasses.replace(t, scale=scale.to(t.scale.device, torch.float32)).dequantize(torch.float32)


def _hypotheses(q_hat, k, v, spec, other_layer_scales):
    """(name, detail, kind, k_hat, v_hat, variant) for every applicable bug, most specific first."""
    kd, vd = _deq(k), _deq(v)
    for side, t in (("k", k), ("v", v)):
        if isinstance(t, KVQuant) and t.scheme.granularity == "head" and t.scale.shape[1] > 1:
            s0 = t.scale[:, :1].expand_as(t.scale)
            if not torch.equal(s0, t.scale):
                edited = _with_scale(t, s0)
                yield (f"{side}_scale_per_tensor", f"{side.upper()} has one scale per KV head but the kernel read "
                       f"head 0's for every head (a per-tensor scale load, stride 0)", "logic",
                       edited if side == "k" else kd, edited if side == "v" else vd, None)
    if isinstance(v, KVQuant):
        yield ("v_scale_missing", "V's codes used without their scale (the output is off by 1/v_scale)", "logic",
               kd, v.decoded(), None)
    for i, (ks, vs) in enumerate(other_layer_scales):
        if isinstance(k, KVQuant) and isinstance(v, KVQuant) and tuple(ks.shape) == tuple(k.scale.shape) \
                and tuple(vs.shape) == tuple(v.scale.shape) and not (torch.equal(ks, k.scale) and torch.equal(vs, v.scale)):
            yield ("kv_scale_wrong_layer", f"K and V dequantized with the scales of another layer (entry {i} of "
                   "other_layer_scales): the layer index of the scale pointer is off", "logic",
                   _with_scale(k, ks), _with_scale(v, vs), None)
    if spec.causal:
        yield ("causal_mask_after_p", "the causal mask applied after P was quantized: masked (future) scores set "
               "the block max, so the seen keys' codes are coarser or zero, and are then zeroed", "logic",
               kd, vd, "causal_after_p")
    if spec.p_format is not None:
        yield ("p_scale_per_tensor", f"P quantized with one scale (1/{spec.p_max:g} of the running max) instead of "
               f"one per (row, block of {spec.p_block} keys): the softmax tail rounds to zero", "logic",
               kd, vd, "p_per_tensor")
    yield ("rescale_skipped", "the online-softmax rescale exp(m_old - m_new) never applied to O and l", "logic",
           kd, vd, "rescale_skipped")
    yield ("rescale_wrong_accumulator", "the online-softmax rescale applied to l but not to O", "logic",
           kd, vd, "rescale_wrong_acc")


O_ROUNDED = (("o_accumulated_fp16", "O accumulated in fp16 across the rescales (the accumulator must be fp32)",
              "acc_fp16"),
             ("o_accumulated_bf16", "O accumulated in bf16 across the rescales (the accumulator must be fp32)",
              "acc_bf16"))


def check_attention(out, q, k, v, spec: ar.AttnSpec | None = None, *, out_dtype: torch.dtype | None = None,
                    k_float: torch.Tensor | None = None, v_float: torch.Tensor | None = None,
                    other_layer_scales=(), diagnose_failures: bool = True) -> AttnVerdict:
    """Verify `out` [B, Hq, Tq, D] of a quantized attention kernel.

    q: the ORIGINAL float queries (quantized here by spec.q_format, canonically); k, v: the cache
    as the kernel read it (KVQuant codes and scales) or float tensors (an unquantized cache).
    out_dtype: the kernel's output rounding (default out's dtype). k_float / v_float: the float
    states before quantization (only for the SQNR against unquantized attention).
    other_layer_scales: [(k_scale, v_scale), ...] of other layers, for the wrong-layer hypothesis.
    """
    spec = spec or ar.AttnSpec()
    out_t = torch.as_tensor(out).detach().cpu()
    out_dtype = out_dtype or (out_t.dtype if out_t.is_floating_point() else torch.float32)
    q = torch.as_tensor(q).detach().cpu()
    ar.check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    if tuple(out_t.shape) != tuple(q.shape):
        raise ValueError(f"out has shape {tuple(out_t.shape)}; attention's output has q's shape {tuple(q.shape)}")
    q_hat = ar.quantize_q(q, spec.q_format)
    kc = k.to("cpu") if isinstance(k, KVQuant) else k.detach().cpu()
    vc = v.to("cpu") if isinstance(v, KVQuant) else v.detach().cpu()
    ref = ar.attention_reference(q_hat, _deq(kc), _deq(vc), spec, out_dtype=out_dtype)
    o64 = out_t.double()
    err = (o64 - ref.out).abs()
    bad = ~(err <= ref.gate)
    passed = not bool(bad.any())
    emax, _ = mt.max_abs_err(o64.reshape(-1, o64.shape[-1]), ref.out.reshape(-1, o64.shape[-1]))
    kv_scheme = str(kc.scheme) if isinstance(kc, KVQuant) else "unquantized"
    metrics = {"shape": tuple(q.shape), "Tk": int(k.shape[2]), "kv_scheme": kv_scheme,
               "spec": f"Q {spec.q_format}, P {spec.p_format} per {spec.p_block}-key block, "
                       f"{'causal' if spec.causal else 'full'}, Q.K^T in {spec.qk_acc}, P.V in "
                       f"{pvacc.describe(spec, int(k.shape[2]))}",
               "rel_l2": mt.rel_l2(o64.reshape(-1, o64.shape[-1]), ref.out.reshape(-1, o64.shape[-1])), "max_abs_err": emax,
               "mismatch_ratio": float(bad.double().mean()),
               "impl_gate_frac": float(torch.nan_to_num(err / ref.gate, nan=math.inf).max()),
               "p_zero_fraction": ref.p_zero_fraction}
    if k_float is not None and v_float is not None:
        orig = ar.sdpa_float64(q.float(), torch.as_tensor(k_float).cpu().float(), torch.as_tensor(v_float).cpu().float(),
                               spec.causal, spec.sm_scale)
        metrics["sqnr_db"] = mt.sqnr_db(orig.reshape(-1, orig.shape[-1]), o64.reshape(-1, orig.shape[-1]))
    first, details, kind, causes = None, {}, "ok", []
    if not passed:
        first = tuple(int(i) for i in bad.nonzero()[0])
        per_bh = torch.nan_to_num(err, nan=math.inf).amax(dim=(2, 3))
        per_q = torch.nan_to_num(err, nan=math.inf).amax(dim=(0, 1, 3))
        details = {"got": float(o64[first]), "ref": float(ref.out[first]), "gate": float(ref.gate[first]),
                   "worst_bh": tuple(int(i) for i in divmod(int(per_bh.argmax()), per_bh.shape[1])),
                   "worst_query": int(per_q.argmax())}
        kind = "logic"
        if diagnose_failures:
            kind, causes = _diagnose(o64, ref, q_hat, kc, vc, spec, out_dtype, other_layer_scales)
    return AttnVerdict(passed, kind, first, metrics, causes, [], details)


def bf16_intermediates_bound(q_hat: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor, spec: ar.AttnSpec,
                             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact out, bound) float64 [B, Hq, Tq, D]: how far an attention with fp32 dots whose scores
    and P may each be rounded to bf16 (unit roundoff u = 2^-8) can be from exact softmax attention
    of the same q_hat, k_hat, v_hat. Derivation (natural-log units, s = q.k * sm_scale):
      score error  ds_ij <= u |s_ij| + (1 + u) gamma_{D+2}(2^-24) sum_d |q||k| sm_scale
      p'_ij = exp(s_ij - m') e^{+-eps_ij}, eps_ij = ds_ij + log1p(u) + 2^-21 (exp's own error); m'
              cancels between P and l, whichever max the kernel subtracts
      w'_j = p'_j / l' in w_j e^{+-(eps_j + E)} (1 +- g), E = max_k eps_k (l from P rounded or not),
              g = gamma_{Tk}(2^-24) the fp32 sum of l
      |O' - O| <= sum_j w_j |V_j| ((e^{eps_j + E}(1 + g))(1 + g) - 1)   (P.V summed in fp32)
    then the output rounding u_out (|O| + that) + eta_out / 2."""
    qd, kd, vd = ar.float64_heads(q_hat, k_hat, v_hat)
    B, Hq, Tq, D = q_hat.shape
    Tk = k_hat.shape[2]
    c = spec.scale_for(D)
    u, u32 = 2.0 ** -8, 2.0 ** -24
    S = (qd @ kd.transpose(-1, -2)) * c
    allowed = ar.allowed_mask(Tq, Tk, spec.causal).expand_as(S)
    ds = u * S.abs() + (1 + u) * gamma(D + 2, u32) * (qd.abs() @ kd.abs().transpose(-1, -2)) * c
    eps = torch.where(allowed, ds + math.log1p(u) + 2.0 ** -21, torch.zeros_like(ds))
    E = eps.amax(dim=-1, keepdim=True)
    w = torch.softmax(torch.where(allowed, S, torch.tensor(-math.inf, dtype=torch.float64)), dim=-1)
    g = gamma(Tk, u32)
    out = w @ vd
    kern = (w * (torch.exp(eps + E) * (1 + g) ** 2 - 1)) @ vd.abs()
    u_out, eta_out = ar._OUT_UNITS[out_dtype]
    return out, kern + u_out * (out.abs() + kern) + eta_out / 2


def _accumulator_causes(o64, ref, q_hat, k, v, spec, out_dtype) -> list[tuple[float, Cause]]:
    """(share of the error explained, cause) for every accumulator narrower than promised whose
    simulation explains the output: O rounded to 16 bits once per block (within that kernel's gate),
    P.V summed in a narrow accumulator (verify/attention_accumulate.py). The closest is named: the
    16-bit-O gates grow with the blocks and at long context would take any error."""
    kd, vd = _deq(k), _deq(v)
    found = []
    for name, detail, variant in O_ROUNDED:
        sim = ar.attention_reference(q_hat, kd, vd, spec, variant=variant, out_dtype=out_dtype)
        ok, share, _ = explained(o64, ref.out, sim.out, sim.gate)
        if ok and share >= pvacc.MATCH_SHARE:     # its wide gate alone takes almost any long-context error
            found.append((share, Cause(name, f"{detail} (explains {share:.1%} of the error energy)", True)))
    m = pvacc.match(o64, ref, q_hat, kd, vd, spec, out_dtype)
    if m is not None:
        Tk = kd.shape[2]
        n = m.spec.pv_promote if m.spec.pv_promote else max(spec.p_block, ar.FP8_STEP)
        found.append((m.share, Cause(
            "accumulator_narrower_than_promised",
            f"P.V accumulated in {pvacc.describe(m.spec, Tk)}, although {pvacc.describe(spec, Tk)} was promised: "
            f"that kernel, simulated, explains {m.share:.0%} of the error (its relative L2 error {m.rel_err:.2e}); "
            f"promote every {max(spec.p_block, ar.FP8_STEP)} keys (add the partial into an fp32 O once per key "
            f"block, FlashAttention-3's two-level accumulation: simulated, {m.fix_rel_err:.2e}) or accumulate "
            f"P.V in fp32; a kernel meant to work so is checked with AttnSpec(pv_acc={m.spec.pv_acc!r}, "
            f"pv_promote={n})", m.confirmed)))
    return sorted(found, key=lambda t: -t[0])


def _diagnose(o64, ref, q_hat, k, v, spec, out_dtype, other_layer_scales):
    ref_out = ref.out
    for name, detail, kind, kd, vd, variant in _hypotheses(q_hat, k, v, spec, other_layer_scales):
        sim = ar.attention_reference(q_hat, kd, vd, spec, variant=variant, out_dtype=out_dtype)
        ok, share, worst = explained(o64, ref_out, sim.out, sim.gate)
        if ok and share > 0:      # within its gate AND closer to the output than the reference is
            return kind, [Cause(name, f"{detail} (explains {share:.1%} of the error energy)", True)]
    acc = _accumulator_causes(o64, ref, q_hat, k, v, spec, out_dtype)
    if acc:
        return "numerical", [c for _, c in acc]
    if spec.p_format is None:
        exact, bound = bf16_intermediates_bound(q_hat, _deq(k), _deq(v), spec, out_dtype)
        worst = float(torch.nan_to_num((o64 - exact).abs() / bound, nan=math.inf).max())
        if worst <= 1.0:
            return "numerical", [Cause("computed_in_bf16", "the error is beyond the fp32 gate but within what bf16 "
                                       f"scores and P (unit roundoff 2^-8) can produce (worst err / bf16 bound "
                                       f"{worst:.2f}): the attention computes in bf16, not fp32", False)]   # a bound, not a simulation
    return "logic", [Cause("unexplained", "no simulated attention bug reproduces the output; the error is "
                           "beyond the derived gate (see the worst (batch, head) and query above)", False)]
