"""The README's python blocks run as written: a tour that drifts from the public API fails here."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The bodies of every ```python fenced block, in order."""
    return BLOCK.findall(text)


def test_block_extraction_finds_each_fenced_python_block():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\nz = 3\n"]


def test_readme_python_blocks_run(capsys):
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python block: the tour is what this test runs"
    for i, code in enumerate(blocks):
        # each block runs in a fresh namespace, as a reader pasting it would; a failure names the block
        exec(compile(code, f"README.md python block {i + 1}", "exec"), {"__name__": f"readme_block_{i + 1}"})
    out = capsys.readouterr().out
    # the tour's printed verdicts are what the README's comments say they are
    assert "True ok" in out and "logic scale_broadcast_stride0" in out


# ------------------------------------------------------------------ the headline figures
# The main job (`bash scripts/main.sh`: `lowbit quantize` with its defaults on the embedded SmolLM2-135M)
# takes minutes on CI's 2 cores, too long to rerun here. It records what it printed in RECORD; this
# test checks that the README's accuracy line is that record's, and that the record is of the main
# job as the code defines it now (the default recipe, its best measures on SmolLM2's Linears, the
# default token counts): change any of those and the record is stale until the main job is rerun.
RECORD = README.parent / "benchmarks" / "results" / "main-job.txt"
SMOLLM2_LINEARS = 30 * 7 + 1      # 30 decoder layers of q, k, v, o, gate, up, down, and the tied lm_head
FINAL = re.compile(r"^(?P<recipe>[\w-]+): perplexity (?P<before>[\d.]+) -> (?P<after>[\d.]+) \((?P<change>[+-][\d.]+)%\), "
                   r"KL from float (?P<kl>[\d.e-]+) nats, top-1 agreement (?P<top1>[\d.]+)%, bytes (?P<mib0>[\d.]+) "
                   r"MiB \(\w+ float\) -> (?P<mib1>[\d.]+) MiB \(on disk\)", re.M)
HEADLINE = re.compile(r"raises SmolLM2-135M's Wikipedia perplexity by (?P<change>[+-][\d.]+)% over the float baseline "
                      r"\(KL (?P<kl>[\d.]+), top-1\s+agreement (?P<top1>[\d.]+)%\) and shrinks its weights from "
                      r"(?P<mib0>[\d.]+) to (?P<mib1>[\d.]+) MiB on disk, in (?P<secs>\d+) s on 2 CPU cores")


def _as_written(value: str, like: str) -> str:
    """`value` rounded to as many decimals as `like` shows (the README rounds the record's figures)."""
    decimals = len(like.split(".")[1]) if "." in like else 0
    sign = "+" if like[0] in "+-" else ""
    return f"{float(value):{sign}.{decimals}f}"


def test_the_readme_headline_is_the_main_jobs_recorded_output():
    record = RECORD.read_text()
    final = FINAL.search(record)
    assert final, f"{RECORD} holds no final line of the main job: rerun `bash scripts/main.sh`"
    head = HEADLINE.search(" ".join(README.read_text().split()))
    assert head, "README.md's accuracy line changed its wording: update HEADLINE"
    # the wall time is left out: it is the machine's as much as lowbit's (a record made on a busy
    # machine takes several times an idle one's), so the README's seconds come from an idle run
    for k in ("change", "kl", "top1", "mib0", "mib1"):
        assert head[k] == _as_written(final[k], head[k]), (k, head[k], final[k])


def test_the_recorded_main_job_is_the_current_one():
    import argparse

    from lowbit.entrypoints import quantize as cli
    from lowbit.workflows.job import BEST, best_line
    p = argparse.ArgumentParser()
    cli.register(p)
    defaults = p.parse_args([])
    record = RECORD.read_text()
    lines = record.splitlines()
    assert lines[0] == f"loading {defaults.model} ...", lines[0]
    recipe = defaults.recipe
    assert FINAL.search(record)["recipe"] == recipe
    calib = BEST[recipe].calib_tokens or cli.CALIB_TOKENS
    assert best_line(recipe, BEST[recipe], SMOLLM2_LINEARS, calib) in lines, \
        f"the main job's measures changed since {RECORD} was written: rerun `bash scripts/main.sh`"
    assert re.search(rf"float perplexity [\d.]+ on {cli.EVAL_TOKENS} tokens", record)
