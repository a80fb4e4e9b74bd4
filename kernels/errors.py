"""Exception types shared by every layer of scanforest.

Every error a user can cause derives from :class:`ScanforestError`, so a caller can catch one
type; the concrete classes also derive from the matching built-in (``ValueError``,
``MemoryError``) so generic handlers keep working.
"""
from __future__ import annotations

import re


class ScanforestError(Exception):
    """Base class of every error scanforest raises on purpose."""


class InputError(ScanforestError, ValueError):
    """An argument or an input array is not acceptable (shape, dtype, NaN, empty, ...)."""


class ScanReadError(ScanforestError, ValueError):
    """A scan file could not be read. ``path`` names the file, ``reason`` says why, on one line
    (a library's message over several lines, pydantic's or tarfile's, is joined: the quarantine
    line and the store's reason are one line each)."""

    def __init__(self, path, reason: str):
        self.path = str(path)
        self.reason = reason = re.sub(r"\s*[\r\n]+\s*", " ", str(reason)).strip()
        super().__init__(f"{self.path}: {reason}")


class DeviceError(ScanforestError, RuntimeError):
    """A GPU was asked for but none is usable (no CuPy, no device, driver problem)."""


class OutOfMemory(ScanforestError, MemoryError):
    """A computation would not fit in (device or host) memory; the message gives the sizes."""
