"""The fp8 W8A8 layer's prefill paths (lowbit.ops.kernels.dense_w8: torch._scaled_mm row-wise and lowbit's CUTLASS
GEMM, which the tuning table may pick at 65+ rows) on an sm_90 GPU: a prepared layer's call through each path
against lowbit's float64 reference (check_quantized with the fp8 tensor core's accumulator model) and against the
layer's Triton path, at row counts that are not tile multiples, with and without a bias. Which path a table cell
selects, and the fall-back where a path cannot run, are tested without a GPU in test_kernel_classes.py."""
import pytest
import torch

import lowbit as lb
from lowbit.nn import QuantLinear
from lowbit.ops.kernels.base import fp8_dot_accumulator
from lowbit.ops.kernels.dense_w8 import CutlassW8A8Fp8, ScaledMMW8A8Fp8, TritonW8A8Fp8
from lowbit.ops.native import prefill as pf
from lowbit.ops.reference import qlinear_reference
from lowbit.recipes.presets import get_recipe
from lowbit.verify.check import check_quantized
from lowbit.verify.tolerance import implementation_gate

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
PATHS = [(ScaledMMW8A8Fp8, None)] + [(CutlassW8A8Fp8, {"config": i}) for i, c in enumerate(pf.ROWWISE_CONFIGS)
                                     if not c.fast_accum]


@pytest.mark.skipif(not ON_SM90, reason="the fp8 prefill paths run on an sm_90 GPU")
@pytest.mark.parametrize("cls,config", PATHS, ids=lambda p: getattr(p, "name", str(p)))
@pytest.mark.parametrize("M", [333, 1037])
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_path_matches_the_reference_and_the_triton_path(cls, config, M, bias, rng):
    if cls.usable() is not None:
        pytest.skip(f"{cls.name} cannot run here: {cls.usable()}")
    N, K = 400, 640
    r = get_recipe("w8a8-fp8")
    lin = torch.nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=rng) * (torch.rand(N, 1, generator=rng) + 0.1) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(N, generator=rng))
    q = QuantLinear.from_linear(lin, r.weight, r.act, backend="kernel").cuda()
    spec = q.fast_spec
    assert spec.kernel == TritonW8A8Fp8.name
    ops = {n: getattr(q, "fast_" + n) for n in spec.operands}
    x = (torch.randn(M, K, generator=rng) * (torch.rand(M, 1, generator=rng) * 3 + 0.1)).bfloat16()
    b = None if q.bias is None else q.bias.detach()
    y = cls.apply(spec, x.cuda(), ops, None if b is None else b.cuda(), config)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    xq, wq = lb.quantize(x.float(), r.act), q.weight_q
    acc = fp8_dot_accumulator("cuda")
    v = check_quantized(y.cpu(), xq, wq, bias=None if b is None else b.double().cpu(), accumulator=acc)
    assert v.passed, v.report()
    gate = implementation_gate(xq, wq, qlinear_reference(xq, wq, None if b is None else b.cpu()), accumulator=acc,
                               out_dtype=torch.bfloat16, bias=None if b is None else b.cpu())
    t = TritonW8A8Fp8.apply(spec, x.cuda(), ops, None if b is None else b.cuda(), None)
    assert ((y.double() - t.double()).abs().cpu() <= 2 * gate).all()    # each within its gate of the reference
