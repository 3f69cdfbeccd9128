"""check_attention: a correct kernel passes, each planted bug fails and is named first.

The "kernels" here are tests/attention_fixtures.py's float32 flash-attention loop (independent of
lowbit.ops.attention's torch path and of the float64 reference), with one bug switched on at a time.
"""
import pytest
import torch

from lowbit.ops import attention_reference as ar
from lowbit.ops.attention import attention
from lowbit.ops.kv_quant import KVScheme, observe_amax, quantize_kv, static_scale
from lowbit.verify.attention import check_attention
from attention_fixtures import flash_attention


def _data(rng, B=2, Hq=4, Hkv=2, Tq=24, Tk=24, D=24, spread=True):
    q = torch.randn(B, Hq, Tq, D, generator=rng) * 1.5
    k = torch.randn(B, Hkv, Tk, D, generator=rng)
    v = torch.randn(B, Hkv, Tk, D, generator=rng)
    if spread:  # heads of different size, as real models have: per-head scales then matter
        f = torch.tensor([1.0, 3.0, 0.5, 2.0][:Hkv]).reshape(1, Hkv, 1, 1)
        k, v = k * f, v * f.flip(1)
    return q, k, v


def _cache(k, v, scheme):
    if scheme.dynamic:
        return quantize_kv(k, scheme), quantize_kv(v, scheme)
    return (quantize_kv(k, scheme, static_scale(observe_amax(k, scheme), scheme)),
            quantize_kv(v, scheme, static_scale(observe_amax(v, scheme), scheme)))


SCHEMES = [KVScheme("fp8", "head"), KVScheme("int8", "tensor"), KVScheme("fp8", "token"), KVScheme("int4", "group", 8)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("p_format", ["fp8_e4m3fn", "int8", None])
def test_correct_kernels_pass(rng, scheme, p_format):
    q, k, v = _data(rng)
    kq, vq = _cache(k, v, scheme)
    spec = ar.AttnSpec(q_format="fp8_e4m3fn", p_format=p_format, p_block=16, causal=True)
    q_hat = ar.quantize_q(q, spec.q_format)
    for out in (flash_attention(q_hat, kq.dequantize(), vq.dequantize(), spec), attention(q, kq, vq, spec, backend="torch")):
        verdict = check_attention(out, q, kq, vq, spec, k_float=k, v_float=v)
        assert verdict.passed, verdict.report()
        assert verdict.kind == "ok" and verdict.metrics["impl_gate_frac"] <= 1.0


BUGS = ["p_scale_per_tensor", "o_accumulated_bf16", "o_accumulated_fp16", "rescale_skipped",
        "rescale_wrong_accumulator", "causal_mask_after_p"]


@pytest.mark.parametrize("bug", BUGS)
def test_planted_softmax_bugs_named_first(rng, bug):
    q, k, v = _data(rng, Tq=48, Tk=48)
    # a growing running max in every row makes the rescale matter: later keys get larger scores
    k = k * torch.linspace(0.5, 2.0, k.shape[2]).reshape(1, 1, -1, 1)
    kq, vq = _cache(k, v, KVScheme("fp8", "token"))
    spec = ar.AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn", p_block=16, causal=True)
    out = flash_attention(ar.quantize_q(q, spec.q_format), kq.dequantize(), vq.dequantize(), spec, bug=bug)
    verdict = check_attention(out, q, kq, vq, spec)
    assert not verdict.passed, f"planted {bug} went unnoticed: {verdict.report()}"
    assert verdict.causes[0].name == bug, verdict.report()
    assert verdict.causes[0].confirmed


def _bugged_cache_out(q, kq, vq, spec, k_hat=None, v_hat=None):
    return flash_attention(ar.quantize_q(q, spec.q_format), kq.dequantize() if k_hat is None else k_hat,
                    vq.dequantize() if v_hat is None else v_hat, spec)


@pytest.mark.parametrize("side", ["k", "v"])
def test_per_head_scale_read_per_tensor_named(rng, side):
    q, k, v = _data(rng)
    kq, vq = _cache(k, v, KVScheme("fp8", "head"))
    spec = ar.AttnSpec(p_block=16, causal=False)
    t = kq if side == "k" else vq
    wrong = (t.decoded() * t.scale[:, :1]).float()
    out = _bugged_cache_out(q, kq, vq, spec, **{f"{side}_hat": wrong})
    verdict = check_attention(out, q, kq, vq, spec)
    assert not verdict.passed and verdict.causes[0].name == f"{side}_scale_per_tensor", verdict.report()


def test_v_scale_forgotten_named(rng):
    q, k, v = _data(rng)
    kq, vq = _cache(k, v, KVScheme("int8", "tensor"))
    spec = ar.AttnSpec(p_block=16)
    out = _bugged_cache_out(q, kq, vq, spec, v_hat=vq.decoded())
    verdict = check_attention(out, q, kq, vq, spec)
    assert not verdict.passed and verdict.causes[0].name == "v_scale_missing", verdict.report()


def test_wrong_layer_scale_named(rng):
    q, k, v = _data(rng)
    scheme = KVScheme("fp8", "head")
    kq, vq = _cache(k, v, scheme)
    k2, v2 = _data(rng)[1:]
    kq2, vq2 = _cache(k2 * 1.7, v2 * 0.6, scheme)
    spec = ar.AttnSpec(p_block=16)
    out = _bugged_cache_out(q, kq, vq, spec, k_hat=(kq.decoded() * kq2.scale), v_hat=(vq.decoded() * vq2.scale))
    verdict = check_attention(out, q, kq, vq, spec, other_layer_scales=[(kq2.scale, vq2.scale)])
    assert not verdict.passed and verdict.causes[0].name == "kv_scale_wrong_layer", verdict.report()


def test_report_and_shape_errors(rng):
    q, k, v = _data(rng, Tq=4, Tk=20)
    kq, vq = _cache(k, v, KVScheme("fp8", "token"))
    spec = ar.AttnSpec(p_block=16)
    out = attention(q, kq, vq, spec, backend="torch")
    text = check_attention(out, q, kq, vq, spec).report()
    assert "PASS" in text and "fp8_e4m3fn token" in text
    with pytest.raises(ValueError, match="q's shape"):
        check_attention(out[:, :, :2], q, kq, vq, spec)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        check_attention(out, q[:, :3], kq, vq, spec)
