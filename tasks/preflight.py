"""Where a command will write, checked before anything starts: one line for each problem.

A store on a read-only mount, a store path that is a file, a folder that does not exist or a
full disk used to surface as an ``OSError`` traceback from the first write, after Prefect's API
and the Dask cluster had started (9-10 s on 2 cores; a minute with retries). These checks are
plain ``os`` calls (no Zarr, no Prefect), so the command line makes them while it parses its
arguments, and the flows' own input checks make them again for runs started another way.

Whether a folder can be written is found by writing there: a probe file is created, written
and removed. ``os.access`` reads permission bits, which root passes wherever the mount is not
read-only (creating a file in ``/sys`` passes it and fails with EPERM), and which say nothing of
a full disk or a network file system's server.
"""
from __future__ import annotations

import os
import tempfile

from scanforest.kernels.errors import InputError


def write_problem(exc: OSError) -> str:
    """Why a write failed, in the system's words as a line reads them ('read-only file system')."""
    return (exc.strerror or str(exc)).lower()


def _probe(folder: str, what: str) -> None:
    """Create, write and remove a hidden file in ``folder``; a user error starting with ``what``
    when that fails. The byte written finds a full disk, where an empty file can still be made."""
    try:
        fd, name = tempfile.mkstemp(prefix=".scanforest-probe-", dir=folder)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        raise InputError(f"{what} ({write_problem(exc)})") from None


def _folder_of(store: str, doing: str) -> str:
    """The folder ``store`` lives in, which must exist (a user error otherwise)."""
    folder = os.path.dirname(os.path.normpath(store))
    if not os.path.isdir(folder):
        why = "is not a folder" if os.path.lexists(folder) else "does not exist"
        raise InputError(f"cannot {doing} the scan store {store}: its folder {folder} {why}")
    return folder


def check_store_location(store: str, *, create: bool = False) -> None:
    """A user error in one line when a command could not write the scan store ``store`` (an
    absolute path): the path is a file; with ``create``, the store is missing and its folder is
    missing or cannot be written; the store exists and cannot be written (an ingest's staging
    folder for archives is checked when an archive comes: :class:`~.ingest.Staging`).

    A store that is missing (without ``create``) or a folder that holds no Zarr hierarchy is
    left to :class:`~scanforest.tasks.store.ScanStore`, whose line says which it is."""
    if os.path.lexists(store) and not os.path.isdir(store):
        raise InputError(f"{store} exists and is not a folder, so it cannot be a scan store")
    exists = os.path.isdir(store)
    if create and not exists:
        folder = _folder_of(store, "create")
        _probe(folder, f"cannot create the scan store {store}: cannot write in {folder}")
    if exists and (create or os.path.isfile(os.path.join(store, "zarr.json"))):
        _probe(store, f"cannot write to the scan store {store}")


def check_output_folder(folder: str) -> None:
    """A user error in one line when the folder a command creates and fills (the demo's) is a
    file, or when it, or its nearest existing parent where it does not exist yet, cannot be
    written."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise InputError(f"{folder} exists and is not a folder")
    there = folder
    while not os.path.lexists(there):
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        raise InputError(f"cannot create {folder}: {there} is not a folder")
    _probe(there, f"cannot write in {folder}" if there == folder else
           f"cannot create {folder}: cannot write in {there}")


def check_output_file(path: str, option: str) -> str:
    """The file a command writes at the end (``report -o``, ``align -o``), checked before any
    work: a user error in one line when it is a folder, when it lies inside a scan store (writing
    ``STORE/zarr.json`` made the store unreadable), or when its folder cannot be made or written
    (:func:`check_output_folder`). Returns the path, absolute."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise InputError(f"{option} {path} is a folder: give a file name")
    there = os.path.dirname(path)
    while there and there != os.path.dirname(there):
        if os.path.isfile(os.path.join(there, "zarr.json")):
            raise InputError(f"{option} {path} lies inside the scan store {there}: write it elsewhere")
        there = os.path.dirname(there)
    check_output_folder(os.path.dirname(path))
    return path
