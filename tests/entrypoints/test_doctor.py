"""`lowbit doctor`: the capability table follows the compute-capability thresholds, every preset
pairing gets a path, and the command runs (on the CPU too)."""
import json

import torch

from lowbit.entrypoints import doctor
from lowbit.entrypoints.main import main


def test_native_paths_thresholds():
    assert not any(doctor.native_paths(None).values())
    t4 = doctor.native_paths((7, 5))
    assert t4["int8 MMA"] and not t4["fp8 MMA"] and not t4["2:4 sparse MMA"]
    h100 = doctor.native_paths((9, 0))
    assert h100["int8 MMA"] and h100["fp8 MMA"] and h100["2:4 sparse MMA"]
    assert not h100["MX / NVFP4 block-scaled MMA"]
    assert doctor.native_paths((10, 0))["MX / NVFP4 block-scaled MMA"]
    assert doctor.native_paths((8, 9))["fp8 MMA"] and not doctor.native_paths((8, 6))["fp8 MMA"]


def test_paths_per_gpu_generation():
    # Hopper: int8 / fp8 native, MXFP8 emulated (no MX datapath), MXFP6 W8A8 has no kernel.
    assert doctor.path_for("int8_token", "int8_channel", (9, 0), True)[0] == "native"
    assert doctor.path_for("fp8_block1x128", "fp8_block128", (9, 0), True)[0] == "native"
    assert doctor.path_for("mxfp8", "mxfp8", (9, 0), True)[0] == "emulated"
    assert doctor.path_for("mxfp6_e2m3", "mxfp6_e2m3", (9, 0), True)[0] == "none"
    # Ampere: no fp8 tensor cores, so the fp8 kernels cannot run; int8 still native.
    assert doctor.path_for("fp8_row", "fp8_row", (8, 0), True)[0] == "none"
    assert doctor.path_for("int8_token", "int8_channel", (8, 0), True)[0] == "native"
    # Blackwell: MX has a datapath, so the kernel that emulates it counts as native there.
    assert doctor.path_for("mxfp8", "mxfp8", (10, 0), True)[0] == "native"
    # No GPU: exact CPU paths.
    path, detail = doctor.path_for("int8_token", "int8_channel", None, True)
    assert path == "cpu" and "_int_mm" in detail
    assert doctor.path_for("fp8_row", "fp8_row", None, True) == ("cpu", "float64 reference")


def test_doctor_command_runs(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "native tensor-core paths" in out
    for label, _, _ in doctor.PAIRINGS:
        assert label in out
    if not torch.cuda.is_available():
        assert "none (no CUDA GPU visible)" in out


def test_doctor_json(capsys):
    assert main(["doctor", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["schemes"]) == len(doctor.PAIRINGS)
    assert {r["path"] for r in rep["schemes"]} <= {"native", "emulated", "cpu", "none"}
    assert rep["capability"] is None or len(rep["capability"]) == 2


def test_doctor_reports_the_native_kernels():
    nat = doctor.report()["native_kernels"]
    assert set(nat) == {"library", "toolchain", "unavailable_reason", "prefill_library", "prefill_unavailable_reason"}
    if not torch.cuda.is_available():
        assert nat["unavailable_reason"] and nat["prefill_unavailable_reason"]    # never "can run" without a GPU
