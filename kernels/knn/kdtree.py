"""Array-based KD-tree (structure of arrays) with CPU (numba) and GPU (CuPy) backends.

This module holds the public API (build, pack, query) and its argument checks; the numba build
and searches are in :mod:`scanforest.kernels.knn._kdtree_cpu`, the CUDA ones in
:mod:`scanforest.kernels.knn._kdtree_gpu`.

Layout (same on both devices, nodes numbered breadth first):

* ``child[i]``: index of the left child (the right child is ``child[i] + 1``), ``-1`` for a leaf;
* ``split_dim[i]``, ``split_val[i]``: a point goes left when ``x[split_dim] <= split_val``;
* ``start[i]``, ``end[i]``: the node's points are ``perm[start:end]`` (every node, not only the
  leaves, owns a contiguous range because each level is a stable partition of its parent range);
* ``lo[i]``, ``hi[i]``: the tight axis-aligned bounding box of the node's points (``(n_nodes, d)``);
* ``perm``: point ids ordered leaf by leaf; ``points`` = ``X[perm]`` (rows contiguous per leaf).

Split rule (Hu 2017, Ch. 3-4): the dimension of largest box extent, cut at the box midpoint
``0.5 lo + 0.5 hi``. When the midpoint rounds onto ``hi`` (``lo`` and ``hi`` adjacent floats) the
cut moves to ``lo`` so both children are non-empty; a node whose box has zero extent (all its
points equal) or that reaches ``max_depth`` stays a leaf, so duplicates never loop. The
randomized variant (``random_dims=F``) picks the split dimension uniformly among the F widest
(ties by smaller dimension) with a counter-based hash of ``(seed, node)``, so the CPU and GPU
builds give the same tree.

The midpoint rule degenerates on skewed data such as real SHOT352 descriptors (most bins zero, a
few large values): the widest dimension is the one with a lone outlier, each cut peels off a
few points, and ``max_depth`` is reached with leaves of 10^5 points (measured: P-BANNS 15x slower
than the brute force on the SHOT descriptors of the PCL clouds). The sample rules look at a
fixed sample of the node (``S = min(count, 64)`` points at positions ``start + k * count // S``
of the node's range):

* ``split="variance"`` (default; FLANN's rule on a sample): the dimension of largest sample
  variance (the F largest for the randomized variant; dimensions whose sample has zero extent
  never count), cut at the sample mean. Mean and variance are float32 sums in sample order
  (``sum(x) / S``, then ``sum((x - mean)**2)``); a mean outside ``[sample min, node max)`` (by
  rounding) moves to the sample minimum, so both children are non-empty. On the SHOT
  descriptors of the PCL clouds (200k indexed, 4 trees, 32-point leaves) recall@4 at 128 leaves
  per query rose from 0.840 (median) to 0.963 at the same speed; on the synthetic clustered
  data from 0.814 to 0.883 at 32 leaves.
* ``split="median"``: the dimension of largest sample extent (F widest for the randomized
  variant), cut at the sample median (the ``S // 2``-th smallest value; when that is the node's
  maximum, the largest smaller sample value).

Every step is a correctly rounded float operation in a fixed order, so the CPU and GPU builds
stay bit-identical. When the sample has zero extent in every dimension the node falls back to
the midpoint rule. ``split="midpoint"`` keeps the paper's rule.

Search: P-ANNS (per query: descend to the nearest leaf pushing far siblings on a bounded
min-heap, scan leaves, pop the closest box, stop when the heap is empty, the popped box is
farther than the current P-th distance, or ``backtracks`` leaves were scanned)
and, on the GPU, P-BANNS (:mod:`scanforest.kernels.knn._kdtree_gpu`). Distances are the canonical
float32 squared L2 of :mod:`scanforest.kernels.knn.bruteforce`, so with an unlimited budget the
searches return exactly the brute-force answer, ties included.

Descent bounds (``descent=``): ``"box"`` pushes each far sibling met while descending with its
box distance (O(d) per level). ``"path"``: a popped node P gets its box distance D_P (O(d), once
per descent); a far sibling met below it is pushed with ``(D_P - c_s + e_s) * PATH_SAFE``,
where ``c_s`` is P's box term on the split dimension ``s`` and ``e_s`` the term of P's interval
cut by the split (the far child's box lies in P's box on the far side of the cut): O(1) per
level instead of the O(d) box distance of every far child. It is a lower bound of the far
child's box distance (the factor covers float32 rounding), so pruning stays exact. A popped node
whose D_P exceeds the current P-th distance is dropped without descending. On SHOT352 "path"
is faster than "box": at the same recall 1.5x (32-point leaves) to 2-2.5x (8-point leaves) on 2
CPU threads with 4 trees; on one H100, P-BANNS over 1.15M rows is 1.1-1.8x faster at budgets of
32-128 leaves and 1.0-1.3x at 256. ``"incremental"`` (the default) takes the popped node's
queue key, itself such a lower bound, for D_P: a descent reads no box at all (FLANN's and Arya
and Mount's incremental distance, with the popped box's interval on each split dimension).
The bounds are looser (recall at the same budget 0.003-0.01 lower), the descent is O(depth):
on one H100 (1.07M SHOT352 rows, 20k queries, P-BANNS in rounds of 128 leaves) 1.6-2.2x the
queries/s of "path" at 128-512 leaves; on 2 CPU threads (200k rows) 1.1-1.2x at the same
budget.

Forests (:func:`build_kdforest`): T randomized trees over the same points (seeds ``seed + t``)
packed into one :class:`KDTree` whose ``roots`` lists the root of every tree. The search starts
with every root in the query's heap, so ONE priority queue orders the pending boxes of all trees
(FLANN's replicated forest) and ``backtracks`` counts leaves over all trees; a point met through
a second tree is not inserted twice (same (distance, id) key).

Bounded search (``bounds=``): a per-query squared distance B (the global P-th distance known from
other shards). Boxes with distance >= B are pruned (pushing, popping, and the near child of a
descent) and only points with distance < B are returned, the rest of the row is ``(inf, -1)``.
"""
from __future__ import annotations

import numpy as np

from ..backend import resolve_device, to_numpy
from ..errors import InputError
from ._kdtree_common import DESCENT_IDS, RULE_IDS, KDTree
from ._kdtree_cpu import BEAM_MAX, _anns_cpu, _banns_cpu, _build_cpu
from .bruteforce import check_k, check_points, exact_scan_ids

__all__ = ["KDTree", "build_kdtree", "build_kdforest", "pack_forest", "query_kdtree", "check_bounds",
           "HEAP_CAP", "MAX_HEAP_CAP", "heap_capacity", "DEFAULT_MAX_DEPTH"]

HEAP_CAP = 256          # least capacity of the per-query priority queue of pending boxes
MAX_HEAP_CAP = 2048     # the most it is given for a budget (16 KB per query on a GPU)
DEFAULT_MAX_DEPTH = 64  # nodes at this depth stay leaves
MAX_RANDOM_DIMS = 32
SPLIT_RULES = ("variance", "median", "midpoint")


def check_split(split):
    if split not in SPLIT_RULES:
        raise InputError(f"split must be one of {', '.join(SPLIT_RULES)}, got {split!r}")
    return split


def _check_build_params(leaf_size, max_depth, random_dims, seed):
    if isinstance(leaf_size, bool) or not isinstance(leaf_size, (int, np.integer)) or leaf_size < 1:
        raise InputError(f"leaf_size must be an integer >= 1, got {leaf_size!r}")
    if max_depth is None:
        max_depth = DEFAULT_MAX_DEPTH
    if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)) or max_depth < 0:
        raise InputError(f"max_depth must be an integer >= 0 or None, got {max_depth!r}")
    if random_dims is None:
        rand_f = 0
    elif isinstance(random_dims, bool) or not isinstance(random_dims, (int, np.integer)) or \
            not 1 <= random_dims <= MAX_RANDOM_DIMS:
        raise InputError(f"random_dims must be None or an integer in 1..{MAX_RANDOM_DIMS}, got {random_dims!r}")
    else:
        rand_f = int(random_dims)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be an integer >= 0, got {seed!r}")
    return int(leaf_size), int(max_depth), rand_f, int(seed)


def build_kdtree(X, *, leaf_size: int = 64, max_depth: int | None = None, random_dims: int | None = None,
                 seed: int = 0, split: str = "variance", device: str = "auto", leaf_rows: bool = True) -> KDTree:
    """Build the array KD-tree of ``X``.

    Parameters
    ----------
    X : (N, d) array_like
        Points (numpy or CuPy, converted to float32; no NaN/inf).
    leaf_size : int, keyword-only
        A node with more than ``leaf_size`` points is split.
    max_depth : int, optional
        Nodes at this depth stay leaves (default 64).
    random_dims : int, optional
        ``None``: split on the best dimension of the rule (largest sample variance, sample
        extent or box extent). ``F``: split on a dimension drawn among the F best, seeded by
        ``seed`` and the node id.
    seed : int
        Seed of the randomized variant.
    split : {"variance", "median", "midpoint"}
        ``"variance"`` (default): dimension of largest variance of a 64-point sample of the
        node, cut at the sample mean (FLANN's rule, on a sample). ``"median"``: dimension of
        largest sample extent, cut at the sample median. ``"midpoint"``: widest box dimension cut
        at the box midpoint (the paper's rule). See the module docstring.
    device : {"auto", "cpu", "gpu"}
    leaf_rows : bool
        ``False``: the tree's arrays only (``points`` and ``data`` are None, the tree cannot be
        searched): what writing an index to a store needs, with no second copy of the rows.

    Returns
    -------
    KDTree
    """
    dev = resolve_device(device, X)
    leaf_size, max_depth, rand_f, seed = _check_build_params(leaf_size, max_depth, random_dims, seed)
    rule = RULE_IDS[check_split(split)]
    params = dict(leaf_size=leaf_size, max_depth=max_depth, random_dims=rand_f or None, seed=seed, split=split)
    if dev == "gpu":
        import cupy as cp

        from . import _kdtree_gpu

        X = check_points(cp.asarray(X), "X", xp=cp)
        return _kdtree_gpu.build(X, leaf_size, max_depth, rand_f, seed, params, rule=rule,
                                 leaf_rows=leaf_rows)
    X = check_points(to_numpy(X), "X", xp=np)
    perm, child, sdim, sval, start, end, lo, hi, depth = _build_cpu(X, leaf_size, max_depth, rand_f, seed, rule)
    return KDTree("cpu", np.ascontiguousarray(X[perm]) if leaf_rows else None, perm, child, sdim, sval, start,
                  end, lo, hi, depth, leaf_size, params, data=X if leaf_rows else None)


def _check_n_trees(n_trees):
    if isinstance(n_trees, bool) or not isinstance(n_trees, (int, np.integer)) or n_trees < 1:
        raise InputError(f"n_trees must be an integer >= 1, got {n_trees!r}")
    return int(n_trees)


def pack_forest(trees) -> KDTree:
    """Pack trees built over the same points into one :class:`KDTree` searched as a forest.

    Node arrays are concatenated (child ids and point ranges shifted per tree), ``points`` and
    ``perm`` are the trees' leaf-ordered rows one after the other (T x N rows) and ``roots``
    holds the root node of every tree. A search then keeps ONE priority queue over the boxes of
    all trees (FLANN's replicated forest), and a point reached through several trees counts once.
    """
    trees = list(trees)
    if not trees:
        raise InputError("pack_forest needs at least one tree")
    t0 = trees[0]
    if len(trees) == 1:
        return t0
    n = t0.n_points
    for t in trees[1:]:
        if t.device != t0.device or t.n_points != n or t.n_dims != t0.n_dims or t.n_trees != 1 \
                or (t.points is None) != (t0.points is None):
            raise InputError("pack_forest: every tree must be a single tree over the same points on one device")
    if t0.device == "gpu":
        import cupy as xp
    else:
        xp = np
    offs = np.cumsum([0] + [t.n_nodes for t in trees[:-1]])
    child = xp.concatenate([xp.where(t.child >= 0, t.child + int(o), -1).astype(xp.int32)
                            for t, o in zip(trees, offs)])
    start = xp.concatenate([t.start + i * n for i, t in enumerate(trees)])
    end = xp.concatenate([t.end + i * n for i, t in enumerate(trees)])
    cat = {name: xp.concatenate([getattr(t, name) for t in trees])
           for name in ("perm", "split_dim", "split_val", "lo", "hi")}
    cat["points"] = None if t0.points is None else xp.concatenate([t.points for t in trees])
    params = dict(t0.params, n_trees=len(trees))
    return KDTree(t0.device, start=start, end=end, child=child, depth=max(t.depth for t in trees),
                  leaf_size=t0.leaf_size, params=params, data=t0.data,
                  roots=xp.asarray(offs, dtype=xp.int32), **cat)


def build_kdforest(X, *, n_trees: int = 1, leaf_size: int = 64, max_depth: int | None = None,
                   random_dims: int | None = None, seed: int = 0, split: str = "variance",
                   device: str = "auto", leaf_rows: bool = True) -> KDTree:
    """Build ``n_trees`` randomized KD-trees over the same points, packed for a shared-queue search.

    Tree ``t`` is ``build_kdtree(X, random_dims=random_dims, seed=seed + t, ...)``; the trees
    are packed by :func:`pack_forest` (T copies of the points, leaf ordered per tree). With
    ``n_trees=1`` this is exactly :func:`build_kdtree`.

    Parameters
    ----------
    X : (N, d) array_like
    n_trees : int, keyword-only
        Number of trees (``>= 1``). ``n_trees > 1`` needs ``random_dims >= 2`` (otherwise every
        tree would be the same tree).
    leaf_size, max_depth, random_dims, seed, split, device, leaf_rows
        As in :func:`build_kdtree`.
    """
    n_trees = _check_n_trees(n_trees)
    leaf_size, max_depth, rand_f, seed = _check_build_params(leaf_size, max_depth, random_dims, seed)
    if n_trees > 1 and rand_f < 2:
        raise InputError(f"n_trees={n_trees} needs random_dims >= 2 (random_dims={random_dims!r} makes every "
                         "tree identical)")
    if resolve_device(device, X) == "gpu":  # validated and on its device once, not once per tree
        import cupy as cp

        X = check_points(cp.asarray(X), "X", xp=cp)
    else:
        X = check_points(to_numpy(X), "X", xp=np)
    trees = [build_kdtree(X, leaf_size=leaf_size, max_depth=max_depth, random_dims=rand_f or None,
                          seed=seed + t, split=split, device=device, leaf_rows=leaf_rows)
             for t in range(n_trees)]
    forest = pack_forest(trees)
    forest.params["seed"] = seed
    return forest


def check_bounds(bounds, m: int, xp=np):
    """Validate per-query bounds ((M,) squared distances, ``inf`` = none) -> float32 on ``xp``."""
    if bounds is None:
        return None
    b = xp.asarray(bounds)
    if b.ndim == 0:
        b = xp.full(m, b, dtype=xp.float32)
    if b.shape != (m,):
        raise InputError(f"bounds must have shape ({m},) (one squared distance per query), got {tuple(b.shape)}")
    if b.dtype.kind not in "fiu":
        raise InputError(f"bounds must be a float array, got dtype {b.dtype}")
    b = b.astype(xp.float32)
    if bool(xp.isnan(b).any()):
        raise InputError("bounds contains NaN (use inf for 'no bound')")
    if bool((b < 0).any()):
        raise InputError("bounds must be >= 0 (squared distances; inf for 'no bound')")
    return b


def _bound_limit(bounds, m: int, xp=np):
    """Largest admissible box/point distance per query: the float just below the bound (strict)."""
    if bounds is None:
        return xp.full(m, np.inf, dtype=xp.float32)
    lim = xp.nextafter(bounds, xp.full_like(bounds, -np.inf)).astype(xp.float32)
    lim[xp.isinf(bounds)] = np.inf
    return lim



def _check_budget(backtracks):
    if backtracks is None:
        return 0
    if isinstance(backtracks, bool) or not isinstance(backtracks, (int, np.integer)) or backtracks < 1:
        raise InputError(f"backtracks must be None (unlimited: exact) or an integer >= 1, got {backtracks!r}")
    return int(backtracks)


def heap_capacity(budget: int, heap_cap: int | None = None) -> int:
    """Capacity of a query's queue of pending boxes for a leaf budget (0: unlimited).

    A full queue drops its farthest box, and a dropped box is never searched: at 50M rows the
    fixed 256 boxes capped recall@4 at 0.81 whatever the budget (1,536 and 2,048 leaves), as
    deep descents push more siblings than that. The default grows with the budget, the next
    power of two of it, within [``HEAP_CAP``, ``MAX_HEAP_CAP``] (unlimited: 1,024, and an
    overflowing exact query is redone by brute force); ``heap_cap`` sets it.
    """
    if heap_cap is not None:
        if isinstance(heap_cap, bool) or not isinstance(heap_cap, (int, np.integer)) or not 8 <= heap_cap <= 1 << 16:
            raise InputError(f"heap_cap must be an integer in [8, 65536], got {heap_cap!r}")
        return int(heap_cap)
    if budget <= 0:
        return 1024
    return int(min(MAX_HEAP_CAP, max(HEAP_CAP, 1 << (int(budget) - 1).bit_length())))


#: how a descent bounds the far children it pushes (``query_kdtree``'s ``descent``)
DESCENTS = ("auto", "box", "path", "incremental", "beam")  # DESCENT_IDS: the kernels' number of the bounds


def resolve_descent(descent: str) -> str:
    """``"auto"`` -> ``"incremental"`` (see the module docstring; a :class:`~.kdforest.KDForest`
    resolves ``"auto"`` per device itself); an unknown name is an InputError."""
    if descent not in DESCENTS:
        raise InputError(f"descent must be one of {', '.join(DESCENTS)}, got {descent!r}")
    return "incremental" if descent == "auto" else descent


def _uses_beam(descent: str, method: str, budget: int, per_round: int, n_roots: int) -> bool:
    """Whether a search with the resolved ``descent`` takes its leaves by the beam: P-BANNS whose
    whole budget fits one round of several leaves (``2 <= budget <= min(leaves_per_round,
    BEAM_MAX)``) over at most ``BEAM_MAX`` trees; any other search with ``"beam"`` descends
    ``"incremental"``-ly, from a queue."""
    return descent == "beam" and method == "banns" and 2 <= budget <= min(per_round, BEAM_MAX) and n_roots <= BEAM_MAX


#: P-BANNS's default leaves per query and round (``query_kdtree``'s ``leaves_per_round``)
LEAVES_PER_ROUND = 128


def resolve_leaves_per_round(leaves_per_round, method: str, budget: int, sliding_window, d: int) -> int:
    """Leaves a query takes per round: 1 for P-ANNS; for P-BANNS ``leaves_per_round`` (default
    :data:`LEAVES_PER_ROUND`), at most the budget. Batched rounds scan with the GPU's stream leaf
    kernel: with another kernel (or d > 2,560, where it does not fit) the default is 1 and more
    is an InputError. The same on both devices, so they return the same answer."""
    if leaves_per_round is not None and (isinstance(leaves_per_round, bool)
                                         or not isinstance(leaves_per_round, (int, np.integer))
                                         or leaves_per_round < 1):
        raise InputError(f"leaves_per_round must be None or an integer >= 1, got {leaves_per_round!r}")
    if method != "banns":
        if leaves_per_round not in (None, 1):
            raise InputError("leaves_per_round applies to method='banns' (P-ANNS takes one leaf at a time)")
        return 1
    from . import _kdtree_gpu

    streams = sliding_window is True or sliding_window == "stream"
    if streams and sliding_window is True:
        streams = _kdtree_gpu.WINDOW_KERNEL == "stream"
    streams = streams and _kdtree_gpu.stream_fits(d)
    if leaves_per_round is None:
        leaves_per_round = LEAVES_PER_ROUND if streams else 1
    elif leaves_per_round > 1 and not streams:
        raise InputError("leaves_per_round > 1 needs the stream leaf kernel (sliding_window=True or 'stream', "
                         f"d <= 2560; got sliding_window={sliding_window!r}, d={d})")
    return int(min(leaves_per_round, budget) if budget > 0 else leaves_per_round)


def query_kdtree(tree: KDTree, queries, k: int, *, method: str = "anns", backtracks: int | None = None,
                 sliding_window: bool | str = True, finish_below: int | None = None, bounds=None,
                 return_stats: bool = False, heap_cap: int | None = None, descent: str = "auto",
                 leaves_per_round: int | None = None):
    """The ``k`` nearest indexed points of every query (squared L2, ascending, ties by id).

    Parameters
    ----------
    tree : KDTree
        From :func:`build_kdtree` or :func:`build_kdforest`; the search runs on ``tree.device``.
        A packed forest is searched with ONE priority queue over the boxes of all its trees
        (the closest pending box of any tree is scanned next) and one budget; a point reached
        through several trees is returned once.
    queries : (M, d) array_like
    k : int
        ``1 <= k <= min(N, 256)``.
    method : {"anns", "banns"}, keyword-only
        ``"anns"``: one query per thread with a private priority queue (CPU and GPU).
        ``"banns"``: buffered rounds with per-leaf query buckets, on both devices: each round
        every query takes ``leaves_per_round`` leaves, and each leaf is scanned once for all the
        queries that took it (on the CPU its rows stay in cache from one query to the next);
        the same leaves and the same answer on both devices.
    backtracks : int or None
        Maximum number of leaves scanned per query (over all trees of a forest); ``None``
        means unlimited, which returns the exact brute-force answer.
    sliding_window : bool or {"stream", "rotate", "tile"}
        P-BANNS only: a block per leaf with its buffered queries staged in shared memory (True:
        ``_kdtree_gpu.WINDOW_KERNEL``, default ``"stream"``; or name the kernel: ``"rotate"``/
        ``"tile"`` are the paper's rotating windows) or the naive per-thread global-memory scan
        (False). Every kernel returns the same answer.
    finish_below : int, optional
        P-BANNS only: when at most this many queries are still active they are finished by exact
        brute force (default ``max(32, M // 256)``).
    bounds : (M,) array_like of float32, optional
        Per-query initial bound on the squared distance (``inf``: none), e.g. the global P-th
        distance already known from other shards. Boxes not closer than the bound are pruned and
        only points strictly closer than the bound are returned; missing slots are ``(inf, -1)``.
        With bounds >= the true k-th distance (strictly above it when ties matter) and an
        unlimited budget the answer is still exact.
    heap_cap : int, optional
        Capacity of each query's queue of pending boxes (default :func:`heap_capacity` of the
        budget; the same on both devices, so they return the same answer).
    descent : {"auto", "box", "path", "incremental", "beam"}
        How a far child met while descending is bounded (see the module docstring): ``"box"``,
        its box distance (O(d) per level); ``"path"``, the O(1) bound from the popped box's
        distance (O(d) once per descent); ``"incremental"``, the O(1) bound from the popped
        box's queue key (no O(d) work in a descent); ``"beam"``, P-BANNS whose budget fits one
        round (``2 <= backtracks <= min(leaves_per_round, 128)``, at most 128 trees) takes its
        leaves level by level instead of from a queue: at each level every box kept becomes
        its near child (its key) and its far child (the incremental bound), and the B boxes of the
        smallest (key, node) stay (B the budget), until all are leaves; a GPU warp a query
        where the queue takes a thread a query and a chain of dependent pops. A
        box's key is that of the leaf its near children lead to, so the beam keeps the
        ancestors of the B leaves of the smallest keys, as the queue takes them, up to the few
        ulps by which ``PATH_SAFE`` can set a far child's bound below its parent's key and ties
        of equal keys, which the beam breaks by node and the queue by its heap order (one tree:
        the same lists on 99.95-100% of queries in our checks; a forest, where every tree's
        nearest leaf has the key 0 when the query is inside the roots' boxes, takes other
        leaves among those ties at small budgets, at the same recall). Any other search
        with ``"beam"`` descends ``"incremental"``-ly. ``"auto"`` is ``"incremental"``. All are
        exact with an unlimited budget; for the same ``descent`` the two devices return the
        same answer.
    leaves_per_round : int, optional
        P-BANNS only: leaves a query takes per round, all chosen against the pruning distance
        of the round's start, then scanned together, each leaf once for every query that took
        it (default :data:`LEAVES_PER_ROUND`, at most the budget). 1 is the paper's P-BANNS
        (one leaf per query and round). More leaves per round cost fewer rounds (a budget of B
        takes ceil(B / L)) and give each leaf more queries to share its reads; a query may scan
        a leaf that a fresher pruning distance would have skipped (the answer can only improve;
        with an unlimited budget it is exact). The CPU runs the same rounds per query, so both
        devices return the same answer. Needs the stream leaf kernel (see
        :func:`resolve_leaves_per_round`).

        On the GPU over float16 rows (a float16 index; d a multiple of 16 up to 512, k <= 16)
        these rounds score a leaf's rows against its queries on tensor cores (half x half ->
        float) and compute the canonical distance only of the rows whose estimate, within a
        rigorous rounding bound (``_kdtree_gpu.mma_eps``), could enter a list: the same answer,
        bit for bit (``_kdtree_gpu.MMA_FILTER``).
    return_stats : bool
        Also return a dict of search statistics: ``heap_overflow`` (queries whose bounded queue
        dropped a box), ``leaves_visited`` ((M,) int32 numpy, leaves scanned per query; P-BANNS
        queries finished by brute force count only the leaves scanned before), and for P-BANNS
        the round and phase timings (with tensor-core scoring also ``mma_rows_reranked``, the
        rows given their canonical distance, and its phases ``ms_mma_*``, inside
        ``ms_leaf_scan``).
    """
    if not isinstance(tree, KDTree):
        raise InputError("tree must be a KDTree from build_kdtree()")
    if tree.device == "gpu":
        import cupy as cp

        queries = check_points(cp.asarray(queries), "queries", dim=tree.n_dims, xp=cp)
    else:
        queries = check_points(to_numpy(queries), "queries", dim=tree.n_dims, xp=np)
    return _query_checked(tree, queries, k, method=method, backtracks=backtracks, sliding_window=sliding_window,
                          finish_below=finish_below, bounds=bounds, return_stats=return_stats, heap_cap=heap_cap,
                          descent=descent, leaves_per_round=leaves_per_round)


def _query_checked(tree, queries, k, *, method, backtracks, sliding_window, finish_below=None, bounds=None,
                   return_stats=False, heap_cap=None, descent="auto", leaves_per_round=None):
    """:func:`query_kdtree` of ``queries`` already checked (C-contiguous float32 on the tree's
    device, finite, ``tree.n_dims`` wide): what a :class:`~.kdforest.KDForest` search calls
    after its own check of the same array (a check is a pass over the queries and a host sync)."""
    if method not in ("anns", "banns"):
        raise InputError(f"method must be 'anns' or 'banns', got {method!r}")
    if not (isinstance(sliding_window, (bool, np.bool_)) or sliding_window in ("stream", "rotate", "tile")):
        raise InputError(f"sliding_window must be a bool or one of 'stream', 'rotate', 'tile', got {sliding_window!r}")
    budget = _check_budget(backtracks)
    cap = heap_capacity(budget, heap_cap)
    descent = resolve_descent(descent)
    per_round = resolve_leaves_per_round(leaves_per_round, method, budget, sliding_window, tree.n_dims)
    roots = tree.roots
    beam = _uses_beam(descent, method, budget, per_round, 1 if roots is None else int(roots.shape[0]))
    if descent == "beam":  # its queue, where a search has one: the incremental bound's
        descent = "incremental"
    if tree.device == "gpu":
        import cupy as cp

        from . import _kdtree_gpu

        k = check_k(k, tree.n_points)
        b = check_bounds(bounds, queries.shape[0], xp=cp)
        lim = _bound_limit(b, queries.shape[0], xp=cp)
        if roots is None:
            roots = cp.zeros(1, cp.int32)
        if method == "banns":  # lim None: no bounds (every query has a root to search)
            res = _kdtree_gpu.banns(tree, queries, k, budget, sliding_window, finish_below, roots=roots,
                                    lim=None if b is None else lim, hcap=cap, descent=descent,
                                    leaves_per_round=per_round, beam=beam)
        else:
            res = _kdtree_gpu.anns(tree, queries, k, budget, roots=roots, lim=lim, hcap=cap, descent=descent)
        if b is not None:
            drop = res[0] > lim[:, None]
            res[0][drop] = cp.inf
            res[1][drop] = -1
        return res if return_stats else res[:2]
    k = check_k(k, tree.n_points)
    m = queries.shape[0]
    b = check_bounds(None if bounds is None else to_numpy(bounds), m, xp=np)
    lim = _bound_limit(b, m, xp=np)
    roots = np.zeros(1, np.int32) if roots is None else np.ascontiguousarray(roots, dtype=np.int32)
    out_d = np.empty((m, k), np.float32)
    out_i = np.empty((m, k), np.int64)
    ovf = np.zeros(m, np.bool_)
    visits = np.zeros(m, np.int32)
    points = tree.points if tree.points.dtype == np.float32 else tree.points.astype(np.float32)  # half rows
    if method == "banns" and per_round > 1 and m:  # one leaf a round is P-ANNS's order: the same answer
        out_d, out_i, ovf, visits = _banns_cpu(tree, points, queries, lim, k, budget, cap, DESCENT_IDS[descent],
                                               per_round, beam)
    else:
        _anns_cpu(points, tree.perm, tree.child, tree.split_dim, tree.split_val, tree.start, tree.end, tree.lo,
                  tree.hi, roots, queries, lim, k, budget, cap, out_d, out_i, ovf, visits, DESCENT_IDS[descent],
                  per_round)
    n_ovf = int(ovf.sum())
    if n_ovf and budget == 0:
        # queue overflow lost boxes: redo those queries exactly (canonical scan of the first tree)
        idx = np.nonzero(ovf)[0]
        n = tree.n_points
        d2, i2 = exact_scan_ids(points[:n], tree.perm[:n], queries[idx], k)
        drop = d2 > lim[idx, None]
        d2[drop] = np.inf
        i2[drop] = -1
        out_d[idx] = d2
        out_i[idx] = i2
    stats = {"heap_overflow": n_ovf, "leaves_visited": visits}
    return (out_d, out_i, stats) if return_stats else (out_d, out_i)


