"""The one-launch W8A8 decode kernel (lowbit.ops.triton.gemm_w8a8_small: the per-token quantization in the
GEMM's prologue), through the prepared W8A8 classes with the tuning table's fused configurations. Oracles: the
two-launch path (its quantizer is bit for bit lowbit.quantize's, tests/ops/test_act_quant*), torch's exact
integer product with the documented epilogue (int8), lowbit's float64 reference (fp8). Rows of very different
sizes, an all-zero row (scale 1), shapes that are no tile multiple, a bias, per-tensor weight scales."""
import pytest
import torch

import lowbit as lb
from lowbit.bench.sm90 import fresh_process
from lowbit.bench.tune import W8A8_FUSED
from lowbit.ops.kernels.dense_w8 import TritonW8A8Fp8, TritonW8A8Int8
from lowbit.recipes.presets import get_recipe
from lowbit.verify.check import check_quantized

CASES = [(1, 40, 200), (7, 33, 384), (16, 70, 130)]


def _x(M, K, rng):
    x = torch.randn(M, K, generator=rng) * torch.logspace(-3, 3, M)[:, None]
    if M > 2:
        x[1] = 0.0
    return x.bfloat16()


@pytest.mark.parametrize("recipe,cls", [("w8a8-int8", TritonW8A8Int8), ("w8a8-fp8", TritonW8A8Fp8),
                                        ("w8a8-int8/weight-tensor", TritonW8A8Int8)])
def test_fused_configs_give_the_two_launch_bits(recipe, cls, rng, kernel_device):
    r = get_recipe(recipe.split("/")[0])
    w_scheme = lb.QuantScheme(format="int8", strategy="tensor") if recipe.endswith("weight-tensor") else r.weight
    for M, N, K in CASES:
        wq = lb.quantize(torch.randn(N, K, generator=rng), w_scheme)
        p = cls.prepare(wq.to(kernel_device), r.act, None)
        x, bias = _x(M, K, rng).to(kernel_device), (torch.randn(N, generator=rng) * 4).to(kernel_device)
        for b in (None, bias):
            ref = cls.apply(p.spec, x, p.tensors, b, None)
            for cfg in W8A8_FUSED[:2]:
                y = cls.apply(p.spec, x, p.tensors, b, cfg)
                assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), (recipe, M, N, K, cfg, b is not None)
        y = cls.apply(p.spec, x, p.tensors, None, W8A8_FUSED[0]).cpu()
        xq = lb.quantize(x.float().cpu(), r.act)
        if recipe.startswith("w8a8-int8"):
            acc = (xq.codes.double() @ wq.codes.double().T).float()         # exact integers (|acc| < 2^24)
            want = ((acc * xq.scale.reshape(-1, 1)) * wq.scale.reshape(1, -1).float()).bfloat16()
            assert torch.equal(y, want)
        else:
            v = check_quantized(y, xq, wq, accumulator="fp32")
            assert v.passed, v.report()


def test_a_fused_cell_past_its_rows_runs_the_two_launch_path_with_its_defaults(rng, interpreter):
    r = get_recipe("w8a8-int8")
    wq = lb.quantize(torch.randn(24, 96, generator=rng), r.weight)
    p = TritonW8A8Int8.prepare(wq, r.act, None)
    x = _x(17, 96, rng)
    ref = TritonW8A8Int8.apply(p.spec, x, p.tensors, None, None)
    assert torch.equal(TritonW8A8Int8.apply(p.spec, x, p.tensors, None, W8A8_FUSED[0]), ref)


SM90 = r'''
import json, re
from lowbit.bench.sm90 import SHARED_LIMIT, compile_sm90
from lowbit.bench.tune import W8A8_FUSED
from lowbit.ops.triton.gemm_w8a8_small import _w8a8_small_kernel, small_m_config
out = []
for fp8 in (False, True):
    for cfg in [small_m_config(1, 14336, 4096)] + W8A8_FUSED:
        t = "*fp8e4nv" if fp8 else "*i8"
        sig = {"x_ptr": "*bf16", "b_ptr": t, "c_ptr": "*bf16", "sb_ptr": "*fp32", "bias_ptr": "*fp32",
               **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_bn", "stride_cm", "stride_sb")}}
        consts = dict(FP8=fp8, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                      PROMOTE_K=min(cfg["BLOCK_K"], 128))
        r = compile_sm90(_w8a8_small_kernel, sig, consts, no_div=("M", "stride_sb"), num_warps=cfg["num_warps"],
                         num_stages=cfg["num_stages"])
        mma = len(re.findall(r"\b[HIQ]G?MMA", r["sass_text"]))
        out.append({"fp8": fp8, "config": cfg, "spill": r["spill_ops"], "shared": r["shared"], "limit": SHARED_LIMIT,
                    "mma": mma})
from lowbit.ops.triton.act_quant import _act_quant_kernel     # the two-launch path's quantizer shares sym_codes
for mode in range(3):
    sig = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "z_ptr": "*i32", "K": "i32", "stride_xm": "i32",
           "stride_qm": "i32"}
    r = compile_sm90(_act_quant_kernel, sig, dict(MODE=mode, BLOCK=4096), num_warps=8)
    out.append({"act_quant_mode": mode, "spill": r["spill_ops"], "shared": r["shared"], "limit": SHARED_LIMIT,
                "mma": 1})
print(json.dumps(out))
'''


def test_the_configs_compile_for_sm90_on_tensor_cores_without_spills():
    """Every configuration `lowbit tune` may pick, and the default, compile for sm_90 (H100 / H200) without a GPU:
    8-bit tensor-core instructions, no spilled registers, shared memory within the limit; and the per-token
    quantizer whose arithmetic it shares, in each mode (Triton's compiler in a subprocess: the test process has
    TRITON_INTERPRET set)."""
    import json

    p = fresh_process(["-c", SM90])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * (1 + len(W8A8_FUSED)) + 3
    for r in rows:
        assert r["spill"] == 0 and r["shared"] <= r["limit"] and r["mma"] > 0, r
