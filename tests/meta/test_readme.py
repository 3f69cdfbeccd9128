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
