"""Distributed matching: shards resident on Dask workers, replicated where memory allows, query
blocks split between the replicas, per-shard top-P merged by a tree reduction into the global top-P.

- Each shard is loaded once per copy by a task pinned to one worker (``load_shard``: rows +
  persisted tree from the store, on that worker's GPU when it has one) and stays resident there
  as a Dask future; query blocks are sent to it, never the shard to the queries.
- An index with ``S`` shards on ``G`` devices (GPUs; on the host, worker processes) is held in
  ``R = G // S`` copies (replica groups, one device per shard). A query block goes to ONE group,
  so the work per query is one search per shard whatever the device count, and every device
  added takes its share of the blocks (FAISS's replicas, and its shards of replicas).
- A worker that dies loses its shards and the partial results it held; Dask recomputes them on
  surviving workers from the store (the tasks are pure functions of the store), so the run
  completes with the identical answer: every copy of a shard is the same forest.
- A shard search that runs out of GPU memory splits its query block and retries
  (:func:`scanforest.tasks.index.search_shard`).
"""
from __future__ import annotations

import itertools
import os

import numpy as np

from scanforest.kernels.errors import InputError
from scanforest.kernels.knn.kdforest import METHODS as KDFOREST_METHODS
from scanforest.tasks import index as idx

from .cluster import dask_client


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
    """A persisted sharded index opened on a Dask cluster: shards loaded once, resident on workers,
    every shard in ``replicas`` copies (one replica group per ``S`` devices).

    ``method`` overrides the persisted search method (``"exact"``: brute force over the same
    resident shards, the baseline of ``scanforest bench match``). ``replicas``: copies of the
    index (default: as many as the workers' devices hold, :meth:`_devices`; 1: every block to
    every worker's shards, as before replication).
    """

    #: a replica group's first query block: at least this share of a ``GOOD_BLOCK``, and this part
    #: of the group's queries; each next block this many times the one before (:meth:`split`)
    ramp = (0.5, 8, 2.0)

    def __init__(self, client, store_path: str | None = None, name: str | None = None, *, device: str = "auto",
                 method: str | None = None, source=None, replicas: int | None = None):
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
        self.method = method
        self._blocks: dict[int, int] = {}
        self._turn = itertools.count()  # the replica group of the next query block
        self.attrs = dict(source.attrs)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        if not workers:
            raise InputError("the Dask cluster has no workers")
        if method is not None and method not in KDFOREST_METHODS:
            raise InputError(f"method must be one of {KDFOREST_METHODS}, got {method!r}")
        if replicas is not None and (isinstance(replicas, bool) or int(replicas) < 1):
            raise InputError(f"replicas must be a positive number of copies or None, got {replicas!r}")
        tag = self.attrs["content_hash"][:12] + ("" if method is None else f"-{method}")
        n_shards = len(self.attrs["shards"])
        devices = self._device_list = self._devices(workers)
        self.replicas = int(replicas) if replicas is not None else self._fitting_copies(devices, n_shards, method)
        self.shards = []            # every copy of every shard, group after group (index r * S + i)
        self.groups = []            # groups[r][i]: copy r of shard i
        self.placement = {}         # index in ``shards`` -> its worker
        held = {tuple(d): 0 for d in devices}
        for r in range(self.replicas):
            group = []
            for i in range(n_shards):
                j = r * n_shards + i
                dev_workers = devices[j % len(devices)]  # copies of a shard on different devices
                w = dev_workers[held[tuple(dev_workers)] % len(dev_workers)]  # a device's shards spread over its workers
                held[tuple(dev_workers)] += 1
                self.placement[j] = w
                f = client.submit(source.load, i, device, method, key=f"sf-shard-{name}-{tag}-{i}-r{r}",
                                  workers=[w], allow_other_workers=True, pure=False)
                self.shards.append(f)
                group.append(f)
            self.groups.append(group)

    def _devices(self, workers: list[str]) -> list[list[str]]:
        """The workers grouped by the device their shards would live on: one list per GPU (the
        workers that share it), one per host worker process (each holds its own copy). A copy of
        a shard per device at most: two on one GPU would share its compute and halve its memory."""
        try:
            info = self.client.run(_worker_free_memory, self.device, workers=workers, on_error="ignore")
        except Exception:  # a worker lost meanwhile: one device per worker
            info = {}
        self._free = {w: int(v[0]) for w, v in info.items()}
        self._dev = "cpu" if all(v[1] == "host" for v in info.values()) else "gpu"  # where shards compute
        by_owner: dict[str, list[str]] = {}
        for w in workers:
            owner = info[w][1] if w in info else w
            by_owner.setdefault(w if owner == "host" else owner, []).append(w)
        return [by_owner[o] for o in sorted(by_owner, key=lambda o: by_owner[o][0])]

    def _fitting_copies(self, devices: list[list[str]], n_shards: int, method: str | None) -> int:
        """Copies of the index the devices hold: one per ``n_shards`` devices, fewer where host
        worker processes, which share the host's memory, cannot all hold one beside a query block
        (:meth:`_plan` on the host's memory split between the copies)."""
        copies = max(1, len(devices) // n_shards)
        host = [d[0] for d in devices if len(d) == 1 and d[0] in self._free]
        if copies > 1 and host and self.device != "gpu":
            free = min(self._free[w] for w in host)  # every host worker reports the same machine's memory
            while copies > 1 and not self._plan([free // (copies * n_shards)] * (copies * n_shards), n_shards, method).fits:
                copies -= 1
        return copies

    def _plan(self, memory: list[int], n_shards: int, method: str | None = None):
        """:func:`plan_shards` of this index's ``n_shards`` shards on workers of ``memory``."""
        from scanforest.kernels.knn.sharded import plan_shards

        a, p = self.attrs, self.attrs.get("params") or {}
        return plan_shards(int(a["n"]), int(a["d"]), memory, shards=n_shards, n_trees=int(p.get("n_trees") or 1),
                           leaf_size=int(p.get("leaf_size") or 64), method=method or p.get("method") or "banns",
                           device=self._dev,
                           row_bytes=idx.resident_row_bytes(str(a.get("dtype", "float32")), self._dev))

    def describe(self) -> dict:
        """Where the index lives: shards, replicas, the workers of each copy, and the memory plan
        of that placement on the devices' free memory (:func:`plan_shards`: figures and reason)."""
        from scanforest.kernels.knn.sharded import placement_mode

        s = len(self.groups[0]) if self.groups else 0
        out = {"shards": s, "replicas": self.replicas, "mode": placement_mode(s, self.replicas),
               "workers": [[self.placement[r * s + i] for i in range(s)] for r in range(self.replicas)]}
        free = [max(self._free.get(w, 0) for w in dev) for dev in self._device_list] if self._free else []
        if free and min(free) > 0:
            plan = self._plan(free, s, self.method)
            out["plan"] = plan.describe()  # the planner's view of these devices (``replicas``: what was placed)
            out["resident_bytes"] = plan.resident_bytes
        return out

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

    def split(self, m: int, block: int, *, ramp: bool = True) -> list[tuple[int, int]]:
        """``m`` queries as ``[a, b)`` blocks of at most ``block``, in waves of one block per
        replica group (block ``j`` goes to group ``j mod R``), every group the same share.

        A group's share goes in blocks that double from a small first one (an eighth of the
        share, at least half a ``GOOD_BLOCK``) up to ``block``: every device starts as soon as
        its first, small block has arrived, and each next block travels while the one before
        is searched. All the queries leave one client, so with R groups the first wave is what
        every device waits for. ``ramp=False`` (queries the workers read themselves): equal
        blocks of at most ``block`` from the start."""
        from scanforest.kernels.knn.sharded import GOOD_BLOCK

        if m == 0:
            return []
        r = min(self.replicas, m)
        share = -(-m // r)
        least, part, growth = self.ramp if ramp else (0, 1, 1.0)
        if ramp:
            b = max(1, min(block, max(int(GOOD_BLOCK[self._dev] * least), -(-share // part))))
        else:  # equal blocks: the share in as few as ``block`` allows
            b = -(-share // -(-share // block))
        sizes = []
        left = share
        while left > 0:
            x = min(b, left)
            sizes.append(x)
            left -= x
            b = min(int(growth * b), block)
        if len(sizes) > 1 and sizes[-1] < sizes[0] // 2:  # a small tail joins the block before it
            sizes[-2:] = [sizes[-2] + sizes[-1]] if sizes[-2] + sizes[-1] <= block else sizes[-2:]
        spans, a = [], 0
        for size in sizes:  # wave by wave: the groups' blocks of one size side by side
            for _ in range(r):
                if a < m:
                    spans.append((a, min(m, a + size)))
                    a += size
        return spans

    def _holders(self) -> list[str]:
        """The live workers that hold shards (every live worker when none of them is left)."""
        alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
        return sorted(set(self.placement.values()) & alive) or sorted(alive)

    def _put_wave(self, blocks: list[np.ndarray], routes: list[list[str]], ok: list[bool]):
        """Futures of query blocks, each sent straight to the workers in its route (one copy over
        the network to each, not client -> scheduler -> worker inside a task: a 200k x 352 block
        is 282 MB, and on one H200 the two hops cost a third of a 10M search), the blocks of a
        wave (one per replica group) all at once. ``ok``, a one-item flag shared by the blocks of
        a query: cleared by a scatter that fails or stalls (a worker killed during it), after
        which blocks go inside tasks, which Dask can run again. Scattered data is not
        recomputable, so a worker lost meanwhile can lose it (:meth:`query` then sends every
        block again inside tasks)."""
        c = self.client
        if ok[0] and all(routes):
            nbytes = sum(q.nbytes for q in blocks)
            try:
                # Client.scatter's own timeout bounds only the wait for workers: a worker killed during
                # the transfer left it waiting forever (test_cluster's worker-kill match, under load),
                # so the whole transfer runs under callback_timeout
                return c.sync(_scatter_all, c, blocks, routes,
                              callback_timeout=SCATTER_TIMEOUT_S + nbytes / SCATTER_MIN_RATE)
            except Exception:  # unreachable or lost workers: through the scheduler, inside tasks
                ok[0] = False
        return [c.submit(_identity, q, pure=False) for q in blocks]

    def _reduce(self, parts, k: int):
        c = self.client
        while len(parts) > 1:  # pairwise tree reduction of the per-shard top-k lists
            nxt = [c.submit(idx.merge_parts, parts[j], parts[j + 1], k=k, pure=False)
                   for j in range(0, len(parts) - 1, 2)]
            if len(parts) % 2:
                nxt.append(parts[-1])
            parts = nxt
        return parts[0]

    def _group_workers(self, group: int) -> list[str]:
        s = len(self.groups[group])
        return sorted({self.placement[group * s + i] for i in range(s)})

    def query_block(self, Q, k: int, *, sync_after: int | None = None, backtracks: int | None = None,
                    group: int | None = None):
        """Submit one query block to every shard of one replica group and tree-reduce.

        ``Q``: the block (an array, sent inside a task), a future of it (:meth:`_put_wave`), or
        ``(QueryFile, a, b)``: rows ``[a, b)`` of a query file, read by each shard's worker.
        ``group``: the replica group (default: the next in turn). Returns a future of
        ``(dist2, ids, stats)``; ``stats``: ``{"leaves": leaves scanned by all shards, "seconds":
        time spent in the searches and merges}``.

        ``sync_after=L`` runs the global bound synchronisation of the paper in two phases: every
        shard first searches with a budget of ``L`` leaves; the per-shard lists are reduced to the
        global top-k, whose k-th distance per query is sent back to every shard as a bound; the
        second phase searches with the full budget, pruning every box not closer than that bound
        (a shard whose own candidates are all worse than another shard's stops early). The two
        phases are merged with duplicates removed. ``None``: one phase, no synchronisation.

        ``backtracks``: every shard's leaf budget for this block (default: the index's own); the
        budget of the second phase when synchronising.
        """
        c = self.client
        g = next(self._turn) % self.replicas if group is None else int(group) % self.replicas
        s = len(self.groups[g])
        if isinstance(Q, tuple):  # (QueryFile, a, b): each shard's worker reads the block itself
            src, a, b = Q
            qf = [c.submit(src.read, a, b, workers=[self.placement[g * s + i]],
                           allow_other_workers=True, pure=False) for i in range(s)]
        else:
            one = Q if hasattr(Q, "key") else c.submit(_identity, np.ascontiguousarray(Q, dtype=np.float32),
                                                       pure=False)
            qf = [one] * s

        read = isinstance(Q, tuple)  # rows read from a source may hold keypoints without a descriptor

        def on_shards(**kw):  # each search runs where its shard lives (loose: a lost worker's shard moves)
            return [c.submit(idx.search_shard, f, qf[i], k, stats=True, skip_invalid=read,
                             workers=[self.placement[g * s + i]], allow_other_workers=True, pure=False, **kw)
                    for i, f in enumerate(self.groups[g])]

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

        ``block``: the largest query block (default: :meth:`plan_block`, at most 262,144 on GPUs
        and 65,536 on CPUs, fitted to the workers' free memory). The queries go in equal blocks,
        as many for every replica group (:meth:`split`), a wave of one block per group at a time.

        ``Q``: an ``(M, d)`` array (its blocks leave this client), or a
        :class:`~scanforest.tasks.index.QueryFile` or
        :class:`~scanforest.tasks.index.StoredQueries` whose blocks the workers read themselves
        (the way past the client's one connection on several GPUs; their rows that are not all
        finite answer ``(inf, -1)``).

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
        src = Q if isinstance(Q, (idx.QueryFile, idx.StoredQueries)) else None
        if src is None:
            Q = np.asarray(Q, dtype=np.float32)
        shape = tuple(Q.shape)  # a query file's header, read once
        if len(shape) != 2 or shape[1] != int(self.attrs["d"]):
            raise InputError(f"queries{'' if src is None else ' in ' + src.path} must be (M, {self.attrs['d']}), "
                             f"got {shape}")
        if block is not None and int(block) < 1:
            raise InputError(f"block must be >= 1, got {block}")
        block = self.plan_block(int(k)) if block is None else int(block)
        spans = self.split(shape[0], block, ramp=src is None)
        r = self.replicas
        first = next(self._turn)  # concurrent queries (the match flow's lanes) start on different groups
        groups = [(first + j) % r for j in range(len(spans))]

        def run(direct: bool):  # one failed scatter clears ``ok``: the remaining blocks go inside tasks
            ok = [direct]
            futs = []
            if src is not None:  # the workers read their blocks: nothing to send (a lost read is redone)
                futs = [self.query_block((src, a, b), int(k), sync_after=sync_after, backtracks=backtracks, group=g)
                        for (a, b), g in zip(spans, groups)]
                return self._collect(futs, spans, shape[0], int(k))
            alive = set(self._holders()) if direct else set()  # looked up once a query
            for w in range(0, len(spans), r):  # a wave: one block per replica group
                blocks = [np.ascontiguousarray(Q[a:b]) for a, b in spans[w:w + r]]
                gs = groups[w:w + r]
                routes = [[x for x in self._group_workers(g) if x in alive] for g in gs]
                for qf, g in zip(self._put_wave(blocks, routes, ok), gs):
                    futs.append(self.query_block(qf, int(k), sync_after=sync_after, backtracks=backtracks, group=g))
            return self._collect(futs, spans, shape[0], int(k))

        try:  # blocks straight to the workers of their replica group
            dist, ids, parts = run(True)
        except InputError:
            raise
        except Exception:  # a worker lost with scattered blocks: again, each block inside its tasks
            dist, ids, parts = run(False)
        stats = {"leaves": int(sum(p["leaves"] for p in parts)),
                 "compute_seconds": float(sum(p["seconds"] for p in parts)),
                 "queries": shape[0], "sync_after": sync_after, "backtracks": backtracks,
                 "blocks": len(spans), "replicas": r}
        self.stats_ = stats
        return (dist, ids, stats) if return_stats else (dist, ids)

    def _collect(self, futs, spans, m: int, k: int):
        """The blocks' answers written into one ``(m, k)`` pair as each block finishes, instead of
        one gather after the last: a block's answers travel and are copied while the others are
        searched (10M rows on four H200s, 8M queries: 384 MB of answers, otherwise all moved after
        the last search). Returns ``(dist2, ids, [stats of each block])``."""
        from distributed import as_completed

        dist, ids = (np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)) if not futs else (None, None)
        where = {f.key: span for f, span in zip(futs, spans)}
        parts = []
        for fut, (d, i, st) in as_completed(futs, with_results=True):
            if dist is None:  # the shards' own dtypes
                dist, ids = np.empty((m, k), d.dtype), np.empty((m, k), i.dtype)
            a, b = where[fut.key]
            dist[a:b], ids[a:b] = d, i
            parts.append(st)
            fut.release()
        return dist, ids, parts

    def close(self):
        for f in self.shards:
            f.release()


async def _scatter_all(client, blocks, routes):
    """Scatter every block to its route's workers at once (one Dask future each)."""
    import asyncio

    return list(await asyncio.gather(*(client._scatter(q, workers=list(rt), broadcast=len(rt) > 1, hash=False,
                                                       direct=True) for q, rt in zip(blocks, routes))))


def match(queries, index, k: int, client=None, **kwargs):
    """Top-``k`` matches of ``queries`` in ``index``.

    ``index`` is a fitted :class:`~scanforest.kernels.knn.kdforest.KDForest` or
    :class:`~scanforest.kernels.knn.sharded.ShardedIndex` (searched in this process), or a
    ``(store_path, index_name)`` pair of a persisted index, searched on ``client``'s cluster
    with shards resident on its workers (a local cluster is started when ``client`` is None).
    ``kwargs``: the search's options for an index object (``recall=``, ``backtracks=``, ...: its
    ``query``'s), the :class:`DistributedIndex`'s for a stored one (``device=``, ``method=``,
    ``replicas=``); one the index does not take is an :class:`InputError` (it was dropped).
    Returns ``(dist2 (M, k) float32, ids (M, k) int64)``.
    """
    import inspect

    from scanforest.kernels.errors import InputError

    if isinstance(index, (tuple, list)):
        if len(index) != 2 or not all(isinstance(x, (str, os.PathLike)) for x in index):
            raise InputError(f"a stored index is given as (store_path, index_name), got {index!r}")
        bad = sorted(set(kwargs) - {"device", "method", "replicas"})
        if bad:
            raise InputError(f"match of a stored index takes device=, method=, replicas=; not {', '.join(bad)}")
        store_path, name = (str(x) for x in index)
        if client is None:
            with dask_client(None) as c:
                di = DistributedIndex(c, store_path, name, **kwargs)
                return di.query(queries, k)
        di = DistributedIndex(client, store_path, name, **kwargs)
        try:
            return di.query(queries, k)
        finally:
            di.close()
    if not callable(getattr(index, "query", None)):
        raise InputError(f"index must be a fitted KDForest or ShardedIndex, or a (store_path, index_name) pair; "
                         f"got {type(index).__name__}")
    params = inspect.signature(index.query).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        bad = sorted(set(kwargs) - set(params))
        if bad:
            raise InputError(f"{type(index).__name__}.query takes no {', '.join(bad)} "
                             f"(its options: {', '.join(n for n in params if n not in ('self', 'Q', 'k'))})")
    return index.query(queries, k, **kwargs)
