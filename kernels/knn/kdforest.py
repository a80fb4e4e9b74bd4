"""scikit-learn-style nearest-neighbour index over the array KD-tree (CPU and GPU)."""
from __future__ import annotations

import time

import numpy as np

from ..backend import is_cupy, resolve_device
from ..errors import InputError
from ..validation import integer
from .bruteforce import MAX_K, ExactSearch, check_k, check_points
from .kdtree import (_bound_limit, _check_budget, _check_build_params, _check_n_trees, _query_checked, build_kdforest,
                     check_split, check_bounds, heap_capacity, resolve_descent)

__all__ = ["KDForest", "merge_topk_unique"]

METHODS = ("banns", "anns", "exact")  # search methods, in the order of the docs
_METHODS = METHODS
_UNSET = object()

#: what ``KDForest()`` builds on each device when ``n_trees`` / ``leaf_size`` are left None, and
#: how it descends with ``descent="auto"`` (the measurements behind each value are in the class
#: docstring and docs/benchmarks.md)
DEVICE_DEFAULTS = {"cpu": {"n_trees": 4, "leaf_size": 32, "descent": "incremental"},
                   "gpu": {"n_trees": 1, "leaf_size": 64, "descent": "beam"}}
#: rows of the index a ``recall=`` calibration queries (leave-one-out), drawn with this seed
CALIBRATION_ROWS = 2000
CALIBRATION_SEED = 0
#: the first budget (leaves per query) a calibration tries, doubled until the target is met
CALIBRATION_START = 8


#: the precisions a budgeted search may score rows in (``KDForest(scan_dtype=...)``)
SCAN_DTYPES = ("float32", "float16")
#: half's largest finite value: rows scanned in half must lie within it
HALF_MAX = 65504.0

#: scored (query, row) pairs a graph round or a graph build handles at a time
GRAPH_CHUNK_PAIRS = 1 << 23


def _check_graph(f) -> None:
    """The graph parameters of a :class:`KDForest` (one line naming the bad one)."""
    def whole(v):
        return not isinstance(v, bool) and isinstance(v, (int, np.integer))

    if f.graph_degree is not None and (not whole(f.graph_degree) or not 1 <= f.graph_degree <= 256):
        raise InputError(f"graph_degree must be an integer in 1..256 or None (no graph), got {f.graph_degree!r}")
    if not whole(f.graph_expand) or not 1 <= f.graph_expand <= 256:
        raise InputError(f"graph_expand must be an integer in 1..256, got {f.graph_expand!r}")
    if not whole(f.graph_rounds) or not 0 <= f.graph_rounds <= 16:
        raise InputError(f"graph_rounds must be an integer in 0..16, got {f.graph_rounds!r}")
    if f.graph_budget is not None and (not whole(f.graph_budget) or f.graph_budget < 1):
        raise InputError(f"graph_budget must be a positive leaf count or None (exact neighbours), "
                         f"got {f.graph_budget!r}")


def _check_scan_dtype(value) -> None:
    if value not in SCAN_DTYPES:
        raise InputError(f"scan_dtype must be one of {SCAN_DTYPES}, got {value!r}")


def _check_half_range(X) -> None:
    """Rows a half-precision scan rounds must lie within half's range: one line otherwise."""
    big = max(float(X.max()), -float(X.min())) if X.size else 0.0  # no copy of the rows
    if not big < HALF_MAX:
        raise InputError(f"scan_dtype='float16' needs rows within half's range (|x| < {HALF_MAX:g}); these reach "
                         f"{big:g}: use scan_dtype='float32' or scale the rows")


def _next_seeds(ids, done, exclude, e: int, xp):
    """The first ``e`` entries of each list ``ids`` ((M, c) int64) that a graph round has not
    expanded yet: neither empty, nor in ``done[r]`` (the ids earlier rounds expanded), nor
    ``exclude[r]`` (a leave-one-out's own row); -1 where a list holds fewer. Also a row's graph
    neighbours: its search's answer without its own id."""
    c = int(ids.shape[1])
    used = ids < 0
    if exclude is not None:
        used |= ids == exclude[:, None]
    if done is not None and done.shape[1]:
        used |= (ids[:, :, None] == done[:, None, :]).any(axis=2)
    key = used.astype(xp.int64) * (c + 1) + xp.arange(c, dtype=xp.int64)[None, :]
    order = xp.argsort(key, axis=1)[:, :e]
    seeds = xp.take_along_axis(ids, order, axis=1)
    return xp.where(xp.take_along_axis(used, order, axis=1), -1, seeds)


def resolve_defaults(device: str, d: int, n_trees=None, leaf_size=None) -> tuple[int, int]:
    """``(n_trees, leaf_size)`` of a forest on ``device`` over ``d``-dimensional rows: the given
    values, or :data:`DEVICE_DEFAULTS` for those left None. A defaulted tree count is 1 on
    one-dimensional rows (randomized trees need ``random_dims >= 2``)."""
    dflt = DEVICE_DEFAULTS["gpu" if device == "gpu" else "cpu"]
    if n_trees is None:
        n_trees = dflt["n_trees"] if d >= 2 else 1
    return int(n_trees), int(dflt["leaf_size"] if leaf_size is None else leaf_size)


def check_recall(recall, name: str = "recall") -> float:
    """A recall target: a float in (0, 1); ``name``: the parameter the error names."""
    if isinstance(recall, bool) or not isinstance(recall, (int, float, np.integer, np.floating)) \
            or not 0.0 < float(recall) < 1.0:
        raise InputError(f"{name} must be a number in (0, 1) (the recall@k the search budget is calibrated for; "
                         f"leave it out for an exact search), got {recall!r}")
    return float(recall)


class KDForest:
    """Approximate (or exact) k-nearest-neighbour index on KD-trees, CPU or GPU.

    Parameters
    ----------
    n_trees : int or None, default None
        Number of randomized trees over the SAME points (FLANN-style replicated forest). Tree
        ``t`` uses the seed ``seed + t``. The search keeps ONE priority queue per query over the
        boxes of all trees (the closest pending box of any tree is scanned next), so the trees
        share one budget of ``backtracks`` leaves; a point found through several trees counts
        once. Memory: T copies of the points. ``None``: the default of the device the index is
        fitted on (:data:`DEVICE_DEFAULTS`, resolved in :meth:`fit` into ``n_trees_``):
        4 on the CPU, 1 on the GPU. CPU: on held-out SHOT352 of the PCL clouds (200k indexed,
        2,000 queries, 2 threads, recall@4 >= 0.9; docs/benchmarks.md, 2026-11-28) 4 trees of
        32-row leaves at 56 leaves per query ran 3,198 queries/s (median of three interleaved
        rounds) against 2,259 for 1 tree of 64 (64 leaves), 2,890 for 4 x 64 (36 leaves),
        2,305 for 2 x 64, 2,229 for 8 x 16 and FLANN's default 4-tree index's 2,059 (448
        checks): 1.55x FLANN, where 1 x 64 was 1.10x; ``bench tools`` the same day: 1.90x
        (2,122 against 1,118 queries/s). The CPU memory is 4 copies of the rows.
        GPU: one tree, unchanged (on one H100 one tree was the faster forest at every recall
        measured, docs/benchmarks.md, 2026-11-26).
    leaf_size : int or None, default None
        Maximum number of points in a leaf. ``None``: the device's default (``leaf_size_``):
        32 on the CPU (the measurement above: 16- and 64-row leaves were slower at 4 trees), 64
        on the GPU (unchanged).
    backtracks : int or None, default None
        Maximum number of leaves scanned per query. ``None`` means unlimited: the search is
        exact (identical to brute force, ties by id). Or leave the budget to the index: give
        :meth:`fit` or :meth:`query` a ``recall=`` target instead (not both).
    method : {"banns", "anns", "exact"}, default "banns"
        P-BANNS (buffered rounds, each leaf scanned once for the queries that take it; both
        devices), P-ANNS (one query per thread), or the exact GEMM brute force.
    random_dims : int or None, default None
        ``None``: split on the best dimension of the rule (see ``split``) when ``n_trees == 1``,
        and on one of the ``min(5, d)`` best (the paper's and FLANN's F = 5) when ``n_trees > 1``.
        ``F`` in ``1..d``: split on a dimension drawn among the F best, seeded (``n_trees > 1``
        needs ``F >= 2``).
    seed : int, default 0
        Seed of the randomized split choice.
    device : {"auto", "cpu", "gpu"}, default "auto"
        ``auto`` follows the array type given to :meth:`fit`.
    max_depth : int or None, default None
        Nodes at this depth stay leaves (default 64).
    sliding_window : bool, default True
        P-BANNS leaf kernel: queries staged in shared memory per leaf block (the default
        streaming kernel, or the paper's rotating windows) or the plain per-thread scan.
    split : {"variance", "median", "midpoint"}, default "variance"
        Split rule: the mean of a 64-point sample of the node on the dimension of largest sample
        variance (FLANN's rule, on a sample), the sample median on the dimension of largest
        sample extent, or the box midpoint of the widest dimension (the paper's rule). See
        :mod:`scanforest.kernels.knn.kdtree`.
    heap_cap : int or None, default None
        Pending boxes each query's queue keeps (a full queue drops its farthest box). ``None``
        grows it with the budget (:func:`scanforest.kernels.knn.kdtree.heap_capacity`).
    descent : {"auto", "box", "path", "incremental", "beam"}, default "auto"
        How a descent bounds the far children it queues: their box distance, or an O(1) bound
        from the popped box or from its queue key; ``"beam"`` takes a budget that fits one
        round (at most ``leaves_per_round`` and 128 leaves) level by level, as many of the
        closest boxes kept at each level as the budget has leaves, a GPU warp a query, and
        descends ``"incremental"``-ly otherwise
        (:func:`scanforest.kernels.knn.kdtree.query_kdtree`). ``"auto"``:
        :data:`DEVICE_DEFAULTS` (``"beam"`` on the GPU, ``"incremental"`` on the CPU, where the
        beam's wider expansion costs more than the queue it saves). Both devices answer alike
        for the same value.
    leaves_per_round : int or None, default None
        P-BANNS: leaves a query takes per round, chosen together and scanned together (each
        leaf once for all the queries that took it); ``None``:
        :data:`scanforest.kernels.knn.kdtree.LEAVES_PER_ROUND`, 1 is the paper's P-BANNS. See
        :func:`scanforest.kernels.knn.kdtree.query_kdtree`.

    graph_degree : int or None, default None
        Also build a neighbour graph over the rows (:meth:`fit`): each row's ``graph_degree``
        nearest other rows, found by this forest's own search at ``graph_budget`` leaves a
        row (``graph_`` holds them, ``graph_stats_`` what the build took). A search with a
        budget then follows it: the forest's answer seeds the list, and in each of
        ``graph_rounds`` rounds the graph neighbours of the list's first ``graph_expand``
        entries not expanded in an earlier round are scored with the canonical distance and
        merged into it (a point counts once): a greedy walk like CAGRA's, from the forest's
        answer instead of random seeds (on the GPU every round of a query in one warp,
        :func:`._graph_gpu.walk`). The forest finds the neighbourhood, the graph the near points
        the budget left in unread leaves. On one H200 (SHOT352 of the PCL clouds, 1,150,847
        rows, 20k held-out queries, ``bench tools --graph 32 --graph-budget 512``,
        docs/benchmarks.md, 2026-11-29) one tree of 32-row leaves at 32 leaves plus 2 rounds of
        4 entries reached recall@4 0.951 at 1,919,823 queries/s (the forest alone: 256 leaves,
        0.955 at 530k; CAGRA in the same run 1,499,533 at 0.961), and 64 leaves plus 8 rounds
        of 4 entries 0.981 at 765,087 (CAGRA 607,076 at 0.987). The graph took 7.2 s to build
        there and 140 MiB (int32). On one H100 (2026-12-06, degree 64, the beam descent and the
        walk's wide row loads since): 2,446,493 queries/s at 0.951 (against CAGRA's fastest
        there, degree 32: 1.53x on an H200 the same day) and, on float16 rows, 1,225,151 at
        0.981 (1.43x CAGRA degree 64, batches of 10k 1.21x). On two CPU cores (200k rows, 4
        trees of 32) one round was 2.6x the forest alone at recall 0.9 and 0.95, its build 72 s
        against the trees' 8.6 s. A stored index keeps each shard's graph over its leaf-ordered
        rows (``index build --graph``, :meth:`graph_in_leaf_order`). The answer stays canonical:
        every distance is the brute force's for that pair, and an unlimited budget (the exact
        forest) is not expanded. ``None``: no graph.
    graph_expand : int, default 4
        List entries whose graph neighbours are scored in each round (the list kept between
        rounds holds ``max(k, graph_expand * graph_rounds)`` entries).
    graph_rounds : int, default 2
        Rounds of the expansion, each over the first entries no round has expanded yet (a
        greedy walk from the forest's answer, CAGRA's search with the forest for its seeds;
        0: the graph is kept but not followed). The defaults, 2 rounds of 4, find more than one
        round of 8 (the same rows offered) in about the same time, on one H200 (docs/benchmarks.md,
        2026-11-29): at 16 leaves 2,457,133 queries/s at recall@4 0.933 against 2,371,344 at
        0.921; at 32 leaves 1,919,823 at 0.951 against 1,923,739 at 0.945.
    graph_budget : int or None, default 128
        Leaves a row's graph search scans (None: exact neighbours, O(N^2 d)).
    scan_dtype : {"float32", "float16"}, default "float32"
        The precision of the rows a budgeted search scores. ``"float16"``: the leaves and the
        graph walk read the rows rounded to half precision (on a GPU stored as half: half the
        bytes every leaf scan and graph round reads; the CPU keeps the same rounded values in
        float32, so both devices answer alike), and each query's list (``max(2 k,
        graph_expand * graph_rounds)`` entries) is then re-ranked with the canonical distance
        to the float32 rows it keeps: the ``k`` returned are the nearest of the rows the search
        found, by their float32 distances. An unlimited budget is the float32 brute force.
        Rows must lie within half's range (|x| < 65504); ``bounds`` apply after the re-rank.

    Attributes
    ----------
    tree_ : KDTree or None
        The built tree, or for ``n_trees > 1`` the packed forest (``tree_.roots`` holds the
        root of every tree); None for ``method="exact"``.
    n_samples_fit_ : int
    n_features_in_ : int
    device_ : str
        ``"cpu"`` or ``"gpu"``.
    n_trees_, leaf_size_ : int
        The tree count and leaf size :meth:`fit` built with (the device's defaults where the
        parameters are None).
    stats_ : dict
        Statistics of the last query: ``leaves_visited`` ((M,) int32 numpy, leaves scanned per
        query over all trees), ``heap_overflow``, and the P-BANNS rounds and phase timings.
    recall_target_ : float or None
        The ``recall=`` of :meth:`fit`: a query that names neither ``backtracks=`` nor
        ``recall=`` searches at the budget calibrated for its ``k`` at this target.
    calibration_ : dict
        After a search with a ``recall=`` target (given to :meth:`fit` or :meth:`query`): the
        estimate the budget came from (see :meth:`calibrate`): ``target``, ``k``, ``budget``
        (leaves per query; None: unlimited), ``recall`` (measured on the sample), ``sample``
        (rows), ``seconds``, ``probes`` (``[(budget, recall), ...]`` in the order tried) and
        ``rule``. Calibrations are cached per ``(k, target)`` until the next :meth:`fit`.

    Notes
    -----
    Recall targets: ``fit(X, recall=0.9)`` or ``query(Q, k, recall=0.9)`` leave the leaf budget
    to the index. It queries ``min(N, CALIBRATION_ROWS)`` of its own rows (drawn with
    ``CALIBRATION_SEED``) for ``k + 1`` neighbours and drops each row's own id (leave-one-out:
    each row is searched as a query the index does not hold, its descent and pruning those of a
    search for its ``k`` nearest other rows), scores the answers against the exact brute force
    with the bench's rule (a returned neighbour counts when its distance is at most the exact
    ``k``-th; ties count), and takes the smallest budget whose measured recall@k is >= the
    target: doubling from :data:`CALIBRATION_START` leaves, then bisection down to a step of
    1/16 of the budget. Queries the index has not seen land within the sampling error of the
    estimate (about 0.01 at 2,000 rows; held-out SHOT352 queries: docs/benchmarks.md). An
    unlimited budget stays the exact answer.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).standard_normal((1000, 8)).astype(np.float32)
    >>> index = KDForest(leaf_size=32, device="cpu").fit(X)
    >>> dist2, ids = index.query(X[:5], k=3)
    >>> ids[:, 0].tolist()
    [0, 1, 2, 3, 4]
    """

    def __init__(self, *, n_trees: int | None = None, leaf_size: int | None = None, backtracks: int | None = None,
                 method: str = "banns", random_dims: int | None = None, seed: int = 0,
                 device: str = "auto", max_depth: int | None = None, sliding_window: bool = True,
                 split: str = "variance", heap_cap: int | None = None, descent: str = "auto",
                 leaves_per_round: int | None = None, graph_degree: int | None = None, graph_expand: int = 4,
                 graph_rounds: int = 2, graph_budget: int | None = 128, scan_dtype: str = "float32"):
        self.n_trees = n_trees
        self.leaf_size = leaf_size
        self.backtracks = backtracks
        self.method = method
        self.random_dims = random_dims
        self.seed = seed
        self.device = device
        self.max_depth = max_depth
        self.sliding_window = sliding_window
        self.split = split
        self.heap_cap = heap_cap
        self.descent = descent
        self.leaves_per_round = leaves_per_round
        self.graph_degree = graph_degree
        self.graph_expand = graph_expand
        self.graph_rounds = graph_rounds
        self.graph_budget = graph_budget
        self.scan_dtype = scan_dtype

    def get_params(self, deep: bool = True) -> dict:
        return {k: getattr(self, k) for k in ("n_trees", "leaf_size", "backtracks", "method", "random_dims",
                                              "seed", "device", "max_depth", "sliding_window", "split",
                                              "heap_cap", "descent", "leaves_per_round", "graph_degree",
                                              "graph_expand", "graph_rounds", "graph_budget", "scan_dtype")}

    def set_params(self, **params) -> "KDForest":
        for k, v in params.items():
            if k not in self.get_params():
                raise InputError(f"unknown parameter {k!r} for KDForest")
            setattr(self, k, v)
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"KDForest({args})"

    def _validate(self):
        """Check the parameters; ``(leaf_size or None, max_depth, random_dims, seed)``."""
        if self.n_trees is not None:
            if isinstance(self.n_trees, bool) or not isinstance(self.n_trees, (int, np.integer)) or self.n_trees < 1:
                raise InputError(f"n_trees must be an integer >= 1 or None (the device's default), "
                                 f"got {self.n_trees!r}")
            _check_n_trees(self.n_trees)
        if self.method not in _METHODS:
            raise InputError(f"method must be one of {_METHODS}, got {self.method!r}")
        if not isinstance(self.sliding_window, (bool, np.bool_)):
            raise InputError(f"sliding_window must be a bool, got {self.sliding_window!r}")
        _check_budget(self.backtracks)
        heap_capacity(1, self.heap_cap)
        _check_graph(self)
        _check_scan_dtype(self.scan_dtype)
        check_split(self.split)
        resolve_descent(self.descent)
        integer(self.leaves_per_round, "leaves_per_round", none=True)
        leaf_size, max_depth, rand_f, seed = _check_build_params(1 if self.leaf_size is None else self.leaf_size,
                                                                 self.max_depth, self.random_dims, self.seed)
        return (None if self.leaf_size is None else leaf_size), max_depth, rand_f, seed

    def fit(self, X, y=None, *, keep_rows: bool = True, recall: float | None = None,
            recall_k: int = 4) -> "KDForest":
        """Validate the parameters and build the index of ``X`` ((N, d) float array).

        ``keep_rows=False`` builds the trees only, keeping no copy of the rows (``tree_.points``
        is None and this forest cannot answer queries): the arrays an index in a store needs,
        built with one copy of the rows on the device.

        ``recall``: a target recall@k in (0, 1) instead of a leaf budget (``backtracks`` must
        then be None): the budget is calibrated now for ``k = recall_k`` (``calibration_``), and
        every :meth:`query` that names no budget searches with the budget calibrated for its
        own ``k`` (calibrated at its first use)."""
        if recall is not None:
            recall = check_recall(recall)
            if self.backtracks is not None:
                raise InputError(f"give recall= or a budget (backtracks={self.backtracks!r}), not both")
            if not keep_rows:
                raise InputError("recall= needs the rows (keep_rows=True): the calibration searches them")
        if self.graph_degree is not None and not keep_rows and self.method != "exact":
            raise InputError("graph_degree needs the rows (keep_rows=True): the graph is found by searching them "
                             "and its rounds score them")
        leaf_size, max_depth, rand_f, seed = self._validate()
        half = self.scan_dtype == "float16" and self.method != "exact"
        if half and not keep_rows:
            raise InputError("scan_dtype='float16' needs the rows (keep_rows=True): its lists are re-ranked "
                             "with the float32 rows")
        dev = resolve_device(self.device, X)
        if dev == "gpu":
            import cupy as cp

            # the exact method keeps float16 rows as they are (the brute force widens them exactly)
            X = check_points(cp.asarray(X), "X", xp=cp, keep_half=self.method == "exact")
        else:
            from ..backend import to_numpy

            X = check_points(to_numpy(X), "X", xp=np)
        self.device_ = dev
        d = int(X.shape[1])
        n_trees, leaf_size = resolve_defaults(dev, d, self.n_trees, leaf_size)
        self.n_trees_, self.leaf_size_ = n_trees, leaf_size
        if self.random_dims is None:
            rand_f = min(5, d) if n_trees > 1 else 0
        elif rand_f > d:
            raise InputError(f"random_dims={rand_f} must be in 1..d = 1..{d} (the data has {d} dimensions)")
        if n_trees > 1 and rand_f < 2:
            raise InputError(f"n_trees={n_trees} needs random_dims >= 2 (random_dims={self.random_dims!r} on "
                             f"d={d} makes every tree identical)")
        self.n_samples_fit_, self.n_features_in_ = int(X.shape[0]), d
        self._fit_X = X if keep_rows else None
        self.__dict__.pop("_exact", None)
        self.tree_ = None
        self.random_dims_ = rand_f or None
        if self.method != "exact":
            self.tree_ = build_kdforest(X, n_trees=n_trees, leaf_size=leaf_size, max_depth=max_depth,
                                        random_dims=rand_f or None, seed=seed, split=self.split, device=dev,
                                        leaf_rows=keep_rows)
        self.graph_, self.graph_stats_ = None, {}
        self.__dict__.pop("_leaf_graph", None)
        self.__dict__.pop("_leaf_inv", None)
        self._scan_X = None
        if half:
            _check_half_range(X)  # nothing built on rows beyond half's range
        if self.graph_degree is not None and self.method != "exact" and keep_rows and self.n_samples_fit_ > 1:
            self._build_graph(X)  # over the float32 rows: the same graph whatever the scan's precision
        self._sync_scan(checked=half)
        self.stats_ = {}
        self._calibrations, self.recall_target_ = {}, recall
        self.__dict__.pop("calibration_", None)
        if recall is not None and self.method != "exact":
            self.calibrate(check_k(recall_k, self.n_samples_fit_), recall)
        return self

    def query(self, Q, k: int = 1, *, bounds=None, backtracks=_UNSET, recall: float | None = None,
              return_stats: bool = False):
        """The ``k`` nearest indexed points of each row of ``Q``.

        Parameters
        ----------
        Q : (M, d) array_like
        k : int
        bounds : (M,) array_like of float32, optional, keyword-only
            Per-query bound on the squared distance (``inf`` = none), e.g. the global k-th
            distance already known from other shards: boxes not closer are pruned and only
            points strictly closer than the bound are returned, the rest of the row being
            ``(inf, -1)``. ``stats_["leaves_visited"]`` shows the saved work.
        backtracks : int or None, optional, keyword-only
            Overrides the fitted ``backtracks`` (or the budget of a ``fit(recall=...)`` target)
            for this call (``None``: unlimited), e.g. a small budget for the first phase of a
            bound synchronisation.
        recall : float in (0, 1), optional, keyword-only
            A target recall@k instead of a budget: the smallest budget whose recall@k on a
            sample of the index's own rows is >= the target (:meth:`calibrate`, cached per
            ``(k, recall)``; ``calibration_`` tells the estimate). Not with ``backtracks=`` or
            a fitted ``backtracks``.
        return_stats : bool, keyword-only
            Also return this search's statistics (what ``stats_`` holds after it): the way to
            read them when several threads search one forest at once.

        Returns
        -------
        dist2 : (M, k) float32
            Squared L2 distances, ascending (ties broken by the smaller id).
        ids : (M, k) int64
            Row indices into the fitted ``X``.

        Arrays are CuPy arrays when the index lives on the GPU.
        """
        if not hasattr(self, "n_samples_fit_"):
            raise InputError("this KDForest is not fitted yet: call fit(X) first")
        if self._fit_X is None and (self.tree_ is None or self.tree_.points is None):
            raise InputError("this KDForest was fitted with keep_rows=False (trees only): it cannot answer "
                             "queries; fit it again, or load the index from its store")
        if self.method not in _METHODS:
            raise InputError(f"method must be one of {_METHODS}, got {self.method!r}")
        k = check_k(k, self.n_samples_fit_)
        if recall is not None:
            recall = check_recall(recall)
            if backtracks is not _UNSET or self.backtracks is not None:
                given = backtracks if backtracks is not _UNSET else self.backtracks
                raise InputError(f"give recall= or a budget (backtracks={given!r}), not both")
        elif backtracks is _UNSET:
            recall = getattr(self, "recall_target_", None)
        if self.device_ == "gpu":
            import cupy as cp

            Q = check_points(cp.asarray(Q), "Q", dim=self.n_features_in_, xp=cp)
        else:
            from ..backend import to_numpy

            if is_cupy(Q):
                Q = to_numpy(Q)
            Q = check_points(Q, "Q", dim=self.n_features_in_, xp=np)
        if self.method == "exact" or self.tree_ is None:
            self.stats_ = stats = {"method": "exact"}
            xp = np
            if self.device_ == "gpu":
                import cupy as xp
            b = check_bounds(bounds, int(Q.shape[0]), xp=xp)
            dist, ids = self._exact_search().search(Q, k)
            if b is not None:
                drop = dist > _bound_limit(b, int(Q.shape[0]), xp=xp)[:, None]
                dist[drop] = np.inf
                ids[drop] = -1
            return (dist, ids, stats) if return_stats else (dist, ids)
        want = self.n_trees if self.n_trees is not None else getattr(self, "n_trees_", self.tree_.n_trees)
        if int(want) != self.tree_.n_trees:
            raise InputError(f"this KDForest has n_trees={want} but its tree_ holds {self.tree_.n_trees} "
                             "tree(s) (a forest loaded without its roots array?)")
        if recall is not None:
            budget = self.calibrate(k, recall)["budget"]
        else:
            budget = self.backtracks if backtracks is _UNSET else backtracks
            _check_budget(budget)
        dist, ids, stats = self._search(Q, k, budget, bounds)
        self.stats_ = stats = dict(stats, method=self.method, **({} if recall is None else {"backtracks": budget}))
        return (dist, ids, stats) if return_stats else (dist, ids)

    def _half_rows(self, X):
        """``X`` rounded to half precision: float16 on a GPU, the same values in float32 on the
        CPU (numba scores float32)."""
        h = X.astype(np.float16)
        return h if self.device_ == "gpu" else h.astype(np.float32)

    def _sync_scan(self, checked: bool = False) -> None:
        """Hold the rows a search scores in ``scan_dtype`` (it may change with :meth:`set_params`
        after :meth:`fit`): half copies of the leaf rows and of the rows the graph walks, or the
        float32 leaf rows again (gathered from the kept rows). ``checked``: the rows' range was
        checked already (:meth:`fit`, before building on them)."""
        scan = getattr(self, "scan_dtype", "float32")  # a forest pickled before the parameter: float32
        _check_scan_dtype(scan)
        tree = self.tree_
        want = scan == "float16" and self.method != "exact" and tree is not None
        have = getattr(self, "_scan_X", None) is not None
        if want == have or tree is None or tree.points is None:
            return
        if self._fit_X is None:
            raise InputError("scan_dtype='float16' needs the rows (keep_rows=True and not to_leaf_order()): its "
                             "lists are re-ranked with the float32 rows")
        if want:
            if not checked:
                _check_half_range(self._fit_X)
            self._scan_X, tree.points = self._half_rows(self._fit_X), self._half_rows(tree.points)
        else:
            self._scan_X, tree.points = None, self._fit_X[tree.perm]

    def _half_scan(self) -> bool:
        return getattr(self, "_scan_X", None) is not None

    def _search(self, Q, k: int, budget, bounds=None, exclude=None):
        """:meth:`_search_rows`, and with ``scan_dtype="float16"`` each list re-ranked by its
        float32 distances (an unlimited budget: the float32 brute force; ``bounds`` applied to
        the re-ranked distances)."""
        self._sync_scan()
        if not self._half_scan():
            return self._search_rows(Q, k, budget, bounds, exclude)
        xp = np
        if self.device_ == "gpu":
            import cupy as xp
        b = check_bounds(bounds, int(Q.shape[0]), xp=xp)
        if budget is None:
            dist, ids = self._exact_search().search(Q, k)
            stats = {"method": "exact", "scan_dtype": "float16"}
        else:
            # the whole list the search keeps (the graph's rounds keep graph_expand x graph_rounds) re-ranked
            walk = int(self.graph_expand) * int(self.graph_rounds) if getattr(self, "graph_", None) is not None else 0
            wide = min(max(2 * int(k), walk + (exclude is not None)), self.n_samples_fit_, MAX_K)
            dist, ids, stats = self._search_rows(Q, wide, budget, None, exclude)
            t0 = time.perf_counter()
            dist, ids = self._rerank(Q, ids, k)
            if self.device_ == "gpu":
                xp.cuda.get_current_stream().synchronize()
            stats = dict(stats, scan_dtype="float16", ms_rerank=round(1e3 * (time.perf_counter() - t0), 3))
        if b is not None:
            drop = dist > _bound_limit(b, int(Q.shape[0]), xp=xp)[:, None]
            dist, ids = xp.where(drop, xp.float32(np.inf), dist), xp.where(drop, -1, ids)
        return dist, ids, stats

    def _rerank(self, Q, ids, k: int):
        """The ``k`` nearest of each list's rows ``ids`` ((M, c) int64, -1: none) by the canonical
        distance to the float32 rows, in (distance, id) order."""
        X = self._fit_X
        if self.device_ == "gpu":
            import cupy as cp

            from . import _graph_gpu
            from .topk import unpack

            keys = _graph_gpu.pair_keys(X, Q, ids)
            if _graph_gpu.fits(k):  # a warp a query keeps the k smallest (the ids are distinct)
                return unpack(_graph_gpu.merge(cp.full((int(Q.shape[0]), k), _graph_gpu.NONE_KEY, cp.uint64), keys, k))
            return unpack(cp.sort(keys, axis=1)[:, :k])
        from .bruteforce import pair_distances_checked

        d = pair_distances_checked(X, Q, ids, "cpu")
        d[ids < 0] = np.inf
        return merge_topk_unique([(d, ids)], k)

    def _search_rows(self, Q, k: int, budget, bounds=None, exclude=None):
        """The forest's search of ``Q`` at a leaf budget (None: unlimited), with its parameters,
        then the graph's rounds (``graph_degree``) when there is a budget. ``exclude``: each
        query's own row id (a calibration's leave-one-out), never a seed of the graph rounds:
        its graph row would hand an indexed row its own neighbours, which a query the index does
        not hold has no way to get."""
        g = getattr(self, "graph_", None)
        if g is None or budget is None:
            return self._forest_search(Q, k, budget, bounds)
        _check_graph(self)  # set_params may have changed the rounds since fit
        if not self.graph_rounds:
            return self._forest_search(Q, k, budget, bounds)
        e, rounds = min(int(self.graph_expand), self.n_samples_fit_), int(self.graph_rounds)
        kk = min(max(int(k), e * rounds + (exclude is not None)), self.n_samples_fit_)
        dist, ids, stats = self._forest_search(Q, kk, budget, bounds)
        t0 = time.perf_counter()
        leaf = self._leaf_positions()
        if leaf is None:
            dist, ids = self._rounds(Q, dist, ids, e, rounds, kk, bounds, exclude)
        else:  # a stored index's graph joins the rows' leaf positions: walk there, answer in ids
            xp = np
            if self.device_ == "gpu":
                import cupy as xp
            perm, inv = leaf
            pos = xp.where(ids >= 0, inv[xp.maximum(ids, 0)], -1)
            ex = None if exclude is None else inv[exclude]
            dist, pos = self._rounds(Q, dist, pos, e, rounds, kk, bounds, ex)
            ids = xp.where(pos >= 0, perm[xp.maximum(pos, 0)], -1)
            dist, ids = merge_topk_unique([(dist, ids)], kk)  # (distance, id) order again, as every search answers
        scored = int(Q.shape[0]) * e * rounds * int(g.shape[1])
        if self.device_ == "gpu":
            import cupy as cp

            cp.cuda.get_current_stream().synchronize()
        stats = dict(stats, graph_rounds=int(self.graph_rounds), graph_rows_scored=scored,
                     ms_graph=round(1e3 * (time.perf_counter() - t0), 3))
        return dist[:, :k], ids[:, :k], stats

    def _forest_search(self, Q, k: int, budget, bounds=None):
        """The trees' search of ``Q`` (checked by :meth:`query`, or rows of the index)."""
        descent = self.descent
        if descent == "auto":
            descent = DEVICE_DEFAULTS["gpu" if self.device_ == "gpu" else "cpu"]["descent"]
        return _query_checked(self.tree_, Q, k, method=self.method, backtracks=budget,
                              sliding_window=self.sliding_window, bounds=bounds, return_stats=True,
                              heap_cap=self.heap_cap, descent=descent, leaves_per_round=self.leaves_per_round)

    def _rounds(self, Q, dist, ids, e: int, rounds: int, kk: int, bounds=None, exclude=None):
        """The graph's ``rounds`` rounds from the forest's lists ``(dist, ids)`` (``kk`` wide):
        on the GPU without bounds all of them in one kernel (:func:`._graph_gpu.walk`), else
        round by round (:meth:`_expand`)."""
        from . import _graph_gpu

        xp = np
        if self.device_ == "gpu":
            import cupy as xp
        X = self._graph_rows()
        rows_ok = X.dtype in (np.float32, np.float16)
        if self.device_ == "gpu" and bounds is None and rows_ok and _graph_gpu.walk_fits(kk, e):
            from .topk import pack, unpack

            return unpack(_graph_gpu.walk(X, Q, self.graph_, pack(dist, ids), e, rounds, exclude))
        done = xp.full((int(Q.shape[0]), e * rounds), -1, xp.int64)  # the entries expanded so far
        for r in range(rounds):
            dist, ids = self._expand(Q, dist, ids, e, kk, bounds, exclude, done, r)
        return dist, ids

    def _expand(self, Q, dist, ids, e: int, kk: int, bounds=None, exclude=None, done=None, r: int = 0):
        """Graph round ``r``: the graph neighbours of each list's first ``e`` entries not yet
        expanded (``done[:, :r * e]``; their ids go to ``done[:, r * e:(r + 1) * e]``) scored
        with the canonical distance and merged into the list (``kk`` entries, a point once): by
        the numba round on the CPU, the kernels of :mod:`._graph_gpu` on the GPU, and
        :func:`~.bruteforce.pair_distances` with a sorted merge where bounds apply. With
        ``bounds``, only points strictly closer than a query's bound enter, as in the forest's
        search. Queries go in chunks of :data:`GRAPH_CHUNK_PAIRS` scored pairs."""
        from . import _graph_gpu
        from .bruteforce import pair_distances_checked
        from .topk import pack, unpack

        xp = np
        if self.device_ == "gpu":
            import cupy as xp
        g, X = self.graph_, self._graph_rows()
        m, deg = int(Q.shape[0]), int(g.shape[1])
        if done is None:
            done, r = xp.full((m, e), -1, xp.int64), 0
        lim = None if bounds is None else _bound_limit(check_bounds(bounds, m, xp=xp), m, xp=xp)
        if self.device_ == "cpu" and lim is None:
            from ._graph_cpu import graph_round

            seeds = _next_seeds(ids, done[:, :r * e], exclude, e, np)
            done[:, r * e:(r + 1) * e] = seeds
            out_d, out_i = np.empty((m, kk), np.float32), np.empty((m, kk), np.int64)
            graph_round(X, np.ascontiguousarray(Q, dtype=np.float32), g,
                        np.ascontiguousarray(dist, dtype=np.float32), np.ascontiguousarray(ids, dtype=np.int64),
                        seeds, out_d, out_i)
            return out_d, out_i
        # canonical keys scored and merged by the GPU kernels (float32 or float16 rows), or (bounds,
        # lists longer than the merge holds) scored and sorted the generic way
        kernels = self.device_ == "gpu" and lim is None and X.dtype in (np.float32, np.float16) and _graph_gpu.fits(kk)
        step = max(1, GRAPH_CHUNK_PAIRS // max(1, e * deg))
        out_d, out_i = [], []
        for a in range(0, m, step):
            d0, i0 = dist[a:a + step], ids[a:a + step]
            seeds = _next_seeds(i0, done[a:a + step, :r * e], None if exclude is None else exclude[a:a + step],
                                e, xp)
            done[a:a + step, r * e:(r + 1) * e] = seeds
            cand = g[xp.maximum(seeds, 0)].astype(xp.int64).reshape(seeds.shape[0], e * deg)
            cand = xp.where(xp.repeat(seeds < 0, deg, axis=1), -1, cand)
            if kernels:
                dd, ii = unpack(_graph_gpu.merge(pack(d0, i0), _graph_gpu.pair_keys(X, Q[a:a + step], cand),
                                                 kk))
            else:
                cd = pair_distances_checked(X, Q[a:a + step], cand, self.device_)  # the index's own rows
                if lim is not None:
                    far = cd >= lim[a:a + step, None]
                    cd, cand = xp.where(far, xp.float32(np.inf), cd), xp.where(far, -1, cand)
                dd, ii = merge_topk_unique([(d0, i0), (cd, cand)], kk)
            out_d.append(dd)
            out_i.append(ii)
        if len(out_d) == 1:
            return out_d[0], out_i[0]
        return xp.concatenate(out_d), xp.concatenate(out_i)

    def _build_graph(self, X):
        """``graph_``: each row's ``graph_degree`` nearest other rows (int32, (N, D); -1 where a
        row has fewer), by this forest's search at ``graph_budget`` leaves (rows in chunks)."""
        xp = np
        if self.device_ == "gpu":
            import cupy as xp
        t0 = time.perf_counter()
        n = self.n_samples_fit_
        deg = min(int(self.graph_degree), n - 1)
        kq = min(deg + 1, n)
        out = xp.empty((n, deg), xp.int32)
        step = max(1, GRAPH_CHUNK_PAIRS // (8 * kq))
        for a in range(0, n, step):
            q = X[a:a + step]
            _, ids, _ = self._forest_search(q, kq, self.graph_budget)
            rows = xp.arange(a, a + int(q.shape[0]), dtype=xp.int64)
            out[a:a + int(q.shape[0])] = _next_seeds(ids, None, rows, deg, xp).astype(xp.int32)
        if self.device_ == "gpu":
            xp.cuda.get_current_stream().synchronize()
        self.graph_ = out
        self.graph_stats_ = {"degree": deg, "budget": self.graph_budget, "seconds": time.perf_counter() - t0,
                             "bytes": int(out.nbytes)}

    def _graph_rows(self):
        """The rows the graph's ids index: the fitted rows, or a stored index's leaf-ordered rows
        (:meth:`set_leaf_graph`; the first tree's order)."""
        if self._half_scan():
            return self._scan_X
        if self._fit_X is not None:
            return self._fit_X
        return self.tree_.points[:self.n_samples_fit_]

    def _leaf_positions(self):
        """``(perm, inverse)`` of a graph over leaf positions (:meth:`set_leaf_graph`), else None."""
        return self._leaf_order() if self.__dict__.get("_leaf_graph") else None

    def _leaf_order(self):
        """``(perm, inverse)``: the row at each position of the first tree's leaf order, and the
        position of each row (int64, kept until the next :meth:`fit` or :meth:`set_leaf_graph`)."""
        got = self.__dict__.get("_leaf_inv")
        if got is None:
            xp = np
            if self.device_ == "gpu":
                import cupy as xp
            perm = self.tree_.perm[:self.n_samples_fit_].astype(xp.int64)
            inv = xp.empty_like(perm)
            inv[perm] = xp.arange(perm.size, dtype=xp.int64)
            got = self.__dict__["_leaf_inv"] = (perm, inv)
        return got

    def graph_in_leaf_order(self):
        """``graph_`` over the rows' positions in the first tree's leaf order (row ``perm[p]``
        at position ``p``): what a stored index keeps beside its leaf-ordered rows (int32,
        (N, D); -1 where a row has fewer neighbours). :meth:`set_leaf_graph` takes it back."""
        if getattr(self, "graph_", None) is None:
            raise InputError("this KDForest has no graph (fit it with graph_degree=...)")
        if self.__dict__.get("_leaf_graph"):
            return self.graph_
        xp = np
        if self.device_ == "gpu":
            import cupy as xp
        perm, inv = self._leaf_order()
        g = self.graph_[perm]
        return xp.where(g >= 0, inv[xp.maximum(g, 0)], -1).astype(xp.int32)

    def to_leaf_order(self) -> "KDForest":
        """Keep the rows in leaf order only (``tree_.points``), the graph following them, as a
        stored index's loaded shard holds them: the input-order copy of the rows goes."""
        if self._half_scan():
            raise InputError("a KDForest with scan_dtype='float16' keeps its float32 rows to re-rank with: it has "
                             "no leaf-order-only form (a stored index keeps half rows with index build --dtype "
                             "float16)")
        if getattr(self, "graph_", None) is not None:
            self.set_leaf_graph(self.graph_in_leaf_order())
        if self.tree_ is not None and self.tree_.points is not None:
            self._fit_X = None
            self.__dict__.pop("_exact", None)
        return self

    def set_leaf_graph(self, graph) -> "KDForest":
        """Follow ``graph`` ((N, D) int32 over leaf positions, :meth:`graph_in_leaf_order`): a
        stored index's forest, whose rows are held in leaf order only. A search maps its ids to
        positions for the rounds and back, each list again in (distance, id) order."""
        xp = np
        if self.device_ == "gpu":
            import cupy as xp
        g = xp.asarray(graph, dtype=xp.int32)
        if g.ndim != 2 or int(g.shape[0]) != self.n_samples_fit_:
            raise InputError(f"a leaf-ordered graph needs one row per indexed row ({self.n_samples_fit_}), "
                             f"got shape {tuple(g.shape)}")
        self.graph_, self.graph_stats_ = g, {"degree": int(g.shape[1]), "bytes": int(g.nbytes), "stored": True}
        self.__dict__["_leaf_graph"] = True
        self.__dict__.pop("_leaf_inv", None)
        return self

    def calibrate(self, k: int, recall: float) -> dict:
        """The smallest leaf budget whose recall@``k`` on a sample of the indexed rows is >= ``recall``.

        Leave-one-out on ``min(N, CALIBRATION_ROWS)`` indexed rows (drawn with
        ``CALIBRATION_SEED``): each is searched for ``k + 1`` neighbours and its own id dropped,
        and a returned row counts when its distance is at most the exact ``k``-th distance to
        the other rows (the brute force of this module's rows; ties count). Budgets double from
        ``CALIBRATION_START`` leaves until one meets the target, then bisect down to a step of
        1/16 of the budget; a budget of every leaf of the forest that still misses it (queue
        overflow) gives None (unlimited: exact). Cached per ``(k, recall)`` until the next
        :meth:`fit`; the result is also ``calibration_``. Works alike on both devices.

        Returns
        -------
        dict
            ``target``, ``k``, ``budget`` (None: unlimited), ``recall`` (measured on the
            sample), ``sample``, ``seconds``, ``probes`` ([(budget, recall), ...]) and ``rule``.
        """
        if not hasattr(self, "n_samples_fit_"):
            raise InputError("this KDForest is not fitted yet: call fit(X) first")
        k, recall = check_k(k, self.n_samples_fit_), check_recall(recall)
        cache = self.__dict__.setdefault("_calibrations", {})
        got = cache.get((k, recall))
        if got is None:
            got = cache[(k, recall)] = self._calibrate(k, recall)
        self.calibration_ = got
        return got

    def _calibrate(self, k: int, target: float) -> dict:
        t0 = time.perf_counter()
        n, dev = self.n_samples_fit_, self.device_
        rule = "leave-one-out: indexed rows searched for k + 1 neighbours, their own id dropped"
        if self.method == "exact" or self.tree_ is None:
            return {"target": target, "k": k, "budget": None, "recall": 1.0, "sample": 0, "seconds": 0.0,
                    "probes": [], "rule": "exact method: no budget"}
        xp = np
        if dev == "gpu":
            import cupy as xp
        tree = self.tree_
        if tree.points is None:
            raise InputError("this KDForest holds no rows (keep_rows=False): it cannot calibrate a recall")
        kk = min(k + 1, n, MAX_K)
        others = kk - 1  # neighbours scored per sampled row (k; n - 1 on a tiny index, MAX_K - 1 at k = MAX_K)
        if others < 1:  # a one-row index: every budget is exact
            return {"target": target, "k": k, "budget": None, "recall": 1.0, "sample": 0,
                    "seconds": time.perf_counter() - t0, "probes": [], "rule": rule}
        s = min(n, CALIBRATION_ROWS)
        pos = np.sort(np.random.default_rng(CALIBRATION_SEED).choice(n, s, replace=False))
        if self._fit_X is not None:  # rows in input order: the sample's ids are its positions
            sample, sid = self._fit_X[xp.asarray(pos)], xp.asarray(pos, dtype=xp.int64)
            exact = self._exact_search().search(sample, kk)[0]
        else:  # a resident forest (rows leaf ordered, ids through perm): distances need no ids
            from .bruteforce import knn_bruteforce

            rows = tree.points[:n]
            sample = rows[xp.asarray(pos)].astype(xp.float32)
            sid = tree.perm[:n][xp.asarray(pos)].astype(xp.int64)
            exact = knn_bruteforce(rows, sample, kk, device=dev)[0]
        thr = exact[:, kk - 1:kk]  # the k-th distance to another row (the row itself is at 0)

        def measure(budget):
            d2, ids = self._search(sample, kk, budget, exclude=sid)[:2]
            hit = (ids != sid[:, None]) & (ids >= 0) & (d2 <= thr)
            return float(xp.minimum(hit.sum(axis=1), others).sum()) / (s * others)

        leaves = int((tree.child == -1).sum())  # over every tree: a budget of all of them is a full scan
        probes, lo, hi, b = [], 0, None, min(CALIBRATION_START, leaves)
        while True:
            r = measure(b)
            probes.append((b, r))
            if r >= target:
                hi = b
                break
            lo = b
            if b >= leaves:
                break
            b = min(2 * b, leaves)
        while hi is not None and hi - lo > max(1, hi // 16):
            mid = (lo + hi) // 2
            r = measure(mid)
            probes.append((mid, r))
            if r >= target:
                hi = mid
            else:
                lo = mid
        if hi is None:
            got = measure(None)
            probes.append((None, got))
        else:
            got = next(r for b, r in probes if b == hi)
        return {"target": target, "k": k, "budget": hi, "recall": got, "sample": s,
                "seconds": time.perf_counter() - t0, "probes": probes, "rule": rule}

    def __getstate__(self):
        """A forest pickled (a Dask worker handing a resident shard to another, or spilling it)
        leaves its exact search behind: a cache, made again on first use where it lands."""
        state = self.__dict__.copy()
        state.pop("_exact", None)
        return state

    def _exact_search(self) -> ExactSearch:
        """The exact search over the kept rows, prepared once (their mean, centred copy and
        norms), and again only when the rows change."""
        c = self.__dict__.get("_exact")
        if c is None or c[0] is not self._fit_X:
            search = ExactSearch(self._fit_X, device=self.device_)
            if self.device_ == "gpu":  # complete before it is shared: other threads search on other streams
                import cupy as cp

                cp.cuda.get_current_stream().synchronize()
            c = self.__dict__["_exact"] = (self._fit_X, search)
        return c[1]

    def kneighbors(self, Q, n_neighbors: int = 1):
        """scikit-learn naming: (distances, indices) with *Euclidean* distances."""
        d2, ids = self.query(Q, n_neighbors)
        xp = np
        if is_cupy(d2):
            import cupy as xp
        return xp.sqrt(d2), ids


def merge_topk_unique(parts, k: int):
    """Global top-``k`` of several ``(dist2, ids)`` results for the same queries, duplicates removed.

    Like :func:`scanforest.kernels.knn.topk.merge_topk` (order by (distance, id), numpy or CuPy),
    but an id present in several parts (the same point returned by two search phases, or by
    two replicated trees) counts once. Missing slots are ``(inf, -1)``.

    Parameters
    ----------
    parts : sequence of (dist2 (M, k_i) float32, ids (M, k_i) int64)
    k : int

    Returns
    -------
    dist2 (M, k) float32, ids (M, k) int64
    """
    from ..backend import array_module
    from .topk import pack, unpack

    if not parts:
        raise InputError("merge_topk_unique needs at least one part")
    m = parts[0][0].shape[0]
    for d, i in parts:
        if d.shape != i.shape or d.ndim != 2 or d.shape[0] != m:
            raise InputError(f"every part must be (M, k_i) with M = {m}; got {d.shape} and {i.shape}")
    xp = array_module(*[a for p in parts for a in p])
    keys = xp.sort(xp.concatenate([pack(xp.asarray(d), xp.asarray(i)) for d, i in parts], axis=1), axis=1)
    none = pack(xp.full((1, 1), np.inf, xp.float32), xp.full((1, 1), -1, xp.int64))[0, 0]
    dup = keys[:, 1:] == keys[:, :-1]
    keys[:, 1:] = xp.where(dup, none, keys[:, 1:])
    keys = xp.sort(keys, axis=1)[:, :k]
    d, i = unpack(keys)
    if d.shape[1] < k:
        from .topk import pad_topk

        d, i = pad_topk(d, i, k)
    return d, i
