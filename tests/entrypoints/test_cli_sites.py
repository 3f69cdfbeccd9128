"""When `lowbit quantize` runs the per-site report (the diagnosis of round to nearest's codes):
by default, not with --no-sites or --no-eval, not when GPTQ chooses the codes (one line says so),
and always where --override-worst picks sites by it."""
import pytest

from lowbit.entrypoints.main import main

transformers = pytest.importorskip("transformers")

HEAD = "per-site SQNR under"


@pytest.mark.parametrize("extra, shown", [
    ([], True),
    (["--no-sites"], False),
    (["--no-eval"], False),
    (["--gptq"], False),
    (["--no-sites", "--override-worst", "0.2"], True),     # the pick reads it
    (["--no-eval", "--override-worst", "0.2"], True),
])
def test_per_site_report_runs_when_asked_or_needed(tiny, tmp_path, capsys, extra, shown):
    out = tmp_path / "q"
    plain = [] if {"--gptq", "--override-worst"} & set(extra) else ["--plain"]    # no best measures
    assert main([*tiny, *plain, *extra, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert (HEAD in text) == shown
    assert ("Worst sites" in (out / "lowbit_report.md").read_text()) == shown
    assert (out / "lowbit_sites.png").exists() == shown
    assert ("no per-site report: GPTQ chooses the codes" in text) == ("--gptq" in extra)
    assert ("not evaluated (--no-eval)" in text) == ("--no-eval" in extra)
