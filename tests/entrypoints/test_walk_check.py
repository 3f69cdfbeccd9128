"""A new user's `lowbit check --grouped` on a machine without a GPU, run as the user runs it (a
fresh process, no TRITON_INTERPRET in the environment: tests/conftest.py sets it for the test
process, which hid the failure), and its --k checked against the recipe's groups."""
import pytest
import torch

from lowbit.bench.sm90 import fresh_process
from lowbit.entrypoints.main import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is the no-GPU one")
def test_check_grouped_runs_in_a_fresh_process_without_a_gpu(seed):
    r = fresh_process(["-m", "lowbit", "check", "--grouped", "w4a16-g32", "--experts", "3", "--tokens", "5", "--n",
                       "16", "--k", "64", "--seed", str(seed)], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("check_grouped_linear: PASS") == 2, r.stdout
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("recipe,k,fix", [("w4a16-g32", 100, "--k 96 or 128"), ("nvfp4", 8, "--k 16"),
                                          ("mxfp8", 40, "--k 32 or 64")])
def test_check_grouped_k_not_a_group_multiple_names_the_flag(recipe, k, fix, capsys):
    assert main(["check", "--grouped", recipe, "--k", str(k)]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("lowbit check: error: --k"), err
    assert fix in last and "pad=True" not in last, last
