"""lowbit.testing.assert_linear_close: passes correct kernels, raises AssertionError whose message
is the verdict with the named cause, and runs inside a peer project's own test (torchao's int8
CPU test, adapted)."""
import importlib.util

import pytest
import torch

import lowbit as lb
from lowbit.testing import assert_linear_close

I8T, I8C = lb.get_preset("int8_token"), lb.get_preset("int8_channel")


def int8_kernel(x, w, stride0=False):
    """A hand-written W8A8 kernel: per-token x codes, per-channel w codes (amax / 127, round half
    even), exact integer dot products, both scales in float32."""
    sx = x.abs().amax(dim=-1, keepdim=True) / 127
    sw = w.abs().amax(dim=1, keepdim=True) / 127
    X, W = torch.round(x / sx), torch.round(w / sw)
    if stride0:                     # the activation scale pointer read with stride 0
        sx = sx.reshape(-1, 1)[:1].expand(sx.reshape(-1, 1).shape).reshape(sx.shape)
    acc = (X.double() @ W.double().T).float()
    return acc * sx * sw.T


def test_a_correct_kernel_passes_and_returns_the_verdict(rng):
    x, w = torch.randn(2, 7, 96, generator=rng), torch.randn(33, 96, generator=rng)   # [B, S, K]
    v = assert_linear_close(int8_kernel(x, w), x, w, x_scheme="int8_token", w_scheme=I8C)
    assert v.passed and v.kind == "ok" and v.metrics["shape"] == (14, 33)


def test_a_broken_kernel_raises_with_the_named_cause(rng):
    x, w = torch.randn(13, 96, generator=rng), torch.randn(21, 96, generator=rng)
    x = x * torch.exp(torch.randn(13, 1, generator=rng))
    with pytest.raises(AssertionError) as e:
        assert_linear_close(int8_kernel(x, w, stride0=True), x, w, x_scheme=I8T, w_scheme=I8C, msg="layer 3")
    lines = str(e.value).splitlines()
    assert lines[0] == "layer 3"
    assert lines[1] == "lowbit: FAIL (logic): scale_broadcast_stride0 (reproduced by simulation)", str(e.value)
    assert lines[2].startswith("check_linear: FAIL (logic)")


def test_schemes_are_required_and_shapes_checked(rng):
    x, w = torch.randn(4, 32, generator=rng), torch.randn(5, 32, generator=rng)
    out = x @ w.T
    with pytest.raises(TypeError, match="x_scheme"):
        assert_linear_close(out, x, w, w_scheme=None)           # noqa: the missing keyword is the test
    assert_linear_close(out, x, w, x_scheme=None, w_scheme=None)  # unquantized, said explicitly
    with pytest.raises(ValueError, match="rows"):
        assert_linear_close(out[:3], x, w, x_scheme=None, w_scheme=None)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        assert_linear_close(out[0], x, w, x_scheme=None, w_scheme=None)


TORCHAO = importlib.util.find_spec("torchao") is not None


def _torchao():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
        from torchao.quantization.granularity import PerRow
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor, QuantizeTensorToInt8Kwargs
    return Int8DynamicActivationInt8WeightConfig, quantize_, PerRow, Int8Tensor, QuantizeTensorToInt8Kwargs


@pytest.mark.skipif(not TORCHAO, reason="torchao (a test oracle) is not importable")
def test_torchao_int8_cpu_test_with_assert_linear_close(rng):
    """torchao's test/quantization/quantize_/workflows/int8/test_int8_tensor_cpu.py, one case
    (dynamic int8 activations, PerRow weights, float32, CPU), its `compute_error(...) > 20` replaced
    by assert_linear_close: torchao's quantizer (scale amax / 127.5, codes in [-128, 127]) is not
    lowbit's int8_token / int8_channel, and the verdict says exactly that."""
    import copy
    Config, quantize_, PerRow, _, _ = _torchao()
    M, N, K = 64, 48, 80
    x = torch.randn(M, K, generator=rng)
    model = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randn(N, K, generator=rng))
    model_q = copy.deepcopy(model)
    quantize_(model_q, Config(version=2, granularity=PerRow()))
    with torch.no_grad():
        out = model_q(x)
    with pytest.raises(AssertionError) as e:
        assert_linear_close(out, x, model.weight.detach(), x_scheme="int8_token", w_scheme="int8_channel")
    assert str(e.value).splitlines()[0] == "lowbit: FAIL (logic): scale_rule_differs (reproduced by simulation)"
    assert "amax / 127.5" in str(e.value) and "both sides" in str(e.value)


@pytest.mark.skipif(not TORCHAO, reason="torchao (a test oracle) is not importable")
def test_torchao_int8_kernel_on_lowbits_codes_passes_and_a_reversed_scale_is_named(rng):
    """torchao's int8 kernel (Int8Tensor: int_scaled_matmul, then the weight scale) fed lowbit's
    codes and scales passes; the same kernel with its weight scale vector reversed is named."""
    _, _, PerRow, Int8Tensor, Kwargs = _torchao()
    M, N, K = 24, 40, 96
    x, w = torch.randn(M, K, generator=rng), torch.randn(N, K, generator=rng)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)

    def kernel(w_scale):
        wt = Int8Tensor(wq.codes.contiguous(), w_scale.contiguous(), [1, K], torch.float32,
                        act_quant_scale=xq.scale.reshape(-1, 1).float().contiguous(),
                        act_quant_kwargs=Kwargs(granularity=PerRow()))
        return torch.nn.functional.linear(xq.dequantize(), wt)

    assert assert_linear_close(kernel(wq.scale), x, w, x_scheme=I8T, w_scheme=I8C).passed
    with pytest.raises(AssertionError) as e:
        assert_linear_close(kernel(wq.scale.flip(0)), x, w, x_scheme=I8T, w_scheme=I8C)
    assert str(e.value).splitlines()[0] == "lowbit: FAIL (logic): scales_permuted (reproduced by simulation)"
