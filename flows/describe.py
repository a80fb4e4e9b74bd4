"""The describe flow: every scan in the store -> normals, keypoints, frames, SHOT352."""
from __future__ import annotations

import time
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from scanforest.tasks.describe import DescribeParams
from scanforest.tasks.prefect_tasks import describe_scan_task
from scanforest.tasks.store import ScanStore, _now

from ._runner import (RUN_HOOKS, absolute_path, auto_batch, check_scheduler, count_redone, dask_client,
                      ensure_prefect_api, failures, map_batches, n_workers, open_store, record_run, require_scans)


@flow(name="scanforest-describe", task_runner=ThreadPoolTaskRunner(max_workers=32), **RUN_HOOKS)
def describe_flow(store: str, scans: list[str] | None = None, params: DescribeParams | None = None,
                  device: str = "auto", scheduler: str | None = None, workers: int | None = None,
                  progress: bool = True, batch: int | None = None) -> dict[str, Any]:
    """Normals, keypoints, frames and SHOT352 for ``scans`` (default: every scan) of ``store``.

    A scan that cannot be described is recorded as failed (its id and the reason) and the rest
    go on; its stage is not written, so the next run tries it again."""
    store = absolute_path(store)
    check_describe(store, scans)
    with dask_client(scheduler, n_workers=workers, device=device) as client:
        summary = _describe(store, scans, params, device, progress, batch, n_workers(client))
        summary["workers"] = n_workers(client)
    return summary


def _describe(store, scans, params, device, progress, batch, nw) -> dict[str, Any]:
    t0 = time.perf_counter()
    st = ScanStore(store)
    ids = st.scans() if scans is None else list(scans)
    params = params or DescribeParams()
    since = _now()
    recs = map_batches(describe_scan_task, ids, item_param="scan_ids",
                       common=dict(store=store, params=params, device=device), label="describe",
                       batch=batch or auto_batch(len(ids), nw), progress=progress, workers=nw)
    count_redone(recs, st, "describe", since, "described")
    done = [r for r in recs if r["status"] == "described"]
    failed = failures(recs)
    summary = {"scans": len(ids), "described": len(done), "skipped": sum(r["status"] == "skipped" for r in recs),
               "failed": len(failed), "failures": failed,
               "keypoints": int(sum(r["keypoints"] for r in done)), "seconds": time.perf_counter() - t0,
               "task_seconds": float(sum(r["seconds"] for r in recs))}
    record_run(st, "describe", {**params.as_dict(), "device": device}, summary, recs)
    return summary


def check_describe(store: str, scans: list[str] | None) -> None:
    """The store exists and holds the named scans (a user error otherwise, before any work)."""
    require_scans(open_store(store), scans)


def run_describe(store: str, *, scans=None, params: DescribeParams | None = None, device: str = "auto",
                 scheduler: str | None = None, workers: int | None = None, progress: bool = True) -> dict[str, Any]:
    store = absolute_path(store)
    check_describe(store, scans)
    check_scheduler(scheduler)
    ensure_prefect_api()
    return describe_flow(store=str(store), scans=scans, params=params, device=device, scheduler=scheduler,
                         workers=workers, progress=progress)
