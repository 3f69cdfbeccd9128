"""verify/probe.py: the test vectors and the fit recover exactly the parameters of an accumulator
simulated by an independent integer implementation here (shifts and masks on fixed-point
products, not lowbit's aligned_sum); a probe table makes the diagnosis simulate the measured
accumulator."""
import numpy as np
import pytest
import torch

import lowbit as lb
from lowbit.verify import accumulate, check_linear
from lowbit.verify import probe as P

UNIT = 2.0 ** -60          # every probe value is a multiple of 2^-60 * 2^-60 ... kept exact as integers


def int_accumulator(bits, rounding, block, promote):
    """An accumulator written with Python integers: products as integers of UNIT^2 (exact), each step
    aligns the running sum and `block` products to the top bit of the largest and drops the bits
    below `bits` fraction bits by `rounding`; promotion adds into a float32 (numpy) accumulator."""
    def drop(v, shift):
        if shift <= 0:
            return v
        q, r = divmod(abs(v), 1 << shift)
        if rounding == "nearest" and (2 * r > (1 << shift) or (2 * r == (1 << shift) and q % 2)):
            q += 1
        if rounding == "floor" and v < 0 and r:
            q += 1
        return (q if v >= 0 else -q) << shift

    def dot(a, b):
        out = []
        for ra, rb in zip(a.tolist(), b.tolist()):
            terms = [int(round(x / UNIT)) * int(round(y / UNIT)) for x, y in zip(ra, rb)]
            acc, total = 0, np.float32(0)
            for s in range(0, len(terms), block):
                step = [acc] + terms[s:s + block]
                top = max(abs(t) for t in step).bit_length() - 1
                acc = sum(drop(t, top - bits) for t in step)
                if promote and (s + block) % promote == 0:
                    total, acc = np.float32(total + np.float32(acc * UNIT * UNIT)), 0
            out.append(float(np.float32(total + np.float32(acc * UNIT * UNIT))))
        return torch.tensor(out, dtype=torch.float64)
    return dot


@pytest.mark.parametrize("bits,rounding,block,promote", [
    (13, "trunc", 32, 0),        # Hopper fp8 fast accumulation (measured on the H200)
    (13, "trunc", 32, 128),      # cuBLAS fp8 without fast accumulation
    (10, "nearest", 16, 0),
    (9, "floor", 4, 64),
])
def test_fit_recovers_a_simulated_accumulator_exactly(bits, rounding, block, promote):
    f = P.probe(int_accumulator(bits, rounding, block, promote), -9, 8, k=512)
    assert f.fitted and (f.bits, f.rounding, f.block, f.promote) == (bits, rounding, block, promote), f
    assert f.candidates == 1, f


def test_vectors_are_exact_in_the_input_format():
    vec = P.vectors(-9, 8, k=512)
    import ml_dtypes
    for name, (a, b) in vec.sets.items():
        for t in (a, b):
            back = t.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            assert np.array_equal(back, t.numpy()), name


def test_an_exact_accumulator_is_not_fitted_as_a_narrow_one():
    f = P.probe(lambda a, b: (a * b).sum(1).float().double(), -9, 8, k=512)
    assert f.bits == 23 and "at least 23 fraction bits" in f.note, f     # all that a float32 output shows


def test_a_probe_table_makes_the_diagnosis_simulate_the_measured_accumulator(rng, monkeypatch):
    monkeypatch.setattr(accumulate, "PROBED", {})
    table = {"device": "a test GPU", "paths": {"cublas_fp8_fast": {"fitted": True, "bits": 11, "rounding": "trunc",
                                                                   "block": 32, "promote": 0}}}
    accumulate.use_probe_table(table)
    M, K, N = 8, 1024, 16
    x, w = torch.rand(M, K, generator=rng), torch.rand(N, K, generator=rng)      # same sign: truncation shows
    s = lb.get_preset("fp8_row")
    xq, wq = lb.quantize(x, s), lb.quantize(w, s)
    X, W = xq.decoded().double(), wq.decoded().double()
    dot = int_accumulator(11, "trunc", 32, 0)
    acc = torch.stack([dot(X[i:i + 1].expand(N, K), W) for i in range(M)])
    out = (acc.float() * xq.scale) * wq.scale.T
    v = check_linear(out, x, w, x_scheme=s, w_scheme=s)
    c = v.causes[0]
    assert v.kind == "numerical" and c.name == "accumulator_narrower_than_promised" and c.confirmed, v.report()
    assert "as probed on a test GPU (11 fraction bits" in c.detail, v.report()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a GPU")
def test_probe_on_this_gpu():
    table = P.measure()
    text = P.describe(table)
    paths = table["paths"]
    assert paths["int8"]["exact_int32"], text
    if "hopper" in torch.cuda.get_device_name().lower() or torch.cuda.get_device_capability() == (9, 0):
        fast = paths["cublas_fp8_fast"]
        assert fast["fitted"] and (fast["bits"], fast["rounding"], fast["block"]) == (13, "trunc", 32), text


def test_probe_command_without_cuda_says_why(capsys):
    import argparse

    from lowbit.entrypoints import probe as cli
    parser = argparse.ArgumentParser()
    cli.register(parser)
    args = parser.parse_args(["--json", "table.json"])
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the command measures it (test_probe_on_this_gpu)")
    assert cli.run(args) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_probe_dot_kernel(rng, kernel_device):
    # the Triton GEMM the probe measures tl.dot with: small integers, so every order sums exactly
    # (fp16: the CPU interpreter reads bfloat16 wrongly; on CUDA the probe runs bf16 and fp8)
    from lowbit.ops.triton.probe_dot import dot_f32
    a = torch.randint(-8, 9, (32, 64), generator=rng).float()
    b = torch.randint(-8, 9, (16, 64), generator=rng).float()
    got = dot_f32(a.to(kernel_device, torch.float16), b.to(kernel_device, torch.float16)).cpu()
    assert torch.equal(got, a @ b.T)
    with pytest.raises(ValueError, match="multiple"):
        dot_f32(a[:, :48].to(kernel_device, torch.float16), b[:, :48].to(kernel_device, torch.float16))
