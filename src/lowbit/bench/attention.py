"""Attention over a quantized KV cache vs bf16 SDPA on one GPU, Llama-3-8B-shaped (32 query heads,
8 KV heads, head_dim 128).

Rows (one layer's attention; ratios are against bf16 SDPA measured in the same process):
  decode   one new token per sequence over a cache of 8k / 32k tokens, batch 1 and 16: KV bytes,
           step time of lowbit's kernel reading the fp8 / int8 cache (dequantized in registers)
  prefill  causal attention of a whole prompt (2k / 8k tokens, batch 1): fp8 cache + fp8 P vs bf16

    python -m lowbit.bench.attention --json attention.json      (or `lowbit bench --only attention`)
"""
from __future__ import annotations

import argparse
import json
import sys

HQ, HKV, D = 32, 8, 128
DECODE = [(1, 8192), (16, 8192), (1, 32768), (16, 32768)]
PREFILL = [(1, 2048), (1, 8192)]
KV_SCHEMES = ["fp8", "fp8-head", "int8-head", "fp8-token"]
DEVICE = "cuda"


def _cache(kv_name, k, v):
    from lowbit.ops.kv_quant import KVScheme, observe_amax, quantize_kv, static_scale
    sch = KVScheme.parse(kv_name)
    if sch.dynamic:
        return quantize_kv(k, sch), quantize_kv(v, sch)
    return (quantize_kv(k, sch, static_scale(observe_amax(k, sch), sch)),
            quantize_kv(v, sch, static_scale(observe_amax(v, sch), sch)))


def run(only: str | None = None, quick: bool = False) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from lowbit.ops import attention_reference as ar
    from lowbit.ops.triton.attention import _mma_ok, cache_bytes, flash_attention
    from lowbit.profiling.timing import bench_ms

    rows = []
    gen = torch.Generator().manual_seed(0)
    decode = DECODE[:2] if quick else DECODE
    for B, T in decode:
        k = torch.randn(B, HKV, T, D, generator=gen).to(DEVICE, torch.bfloat16)
        v = torch.randn(B, HKV, T, D, generator=gen).to(DEVICE, torch.bfloat16)
        q = torch.randn(B, HQ, 1, D, generator=gen).to(DEVICE, torch.bfloat16)
        base = bench_ms(lambda a: F.scaled_dot_product_attention(a, k, v, enable_gqa=True), [(q,)])
        kv_bf16 = 2 * k.numel() * 2
        rows.append(dict(bench="decode", B=B, T=T, kv="bf16 sdpa", kv_bytes=kv_bf16, us=base * 1e3, vs_bf16=1.0))
        for name in KV_SCHEMES:
            if only and only not in name:
                continue
            kq, vq = _cache(name, k.float(), v.float())
            for pf in ("fp8_e4m3fn", None):
                spec = ar.AttnSpec(q_format=None, p_format=pf, p_block=64, causal=True)
                ms = bench_ms(lambda a: flash_attention(a, kq, vq, spec, out_dtype=torch.bfloat16), [(q,)])
                rows.append(dict(bench="decode", B=B, T=T, kv=name, p=pf or "fp32", mma=_mma_ok(q, True, kq, vq, spec),
                                 kv_bytes=cache_bytes(kq, vq),
                                 us=ms * 1e3, vs_bf16=base / ms, bytes_vs_bf16=cache_bytes(kq, vq) / kv_bf16))
        del k, v
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for B, T in (PREFILL[:1] if quick else PREFILL):
        k = torch.randn(B, HKV, T, D, generator=gen).to(DEVICE, torch.bfloat16)
        v = torch.randn(B, HKV, T, D, generator=gen).to(DEVICE, torch.bfloat16)
        q = torch.randn(B, HQ, T, D, generator=gen).to(DEVICE, torch.bfloat16)
        base = bench_ms(lambda a: F.scaled_dot_product_attention(a, k, v, is_causal=True, enable_gqa=True), [(q,)],
                        warmup=5, rep=20)
        flops = 4 * B * HQ * T * T * D / 2          # causal: half of QK^T and PV
        rows.append(dict(bench="prefill", B=B, T=T, kv="bf16 sdpa", us=base * 1e3, tflops=flops / base / 1e9,
                         vs_bf16=1.0))
        kq, vq = _cache("fp8", k.float(), v.float())
        q_vals, q_scale = ar.quantize_q_parts(q, "fp8_e4m3fn")
        spec = ar.AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn", p_block=64, causal=True)
        ms = bench_ms(lambda a: flash_attention(a, kq, vq, spec, q_scale=q_scale, out_dtype=torch.bfloat16),
                      [(q_vals,)], warmup=5, rep=20)
        rows.append(dict(bench="prefill", B=B, T=T, kv="fp8", p="fp8_e4m3fn", us=ms * 1e3,
                         tflops=flops / ms / 1e9, vs_bf16=base / ms))
        del k, v, q
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        _print(r)
    return rows


def _print(r: dict) -> None:
    extra = f" KV {r['kv_bytes'] / 2**20:9.1f} MiB" if "kv_bytes" in r else f" {r.get('tflops', 0):6.1f} TF/s"
    mode = {True: "mma", False: "fp32-dot"}.get(r.get("mma"), "")
    print(f"{r['bench']:8s} B={r['B']:<3d} T={r['T']:<6d} {r['kv']:10s} P {r.get('p', '-'):10s} {mode:8s}{extra} "
          f"{r['us']:10.1f} us  x{r['vs_bf16']:.2f} vs bf16 SDPA", flush=True)


def main(argv=None) -> int:
    import torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("lowbit.bench.attention times GPU kernels: no CUDA GPU here", file=sys.stderr)
        return 2
    from lowbit.bench.common import environment
    rows = run(None, a.quick)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(environment=environment(), rows=rows), f, indent=1, default=str)
        print(f"# wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
