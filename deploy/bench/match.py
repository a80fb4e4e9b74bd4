"""``scanforest bench match``: distributed matching throughput on 1..W workers (one per GPU with
dask-cuda), parallel efficiency, bytes moved between workers, against the exact brute force on
the same devices in the same run."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from scanforest.flows.cluster import dask_client
from scanforest.kernels.backend import describe_device, resolve_device
from scanforest.kernels.errors import InputError

from ._common import BenchReport, read_record
from ._data import id_recall

# synthetic references up to WHOLE_MAX rows are drawn in one piece (the data of earlier runs),
# larger ones in PIECE-row parts of their own seeds
WHOLE_MAX = 1 << 24
PIECE = 1 << 22


def _transfer_bytes(client) -> int:
    def get(dask_worker):
        return int(dask_worker.transfer_outgoing_bytes_total)

    return int(sum(client.run(get).values()))


def _release(client, di) -> None:
    """Drop a DistributedIndex's resident shards and give their GPU memory back before the next
    index is loaded (two resident copies of a 10M x 352 shard do not fit beside the search)."""
    keys = {f.key for f in di.shards}
    di.close()

    def held(dask_worker):
        return sum(k in dask_worker.data for k in keys)

    t0 = time.perf_counter()
    while sum(client.run(held).values()) and time.perf_counter() - t0 < 30:
        time.sleep(0.1)
    from scanforest.tasks.index import free_gpu_pool

    client.run(free_gpu_pool)


def _resident_bytes(dask_worker) -> int:
    """Bytes of the index shards held by this worker (their Dask-reported sizes)."""
    from dask.sizeof import sizeof

    return int(sum(sizeof(v) for key, v in dask_worker.data.items() if str(key).startswith("sf-shard-")))


#: timed passes over the queries after the warm-up; the fastest counts (the same rule for the
#: forest and the brute force rows: a pass may pay a pool's growth or a stray host stall)
PASSES = 2

#: threads of a GPU worker: two query blocks searched side by side on one GPU, each on its own
#: stream (:func:`scanforest.tasks.index._search_stream`), keep it busy through the other's syncs
GPU_WORKER_THREADS = 2


def _timed_query(di, Q, k, block, sync_after=None, backtracks=None, passes: int = PASSES, src=None):
    """(seconds, dist, ids, leaves, bytes moved) of the fastest of ``passes`` full query passes
    after a warm-up block. ``src``: what the timed passes query (a
    :class:`~scanforest.tasks.index.QueryFile` holding ``Q``; default ``Q`` itself)."""
    client = di.client
    src = Q if src is None else src
    di.wait()  # resident on the workers (a gather would copy every shard into this process)
    # warm-up (kernels compiled, pools grown): a few thousand queries, not a whole block (at 100M
    # rows a 65,536-query block of the brute force takes as long as the 20,000 timed ones), split
    # over every replica group
    di.query(Q[: min(len(Q), block or 4096, 4096)], k, block=block, sync_after=sync_after, backtracks=backtracks)
    best = None
    for _ in range(max(1, int(passes))):
        b0 = _transfer_bytes(client)
        t0 = time.perf_counter()
        dist, ids = di.query(src, k, block=block, sync_after=sync_after, backtracks=backtracks)
        t = time.perf_counter() - t0
        if best is None or t < best[0]:
            best = (t, dist, ids, di.stats_["leaves"], _transfer_bytes(client) - b0, dict(di.stats_))
    di.stats_ = best[5]  # the counted pass's statistics (the busy share)
    return best[:5]


_VARIES = ("workers", "sync_after", "backtracks")  # told apart by the (workers, sync, budget) keys


def _merge_recorded(path: str, rep: BenchReport, qps: dict) -> dict:
    """This run's ``{(workers, sync, budget): (queries/s, recall)}`` merged with those recorded
    on the workdir by earlier runs of the same configuration (``rep.params`` less the worker
    counts, the synchronisation and the budgets, which the keys tell apart); recorded."""
    config = {k: v for k, v in rep.params.items() if k not in _VARIES}
    try:
        rec = {(int(w), None if sa is None else int(sa), int(b)): (float(q), float(r))
               for w, sa, b, q, r in (read_record(path, config) or {}).get("qps", [])}
    except (ValueError, TypeError):  # a record of another layout: start afresh
        rec = {}
    earlier = sorted({key[0] for key in rec} - {key[0] for key in qps})
    if earlier:
        rep.note(f"queries/s of {earlier} worker(s) from an earlier run on this workdir (same configuration)")
    rec.update(qps)
    with open(path, "w") as f:
        json.dump({"config": config, "qps": [[w, sa, b, q, r] for (w, sa, b), (q, r) in rec.items()]}, f)
    return rec


def _at_recall(points, target: float) -> float | None:
    """Queries/s at ``target`` recall on a curve of ``(recall, queries/s)`` points, interpolated
    linearly between the two measured points around it (None: the curve does not reach it from
    both sides; the fastest point at or above a recall is taken where one sits exactly on it)."""
    pts = sorted(points)
    exact = [q for r, q in pts if r == target]
    if exact:
        return max(exact)
    for (r0, q0), (r1, q1) in zip(pts, pts[1:]):
        if r0 < target < r1:
            return q0 + (q1 - q0) * (target - r0) / (r1 - r0)
    return None


RECALL_TARGETS = (0.90, 0.95, 0.98)


def _efficiency_rows(rep: BenchReport, qps: dict, where: str, *, weak: bool = False) -> None:
    """Parallel efficiency from 1 to W workers, two ways (``weak``: each worker count held ``W``
    times the 1-worker rows, so the efficiency is W workers' queries/s over 1 worker's, not over
    W times it):

    - at the same budget per shard: more shards then scan more leaves per query in all, so the
      recall rises with W and the efficiency understates the scaling;
    - at matched recall: for each 1-worker point, the fastest W-worker point (any budget) whose
      recall is at least as high: the scaling a user who asks for a recall sees (with more
      than one budget measured).
    """
    tag_budget = len({key[2] for key in qps}) > 1
    kind = "weak scaling efficiency (W x the rows on W workers)" if weak else "parallel efficiency"
    for (w, sa, b), (q, _) in sorted(qps.items(), key=lambda x: (x[0][0], x[0][1] or 0, x[0][2])):
        if w > 1 and (1, sa, b) in qps:
            tag = ("" if sa is None else f", sync {sa}") + (f", {b} leaves per shard" if tag_budget else "")
            rep.add(f"{kind} 1 -> {w} workers{tag}", q / ((1 if weak else w) * qps[(1, sa, b)][0]), "", where)
    for sa in sorted({key[1] for key in qps}, key=lambda x: x or 0):  # interpolated on each curve
        curve = {w: [(r, q) for (ww, s2, _), (q, r) in qps.items() if ww == w and s2 == sa] for w, _, _ in qps}
        sync = "" if sa is None else f", sync {sa}"
        for target in RECALL_TARGETS:
            one = _at_recall(curve.get(1, []), target)
            for w in sorted(x for x in curve if x > 1):
                many = _at_recall(curve[w], target)
                if one is None or many is None:
                    continue
                rep.add(f"{kind} 1 -> {w} workers at recall {target:.2f}{sync} (queries/s interpolated on each "
                        f"curve: 1 worker {one:,.0f}, {w} workers {many:,.0f})", many / ((1 if weak else w) * one),
                        "", where, target_recall=target, workers=w, qps_one=one, qps_many=many)
    for (w1, sa1, b1), (q1, r1) in sorted(qps.items(), key=lambda x: (x[0][1] or 0, x[0][2])):
        if w1 != 1 or not tag_budget:
            continue
        for w in sorted({key[0] for key in qps if key[0] > 1}):
            ok = [(q, b) for (ww, sa, b), (q, r) in qps.items() if ww == w and sa == sa1 and r >= r1]
            sync = "" if sa1 is None else f", sync {sa1}"
            if not ok:
                rep.note(f"no {w}-worker budget{sync} reached the 1-worker recall {r1:.3f} of {b1} leaves")
                continue
            q, b = max(ok)
            rep.add(f"{kind} 1 -> {w} workers at recall >= {r1:.3f}{sync} "
                    f"(1 worker {b1} leaves; {w} workers {b} leaves per shard)", q / ((1 if weak else w) * q1), "",
                    where)


def _source_key(n, d, clusters, dtype, params, shards) -> str:
    """What a bench index was generated and built from (the reference is a function of these)."""
    gen = "clustered-whole" if n <= WHOLE_MAX else f"clustered-pieces-{PIECE}"
    return json.dumps({"n": n, "d": d, "clusters": clusters, "dtype": dtype, "params": params, "shards": shards,
                       "generator": gen, "seed": 1}, sort_keys=True)


def _workdir_index(store: str) -> str | None:
    """The source key of a complete bench index kept in ``store`` (None: none there)."""
    from scanforest.tasks.store import ScanStore

    try:
        return ScanStore(store, mode="r").catalog.index_attrs("bench").get("bench_source")
    except (InputError, OSError, KeyError, ValueError):
        return None


def _mark_workdir_index(store: str, source: str) -> None:
    from scanforest.tasks.store import ScanStore

    ScanStore(store).catalog.update_index("bench", {"bench_source": source})


def _reference(n: int, d: int, clusters: int, dev: str, dtype: str, piece: int = PIECE,
               whole_max: int = WHOLE_MAX) -> np.ndarray:
    """The synthetic reference (seed 1): whole up to ``whole_max`` (16M) rows (the figures of
    earlier runs), else in ``piece``-row parts of their own seeds, written into a host array of
    ``dtype`` (a 100M x 352 reference never exists in float32 anywhere)."""
    from ._data import clustered

    xp = np
    if dev == "gpu":
        import cupy as xp
    def host(a):  # narrowed on the device: half the transfer for float16
        a = a.astype(dtype, copy=False)
        return a.get() if xp is not np else a

    if n <= whole_max:
        return host(clustered(n, d, clusters=clusters, seed=1, xp=xp))
    X = np.empty((n, d), dtype)
    for i, a in enumerate(range(0, n, piece)):
        X[a:min(n, a + piece)] = host(_piece(i, n, d, clusters, xp, piece))
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()
    return X


def _piece(i: int, n: int, d: int, clusters: int, xp, piece: int = PIECE):
    """Piece ``i`` (rows ``i * piece`` to ``(i + 1) * piece``) of a reference drawn in pieces, float32."""
    from ._data import clustered

    a = i * piece
    return clustered(min(piece, n - a), d, clusters=clusters, seed=1_000_003 * (i + 1) + 1, xp=xp)


@dataclass(frozen=True)
class GeneratedShards:
    """The bench's synthetic reference drawn on the workers, shard by shard, instead of read from
    a store: the rows of :func:`_reference` in pieces (the same values for ``n`` above
    ``WHOLE_MAX`` on the same kind of device), rounded to ``dtype``, each shard's trees built
    where it lives. For references whose store does not fit the machine (100M x 352 is 70 GB in
    float16; one H200 machine has 64 GB of disk); a lost worker's shard is drawn again.

    A float16 reference keeps half rows on a GPU, as a stored float16 index does (the trees are
    built on its float32 widening, the rows then drawn again in leaf order: the device never
    holds the float32 rows beside the half ones).
    """

    n: int
    d: int
    clusters: int
    dtype: str
    params: tuple  # the forest parameters, as sorted (key, value) pairs (hashable)
    shards: int
    piece: int = PIECE

    @property
    def key(self) -> str:
        return "generated"

    @property
    def attrs(self) -> dict:
        from scanforest.kernels.knn.sharded import shard_ranges

        src = json.dumps({"n": self.n, "d": self.d, "clusters": self.clusters, "dtype": self.dtype,
                          "params": dict(self.params), "shards": self.shards, "piece": self.piece}, sort_keys=True)
        return {"shards": [list(r) for r in shard_ranges(self.n, self.shards)], "n": self.n, "d": self.d,
                "params": dict(self.params), "dtype": self.dtype,
                "content_hash": hashlib.sha256(src.encode()).hexdigest()}

    def rows(self, a: int, b: int, xp, dtype):
        """Rows ``[a, b)`` as ``dtype`` (after rounding to the reference's own dtype) on ``xp``."""
        out = xp.empty((b - a, self.d), dtype)
        for i in range(a // self.piece, -(-b // self.piece)):
            p0 = i * self.piece
            lo, hi = max(a, p0), min(b, p0 + self.piece)
            blk = _piece(i, self.n, self.d, self.clusters, xp, self.piece)[lo - p0:hi - p0]
            out[lo - a:hi - a] = blk.astype(self.dtype, copy=False).astype(dtype, copy=False)
            del blk
        return out

    def load(self, shard: int, device: str = "auto", method: str | None = None):
        from scanforest.kernels.knn.sharded import Shard
        from scanforest.tasks import index as idx

        idx._pin_on_dask_cuda()
        dev = resolve_device(device)
        xp = np
        if dev == "gpu":
            import cupy as xp
        a, b = self.attrs["shards"][shard]
        params = dict(self.params)
        if method is not None:
            params["method"] = method
        rdt = np.float16 if idx.resident_row_bytes(self.dtype, dev) == 2 else np.float32
        if params.get("method", "banns") == "exact":
            return Shard(a, b, idx._fit_forest(self.rows(a, b, xp, rdt), params, shard, dev))
        if params.get("graph_degree") is not None:  # the graph is found by searching the rows: fit with
            # them, then keep the leaf-ordered copy only, as a stored shard holds it
            forest = idx._fit_forest(self.rows(a, b, xp, np.float32), params, shard, dev).to_leaf_order()
            if dev == "gpu":
                idx.free_gpu_pool()
            return Shard(a, b, forest)
        forest = idx._fit_forest(self.rows(a, b, xp, np.float32), params, shard, dev, keep_rows=False)
        tree = forest.tree_
        del forest
        if dev == "gpu":
            idx.free_gpu_pool()
        # leaf order without a second copy: each source row r goes to every position p with
        # perm[p] == r (one per tree), scattered piece by piece
        nr = b - a
        reps = tree.perm.shape[0] // nr
        order = xp.argsort(tree.perm, kind="stable") if xp is np else xp.argsort(tree.perm)
        points = xp.empty((tree.perm.shape[0], self.d), rdt)
        i = a
        while i < b:  # piece by piece (each piece drawn once)
            j = min(b, (i // self.piece + 1) * self.piece)
            blk = self.rows(i, j, xp, rdt)
            if reps > 1:
                blk = xp.repeat(blk, reps, axis=0)
            points[order[reps * (i - a):reps * (j - a)]] = blk
            del blk
            i = j
        del order
        tree.points = points
        return Shard(a, b, idx.resident_forest(tree, params, shard, dev, nr))


def _query_rows(rep, di, Q, k, block, sa, budget, mb, ref, qps, *, w, where, method, bf_qps, tag_budget,
                plan=None, src=None):
    """One timed pass over all queries (sync ``sa``, leaf budget ``budget`` per shard, None:
    unlimited), its rows, and its ``(queries/s, recall)`` in ``qps[(w, sa, budget or 0)]``."""
    m = len(Q)
    t, _, ids, leaves, moved = _timed_query(di, Q, k, block, sa, budget, src=src)
    r = id_recall(ids[:mb], ref, k)  # by the ids it returned, never by the distances it reports
    tag = (f", {budget} leaves per shard" if tag_budget else "") + \
        ("" if sa is None else f", bound sync after {sa} leaves")
    qps[(w, sa, int(budget or 0))] = (m / t, r)
    rep.add(f"{method} queries/s, {w} worker{'s' if w > 1 else ''}{tag}", m / t, "queries/s", where,
            baseline=f"exact brute force, {w} workers", baseline_value=bf_qps, recall=r,
            workers=w, sync_after=sa, backtracks=budget, placement=di.describe(), plan=plan)
    rep.add(f"recall@{k}, {w} workers{tag}", r, "", where)
    rep.add(f"leaves scanned per query (all shards), {w} workers{tag}", leaves / m, "leaves", where,
            higher_is_better=False)
    rep.add(f"bytes moved between workers per query, {w} workers{tag}", moved / m, "bytes", where,
            higher_is_better=False)
    # where the time goes: the workers' time inside shard searches and merges, against W x wall
    rep.add(f"worker busy share (searches + merges / workers x wall), {w} workers{tag}",
            di.stats_["compute_seconds"] / (w * t), "", where)


def _faiss_ivf_rows(rep, X, Q, k, mb, ref, qps, *, nlist: int, nprobes, where: str, bf_qps: float,
                    targets=(0.9, 0.95, 0.98)) -> None:
    """FAISS GPU IVF-Flat on the same reference and queries, in the same run: a row per
    ``nprobes`` (all ``len(Q)`` queries timed; recall over the first ``mb`` by the canonical
    distances of the ids it returns, the rule of every other row), then for each target the
    forest's fastest 1-worker point at that recall against IVF-Flat's (``qps``: the forest's
    ``{(workers, sync, budget): (queries/s, recall)}``)."""
    try:
        import faiss
    except ImportError:
        rep.note("FAISS GPU rows skipped: faiss is not installed")
        return
    if not hasattr(faiss, "GpuIndexIVFFlat") or faiss.get_num_gpus() < 1:
        rep.note(f"FAISS GPU rows skipped: this faiss {faiss.__version__} has no GPU support (faiss-gpu)")
        return
    from scanforest.kernels.knn.bruteforce import pair_distances, recall

    from ._data import _best_at, _ivf_lists, _ivf_train_rows

    n, d = X.shape
    m = len(Q)
    nl = _ivf_lists(n, nlist)
    t0 = time.perf_counter()
    res = faiss.StandardGpuResources()
    ivf = faiss.GpuIndexIVFFlat(res, d, nl, faiss.METRIC_L2, faiss.GpuIndexIVFFlatConfig())
    ivf.train(np.ascontiguousarray(_ivf_train_rows(X, nl), dtype=np.float32))
    for a in range(0, n, 1 << 20):  # float32 pieces of a (possibly float16) reference
        ivf.add(np.ascontiguousarray(X[a:a + (1 << 20)], dtype=np.float32))
    build = time.perf_counter() - t0
    rep.add(f"FAISS GPU IVF-Flat build (nlist={nl})", build, "s", where, higher_is_better=False)
    Qf = np.ascontiguousarray(Q, dtype=np.float32)
    curve = []
    for p in nprobes:
        ivf.nprobe = int(p)
        ivf.search(Qf[:1000], k)  # warm-up
        t0 = time.perf_counter()
        _, ids = ivf.search(Qf, k)
        t = time.perf_counter() - t0
        ids = ids[:mb]
        used = np.unique(ids[ids >= 0])  # the canonical distances of the returned rows only
        rid = np.where(ids >= 0, np.searchsorted(used, np.maximum(ids, 0)), -1)
        r = recall(pair_distances(np.asarray(X[used], np.float32), Qf[:mb], rid, device="cpu"), ref, k)
        rep.add(f"FAISS GPU IVF-Flat (nlist={nl}) queries/s, nprobe={p}", m / t, "queries/s", where,
                baseline="exact brute force, 1 workers", baseline_value=bf_qps, recall=r, build_s=build,
                faiss=faiss.__version__)
        rep.add(f"FAISS GPU IVF-Flat (nlist={nl}) recall@{k}, nprobe={p}", r, "", where)
        curve.append((m / t, r, f"nprobe={p}"))
    del ivf
    ours = [(v, r, f"{b} leaves per shard") for (w, sa, b), (v, r) in qps.items() if w == 1 and sa is None]
    for target in targets:
        mine, theirs = _best_at(ours, target), _best_at(curve, target)
        if mine is None or theirs is None:
            rep.note(f"at recall@{k} >= {target}: " + ("the forest" if mine is None else "IVF-Flat")
                     + " has no measured point (widen its settings)")
            continue
        rep.add(f"forest ({mine[2]}, recall {mine[1]:.3f}) vs FAISS GPU IVF-Flat ({theirs[2]}, recall "
                f"{theirs[1]:.3f}) at recall@{k} >= {target}, 1 worker", mine[0], "queries/s", where,
                baseline=f"FAISS GPU IVF-Flat nlist={nl}", baseline_value=theirs[0])


def _plan(w: int, n: int, d: int, k: int, dev: str, *, shards, n_trees, leaf_size, method, store_dtype, block,
          graph_degree: int = 0):
    """The placement plan of an ``n``-row bench index on ``w`` workers, one per GPU (workers
    beyond the GPUs share them, and their memory), or on the host (its memory split ``w`` ways)."""
    from scanforest.kernels.backend import device_memory
    from scanforest.tasks import index as idx

    mem = device_memory(dev)
    per = -(-w // len(mem))  # workers per device
    mem = [mem[i % len(mem)] // per for i in range(w)]
    params = {"n_trees": n_trees, "leaf_size": leaf_size, "method": method,
              **({"graph_degree": graph_degree} if graph_degree else {})}
    return idx.plan_for(n, d, params, dev, k=k, memory=mem, dtype=store_dtype, shards=shards, block=block)


def run(n: int, m: int, d: int, k: int, workers: list[int], *, method: str, backtracks,
        leaf_size: int, device: str, block: int | None, out, clusters: int = 1000, shards: int | None = None,
        sync_after: int | None = None, bf_queries: int | None = None, n_trees: int = 1,
        workdir: str | None = None, store_dtype: str = "float32", reference: str = "store",
        faiss_nprobes=(), faiss_nlist: int = 0, leaves_per_round: int | None = None,
        rows_per_worker: int | None = None, queries: str = "client", graph: int = 0,
        graph_budget: int = 128, graph_expand: int = 4, graph_rounds: int = 2) -> BenchReport:
    """One table: for each worker count, the forest (with and without the global bound
    synchronisation when ``sync_after`` is given) and the exact brute force over the same
    resident shards; recall against the exact answer of the first ``bf_queries`` queries.

    ``shards=None``: the planner (:func:`scanforest.kernels.knn.sharded.plan_shards`) chooses
    the shards from the workers' device memory: one shard when the index fits one device, held
    by every worker, which split the query blocks (replicas); else the fewest shards that fit,
    in copies where the devices allow. ``shards=S`` builds one S-shard index, placed the same
    way. The plan, its memory figures and its reason are in the notes and in the queries/s rows.
    ``rows_per_worker=N``: weak scaling, each worker count ``W`` indexes ``N x W`` rows (and
    the efficiency rows compare W workers' queries/s with 1 worker's, not with W times it).
    ``block``: the largest query block (None: planned from the workers' free memory).
    ``workdir`` keeps the index stores there: a later run with the same data and parameters
    reuses them (the build row then says so), e.g. to run each worker count in its own command.

    ``backtracks``: a leaf budget per shard, or a list of them (a recall/speed curve on the same
    resident index: the first is built in, the others are set per query). With several budgets
    the efficiency is also given at matched recall.

    ``store_dtype="float16"`` stores the reference in half precision (100M x 352 rows: 70 GB
    instead of 141 GB of disk and host memory); the brute force and the recall are then over the
    same rounded rows. References over 16M rows are generated in 4M-row pieces (never whole on
    one device) straight into a host array of that dtype.

    ``reference="workers"``: no store; every worker draws its shards' rows itself (the pieces
    of :class:`GeneratedShards`) and builds their trees where they stay (for a reference whose
    store does not fit the machine's disk). The shard load row then covers drawing and trees.

    ``leaves_per_round``: the forests' P-BANNS leaves per query and round (None: the default).

    ``queries="file"``: the queries are written to an ``.npy`` in the workdir before any clock
    starts, and every timed pass (forest and brute force alike) has the workers read their
    blocks from it (:class:`~scanforest.tasks.index.QueryFile`) instead of receiving them from
    this process; ``"client"``: the blocks leave this process.

    ``faiss_nprobes`` (GPU): FAISS GPU IVF-Flat over the same reference (``faiss_nlist`` lists,
    0: 4 sqrt(N)) and queries after the workers are gone, on the same GPU, and the forest against
    it at matched recall (:func:`_faiss_ivf_rows`).
    """
    if reference not in ("store", "workers"):
        raise InputError(f"reference must be 'store' or 'workers', got {reference!r}")
    if queries not in ("client", "file"):
        raise InputError(f"--queries must be 'client' or 'file', got {queries!r}")
    if rows_per_worker is not None and int(rows_per_worker) < 1:
        raise InputError(f"--rows-per-worker must be a positive number of rows, got {rows_per_worker}")
    if block is not None and int(block) < 1:
        raise InputError(f"--block must be a positive number of queries (0: planned), got {block}")
    if leaves_per_round is not None and (isinstance(leaves_per_round, bool) or int(leaves_per_round) < 1):
        raise InputError(f"--leaves-per-round must be a positive number of leaves, got {leaves_per_round}")
    gparams = {}
    if graph:  # every shard with a neighbour graph (index build --graph), checked as the command checks it
        from scanforest.flows.inputs import check_graph_options

        gparams = {"graph_degree": int(graph), "graph_budget": int(graph_budget), "graph_expand": int(graph_expand),
                   "graph_rounds": int(graph_rounds)}
        check_graph_options({"method": method, **gparams})
    from scanforest.flows.distributed import DistributedIndex
    from scanforest.tasks import index as idx

    from ._data import clustered

    dev = resolve_device(device)
    budgets = list(backtracks) if isinstance(backtracks, (list, tuple)) else [backtracks]
    if len(budgets) > 1 and any(b is None or int(b) < 1 for b in budgets):
        raise InputError("a list of budgets needs positive leaf counts (unlimited search takes one budget)")
    backtracks = budgets[0]
    mb = m if not bf_queries else min(m, int(bf_queries))
    rep = BenchReport("match", {"n": n, "m": m, "d": d, "k": k, "workers": workers, "method": method,
                                "backtracks": budgets if len(budgets) > 1 else backtracks,
                                "leaf_size": leaf_size, "block": block,
                                **({"rows_per_worker": rows_per_worker} if rows_per_worker else {}),
                                "shards": shards, "sync_after": sync_after, "bf_queries": mb,
                                "n_trees": n_trees, "clusters": clusters,
                                **({"leaves_per_round": leaves_per_round} if leaves_per_round else {}),
                                **({"store_dtype": store_dtype} if store_dtype != "float32" else {}),
                                **({"reference": reference} if reference != "store" else {}),
                                **({"queries": queries} if queries != "client" else {}), **gparams}, echo=True,
                      out=out)
    t0 = time.perf_counter()
    if dev == "gpu":
        import cupy as cp

        Q = cp.asnumpy(clustered(m, d, clusters=clusters, seed=2, xp=cp))
        cp.get_default_memory_pool().free_all_blocks()
    else:
        Q = clustered(m, d, clusters=clusters, seed=2)
    where_ref = "in the store" if reference == "store" else "drawn on the workers, no store"
    sizes = (f"{rows_per_worker:,} rows per worker" if rows_per_worker else f"{n:,}")
    rep.note(f"data: {sizes} x {d} reference ({store_dtype}, {where_ref}), {m:,} queries, {clusters} Gaussian "
             f"clusters; queries generated in {time.perf_counter() - t0:.1f} s")
    devname = describe_device(dev)
    tmp = workdir or tempfile.mkdtemp(prefix="sf-bench-match-")
    os.makedirs(tmp, exist_ok=True)
    files = {}  # the timed queries (all, and the brute force's) as files the workers read
    if queries == "file":
        from scanforest.tasks.index import QueryFile

        files = {"all": QueryFile.write(os.path.join(tmp, "queries.npy"), Q),
                 "bf": QueryFile.write(os.path.join(tmp, "queries-bf.npy"), Q[:mb])}
        rep.note(f"queries read by the workers from .npy files in {tmp} (written before the clocks start)")
    # budgets are set per query, so one stored index serves every budget (and every later run)
    params = {"method": method, "leaf_size": leaf_size, "backtracks": None, "n_trees": n_trees, **gparams}
    if leaves_per_round:
        params["leaves_per_round"] = int(leaves_per_round)
    built = {}
    data = {}  # the reference of each size, generated only when an index must be (re)built
    plans = {w: _plan(w, rows_per_worker * w if rows_per_worker else n, d, k, dev, shards=shards, n_trees=n_trees,
                      leaf_size=leaf_size, method=method, store_dtype=store_dtype, block=block,
                      graph_degree=int(graph or 0))
             for w in workers}

    def size(w):
        return rows_per_worker * w if rows_per_worker else n

    def store_for(w):
        n_w, s_count = size(w), plans[w].shards
        if (n_w, s_count) not in built:
            store = os.path.join(tmp, f"n{n_w}-s{s_count}.zarr")
            source = _source_key(n_w, d, clusters, store_dtype, params, s_count)
            t0 = time.perf_counter()
            if _workdir_index(store) == source:
                what = "unchanged in the workdir: same generated data and parameters"
            else:
                if n_w not in data:
                    t1 = time.perf_counter()
                    data.clear()  # one reference in this process's memory at a time
                    data[n_w] = _reference(n_w, d, clusters, dev, store_dtype)
                    rep.note(f"reference generated in {time.perf_counter() - t1:.1f} s ({n_w:,} rows)")
                res = idx.build_index(store, "bench", data[n_w], shards=s_count, params=params, device=dev,
                                      dtype=store_dtype)
                _mark_workdir_index(store, source)
                what = "write + trees" if res["status"] == "built" else "unchanged in the workdir: content hash only"
            built[(n_w, s_count)] = (store, time.perf_counter() - t0)
            rows = f", {n_w:,} rows" if rows_per_worker else ""
            rep.add(f"index build ({what}), {s_count} shard{'s' if s_count > 1 else ''}{rows}",
                    built[(n_w, s_count)][1], "s", devname, higher_is_better=False)
        return built[(n_w, s_count)][0]

    def source_for(w):
        if reference == "workers":
            return GeneratedShards(size(w), d, clusters, store_dtype, tuple(sorted(params.items())), plans[w].shards)
        return idx.StoredShards(store_for(w), "bench")

    try:
        for w in workers:  # every index first: the reference then leaves this process's memory
            if reference == "store":
                store_for(w)
        data.clear()
        ref = ref_dist = None  # the exact search's ids (the recall of the forest) and distances (FAISS's)
        qps = {}
        bf_rate = {}  # workers -> the exact brute force's queries/s
        for w in workers:
            src = source_for(w)
            plan = plans[w]
            rep.note(f"{w} worker{'s' if w > 1 else ''}: plan {plan.describe()}")
            with dask_client(None, n_workers=w, device=dev,
                             threads_per_worker=GPU_WORKER_THREADS if dev == "gpu" else 1) as client:
                where = f"{devname} x{w}"
                # exact brute force over the same resident shards: the baseline and the recall reference
                bf = DistributedIndex(client, source=src, device=dev, method="exact", replicas=plan.replicas)
                t_bf, bd, bi, _, _ = _timed_query(bf, Q[:mb], k, block, src=files.get("bf"))
                _release(client, bf)
                if ref is None or rows_per_worker:  # weak scaling: another reference each
                    ref, ref_dist = bi, bd
                bf_rate[w] = mb / t_bf
                rep.add(f"exact brute force queries/s, {w} worker{'s' if w > 1 else ''}", mb / t_bf, "queries/s",
                        where, workers=w)
                di = DistributedIndex(client, source=src, device=dev, replicas=plan.replicas)
                t0 = time.perf_counter()
                di.wait()
                what = (f"store -> {dev}, trees included" if reference == "store"
                        else f"rows drawn on the workers' {dev}s, trees built there")
                rep.add(f"shard load ({what}), {w} workers", time.perf_counter() - t0, "s",
                        where, higher_is_better=False)
                # the memory plan beside the measurement: estimated residency vs what the shards hold
                held = client.run(_resident_bytes, workers=sorted(set(di.placement.values())))
                placed = di.describe()
                rep.note(f"{w} workers: {placed['mode']}, {placed['shards']} shard(s) x {placed['replicas']} "
                         f"replica(s); shards hold {max(held.values()) / 2**30:.2f} GiB on the fullest worker "
                         f"(the planner's estimate: {plan.resident_bytes / 2**30:.2f} GiB); planned block "
                         f"{di.plan_block(k):,}")
                variants = [None] + ([int(sync_after)] if sync_after else [])
                for b in budgets:
                    for sa in variants:
                        _query_rows(rep, di, Q, k, block, sa, b, mb, ref, qps, w=w, where=where, method=method,
                                    bf_qps=mb / t_bf, tag_budget=len(budgets) > 1, plan=plan.as_dict(),
                                    src=files.get("all"))
                _release(client, di)
        if faiss_nprobes and dev == "gpu" and ref is not None and not rows_per_worker:
            t1 = time.perf_counter()  # the workers (and their GPU memory) are gone
            if reference == "workers":  # the very rows the workers drew (pieces), not _reference's
                import cupy as cp

                src = GeneratedShards(n, d, clusters, store_dtype, tuple(sorted(params.items())), 1)
                X = np.empty((n, d), store_dtype)
                for a in range(0, n, src.piece):
                    X[a:a + src.piece] = src.rows(a, min(n, a + src.piece), cp, store_dtype).get()
            else:
                X = _reference(n, d, clusters, dev, store_dtype)
            rep.note(f"reference generated again for FAISS in {time.perf_counter() - t1:.1f} s")
            _faiss_ivf_rows(rep, X, Q, k, mb, ref_dist, qps, nlist=faiss_nlist, nprobes=list(faiss_nprobes),
                            where=f"{devname} x1", bf_qps=bf_rate.get(1))
            del X
        elif faiss_nprobes:
            rep.note("FAISS GPU rows skipped: they run with --device gpu and without --rows-per-worker")
        if workdir:  # worker counts measured by earlier runs on this workdir with the same configuration
            qps = _merge_recorded(os.path.join(tmp, "bench-match.json"), rep, qps)
        _efficiency_rows(rep, qps, devname, weak=bool(rows_per_worker))

        rep.note("workers share one host; with one GPU, several workers share it (efficiency then measures "
                 "orchestration, not GPU scaling)" if dev == "gpu" else
                 f"CPU workers share {os.cpu_count()} cores")
        if shards:
            rep.note(f"one {shards}-shard index for every worker count")
        if mb < m:
            rep.note(f"brute force and recall over the first {mb:,} of the {m:,} queries")
        rep.finish(out)
        return rep
    finally:
        for f in files.values():  # the query files are scratch, kept workdir or not
            with contextlib.suppress(OSError):
                os.unlink(f.path)
        if not workdir:
            shutil.rmtree(tmp, ignore_errors=True)


def register(app, bench) -> None:
    """Add this bench to ``scanforest bench`` (found by :mod:`scanforest.deploy.cli`)."""
    import typer

    @bench.command("match")
    def bench_match(
        n: int = typer.Option(200_000, help="Reference descriptors."),
        m: int = typer.Option(20_000, help="Queries."),
        d: int = typer.Option(352, help="Dimension (SHOT: 352)."),
        k: int = typer.Option(4, "-k"),
        workers: str = typer.Option("1,2", help="Worker counts to run (comma separated)."),
        method: str = typer.Option("anns"),
        backtracks: str = typer.Option("256", help="Leaf visits per query and shard (0 = unlimited, exact); a "
                                       "comma list runs a recall/speed curve on the same index."),
        leaf_size: int = typer.Option(64),
        block: int = typer.Option(0, help="The largest query block (0: planned from the workers' free memory; "
                                  "the queries go in equal blocks, as many to every replica group)."),
        device: str = typer.Option("auto"),
        shards: int = typer.Option(0, help="Shards of one index used for every worker count (0: planned from the "
                                   "devices' memory: one shard held by every GPU when it fits one)."),
        rows_per_worker: int = typer.Option(0, "--rows-per-worker", help="Weak scaling: W workers index W times "
                                            "this many rows (--n is then unused)."),
        sync: int = typer.Option(0, help="Also run the global bound synchronisation after this many leaves (0: off)."),
        bf_queries: int = typer.Option(0, help="Queries for the brute force and the recall (0: all)."),
        n_trees: int = typer.Option(1, help="Randomized trees per shard (replicated forest)."),
        leaves_per_round: int = typer.Option(0, "--leaves-per-round", help="P-BANNS leaves a query takes per "
                                             "round (0: the default, kdtree.LEAVES_PER_ROUND)."),
        clusters: int = typer.Option(1000, help="Gaussian clusters of the synthetic descriptors."),
        workdir: str = typer.Option(None, help="Keep the index stores here and reuse them in later runs "
                                    "with the same data and parameters (default: a temporary folder)."),
        store_dtype: str = typer.Option("float32", help="Reference rows in the store: float32, or float16 (half "
                                        "the disk; e.g. 100M x 352 needs 70 GB instead of 141 GB)."),
        reference: str = typer.Option("store", help="store: the reference in an index store (built once; "
                                      "--workdir keeps it); workers: drawn and indexed on the workers, no store "
                                      "(for a reference bigger than the disk)."),
        faiss_nprobe: str = typer.Option("", "--faiss-nprobe", help="FAISS GPU IVF-Flat over the same data in "
                                         "the same run, these probes (comma list; --device gpu, faiss-gpu)."),
        faiss_nlist: int = typer.Option(0, "--faiss-nlist", help="FAISS IVF lists (0: 4 sqrt(N))."),
        queries: str = typer.Option("client", help="client: query blocks sent from this process; file: the "
                                    "workers read their blocks from an .npy in the workdir (no client "
                                    "in the data path)."),
        graph: int = typer.Option(0, "--graph", help="Every shard with a neighbour graph of this many neighbours "
                                  "a row (index build --graph; 0: none), walked after each budget's search."),
        graph_budget: int = typer.Option(128, "--graph-budget", help="Leaves a row's graph search scans."),
        graph_expand: int = typer.Option(4, "--graph-expand", help="List entries a graph round expands."),
        graph_rounds: int = typer.Option(2, "--graph-rounds", help="Rounds of the graph walk."),
        out: str = typer.Option(None, "--out"),
    ):
        """Distributed matching: queries/s on 1..W workers, efficiency, bytes moved, vs brute force."""
        from ._common import parse_counts

        run(n, m, d, k, _worker_counts(workers), method=method,
            backtracks=[int(b) or None for b in backtracks.split(",")],
            leaf_size=leaf_size, device=device, block=block or None, out=out, clusters=clusters,
            shards=shards or None, rows_per_worker=rows_per_worker or None,
            sync_after=sync or None, bf_queries=bf_queries or None, n_trees=n_trees, workdir=workdir,
            leaves_per_round=None if leaves_per_round == 0 else leaves_per_round,
            store_dtype=store_dtype, reference=reference, queries=queries,
            faiss_nprobes=parse_counts(faiss_nprobe), faiss_nlist=faiss_nlist, graph=graph,
            graph_budget=graph_budget, graph_expand=graph_expand, graph_rounds=graph_rounds)


def _worker_counts(text: str) -> list[int]:
    """``--workers`` as a list of counts, each at least 1 (one line naming the option otherwise)."""
    from scanforest.kernels.errors import InputError

    from ._common import parse_counts

    counts = parse_counts(text)
    if not counts or min(counts) < 1:
        raise InputError(f"--workers must list worker counts of at least 1 (e.g. 1,2,4), got {text!r}")
    return counts
