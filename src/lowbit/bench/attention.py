"""Attention over a quantized KV cache vs bf16 SDPA on one GPU, Llama-3-8B-shaped (32 query heads,
8 KV heads, head_dim 128), and whole decode steps of a few Llama-3-8B-shaped layers.

Rows (ratios are against bf16 measured in the same process; every timing is a CUDA-graph replay,
as a serving decode step runs, so neither side pays Python launch overhead):
  decode   one new token per sequence over a cache of 8k / 32k tokens, batch 1 and 16: KV bytes,
           time of lowbit's kernel (the one lowbit.ops.dispatch picks: split-KV) reading the fp8 /
           int8 cache, against the fastest bf16 SDPA backend torch offers for the same call
           (default, flash, cuDNN, memory-efficient: each that runs is timed, the best is the base)
  sweep    the split-KV kernel's warps and split count around its defaults (fp8 cache)
  step     one decode step of STEP_LAYERS layers (q/k/v, o, gate/up, down projections in bf16 or
           w4a16 + attention with the new token written to the cache), bf16 KV + SDPA (the backend
           fastest in the decode rows at that batch and context) vs fp8 KV + lowbit; the bound is what the bytes allow: (weights + bf16 KV) / (weights + fp8 KV)
  prefill  causal attention of a whole prompt (2k / 8k tokens, batch 1), fp8 cache, vs bf16 SDPA: lowbit's
           arithmetic (fp8 Q, fp8 P) in each tensor-core prefill configuration (prefill_candidates; the
           default heuristic's marked) and in the general kernel, and SDPA over the dequantized cache
           (the tuning table's alternative); Q's quantization is outside the timed call
  must     the issue's targets with the measured value and met / missed

    python -m lowbit.bench.attention --json attention.json      (or `lowbit bench --only attention`)
"""
from __future__ import annotations

import argparse
import sys

import lowbit as lb
from lowbit.bench.common import environment, write_run
from lowbit.ops import attention_reference as ar
from lowbit.ops.attention import attention_triton
from lowbit.ops.attention_sdpa import sdpa_attention
from lowbit.ops.kv_quant import KVScheme, observe_amax, quantize_kv, static_scale
from lowbit.ops.weight_only import prepare_w4, w4a16_linear
from lowbit.profiling import timing


HQ, HKV, D = 32, 8, 128
HIDDEN, INTER = 4096, 14336
DECODE = [(1, 8192), (16, 8192), (1, 32768), (16, 32768)]
PREFILL = [(1, 2048), (1, 8192)]
STEP = [(16, 32768), (1, 32768), (16, 8192), (1, 8192)]
STEP_LAYERS = 4
KV_SCHEMES = ["fp8", "fp8-head", "int8-head", "fp8-token"]
DEVICE = "cuda"
FP8_SPEC = dict(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn", p_block=64, causal=True)


def quantized_cache(kv_name, k, v):
    """(keys, values) as the cache holds them under the KV scheme `kv_name` (static schemes are
    calibrated on k, v themselves)."""
    sch = KVScheme.parse(kv_name)
    if sch.dynamic:
        return quantize_kv(k, sch), quantize_kv(v, sch)
    return (quantize_kv(k, sch, static_scale(observe_amax(k, sch), sch)),
            quantize_kv(v, sch, static_scale(observe_amax(v, sch), sch)))


def _time(fn, args, **kw):
    return timing.bench_ms(fn, [args], cuda_graph=DEVICE == "cuda", **kw)


def _timed(row: dict, base_ms: float, fn, args, **kw) -> dict:
    """row with its time (us) and ratio to the bf16 base, or with the error that stopped it: one
    failing configuration is reported as such and the others still run."""
    try:
        ms = _time(fn, args, **kw)
    except (RuntimeError, ValueError, TypeError) as exc:
        return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return {**row, "us": ms * 1e3, "vs_bf16": base_ms / ms}


def _sdpa_backends():
    """[(name, context factory)] of torch's SDPA backends to try; 'sdpa' is torch's own choice."""
    import contextlib

    import torch
    out = [("sdpa", contextlib.nullcontext)]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return out
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        be = getattr(SDPBackend, name, None)
        if be is not None and torch.cuda.is_available():
            out.append((f"sdpa-{name.split('_')[0].lower()}", lambda be=be: sdpa_kernel(be)))
    return out


def _best_sdpa(q, k, v, causal: bool, rows: list, base_row: dict, **kw) -> float:
    """Time bf16 SDPA under each backend that runs; append one row each; return the best ms."""
    import torch.nn.functional as F
    best = None
    for name, ctx in _sdpa_backends():
        def call(a, ctx=ctx):
            with ctx():
                return F.scaled_dot_product_attention(a, k, v, is_causal=causal, enable_gqa=True)
        try:
            call(q)
            ms = _time(call, (q,), **kw)
        except RuntimeError as exc:           # this backend does not take the call (shape, GQA, build)
            rows.append({**base_row, "kv": f"bf16 {name}", "error": str(exc).splitlines()[0][:160]})
            continue
        rows.append({**base_row, "kv": f"bf16 {name}", "us": ms * 1e3})
        best = ms if best is None else min(best, ms)
    if best is None:
        raise RuntimeError("no SDPA backend ran the bf16 baseline")
    for r in rows:
        if r.get("kv", "").startswith("bf16 ") and "us" in r and "vs_bf16" not in r:
            r["vs_bf16"] = best * 1e3 / r["us"]
    return best


def _decode_rows(only, quick) -> list[dict]:
    import torch

    from lowbit.ops.triton.attention import cache_bytes    # optional: triton
    from lowbit.ops.triton.attention_decode import (RESIDENT, launch_warps, pick_splits,    # optional: triton
                                                    split_kv_attention)
    from lowbit.ops.triton.common import num_sms    # optional: triton

    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for B, T in (DECODE[:2] if quick else DECODE):
        k = torch.randn(B, HKV, T, D, generator=gen, device=DEVICE).to(torch.bfloat16)
        v = torch.randn(B, HKV, T, D, generator=gen, device=DEVICE).to(torch.bfloat16)
        q = torch.randn(B, HQ, 1, D, generator=gen, device=DEVICE).to(torch.bfloat16)
        kv_bf16 = 2 * k.numel() * 2
        base_row = dict(bench="decode", B=B, T=T, kv_bytes=kv_bf16)
        sd = []
        base = _best_sdpa(q, k, v, False, sd, base_row)
        rows += sd
        specs = [("fp8 Q, fp8 P", ar.AttnSpec(**FP8_SPEC)),
                 ("bf16 Q, fp8 P", ar.AttnSpec(**{**FP8_SPEC, "q_format": None})),
                 ("fp8 Q, fp32 P", ar.AttnSpec(**{**FP8_SPEC, "p_format": None})),
                 # coarser P blocks (one scale per 128 keys): half the per-block softmax bookkeeping
                 ("fp8 Q, fp8 P/128", ar.AttnSpec(**{**FP8_SPEC, "p_block": 2 * FP8_SPEC["p_block"]}))]
        for name in KV_SCHEMES:
            if only and only not in name:
                continue
            kq, vq = quantized_cache(name, k.float(), v.float())
            for label, spec in (specs if name == "fp8" else specs[:1]):
                row = dict(bench="decode", B=B, T=T, kv=name, attn=label, kv_bytes=cache_bytes(kq, vq),
                           bytes_vs_bf16=cache_bytes(kq, vq) / kv_bf16)
                rows.append(_timed(row, base, lambda a: attention_triton(a, kq, vq, spec, out_dtype=torch.bfloat16),
                                   (q,)))
            if name == "fp8":
                for warps in ((4,) if quick else (1, 2, 4)):
                    _, auto = pick_splits(B, HKV, T, FP8_SPEC["p_block"], num_sms(), RESIDENT[warps])
                    for splits in sorted({max(1, auto // 2), auto, 2 * auto}):
                        spec = specs[0][1]
                        row = dict(bench="sweep", B=B, T=T, kv=name, attn=specs[0][0], warps=warps, splits=splits,
                                   default=(warps == launch_warps(16, B * HKV) and splits == auto))
                        rows.append(_timed(row, base, lambda a: split_kv_attention(
                            a, kq, vq, spec, out_dtype=torch.bfloat16, splits=splits, warps=warps), (q,)))
            del kq, vq
        del k, v
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def _weight_bytes(w) -> int:
    if hasattr(w, "packed"):                      # a prepared w4a16 weight: codes, scales, zero points
        return sum(t.numel() * t.element_size() for t in (w.packed, w.scale, w.zero_point) if t is not None)
    return w.numel() * w.element_size()


class _Layers:
    """STEP_LAYERS Llama-3-8B-shaped decoder layers (no norms or rotary: the same in both runs),
    weights bf16 or w4a16 (int4, groups of 128; built once by `weights`, shared), and a KV cache of T tokens per layer: bf16 (read by
    SDPA) or fp8 per tensor (read by lowbit's kernel). step(x) writes the new token's K / V into
    slot T - 1 (quantized for fp8) and attends over all T."""

    def __init__(self, B: int, T: int, weights: list, kind: str, kv: str, gen, sdpa_ctx=None):
        import contextlib

        import torch
        self.sdpa_ctx = sdpa_ctx or contextlib.nullcontext

        self.B, self.T, self.kv = B, T, kv
        self.pos = torch.full((1,), T - 1, dtype=torch.int32, device=DEVICE)   # the new token's slot
        self.spec = ar.AttnSpec(**FP8_SPEC)
        self.layers = []
        for ws in weights:
            k = torch.randn(B, HKV, T, D, generator=gen, device=DEVICE).to(torch.bfloat16)
            v = torch.randn(B, HKV, T, D, generator=gen, device=DEVICE).to(torch.bfloat16)
            cache = (k, v) if kv == "bf16" else quantized_cache("fp8", k.float(), v.float())
            del k, v
            self.layers.append((ws, cache))
        self.weight_bytes = sum(_weight_bytes(w) for ws in weights for w in ws)
        self.linear = self._linear_w4 if kind == "w4a16" else self._linear_bf16

    @staticmethod
    def weights(kind: str, gen) -> list:
        """STEP_LAYERS layers' [q/k/v, o, gate/up, down] weights, bf16 or prepared w4a16."""
        import torch
        shapes = [(HQ * D + 2 * HKV * D, HIDDEN), (HIDDEN, HQ * D), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
        out = []
        for _ in range(STEP_LAYERS):
            ws = [(torch.randn(n, kk, generator=gen, device=DEVICE) * kk ** -0.5).to(torch.bfloat16)
                  for n, kk in shapes]
            out.append([_Layers._w4(w) for w in ws] if kind == "w4a16" else ws)
        return out

    @staticmethod
    def _w4(w):
        return prepare_w4(lb.quantize(w, lb.QuantScheme(format="int4", strategy="group", group_size=128)))

    @staticmethod
    def _linear_bf16(x, w):
        return x @ w.T

    @staticmethod
    def _linear_w4(x, w):
        return w4a16_linear(x, w)

    def kv_bytes(self) -> int:
        from lowbit.ops.triton.attention import cache_bytes    # optional: triton
        return sum(cache_bytes(*c) for _, c in self.layers)

    def step(self, x):
        import torch
        import torch.nn.functional as F

        from lowbit.ops.triton.kv_append import append_kv    # optional: triton
        B, t = self.B, self.T - 1
        for (wqkv, wo, wgu, wd), (kc, vc) in self.layers:
            qkv = self.linear(x, wqkv)
            q = qkv[:, :HQ * D].reshape(B, HQ, 1, D)
            kn = qkv[:, HQ * D:(HQ + HKV) * D].reshape(B, HKV, 1, D)
            vn = qkv[:, (HQ + HKV) * D:].reshape(B, HKV, 1, D)
            if self.kv == "bf16":
                kc[:, :, t:t + 1] = kn
                vc[:, :, t:t + 1] = vn
                with self.sdpa_ctx():
                    a = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
            else:
                append_kv(kc, kn, self.pos)              # one launch each: quantize and store at pos
                append_kv(vc, vn, self.pos)
                a = attention_triton(q, kc, vc, self.spec, out_dtype=torch.bfloat16)
            h = x + self.linear(a.reshape(B, HQ * D), wo)
            gu = self.linear(h, wgu)
            x = h + self.linear(F.silu(gu[:, :INTER]) * gu[:, INTER:], wd)
        return x


def _step_rows(quick, sdpa_best: dict | None = None) -> list[dict]:
    """sdpa_best: {(B, T): SDPA backend name} (the fastest in the decode rows), used by the bf16 steps."""
    import torch
    rows = []
    backends = dict(_sdpa_backends())
    sdpa_best = sdpa_best or {}
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    weights = {}
    for kind in ("bf16", "w4a16"):
        try:
            weights[kind] = _Layers.weights(kind, gen)
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
            rows.append(dict(bench="step", B=0, T=0, layers=STEP_LAYERS, weights=kind, kv="-",
                             error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
    for B, T in (STEP[:1] if quick else STEP):
        for kind, ws in weights.items():
            got = {}
            for kv in ("bf16", "fp8"):
                sdpa = sdpa_best.get((B, T), "sdpa")
                row = dict(bench="step", B=B, T=T, layers=STEP_LAYERS, weights=kind, kv=kv,
                           **({"sdpa": sdpa} if kv == "bf16" else {}))
                try:
                    m = _Layers(B, T, ws, kind, kv, gen, backends.get(sdpa))
                    x = (torch.randn(B, HIDDEN, generator=gen, device=DEVICE) * 0.1).to(torch.bfloat16)
                    ms = _time(m.step, (x,), warmup=10, rep=40)
                except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
                    rows.append({**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
                    break
                got[kv] = (ms, m.weight_bytes, m.kv_bytes())
                rows.append({**row, "us": ms * 1e3, "weight_bytes": m.weight_bytes, "kv_bytes": m.kv_bytes()})
                del m
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            if len(got) == 2:
                (t16, w, kv16), (t8, _, kv8) = got["bf16"], got["fp8"]
                bound = (w + kv16) / (w + kv8)
                rows[-1].update(vs_bf16=t16 / t8, bound=bound, of_bound=(t16 / t8 - 1) / max(bound - 1, 1e-9))
    return rows


def _prefill_rows(quick) -> list[dict]:
    import torch

    from lowbit.ops.triton.attention import flash_attention    # optional: triton
    from lowbit.ops.triton.attention_prefill import (default_config, prefill_attention,    # optional: triton
                                                     prefill_candidates)

    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    for B, T in (PREFILL[:1] if quick else PREFILL):
        k = torch.randn(B, HKV, T, D, generator=gen, device=DEVICE).to(torch.bfloat16)
        v = torch.randn(B, HKV, T, D, generator=gen, device=DEVICE).to(torch.bfloat16)
        q = torch.randn(B, HQ, T, D, generator=gen, device=DEVICE).to(torch.bfloat16)
        flops = 4 * B * HQ * T * T * D / 2          # causal: half of QK^T and PV
        base_row = dict(bench="prefill", B=B, T=T)
        sd = []
        base = _best_sdpa(q, k, v, True, sd, base_row, warmup=5, rep=20)
        for r in sd:
            if "us" in r:
                r["tflops"] = flops / r["us"] / 1e6
        rows += sd
        kq, vq = quantized_cache("fp8", k.float(), v.float())
        q_vals, q_scale = ar.quantize_q_parts(q, "fp8_e4m3fn")
        spec = ar.AttnSpec(**FP8_SPEC)
        D_ = q.shape[-1]
        default = default_config(D_, T, spec.p_block)
        # lowbit's arithmetic (fp8 Q, fp8 P): each tensor-core prefill configuration a tuning table may
        # pick, and the general kernel; then the table's other choice, SDPA over the dequantized cache
        runs = [(f"prefill {cfg}", dict(config=str(cfg), default=cfg == default),
                 lambda a, cfg=cfg: prefill_attention(a, kq, vq, spec, q_scale=q_scale, out_dtype=torch.bfloat16,
                                                      config=cfg), (q_vals,))
                for cfg in prefill_candidates(D_, T, spec.p_block)]
        runs.append(("flash (general)", {}, lambda a: flash_attention(a, kq, vq, spec, q_scale=q_scale,
                                                                      out_dtype=torch.bfloat16), (q_vals,)))
        runs.append(("sdpa over dequantized", dict(scratch_bytes=2 * kq.codes.numel() * 2),
                     lambda a: sdpa_attention(a, kq, vq, spec, out_dtype=torch.bfloat16), (q,)))
        for label, extra, fn, args in runs:
            head = dict(bench="prefill", B=B, T=T, kv="fp8", attn=label, **extra)
            try:
                row = _timed(head, base, fn, args, warmup=5, rep=20)
            except Exception as exc:        # noqa: BLE001 -- a configuration Triton cannot build here (out of
                # resources, compile error) is reported as that row's error; the other rows still run
                row = {**head, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
            if "us" in row:
                row["tflops"] = flops / row["us"] / 1e6
            rows.append(row)
        del k, v, q
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def must_rows(rows: list[dict]) -> list[dict]:
    """The issue's targets against the rows: met / missed with the value (a target whose rows are
    absent is 'not measured', never met)."""
    out = []

    def add(target, need, value, ok, note=""):
        out.append(dict(bench="must", target=target, must=need, value=value,
                        status="not measured" if value is None else ("met" if ok else "missed"), note=note))

    dec = [r for r in rows if r["bench"] == "decode" and "vs_bf16" in r and r.get("attn") == "fp8 Q, fp8 P"]
    for name in ("fp8", "int8-head"):
        b = [r["bytes_vs_bf16"] for r in dec if r["kv"] == name]
        # the codes halve; the static scales add 8 bytes per layer (per tensor) or per KV head
        add(f"KV bytes {name} vs bf16", "0.5x", max(b) if b else None, b and max(b) <= 0.51)
    for g in (32, 64):
        b4 = _int4_bytes_ratio(g)
        add(f"KV bytes int4-g{g} (scales included) vs bf16", "<= 0.3x", b4, b4 <= 0.3,
            "" if b4 <= 0.3 else f"the fp32 scales add {32 / g:.0f} bits per value: int4-g64 or coarser meets it")
    for B in (1, 16):
        r = [x["vs_bf16"] for x in dec if x["kv"] == "fp8" and x["T"] == 32768 and x["B"] == B]
        add(f"attention, decode B={B} T=32k, fp8 KV vs bf16 SDPA", ">= 1.6x", r[0] if r else None, r and r[0] >= 1.6)
    pre = [r for r in rows if r["bench"] == "prefill" and r.get("kv") == "fp8" and "vs_bf16" in r]
    for T in sorted({r["T"] for r in rows if r["bench"] == "prefill"}):
        at = [r for r in pre if r["T"] == T]
        best = max(at, key=lambda r: r["vs_bf16"]) if at else None
        lowbit = [r for r in at if r["attn"].startswith(("prefill", "flash"))]
        top = max(lowbit, key=lambda r: r["vs_bf16"]) if lowbit else None
        add(f"attention prefill T={T}, fp8 KV (fastest path) vs best bf16 SDPA", ">= 1.0x",
            best["vs_bf16"] if best else None, best and best["vs_bf16"] >= 1.0,
            (f"{best['attn']}; lowbit's arithmetic at best {top['vs_bf16']:.2f}x ({top['attn']})" if top else
             best["attn"]) if best else "")
    st = [r for r in rows if r["bench"] == "step" and "bound" in r and r["T"] == 32768]
    for w in ("bf16", "w4a16"):
        r = [x for x in st if x["B"] == 16 and x["weights"] == w]
        add(f"whole decode step B=16 T=32k ({w} weights), fp8 KV vs bf16 KV", ">= 1.4x",
            r[0]["vs_bf16"] if r else None, r and r[0]["vs_bf16"] >= 1.4)
        r = [x for x in st if x["B"] == 1 and x["weights"] == w]
        add(f"whole decode step B=1 T=32k ({w} weights): gain vs the bytes' bound", "report",
            r[0]["vs_bf16"] if r else None, True,
            f"bound {r[0]['bound']:.3f}x, {r[0]['of_bound']:.0%} of the possible gain" if r else "")
    return out


def _int4_bytes_ratio(group: int = 32) -> float:
    """KV bytes of an int4-g<group> cache as lowbit stores it (codes two per byte, fp32 scales
    included: KVQuant.nbytes of a real cache) over bf16's."""
    import torch

    x = torch.randn(1, HKV, 64, -(-D // group) * group)   # a whole number of groups per head
    return quantize_kv(x, KVScheme("int4", "group", group)).nbytes() / (x.numel() * 2)


def run(only: str | None = None, quick: bool = False, prefill_only: bool = False) -> list[dict]:
    if prefill_only:
        rows = _prefill_rows(quick)
        rows += must_rows(rows)
        for r in rows:
            _print(r)
        return rows
    rows = _decode_rows(only, quick)
    for r in rows:
        _print(r)
    if not only:
        best = {}
        for r in rows:
            if r["bench"] == "decode" and r["kv"].startswith("bf16 ") and "us" in r:
                key = (r["B"], r["T"])
                if key not in best or r["us"] < best[key][1]:
                    best[key] = (r["kv"][len("bf16 "):], r["us"])
        step = _step_rows(quick, {k: name for k, (name, _) in best.items()})
        for r in step:
            _print(r)
        pre = _prefill_rows(quick)
        for r in pre:
            _print(r)
        rows += step + pre
        must = must_rows(rows)
        for r in must:
            _print(r)
        rows += must
    return rows


def _print(r: dict) -> None:
    if r["bench"] == "must":
        v = "-" if r["value"] is None else f"{r['value']:.3f}"
        print(f"must     {r['target']:62s} {r['must']:8s} {v:>8s}  {r['status']}  {r['note']}", flush=True)
        return
    head = f"{r['bench']:8s} B={r['B']:<3d} T={r['T']:<6d} {r['kv']:16s}"
    if "error" in r:
        print(f"{head} not run: {r['error']}", flush=True)
        return
    if r["bench"] == "step":
        extra = f" {r['weights']:6s} W {r['weight_bytes'] / 2**30:5.2f} GiB KV {r['kv_bytes'] / 2**30:6.2f} GiB"
        tail = f" x{r['vs_bf16']:.2f} (bound x{r['bound']:.2f})" if "vs_bf16" in r else ""
        print(f"{head}{extra} {r['us']:10.1f} us{tail}", flush=True)
        return
    extra = f" {r.get('attn', ''):14s}"
    if r["bench"] == "prefill" and "attn" in r:
        extra = f" {r['attn']:22s}{'*' if r.get('default') else ' '}"
    if r["bench"] == "sweep":
        extra += f" warps {r['warps']} splits {r['splits']:<3d}{' (default)' if r['default'] else ''}"
    elif "kv_bytes" in r:
        extra += f" KV {r['kv_bytes'] / 2**20:9.1f} MiB"
    elif "tflops" in r:
        extra += f" {r['tflops']:6.1f} TF/s"
    print(f"{head}{extra} {r['us']:10.1f} us  x{r.get('vs_bf16', 0):.2f} vs bf16", flush=True)


def main(argv=None) -> int:
    import torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--prefill-only", action="store_true", help="only the prefill rows and their must")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("lowbit.bench.attention times GPU kernels: no CUDA GPU here", file=sys.stderr)
        return 2
    rows = run(None, a.quick, a.prefill_only)
    if a.json:
        write_run(a.json, environment(), rows)
        print(f"# wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
