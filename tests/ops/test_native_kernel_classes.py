"""The native sm_90a decode kernels as dense kernel classes (lowbit.ops.kernels.native): opt-in, refused
with the reason where they cannot run, laid out next to the Triton layout, and applied through their layout.
No GPU here: the native call is replaced by the CPU twin (csrc/host_twin.cpp, the kernels' own warp
programs), checked against lowbit's float64 reference; calls the native kernel does not take run the Triton
class on the Triton operands (the interpreter), compared bit for bit."""
import pytest
import torch

import lowbit as lb
from lowbit.ops import prepared as runtime
from lowbit.ops import tuning
from lowbit.ops.kernels import native as kn
from lowbit.ops.kernels.base import Device
from lowbit.ops.kernels.dense import choose_linear
from lowbit.ops.kernels.dense_w4 import TritonW4A16
from lowbit.ops.kernels.dense_w8 import TritonW8A8Int8, TritonW8A16
from lowbit.ops.native import kernels as nk
from lowbit.recipes.presets import get_recipe
from lowbit.verify.check import check_quantized

H200 = Device("cuda", (9, 0))
W4 = lb.QuantScheme(format="int4", strategy="group", group_size=128, symmetric=False)
CASES = {  # weight scheme, activation scheme -> the native class that takes it
    "w4a16": (W4, None, "native_w4a16"),
    "w8a16": (get_recipe("w8a16-int8").weight, None, "native_w8a16"),
    "w8a8-int8": (get_recipe("w8a8-int8").weight, get_recipe("w8a8-int8").act, "native_w8a8_int8"),
    "w8a8-fp8": (get_recipe("w8a8-fp8").weight, get_recipe("w8a8-fp8").act, "native_w8a8_fp8"),
}


@pytest.fixture
def opted_in(monkeypatch):
    """LOWBIT_NATIVE=1 and a library that can run (this machine has no GPU to say so)."""
    monkeypatch.setenv(kn.OPT_IN, "1")
    monkeypatch.setattr(kn.library, "unavailable_reason", lambda: None)


@pytest.mark.parametrize("case", sorted(CASES))
def test_without_opt_in_the_triton_class_runs(case, monkeypatch):
    monkeypatch.delenv(kn.OPT_IN, raising=False)
    ws, xs, name = CASES[case]
    c = choose_linear(lb.quantize(torch.randn(48, 256), ws), xs, device=H200)
    assert c.name == name.replace("native", "triton")
    assert dict(c.refused)[name].startswith("opt-in: set LOWBIT_NATIVE=1")


@pytest.mark.parametrize("case", sorted(CASES))
def test_opted_in_the_native_class_runs_and_refuses_other_gpus(case, opted_in):
    ws, xs, name = CASES[case]
    q = lb.quantize(torch.randn(48, 256), ws)
    c = choose_linear(q, xs, device=H200)
    assert c.name == name and c.prepared.spec.kernel == name and not c.prepared.spec.graphable
    assert {"n_packed", "n_scale"} <= set(c.prepared.spec.operands)
    other = choose_linear(q, xs, device=Device("cuda", (10, 0)))   # Blackwell: no sm_90a code
    assert "sm_90a code only" in dict(other.refused)[name]
    assert "CUDA GPU" in dict(choose_linear(q, xs, device=Device("interpreter")).refused)[name]


def test_a_layout_the_native_kernel_cannot_hold_falls_through(opted_in):
    q = lb.quantize(torch.randn(48, 252), lb.get_preset("int8_channel"))   # K = 252: not a multiple of 8
    c = choose_linear(q, None, device=H200)
    assert c.name == "triton_w8a16" and "multiple of 8" in dict(c.refused)["native_w8a16"]


def test_group_sizes_outside_the_kernel_are_refused_by_scheme(opted_in):
    ws = lb.QuantScheme(format="int4", strategy="group", group_size=16)
    c = choose_linear(lb.quantize(torch.randn(48, 256), ws), None, device=H200)
    assert "groups of (32, 64, 128, 256)" in dict(c.refused)["native_w4a16"]


@pytest.mark.parametrize("case,call,twin,base", [("w4a16", "w4a16", "twin_w4a16", TritonW4A16),
                                                ("w8a16", "w8a16", "twin_w8a16", TritonW8A16),
                                                ("w8a8-int8", "w8a8", "twin_w8a8", TritonW8A8Int8)])
def test_apply_reads_the_native_layout(case, call, twin, base, opted_in, monkeypatch, interpreter):
    """Decode rows through the class's native operands (the twin standing in for the GPU), with and without
    a float32 / bf16 bias, pass the float64 reference's gate for an fp32 accumulator and a bf16 output;
    more rows, or an fp16 bias, run the Triton class on its own operands, bit for bit."""
    calls = []
    fn = getattr(nk, twin)
    monkeypatch.setattr(nk, call, lambda x, w, bias=None: calls.append(x.shape[0]) or fn(x, w, 3, bias=bias))
    ws, xs, name = CASES[case]
    N, K = 37, 384
    q = lb.quantize(torch.randn(N, K), ws)
    c = choose_linear(q, xs, device=H200)
    spec, ops = c.prepared.spec, c.prepared.tensors
    biases = (None, torch.randn(N) * 4, (torch.randn(N) * 4).bfloat16())
    for M, bias in zip((1, 7, 16), biases):
        x = torch.randn(M, K).bfloat16()
        y = c.kernel.apply(spec, x, ops, bias, None)
        xq = x.double() if xs is None else lb.quantize(x.float(), xs)
        v = check_quantized(y, xq, q, accumulator="fp32", bias=None if bias is None else bias.double())
        assert v.passed, v.report()
    assert calls == [1, 7, 16]
    x, bias = torch.randn(20, K).bfloat16(), torch.randn(N).half()
    assert torch.equal(c.kernel.apply(spec, x, ops, None, None), base.apply(spec, x, ops, None, None))
    assert torch.equal(c.kernel.apply(spec, x[:3], ops, bias, None), base.apply(spec, x[:3], ops, bias, None))
    assert calls == [1, 7, 16]


def _table(*cells):
    return tuning.Table(tuning.environment(), {(c.op, c.kind, c.N, c.K, c.bucket): c for c in cells})


def test_the_tuning_tables_native_cells_choose_the_launch(opted_in, monkeypatch, interpreter, rng):
    """A native cell (op "native") names the decode launch's variant, or "triton" (the Triton class, as its
    own linear cell says); without a cell the native kernel takes its default launch up to 16 rows; the
    variant reaches the launch, whose output is the default launch's bits (the twin stands in)."""
    seen = []

    def launch(x, w, bias=None, **variant):
        seen.append(variant)
        return nk.twin_w4a16(x, w, bias=bias, **{k: v for k, v in variant.items() if k != "fixup"})
    monkeypatch.setattr(nk, "w4a16", launch)
    N, K = 40, 384
    q = lb.quantize(torch.randn(N, K, generator=rng), W4)
    c = choose_linear(q, None, device=H200)
    spec, ops, kind = c.prepared.spec, c.prepared.tensors, tuning.kind_key(c.prepared.spec)
    x = torch.randn(1, K, generator=rng).bfloat16()
    try:
        tuning.reset(_table())
        assert c.kernel.for_rows(spec, 1) == (c.kernel, {}) and c.kernel.for_rows(spec, 16) == (c.kernel, {})
        assert c.kernel.for_rows(spec, 17)[0] is TritonW4A16       # past the decode kernel's 16 rows
        y0 = runtime.run(spec, x, ops, None)
        variant = {"nt": 2, "prefetch": True, "splits": 2, "fixup": True}
        tuning.reset(_table(tuning.Cell("native", kind, N, K, "1", "kernel", variant),
                            tuning.Cell("native", kind, N, K, "2-16", "triton"),
                            tuning.Cell("linear", kind, N, K, "2-16", "dequant")))
        assert c.kernel.for_rows(spec, 1) == (c.kernel, variant)
        assert c.kernel.for_rows(spec, 5) == (TritonW4A16.dequant, None)
        y1 = runtime.run(spec, x, ops, None)
        assert seen == [{}, variant] and torch.equal(y0, y1)
        tuning.reset(_table(tuning.Cell("native", kind, N, K, "1", "kernel", {"tiles": 3})))
        with pytest.raises(ValueError, match=r"native cell's config has \['tiles'\]"):
            c.kernel.for_rows(spec, 1)
    finally:
        tuning.reset()
