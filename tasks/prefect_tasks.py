"""Prefect tasks: each wraps one idempotent unit of work from ``scanforest.tasks`` and runs it on
the active Dask cluster (``distributed.default_client()``), or inline when there is none.

The unit-of-work functions themselves import neither Prefect nor the flows, so Dask workers
(and the GPU machine, which has no Prefect) only import what the work needs.
"""
from __future__ import annotations

from typing import Any, Callable

from prefect import task

from .ingest import Source, ingest_file

#: transient failures worth a retry (network filesystems, a worker lost mid-task, ...)
RETRY_DELAYS = [2, 10, 30]


def on_cluster(fn: Callable, *args, key: str | None = None, resources: dict | None = None, **kwargs) -> Any:
    """Run ``fn(*args, **kwargs)`` on the default Dask client's cluster and wait for the result.

    A worker killed while running it does not fail the call: Dask reschedules the work on a
    surviving worker (its ``allowed-failures`` budget applies).
    """
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):
        return fn(*args, **kwargs)
    fut = client.submit(fn, *args, key=key, pure=False, resources=resources, **kwargs)
    try:
        return fut.result()
    finally:
        fut.release()


@task(name="ingest-scan", retries=2, retry_delay_seconds=RETRY_DELAYS, task_run_name="ingest {source.scan_id}")
def ingest_scan(store: str, source: Source, units: str = "m") -> dict[str, Any]:
    """Ingest one scan file (skip when unchanged, quarantine when unreadable)."""
    return on_cluster(ingest_file, store, source, units=units, key=f"ingest-{source.scan_id}-{id(source):x}")


@task(name="describe-scan", retries=2, retry_delay_seconds=RETRY_DELAYS, task_run_name="describe {scan_id}")
def describe_scan_task(store: str, scan_id: str, params, device: str = "auto") -> dict[str, Any]:
    """Normals, keypoints, frames and SHOT352 of one stored scan (skipped when already done)."""
    from .describe import describe_scan

    return on_cluster(describe_scan, store, scan_id, params, device=device, key=f"describe-{scan_id}-{id(params):x}")


@task(name="align-pair", retries=2, retry_delay_seconds=RETRY_DELAYS, task_run_name="align {observed} -> {reference}")
def align_pair_task(store: str, observed: str, reference: str, options: dict | None = None) -> dict[str, Any]:
    """Parametric chamfer alignment of one stored scan onto another (skipped when already done)."""
    from .align import align_pair

    return on_cluster(align_pair, store, observed, reference, **(options or {}),
                      key=f"align-{observed}-{reference}-{id(options):x}")
