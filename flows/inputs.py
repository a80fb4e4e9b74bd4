"""A stage's input as every process must see it, checked in the flow process before any work is
submitted (and before a cluster starts): paths made absolute (:func:`absolute_path`), the store
opened (:func:`open_store`), the scans named found in it (:func:`require_scans`)."""
from __future__ import annotations

import os


def absolute_path(path: str) -> str:
    """A store (or source) path as every process must see it: absolute in the flow process, before
    any work is submitted (a worker of an existing cluster has another working folder, and a
    relative path there names another store). URLs (``s3://...``) are kept."""
    path = str(path)
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def open_store(store: str, mode: str = "a"):
    """An existing scan store, or a user error in one line (``ScanStore`` says which: none there,
    or something else there; for ``mode="a"``, :func:`~scanforest.tasks.preflight.check_store_location`
    says when it cannot be written: read-only, full); only ingest creates stores. The stages'
    input checks open their store here, before a cluster starts."""
    from scanforest.tasks.preflight import check_store_location
    from scanforest.tasks.store import ScanStore

    path = absolute_path(store)
    st = ScanStore(path, mode=mode)
    if mode == "a":
        check_store_location(path)
    return st


def require_scans(st, ids, kind: str = "scan") -> None:
    """Every id names a scan of the store ``st`` (a user error in one line otherwise)."""
    from scanforest.kernels.errors import InputError

    have = set(st.scans())
    missing = [s for s in ids or () if s not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{st.path}: no {kind} {missing[0]!r}{more}")
