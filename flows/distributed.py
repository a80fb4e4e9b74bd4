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

import numpy as np

from scanforest.kernels.errors import InputError
from scanforest.kernels.knn.kdforest import METHODS as KDFOREST_METHODS
from scanforest.tasks import index as idx

from ._runner import dask_client


def _identity(x):
    return x


# a scattered query block that has not reached its workers after this long (plus its size at this
# rate) goes inside a task instead: a worker killed during a scatter leaves it waiting forever
SCATTER_TIMEOUT_S = 3.0
SCATTER_MIN_RATE = 100e6  # bytes/s


def _worker_free_memory(device: str):
    from scanforest.kernels.backend import free_memory

    return free_memory(device)


class DistributedIndex:
    """A persisted sharded index opened on a Dask cluster: shards loaded once, resident on workers.

    ``method`` overrides the persisted search method (``"exact"``: brute force over the same
    resident shards, the baseline of ``scanforest bench match``).
    """

    def __init__(self, client, store_path: str | None = None, name: str | None = None, *, device: str = "auto",
                 method: str | None = None, source=None):
        """``source``: where the shards come from instead of ``(store_path, name)``: an object with
        ``attrs`` (``shards`` row ranges, ``n``, ``d``, ``content_hash``), ``key`` (a name) and
        ``load(shard, device, method)`` returning a :class:`~scanforest.kernels.knn.sharded.Shard`,
        run on the shard's worker (a pure function of its arguments: a lost worker's shard is
        loaded again elsewhere), e.g. the generated reference of ``scanforest bench match``."""
        self.client = client
        if source is None:
            if store_path is None or name is None:
                raise InputError("DistributedIndex needs a store path and an index name (or a source)")
            source = idx.StoredShards(store_path, name)
        self.source = source
        self.store_path = store_path
        self.name = name = source.key
        self.device = device
        self._blocks: dict[int, int] = {}
        self.attrs = dict(source.attrs)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        if not workers:
            raise InputError("the Dask cluster has no workers")
        if method is not None and method not in KDFOREST_METHODS:
            raise InputError(f"method must be one of {KDFOREST_METHODS}, got {method!r}")
        tag = self.attrs["content_hash"][:12] + ("" if method is None else f"-{method}")
        self.shards = []
        self.placement = {}
        for i in range(len(self.attrs["shards"])):
            w = workers[i % len(workers)]
            self.placement[i] = w
            self.shards.append(client.submit(source.load, i, device, method,
                                             key=f"sf-shard-{name}-{tag}-{i}", workers=[w],
                                             allow_other_workers=True, pure=False))

    def wait(self) -> "DistributedIndex":
        """Block until every shard is loaded and resident on its worker (nothing travels)."""
        from distributed import wait

        wait(self.shards)
        for f in self.shards:
            if f.status == "error":
                f.result()  # raises the shard's load error here, with its traceback
        return self

    @property
    def n(self) -> int:
        return int(self.attrs["n"])

    def plan_block(self, k: int, block: int | None = None, *, headroom: float = 0.85, min_block: int = 256) -> int:
        """The largest query block (``block``, default ``MAX_BLOCK`` of the shards' device:
        262,144 on GPUs, 65,536 on CPUs, halved down to ``min_block``) whose working set
        (:func:`scanforest.kernels.knn.sharded.search_working_bytes`) fits the free memory each
        worker has beside its resident shards; workers that share a GPU (or the host) share its
        free memory. Waits for the shards; planned once per ``k``."""
        from scanforest.kernels.knn.sharded import MAX_BLOCK, fit_block

        if k in self._blocks:
            return self._blocks[k]
        self.wait()
        holders = self._holders()
        try:
            free = self.client.run(_worker_free_memory, self.device, workers=holders, on_error="ignore")
        except Exception:  # a worker lost meanwhile: plan for the largest block, the OOM split still guards
            free = {}
        if not free:
            return max(1, int(block or MAX_BLOCK.get(self.device, MAX_BLOCK["cpu"])))
        owners: dict[str, int] = {}
        for _, owner in free.values():
            owners[owner] = owners.get(owner, 0) + 1
        share = min(f / owners[o] for f, o in free.values())
        rows = max(b - a for a, b in self.attrs["shards"])
        d = int(self.attrs["d"])
        dev = "cpu" if set(owners) == {"host"} else "gpu"  # where the shards compute (the tile budget)
        self._blocks[k] = fit_block(rows, d, k, headroom * share, block=block, min_block=min_block, device=dev)
        return self._blocks[k]

    def _holders(self) -> list[str]:
        """The live workers that hold shards (every live worker when none of them is left)."""
        alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
        return sorted(set(self.placement.values()) & alive) or sorted(alive)

    def _put(self, Q: np.ndarray, route):
        """A future of the query block. ``route``, a list shared by the blocks of a query: the
        workers to scatter it to (one copy over the network to each, not client -> scheduler ->
        worker inside a task: a 200k x 352 block is 282 MB, and on one H200 the two hops cost a
        third of a 10M search), copied to each when there are several; empty (or None): inside a
        task. Scattered data is not recomputable, so a worker lost meanwhile can lose it
        (:meth:`query` then sends the blocks again inside tasks); a scatter that fails or stalls
        (a worker killed during it) empties ``route``, and this block and the next go inside
        tasks."""
        c = self.client
        if route:
            try:
                # Client.scatter's own timeout bounds only the wait for workers: a worker killed during
                # the transfer left it waiting forever (test_cluster's worker-kill match, under load),
                # so the whole transfer runs under callback_timeout
                return c.sync(c._scatter, Q, workers=list(route), broadcast=len(route) > 1, hash=False,
                              direct=True, callback_timeout=SCATTER_TIMEOUT_S + Q.nbytes / SCATTER_MIN_RATE)
            except Exception:  # unreachable or lost workers: through the scheduler, inside tasks
                route.clear()
        return c.submit(_identity, Q, pure=False)

    def _reduce(self, parts, k: int):
        c = self.client
        while len(parts) > 1:  # pairwise tree reduction of the per-shard top-k lists
            nxt = [c.submit(idx.merge_parts, parts[j], parts[j + 1], k=k, pure=False)
                   for j in range(0, len(parts) - 1, 2)]
            if len(parts) % 2:
                nxt.append(parts[-1])
            parts = nxt
        return parts[0]

    def query_block(self, Q: np.ndarray, k: int, *, sync_after: int | None = None,
                    backtracks: int | None = None, route=None):
        """Submit one query block to every shard and tree-reduce.

        Returns a future of ``(dist2, ids, stats)``; ``stats``: ``{"leaves": leaves scanned by all
        shards, "seconds": time spent in the searches and merges}``.

        ``sync_after=L`` runs the global bound synchronisation of the paper in two phases: every
        shard first searches with a budget of ``L`` leaves; the per-shard lists are reduced to the
        global top-k, whose k-th distance per query is sent back to every shard as a bound; the
        second phase searches with the full budget, pruning every box not closer than that bound
        (a shard whose own candidates are all worse than another shard's stops early). The two
        phases are merged with duplicates removed. ``None``: one phase, no synchronisation.

        ``backtracks``: every shard's leaf budget for this block (default: the index's own); the
        budget of the second phase when synchronising.

        ``route``: workers to send the block straight to (:meth:`_put`); by default it travels
        inside a task, which Dask can run again if a worker is lost.
        """
        c = self.client
        qf = self._put(np.ascontiguousarray(Q, dtype=np.float32), route)

        def on_shards(**kw):  # each search runs where its shard lives (loose: a lost worker's shard moves)
            return [c.submit(idx.search_shard, s, qf, k, stats=True, workers=[self.placement[i]],
                             allow_other_workers=True, pure=False, **kw) for i, s in enumerate(self.shards)]

        full = {} if backtracks is None else {"backtracks": int(backtracks)}
        if sync_after is None:
            return self._reduce(on_shards(**full), k)
        first = self._reduce(on_shards(backtracks=int(sync_after)), k)
        bound = c.submit(idx.kth_bound, first, pure=False)
        second = self._reduce(on_shards(bounds=bound, **full), k)
        return c.submit(idx.merge_phases, first, second, k=k, pure=False)

    def query(self, Q, k: int, *, block: int | None = None, progress=None, sync_after: int | None = None,
              backtracks: int | None = None, return_stats: bool = False):
        """Global top-``k`` of every row of ``Q``: ``(dist2 (M, k) float32, ids (M, k) int64)``.

        ``block``: queries per block sent to every shard (default: :meth:`plan_block`, at most
        262,144 on GPUs and 65,536 on CPUs, fitted to the workers' free memory).

        ``backtracks``: the leaf budget of every shard for this query (default: the index's own,
        set at build time); a recall/speed trade-off chosen per query, with no rebuild.

        ``sync_after``: see :meth:`query_block`. The statistics (``leaves``: the total number of
        leaves scanned over all shards, the backtracks the synchronisation saves;
        ``compute_seconds``: time inside the shard searches and merges) are in ``self.stats_``,
        and returned as a third element with ``return_stats=True`` (use that when several
        threads query the same index).
        """
        if not 1 <= int(k) <= self.n:
            raise InputError(f"k must be in [1, {self.n}], got {k}")
        if sync_after is not None and (isinstance(sync_after, bool) or int(sync_after) < 1):
            raise InputError(f"sync_after must be a positive number of leaves or None, got {sync_after!r}")
        if backtracks is not None and (isinstance(backtracks, bool) or int(backtracks) < 1):
            raise InputError(f"backtracks must be a positive number of leaves or None, got {backtracks!r}")
        Q = np.asarray(Q, dtype=np.float32)
        if Q.ndim != 2 or Q.shape[1] != int(self.attrs["d"]):
            raise InputError(f"queries must be (M, {self.attrs['d']}), got {Q.shape}")
        if block is None:
            block = self.plan_block(int(k))
        if int(block) < 1:
            raise InputError(f"block must be >= 1, got {block}")
        block = int(block)

        def run(route):  # one failed scatter empties the route: the remaining blocks go inside tasks
            futs = [self.query_block(Q[a:a + block], int(k), sync_after=sync_after, backtracks=backtracks,
                                     route=route) for a in range(0, len(Q), block)]
            return self.client.gather(futs)

        try:  # blocks straight to the workers that hold shards (looked up once a query)
            out = run(self._holders())
        except InputError:
            raise
        except Exception:  # a worker lost with scattered blocks: again, each block inside its tasks
            out = run([])
        stats = {"leaves": int(sum(o[2]["leaves"] for o in out)),
                 "compute_seconds": float(sum(o[2]["seconds"] for o in out)),
                 "queries": int(len(Q)), "sync_after": sync_after, "backtracks": backtracks}
        self.stats_ = stats
        if not out:
            res = np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        else:
            res = np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])
        return res + (stats,) if return_stats else res

    def close(self):
        for f in self.shards:
            f.release()


def match(queries, index, k: int, client=None, **kwargs):
    """Top-``k`` matches of ``queries`` in ``index``.

    ``index`` is a fitted :class:`~scanforest.kernels.knn.kdforest.KDForest` or
    :class:`~scanforest.kernels.knn.sharded.ShardedIndex` (searched in this process), or a
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
