"""The align flow: parametric chamfer alignment for a batch of (observed, reference) scan pairs."""
from __future__ import annotations

import time
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from .batching import map_units
from .cluster import check_scheduler, dask_client, n_workers
from .inputs import absolute_path, check_align
from .prefect_api import ensure_prefect_api
from .prefect_tasks import align_pair_task
from .records import RUN_HOOKS, failures, record_run


@flow(name="scanforest-align", task_runner=ThreadPoolTaskRunner(max_workers=32), **RUN_HOOKS)
def align_flow(store: str, pairs: list[list[str]], model: str = "rigid", chain: bool = False, loss: str = "l2",
               outside: str = "clamp", max_iter: int = 100, device: str = "auto", scheduler: str | None = None,
               workers: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Align every ``[observed, reference]`` scan pair; results go into the observed scans."""
    t0 = time.perf_counter()
    store = absolute_path(store)
    st = check_align(store, pairs)
    opts = {"model": model, "chain": chain, "loss": loss, "outside": outside, "max_iter": max_iter, "device": device}
    with dask_client(scheduler, n_workers=workers, device=device) as client:
        recs = map_units(align_pair_task, [dict(store=store, observed=o, reference=r, options=opts) for o, r in pairs],
                         label="align", progress=progress)
        nw = n_workers(client)
    summary = {"pairs": len(pairs), "aligned": sum(r["status"] not in ("skipped", "failed") for r in recs),
               "converged": sum(r["status"] == "converged" for r in recs),
               "failed": sum(r["status"] == "failed" for r in recs), "failures": failures(recs), "workers": nw,
               "seconds": time.perf_counter() - t0}
    record_run(st, "align", opts, summary, recs)
    summary["results"] = recs
    return summary


def run_align(store, pairs, **kw):
    store = absolute_path(store)
    check_align(store, [list(p) for p in pairs])
    check_scheduler(kw.get("scheduler"))
    ensure_prefect_api()
    return align_flow(store=store, pairs=[list(p) for p in pairs], **kw)
