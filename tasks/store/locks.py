"""Claims on the store: ``flock`` files under ``STORE/.locks/`` (never Zarr nodes).

``.locks/scans/<scan_id>.lock`` is a scan's write claim (:meth:`Claims.claim`),
``.locks/stages/<stage>/<scan_id>.lock`` a stage's work claim (:meth:`Claims.claim_stage`),
``.locks/quarantine/<id>.lock`` a quarantine record's, ``.locks/store.lock`` the store's creation.
The lock files stay (one empty file per name): removing one that another process may be about
to lock would let two writers hold "the" claim.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from typing import Iterator

LOCKS = ".locks"

_HELD = threading.local()


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, *, shared: bool = False, wait: bool = True,
              create: bool = True) -> Iterator[bool]:
    """Hold an ``flock`` on ``path`` for the ``with`` block; yields whether it was obtained.

    Re-entrant within a thread (a writer that holds a scan's claim can call methods that claim it
    again). ``wait=False`` yields ``False`` at once when another holder has it. ``create=False``
    (read-only callers) yields ``True`` without locking when the file does not exist: nobody
    holds a claim whose file was never created.
    """
    key = os.path.abspath(path)
    held = _HELD.__dict__.setdefault("paths", set())
    if key in held:
        yield True
        return
    if create:
        Path(key).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
    else:
        try:
            fd = os.open(key, os.O_RDONLY)
        except FileNotFoundError:
            yield True
            return
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        held.add(key)
        try:
            yield True
        finally:
            held.discard(key)
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class Claims:
    """The claims of a :class:`~scanforest.tasks.store.scans.ScanStore` (a mixin: it uses the
    store's ``path``, ``mode`` and ``_writing``)."""

    def _lock_path(self, kind: str, name: str) -> Path:
        return Path(self.path) / LOCKS / kind / f"{name}.lock"

    @contextlib.contextmanager
    def _lock(self, path: Path, *, wait: bool) -> Iterator[bool]:
        """:func:`file_lock` on ``path``; creating its file in a full or read-only store is a
        :class:`~scanforest.tasks.store.StoreWriteError` (and so is a write under it that fails that way)."""
        with self._writing(), file_lock(path, wait=wait, create=self.mode != "r") as got:
            yield got

    def claim(self, scan_id: str, *, wait: bool = True):
        """The scan's write claim, as a context manager yielding whether it was obtained.

        Hold it around any read-check-write of one scan (ingest holds it from "is it current?" to
        the complete flag). ``wait=False`` yields ``False`` at once while another process holds it.
        """
        return self._lock(self._lock_path("scans", scan_id), wait=wait)

    def claim_stage(self, scan_id: str, stage: str, *, wait: bool = False):
        """The claim on the work of one stage of one scan (``.locks/stages/<stage>/<scan_id>.lock``),
        as a context manager yielding whether it was obtained; by default it does not wait.

        A stage's unit of work holds it from "is this stage done?" to its :meth:`write_stage`, so
        two runs of one stage on one store at once share the work: the second finds the scan held
        and leaves it to the first (``held``: it counts it as such) instead of computing it again.
        It is not the scan's write claim (:meth:`claim`, which the write itself takes): other stages,
        ``check`` and readers of the scan go on while a stage computes. The OS drops it when its
        process dies, so a killed worker's scans are free for the run that redoes them."""
        return self._lock(self._lock_path(f"stages/{stage}", scan_id), wait=wait)
