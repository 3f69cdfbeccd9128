"""verify/probe_attention.py: the attention probe recovers the Q.K^T and P.V accumulators planted in
float64-simulated attention kernels (an online softmax over 64-key blocks, O and l rescaled in
fp32), whose accumulators are written here, not taken from lowbit: fp32 throughout; P.V in bf16
promoted into fp32 every 64 keys; an fp8-like 14-bit accumulator (13 fraction bits, truncated, 32
products per step, P cast to e4m3) promoted every 128 keys or never (vLLM's 128k fp8 failure)."""
import json
import math

import torch

from lowbit.entrypoints.main import main
from lowbit.verify import probe_attention as PA

BLOCK = 64


def sequential(dtype: torch.dtype):
    """Adds the terms (last axis) one at a time in `dtype` (float32 or bfloat16): IEEE addition of two
    values of that type rounds their exact sum once, and every term here is exact in it."""
    def add(part, terms):
        t = terms.to(dtype)
        assert torch.equal(t.double(), terms)
        acc = part.to(dtype)
        for i in range(t.shape[-1]):
            acc = acc + t[..., i]
        return acc.double()
    return add


def fused(fraction_bits: int, step: int):
    """Each step aligns the partial and `step` terms to the largest one's exponent and truncates them
    below `fraction_bits` fraction bits, then adds them exactly."""
    def add(part, terms):
        for s in range(0, terms.shape[-1], step):
            t = torch.cat([part[..., None], terms[..., s:s + step]], dim=-1)
            top = torch.frexp(t.abs().amax(-1)).exponent - 1
            unit = torch.ldexp(torch.ones_like(part), top - fraction_bits)[..., None]
            part = (torch.trunc(t / unit) * unit).sum(-1)
        return part
    return add


def kernel(qk, pv, promote=0, p_fp8=False):
    """Softmax attention over key blocks of 64: fp32 scores summed by `qk` over head_dim, exponents in
    log2 units, P (fp32, or cast to e4m3) relative to the running max, P.V summed by `pv` over the
    keys into a partial that joins an fp32 O every `promote` keys (0: never); O, l and the partial
    rescaled in fp32 when the max grows; fp32 output."""
    f32 = lambda x: x.float().double()              # noqa: E731  float64 -> float32 rounds once

    def attn(q, k, v, sm_scale):
        s = f32(qk(torch.zeros(q.shape[:-1] + (k.shape[2],), dtype=torch.float64),
                   q[..., :, None, :] * k[..., None, :, :]))
        t = f32(s * f32(torch.tensor(sm_scale / math.log(2.0), dtype=torch.float64)))
        m = torch.full(t.shape[:-1] + (1,), -math.inf, dtype=torch.float64)
        l = torch.zeros_like(m)
        part = torch.zeros(t.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
        total = torch.zeros_like(part)
        for b0 in range(0, t.shape[-1], BLOCK):
            tb = t[..., b0:b0 + BLOCK]
            m_new = torch.maximum(m, tb.amax(-1, keepdim=True))
            alpha = f32(torch.exp2(m - m_new))
            p = f32(torch.exp2(tb - m_new))
            if p_fp8:
                p = p.float().to(torch.float8_e4m3fn).double()
            l = sequential(torch.float32)(f32(l * alpha)[..., 0], p)[..., None]
            part, total = f32(part * alpha), f32(total * alpha)
            prods = (p[..., :, None] * v[..., None, b0:b0 + BLOCK, :]).transpose(-1, -2)   # [.., Tq, D, keys]
            step = min(promote or BLOCK, BLOCK)
            for c0 in range(0, prods.shape[-1], step):
                part = pv(part, prods[..., c0:c0 + step])
                if promote and (b0 + c0 + step) % promote == 0:
                    total, part = f32(total + part), torch.zeros_like(part)
            m = m_new
        return f32(f32(total + part) / l).float()
    return attn


def test_fp32_kernel_is_fitted_up_to_what_the_outputs_show():
    fit = PA.probe_attention(kernel(sequential(torch.float32), sequential(torch.float32)), "bf16")
    assert fit.qk.fitted and fit.qk.bits == PA.QK_READ_BITS and "at least" in fit.qk.note, fit.qk
    assert (fit.pv.bits, fit.pv.rounding, fit.pv.block) == (23, "nearest", 1) and "at least 23" in fit.pv.note, fit.pv


def test_pv_in_bf16_between_key_blocks_is_recovered():
    fit = PA.probe_attention(kernel(sequential(torch.float32), sequential(torch.bfloat16), promote=64), "bf16")
    assert (fit.pv.bits, fit.pv.rounding, fit.pv.block, fit.pv.promote) == (7, "nearest", 1, 64), fit.pv


def test_fp8_like_accumulator_promoted_every_128_keys_is_recovered():
    fit = PA.probe_attention(kernel(fused(13, 32), fused(13, 32), 128, p_fp8=True), "fp8")
    assert (fit.qk.bits, fit.qk.rounding, fit.qk.block, fit.qk.promote) == (13, "trunc", 32, 0), fit.qk
    assert (fit.pv.bits, fit.pv.rounding, fit.pv.block, fit.pv.promote) == (13, "trunc", 32, 128), fit.pv


FP8_NEVER_PROMOTED = kernel(fused(13, 32), fused(13, 32), 0, p_fp8=True)     # for the command line below


def test_fp8_like_accumulator_never_promoted_is_recovered_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "probe.json"
    assert main(["probe", "--attention", "test_probe_attention:FP8_NEVER_PROMOTED", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    pv = [line for line in out.splitlines() if "attention P.V" in line]
    assert len(pv) == 1 and pv[0].endswith("13 fraction bits, trunc, 32-term steps, never promoted"), out
    fit = json.loads(path.read_text())
    assert [fit["qk"][x] for x in ("bits", "rounding", "block", "promote")] == [13, "trunc", 32, 0], fit
    assert [fit["pv"][x] for x in ("bits", "rounding", "block", "promote")] == [13, "trunc", 32, 0], fit


def test_command_line_names_a_missing_kernel(capsys):
    assert main(["probe", "--attention", "no_such_module_here:attn"]) == 2
    assert "PYTHONPATH" in capsys.readouterr().err
