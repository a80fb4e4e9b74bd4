"""The describe flow: every scan in the store -> normals, keypoints, frames, SHOT352."""
from __future__ import annotations

import time
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from scanforest.tasks.describe import DescribeParams
from scanforest.tasks.prefect_tasks import describe_scan_task
from scanforest.tasks.store import ScanStore

from ._runner import auto_batch, dask_client, ensure_prefect_api, map_batches, n_workers, record_run


@flow(name="scanforest-describe", task_runner=ThreadPoolTaskRunner(max_workers=32))
def describe_flow(store: str, scans: list[str] | None = None, params: DescribeParams | None = None,
                  device: str = "auto", scheduler: str | None = None, workers: int | None = None,
                  progress: bool = True, batch: int | None = None) -> dict[str, Any]:
    """Normals, keypoints, frames and SHOT352 for ``scans`` (default: every scan) of ``store``."""
    with dask_client(scheduler, n_workers=workers, device=device) as client:
        summary = _describe(store, scans, params, device, progress, batch, n_workers(client))
        summary["workers"] = n_workers(client)
    return summary


def _describe(store, scans, params, device, progress, batch, nw) -> dict[str, Any]:
    t0 = time.perf_counter()
    st = ScanStore(store)
    ids = scans or st.scans()
    params = params or DescribeParams()
    recs = map_batches(describe_scan_task, ids, item_param="scan_ids",
                       common=dict(store=store, params=params, device=device), label="describe",
                       batch=batch or auto_batch(len(ids), nw), progress=progress)
    done = [r for r in recs if r["status"] == "described"]
    summary = {"scans": len(ids), "described": len(done), "skipped": len(ids) - len(done),
               "keypoints": int(sum(r["keypoints"] for r in done)), "seconds": time.perf_counter() - t0,
               "task_seconds": float(sum(r["seconds"] for r in recs))}
    record_run(st, "describe", {**params.as_dict(), "device": device}, summary, recs)
    return summary


def run_describe(store: str, *, scans=None, params: DescribeParams | None = None, device: str = "auto",
                 scheduler: str | None = None, workers: int | None = None, progress: bool = True) -> dict[str, Any]:
    ensure_prefect_api()
    return describe_flow(store=str(store), scans=scans, params=params, device=device, scheduler=scheduler,
                         workers=workers, progress=progress)
