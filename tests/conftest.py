"""Shared test set-up. Without CUDA, Triton kernels run in Triton's CPU interpreter; the
variable must be set before triton is first imported, hence here."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """Run a test on the CPU and, where present, on CUDA."""
    return request.param


@pytest.fixture
def rng():
    """Fresh random data in every test: seeded from the OS, the seed printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def kernel_device(request):
    """Where a Triton kernel runs: the CPU through the interpreter (CI), or CUDA. On a CUDA
    machine the interpreter is off, so the CPU case is left to CI."""
    if request.param == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU (interpreter) variant runs in CI, where there is no CUDA")
    return request.param
