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
    assert c.name == name and c.prepared.spec.kernel == name and c.prepared.spec.graphable   # CUDA-graph replays
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


def _twins(monkeypatch, calls):
    """The CPU twin in for the GPU: the GEMVs (recording the rows and launch keywords of each launch; the twin adds
    the splits as the reduce kernel does, so the fixup is dropped) and the dequantization."""
    def stand_in(twin):
        def run(x, w, splits=None, bias=None, out=None, fixup=False, **variant):
            calls.append((x.shape[0], variant))
            y = twin(x, w, splits or 3, bias=bias, **variant)
            return y if out is None else out.copy_(y)
        return run
    for call in ("w4a16", "w8a16", "w8a8"):
        monkeypatch.setattr(nk, call, stand_in(getattr(nk, "twin_" + call)))
    monkeypatch.setattr(nk, "dequantize", lambda w, dtype, out=None: out.copy_(nk.twin_dequantize(w, dtype)))


@pytest.mark.parametrize("case,base", [("w4a16", TritonW4A16), ("w8a16", TritonW8A16)])
def test_a_weight_only_native_layer_holds_its_weight_once_and_runs_every_call(case, base, opted_in, monkeypatch,
                                                                             interpreter, rng):
    """The weight-only classes lay out the native weight alone. Decode rows (with a float32 / bf16 bias) run the
    GEMV, 17-64 bf16 rows the GEMV per 16 rows (each launch's rows are the GEMV's: the twin, bit for bit), more rows,
    fp16 rows or an fp16 bias the weight dequantized from the native layout and the float GEMM: bit for bit the
    Triton class's dequant path on its own layout. Every output passes the float64 reference's gate."""
    calls = []
    _twins(monkeypatch, calls)
    ws, xs, name = CASES[case]
    N, K = 37, 384
    q = lb.quantize(torch.randn(N, K, generator=rng), ws)
    c = choose_linear(q, xs, device=H200)
    spec, ops = c.prepared.spec, c.prepared.tensors
    assert set(ops) <= {"n_packed", "n_scale", "n_zero", "n_counters"}, set(ops)   # no Triton layout
    tri = base.prepare(q, xs, None)
    biases = (None, torch.randn(N, generator=rng) * 4, (torch.randn(N, generator=rng) * 4).bfloat16(), None)
    for M, bias in zip((1, 7, 16, 40), biases):
        x = torch.randn(M, K, generator=rng).bfloat16()
        y = c.kernel.apply(spec, x, ops, bias, None)
        v = check_quantized(y, x.double(), q, accumulator="fp32", bias=None if bias is None else bias.double())
        assert v.passed, v.report()
    w = c.kernel.native_weight(spec, ops)
    assert [m for m, _ in calls] == [1, 7, 16, 16, 16, 8]
    assert torch.equal(y, torch.cat([getattr(nk, "twin_" + case)(x[i:i + 16], w, 3) for i in (0, 16, 32)]))
    calls.clear()
    for x, bias in ((torch.randn(70, K, generator=rng).bfloat16(), None),        # past the GEMV's 64 rows
                    (torch.randn(3, K, generator=rng).half(), None),              # fp16 rows
                    (torch.randn(5, K, generator=rng).bfloat16(), torch.randn(N, generator=rng).half())):
        y = c.kernel.apply(spec, x, ops, bias, None)
        assert torch.equal(y, base.dequant.apply(tri.spec, x, tri.tensors, bias, None)), (x.shape, x.dtype)
    assert calls == []


def test_w8a8_decode_rows_read_the_native_layout_and_more_rows_the_triton_class(opted_in, monkeypatch, interpreter,
                                                                               rng):
    """W8A8 keeps the Triton layout beside the native one (no exact dequantized path for quantized activations):
    decode rows run the native GEMV (the twin), within the reference's gate; more rows, or an fp16 bias, the Triton
    class on its own operands, bit for bit."""
    calls = []
    _twins(monkeypatch, calls)
    ws, xs, name = CASES["w8a8-int8"]
    N, K = 37, 384
    q = lb.quantize(torch.randn(N, K, generator=rng), ws)
    c = choose_linear(q, xs, device=H200)
    spec, ops = c.prepared.spec, c.prepared.tensors
    for M, bias in zip((1, 16), (None, torch.randn(N, generator=rng) * 4)):
        x = torch.randn(M, K, generator=rng).bfloat16()
        y = c.kernel.apply(spec, x, ops, bias, None)
        v = check_quantized(y, lb.quantize(x.float(), xs), q, accumulator="fp32",
                            bias=None if bias is None else bias.double())
        assert v.passed, v.report()
    assert [m for m, _ in calls] == [1, 16]
    x, bias = torch.randn(20, K, generator=rng).bfloat16(), torch.randn(N, generator=rng).half()
    assert torch.equal(c.kernel.apply(spec, x, ops, None, None), TritonW8A8Int8.apply(spec, x, ops, None, None))
    assert torch.equal(c.kernel.apply(spec, x[:3], ops, bias, None), TritonW8A8Int8.apply(spec, x[:3], ops, bias, None))
    assert [m for m, _ in calls] == [1, 16]


def _table(*cells):
    return tuning.Table(tuning.environment(), {(c.op, c.kind, c.N, c.K, c.bucket): c for c in cells})


def test_the_tuning_tables_native_cells_choose_the_launch(opted_in, monkeypatch, interpreter, rng):
    """A native cell (op "native") names the GEMV's launch variant ("kernel"), or the dequant path; without a cell
    the heuristic: the GEMV up to 64 rows, then the dequant path. The variant reaches every launch, and the output
    is the default launch's bits (the twin stands in)."""
    calls = []
    _twins(monkeypatch, calls)
    N, K = 40, 384
    q = lb.quantize(torch.randn(N, K, generator=rng), W4)
    c = choose_linear(q, None, device=H200)
    spec, ops, kind = c.prepared.spec, c.prepared.tensors, tuning.kind_key(c.prepared.spec)
    x = torch.randn(20, K, generator=rng).bfloat16()
    try:
        tuning.reset(_table())
        assert [c.kernel.for_rows(spec, M)[1] for M in (1, 16, 64, 65)] == [kn.NativeCall("kernel")] * 3 + [
            kn.NativeCall("dequant")]
        y0 = runtime.run(spec, x, ops, None)
        variant = {"nt": 2, "prefetch": True, "splits": 2, "fixup": True}
        tuning.reset(_table(tuning.Cell("native", kind, N, K, "17-64", "kernel", variant),
                            tuning.Cell("native", kind, N, K, "2-16", "dequant"),
                            tuning.Cell("native", kind, N, K, "1", "triton")))
        assert c.kernel.for_rows(spec, 20) == (c.kernel, kn.NativeCall("kernel", tuple(sorted(variant.items()))))
        assert c.kernel.for_rows(spec, 5)[1] == c.kernel.for_rows(spec, 1)[1] == kn.NativeCall("dequant")
        calls.clear()
        y1 = runtime.run(spec, x, ops, None)
        assert calls == [(16, {"nt": 2, "prefetch": True}), (4, {"nt": 2, "prefetch": True})]
        assert torch.equal(y0, y1)
        tuning.reset(_table(tuning.Cell("native", kind, N, K, "1", "kernel", {"tiles": 3})))
        with pytest.raises(ValueError, match=r"native cell's config has \['tiles'\]"):
            c.kernel.for_rows(spec, 1)
    finally:
        tuning.reset()
