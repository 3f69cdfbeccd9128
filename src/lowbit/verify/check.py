"""check_linear: verify a quantized linear's output and say what is wrong when it is."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import lowbit as lb
from lowbit.ops.reference import qlinear_reference
from lowbit.verify import metrics as mt
from lowbit.verify import tolerance as tol
from lowbit.verify.diagnose import Cause, Context, diagnose

DEAD_CHANNEL_CODES = 8   # a channel using this few codes out of >= 15 is reported as dead


@dataclass
class Verdict:
    """Result of check_linear.

    passed: every output within the implementation gate (and finite).
    kind: "ok" | "numerical" | "logic".
    first_failure: (row, col) of the first failing output in row-major order, or None.
    metrics: numbers (relative L2, max error and where, mismatch ratio against the gate, SQNR
             against the original inputs, gate fractions, code census).
    causes: named likely causes (diagnose.Cause), most specific first.
    warnings: things that do not fail the check (sqrt(K) statistical estimate exceeded, dead channels).
    """

    passed: bool
    kind: str
    first_failure: tuple[int, int] | None
    metrics: dict
    causes: list[Cause] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    def report(self) -> str:
        m = self.metrics
        lines = [f"check_linear: {'PASS' if self.passed else 'FAIL'} ({self.kind})  "
                 f"[{m['shape'][0]}x{m['shape'][1]}, K={m['K']}, x: {m['x_scheme']}, w: {m['w_scheme']}, "
                 f"accumulator {m['accumulator']}]"]
        lines.append(f"  vs quantization-aware reference: rel L2 {m['rel_l2']:.3e}, max |err| {m['max_abs_err']:.3e} "
                     f"at {tuple(m['max_at'])}, {m['mismatch_ratio']:.2%} of outputs over the gate, "
                     f"worst err/gate {m['impl_gate_frac']:.3g}")
        if m.get("quant_gate_frac") is not None:
            lines.append(f"  vs original inputs: SQNR {m['sqnr_db']:.1f} dB, worst err/K-gate {m['quant_gate_frac']:.3g}, "
                         f"worst err/sqrt(K) estimate {m['sqrtk_frac']:.3g}")
        if self.first_failure is not None:
            r, c = self.first_failure
            d = self.details
            lines.append(f"  first failure at row {r}, col {c}: got {d['got']:.9g}, reference {d['ref']:.9g}, "
                         f"|err| {d['err']:.3e} > gate {d['gate']:.3e} ({d['gate_rule']})")
            lines.append(f"  worst row {d['worst_row']} (max |err| {d['worst_row_err']:.3e}), "
                         f"worst column {d['worst_col']} (max |err| {d['worst_col_err']:.3e})")
        for c in self.causes:
            lines.append(f"  cause: {c}")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def _f64_2d(t, name: str) -> torch.Tensor:
    t = torch.as_tensor(t).detach().to("cpu")
    if t.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}; flatten leading dims to rows")
    return t


def _available_codes(fmt, symmetric: bool) -> int:
    if fmt.kind == "int":
        return (fmt.qmax - fmt.qmin + 1) - (1 if (symmetric and fmt.signed) else 0)
    return 2 ** fmt.bits - len(getattr(fmt, "nan_codes", ())) - len(getattr(fmt, "inf_codes", ()))


def check_linear(out, x, w, *, x_scheme=None, w_scheme=None, bias=None, accumulator: str | None = None,
                 out_dtype: torch.dtype | None = None, diagnose_failures: bool = True) -> Verdict:
    """Verify `out` ~ x @ w.T (+ bias) computed by a kernel that quantizes x and w by the schemes.

    out: kernel output [M, N] (any float dtype; its dtype is the output rounding unless
         out_dtype says otherwise). x: [M, K] float inputs, w: [N, K] float weights (the
         ORIGINAL values; lowbit quantizes them with its canonical quantizer). bias: [N] or None.
    x_scheme / w_scheme: QuantScheme, preset name, or None (that side not quantized).
    accumulator: what the kernel promises: "int32" (default when both sides are integer),
         "fp32" (default otherwise), "fp16", "bf16", "fp8_fast" (Hopper fp8 tensor cores without
         promotion: about 14 significant bits).
    Gate: |out - reference| <= implementation gate (lowbit.verify.tolerance), per element.
    """
    out_t = _f64_2d(out, "out")
    xt, wt = _f64_2d(x, "x"), _f64_2d(w, "w")
    M, K = xt.shape
    N = wt.shape[0]
    if wt.shape[1] != K:
        raise ValueError(f"w must be [N, K] with K={K} (out = x @ w.T), got {tuple(wt.shape)}")
    if tuple(out_t.shape) != (M, N):
        raise ValueError(f"out has shape {tuple(out_t.shape)}, expected ({M}, {N}) = (rows of x, rows of w)")
    out_dtype = out_dtype or (out_t.dtype if out_t.is_floating_point() else torch.float32)
    if isinstance(x_scheme, str):
        x_scheme = lb.get_preset(x_scheme)
    if isinstance(w_scheme, str):
        w_scheme = lb.get_preset(w_scheme)
    xq = lb.quantize(xt.float(), x_scheme) if x_scheme is not None else xt.double()
    wq = lb.quantize(wt.float(), w_scheme) if w_scheme is not None else wt.double()
    return check_quantized(out_t, xq, wq, bias=bias, accumulator=accumulator, out_dtype=out_dtype, x=xt, w=wt,
                           x_scheme=x_scheme, w_scheme=w_scheme, diagnose_failures=diagnose_failures)


def check_quantized(out, xq, wq, *, bias=None, accumulator: str | None = None, out_dtype: torch.dtype | None = None,
                    x=None, w=None, x_scheme=None, w_scheme=None, diagnose_failures: bool = True) -> Verdict:
    """check_linear on operands already quantized: `out` [M, N] ~ xq @ wq.T (+ bias), xq / wq
    QTensors, or float tensors used as they are (an unquantized side, or activations a static
    scale quantized, as their dequantized values). What `lowbit verify-model` checks a deployed
    layer with: the checkpoint holds the codes, not the float weights. x / w: the original float
    inputs when known (check_linear passes them, with their schemes): they add the SQNR against
    the unquantized product, the quantization bounds, the code census and the diagnoses that
    re-quantize (rounding rules, wrapped codes); without them those are left out."""
    out_t = torch.as_tensor(out).detach().to("cpu")
    M, N = out_t.shape
    K = xq.codes.shape[1] if hasattr(xq, "codes") else torch.as_tensor(xq).shape[1]
    out_dtype = out_dtype or (out_t.dtype if out_t.is_floating_point() else torch.float32)
    acc = accumulator or tol.default_accumulator(xq, wq)
    xt, wt = x, w
    out64 = out_t.double()
    ref = qlinear_reference(xq, wq, bias)
    gate = tol.implementation_gate(xq, wq, ref, accumulator=acc, out_dtype=out_dtype, bias=bias)
    b64 = None if bias is None else torch.as_tensor(bias).detach().cpu().double()
    orig = qgate = sgate = None
    if xt is not None and wt is not None:
        orig = xt.double() @ wt.double().T + (0 if b64 is None else b64)
        det, stat = tol.quantization_bounds(xt.float(), wt.float(), xq if x_scheme else None,
                                            wq if w_scheme else None)
        qgate, sgate = det + gate, stat + gate

    err = (out64 - ref).abs()
    bad = ~(err <= gate)                      # NaN counts as a failure
    passed = not bool(bad.any())
    first = None
    if not passed:
        flat = int(torch.nonzero(bad.reshape(-1))[0])
        first = divmod(flat, N)
    emax, where = mt.max_abs_err(out64, ref)
    metrics = {
        "shape": (M, N), "K": K, "accumulator": acc,
        "x_scheme": _scheme_name(xq, x_scheme), "w_scheme": _scheme_name(wq, w_scheme),
        "rel_l2": mt.rel_l2(out64, ref), "max_abs_err": emax, "max_at": where,
        "rms_err": mt.rms_err(out64, ref),
        "mismatch_ratio": float(bad.double().mean()),
        "impl_gate_frac": float(torch.nan_to_num(err / gate, nan=math.inf).max()),
    }
    if orig is not None:
        e_orig = (out64 - orig).abs()
        metrics.update(sqnr_db=mt.sqnr_db(orig, out64),
                       quant_gate_frac=float(torch.nan_to_num(e_orig / qgate, nan=math.inf).max()),
                       sqrtk_frac=float(torch.nan_to_num(e_orig / sgate, nan=math.inf).max()))
    warnings = []
    if metrics.get("sqrtk_frac", 0) > 1:
        warnings.append(f"error vs the original inputs is {metrics['sqrtk_frac']:.2f}x the sqrt(K) statistical "
                        f"estimate (diagnostic only): the quantization is coarser than independent rounding "
                        f"errors at this scheme's steps would give")
    for side, q, sch in (("w", wq, w_scheme), ("x", xq, x_scheme)):
        if sch is None or K < 2 * DEAD_CHANNEL_CODES:
            continue
        cen = mt.code_census(q.codes, _available_codes(sch.fmt, sch.symmetric))
        metrics[f"{side}_codes_worst"] = cen.describe()
        if cen.worst <= DEAD_CHANNEL_CODES and cen.available >= 2 * DEAD_CHANNEL_CODES:
            dead = int((cen.used <= DEAD_CHANNEL_CODES).sum())
            warnings.append(f"dead channels in {side}: {dead} channel(s) use <= {DEAD_CHANNEL_CODES} codes; worst: "
                            f"{cen.describe()} (one scale shared by channels of very different size: use per-channel "
                            f"or per-group scales)")
    details = {}
    if not passed:
        r, c = first
        wr = mt.worst_per_row(out64, ref)
        wc = mt.worst_per_col(out64, ref)
        details = {"got": float(out64[r, c]), "ref": float(ref[r, c]), "err": float(err[r, c]),
                   "gate": float(gate[r, c]),
                   "gate_rule": f"{acc} accumulator, gamma_n(u)*sum|x_q||w_q| + output rounding ({out_dtype})",
                   "worst_row": int(torch.nan_to_num(wr, nan=math.inf).argmax()),
                   "worst_row_err": float(wr.max()),
                   "worst_col": int(torch.nan_to_num(wc, nan=math.inf).argmax()),
                   "worst_col_err": float(wc.max())}
    kind, causes = "ok", []
    if not passed:
        kind = "logic"
        if diagnose_failures:
            ctx = Context(out=out64, ref=ref, gate=gate, x=None if xt is None else xt.float(),
                          w=None if wt is None else wt.float(), xq=xq, wq=wq, bias=bias,
                          orig_ref=orig, quant_gate=qgate, accumulator=acc, out_dtype=out_dtype)
            kind, causes = diagnose(ctx)
    return Verdict(passed, kind, first, metrics, causes, warnings, details)


def _scheme_name(q, scheme) -> str:
    if scheme is not None:
        return str(scheme)
    return str(q.scheme) if hasattr(q, "scheme") else "unquantized"
