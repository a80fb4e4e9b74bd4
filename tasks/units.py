"""Running units of work: what the Prefect tasks and the one-pass pipeline share, without Prefect
(Dask workers import this, not Prefect)."""
from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any, Callable

from scanforest.kernels.errors import ScanforestError

from .store import StoreWriteError

log = logging.getLogger("scanforest")

#: a unit of work's status for a scan whose stage another run is computing (it holds the scan's
#: stage claim, :meth:`~scanforest.tasks.store.ScanStore.claim_stage`): left to that run
HELD = "held"
HELD_REASON = "held by another run"


def isolated(fn: Callable, item: str, *args, **kwargs) -> dict[str, Any]:
    """Run one item's unit of work; an error becomes that item's ``failed`` record (its id and
    the reason in one line), so one bad scan does not fail the batch or the flow. The item's
    stage is not recorded, so the next run tries it again. Unexpected errors (not a
    :class:`ScanforestError`) keep their traceback in the log and in the record.

    A store that cannot be written (no space left, read-only: :class:`StoreWriteError`) is not
    this item's failure: it is raised, and ends the run in one line instead of failing every scan
    after this one the same way."""
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    except StoreWriteError:
        raise
    except ScanforestError as exc:
        return {"scan_id": item, "status": "failed", "reason": str(exc), "seconds": time.perf_counter() - t0,
                **_device_memory(exc)}
    except Exception as exc:  # noqa: BLE001 - recorded with its traceback, the batch goes on
        tb = traceback.format_exc()
        log.error("%s failed:\n%s", item, tb)
        return {"scan_id": item, "status": "failed", "reason": f"{type(exc).__name__}: {exc}".splitlines()[0],
                "traceback": tb, "where": innermost_frame(exc), "seconds": time.perf_counter() - t0,
                **_device_memory(exc)}


def _device_memory(exc: BaseException) -> dict[str, bool]:
    """``{"device_memory": True}`` for a GPU out of memory (a unit that may pass once cached
    memory is given back: :func:`scanforest.kernels.backend.is_device_memory_error`)."""
    from scanforest.kernels.backend import is_device_memory_error

    return {"device_memory": True} if is_device_memory_error(exc) else {}


def innermost_frame(exc: BaseException) -> str:
    """``file:line in function`` of the frame that raised ``exc`` (the last one in scanforest's
    code when the error came from a library below it): where to look, in one line."""
    import scanforest.kernels
    import scanforest.tasks

    roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (scanforest.kernels, scanforest.tasks))
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # the first: the caller's try (isolated's)
    ours = [f for f in frames if f.filename.startswith(roots)]
    f = (ours or frames or [None])[-1]
    return "" if f is None else f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"


def held(scan_id: str, t0: float, **fields) -> dict[str, Any]:
    """The record of a scan left to the run that holds its stage claim."""
    return {"scan_id": scan_id, "status": HELD, "reason": HELD_REASON, **fields, "seconds": time.perf_counter() - t0}


#: test hook: a folder; a unit of work that has claimed a scan's stage announces it there and waits
TEST_CLAIMED_ENV = "SCANFOREST_TEST_CLAIMED"


def after_claim(stage: str, scan_id: str, run: str | None) -> None:
    """Test hook, a no-op unless ``SCANFOREST_TEST_CLAIMED`` names a folder: a unit that has just
    claimed ``scan_id``'s ``stage`` writes ``<stage>~<run>~<scan_id>`` there (holding its pid) and
    waits, its claim held, until the folder holds ``go``, ``go~<run>`` or that file's name plus
    ``.go`` (at most 120 s). Tests use it to hold scans while another run starts (concurrent
    runs) or to kill a worker at a known point."""
    folder = os.environ.get(TEST_CLAIMED_ENV)
    if not folder:
        return
    name = f"{stage}~{run}~{scan_id}"
    with open(os.path.join(folder, name), "w") as fh:
        fh.write(str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
            os.path.exists(os.path.join(folder, go)) for go in ("go", f"go~{run}", f"{name}.go")):
        time.sleep(0.02)
