"""Faults injected into units of work that Dask runs (tests of retries)."""
from __future__ import annotations

from pathlib import Path


def fails_once(fn, marks: Path, at: int = 1):
    """``fn`` that, on its call number ``at`` (0-based, counted in the folder ``marks``, which
    Dask's copies of the function share), does its work and then raises a transient OSError
    once: a unit whose results were written before its task failed."""
    marks.mkdir(exist_ok=True)

    def unit(*args, **kwargs):
        n = len(list(marks.iterdir()))
        (marks / str(n)).touch()
        out = fn(*args, **kwargs)
        if n == at:
            raise OSError("transient: the network filesystem went away")
        return out

    return unit
