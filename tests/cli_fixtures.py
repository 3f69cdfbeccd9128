"""Helpers of the command-line tests: stand-ins that fail a test when the CLI does work it should
have refused before, and the check of a one-line error."""


def no_model(*a, **k):
    raise AssertionError("the model was loaded before the arguments were checked")


def no_texts(*a, **k):
    raise AssertionError("calibration text was prepared before the plan was checked")


def one_line_error(capsys, *words, prefix: str = "lowbit "):
    """The last stderr line, asserted to be the CLI's one-line error (no traceback) starting with
    `prefix` and holding every one of `words`."""
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith(prefix), err
    for w in words:
        assert w in last, last
    return last
