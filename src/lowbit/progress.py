"""Progress of lowbit's long stages (calibration, the per-site report, evaluation, quantizing):
a tqdm bar when stderr is a terminal; otherwise (a log file, a pipe, CI) one line per stage on
stderr when the stage starts, so that redirected output holds no bar redraws."""
from __future__ import annotations

import sys


def say_flushed(line: str) -> None:
    """A workflow's default voice for its lines: printed and flushed (progress bars share the terminal)."""
    print(line, flush=True)


def progress_bar(iterable=None, *, desc: str, unit: str = "it", total: int | None = None, leave: bool = True):
    """Wrap `iterable` (or count `total` steps by update()) as tqdm would; off a terminal, say
    "desc: N units" once and hand the iterable back unchanged."""
    if sys.stderr.isatty():
        from tqdm import tqdm          # optional dependency (the [models] extra); only a terminal needs it
        return tqdm(iterable, desc=desc, unit=unit, total=total, leave=leave)
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    units = unit if total == 1 else unit + ("es" if unit.endswith(("ch", "s", "x")) else "s")
    print(f"{desc}: {total} {units}" if total is not None else f"{desc} ...", file=sys.stderr, flush=True)
    return _Quiet(iterable)


class _Quiet:
    """A bar that draws nothing: iterates its iterable; update() and close() do nothing."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def __len__(self):
        return len(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def library_bars_off_a_terminal() -> None:
    """Off a terminal, switch off transformers' own progress bars (GGUF dequantization, weight
    loading), which would otherwise redraw in the log."""
    if not sys.stderr.isatty():
        from transformers.utils import logging     # optional dependency (the [models] extra)
        logging.disable_progress_bar()
