"""Prefect tasks: each wraps one idempotent unit of work from ``scanforest.tasks`` and runs it on
the active Dask cluster (``distributed.default_client()``), or inline when there is none.

The unit-of-work functions themselves import neither Prefect nor the flows, so Dask workers
(and the GPU machine, which has no Prefect) only import what the work needs: these tasks, and
:func:`current_run` (the Prefect run a stage record names), live with the flows.
"""
from __future__ import annotations

from typing import Any, Callable

from prefect import task

from scanforest.kernels.errors import ScanforestError
from scanforest.tasks.ingest import Source, ingest_files
from scanforest.tasks.units import isolated

from .cluster import Interrupted, stopping, wait_for


def current_run() -> str | None:
    """The id of the Prefect flow run this code runs in (from a task run's or a flow run's
    context), or None outside one. Stage records name it (``run``), so a flow counts as its own
    the stages its run wrote, and no other run's (:func:`scanforest.flows.records.count_redone`)."""
    try:
        from prefect.context import FlowRunContext, TaskRunContext
    except ImportError:
        return None
    task = TaskRunContext.get()
    if task is not None and getattr(task.task_run, "flow_run_id", None):
        return str(task.task_run.flow_run_id)
    flow = FlowRunContext.get()
    if flow is not None and flow.flow_run is not None:
        return str(flow.flow_run.id)
    return None


#: transient failures worth a retry (network filesystems, a worker lost mid-task, ...)
RETRY_DELAYS = [2, 10, 30]


def not_a_user_error(task, task_run, state) -> bool:
    """Prefect retry condition: retry what may pass next time, never a user error (a bad
    parameter fails the same way three times, 12-18 s later)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            exc = state.result(raise_on_failure=False)
        except Exception:
            return True
    return not isinstance(exc, ScanforestError)


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
    if stopping():
        raise Interrupted("stopped by a Ctrl-C")
    fut = client.submit(fn, *args, key=key, pure=False, resources=resources, **kwargs)
    try:
        return wait_for(client, [fut], fut.result)
    finally:
        fut.release()


def on_cluster_many(fn: Callable, calls: list[tuple[tuple, dict]], priorities: list[int] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` for every ``(args, kwargs)`` as separate Dask tasks (in
    parallel, each rescheduled if its worker dies; ``priorities``: Dask's, higher first) and
    return the results in order."""
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):
        return [fn(*a, **kw) for a, kw in calls]
    if stopping():
        raise Interrupted("stopped by a Ctrl-C")
    prio = priorities or [0] * len(calls)
    futs = [client.submit(fn, *a, pure=False, priority=p, **kw) for (a, kw), p in zip(calls, prio)]
    try:
        return wait_for(client, futs, lambda: client.gather(futs))
    finally:
        for f in futs:
            f.release()


def in_parts(fn: Callable, items: list, parts: int | list[int], *args, **kwargs) -> list[Any]:
    """``fn(*args, part, **kwargs)`` for ``items`` split into ``parts`` (the batches of a task run
    that holds several: :func:`~scanforest.flows.batching.map_batches`): that many even parts, or
    parts of these sizes (a tapered run's, the smaller ones at a lower Dask priority:
    :func:`~scanforest.flows.batching.batch_priorities`), each its own Dask task; each returns one
    record per item, and the records come back in ``items``' order."""
    from .batching import batch_priorities, even_parts, split_sizes

    if isinstance(parts, int):
        if parts <= 1:
            return on_cluster(fn, *args, items, **kwargs)
        split, prio = even_parts(items, parts), None
    else:
        split, prio = split_sizes(items, parts), batch_priorities(parts)
    out = on_cluster_many(fn, [((*args, part), kwargs) for part in split], prio)
    return [rec for recs in out for rec in recs]


def batch_name(items: list, attr: str | None = None) -> str:
    first = getattr(items[0], attr) if attr else items[0]
    return first if len(items) == 1 else f"{first} (+{len(items) - 1})"


@task(name="ingest", retries=2, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=not_a_user_error,
      task_run_name=lambda: "ingest " + run_label("sources", "scan_id"))
def ingest_scan(store: str, sources: list[Source], units: str = "m", run: str | None = None,
                copc: dict[str, Any] | None = None, parts: int = 1) -> list[dict[str, Any]]:
    """Ingest a batch of scan files in ``parts`` Dask tasks (each file skipped when unchanged,
    quarantined when unreadable; ``copc``: the query of COPC files); a worker lost midway has its
    task rescheduled, and the files it finished are found current."""
    return in_parts(ingest_files, list(sources), parts, store, units=units, run=run, copc=copc)


@task(name="describe", retries=2, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=not_a_user_error,
      task_run_name=lambda: "describe " + run_label("scan_ids"))
def describe_scan_task(store: str, scan_ids: list[str], params, device: str = "auto",
                       run: str | None = None) -> list[dict[str, Any]]:
    """Normals, keypoints, frames and SHOT352 of stored scans, one Dask task per scan (each skipped
    when already done, left to another run that holds it); ``run``: the flow run the stage records
    name (default: this task's flow run)."""
    from scanforest.tasks.describe import describe_scan

    run = run or current_run()
    return on_cluster_many(isolated, [((describe_scan, s, store, s, params), {"device": device, "run": run})
                                      for s in scan_ids])


def run_label(param: str, attr: str | None = None) -> str:
    """Task-run name from the run's parameters: the first item and how many more."""
    from prefect.runtime import task_run

    items = task_run.parameters.get(param) or ["?"]
    return batch_name(list(items), attr)


@task(name="align-pair", retries=2, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=not_a_user_error,
      task_run_name="align {observed} -> {reference}")
def align_pair_task(store: str, observed: str, reference: str, options: dict | None = None) -> dict[str, Any]:
    """Parametric chamfer alignment of one stored scan onto another (skipped when already done)."""
    from scanforest.tasks.align import align_pair

    return on_cluster(isolated, align_pair, f"{observed}:{reference}", store, observed, reference,
                      **(options or {}), key=f"align-{observed}-{reference}-{id(options):x}")


@task(name="recognize", retries=2, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=not_a_user_error,
      task_run_name=lambda: "recognize " + run_label("scan_ids"))
def recognize_batch_task(store: str, scan_ids: list[str], library: str, params: dict,
                         device: str = "auto", run: str | None = None) -> list[dict[str, Any]]:
    """Recognise the library's models in stored scenes, one Dask task per scene (each skipped when
    done, left to another run that holds it); ``run``: as for :func:`describe_scan_task`."""
    from scanforest.tasks.recognize import recognize_scan

    run = run or current_run()
    return on_cluster_many(isolated, [((recognize_scan, s, store, s, library, params), {"device": device, "run": run})
                                      for s in scan_ids])


@task(name="process", retries=2, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=not_a_user_error,
      task_run_name=lambda: "process " + run_label("scan_ids"))
def process_batch_task(store: str, scan_ids: list[str], library: str, index: str, params: dict, k: int,
                       device: str = "auto", parts: int | list[int] = 1) -> list[dict[str, Any]]:
    """Describe, match and recognise a batch of stored scenes in ``parts`` Dask tasks: each one
    pass on one worker, each scene's data resident on its device
    (:func:`scanforest.tasks.pipeline.process_batch`)."""
    from scanforest.tasks.pipeline import process_batch

    from .worker_setup import leave_the_worker_pool

    return in_parts(process_batch, list(scan_ids), parts, store, library=library, index=index, params=params,
                    k=k, device=device, while_writing=leave_the_worker_pool)
