"""The tensor-core prefill kernel (every candidate configuration) and the SDPA fallback against their
float64 references' derived gates on small odd shapes (lengths not tile multiples, Tq != Tk, GQA
groups 1 and 4, head_dim 64 / 80 / 96); the dispatch's choice and last_path; refusals."""
import pytest
import torch

from lowbit.ops import attention_reference as ar
from lowbit.ops.attention import attention, attention_triton, last_path, prefill_options
from lowbit.ops.attention_sdpa import scratch_bytes, sdpa_attention
from lowbit.ops.kv_quant import KVScheme, observe_amax, quantize_kv, static_scale
from lowbit.ops.triton.attention_prefill import (PrefillConfig, default_config, prefill_attention,
                                                 prefill_candidates)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _kv(rng, B, Hkv, Tk, D, k_scheme, v_scheme):
    k = torch.randn(B, Hkv, Tk, D, generator=rng) * torch.linspace(0.5, 2, Hkv).reshape(1, Hkv, 1, 1)
    v = torch.randn(B, Hkv, Tk, D, generator=rng)
    out = []
    for x, sch in ((k, k_scheme), (v, v_scheme)):
        if sch is None:
            out.append(x.to(torch.bfloat16).to(DEV))
        elif sch.dynamic:
            out.append(quantize_kv(x, sch).to(DEV))
        else:
            out.append(quantize_kv(x, sch, static_scale(observe_amax(x, sch), sch)).to(DEV))
    return out


def _deq(t):
    return t.to("cpu").dequantize() if hasattr(t, "scheme") else t.cpu().float()


def _check(out, q, kq, vq, spec, out_dtype=torch.float32):
    ref = ar.attention_reference(ar.quantize_q(q.cpu().float(), spec.q_format), _deq(kq), _deq(vq), spec,
                                 out_dtype=out_dtype)
    assert bool(torch.isfinite(out).all())
    worst = float(((out.cpu().double() - ref.out).abs() / ref.gate).max())
    assert worst <= 1.0, f"worst err/gate {worst:.3g}"


FP8_T, FP8_H, FP8_TOK, INT8_H = (KVScheme("fp8", "tensor"), KVScheme("fp8", "head"), KVScheme("fp8", "token"),
                                 KVScheme("int8", "head"))
CASES = [  # B, Hq, Hkv, Tq, Tk, D, K scheme, V scheme, P format, causal
    (1, 4, 1, 37, 45, 64, FP8_T, FP8_T, "fp8_e4m3fn", True),       # GQA 4, Tq != Tk, bottom-right causal
    (1, 2, 2, 19, 19, 80, FP8_H, FP8_H, "fp8_e4m3fn", True),       # no GQA, head_dim 80 (masked lanes)
    (2, 4, 1, 20, 33, 96, INT8_H, INT8_H, "int8", False),          # int8 codes and P, full attention
    (1, 4, 1, 70, 70, 64, FP8_TOK, FP8_H, "fp8_e4m3fn", True),     # K per token, V per head
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Tq{c[3]}-Tk{c[4]}-D{c[5]}-G{c[1] // c[2]}-{c[6]}-{c[8]}")
def test_prefill_kernel_within_gate(rng, case):
    B, Hq, Hkv, Tq, Tk, D, ks, vs, pf, causal = case
    kq, vq = _kv(rng, B, Hkv, Tk, D, ks, vs)
    q = (torch.randn(B, Hq, Tq, D, generator=rng) * 1.5).to(DEV)
    spec = ar.AttnSpec(q_format="int8" if pf == "int8" else "fp8_e4m3fn", p_format=pf, p_block=16, causal=causal)
    vals, scale = ar.quantize_q_parts(q, spec.q_format)
    _check(prefill_attention(vals, kq, vq, spec, q_scale=scale, config=PrefillConfig(32, 4, 2)), q, kq, vq, spec)


def _timed_candidates():
    """Every candidate on the GPU; in the interpreter (where warps and stages change nothing) one per block_m."""
    out, seen = [], set()
    for c in prefill_candidates(64, 4096, 64):
        if DEV == "cuda" or c.block_m not in seen:
            out.append(c)
            seen.add(c.block_m)
    return out


@pytest.mark.parametrize("cfg", _timed_candidates(), ids=str)
def test_every_candidate_within_gate(rng, cfg):
    """Each configuration the tuner may pick: rows split over several query blocks (Tq > block_m for
    the 64-row ones), diagonal and full key blocks, a key tail, bf16 output."""
    kq, vq = _kv(rng, 1, 1, 150, 64, FP8_T, FP8_T)
    q = torch.randn(1, 2, 140, 64, generator=rng).to(DEV)
    spec = ar.AttnSpec(p_block=16, causal=True)
    vals, scale = ar.quantize_q_parts(q, spec.q_format)
    out = prefill_attention(vals, kq, vq, spec, q_scale=scale, out_dtype=torch.bfloat16, config=cfg)
    _check(out, q, kq, vq, spec, out_dtype=torch.bfloat16)


def test_prefill_bf16_q_and_cache(rng):
    kb, vb = _kv(rng, 1, 2, 41, 64, None, None)
    q = torch.randn(1, 4, 41, 64, generator=rng).to(torch.bfloat16).to(DEV)
    spec = ar.AttnSpec(q_format=None, p_block=16, causal=True)
    _check(prefill_attention(q, kb, vb, spec, config=PrefillConfig(16, 4, 1)), q.float(), kb, vb, spec)


def test_dispatch_runs_prefill_and_records_the_path(rng):
    kq, vq = _kv(rng, 1, 1, 40, 64, FP8_H, FP8_H)
    q = torch.randn(1, 4, 40, 64, generator=rng).to(DEV)               # 160 rows: past split-KV's tile
    spec = ar.AttnSpec(p_block=16)
    out = attention_triton(q, kq, vq, spec, config=PrefillConfig(32, 4, 1))
    assert last_path() == "prefill[m32w4s1]"
    _check(out, q, kq, vq, spec)
    attention_triton(q, kq, vq, spec, kernel="flash")
    assert last_path() == "flash"
    kt, vt = _kv(rng, 1, 1, 40, 64, FP8_TOK, FP8_TOK)                  # V per token: the general kernel
    attention_triton(q, kt, vt, spec)
    assert last_path() == "flash"
    with pytest.raises(ValueError, match="v: scales per token"):
        attention_triton(q, kt, vt, spec, kernel="prefill")


def test_every_prefill_option_runs_through_attention_triton(rng):
    """What the tuner iterates: each (kernel, config) runs through attention_triton and says so in last_path."""
    kq, vq = _kv(rng, 1, 1, 40, 64, FP8_H, FP8_H)
    q = torch.randn(1, 4, 40, 64, generator=rng).to(DEV)
    spec = ar.AttnSpec(p_block=16)
    opts = prefill_options(64, 40, 16)
    assert [k for k, _ in opts][-2:] == ["flash", "sdpa"] and all(k == "prefill" for k, _ in opts[:-2])
    for kernel, cfg in opts[:1] + opts[-2:]:
        out = attention_triton(q, kq, vq, spec, kernel=kernel, config=cfg)
        assert last_path() == (f"prefill[{cfg}]" if cfg else kernel)
        assert out.shape == q.shape and bool(torch.isfinite(out).all())


def test_candidates_and_default():
    c = prefill_candidates(128, 2048, 64)
    assert 1 <= len(c) <= 8 and len(set(c)) == len(c)
    assert default_config(128, 2048, 64) == PrefillConfig(128, 8, 2)
    assert all(x.block_m <= 64 for x in prefill_candidates(128, 40, 64))
    assert default_config(256, 2048, 64).block_m == 64
    with pytest.raises(ValueError, match="num_warps"):
        PrefillConfig(128, 2, 2)


SDPA_CASES = [  # B, Hq, Hkv, Tq, Tk, D, scheme, causal
    (1, 4, 1, 37, 45, 64, FP8_T, True), (1, 2, 2, 19, 19, 80, KVScheme("fp8", "token"), True),
    (2, 4, 1, 20, 33, 96, INT8_H, False), (1, 4, 2, 24, 24, 64, None, True)]


@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: f"Tq{c[3]}-Tk{c[4]}-D{c[5]}-{c[6]}-{c[7]}")
def test_sdpa_fallback_within_its_gate(rng, case):
    B, Hq, Hkv, Tq, Tk, D, sch, causal = case
    kq, vq = _kv(rng, B, Hkv, Tk, D, sch, sch)
    q = torch.randn(B, Hq, Tq, D, generator=rng).to(torch.bfloat16).to(DEV)
    spec = ar.AttnSpec(causal=causal)
    out = attention(q, kq, vq, spec, backend="sdpa", out_dtype=torch.float32)
    assert last_path() == "sdpa"
    ref = ar.sdpa_bf16_reference(q, _deq(kq), _deq(vq), causal, out_dtype=torch.bfloat16)
    worst = float(((out.cpu().double() - ref.out).abs() / ref.gate).max())
    assert worst <= 1.0, f"worst err/gate {worst:.3g}"


def test_sdpa_scratch_is_reused(rng):
    kq, vq = _kv(rng, 1, 1, 30, 64, FP8_T, FP8_T)
    q = torch.randn(1, 2, 30, 64, generator=rng).to(torch.bfloat16).to(DEV)
    spec = ar.AttnSpec()
    sdpa_attention(q, kq, vq, spec)
    held = scratch_bytes()
    assert held >= 2 * 30 * 64 * 2
    for _ in range(3):
        sdpa_attention(q, kq, vq, spec)
    kq2, vq2 = _kv(rng, 1, 1, 20, 64, FP8_T, FP8_T)                    # smaller: a view of the same buffer
    sdpa_attention(q[:, :, :20], kq2, vq2, spec)
    assert scratch_bytes() == held


def test_sdpa_gate_catches_a_wrong_scale(rng):
    """The sdpa reference's gate is tight enough to see V's scale forgotten."""
    kq, vq = _kv(rng, 1, 1, 30, 64, FP8_T, FP8_T)
    q = torch.randn(1, 2, 30, 64, generator=rng).to(torch.bfloat16)
    out = sdpa_attention(q.to(DEV), kq, vq, ar.AttnSpec()).float().cpu()
    ref = ar.sdpa_bf16_reference(q, _deq(kq), _deq(vq).mul(1.01), True, out_dtype=torch.bfloat16)
    assert float(((out.double() - ref.out).abs() / ref.gate).max()) > 1.0


@pytest.mark.parametrize("sch", [FP8_T, FP8_H, FP8_TOK, KVScheme("int8", "token")], ids=str)
def test_kv_dequant_kernel_is_bit_exact(rng, sch):
    """The one-launch dequantization the sdpa path runs on CUDA: bit for bit KVQuant.dequantize's
    fp32 values rounded to bf16 (odd head_dim, a token count no tile multiple)."""
    from lowbit.ops.triton.kv_dequant import dequantize_bf16_into
    kq, _ = _kv(rng, 2, 3, 11, 40, sch, sch)
    out = torch.empty(kq.shape, dtype=torch.bfloat16, device=DEV)
    dequantize_bf16_into(kq, out)
    assert torch.equal(out.cpu(), kq.to("cpu").dequantize(torch.float32).to(torch.bfloat16))


def test_tuning_table_chooses_the_prefill_path(rng):
    """A tuning table's attention cell (kind, head_dim, GQA group, bucket of Tq) picks the prefill
    path: SDPA over the dequantized cache ("dequant"), or a kernel and its tiles; without a cell the
    dispatch's own choice stands. Every path's output is checked against its own reference."""
    from lowbit.ops import attention as attn
    from lowbit.ops import tuning
    kq, vq = _kv(rng, 1, 1, 40, 64, FP8_H, FP8_H)
    q = torch.randn(1, 4, 40, 64, generator=rng).to(DEV)
    spec = ar.AttnSpec(p_block=16)
    kind = attn.attention_kind(kq, vq, spec)
    cells = {"dequant": None, "kernel": {"kernel": "prefill", "block_m": 32, "num_warps": 4, "num_stages": 1}}
    try:
        for path, cfg in cells.items():
            cell = tuning.Cell("attention", kind, 64, 4, tuning.bucket(40), path, cfg)
            tuning.reset(tuning.Table(tuning.environment(), {("attention", kind, 64, 4, cell.bucket): cell}), "test")
            out = attention_triton(q, kq, vq, spec)
            if path == "dequant":
                assert last_path() == "sdpa"
            else:
                assert last_path() == "prefill[m32w4s1]"
                _check(out, q, kq, vq, spec)
        tuning.reset(tuning.Table(tuning.environment(), {}), "empty table")
        attention_triton(q, kq, vq, spec)
        assert last_path().startswith("prefill[")          # the dispatch's own choice without a cell
    finally:
        tuning.reset()
