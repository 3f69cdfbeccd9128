"""Shared test set-up. Without CUDA, Triton kernels run in Triton's CPU interpreter; the
variable must be set before triton is first imported, hence here.

Randomized tests take the `seed` fixture (or `rng`, a torch.Generator seeded by it): a fresh
seed from the OS in every run, printed with the one command that reproduces a failure.
Options:
  --seed N    every randomized test uses seed N (reproduce a failure)
  --soak N    run only the randomized tests, each over N fresh seeds; the summary lists every
              failing (test, seed) pair (scripts/soak.sh); with LOWBIT_SOAK_FAILURES=FILE each
              failure is also appended to FILE as it happens
"""
import os
import shlex
import sys

import torch

# Test-only oracles (torchao) live outside site-packages (scripts/setup.sh says why).
_ORACLES = os.path.join(sys.prefix, "oracles")
if os.path.isdir(_ORACLES) and _ORACLES not in sys.path:
    sys.path.append(_ORACLES)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help="seed for every randomized test (reproduces a failure; default: fresh from the OS)")
    parser.addoption("--soak", type=int, default=0, metavar="N",
                     help="run only the randomized tests (those taking `seed` or `rng`), each over N fresh seeds")


def pytest_generate_tests(metafunc):
    n = metafunc.config.getoption("soak")
    if n > 0 and "seed" in metafunc.fixturenames:
        # the ids are fixed (s0, s1, ...) so that xdist's workers collect the same tests; each
        # instance still draws its own fresh seed when it runs
        metafunc.parametrize("_soak_index", range(n), ids=[f"s{i}" for i in range(n)])


def pytest_collection_modifyitems(config, items):
    if config.getoption("soak") > 0:
        keep = [it for it in items if "seed" in getattr(it, "fixturenames", ())]
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep


@pytest.fixture
def seed(request, _soak_index) -> int:
    """A fresh 32-bit seed (or --seed's), recorded so that a failure prints how to reproduce it."""
    fixed = request.config.getoption("seed")
    s = fixed if fixed is not None else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", s))
    print(f"random seed: {s}")
    return s


@pytest.fixture
def _soak_index():
    """Only a parameter under --soak (see pytest_generate_tests)."""
    return 0


@pytest.fixture
def rng(seed):
    """Fresh random data in every test: seeded from the OS, the seed printed on failure."""
    return torch.Generator().manual_seed(seed)


def _seed_of(report):
    return next((v for k, v in report.user_properties if k == "seed"), None)


def _repro(nodeid: str, seed: int) -> str:
    base = nodeid.split("[")[0] if "[s" in nodeid else nodeid
    if "[s" in nodeid:  # drop only the soak parameter, keep the test's own parameters
        params = nodeid[nodeid.index("[") + 1:-1].split("-")
        params = [p for p in params if not (p.startswith("s") and p[1:].isdigit())]
        base += f"[{'-'.join(params)}]" if params else ""
    return f"PYTHONPATH=src python -m pytest {shlex.quote(base)} -p no:xdist --seed {seed}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    s = _seed_of(report)
    if report.failed and s is not None:
        report.sections.append(("lowbit seed", f"random seed {s}; reproduce with:\n  {_repro(report.nodeid, s)}"))
        log = os.environ.get("LOWBIT_SOAK_FAILURES")
        if log:  # a long soak shows its failures as they happen (xdist workers print nothing)
            with open(log, "a") as f:
                f.write(f"{s} {_repro(report.nodeid, s)}\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    failed = [r for r in terminalreporter.stats.get("failed", []) if _seed_of(r) is not None]
    if config.getoption("soak") > 0:
        ran = [r for k in ("passed", "failed") for r in terminalreporter.stats.get(k, []) if r.when == "call"]
        terminalreporter.write_sep("=", f"soak: {len(ran)} seeded runs, {len(failed)} failed")
    for r in failed:
        terminalreporter.write_line(f"FAILED SEED {_seed_of(r)}: {_repro(r.nodeid, _seed_of(r))}")


@pytest.fixture(params=["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def kernel_device(request):
    """Where a Triton kernel runs: the CPU through the interpreter (CI), or CUDA. On a CUDA
    machine the interpreter is off, so the CPU case is left to CI."""
    if request.param == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU (interpreter) variant runs in CI, where there is no CUDA")
    return request.param


@pytest.fixture
def interpreter():
    """A test of kernel logic on CPU tensors through Triton's interpreter: left to CI on a CUDA
    machine, where the interpreter is off."""
    if torch.cuda.is_available():
        pytest.skip("the CPU (interpreter) variant runs in CI, where there is no CUDA")


@pytest.fixture(params=DEVICES)
def device(request):
    """Run a test on the CPU and, where present, on CUDA."""
    return request.param
