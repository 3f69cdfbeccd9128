"""lowbit's native decode kernels on an sm_90 GPU (skipped elsewhere: the CPU twin's tests cover their logic):
every launch variant gives the default launch's bits (row tiles per CTA, the prefetch, the in-kernel split
fixup, twice in a row: its counters reset), the W8A8 int8 output is torch's exact integer product with the
documented epilogue, the float kinds pass lowbit's float64 reference, the dequantized weight is torch's
per-weight rounding bit for bit, and an opted-in layer's 17-64-row calls (16 rows a launch), CUDA-graph replay
and dequant path give the direct calls' bits."""
import pytest
import torch

import lowbit as lb
from lowbit.nn import QuantLinear
from lowbit.ops import bound
from lowbit.ops import prepared as runtime
from lowbit.ops.kernels.dense import prepared_class
from lowbit.ops.kernels.dense_w4 import TritonW4A16
from lowbit.ops.kernels.dense_w8 import TritonW8A16
from lowbit.ops.kernels.native import opted_in
from lowbit.ops.native import kernels as nk
from lowbit.ops.native import library
from lowbit.recipes.presets import get_recipe
from lowbit.scheme import QuantScheme
from lowbit.verify.check import check_quantized

pytestmark = pytest.mark.skipif(library.unavailable_reason() is not None,
                                reason=f"needs the native library on an sm_90 GPU ({library.unavailable_reason()})")

# (M, N, K): a partial 16-row tile and a partial last column of NT tiles, K past the 256-code k-block
SHAPES = [(1, 40, 384), (7, 333, 2176), (16, 100, 1152)]
VARIANTS = [dict(nt=2), dict(nt=4, prefetch=True), dict(prefetch=True), dict(splits=3, fixup=True),
            dict(splits=3, nt=2, fixup=True, prefetch=True)]
KINDS = {  # weight scheme, activation preset (None: weight-only), the launch's name
    "w4a16-g128": (QuantScheme(format="int4", strategy="group", group_size=128), None, "w4a16"),
    "w4a16-g32-asym": (QuantScheme(format="int4", strategy="group", group_size=32, symmetric=False), None, "w4a16"),
    "w8a16": (lb.get_preset("int8_channel"), None, "w8a16"),
    "w8a8-int8": (lb.get_preset("int8_channel"), "int8_token", "w8a8"),
    "w8a8-fp8": (lb.get_preset("fp8_row"), "fp8_row", "w8a8"),
}


def _case(kind, M, N, K, rng):
    ws, act, call = KINDS[kind]
    if ws.strategy == "group":
        K -= K % ws.group_size
    qt = lb.quantize(torch.randn(N, K, generator=rng), ws)
    w = (nk.prepare_w4 if call == "w4a16" else nk.prepare_w8)(qt.to("cuda"))
    x = torch.randn(M, K, generator=rng).bfloat16()
    return qt, w, x, act, getattr(nk, call)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_launch_variant_gives_the_default_bits(kind, rng):
    for M, N, K in SHAPES:
        qt, w, x, act, run = _case(kind, M, N, K, rng)
        xc = x.cuda()
        base = run(xc, w, 3)                      # three splits added by the second kernel
        for v in VARIANTS:
            for _ in range(2):                    # the fixup's counters are left at zero for the next launch
                y = run(xc, w, **{"splits": 3, **v})
                assert torch.equal(y.view(torch.int16), base.view(torch.int16)), (kind, M, N, K, v)
        y = base.cpu()
        if kind == "w8a8-int8":
            xq = lb.quantize(x.float(), lb.get_preset(act))
            acc = (xq.codes.double() @ qt.codes.double().T).float()     # exact integers (|acc| < 2^24)
            assert torch.equal(y, ((acc * xq.scale) * qt.scale.reshape(1, -1)).bfloat16())
        else:
            operand = x.double() if act is None else lb.quantize(x.float(), lb.get_preset(act))
            v = check_quantized(y, operand, qt, accumulator="fp32")
            assert v.passed, v.report()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_dequantized_weight_is_each_weight_rounded_once(dtype, rng):
    for kind in ("w4a16-g32-asym", "w8a16"):
        qt, w, _, _, _ = _case(kind, 1, 333, 2176, rng)
        z = 0 if qt.zero_point is None else qt.expanded_zero_point().float()
        s = qt.expanded_scale().float() if kind.startswith("w4") else qt.scale.reshape(-1, 1).float()
        want = ((qt.codes.float() - z) * s).to(dtype)
        assert torch.equal(nk.dequantize(w, dtype).cpu().view(torch.uint8), want.view(torch.uint8)), kind


@pytest.mark.parametrize("recipe,base", [("w4a16", TritonW4A16), ("w8a16-int8", TritonW8A16)])
def test_an_opted_in_layer_gives_its_direct_calls_bits(recipe, base, rng):
    """40 rows: the GEMV 16 rows a launch (bit for bit the per-chunk launches); 1 row in eager mode: the layer's
    CUDA-graph replay (a plan cannot hold a ctypes launch: the refusal says so); 300 rows: the weight
    dequantized from the native layout and the float GEMM, bit for bit the Triton class's dequant path."""
    r = get_recipe(recipe)
    lin = torch.nn.Linear(1152, 200, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02, generator=rng)
    with opted_in():
        q = QuantLinear.from_linear(lin, r.weight, r.act, backend="kernel").cuda()
    spec = q.fast_spec
    assert spec.kernel.startswith("native_") and spec.graphable, spec
    ops = {n: getattr(q, "fast_" + n) for n in spec.operands}
    bias = q.bias.detach().float().cuda()
    w = prepared_class(spec).native_weight(spec, ops)
    x = torch.randn(40, 1152, generator=rng).bfloat16().cuda()
    launch = nk.w4a16 if recipe == "w4a16" else nk.w8a16
    want = torch.cat([launch(x[i:i + 16], w, bias=bias) for i in (0, 16, 32)])
    assert torch.equal(runtime.run(spec, x, ops, bias), want)
    x1 = x[:1].clone()
    direct = runtime.run(spec, x1, ops, bias)
    before = dict(bound.REFUSALS)
    outs = [q(x1) for _ in range(4)]          # direct, a refused recording, then graph replays
    assert all(torch.equal(o.reshape(direct.shape), direct) for o in outs)
    assert any("ctypes" in k and n > before.get(k, 0) for k, n in bound.REFUSALS.items()), bound.REFUSALS
    xl = torch.randn(300, 1152, generator=rng).bfloat16().cuda()
    tri = base.prepare(q.weight_q.cuda(), None, None)
    assert torch.equal(q(xl), base.dequant.apply(tri.spec, xl, tri.tensors, bias, None))
