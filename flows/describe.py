"""The describe flow: every scan in the store -> normals, keypoints, frames, SHOT352."""
from __future__ import annotations

import time
import uuid
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from scanforest.tasks.describe import DescribeParams
from scanforest.tasks.store import ScanStore, utc_now
from scanforest.tasks.units import HELD

from .batching import TASKS_IN_FLIGHT, auto_batch, map_batches
from .cluster import check_scheduler, dask_client, n_workers
from .inputs import absolute_path, check_describe, open_store
from .noop import describe_noop
from .prefect_api import ensure_prefect_api
from .prefect_tasks import current_run, describe_scan_task
from .records import RUN_HOOKS, count_redone, failures, record_run


@flow(name="scanforest-describe", task_runner=ThreadPoolTaskRunner(max_workers=TASKS_IN_FLIGHT), **RUN_HOOKS)
def describe_flow(store: str, scans: list[str] | None = None, params: DescribeParams | None = None,
                  device: str = "auto", scheduler: str | None = None, workers: int | None = None,
                  progress: bool = True, batch: int | None = None) -> dict[str, Any]:
    """Normals, keypoints, frames and SHOT352 for ``scans`` (default: every scan) of ``store``.

    A scan that cannot be described is recorded as failed (its id and the reason) and the rest
    go on; its stage is not written, so the next run tries it again."""
    store = absolute_path(store)
    check_describe(store, scans)
    quick = describe_noop(store, scans, params or DescribeParams())
    if quick is not None:  # nothing to do: no cluster, and the run is counted, not stored (record_run)
        record_run(ScanStore(store), "describe", {**(params or DescribeParams()).as_dict(), "device": device},
                   quick, [])
        return quick
    with dask_client(scheduler, n_workers=workers, device=device) as client:
        summary = _describe(store, scans, params, device, progress, batch, n_workers(client))
        summary["workers"] = n_workers(client)
    return summary


def _describe(store, scans, params, device, progress, batch, nw) -> dict[str, Any]:
    t0 = time.perf_counter()
    st = ScanStore(store)
    ids = st.scans() if scans is None else list(scans)
    params = params or DescribeParams()
    since = utc_now()
    run = current_run() or f"local-{uuid.uuid4().hex}"  # the stage records name it (outside Prefect too)
    recs = map_batches(describe_scan_task, ids, item_param="scan_ids",
                       common=dict(store=store, params=params, device=device, run=run), label="describe",
                       batch=batch or auto_batch(len(ids), nw), progress=progress, workers=nw)
    summary = summarize(recs, st, since=since, run=run)
    summary.update(scans=len(ids), seconds=time.perf_counter() - t0)
    record_run(st, "describe", {**params.as_dict(), "device": device}, summary, recs)
    return summary


def summarize(recs: list[dict], st: ScanStore, *, since: str, run: str | None) -> dict[str, Any]:
    """A describe run's figures, counted from what it stored: a scan whose ``describe`` record
    names this run is ``described`` with the record's keypoints, also where a lost worker took
    the unit's own record with it (Dask ran it again and it found the stage written:
    :func:`count_redone`); a scan another run was describing is ``held``, left to that run, so the
    ``described`` of runs at once add up to the scans once."""
    count_redone(recs, st, "describe", since, "described", run=run,
                 fields={"keypoints": "keypoints", "valid": "valid_descriptors"})
    done = [r for r in recs if r["status"] == "described"]
    failed = failures(recs)
    return {"scans": len(recs), "described": len(done), "skipped": sum(r["status"] == "skipped" for r in recs),
            "held": sum(r["status"] == HELD for r in recs), "failed": len(failed), "failures": failed,
            "keypoints": int(sum(r.get("keypoints", 0) for r in done)),
            "task_seconds": float(sum(r.get("seconds", 0.0) for r in recs))}


def run_describe(store: str, *, scans=None, params: DescribeParams | None = None, device: str = "auto",
                 scheduler: str | None = None, workers: int | None = None, progress: bool = True) -> dict[str, Any]:
    store = absolute_path(store)
    check_describe(store, scans)
    p = params or DescribeParams()
    open_store(store).check_coordinates(scans, {"normal_radius": p.normal_radius, "keypoint_radius": p.keypoint_radius,
                                                "shot_radius": p.shot_radius})
    check_scheduler(scheduler)
    ensure_prefect_api()
    return describe_flow(store=str(store), scans=scans, params=params, device=device, scheduler=scheduler,
                         workers=workers, progress=progress)
