"""Prefect flows for indexes and matching (the distributed search itself is in
:mod:`scanforest.flows.distributed`, which needs no Prefect)."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from scanforest.kernels.errors import InputError
from scanforest.tasks import index as idx
from scanforest.tasks.store import ScanStore, stage_digest

from .batching import auto_batch, map_batches
from .cluster import check_scheduler, dask_client, n_workers
from .distributed import DistributedIndex
from .inputs import absolute_path, check_index_build, check_match, library_index_for_match
from .noop import match_noop
from .prefect_api import ensure_prefect_api
from .prefect_tasks import current_run, run_label
from .records import RUN_HOOKS, record_run


# ---------------------------------------------------------------------------------- flows


@flow(name="scanforest-index-build", **RUN_HOOKS)
def index_build_flow(store: str, reference: list[str] | None = None, name: str = "default", shards: int | str = 1,
                     params: dict | None = None, device: str = "cpu", k: int = 4,
                     dtype: str = "float32", library: str | None = None) -> dict[str, Any]:
    """Build (or keep, when unchanged) the sharded index ``name`` over the SHOT descriptors of the
    ``reference`` scans, or over the model library ``library`` of the store (its reference rows,
    in order: what the recognize stage matches against, so it uses this index's matches instead
    of matching again), stored as ``dtype`` (float32, or float16 for half the disk).
    ``shards="auto"``: one per local GPU (one on the CPU), checked against the devices' memory
    with :func:`scanforest.kernels.knn.sharded.plan_shards` (an index that cannot fit is refused
    before anything is written)."""
    store = absolute_path(store)
    st = check_index_build(store, reference, shards, params, dtype, library=library, name=name)
    source = None
    if library is not None:
        ref, ref_scan, ref_row, scans, source = idx.collect_library_reference(st, library)
    else:
        missing = [s for s in reference if not st.has_stage(s, "describe")]
        if missing:
            raise InputError(f"reference scans without descriptors (run `scanforest describe`): {missing[:5]}")
        ref, ref_scan, ref_row = idx.collect_reference(st, reference)
        scans = list(reference)
    plan = None
    if shards == "auto":
        plan = idx.plan_for(ref.shape[0], ref.shape[1], params or {}, device, k=k, dtype=dtype)
        shards = plan.shards
    res = idx.build_index(store, name, ref, shards=int(shards), params=params or {}, ref_scan=ref_scan,
                          ref_row=ref_row, scans=scans, device=device, dtype=dtype, library=source)
    if plan is not None:
        res["plan"] = plan.describe()
    if source is not None:
        res["library"] = source["name"]
    record_run(st, "index-build", {"name": name, "shards": shards, **({"library": library} if library else {}),
                                   **(params or {})}, res, [])
    return res


def _match_batch(di: DistributedIndex, store: str, scan_ids: list[str], k: int) -> list[dict[str, Any]]:
    """Match a batch of scans with ONE distributed query (their descriptors stacked, read from the
    store by the workers that search them: :class:`~scanforest.tasks.index.StoredQueries`), so a
    batch pays one round of Dask tasks instead of one per scan; each scan's results are written
    on their own and skipped when already there. Each record's ``seconds`` is the time inside
    store I/O and (its share by rows of) the shard searches and merges: the busy time the
    archive bench's overhead figure is computed from.

    A scan whose match claim another run holds (:meth:`ScanStore.claim_stage`) is left to it
    (``held``); this batch holds its own scans' claims from the check to the writes."""
    from contextlib import ExitStack

    from scanforest.tasks.units import held

    with ExitStack() as claims:
        return _match_claimed(di, ScanStore(store), scan_ids, k, claims, held, current_run())


def _match_claimed(di, st, scan_ids, k, claims, held, run) -> list[dict[str, Any]]:
    tag = di.attrs["content_hash"]
    recs: dict[str, dict[str, Any]] = {}
    todo = []
    for sid in scan_ids:
        t0 = time.perf_counter()
        # the describe record the matches belong to: a scan described again is matched again
        drec = st.stage(sid, "describe")
        described = stage_digest(drec)
        done = {"index": di.name, "content_hash": tag, "k": k, "describe": described}
        if st.has_stage(sid, "match", **done):
            recs[sid] = {"scan_id": sid, "status": "skipped", "seconds": time.perf_counter() - t0}
            continue
        if not claims.enter_context(st.claim_stage(sid, "match")):
            recs[sid] = held(sid, t0)
            continue
        if st.has_stage(sid, "match", **done):  # finished by another run between the two looks
            recs[sid] = {"scan_id": sid, "status": "skipped", "seconds": time.perf_counter() - t0}
            continue
        todo.append((sid, described, drec, time.perf_counter() - t0))
    if todo:
        # the workers read the descriptors from the store (no descriptor through this process);
        # a keypoint without one answers (inf, -1), as written before
        src = idx.StoredQueries.of(st, [t[0] for t in todo], records=[t[2] for t in todo])
        d_all = np.zeros((0, k), np.float32)
        i_all = np.zeros((0, k), np.int64)
        compute = 0.0
        if src.shape[0]:
            d_all, i_all, stats = di.query(src, k, return_stats=True)
            compute = stats["compute_seconds"]
        valid = i_all[:, 0] >= 0 if len(i_all) else np.zeros(0, bool)
        n_rows = max(1, int(valid.sum()))
        a = 0
        for (sid, described, _, t_check), m in zip(todo, src.rows):
            t0 = time.perf_counter()
            ids, dist = i_all[a:a + m], d_all[a:a + m]
            n = int(valid[a:a + m].sum())
            a += m
            st.write_stage(sid, "match", {"match_ids": ids, "match_dist": dist},
                           {"index": di.name, "content_hash": tag, "k": k, "queries": n, "describe": described,
                            **({"run": run} if run else {})})
            recs[sid] = {"scan_id": sid, "status": "matched", "queries": n,
                         "seconds": t_check + time.perf_counter() - t0 + compute * n / n_rows}
    return [recs[s] for s in scan_ids]


#: concurrent match tasks (Prefect threads): each holds one batch query in flight (its descriptors
#: read by the workers) and writes its scans' matches in the flow process, so the writes overlap
#: the shard searches
MATCH_LANES = 8


@flow(name="scanforest-match", task_runner=ThreadPoolTaskRunner(max_workers=MATCH_LANES), **RUN_HOOKS)
def match_flow(store: str, queries: list[str] | None = None, k: int = 4, name: str = "default",
               device: str = "auto", scheduler: str | None = None, workers: int | None = None,
               batch: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Match every query scan's SHOT descriptors against index ``name``; writes (M, k) ``match_ids``
    (int64, global reference rows) and ``match_dist`` (float32, squared) into each scan.

    Scans go in batches (``batch`` scans per task and per distributed query; default: chosen
    from the number of scans so that each of the concurrent tasks gets several batches)."""
    from prefect import task

    t0 = time.perf_counter()
    store = absolute_path(store)
    st, attrs = check_match(store, queries, k, name)
    quick = match_noop(store, queries, k, name)
    if quick is not None:  # nothing to do: no cluster, and the run is counted, not stored (record_run)
        record_run(st, "match", {"name": name, "k": k, "device": device, "batch": 0}, quick, [])
        return quick
    ids = (list(queries) if queries is not None else
           [s for s in st.scans() if s not in set(attrs.get("scans", [])) and st.has_stage(s, "describe")])
    with dask_client(scheduler, n_workers=workers, device=device) as client:
        di = DistributedIndex(client, store, name, device=device)
        placement = di.describe()

        @task(name="match", retries=2, retry_delay_seconds=[2, 10],
              task_run_name=lambda: "match " + run_label("scan_ids"))
        def match_batch(scan_ids: list[str]) -> list[dict[str, Any]]:
            return _match_batch(di, store, scan_ids, k)

        nb = batch or auto_batch(len(ids), MATCH_LANES)
        t1 = time.perf_counter()
        recs = map_batches(match_batch, ids, item_param="scan_ids", common={}, label="match", batch=nb,
                           progress=progress)
        t_scans = time.perf_counter() - t1
        summary = {"scans": len(ids), "matched": sum(r["status"] == "matched" for r in recs),
                   "held": sum(r["status"] == "held" for r in recs),
                   "queries": int(sum(r.get("queries", 0) for r in recs)), "k": k,
                   "shards": len(attrs["shards"]), "workers": n_workers(client), "batch": nb,
                   # the workers that hold shards: the ones the stage's compute can use
                   "lanes": len(set(di.placement.values())),
                   # where the index lives, and the memory plan behind it (figures and reason)
                   "placement": f"{placement['mode']}: {placement['shards']} shard(s) x {placement['replicas']} "
                                f"replica(s)",
                   "plan": placement.get("plan", ""),
                   "scans_seconds": t_scans, "task_seconds": float(sum(r["seconds"] for r in recs)),
                   "seconds": time.perf_counter() - t0}
        di.close()
    record_run(st, "match", {"name": name, "k": k, "device": device, "batch": nb}, summary, recs)
    return summary


def run_index_build(store, reference=None, **kw):
    store = absolute_path(store)
    reference = None if reference is None else list(reference)
    check_index_build(store, reference, kw.get("shards", 1), kw.get("params"), kw.get("dtype", "float32"),
                      library=kw.get("library"), name=kw.get("name", "default"))
    ensure_prefect_api()
    return index_build_flow(store=store, reference=reference, **kw)


def run_match(store, library: str | None = None, **kw):
    """The match flow; ``library``: against the index over that model library (its name resolved
    here, ``name`` ignored), recorded in the summary."""
    store = absolute_path(store)
    if library is not None:
        kw["name"] = library_index_for_match(store, library)
    check_match(store, kw.get("queries"), kw.get("k", 4), kw.get("name", "default"))
    check_scheduler(kw.get("scheduler"))
    ensure_prefect_api()
    res = match_flow(store=store, **kw)
    if library is not None:
        res = {"library": library, "index": kw["name"], **res}
    return res
