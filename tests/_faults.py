"""Faults injected into units of work that Dask runs (tests of retries)."""
from __future__ import annotations

import os
from pathlib import Path


def fails_once(fn, marks: Path, at: int = 1):
    """``fn`` that, on its call number ``at`` (0-based, counted in the folder ``marks``, which
    Dask's copies of the function share), does its work and then raises a transient OSError
    once: a unit whose results were written before its task failed."""
    marks.mkdir(exist_ok=True)

    def unit(*args, **kwargs):
        n = 0  # this call's number: the first free mark, claimed atomically (two threads of a
        while True:  # worker counting the folder at once took the same number: a call uncounted)
            try:
                os.close(os.open(marks / str(n), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                n += 1
        out = fn(*args, **kwargs)
        if n == at:
            raise OSError("transient: the network filesystem went away")
        return out

    return unit
