"""Sharded nearest-neighbour index: the reference set split into contiguous shards, one
KD-forest per shard, every query visiting every shard, per-shard top-k merged into the global
top-k (:func:`scanforest.kernels.knn.topk.merge_topk`).

This module is the single-process form (shards searched one after the other on one device);
:mod:`scanforest.flows.match` runs the same shards resident on Dask workers, one per GPU.
With an unlimited backtrack budget (or ``method="exact"``) the answer equals the single-device
brute force exactly, ids and distances, because shards are contiguous id ranges and the merge
orders by (distance, id).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..jit import njit, prange
from ..backend import is_cupy, xp_for
from ..errors import InputError
from .topk import merge_topk, pad_topk


@njit(cache=True, parallel=True)
def _gather_rows_nb(X, perm, out):
    for i in prange(perm.shape[0]):
        out[i] = X[perm[i]]


def gather_rows(X: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """``X[perm]`` on the host with all cores (numpy's fancy indexing copies on one): a
    shard's leaf-ordered rows, made before they go to the device (no second copy there)."""
    X = np.ascontiguousarray(X)
    perm = np.asarray(perm, np.int64)
    out = np.empty((perm.shape[0],) + X.shape[1:], X.dtype)
    bits = f"u{X.dtype.itemsize}"  # rows are moved as bits (numba has no float16)
    _gather_rows_nb(X.view(bits), perm, out.view(bits))
    return out


def shard_ranges(n: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous, nearly equal ``[start, stop)`` ranges covering ``range(n)``."""
    if shards < 1:
        raise InputError(f"shards must be >= 1, got {shards}")
    if shards > n:
        raise InputError(f"shards ({shards}) cannot exceed the number of reference points ({n})")
    bounds = np.linspace(0, n, shards + 1).round().astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass
class Shard:
    """One shard: a fitted KDForest over rows ``[start, stop)`` of the reference set."""

    start: int
    stop: int
    forest: object  # KDForest

    def query(self, Q, k: int, *, return_stats: bool = False, **search):
        """Top-min(k, shard size) of this shard with *global* ids, padded to k with (inf, -1)
        (and the search's statistics with ``return_stats``).

        ``search`` (``bounds=``, ``backtracks=``) goes to :meth:`KDForest.query`."""
        kk = min(k, self.stop - self.start)
        d, i, stats = self.forest.query(Q, kk, return_stats=True, **search)
        xp = xp_for("gpu" if is_cupy(i) else "cpu")
        i = xp.where(i >= 0, i + self.start, -1)  # -1 pads (fewer than k found) stay -1
        out = pad_topk(d, i, k)
        return out + (stats,) if return_stats else out


class ShardedIndex:
    """A reference set in ``shards`` contiguous shards, each indexed by its own KD-forest.

    Parameters
    ----------
    shards : int
        Number of shards (one per GPU worker in the distributed form).
    **forest_params
        Passed to :class:`scanforest.kernels.knn.kdforest.KDForest` for every shard (``method``,
        ``leaf_size``, ``backtracks``, ``random_dims``, ``device`` ...). Each shard's ``seed``
        is ``seed + shard index``, so randomized trees differ between shards.
    """

    def __init__(self, *, shards: int = 1, **forest_params):
        from .kdforest import KDForest

        from ..validation import integer

        integer(shards, "shards")
        KDForest().set_params(**forest_params)  # an unknown forest parameter, said now (it was at fit)
        self.shards = shards
        self.forest_params = forest_params

    def fit(self, X) -> "ShardedIndex":
        from .kdforest import KDForest

        if getattr(X, "ndim", None) != 2:
            raise InputError(f"X must be a 2-D (N, d) array, got shape {getattr(X, 'shape', None)}")
        n = int(X.shape[0])
        if n == 0:
            raise InputError("X is empty (0 rows)")
        self.ranges_ = shard_ranges(n, int(self.shards))
        seed = int(self.forest_params.get("seed", 0))
        params = {k: v for k, v in self.forest_params.items() if k != "seed"}
        self.shards_ = [Shard(a, b, KDForest(seed=seed + s, **params).fit(X[a:b]))
                        for s, (a, b) in enumerate(self.ranges_)]
        self.n_samples_fit_, self.n_features_in_ = n, int(X.shape[1])
        self.device_ = self.shards_[0].forest.device_
        return self

    def query(self, Q, k: int = 1):
        """Global top-k (squared distances ascending, ties by id) over all shards."""
        if not hasattr(self, "shards_"):
            raise InputError("this ShardedIndex is not fitted yet: call fit(X) first")
        if not 1 <= int(k) <= self.n_samples_fit_:
            raise InputError(f"k must be in [1, {self.n_samples_fit_}], got {k}")
        parts = [s.query(Q, int(k)) for s in self.shards_]
        return merge_topk(parts, int(k))


# ---------------------------------------------------------------------------------------------
# memory planning
# ---------------------------------------------------------------------------------------------
# the search's per-query priority queue at its largest (kdtree.MAX_HEAP_CAP boxes: key + node)
HEAP_BYTES_PER_QUERY = 2048 * 8
BF_TILE_BYTES = {"gpu": 2 << 30, "cpu": 512 << 20}  # the brute force's coarse GEMM tile budget
# the largest query block planned by default: a GPU search round has fixed costs (bucketing,
# launches, one host sync) that a larger block spreads (10M x 352 on an H200, 384 leaves: 35,000
# queries/s at 65,536 queries per block, 54,800 at 262,144); a CPU search has none
MAX_BLOCK = {"gpu": 262_144, "cpu": 65_536}


def shard_resident_bytes(rows: int, d: int, *, n_trees: int = 1, leaf_size: int = 64,
                         method: str = "banns", row_bytes: int = 4, graph_degree: int = 0) -> int:
    """Bytes a loaded shard of ``rows`` rows holds on its device: for the exact method the rows;
    for a forest each tree's leaf-ordered rows, permutation and nodes (at most 4 per
    ``leaf_size`` rows; a node is its child, split, point range and a box of 2 x ``d`` floats).
    ``row_bytes`` per value: 2 for a float16 index on a GPU, which keeps its rows in half
    precision (and, once searched, their squared norms for the tensor-core leaf scan: 4 bytes a
    row), else 4. ``graph_degree``: a neighbour graph over the rows (4 bytes a neighbour) and the
    inverse of the leaf order its searches map ids through (8 bytes a row)."""
    rows, d = int(rows), int(d)
    if method == "exact":
        return rows * d * int(row_bytes)
    nodes = 4 * -(-rows // int(leaf_size))
    norms = 4 if int(row_bytes) == 2 else 0
    graph = rows * (4 * int(graph_degree) + 8) if graph_degree else 0
    return int(n_trees) * (rows * (d * int(row_bytes) + norms) + rows * 8 + nodes * (28 + 8 * d)) + graph


def search_working_bytes(rows: int, d: int, block: int, k: int, *, device: str = "gpu") -> int:
    """Transient bytes of one query block on a shard of ``rows`` rows: the block and its results,
    the per-query queues, and the exact brute force that finishes queries (the rows' norms and
    the GEMM tile budget; it centres the rows tile by tile when a centred copy does not fit)."""
    rows, d, block, k = int(rows), int(d), int(block), int(k)
    per_query = d * 4 + HEAP_BYTES_PER_QUERY + 20 * k + 64
    return block * per_query + rows * 4 + BF_TILE_BYTES.get(device, BF_TILE_BYTES["gpu"])


def fit_block(rows: int, d: int, k: int, cap: float, *, block: int | None = None, min_block: int = 256,
              device: str = "gpu") -> int:
    """The largest query block (``block``, default ``MAX_BLOCK[device]``, halved down to
    ``min_block``) whose working set on a shard of ``rows`` rows fits in ``cap`` bytes
    (``min_block`` when none does)."""
    b = max(1, int(MAX_BLOCK.get(device, MAX_BLOCK["gpu"]) if block is None else block))
    while b > min_block and search_working_bytes(rows, d, b, k, device=device) > cap:
        b = max(min_block, b // 2)
    return b


# the smallest query block at which a GPU search is still efficient (its fixed per-round costs
# spread): the planner prefers fewer, larger shards only while a block of this size fits beside
# them; replicas then split the queries, and a GPU's share of a query goes in at least two blocks
# of this size or more, so the next block travels while one is searched
GOOD_BLOCK = {"gpu": 65_536, "cpu": 4_096}


def placement_mode(shards: int, replicas: int) -> str:
    """``single``, ``replicate``, ``shard`` or ``shard+replicate``: how an index of ``shards``
    row ranges in ``replicas`` copies lives on its workers."""
    if shards == 1:
        return "replicate" if replicas > 1 else "single"
    return "shard+replicate" if replicas > 1 else "shard"


@dataclass
class ShardPlan:
    """Where an index lives on a cluster: ``shards`` row ranges, each held by ``replicas`` workers
    (``shards x replicas`` workers hold shards; the rest hold none). A query block goes to one
    replica group (a worker per shard), so replicas split the queries and shards split the rows."""

    shards: int                 # row ranges of the index
    block: int                  # queries per block that fit beside the resident shard
    rows_per_shard: int
    resident_bytes: int         # per worker
    working_bytes: int          # per worker, at ``block``
    memory_bytes: int           # the smallest worker's memory the plan was made for
    fits: bool
    min_workers: int            # workers of this memory the index needs at the smallest block
    replicas: int = 1           # copies of every shard (query blocks split between them)
    workers: int = 1            # workers (devices) the plan was made for
    build_bytes: int = 0        # per worker while a shard's trees are built on it (0: not built there)
    reason: str = ""

    @property
    def mode(self) -> str:
        return placement_mode(self.shards, self.replicas)

    def describe(self) -> str:
        g = 2 ** 30
        build = f", {self.build_bytes / g:.1f} GiB while its trees are built" if self.build_bytes else ""
        return (f"{self.mode}: {self.shards} shard(s) of {self.rows_per_shard:,} rows x {self.replicas} "
                f"replica(s) on {self.workers} worker(s): {self.resident_bytes / g:.1f} GiB resident "
                f"+ {self.working_bytes / g:.1f} GiB per {self.block:,}-query block on each worker "
                f"({self.memory_bytes / g:.1f} GiB{build}); {self.reason}")

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return {**asdict(self), "mode": self.mode}


def plan_shards(n: int, d: int, memory_bytes, *, k: int = 4, block: int | None = None, n_trees: int = 1,
                leaf_size: int = 64, method: str = "banns", device: str = "gpu", headroom: float = 0.85,
                min_block: int = 256, row_bytes: int = 4, build_row_bytes: int = 0,
                shards: int | None = None, graph_degree: int = 0) -> ShardPlan:
    """Shards, replicas and query block for ``n`` x ``d`` reference rows on workers of
    ``memory_bytes`` each (an int, or one per worker, i.e. per GPU: the smallest counts).

    Every query searches every shard, so each shard added multiplies the work per query; copies
    of a shard (replicas) split the queries instead. The plan therefore takes the most replicas
    ``R`` whose ``W // R`` shards fit: the whole index on every worker when it fits one
    (``replicate``), else FAISS's shards of replicas (``shard+replicate``), else one shard per
    worker (``shard``). A shard fits when its resident bytes (:func:`shard_resident_bytes`), and
    while its trees are built on the worker ``build_row_bytes`` per value of its rows
    (:func:`build_bytes`; 0: built elsewhere), leave room for a query block of at least
    ``GOOD_BLOCK[device]`` within ``headroom`` of the memory; failing that, of ``min_block``.
    ``shards`` fixes the shard count (a stored index's) and plans only its replicas.
    ``fits=False`` means even ``min_block`` does not fit one shard per worker; then
    ``min_workers`` is the number of such workers the index needs. ``row_bytes``: bytes per
    resident value of the rows (2 for a float16 index on GPUs). ``graph_degree``: each shard
    also holds a neighbour graph of that degree (and builds it where its trees are built).
    """
    mem = [int(m) for m in (memory_bytes if hasattr(memory_bytes, "__len__") else [memory_bytes])]
    if not mem or min(mem) <= 0:
        raise InputError(f"memory_bytes must be positive (one value per worker), got {memory_bytes!r}")
    if int(n) < 1 or int(d) < 1:
        raise InputError(f"n and d must be >= 1, got n={n}, d={d}")
    if block is None:
        block = MAX_BLOCK.get(device, MAX_BLOCK["gpu"])
    if int(block) < 1 or int(min_block) < 1:
        raise InputError(f"block and min_block must be >= 1, got {block}, {min_block}")
    if shards is not None and not 1 <= int(shards) <= int(n):
        raise InputError(f"shards must be in [1, {n}], got {shards}")
    workers, cap = len(mem), headroom * min(mem)
    good = min(int(block), GOOD_BLOCK.get(device, GOOD_BLOCK["gpu"]))

    def sized(s: int, on: int = workers) -> tuple[int, int, int, int, int]:
        """rows, resident, build, block and working bytes of ``s`` shards on ``on`` workers"""
        rows = -(-int(n) // s)
        each = -(-s // on)  # shards a worker holds (more than one only when s > on)
        res = each * shard_resident_bytes(rows, d, n_trees=n_trees, leaf_size=leaf_size, method=method,
                                          row_bytes=row_bytes, graph_degree=graph_degree)
        bld = (res * (each - 1) // each + build_bytes(rows, d, leaf_size=leaf_size, row_bytes=build_row_bytes,
                                                      graph_degree=graph_degree)
               if build_row_bytes else 0)  # one shard built beside those already resident
        b = fit_block(rows, d, k, cap - max(res, bld), block=block, min_block=min_block, device=device)
        return rows, res, bld, b, search_working_bytes(rows, d, b, k, device=device)

    def room(s: int, at_least: int) -> bool:
        _, res, bld, b, work = sized(s)
        return max(res, bld) + work <= cap and b >= at_least

    counts = [int(shards)] if shards is not None else [workers // r for r in range(workers, 0, -1)]
    chosen, why = None, ""
    for at_least, what in ((good, f"a {good:,}-query block"), (min_block, f"a {min_block:,}-query block")):
        for s in counts:
            if s <= int(n) and room(s, at_least):
                chosen = s
                break
        if chosen is not None:
            r = max(1, workers // chosen)
            if chosen == 1:
                why = (f"the whole index and {what} fit one worker: each of the {r} worker(s) holds it and "
                       "takes its share of the query blocks")
            else:
                why = (f"fewer than {chosen} shards leave no room for {what}" if shards is None
                       else f"the index has {chosen} shards")
                why += (f"; {r} copies of each shard split the query blocks" if r > 1
                        else "; every query block searches every shard")
            break
    s = chosen if chosen is not None else (int(shards) if shards is not None else min(workers, int(n)))
    rows, res, bld, b, work = sized(s)
    replicas = max(1, workers // s)
    w = s  # the workers of this memory the index needs (more than it has when it does not fit)
    while w < int(n):
        r_w, res_w, bld_w, _, _ = sized(w, w)
        if max(res_w, bld_w) + search_working_bytes(r_w, d, min_block, k, device=device) <= cap:
            break
        w += 1 if w < 64 else w // 8
    fits = chosen is not None
    if not fits:
        why = f"one shard per worker does not leave room for a {min_block:,}-query block"
    return ShardPlan(s, b, rows, res, work, min(mem), fits, w, replicas, workers, bld, why)


def build_bytes(rows: int, d: int, *, leaf_size: int = 64, row_bytes: int = 4, graph_degree: int = 0) -> int:
    """Bytes on a device while a shard's tree is built there: its rows at ``row_bytes`` per value
    (the build works on float32 rows), the permutation and the nodes: a resident shard's bytes
    at those rows, and the build's second 8 bytes a row. A graph (``graph_degree``) is found by
    searching the rows: its build keeps them in input order beside the leaf-ordered copy, with
    the graph and one chunk of searches (:data:`~.kdforest.GRAPH_CHUNK_PAIRS` keys)."""
    total = shard_resident_bytes(rows, d, leaf_size=leaf_size, row_bytes=row_bytes, graph_degree=graph_degree)
    if graph_degree:
        from .kdforest import GRAPH_CHUNK_PAIRS

        total += int(rows) * int(d) * 4 + 16 * GRAPH_CHUNK_PAIRS
    return total + 8 * int(rows)
