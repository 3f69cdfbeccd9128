"""lowbit.ops.linear: which kernel each scheme pair gets, that every backend computes the same
function as the float64 reference (within a derived bound), and that nothing falls back silently."""
import pytest
import torch

import lowbit as lb
from lowbit.ops import linear, qlinear_reference
from lowbit.ops.linear import kernel_for
from lowbit.scheme import QuantScheme
from lowbit.verify.tolerance import gamma

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U32 = 2.0 ** -24
P = lb.get_preset

PAIRS = {
    "int8": (P("int8_token"), P("int8_channel")),
    "int8_asym": (QuantScheme("int8", "token", symmetric=False), P("int8_channel")),
    "fp8_rowwise": (P("fp8_row"), P("fp8_row")),
    "fp8_tensor": (P("fp8_tensor"), P("fp8_tensor")),
    "fp8_block": (P("fp8_block1x128"), P("fp8_block128")),
    "mxfp8": (P("mxfp8"), P("mxfp8")),
}


def test_kernel_table():
    assert kernel_for(*PAIRS["int8"]) == "int8"
    assert kernel_for(*PAIRS["int8_asym"]) == "int8"
    assert kernel_for(*PAIRS["fp8_rowwise"]) == "fp8_rowwise"
    assert kernel_for(*PAIRS["fp8_tensor"]) == "fp8_rowwise"
    assert kernel_for(QuantScheme("fp8_e4m3fn", "token"), P("fp8_tensor")) == "fp8_rowwise"
    assert kernel_for(*PAIRS["fp8_block"]) == "fp8_block"
    assert kernel_for(QuantScheme("fp8_e4m3fn", "group", group_size=128), P("fp8_block128")) == "fp8_block"
    assert kernel_for(*PAIRS["mxfp8"]) == "mxfp8"
    # pairs with no kernel
    assert kernel_for(P("int8_token"), P("fp8_row")) is None
    assert kernel_for(P("int8_token"), QuantScheme("int8", "channel", symmetric=False)) is None
    assert kernel_for(P("mxfp4"), P("mxfp4")) is None
    assert kernel_for(None, P("int4_g128")) is None
    assert kernel_for(P("fp8_row"), QuantScheme("fp8_e4m3fn", "block", block_size=(64, 64))) is None


def _bound(xq, wq, bias, out_dtype, u_acc):
    """|out - ref| bound, Higham's gamma_n = n u / (1 - n u) for n compounded roundings: the
    accumulation (gamma_K(u_acc) of sum|x_k w_k| = S, zero for exact int8) and the fp32 epilogue
    the kernels document (lowbit.ops.triton.gemm_int8 / gemm_fp8 / gemm_blockscaled): acc -> fp32,
    two scale products and the bias add, 4 roundings of quantities <= S (1 + gamma_K) + |bias|;
    then the cast to out_dtype (u_out, applied by the caller)."""
    xd, wd = xq.dequantize(torch.float64), wq.dequantize(torch.float64)
    S = xd.abs().reshape(-1, xd.shape[-1]) @ wd.abs().T
    K = xd.shape[-1]
    b = 0.0 if bias is None else bias.double().abs()
    acc = gamma(K, u_acc) * S
    e = acc + gamma(4, U32) * (S + acc + b)
    u_out = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[out_dtype]
    return e, u_out


@pytest.mark.parametrize("pair", list(PAIRS))
def test_backends_match_reference(rng, pair):
    xs, ws = PAIRS[pair]
    M0, M1, N = 2, int(torch.randint(1, 9, (1,), generator=rng)), int(torch.randint(24, 41, (1,), generator=rng))
    K = 256 if pair in ("fp8_block",) else 32 * int(torch.randint(2, 6, (1,), generator=rng))
    x = torch.randn(M0, M1, K, generator=rng) * 3
    x[0, 0] = 0.0  # an all-zero token: scale 1, zero codes, no NaN
    w = torch.randn(N, K, generator=rng) * torch.rand(N, 1, generator=rng)
    bias = torch.randn(N, generator=rng)
    xq, wq = lb.quantize(x.to(DEV), xs), lb.quantize(w.to(DEV), ws)
    ref = qlinear_reference(xq, wq, bias.to(DEV)).cpu()
    assert ref.shape == (M0, M1, N)
    backends = ["reference", "triton"] + (["torch"] if pair in ("int8", "int8_asym", "fp8_rowwise",
                                                                  "fp8_tensor") else [])
    for backend in backends + [None]:
        if backend == "torch" and DEV == "cuda" and (pair.startswith("int8") or N % 16):
            # torch._int_mm on CUDA refuses M <= 16, _scaled_mm N % 16 != 0: a clear error
            with pytest.raises(NotImplementedError, match="torch._(int|scaled)_mm on CUDA needs"):
                linear(xq, wq, bias=bias.to(DEV), out_dtype=torch.float32, backend=backend)
            continue
        out = linear(xq, wq, bias=bias.to(DEV), out_dtype=torch.float32, backend=backend).cpu().double()
        assert out.shape == ref.shape
        exact_int = pair.startswith("int8")
        u_acc = 0.0 if exact_int else (2.0 ** -13 if DEV == "cuda" and backend != "reference" else U32)
        e, _ = _bound(xq.to("cpu"), wq.to("cpu"), bias, torch.float32, u_acc)
        err = (out - ref).abs().reshape(-1, N)
        assert torch.all(err <= e), f"{pair} backend={backend}: max excess {(err - e).max()}"
        assert torch.isfinite(out).all()


def test_cpu_auto_backend_is_exact_for_int8(rng):
    """On the CPU, backend=None takes torch._int_mm with a float64 epilogue: the float64 output
    equals the float64 reference exactly (integer accumulation, same epilogue products)."""
    if DEV == "cuda":
        pytest.skip("CPU dispatch")
    xs, ws = PAIRS["int8"]
    xq = lb.quantize(torch.randn(5, 96, generator=rng), xs)
    wq = lb.quantize(torch.randn(33, 96, generator=rng), ws)
    out = linear(xq, wq, out_dtype=torch.float64)
    ref = qlinear_reference(xq, wq)
    assert torch.allclose(out, ref, rtol=4 * 2.0 ** -53, atol=0)  # two float64 products apart at most


def test_w_colsum_precomputed_equals_computed(rng):
    xs, ws = PAIRS["int8_asym"]
    xq = lb.quantize((torch.rand(4, 64, generator=rng) * 5).to(DEV), xs)  # one-sided: zero points matter
    wq = lb.quantize(torch.randn(24, 64, generator=rng).to(DEV), ws)
    cs = wq.codes.sum(1, dtype=torch.int32)
    a = linear(xq, wq, out_dtype=torch.float32, backend="triton")
    b = linear(xq, wq, out_dtype=torch.float32, backend="triton", w_colsum=cs)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="w_colsum must be int32"):
        linear(xq, wq, backend="triton", w_colsum=cs.float())


def test_no_silent_fallback(rng):
    w = torch.randn(24, 128, generator=rng).to(DEV)
    x = torch.randn(3, 128, generator=rng).to(DEV)
    xq = lb.quantize(x, P("int8_token"))
    wq_fp8 = lb.quantize(w, P("fp8_row"))
    with pytest.raises(NotImplementedError, match="no triton kernel for x: .*int8.* with w: .*fp8"):
        linear(xq, wq_fp8, backend="triton")
    with pytest.raises(NotImplementedError, match="no torch kernel"):
        linear(lb.quantize(x, P("mxfp8")), lb.quantize(w, P("mxfp8")), backend="torch")
    with pytest.raises(NotImplementedError, match="unquantized"):
        linear(x, lb.quantize(w, P("int4_g128")), backend="triton")
    if DEV == "cuda":
        with pytest.raises(NotImplementedError, match="M > 16"):
            linear(xq, lb.quantize(w, P("int8_channel")), backend="torch")
    with pytest.raises(ValueError, match="backend="):
        linear(xq, lb.quantize(w, P("int8_channel")), backend="cutlass")
    with pytest.raises(TypeError, match="wq must be a QTensor"):
        linear(xq, w)
    with pytest.raises(ValueError, match="K=48"):
        linear(xq, lb.quantize(w[:, :48], P("int8_channel")), backend="triton")
    assert linear(xq, lb.quantize(w, P("int8_channel")), backend="reference").shape == (3, 24)


def test_cpu_tensors_refused_by_triton_outside_interpreter(monkeypatch, rng):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    xq = lb.quantize(torch.randn(3, 64, generator=rng), P("int8_token"))
    wq = lb.quantize(torch.randn(24, 64, generator=rng), P("int8_channel"))
    with pytest.raises(ValueError, match="need CUDA tensors"):
        linear(xq, wq, backend="triton")


@pytest.mark.parametrize("pair", ["int8", "int8_asym", "fp8_rowwise", "fp8_tensor", "fp8_block", "mxfp8"])
def test_triton_output_passes_check_linear(rng, pair):
    """The verification engine (derived gates from the original float inputs) accepts the
    kernels' outputs, and rejects the same output with one channel's scale off by half."""
    from lowbit.verify import check_linear

    xs, ws = PAIRS[pair]
    M, N = int(torch.randint(1, 20, (1,), generator=rng)), int(torch.randint(24, 41, (1,), generator=rng))
    K = 256 if pair == "fp8_block" else 32 * int(torch.randint(2, 6, (1,), generator=rng))
    x = torch.randn(M, K, generator=rng) * 2
    w = torch.randn(N, K, generator=rng) * torch.rand(N, 1, generator=rng)
    bias = torch.randn(N, generator=rng)
    xq, wq = lb.quantize(x.to(DEV), xs), lb.quantize(w.to(DEV), ws)
    out = linear(xq, wq, bias=bias.to(DEV), out_dtype=torch.bfloat16, backend="triton").cpu()
    # On Hopper the fp8 MMA keeps about 14 bits between the kernels' fp32 promotions; fp16's
    # accumulator model (11 bits) is the conservative stand-in the gate knows.
    acc = "fp16" if DEV == "cuda" and not pair.startswith("int8") else None
    verdict = check_linear(out, x, w, x_scheme=xs, w_scheme=ws, bias=bias, accumulator=acc)
    assert verdict.passed, verdict.report() if hasattr(verdict, "report") else verdict
    broken = out.float().clone()
    col = int((out.float() - bias).abs().sum(0).argmax())  # a channel whose x.w is far from 0
    broken[:, col] = (broken[:, col] - bias[col]) * 1.5 + bias[col]  # that channel scaled 1.5x
    assert not check_linear(broken, x, w, x_scheme=xs, w_scheme=ws, bias=bias, accumulator=acc).passed
