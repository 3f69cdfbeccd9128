"""`lowbit quantize` / `lowbit sites` as a user meets them: every bad argument is refused before
a model is loaded, --out never loses a user's file, a missing matplotlib costs only the PNG, and
an interrupted save leaves the previous checkpoint as it was. A tiny random Llama stands in for
the embedded model (the end-to-end run on the real one is tests/pipelines/test_models_e2e.py)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lowbit.entrypoints.main import main
from lowbit.io.outdir import MANIFEST
from cli_fixtures import SLOW_WRITES, no_model

transformers = pytest.importorskip("transformers")


BAD_QUANTIZE = [
    (["--recipe", "int8"], "--recipe"),
    (["--recipe", ","], "--recipe"),
    (["--override-to", "w9"], "--override-to"),
    (["--override", "mlp"], "PATTERN=RECIPE"),
    (["--override", "mlp=w9"], "--override"),
    (["--tokens", "100"], "--tokens 100 is less than one --window"),
    (["--window", "1"], "--window"),
    (["--calib-tokens", "10"], "--calib-tokens"),
    (["--threads", "0"], "--threads"),
    (["--smoothquant", "2"], "--smoothquant"),
    (["--override-worst", "0.9"], "--override-worst"),
    (["--recipe", "w4a16", "--static-scales"], "--static-scales"),
    (["--out", "/proc/lowbit-out"], "cannot write"),
]


@pytest.mark.parametrize("args, why", BAD_QUANTIZE)
def test_quantize_refuses_bad_arguments_before_loading(monkeypatch, tmp_path, capsys, args, why):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    monkeypatch.chdir(tmp_path)              # the default --out lowbit-out/... lands here
    assert main(["quantize", *args]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []        # nothing written


def test_quantize_refuses_out_paths_before_loading(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    (tmp_path / "file").write_text("x")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    for out, why in ((tmp_path / "file", "is a file"), (tmp_path / "file" / "sub", "is a file"),
                     (tmp_path / "user", "--overwrite")):
        assert main(["quantize", "--out", str(out)]) == 2
        assert why in capsys.readouterr().err
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("args, why", [(["--recipe", "int8"], "--recipe"), (["--png", "plot.svg"], ".png"),
                                       (["--png", "/proc/x/plot.png"], "cannot write"),
                                       (["--tokens", "10"], "--tokens"), (["--top", "0"], "--top")])
def test_sites_refuses_bad_arguments_before_loading(monkeypatch, tmp_path, capsys, args, why):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    assert main(["sites", *args]) == 2
    assert why in capsys.readouterr().err


# ------------------------------------------------------------------ runs on a tiny model
def _listing(d):
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))


def test_out_keeps_the_users_files(tiny, tmp_path, capsys):
    out = tmp_path / "user"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main([*tiny, "--out", str(out), "--overwrite"]) == 0
    written = json.loads((out / MANIFEST).read_text())["files"]
    assert {"config.json", "model.safetensors", "lowbit.json", "lowbit_report.md"} <= set(written)
    assert "notes.txt" not in written and (out / "notes.txt").read_text() == "mine"
    # a second run replaces lowbit's files (no --overwrite needed: lowbit wrote them) and
    # still leaves the user's alone, including one added in between
    (out / "more.txt").write_text("also mine")
    first = (out / "model.safetensors").stat().st_mtime_ns
    time.sleep(0.01)
    assert main([*tiny, "--out", str(out)]) == 0
    assert (out / "model.safetensors").stat().st_mtime_ns != first
    assert (out / "notes.txt").read_text() == "mine" and (out / "more.txt").read_text() == "also mine"
    assert sorted(os.listdir(tmp_path)) == ["user"]          # no staging or backup directory left
    from lowbit.pipelines.checkpoint import load_compressed
    assert load_compressed(out).recipe == "w8a8-int8"


def test_report_without_matplotlib(tiny, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # `import matplotlib` now fails
    out = tmp_path / "q"
    assert main([*tiny, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("matplotlib is not installed") == 2    # the sites PNG and the metric PNG
    assert not list(out.glob("*.png"))
    md = (out / "lowbit_report.md").read_text()
    assert "perplexity" in md and "no figures: matplotlib is not installed" in md
    assert (out / "model.safetensors").exists()


def test_an_error_while_saving_leaves_the_previous_output(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "q"
    assert main([*tiny, "--out", str(out)]) == 0
    before = {p: (out / p).read_bytes() for p in _listing(out) if (out / p).is_file()}

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr("lowbit.io.st_format.ShardedWriter.finish", interrupted)
    assert main([*tiny, "--out", str(out)]) == 130           # Ctrl-C: one line, exit status 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("lowbit quantize: interrupted") and "Traceback" not in err, err
    assert {p: (out / p).read_bytes() for p in _listing(out) if (out / p).is_file()} == before
    assert sorted(os.listdir(tmp_path)) == ["q"]


_SLOW_SAVE = SLOW_WRITES + textwrap.dedent("""
    import sys, torch
    from lowbit.pipelines.checkpoint import save_compressed
    from lowbit.pipelines.quantize_model import quantize_model
    torch.manual_seed(int(sys.argv[2]))
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    quantize_model(m, "w8a16-int8")
    save_compressed(m, sys.argv[1], "w8a16-int8", config={}, overwrite=True)
    print("done", flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_killing_a_save_midway_leaves_the_previous_checkpoint(tmp_path, seed, sig):
    """A real process killed while it writes: Ctrl-C (SIGINT) cleans its staging directory up;
    SIGKILL cannot, but the previous checkpoint is byte-for-byte intact either way."""
    out = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", _SLOW_SAVE, str(out)]
    # generous timeouts: a loaded CI machine may take minutes to import torch
    first = subprocess.run(cmd + [str(seed % 2**31), "fast"], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and "done" in first.stdout, first.stderr
    before = {p: (out / p).read_bytes() for p in _listing(out)}
    proc = subprocess.Popen(cmd + [str((seed + 1) % 2**31), "slow"], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("writing")     # midway through the tensors
    proc.send_signal(sig)
    proc.wait(timeout=600)
    assert proc.returncode != 0
    assert {p: (out / p).read_bytes() for p in _listing(out)} == before
    left = sorted(set(os.listdir(tmp_path)) - {"ckpt"})
    if sig == signal.SIGINT:
        assert left == []
    else:
        assert left and all(n.startswith(".ckpt.lowbit-tmp-") for n in left)   # only a hidden staging directory
        # the next save into the same directory removes the killed one's stage
        again = subprocess.run(cmd + [str((seed + 2) % 2**31), "fast"], env=env, capture_output=True, text=True,
                               timeout=600)
        assert again.returncode == 0 and "done" in again.stdout, again.stderr
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_best_measures_bring_their_calibration_tokens(tiny, tmp_path, monkeypatch, capsys):
    """A recipe's best measures run on the calibration tokens they were measured with (lowbit.workflows.job.BEST's
    calib_tokens) unless --calib-tokens is given; --plain (like any measure flag: the same branch) keeps the default."""
    from lowbit.workflows import job as best
    from lowbit.workflows.steps import OverrideWorst
    from lowbit.entrypoints import quantize as cli_quantize
    from lowbit.evaluation import workload as pipeline
    asked = []
    texts = pipeline.prepare_texts                       # the tiny fixture's stand-in
    monkeypatch.setattr(pipeline, "prepare_texts", lambda loaded, tokens, calib, window, **data: asked.append(calib)
                        or texts(loaded, tokens, calib, window))
    monkeypatch.setitem(best.BEST, "w8a8-int8", best.Best((OverrideWorst(0.05),), "test entry", calib_tokens=96))
    base = [a for i, a in enumerate(tiny) if a != "--calib-tokens" and tiny[i - 1] != "--calib-tokens"]
    cases = [([], [cli_quantize.CALIB_TOKENS, 96]), (["--calib-tokens", "64"], [64]),
             (["--plain"], [cli_quantize.CALIB_TOKENS])]
    for i, (extra, want) in enumerate(cases):
        asked.clear()
        assert main([*base, *extra, "--no-save", "--out", str(tmp_path / f"q{i}")]) == 0
        assert asked == want, extra
    assert "on 96 calibration tokens" in capsys.readouterr().out
