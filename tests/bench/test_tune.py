"""`lowbit tune`'s candidates: every W8A8 tile alternative it may pick computes what the default
tiles compute (int8: bit for bit; the interpreter runs each configuration at a shape that is no
tile multiple), and the command refuses to run without a GPU."""
import pytest
import torch

from lowbit.bench import tune
from lowbit.ops import tuning


def test_candidates_per_kind():
    assert tune.candidates("w4a16/int4/g128", "1") == [("kernel", None), ("dequant", None)]
    for b in tuning.BUCKET_NAMES:
        c = tune.candidates("w8a8/int8", b)
        assert c[0] == ("kernel", None) and all(p == "kernel" for p, _ in c)


@pytest.mark.parametrize("bucket", [b for b in tuning.BUCKET_NAMES if tune.W8A8_TILES[b]])
def test_w8a8_tile_alternatives_are_bit_identical(rng, bucket):
    from lowbit.ops.triton.gemm_int8 import launch_int8_gemm
    M, N, K = 5, 70, 300
    a = torch.randint(-127, 128, (M, K), generator=rng, dtype=torch.int8)
    b = torch.randint(-127, 128, (N, K), generator=rng, dtype=torch.int8)
    sa, sb = torch.rand(M, generator=rng) + 0.01, torch.rand(N, generator=rng) + 0.01
    ref = launch_int8_gemm(a, b, torch.empty(M, N, dtype=torch.bfloat16), sa, sb, None, None, None)
    exact = ((a.double() @ b.double().T) * sa.double()[:, None] * sb.double()[None, :])
    assert (ref.double() - exact).abs().max() <= 2.0 ** -8 * exact.abs().max()   # the default is right
    for cfg in tune.W8A8_TILES[bucket]:
        y = launch_int8_gemm(a, b, torch.empty(M, N, dtype=torch.bfloat16), sa, sb, None, None, None, config=cfg)
        assert torch.equal(y, ref), cfg


def test_tune_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(ValueError, match="CUDA GPU"):
        tune.run_tune("tiny")
