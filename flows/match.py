"""Distributed matching: shards resident on Dask workers, queries in blocks to every shard,
per-shard top-P merged by a tree reduction into the global top-P.

- Each shard is loaded once by a task pinned to one worker (``load_shard``: rows + persisted
  tree from the store, on that worker's GPU when it has one) and stays resident there as a
  Dask future; query blocks are sent to it, never the shard to the queries.
- A worker that dies loses its shards and the partial results it held; Dask recomputes them on
  surviving workers from the store (the tasks are pure functions of the store), so the run
  completes with the identical answer.
- A shard search that runs out of GPU memory splits its query block and retries
  (:func:`scanforest.tasks.index.search_shard`).
"""
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


def _identity(x):
    return x


class DistributedIndex:
    """A persisted sharded index opened on a Dask cluster: shards loaded once, resident on workers."""

    def __init__(self, client, store_path: str, name: str, *, device: str = "auto"):
        self.client = client
        self.store_path = store_path
        self.name = name
        self.attrs = idx.index_attrs(store_path, name)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        if not workers:
            raise InputError("the Dask cluster has no workers")
        tag = self.attrs["content_hash"][:12]
        self.shards = []
        for i in range(len(self.attrs["shards"])):
            w = workers[i % len(workers)]
            self.shards.append(client.submit(idx.load_shard, store_path, name, i, device,
                                             key=f"sf-shard-{name}-{tag}-{i}", workers=[w],
                                             allow_other_workers=True, pure=False))
        self.placement = {i: workers[i % len(workers)] for i in range(len(self.shards))}

    @property
    def n(self) -> int:
        return int(self.attrs["n"])

    def query_block(self, Q: np.ndarray, k: int):
        """Submit one query block to every shard and tree-reduce; returns a future of (dist, ids)."""
        c = self.client
        qf = c.submit(_identity, np.ascontiguousarray(Q, dtype=np.float32), pure=False)
        parts = [c.submit(idx.search_shard, s, qf, k, pure=False) for s in self.shards]
        while len(parts) > 1:  # pairwise tree reduction of the per-shard top-k lists
            nxt = [c.submit(idx.merge_parts, parts[j], parts[j + 1], k=k, pure=False)
                   for j in range(0, len(parts) - 1, 2)]
            if len(parts) % 2:
                nxt.append(parts[-1])
            parts = nxt
        return parts[0]

    def query(self, Q, k: int, *, block: int = 65_536, progress=None):
        if not 1 <= int(k) <= self.n:
            raise InputError(f"k must be in [1, {self.n}], got {k}")
        Q = np.asarray(Q, dtype=np.float32)
        if Q.ndim != 2 or Q.shape[1] != int(self.attrs["d"]):
            raise InputError(f"queries must be (M, {self.attrs['d']}), got {Q.shape}")
        futs = [self.query_block(Q[a:a + block], int(k)) for a in range(0, len(Q), block)]
        out = self.client.gather(futs)
        if not out:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])

    def close(self):
        for f in self.shards:
            f.release()


def match(queries, index, k: int, client=None, **kwargs):
    """Top-``k`` matches of ``queries`` in ``index``.

    ``index`` is a fitted :class:`~scanforest.kernels.kdforest.KDForest` or
    :class:`~scanforest.kernels.sharded.ShardedIndex` (searched in this process), or a
    ``(store_path, index_name)`` pair of a persisted index, searched on ``client``'s cluster
    with shards resident on its workers (a local cluster is started when ``client`` is None).
    Returns ``(dist2 (M, k) float32, ids (M, k) int64)``.
    """
    if isinstance(index, tuple):
        store_path, name = index
        if client is None:
            with dask_client(None) as c:
                di = DistributedIndex(c, store_path, name, **kwargs)
                return di.query(queries, k)
        di = DistributedIndex(client, store_path, name, **kwargs)
        try:
            return di.query(queries, k)
        finally:
            di.close()
    return index.query(queries, k)


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
