"""The ingest flow: a folder, glob or archive of scans -> the Zarr scan store."""
from __future__ import annotations

import sys
import time
import uuid
from typing import Any

# Zarr is imported with the flow module (the CLI starts Prefect's API first, so the import runs
# while the server boots), not by the first store a run opens: there it took 0.15 s on 2 cores and
# 0.7 s on a 16-core GPU machine between the ingest's start and its first task
import zarr  # noqa: F401
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from scanforest.kernels.errors import InputError
from scanforest.tasks.ingest import Staging, check_source, discover, ignored_note, staging_folder, staging_note
from scanforest.tasks.las import copc_settings
from scanforest.tasks.store import ScanStore, scan_id_for

from .batching import TASKS_IN_FLIGHT, auto_batch, map_batches
from .cluster import check_scheduler, dask_client, n_workers
from .inputs import absolute_path, check_ingest
from .prefect_api import ensure_prefect_api, quiet_prefect_logs
from .prefect_tasks import ingest_scan
from .records import RUN_HOOKS, box_origin, record_run
from .worker_setup import INGEST_PRELOAD


@flow(name="scanforest-ingest", task_runner=ThreadPoolTaskRunner(max_workers=TASKS_IN_FLIGHT), **RUN_HOOKS)
def ingest_flow(source: str, store: str, units: str = "m", scheduler: str | None = None,
                workers: int | None = None, progress: bool = True, batch: int | None = None,
                copc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ingest every scan under ``source`` (folder, glob or archive) into ``store``.

    ``copc``: the query of COPC files (:func:`~scanforest.tasks.las.copc_settings`: ``level``
    or ``resolution``, and ``bounds``); default their full point cloud.
    Runs its tasks on the Dask cluster at ``scheduler`` or on a local cluster of ``workers``
    processes. Returns the summary: ingested / skipped / quarantined / ignored, points, bytes, seconds.
    """
    # workers run in another working folder: a relative store would be written there
    source, store = absolute_path(source), absolute_path(store)
    existing = _is_store(store)
    check_source(source, allow_empty=existing)
    copc = copc_settings(**(copc or {}))
    with dask_client(scheduler, n_workers=workers, device="cpu", preload=INGEST_PRELOAD) as client:
        summary = _ingest(source, store, units, progress, batch, n_workers(client), existing, copc)
        summary["workers"] = n_workers(client)
    return summary


def _is_store(store: str) -> bool:
    """An ingest into an existing store may find nothing new (a drop folder between deliveries);
    one that would create the store must find scans, or it leaves nothing behind."""
    return ScanStore.exists(store)


def _ingest(source: str, store: str, units: str, progress: bool, batch: int | None, nw: int,
            existing: bool = False, copc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Discover, create the store (only now: a source without scans leaves nothing behind), ingest."""
    t0 = time.perf_counter()
    ignored: list[dict[str, str]] = []
    with Staging(staging_folder(store)) as staging:  # made when an archive comes
        try:
            sources, problems = discover(source, staging, ignored=ignored)
            t_found = time.perf_counter() - t0
            if not sources and not problems and not existing:
                raise InputError(f"ingest source {source} holds no scan files ({len(ignored)} other files ignored)")
            st = ScanStore(store, create=True)
        except InputError:
            staging.remove()
            raise
        for prob in problems:
            st.quarantine(prob["source"], prob["reason"],
                          key=scan_id_for(prob["source"].replace("::", "/").lstrip("/")))
        run = uuid.uuid4().hex  # marks the scans this run writes (see ingest_file)
        records = map_batches(ingest_scan, sources, item_param="sources",
                              common=dict(store=store, units=units, run=run, copc=copc),
                              label="ingest", batch=batch or auto_batch(len(sources), nw), progress=progress, workers=nw,
                              parts_param="parts")
        # the scans' groups as their workers left them: the next listing of the store reads none of them
        ScanStore.remember_summaries(store, {r["scan_id"]: r.pop("group") for r in records if r.get("group")})
        summary = summarize(records, time.perf_counter() - t0)
        summary["discover_seconds"] = t_found
        summary["quarantined"] += len(problems)
        summary["quarantine_reasons"] += [{"source": p["source"], "reason": p["reason"]} for p in problems]
        summary["ignored"] = len(ignored)
        if ignored:
            summary["ignored_note"] = ignored_note(ignored)
        # the files extracted from archives are kept where an archive member was quarantined (a
        # rerun retries it without extracting again), unless another ingest still reads them; said
        members = sum(r["status"] == "quarantined" and "::" in r["source"] for r in records)
        if not members or not staging.holds_files():
            staging.remove()
        else:
            summary["staging_note"] = staging_note(staging.path, members)
    params = {"source": str(source), "units": units}
    if copc and any(v is not None for v in copc.values()):
        params["copc"] = copc
    record_run(st, "ingest", params, summary, records)
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
        **box_origin(records),
    }



def run_ingest(source: str, store: str, *, scheduler: str | None = None, workers: int | None = None,
               units: str = "m", progress: bool = True, batch: int | None = None,
               copc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ingest with the embedded defaults: a local Dask cluster (or ``scheduler``) and Prefect's API.
    ``copc``: :func:`ingest_flow`'s."""
    copc = check_ingest(source, store, copc)  # a bad source or COPC query: one line, before Prefect or Dask
    from .noop import quick_ingest

    summary = quick_ingest(str(source), str(store))  # an empty drop folder: answered before Prefect or Dask
    if summary is None:
        check_scheduler(scheduler)
        ensure_prefect_api()
        quiet_prefect_logs()
        summary = ingest_flow(source=str(source), store=str(store), units=units, scheduler=scheduler,
                              workers=workers, progress=progress, batch=batch, copc=copc)
    if progress and summary.get("ignored_note"):
        print(summary["ignored_note"], file=sys.stderr)
    return summary
