"""The errors of a scan store that are about the store, not a scan's content or a user's
arguments: a write that fails because of where the store is (:class:`StoreWriteError`), and an
array that does not read back (:class:`StoreReadError`)."""
from __future__ import annotations

import errno
from typing import Any, Callable

from scanforest.kernels.errors import InputError


#: errors of a write that say the store's location is unusable (a full disk, a used-up quota, a
#: read-only mount), not that this scan or this run went wrong
WHERE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class StoreWriteError(InputError):
    """A write into the store failed because of where the store is: no space left, the quota used
    up, or a read-only file system. A user error (:class:`InputError`): the flows do not retry it
    (every retry fails the same way), a stage's unit of work does not record it as that scan's
    failure (:func:`scanforest.tasks.units.isolated` lets it end the run), and the command line
    prints it in one line, naming the store and the reason, exit 2."""

    def __init__(self, path: str, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot write to {self.path}: {reason}")

    def __reduce__(self):  # pickled between Dask workers and the flow: rebuilt from its own fields
        return type(self), (self.path, self.reason)


class StoreReadError(InputError):
    """An array of a scan that does not read back: a chunk file cut short or altered (its
    decompression or its checksum fails: the store's arrays carry zstd's content checksum) or
    unreadable. That scan's failure in a batch, not retried (a second read fails the same way);
    the command line prints it in one line naming the scan, the array and the repair."""

    def __init__(self, path: str, scan_id: str, array: str, reason: str):
        self.path, self.scan_id, self.array, self.reason = str(path), scan_id, array, reason
        super().__init__(f"{self.path}: scan {scan_id!r}, array {array!r} cannot be read ({reason}): "
                         f"`scanforest check {self.path} --repair` removes what is damaged, and the next "
                         "ingest or stage writes it again")

    def __reduce__(self):  # pickled between Dask workers and the flow: rebuilt from its own fields
        return type(self), (self.path, self.scan_id, self.array, self.reason)


def _decoded(path: str, scan_id: str, name: str, read: Callable[[], Any]) -> Any:
    """``read()`` of one stored array; a chunk that does not decode (zstd's error, a checksum
    that does not match, a chunk of the wrong size, an I/O error) is a :class:`StoreReadError`."""
    from scanforest.kernels.errors import ScanforestError

    try:
        return read()
    except (ScanforestError, KeyError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - what a damaged chunk raises depends on its codec
        raise StoreReadError(path, scan_id, name, f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc


def _where_error(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT/EROFS ``OSError`` behind ``exc`` (itself, its causes and contexts, the
    members of an exception group), or None."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in WHERE_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__, *(getattr(e, "exceptions", None) or ())]
    return None
