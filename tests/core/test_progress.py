"""lowbit.progress: a bar on a terminal, one line per stage in a log (no bar redraws there)."""
import io
import sys

import pytest
import torch

from lowbit.progress import progress_bar


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_off_a_terminal_one_line_per_stage_and_the_items_unchanged(monkeypatch, rng):
    err = _Stream(False)
    monkeypatch.setattr(sys, "stderr", err)
    items = torch.randint(0, 100, (int(torch.randint(2, 9, (1,), generator=rng)),), generator=rng).tolist()
    assert list(progress_bar(items, desc="per-site SQNR", unit="batch")) == items
    bar = progress_bar(total=3, desc="quantize w8a8-int8", unit="layer")
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert list(progress_bar((i for i in items), desc="calibrate", unit="layer")) == items   # no len: no count
    assert err.getvalue() == (f"per-site SQNR: {len(items)} batches\nquantize w8a8-int8: 3 layers\ncalibrate ...\n")


def test_on_a_terminal_a_tqdm_bar(monkeypatch):
    tqdm = pytest.importorskip("tqdm")
    err = _Stream(True)
    monkeypatch.setattr(sys, "stderr", err)
    bar = progress_bar(range(4), desc="eval", unit="window", leave=False)
    assert isinstance(bar, tqdm.tqdm) and list(bar) == [0, 1, 2, 3]
    assert "eval" in err.getvalue() and "\r" in err.getvalue()     # drawn in place, as a terminal shows it


def test_transformers_bars_are_off_in_a_log_and_left_alone_on_a_terminal(monkeypatch):
    logging = pytest.importorskip("transformers.utils.logging")
    from lowbit.progress import library_bars_off_a_terminal
    was = logging.is_progress_bar_enabled()
    try:
        logging.enable_progress_bar()
        monkeypatch.setattr(sys, "stderr", _Stream(True))
        library_bars_off_a_terminal()
        assert logging.is_progress_bar_enabled()
        monkeypatch.setattr(sys, "stderr", _Stream(False))
        library_bars_off_a_terminal()
        assert not logging.is_progress_bar_enabled()
    finally:
        (logging.enable_progress_bar if was else logging.disable_progress_bar)()
