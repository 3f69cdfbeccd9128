"""Kernels as classes (lowbit.ops.kernels): each class's refusals, which class dispatch picks per
recipe and device, the tuning table's paths as classes, and the extension point (a kernel registered
from outside takes the layers it can run, and only those)."""
import pytest
import torch

from lowbit.nn import QuantLinear, get_recipe
from lowbit.nn.experts import QuantExperts
from lowbit.ops import tuning
from lowbit.ops.kernels import GEMM, GROUPED, LINEAR, Device, LinearLayer, choose_grouped, class_for_rows, explain
from lowbit.ops.kernels.dense_mx import TritonMXFP8
from lowbit.ops.kernels.dense_w4 import DequantW4A16, TritonFP4, TritonW4A16
from lowbit.ops.kernels.dense_w8 import CutlassW8A8Fp8, ScaledMMW8A8Fp8, TritonW8A8Fp8, TritonW8A8Int8, TritonW8A16
from lowbit.ops.kernels.exact import ExactDequantized, ExactInt8, QTensorGemm
from lowbit.ops.kernels.gemm import GemmFp8Block, GemmFp8Rowwise, GemmInt8, GemmMXFP8
from lowbit.ops.kernels.grouped import (GroupedExact, GroupedFp4, GroupedFp8, GroupedInt8, GroupedMXFP8,
                                        GroupedW4A16, GroupedW8A16)
from lowbit.quantize import quantize
from lowbit.scheme import QuantScheme, get_preset

P = get_preset
INTERP, CPU, AMPERE, HOPPER = Device("interpreter"), Device("cpu"), Device("cuda", (8, 0)), Device("cuda", (9, 0))
INT8_TOK = QuantScheme(format="int8", strategy="token", dynamic=True)
INT4_G16 = QuantScheme(format="int4", strategy="group", group_size=16)
UINT4_G32 = QuantScheme(format="uint4", strategy="group", group_size=32, symmetric=False)


def L(w, x=None, **kw):
    return LinearLayer(P(w) if isinstance(w, str) else w, P(x) if isinstance(x, str) else x, 64, 256, **kw)


# (class, a layer it takes, a layer it refuses, a phrase of the reason)
CASES = [
    (TritonW8A8Int8, L("int8_channel", "int8_token"), L("fp8_row", "fp8_row"), "takes int8"),
    (TritonW8A8Int8, L("int8_channel", "int8_token"), L("int4_g128"), "weight-only"),
    (TritonW8A8Fp8, L("fp8_row", "fp8_row"), L("int8_channel", "int8_token"), "takes fp8_e4m3fn"),
    (TritonW8A8Fp8, L("fp8_row", "fp8_row"), L("fp8_block128", "fp8_row"), "one fp32 scale per output channel"),
    (TritonW8A16, L("int8_channel"), L("int8_channel", "int8_token"), "float activations"),
    (TritonW8A16, L("fp8_row"), L("int4_g128"), "reads int8 or fp8"),
    (TritonW4A16, L("int4_g128"), L(INT4_G16), "group_size 16"),
    (TritonW4A16, L("int4_g128_asym"), L("int4_g128", padded=True), "zero-padded"),
    (TritonW4A16, L("nvfp4"), L("mxfp6_e2m3"), "has no kernel"),
    (TritonFP4, L("mxfp4", "mxfp4"), L("mxfp4"), "MXFP4 x MXFP4"),
    (TritonFP4, L("nvfp4", "nvfp4"), L("nvfp4", "mxfp4"), "NVFP4 x NVFP4"),
    (TritonMXFP8, L("mxfp8", "mxfp8"), L("mxfp6_e2m3", "mxfp6_e2m3"), "MXFP8 x MXFP8"),
    (QTensorGemm, L("fp8_block128", "fp8_block1x128"), L("int8_channel", "int8_token", static_scale=True), "static"),
    (QTensorGemm, L("int8_channel", "int8_token"), L("mxfp6_e2m3", "mxfp6_e2m3"), "no GEMM"),
    (ExactInt8, L("int8_channel", "int8_token"), L("fp8_row", "fp8_row"), "int8 symmetric"),
    (GemmInt8, L("int8_channel", "int8_token"), L("int8_channel"), "weight-only"),
    (GemmFp8Rowwise, L("fp8_row", "fp8_row"), L("fp8_block128", "fp8_block1x128"), "one fp32 scale per row"),
    (GemmFp8Block, L("fp8_block128", "fp8_block1x128"), L("fp8_row", "fp8_row"), "128x128"),
    (GemmMXFP8, L("mxfp8", "mxfp8"), L("fp8_row", "fp8_row"), "MXFP8 on both"),
    (GroupedInt8, L("int8_channel", "int8_token"), L("int8_channel", "fp8_row"), "int8 activations"),
    (GroupedFp8, L("fp8_row", "fp8_row"), L("fp8_tensor", "fp8_row"), "per channel"),
    (GroupedW8A16, L("int8_channel"), L("fp8_row"), "int8 weights"),
    (GroupedW4A16, L("int4_g128"), L(UINT4_G32), "uint4"),
    (GroupedW4A16, L("mxfp4"), L(INT4_G16), "group_size 16"),
    (GroupedFp4, L("nvfp4", "nvfp4"), L("nvfp4"), "NVFP4 x NVFP4"),
    (GroupedMXFP8, L("mxfp8", "mxfp8"), L("mxfp8"), "MXFP8 x MXFP8"),
]


@pytest.mark.parametrize("cls, takes, refuses, phrase", CASES,
                         ids=[f"{c[0].__name__}-{c[3].split()[0]}" for c in CASES])
def test_can_run_takes_and_refuses_with_a_reason(cls, takes, refuses, phrase):
    assert cls.can_run(takes, INTERP) is None
    why = cls.can_run(refuses, INTERP)
    assert why is not None and phrase in why, why


TRITON_CLASSES = [TritonW8A8Int8, TritonW8A8Fp8, TritonW8A16, TritonW4A16, TritonFP4, TritonMXFP8, QTensorGemm,
                  GroupedInt8, GroupedFp8, GroupedW8A16, GroupedW4A16, GroupedFp4, GroupedMXFP8]


@pytest.mark.parametrize("cls", TRITON_CLASSES, ids=lambda c: c.__name__)
def test_device_refusals(cls):
    """Without Triton every Triton kernel refuses, naming the extra; a GPU older than a kernel's tensor-core
    path is refused with both capabilities; the exact twins run everywhere."""
    layer = next(t for c, t, _, _ in CASES if c is cls)
    assert "triton is not installed" in cls.can_run(layer, CPU)
    assert cls.can_run(layer, HOPPER) is None
    need = cls.min_capability
    if need is not None and need > (8, 0):
        assert f"{need[0]}.{need[1]}" in cls.can_run(layer, AMPERE) and "sm_80" in cls.can_run(layer, AMPERE)
    for exact in (ExactDequantized, GroupedExact):
        assert exact.can_run(layer, CPU) is None


def test_the_qtensor_gemm_needs_its_gemms_tensor_cores():
    why = QTensorGemm.can_run(L("fp8_block128", "fp8_block1x128"), AMPERE)
    assert "fp8_block" in why and "8.9" in why


EXPECTED = {   # recipe -> (dense class on a Triton device, grouped class, dense class without Triton)
    "w8a8-int8": ("triton_w8a8_int8", "grouped_int8", "exact_int8"),
    "w8a8-int8-tensor": ("triton_w8a8_int8", "grouped_int8", "exact_int8"),
    "w8a8-fp8": ("triton_w8a8_fp8", "grouped_fp8", "exact_dequantized"),
    "w8a16-int8": ("triton_w8a16", "grouped_w8a16", "exact_dequantized"),
    "w4a16": ("triton_w4a16", "grouped_w4a16", "exact_dequantized"),
    "w4a16-asym": ("triton_w4a16", "grouped_w4a16", "exact_dequantized"),
    "mxfp4": ("triton_fp4", "grouped_fp4", "exact_dequantized"),
    "nvfp4": ("triton_fp4", "grouped_fp4", "exact_dequantized"),
    "mxfp8": ("triton_mxfp8", "grouped_mxfp8", "exact_dequantized"),
}


def _linear(rng, n, k, scheme_w, scheme_x, **kw):
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=rng) * 0.05)
    return QuantLinear.from_linear(lin, scheme_w, scheme_x, **kw)


@pytest.mark.parametrize("recipe", sorted(EXPECTED))
def test_dispatch_picks_the_class_per_recipe(rng, recipe):
    """Every class ahead of the chosen one is recorded with its reason; the layer's Spec names the class;
    the grouped registry and a device without Triton answer as the table above says."""
    r = get_recipe(recipe)
    dense, grouped, no_triton = EXPECTED[recipe]
    q = _linear(rng, 40, 256, r.weight, r.act, backend="kernel")
    assert q.kernel_choice.name == dense and q.fast_spec.kernel == dense
    ahead = LINEAR.names()[:LINEAR.names().index(dense)]
    assert [n for n, _ in q.kernel_choice.refused] == ahead and all(why for _, why in q.kernel_choice.refused)
    assert choose_grouped(r.weight, r.act, device=INTERP).name == grouped
    rep = explain(r.weight, r.act, device=CPU)
    assert rep["linear"]["kernel"] == no_triton and rep["linear"]["rows"] == {}
    assert rep["grouped"]["kernel"] == "exact"


def test_a_layout_refusal_moves_on_to_the_next_kernel(rng):
    """MXFP4 scales beyond the planar kernel's exact range (K = 96: not the pairs layout) are found when
    the weight is laid out: the W4A16 kernel is refused with that reason and the exact twin runs."""
    w = torch.randn(24, 96, generator=rng) * 2.0 ** 118
    q = QuantLinear(quantize(w, P("mxfp4")), P("mxfp4"), None, backend="kernel")
    assert q.fast_spec is None and q.kernel_choice.name == "exact_dequantized"
    assert dict(q.kernel_choice.refused)["triton_w4a16"].startswith("the W4A16 layout cannot hold")
    assert q(torch.randn(2, 96, generator=rng).bfloat16()) is not None and q.last_path == "dequantized"


def test_the_tuning_table_paths_are_classes(rng, interpreter):
    """A "dequant" cell for this layer's kind, shape and bucket runs DequantW4A16 at that bucket's M, the
    kernel class elsewhere, and the layer's output at that M is that class's apply."""
    N, K = 40, 256
    r = get_recipe("w4a16")
    q = _linear(rng, N, K, r.weight, None, backend="kernel")
    spec = q.fast_spec
    cell = tuning.Cell("linear", tuning.kind_key(spec), N, K, "2-16", "dequant", None)
    tuning.reset(tuning.Table(tuning.environment(), {("linear", cell.kind, N, K, "2-16"): cell}), "test table")
    try:
        assert class_for_rows(spec, 5) is DequantW4A16 and class_for_rows(spec, 1) is TritonW4A16
        x = torch.randn(5, K, generator=rng).bfloat16()
        ops = {n: getattr(q, "fast_" + n) for n in spec.operands}
        assert torch.equal(q(x), DequantW4A16.apply(spec, x, ops, q.bias, None))
    finally:
        tuning.reset()
    assert class_for_rows(spec, 5) is TritonW4A16       # the heuristic again: the cached answer was forgotten


@pytest.mark.parametrize("path,config", [("scaled_mm", None), ("cutlass", {"config": 1})])
def test_fp8_prefill_cells_run_their_class_where_it_can_run(path, config, rng, interpreter, monkeypatch):
    """A "scaled_mm" / "cutlass" cell of the fp8 kind runs that class at its bucket (with the cell's config); where
    the class cannot run on this machine (no library, an older torch) the Triton kernel runs under its default
    tiles, never the cell's config. Off the GPU (the interpreter) the classes' apply is the Triton class's."""
    N, K = 48, 256
    r = get_recipe("w8a8-fp8")
    q = _linear(rng, N, K, r.weight, r.act, backend="kernel")
    spec = q.fast_spec
    alt = TritonW8A8Fp8.alternatives[path]
    assert alt is {"scaled_mm": ScaledMMW8A8Fp8, "cutlass": CutlassW8A8Fp8}[path]
    cell = tuning.Cell("linear", tuning.kind_key(spec), N, K, "513+", path, config)
    tuning.reset(tuning.Table(tuning.environment(), {("linear", cell.kind, N, K, "513+"): cell}), "test table")
    try:
        monkeypatch.setattr(alt, "usable", classmethod(lambda cls: None))
        assert TritonW8A8Fp8.for_rows(spec, 600) == (alt, config)
        assert class_for_rows(spec, 16) is TritonW8A8Fp8            # other buckets: their own answer
        monkeypatch.setattr(alt, "usable", classmethod(lambda cls: "not here"))
        assert TritonW8A8Fp8.for_rows(spec, 600) == (TritonW8A8Fp8, None)
    finally:
        tuning.reset()
    x = torch.randn(33, K, generator=rng).bfloat16()
    ops = {n: getattr(q, "fast_" + n) for n in spec.operands}
    assert torch.equal(alt.apply(spec, x, ops, q.bias, config), TritonW8A8Fp8.apply(spec, x, ops, q.bias, None))


def test_a_table_path_of_another_kind_runs_the_kernel(rng, interpreter):
    """A prefill path named in a cell of a kind that has none (a hand-edited table) runs the layer's own kernel."""
    N, K = 40, 256
    q = _linear(rng, N, K, get_recipe("w8a8-int8").weight, get_recipe("w8a8-int8").act, backend="kernel")
    spec = q.fast_spec
    for path, config in (("scaled_mm", None), ("cutlass", {"config": 1})):
        cell = tuning.Cell("linear", tuning.kind_key(spec), N, K, "513+", path, config)
        tuning.reset(tuning.Table(tuning.environment(), {("linear", cell.kind, N, K, "513+"): cell}), "test table")
        try:   # the kernel under its default tiles: the other path's configuration is not its tiles
            assert TritonW8A8Int8.for_rows(spec, 600) == (TritonW8A8Int8, None)
        finally:
            tuning.reset()


class FakeW4A16(TritonW4A16):
    """A kernel from outside: takes int4 with groups of 32 only, lays out as the W4A16 kernel does,
    counts its calls and applies the same arithmetic."""
    name = "fake_w4a16"
    calls = 0

    @classmethod
    def refuses(cls, layer):
        if layer.weight.group_size != 32:
            return f"fake: groups of 32 only, got {layer.weight.group_size}"
        return super().refuses(layer)

    @staticmethod
    def apply(spec, x2, ops, bias, config):
        FakeW4A16.calls += 1
        return TritonW4A16.apply(spec, x2, ops, bias, config)


FakeW4A16.dequant = None


def test_a_registered_kernel_takes_the_layers_it_can_run(rng, interpreter):
    g32 = QuantScheme(format="int4", strategy="group", group_size=32)
    x = torch.randn(3, 128, generator=rng).bfloat16()
    plain = _linear(rng, 24, 128, g32, None, backend="kernel")
    with LINEAR.registered(FakeW4A16, before="triton_w4a16"):
        assert LINEAR.names().index("fake_w4a16") == LINEAR.names().index("triton_w4a16") - 1
        q = QuantLinear(plain.weight_q, g32, None, bias=plain.bias, backend="kernel")
        assert q.kernel_choice.name == "fake_w4a16" and q.fast_spec.kernel == "fake_w4a16"
        before = FakeW4A16.calls
        y = q(x)
        assert FakeW4A16.calls == before + 1 and q.last_path == "fast:w4a16"
        assert torch.equal(y, plain(x))          # the same arithmetic as the kernel it stands in for
        g128 = _linear(rng, 24, 128, P("int4_g128"), None, backend="kernel")
        assert g128.kernel_choice.name == "triton_w4a16"
        assert dict(g128.kernel_choice.refused)["fake_w4a16"] == "fake: groups of 32 only, got 128"
    assert "fake_w4a16" not in LINEAR.names()
    assert QuantLinear(plain.weight_q, g32, None, backend="kernel").kernel_choice.name == "triton_w4a16"


def test_a_registered_grouped_kernel_is_asked_first(rng):
    class Never(GroupedExact):
        name, kind, triton = "never", "never", True

        @classmethod
        def refuses(cls, layer):
            return "never runs"
    r = get_recipe("w8a8-int8")

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(3, 64, 32, generator=rng))
            self.down_proj = torch.nn.Parameter(torch.randn(3, 32, 32, generator=rng))
            self.act_fn = torch.nn.SiLU()
    with GROUPED.registered(Never, before="grouped_int8"):
        q = QuantExperts.from_module(Experts(), r.weight, r.act, backend="kernel")
        assert q.kernel_choice.refused[0] == ("never", "never runs") and q.kernel_choice.name == "grouped_int8"
    assert "never" not in GROUPED.names()


def test_registry_refuses_bad_registrations():
    with pytest.raises(ValueError, match="registered already"):
        LINEAR.register(TritonW4A16)
    with pytest.raises(ValueError, match="needs a `name` and a `kind`"):
        GEMM.register(type("Nameless", (GemmInt8,), {"name": ""}))
    with pytest.raises(ValueError, match="no kernel named 'nope'; registered: int8, fp8_rowwise"):
        GEMM.get("nope")
    with pytest.raises(ValueError, match="capability"):
        Device("cuda")
