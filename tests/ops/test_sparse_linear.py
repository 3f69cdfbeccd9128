"""2:4 sparse linear (lowbit.ops.sparse): the dense twin on the CPU, PyTorch's semi-structured
sparse path (cuSPARSELt / CUTLASS) on CUDA, both against a float64 reference."""
import pytest
import torch

from lowbit.ops.sparse import prepare_2_4, sparse_linear
from lowbit.sparsity import prune_2_4

U32 = 2.0 ** -24


def _bound(x64, w64, ref, K):
    """bf16 operands are exact in float32 products; float32 accumulation of K terms in any
    order is within gamma_K <= K*u32 of sum |x||w| (2u per add allows a truncating adder),
    then the bf16 output rounding, unit roundoff 2^-8, of the computed value."""
    acc = 2 * K * U32 * (x64.abs() @ w64.abs().T)
    return acc + 2.0 ** -8 * (ref.abs() + acc)


def _weights(rng, N, K, device):
    w = prune_2_4(torch.randn(N, K, generator=rng)).to(torch.bfloat16)
    return w.to(device)


def test_sparse_linear_against_float64(device, rng):
    N, K = 128, 192
    w = _weights(rng, N, K, device)
    sw = prepare_2_4(w)
    assert sw.backend == ("dense" if device == "cpu" else sw.backend)
    if device == "cuda":
        assert sw.backend == "cusparselt" and sw.sparse is not None
    bias = torch.randn(N, generator=rng).to(torch.bfloat16)
    for M in (1, 3, 17):
        x = torch.randn(M, K, generator=rng).to(torch.bfloat16)
        out = sparse_linear(x.to(device), sw, bias.to(device))
        assert out.shape == (M, N) and out.dtype == torch.bfloat16
        ref = x.double() @ w.cpu().double().T + bias.double()
        bound = _bound(x.double(), w.cpu().double(), ref, K) + 2.0 ** -8 * bias.double().abs()
        assert torch.all((out.cpu().double() - ref).abs() <= bound)


def test_sparse_and_dense_backends_agree_on_gpu(device, rng):
    if device != "cuda":
        pytest.skip("the semi-structured sparse path needs CUDA")
    N, K = 512, 1024
    w = _weights(rng, N, K, device)
    x = torch.randn(2, 33, K, generator=rng).to(torch.bfloat16).cuda()
    dense = sparse_linear(x, prepare_2_4(w, backend="dense"))
    for backend in ("cusparselt",):  # PyTorch's CUTLASS path refuses sm_90 ("8.x only")
        out = sparse_linear(x, prepare_2_4(w, backend=backend))
        ref = x.double().reshape(-1, K) @ w.double().T
        bound = _bound(x.double().reshape(-1, K), w.double(), ref, K)
        assert torch.all((out.double().reshape(-1, N) - ref).abs() <= bound), backend
        assert torch.all((dense.double().reshape(-1, N) - ref).abs() <= bound)


def test_errors(rng):
    w = torch.randn(64, 64, generator=rng).to(torch.bfloat16)
    with pytest.raises(ValueError, match="not 2:4 sparse"):
        prepare_2_4(w)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        prepare_2_4(prune_2_4(w.float()))
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        prepare_2_4(prune_2_4(w), backend="cusparselt")
    sw = prepare_2_4(prune_2_4(w))
    with pytest.raises(ValueError, match="last dim must be K"):
        sparse_linear(torch.randn(2, 63).to(torch.bfloat16), sw)
    with pytest.raises(TypeError, match="must match"):
        sparse_linear(torch.randn(2, 64), sw)
