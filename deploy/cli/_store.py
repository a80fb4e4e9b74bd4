"""Where a command writes, checked while its arguments are parsed (before its flow is imported,
a cluster starts or Prefect's API is waited for), and named again when a write fails later.

The ``STORE`` argument of every command that writes into a store takes one of these callbacks;
a problem (:mod:`scanforest.tasks.preflight`) is a user error in one line, exit 2, about a
second into the command. The path that passed is kept, so a write that fails for the same
reasons during the run (the disk filled up meanwhile) is one line naming it too
(:func:`write_failure`, used by :func:`scanforest.deploy.cli.main`).
"""
from __future__ import annotations

import errno
from pathlib import Path

#: the store (or output folder) this command writes, once its argument is checked
_target: str | None = None

#: errors of a write that say where the command writes is unusable, not that scanforest failed
WHERE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _keep(path: str) -> str:
    global _target
    _target = path
    return path


def existing_store(store: str) -> str:
    """``STORE`` callback of the commands that write into an existing store (describe, index
    build, match, recognize, align-store)."""
    from scanforest.flows.inputs import absolute_path
    from scanforest.tasks.preflight import check_store_location

    check_store_location(_keep(absolute_path(store)))
    return store


def new_store(store: str) -> str:
    """``STORE`` callback of ingest, which creates the store when missing (its staging folder for
    archives is checked when an archive comes: :class:`~scanforest.tasks.ingest.Staging`)."""
    from scanforest.flows.inputs import absolute_path
    from scanforest.tasks.preflight import check_store_location

    check_store_location(_keep(absolute_path(store)), create=True)
    return store


def new_or_existing_store(store: str) -> str:
    """``STORE`` callback of ``flow run``, which creates the store when it ingests frames."""
    from scanforest.flows.inputs import absolute_path
    from scanforest.tasks.preflight import check_store_location

    check_store_location(_keep(absolute_path(store)), create=True)
    return store


def output_folder(folder: Path) -> Path:
    """``--workdir`` callback of the demo, which creates the folder and its archive and store."""
    from scanforest.flows.inputs import absolute_path
    from scanforest.tasks.preflight import check_output_folder

    check_output_folder(_keep(absolute_path(str(folder))))
    return folder


def write_failure(exc: OSError) -> str | None:
    """The one line for a write that failed during a run because of where it writes (a full
    disk, a quota, a mount gone read-only), naming the store; None for any other error, which
    keeps its traceback."""
    if exc.errno not in WHERE_ERRORS:
        return None
    from scanforest.tasks.preflight import write_problem

    where = _target or "the store"
    if exc.filename and not str(exc.filename).startswith(where):  # not the store's write after all
        where = str(exc.filename)
    return f"cannot write to {where}: {write_problem(exc)}"
