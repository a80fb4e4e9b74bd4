"""The ingest flow: a folder, glob or archive of scans -> the Zarr scan store."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from scanforest.tasks.ingest import discover
from scanforest.tasks.prefect_tasks import ingest_scan
from scanforest.tasks.store import ScanStore, scan_id_for

from ._runner import (auto_batch, dask_client, ensure_prefect_api, map_batches, n_workers, quiet_prefect_logs,
                      record_run)


@flow(name="scanforest-ingest", task_runner=ThreadPoolTaskRunner(max_workers=32))
def ingest_flow(source: str, store: str, units: str = "m", scheduler: str | None = None,
                workers: int | None = None, progress: bool = True, batch: int | None = None) -> dict[str, Any]:
    """Ingest every scan under ``source`` (folder, glob or archive) into ``store``.

    Runs its tasks on the Dask cluster at ``scheduler`` or on a local cluster of ``workers``
    processes. Returns the summary: ingested / skipped / quarantined, points, bytes, seconds.
    """
    with dask_client(scheduler, n_workers=workers, device="cpu") as client:
        summary = _ingest(source, store, units, progress, batch, n_workers(client))
        summary["workers"] = n_workers(client)
    return summary


def _ingest(source: str, store: str, units: str, progress: bool, batch: int | None, nw: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    st = ScanStore(store)
    staging = Path(str(store).rstrip("/") + ".staging")
    sources, problems = discover(source, staging)
    for prob in problems:
        st.quarantine(prob["source"], prob["reason"], key=scan_id_for(prob["source"].replace("::", "/").lstrip("/")))
    records = map_batches(ingest_scan, sources, item_param="sources", common=dict(store=store, units=units),
                          label="ingest", batch=batch or auto_batch(len(sources), nw), progress=progress)
    summary = summarize(records, time.perf_counter() - t0)
    summary["quarantined"] += len(problems)
    summary["quarantine_reasons"] += [{"source": p["source"], "reason": p["reason"]} for p in problems]
    if staging.exists() and summary["quarantined"] == len(problems):
        shutil.rmtree(staging, ignore_errors=True)
    record_run(st, "ingest", {"source": str(source), "units": units}, summary, records)
    return summary


def summarize(records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    by = {"ingested": 0, "skipped": 0, "quarantined": 0}
    for r in records:
        by[r["status"]] = by.get(r["status"], 0) + 1
    ingested = [r for r in records if r["status"] == "ingested"]
    return {
        **by,
        "files": len(records),
        "points": int(sum(r["points"] for r in ingested)),
        "bytes": int(sum(r["bytes"] for r in ingested)),
        "seconds": seconds,
        "task_seconds": float(sum(r.get("seconds", 0.0) for r in records)),
        "quarantine_reasons": [{"source": r["source"], "reason": r["reason"]}
                               for r in records if r["status"] == "quarantined"],
    }


def run_ingest(source: str, store: str, *, scheduler: str | None = None, workers: int | None = None,
               units: str = "m", progress: bool = True, batch: int | None = None) -> dict[str, Any]:
    """Ingest with the embedded defaults: a local Dask cluster (or ``scheduler``) and Prefect's API."""
    ensure_prefect_api()
    quiet_prefect_logs()
    return ingest_flow(source=str(source), store=str(store), units=units, scheduler=scheduler,
                       workers=workers, progress=progress, batch=batch)
