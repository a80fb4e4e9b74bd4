"""A stage's work as Prefect tasks: items in batches sized for the cluster's workers
(:func:`auto_batch`, :func:`split_batches`), one Prefect task run per batch or unit on the flow's
thread-pool task runner (:func:`map_batches`, :func:`map_units`), with a progress bar."""
from __future__ import annotations

import itertools


#: Prefect task runs a flow keeps in flight (threads of its task runner, each waiting on one Dask
#: task): two per worker up to 64 workers, so that a worker that finishes a task finds its next
#: one already queued on the scheduler (with one per worker, 32 workers on four H100s went idle
#: between tasks while the flow process handed the next one out)
TASKS_IN_FLIGHT = 128


def auto_batch(n_items: int, workers: int, *, max_batch: int = 32) -> int:
    """Items per Prefect task: one each for small runs; for archives, enough per task that the
    per-task orchestration (~25-50 ms on 2 cores) stays a few percent of the work, while keeping
    at least 8 tasks per worker in flight for balance and progress."""
    return max(1, min(max_batch, n_items // max(1, 8 * workers)))


#: rounds of whole batches a run needs before its last rounds are tapered (:func:`split_batches`)
TAPER_MIN_ROUNDS = 4


def split_batches(items: list, batch: int, workers: int = 1, *, taper: bool = False) -> list[list]:
    """``items`` in consecutive batches of at most ``batch``, sized evenly (they differ by at most
    one item), and as many of them as a multiple of ``workers`` where there are enough items:
    equal tasks dealt out to the workers finish together, where a remainder batch (or one
    task more than a round) leaves all but a few workers idle for the run's last task.

    ``taper``: with at least :data:`TAPER_MIN_ROUNDS` rounds of whole batches, the last two rounds
    (one batch a worker each) are a half and a quarter of ``batch``. Equal tasks still end
    unevenly (their scenes and their GPU's other workers differ): on two H200s a worker sat idle
    2.0 s on average (at most 4.1 s) of a 53 s pass waiting for the last 6 s tasks; the small
    tasks at the end even that out. They must run last: :func:`batch_priorities`."""
    n = len(items)
    if not n:
        return []
    if taper and workers > 1 and batch >= 4 and n >= TAPER_MIN_ROUNDS * workers * batch:
        tail = [-(-batch // 2)] * workers + [-(-batch // 4)] * workers
        return split_batches(items[:n - sum(tail)], batch, workers) + split_sizes(items[n - sum(tail):], tail)
    t = -(-n // max(1, batch))
    if workers > 1 and t > 1:
        t = min(n, -(-t // workers) * workers)
    q, r = divmod(n, t)
    out, i = [], 0
    for j in range(t):
        size = q + (j < r)
        out.append(items[i:i + size])
        i += size
    return out


#: Prefect task runs a stage makes per worker when its task splits its items into several Dask
#: tasks (``parts``), and at least :data:`MIN_TASK_RUNS`: the server records every task run's
#: states from its events, and a flow waits behind that queue. On four H200s' host, the 288 task
#: runs of an 8,000-scan ingest on 32 workers held the next flow's start back by 2-3 s (its
#: first task 1.9-3.2 s into its call, against 0.2 s after 72 task runs on one GPU); on 2 cores,
#: 288 task runs were recorded 3.4-5.1 s after their flow returned, 72 after 1.0 s (2026-11-28)
TASK_RUNS_PER_WORKER = 2
MIN_TASK_RUNS = 16


def split_sizes(items: list, sizes: list[int]) -> list[list]:
    """``items`` in consecutive parts of these sizes (which must add up to their count)."""
    if sum(sizes) != len(items) or min(sizes, default=1) < 1:
        raise ValueError(f"parts of sizes {sizes} do not split {len(items)} items")
    ends = list(itertools.accumulate(sizes))
    return [items[e - k:e] for k, e in zip(sizes, ends)]


def batch_priorities(sizes: list[int]) -> list[int]:
    """Dask priorities of batches of these sizes (higher runs first): the largest 0, each
    smaller one less by its shortfall, so that a tapered run's small batches
    (:func:`split_batches`) wait for every larger one, whichever task run submitted them first."""
    top = max(sizes, default=0)
    return [int(s) - top for s in sizes]


def even_parts(seq: list, n: int) -> list[list]:
    """``seq`` in ``n`` parts of consecutive elements (fewer when it is shorter), whose lengths
    differ by at most one: batches grouped into task runs, and a task run's items split back
    into the batches they came as."""
    n = max(1, min(n, len(seq)))
    q, r = divmod(len(seq), n)
    out, i = [], 0
    for j in range(n):
        size = q + (j < r)
        out.append(list(seq[i:i + size]))
        i += size
    return out


def map_batches(task, items: list, *, item_param: str, common: dict, label: str, batch: int,
                progress: bool = True, workers: int = 1, parts_param: str | None = None,
                taper: bool = False) -> list:
    """Run ``task(**common, item_param=batch_of_items)`` over batches of at most ``batch`` items
    (:func:`split_batches` over ``workers``, tapered at the end with ``taper``); each task returns
    one record per item. Returns the flat list of records in input order.

    ``parts_param``: the task's parameter that splits its items into Dask tasks (each scheduled,
    balanced and rescheduled by Dask on its own). Then consecutive batches go to one Prefect task
    run (:func:`even_parts`, :data:`TASK_RUNS_PER_WORKER` per worker, at least
    :data:`MIN_TASK_RUNS`), which hands them to Dask as its parts: their count, or with ``taper``
    their sizes (:func:`~scanforest.flows.prefect_tasks.in_parts`). The cluster balances the same
    Dask tasks, and Prefect records fewer task runs."""
    if not len(items):  # nothing to run (an ingest whose only source was a corrupt archive)
        return []
    batches = split_batches(list(items), batch, workers, taper=taper)
    if parts_param is None:
        units = [({**common, item_param: b}, len(b)) for b in batches]
    else:
        groups = even_parts(batches, max(MIN_TASK_RUNS, TASK_RUNS_PER_WORKER * workers))
        units = [({**common, item_param: [x for b in g for x in b],
                   parts_param: [len(b) for b in g] if taper else len(g)}, sum(map(len, g)))
                 for g in groups]
    out = map_units(task, [kw for kw, _ in units], label=label, progress=progress, weights=[w for _, w in units])
    return [rec for recs in out for rec in recs]


def map_units(task, kwargs_list: list[dict], *, label: str, progress: bool = True, weights=None) -> list:
    """Submit one Prefect task run per item on the flow's thread-pool task runner (each run
    dispatches its work to Dask) and collect the results in input order, with a progress bar."""
    from prefect.futures import as_completed

    results: list = [None] * len(kwargs_list)
    if not kwargs_list:
        return results
    import time

    weights = weights or [1] * len(kwargs_list)
    futures = {task.submit(**kw): i for i, kw in enumerate(kwargs_list)}
    with _Bar(label, sum(weights), progress) as bar:
        for fut in as_completed(list(futures)):
            res = fut.result()
            now = time.time()
            for r in res if isinstance(res, list) else [res]:
                if isinstance(r, dict):
                    r.setdefault("finished_at", now)
            results[futures[fut]] = res
            bar.advance(weights[futures[fut]])
    return results


class _Bar:
    """A rich progress bar on the terminal (silent when stderr is not a terminal)."""

    def __init__(self, label: str, total: int, enabled: bool):
        import sys

        self.enabled = enabled and sys.stderr.isatty()
        self.total = total
        self.label = label

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

            self._p = Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
            self._p.__enter__()
            self._t = self._p.add_task(self.label, total=self.total)
        return self

    def advance(self, n: int = 1):
        if self.enabled:
            self._p.advance(self._t, n)

    def __exit__(self, *exc):
        if self.enabled:
            self._p.__exit__(*exc)
