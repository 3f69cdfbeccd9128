"""lowbit.io.outdir: stale staging directories of killed saves are removed by the next save,
and nothing that is not provably an abandoned lowbit stage is ever touched."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from lowbit.io.outdir import MANIFEST, STAGE_MARKER, clean_stale_stages, staged


def _dead_pid() -> int:
    """The id of a process that has exited (reaped: no process holds it now)."""
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def _stage(parent, name: str, marker: dict | str | None) -> os.PathLike:
    d = parent / name
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"partial")
    if isinstance(marker, dict):
        (d / STAGE_MARKER).write_text(json.dumps(marker))
    elif isinstance(marker, str):
        (d / STAGE_MARKER).write_text(marker)
    return d


def test_next_save_removes_only_abandoned_lowbit_stages(tmp_path):
    host, dead = socket.gethostname(), _dead_pid()
    out = tmp_path / "ckpt"
    stale = _stage(tmp_path, ".ckpt.lowbit-tmp-abc", {"pid": dead, "host": host})
    keep = {
        "running": _stage(tmp_path, ".ckpt.lowbit-tmp-run", {"pid": os.getppid(), "host": host}),
        "mine": _stage(tmp_path, ".ckpt.lowbit-tmp-own", {"pid": os.getpid(), "host": host}),
        "other host": _stage(tmp_path, ".ckpt.lowbit-tmp-far", {"pid": dead, "host": host + "-elsewhere"}),
        "no marker": _stage(tmp_path, ".ckpt.lowbit-tmp-user", None),
        "bad marker": _stage(tmp_path, ".ckpt.lowbit-tmp-bad", "not json"),
        "pid not int": _stage(tmp_path, ".ckpt.lowbit-tmp-str", {"pid": str(dead), "host": host}),
        "other target": _stage(tmp_path, ".ckpt2.lowbit-tmp-x", {"pid": dead, "host": host}),
    }
    # a symlink named like a stage, pointing at an abandoned-looking directory: not followed
    target = _stage(tmp_path, "elsewhere", {"pid": dead, "host": host})
    (tmp_path / ".ckpt.lowbit-tmp-link").symlink_to(target, target_is_directory=True)
    with staged(out) as stage:
        assert (stage / STAGE_MARKER).is_file()
        (stage / "a.txt").write_text("new")
    assert not stale.exists()
    for why, d in keep.items():
        assert (d / "model.safetensors").read_bytes() == b"partial", why
    assert (target / "model.safetensors").exists() and (tmp_path / ".ckpt.lowbit-tmp-link").is_symlink()
    # the marker is never part of the output
    assert sorted(os.listdir(out)) == ["a.txt", MANIFEST]
    assert json.loads((out / MANIFEST).read_text())["files"] == ["a.txt"]


def test_clean_stale_stages_returns_what_it_removed(tmp_path):
    stale = _stage(tmp_path, ".q.lowbit-tmp-1", {"pid": _dead_pid(), "host": socket.gethostname()})
    assert clean_stale_stages(tmp_path / "q") == [stale]
    assert clean_stale_stages(tmp_path / "q") == []
    assert clean_stale_stages(tmp_path / "missing" / "q") == []


def test_nested_stage_output_has_no_marker(tmp_path):
    """A save into a staging directory (lowbit quantize writes its checkpoint so) commits
    without carrying either stage's marker."""
    out = tmp_path / "report"
    with staged(out) as stage:
        with staged(stage, overwrite=True) as inner:
            (inner / "model.safetensors").write_bytes(b"x")
        (stage / "report.md").write_text("r")
    assert sorted(os.listdir(out)) == [MANIFEST, "model.safetensors", "report.md"]
    assert sorted(os.listdir(tmp_path)) == ["report"]
