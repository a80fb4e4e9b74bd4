"""Running units of work: what the Prefect tasks and the one-pass pipeline share, without Prefect
(Dask workers import this, not Prefect)."""
from __future__ import annotations

import logging
import time
import traceback
from typing import Any, Callable

from scanforest.kernels.errors import ScanforestError

log = logging.getLogger("scanforest")


def isolated(fn: Callable, item: str, *args, **kwargs) -> dict[str, Any]:
    """Run one item's unit of work; an error becomes that item's ``failed`` record (its id and
    the reason in one line), so one bad scan does not fail the batch or the flow. The item's
    stage is not recorded, so the next run tries it again. Unexpected errors (not a
    :class:`ScanforestError`) keep their traceback in the log and in the record."""
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    except ScanforestError as exc:
        return {"scan_id": item, "status": "failed", "reason": str(exc), "seconds": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - recorded with its traceback, the batch goes on
        tb = traceback.format_exc()
        log.error("%s failed:\n%s", item, tb)
        return {"scan_id": item, "status": "failed", "reason": f"{type(exc).__name__}: {exc}".splitlines()[0],
                "traceback": tb, "seconds": time.perf_counter() - t0}
