"""pytest plugin: a `lowbit_check` fixture and a `lowbit` marker for quantized-kernel tests.

Enable it with `-p lowbit.verify.pytest_plugin` on the command line or `pytest_plugins =
["lowbit.verify.pytest_plugin"]` in a conftest.py. It is not registered as an automatic pytest11
entry point: loading it imports torch and lowbit's references (seconds), which every pytest run in
the environment would pay.

    @pytest.mark.lowbit(x_scheme="int8_token", w_scheme="int8_channel", accumulator="int32")
    def test_my_kernel(lowbit_check):
        lowbit_check(my_kernel(x, w), x, w)          # schemes from the marker; keywords override

A failing check raises AssertionError with the verdict; every verdict of a test is also attached to
its report as a "lowbit verdicts" section (shown with -rA / -rP, and on failure).
"""
from __future__ import annotations

import pytest

from lowbit.verify.testing import assert_linear_close, summary

_KEYS = ("x_scheme", "w_scheme", "accumulator", "bias", "out_dtype")
_VERDICTS = pytest.StashKey[list]()      # the verdicts of the running test, for its report


def pytest_configure(config):
    config.addinivalue_line("markers", "lowbit(x_scheme=..., w_scheme=..., accumulator=...): default schemes "
                                       "for the lowbit_check fixture")


@pytest.fixture
def lowbit_check(request):
    """A function (out, x, w, **schemes) -> Verdict that asserts like lowbit.testing.assert_linear_close,
    taking unspecified schemes from the test's `lowbit` marker."""
    mark = request.node.get_closest_marker("lowbit")
    defaults = dict(mark.kwargs) if mark else {}
    unknown = sorted(set(defaults) - set(_KEYS))
    if unknown:
        raise pytest.UsageError(f"@pytest.mark.lowbit got unknown argument(s) {unknown}; use {', '.join(_KEYS)}")
    lines = request.node.stash.setdefault(_VERDICTS, [])

    def check(out, x, w, **kw):
        args = {**defaults, **kw}
        missing = [k for k in ("x_scheme", "w_scheme") if k not in args]
        if missing:
            raise pytest.UsageError(f"lowbit_check needs {' and '.join(missing)} (None for an unquantized side), "
                                    f"as a keyword or in @pytest.mark.lowbit(...)")
        try:
            v = assert_linear_close(out, x, w, **args)
        except AssertionError as e:
            lines.append(str(e))
            raise
        lines.append(f"lowbit: {summary(v)}\n{v.report()}")
        return v

    return check


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the test's verdicts to its call report (shown under -rA / -rP and on failure)."""
    outcome = yield
    lines = item.stash.get(_VERDICTS, None)
    if call.when == "call" and lines:
        outcome.get_result().sections.append(("lowbit verdicts", "\n\n".join(lines)))
