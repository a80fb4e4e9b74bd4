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
from scanforest.tasks.store import ScanStore

from ._runner import dask_client, ensure_prefect_api, map_units, n_workers, record_run
from .distributed import DistributedIndex


# ---------------------------------------------------------------------------------- flows


@flow(name="scanforest-index-build")
def index_build_flow(store: str, reference: list[str], name: str = "default", shards: int = 1,
                     params: dict | None = None, device: str = "cpu") -> dict[str, Any]:
    """Build (or keep, when unchanged) the sharded index ``name`` over the SHOT descriptors of the
    ``reference`` scans."""
    st = ScanStore(store)
    missing = [s for s in reference if not st.has_stage(s, "describe")]
    if missing:
        raise InputError(f"reference scans without descriptors (run `scanforest describe`): {missing[:5]}")
    ref, ref_scan, ref_row = idx.collect_reference(st, reference)
    res = idx.build_index(store, name, ref, shards=shards, params=params or {}, ref_scan=ref_scan,
                          ref_row=ref_row, scans=reference, device=device)
    record_run(st, "index-build", {"name": name, "shards": shards, **(params or {})}, res, [])
    return res


def _match_scan(di: DistributedIndex, store: str, scan_id: str, k: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    st = ScanStore(store)
    tag = di.attrs["content_hash"]
    if st.has_stage(scan_id, "match", index=di.name, content_hash=tag, k=k):
        return {"scan_id": scan_id, "status": "skipped", "seconds": time.perf_counter() - t0}
    Q = st.read(scan_id, "kp_shot")
    ok = np.isfinite(Q).all(axis=1)
    dist = np.full((len(Q), k), np.inf, np.float32)
    ids = np.full((len(Q), k), -1, np.int64)
    if ok.any():
        d, i = di.query(Q[ok], k)
        dist[ok], ids[ok] = d, i
    st.write_stage(scan_id, "match", {"match_ids": ids, "match_dist": dist},
                   {"index": di.name, "content_hash": tag, "k": k, "queries": int(ok.sum())})
    return {"scan_id": scan_id, "status": "matched", "queries": int(ok.sum()), "seconds": time.perf_counter() - t0}


@flow(name="scanforest-match", task_runner=ThreadPoolTaskRunner(max_workers=8))
def match_flow(store: str, queries: list[str] | None = None, k: int = 4, name: str = "default",
               device: str = "auto", scheduler: str | None = None, workers: int | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Match every query scan's SHOT descriptors against index ``name``; writes (M, k) ``match_ids``
    (int64, global reference rows) and ``match_dist`` (float32, squared) into each scan."""
    from prefect import task

    t0 = time.perf_counter()
    st = ScanStore(store)
    attrs = idx.index_attrs(store, name)
    ids = queries or [s for s in st.scans() if s not in set(attrs.get("scans", [])) and st.has_stage(s, "describe")]
    with dask_client(scheduler, n_workers=workers, device=device) as client:
        di = DistributedIndex(client, store, name, device=device)

        @task(name="match-scan", retries=2, retry_delay_seconds=[2, 10], task_run_name="match {scan_id}")
        def match_scan(scan_id: str) -> dict[str, Any]:
            return _match_scan(di, store, scan_id, k)

        recs = map_units(match_scan, [dict(scan_id=s) for s in ids], label="match", progress=progress)
        summary = {"scans": len(ids), "matched": sum(r["status"] == "matched" for r in recs),
                   "queries": int(sum(r.get("queries", 0) for r in recs)), "k": k,
                   "shards": len(attrs["shards"]), "workers": n_workers(client),
                   "seconds": time.perf_counter() - t0}
        di.close()
    record_run(st, "match", {"name": name, "k": k, "device": device}, summary, recs)
    return summary


def run_index_build(store, reference, **kw):
    ensure_prefect_api()
    return index_build_flow(store=str(store), reference=list(reference), **kw)


def run_match(store, **kw):
    ensure_prefect_api()
    return match_flow(store=str(store), **kw)
