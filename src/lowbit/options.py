"""Options: the base of the typed options objects that functions with many settings take.

A function with many settings takes its main inputs as parameters and the rest as one frozen
dataclass deriving from Options, `options=`, or as the same names in keywords, which replace the
options' fields:

    def gptq_model(model, recipe, calib, options: GPTQOptions | None = None, **changes):
        o = GPTQOptions.merge(options, changes, "gptq_model")

A misspelt keyword is refused with the nearest field's name, as a misspelt keyword argument is
refused by Python, so the keyword form stays as safe as the explicit signature it replaces.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T", bound="Options")


def refuse_unknown(owner: str, given: Mapping[str, Any] | list[str], names: list[str]) -> None:
    """TypeError naming the first of `given` that is not in `names`, the nearest valid name and
    every valid name; `owner`: the function the options are for."""
    for k in given:
        if k not in names:
            near = difflib.get_close_matches(k, names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"{owner} got an unknown option {k!r}{hint}; the options are: {', '.join(names)}")


class Options:
    """Mix-in of a frozen dataclass of settings: replace() and merge() refuse unknown names."""

    def replace(self: T, owner: str | None = None, **changes) -> T:
        """A copy with `changes` applied; an unknown name is refused with the valid ones (the
        error names `owner`, default the class)."""
        refuse_unknown(owner or type(self).__name__, changes, [f.name for f in dataclasses.fields(self)])
        return dataclasses.replace(self, **changes)

    @classmethod
    def merge(cls: type[T], options: T | None, changes: Mapping[str, Any], owner: str) -> T:
        """`options` (None: the defaults) with the keyword `changes` applied: what a function taking
        `options=None, **changes` works with. TypeError for options of another type (a dict, say:
        pass its items as keywords, or cls(**d))."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"{owner}: options must be a {cls.__name__} (or None), not {type(options).__name__}; "
                            f"pass the settings as keywords or as {cls.__name__}(...)")
        return (options or cls()).replace(owner, **changes)
