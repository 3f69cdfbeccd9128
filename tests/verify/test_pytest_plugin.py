"""The pytest plugin (lowbit.verify.pytest_plugin): run in a child pytest on a generated test file,
as a kernel author would enable it (-p lowbit.verify.pytest_plugin)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")

TESTS = textwrap.dedent('''
    import pytest
    import torch

    def kernel(x, w, bug=False):
        sx = x.abs().amax(dim=1, keepdim=True) / 127
        sw = w.abs().amax(dim=1, keepdim=True) / 127
        acc = (torch.round(x / sx).double() @ torch.round(w / sw).double().T).float()
        return acc * sx * sw.T + (1.0 if bug else 0.0)

    X = torch.randn(9, 64, generator=torch.Generator().manual_seed(SEED))
    W = torch.randn(11, 64, generator=torch.Generator().manual_seed(SEED + 1))

    @pytest.mark.lowbit(x_scheme="int8_token", w_scheme="int8_channel", accumulator="int32")
    def test_good(lowbit_check):
        assert lowbit_check(kernel(X, W), X, W).passed

    @pytest.mark.lowbit(x_scheme="int8_token", w_scheme="int8_channel")
    def test_bad(lowbit_check):
        lowbit_check(kernel(X, W, bug=True), X, W)

    def test_no_schemes(lowbit_check):
        lowbit_check(kernel(X, W), X, W)
''')


def test_fixture_and_marker(tmp_path, seed):
    (tmp_path / "test_kernel.py").write_text(TESTS.replace("SEED", str(seed % 1000)))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "lowbit.verify.pytest_plugin", "-p", "no:cacheprovider",
                        "-rA", "-q", "-o", "addopts=", str(tmp_path / "test_kernel.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    text = r.stdout + r.stderr
    assert "PASSED test_kernel.py::test_good" in text, text
    assert "FAILED test_kernel.py::test_bad" in text and "output_offset (reproduced by simulation)" in text, text
    assert "lowbit_check needs x_scheme and w_scheme" in text, text
    assert "lowbit verdicts" in text and "check_linear: PASS (ok)" in text, text   # the passing verdict, reported
