"""`lowbit audit`: the conformance table over kernels x adversarial cases (verify/audit.py)."""
import json

import torch

from lowbit.cli import main
from lowbit.verify import audit as au


def correct_w8a8(xq, wq, bias):
    """A user kernel as `--kernel test_audit:correct_w8a8` sees it: QTensors in, out [M, N].
    float64 products of int8 codes are exact (|acc| << 2^53) and run on CUDA too (int64 matmul does not)."""
    acc = xq.codes.double() @ wq.codes.double().T
    return (acc.float() * xq.scale) * wq.scale.reshape(1, -1) + bias


def stride0_w8a8(xq, wq, bias):
    """The issue's H200 bug: the per-token scale pointer read with stride 0 (row 0's scale for all)."""
    acc = xq.codes.double() @ wq.codes.double().T
    return (acc.float() * xq.scale[:1]) * wq.scale.reshape(1, -1) + bias


def _audit(tmp_path, rng, kernel, *cases):
    js, png = tmp_path / "a.json", tmp_path / "a.png"
    seed = str(int(torch.randint(2 ** 31, (1,), generator=rng)))      # fresh inputs every run
    args = ["audit", "--seed", seed, "--no-builtin", "--kernel", kernel, "--x-scheme", "int8_token", "--w-scheme", "int8_channel",
            "--json", str(js), "--png", str(png)]
    for c in cases:
        args += ["--case", c]
    rc = main(args)
    return rc, json.loads(js.read_text()), png.read_bytes()


def test_user_kernel_correct_passes_every_case(tmp_path, rng, capsys):
    rc, data, png = _audit(tmp_path, rng, "test_audit:correct_w8a8")
    assert rc == 0
    assert {c["verdict"] for c in data["cells"]} == {"pass"} and len(data["cells"]) == len(au.CASES)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "non-contiguous codes" in capsys.readouterr().out


def test_user_kernel_bug_is_named_in_the_table(tmp_path, rng, capsys):
    rc, data, _ = _audit(tmp_path, rng, "test_audit:stride0_w8a8", "random", "M=1")
    assert rc == 1
    cells = {c["case"]: c for c in data["cells"]}
    assert cells["random"]["verdict"] == "logic" and cells["random"]["cause"] == "scale_broadcast_stride0"
    assert cells["M=1"]["verdict"] == "pass"          # one row: row 0's scale is the right one
    out = capsys.readouterr().out
    assert "logic: scale_broadcast_stride0" in out


def test_builtin_cpu_kernels_conform(tmp_path, rng, capsys):
    # the torch paths on every case, and one Triton kernel (interpreter on CPU) on two
    seed = int(torch.randint(2 ** 31, (1,), generator=rng))
    rc = main(["audit", "--seed", str(seed), "--only", "torch", "--json", str(tmp_path / "t.json")])
    assert rc == 0, capsys.readouterr().out
    triton = [s for s in au.discover("cuda" if torch.cuda.is_available() else "cpu", True)
              if s.name == "lowbit triton int8"]
    cells = au.audit(triton, [c for c in au.CASES if c.name in ("random", "K not a tile multiple")],
                     device="cuda" if torch.cuda.is_available() else "cpu", seed=seed)
    assert [c.verdict for c in cells] == ["pass", "pass"], cells


def test_bad_arguments_are_refused(capsys):
    assert main(["audit", "--no-builtin", "--kernel", "nocolon"]) == 2
    assert "MODULE:FUNCTION" in capsys.readouterr().err
    assert main(["audit", "--case", "no such case"]) == 2
