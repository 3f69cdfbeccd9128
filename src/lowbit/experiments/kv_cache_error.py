"""Where a quantized KV cache's perplexity cost comes from, on the embedded model (SmolLM2-135M,
float32): each cache scheme applied to K and V, to K only and to V only, with static scales
calibrated on a chosen number of tokens; perplexity, KL from the unquantized-cache model (which
is the float model itself here, so KL is the cache's cost alone), top-1 agreement, and the share
of cached values beyond the calibrated range (static scales clip them).

    python -m lowbit.experiments.kv_cache_error --tokens 2048 --rows fp8:kv fp8:k fp8:v fp8-token:kv
    python -m lowbit.experiments.kv_cache_error --rows fp8:kv:8192      # static scales from 8,192 tokens

A row is SCHEME:SIDES[:CALIB_TOKENS] (SIDES: kv, k or v; CALIB_TOKENS default --calib-tokens).
"""
from __future__ import annotations

import argparse
import sys

import torch
from transformers.cache_utils import Cache, DynamicLayer

from lowbit.evaluation.evaluate import perplexity, prepare_reference, reference_logits, token_metrics
from lowbit.evaluation.workload import load_model, prepare_texts
from lowbit.nn.kv_cache import cache_kwarg, calibrate_kv_cache, num_decoder_layers
from lowbit.ops.kv_quant import KVScheme, quantize_kv
from lowbit.workflows.job import parse_kv_cache


class _SideLayer(DynamicLayer):
    """A cache layer that stores the chosen sides quantized (lowbit.ops.kv_quant) and the other
    unquantized, and counts values beyond a static scale's range."""

    def __init__(self, scheme: KVScheme, scales, sides: str, clip: dict):
        super().__init__()
        self.scheme, self.scales, self.sides, self.clip = scheme, scales, sides, clip

    def update(self, key_states, value_states, *args, **kwargs):
        out = []
        for side, x, s in (("k", key_states, self.scales[0]), ("v", value_states, self.scales[1])):
            if side not in self.sides:
                out.append(x)
                continue
            if s is not None:
                self.clip["over"] += int((x.abs() > s.to(x.device) * self.scheme.fmt.max).sum())
                self.clip["all"] += x.numel()
            out.append(quantize_kv(x, self.scheme, s, name=f"{side} states").dequantize(x.dtype))
        return super().update(out[0], out[1], *args, **kwargs)


def run_row(model, texts_eval, reference, scheme: KVScheme, sides: str, calib) -> dict:
    kv = calibrate_kv_cache(model, calib, scheme)
    n = num_decoder_layers(model)
    clip = {"over": 0, "all": 0}
    kw = cache_kwarg(model)

    def hook(module, args, kwargs):
        cache = Cache(layers=[_SideLayer(kv.scheme, kv.layer_scales(i), sides, clip) for i in range(n)])
        return args, {**kwargs, kw: cache, "use_cache": True}
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        t = token_metrics(model, texts_eval, reference, 512)
    finally:
        handle.remove()
    return {"ppl": t.perplexity, "kl": t.kl, "top1": t.top1,
            "clipped": clip["over"] / clip["all"] if clip["all"] else None}


def _parse_row(text: str, calib_tokens: int) -> tuple[KVScheme, str, int]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[1] not in ("kv", "k", "v"):
        raise ValueError(f"--rows {text!r}: give SCHEME:SIDES[:CALIB_TOKENS], SIDES kv, k or v (e.g. fp8:k)")
    return parse_kv_cache(parts[0]).scheme, parts[1], int(parts[2]) if len(parts) == 3 else calib_tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lowbit.experiments.kv_cache_error", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="evaluation tokens (windows of 512)")
    p.add_argument("--calib-tokens", type=int, default=1024, help="calibration tokens of static scales")
    p.add_argument("--rows", nargs="+", default=["fp8:kv", "fp8:k", "fp8:v", "fp8-token:kv", "int8-token:kv"])
    args = p.parse_args(argv)
    rows = [(r, *_parse_row(r, args.calib_tokens)) for r in args.rows]       # every row checked before loading
    loaded = load_model("smollm2")
    model = loaded.model.eval()
    texts = prepare_texts(loaded, args.tokens, args.calib_tokens, 512)
    calibs = {}
    with torch.no_grad():
        reference = prepare_reference(reference_logits(model, texts.eval_ids, 512))
        base = perplexity(model, texts.eval_ids, 512)
        print(f"SmolLM2-135M float32, {args.tokens} evaluation tokens; cache unquantized: perplexity {base:.4f}")
        print("| row | perplexity | rise | KL (nats) | top-1 | clipped |")
        print("|---|---|---|---|---|---|")
        for text, scheme, sides, n_cal in rows:
            if n_cal not in calibs:
                calibs[n_cal] = prepare_texts(loaded, 512, n_cal, 512).calib
            r = run_row(model, texts.eval_ids, reference, scheme, sides, calibs[n_cal])
            clipped = "-" if r["clipped"] is None else f"{r['clipped']:.1e}"
            print(f"| {text} | {r['ppl']:.4f} | {100 * (r['ppl'] / base - 1):+.3f}% | {r['kl']:.5f} | "
                  f"{100 * r['top1']:.2f}% | {clipped} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
