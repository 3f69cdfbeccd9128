"""check_linear end to end and the `lowbit check` command."""
import dataclasses

import pytest
import torch
from safetensors.torch import save_file

import lowbit as lb
from lowbit.entrypoints.main import main
from lowbit.verify import check_linear

XS = lb.QuantScheme(format="int8", strategy="token")
WS = lb.QuantScheme(format="int8", strategy="channel")


def _kernel(x, w, bias=None):
    xq, wq = lb.quantize(x, XS), lb.quantize(w, WS)
    out = ((xq.codes.long() @ wq.codes.long().T).float() * xq.scale) * wq.scale.T
    return out if bias is None else out + bias


def test_pass_with_bias_and_report(rng):
    x, w, b = torch.randn(10, 48, generator=rng), torch.randn(6, 48, generator=rng), torch.randn(6, generator=rng)
    v = check_linear(_kernel(x, w, b), x, w, x_scheme=XS, w_scheme="int8_channel", bias=b)
    assert v.passed and v.kind == "ok" and v.first_failure is None
    assert v.metrics["quant_gate_frac"] < 1 and "PASS" in v.report()


def test_first_failure_is_first_in_row_major_order(rng):
    x, w = torch.randn(9, 40, generator=rng), torch.randn(7, 40, generator=rng)
    out = _kernel(x, w)
    out[4, 5] += 1.0
    out[6, 1] += 1.0
    v = check_linear(out, x, w, x_scheme=XS, w_scheme=WS)
    assert not v.passed and v.first_failure == (4, 5)
    rep = v.report()
    assert "row 4, col 5" in rep and "gate" in rep


def test_unquantized_fp32_kernel_passes_and_bf16_output_needs_its_rounding(rng):
    x, w = torch.randn(5, 300, generator=rng), torch.randn(8, 300, generator=rng)
    assert check_linear(x @ w.T, x, w).passed
    out16 = (x @ w.T).bfloat16()
    assert check_linear(out16, x, w).passed                      # gate includes bf16 output rounding
    assert not check_linear(out16.float(), x, w, out_dtype=torch.float32).passed  # promised fp32 out


def test_dead_channel_warning_from_census(rng):
    x = torch.rand(4, 128, generator=rng)
    w = torch.randn(6, 128, generator=rng)
    w[3] *= 1 / 64                                               # a quiet column
    ts = lb.QuantScheme(format="int8", strategy="tensor")
    xq, wq = lb.quantize(x, ts), lb.quantize(w, ts)
    out = ((xq.codes.long() @ wq.codes.long().T).float() * xq.scale) * wq.scale
    v = check_linear(out, x, w, x_scheme=ts, w_scheme=ts)
    assert v.passed and any("dead channels in w" in s for s in v.warnings)


def test_bad_arguments_raise(rng):
    x, w = torch.randn(3, 16, generator=rng), torch.randn(4, 16, generator=rng)
    with pytest.raises(ValueError, match="out has shape"):
        check_linear(torch.zeros(4, 3), x, w)
    with pytest.raises(ValueError, match="w must be"):
        check_linear(torch.zeros(3, 4), x, torch.randn(4, 8))


def test_lowbit_check_command(rng, tmp_path, capsys):
    x, w = torch.randn(6, 64, generator=rng), torch.randn(5, 64, generator=rng)
    meta = {"x_scheme": XS.to_json(), "w_scheme": "int8_channel"}
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    out = _kernel(x, w)
    save_file({"out": out, "x": x, "w": w}, str(good), metadata=meta)
    shifted = torch.cat([out[:1], out[:-1]]).contiguous()
    save_file({"out": shifted, "x": x, "w": w}, str(bad), metadata=meta)
    assert main(["check", str(good)]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["check", str(bad)]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "row_shift" in text and "row 1, col" in text
    save_file({"out": out, "x": x}, str(bad), metadata=meta)
    assert main(["check", str(bad)]) == 2


def test_device_tensors_are_accepted(rng, device):
    x, w = torch.randn(7, 64, generator=rng), torch.randn(9, 64, generator=rng)
    out = _kernel(x, w)
    v = check_linear(out.to(device), x.to(device), w.to(device), x_scheme=XS, w_scheme=WS)
    assert v.passed, v.report()
    bad = out.clone()
    bad[:, 3] *= 1.01   # one column 1% off
    v = check_linear(bad.to(device), x.to(device), w.to(device), x_scheme=XS, w_scheme=WS)
    assert not v.passed and v.first_failure[1] == 3
