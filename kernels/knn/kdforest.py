"""scikit-learn-style nearest-neighbour index over the array KD-tree (CPU and GPU)."""
from __future__ import annotations

import numpy as np

from ..backend import is_cupy, resolve_device
from ..errors import InputError
from .bruteforce import ExactSearch, check_k, check_points
from .kdtree import (_bound_limit, _check_budget, _check_build_params, _check_n_trees, build_kdforest, check_split,
                     check_bounds, heap_capacity, query_kdtree, resolve_descent)

__all__ = ["KDForest", "merge_topk_unique"]

METHODS = ("banns", "anns", "exact")  # search methods, in the order of the docs
_METHODS = METHODS
_UNSET = object()


class KDForest:
    """Approximate (or exact) k-nearest-neighbour index on KD-trees, CPU or GPU.

    Parameters
    ----------
    n_trees : int, default 1
        Number of randomized trees over the SAME points (FLANN-style replicated forest). Tree
        ``t`` uses the seed ``seed + t``. The search keeps ONE priority queue per query over the
        boxes of all trees (the closest pending box of any tree is scanned next), so the trees
        share one budget of ``backtracks`` leaves; a point found through several trees counts
        once. Memory: T copies of the points.
    leaf_size : int, default 64
        Maximum number of points in a leaf.
    backtracks : int or None, default None
        Maximum number of leaves scanned per query. ``None`` means unlimited: the search is
        exact (identical to brute force, ties by id).
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
    descent : {"auto", "box", "path"}, default "auto"
        How a descent bounds the far children it queues: their box distance, or an O(1) bound
        from the popped box (:func:`scanforest.kernels.knn.kdtree.query_kdtree`); ``auto`` is
        ``path``. Both devices answer alike for the same value.
    leaves_per_round : int or None, default None
        P-BANNS: leaves a query takes per round, chosen together and scanned together (each
        leaf once for all the queries that took it); ``None``:
        :data:`scanforest.kernels.knn.kdtree.LEAVES_PER_ROUND`, 1 is the paper's P-BANNS. See
        :func:`scanforest.kernels.knn.kdtree.query_kdtree`.

    Attributes
    ----------
    tree_ : KDTree or None
        The built tree, or for ``n_trees > 1`` the packed forest (``tree_.roots`` holds the
        root of every tree); None for ``method="exact"``.
    n_samples_fit_ : int
    n_features_in_ : int
    device_ : str
        ``"cpu"`` or ``"gpu"``.
    stats_ : dict
        Statistics of the last query: ``leaves_visited`` ((M,) int32 numpy, leaves scanned per
        query over all trees), ``heap_overflow``, and the P-BANNS rounds and phase timings.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).standard_normal((1000, 8)).astype(np.float32)
    >>> index = KDForest(leaf_size=32, device="cpu").fit(X)
    >>> dist2, ids = index.query(X[:5], k=3)
    >>> ids[:, 0].tolist()
    [0, 1, 2, 3, 4]
    """

    def __init__(self, *, n_trees: int = 1, leaf_size: int = 64, backtracks: int | None = None,
                 method: str = "banns", random_dims: int | None = None, seed: int = 0,
                 device: str = "auto", max_depth: int | None = None, sliding_window: bool = True,
                 split: str = "variance", heap_cap: int | None = None, descent: str = "auto",
                 leaves_per_round: int | None = None):
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

    def get_params(self, deep: bool = True) -> dict:
        return {k: getattr(self, k) for k in ("n_trees", "leaf_size", "backtracks", "method", "random_dims",
                                              "seed", "device", "max_depth", "sliding_window", "split",
                                              "heap_cap", "descent", "leaves_per_round")}

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
        if isinstance(self.n_trees, bool) or not isinstance(self.n_trees, (int, np.integer)) or self.n_trees < 1:
            raise InputError(f"n_trees must be an integer >= 1, got {self.n_trees!r}")
        _check_n_trees(self.n_trees)
        if self.method not in _METHODS:
            raise InputError(f"method must be one of {_METHODS}, got {self.method!r}")
        if not isinstance(self.sliding_window, (bool, np.bool_)):
            raise InputError(f"sliding_window must be a bool, got {self.sliding_window!r}")
        _check_budget(self.backtracks)
        heap_capacity(1, self.heap_cap)
        check_split(self.split)
        resolve_descent(self.descent)
        return _check_build_params(self.leaf_size, self.max_depth, self.random_dims, self.seed)

    def fit(self, X, y=None, *, keep_rows: bool = True) -> "KDForest":
        """Validate the parameters and build the index of ``X`` ((N, d) float array).

        ``keep_rows=False`` builds the trees only, keeping no copy of the rows (``tree_.points``
        is None and this forest cannot answer queries): the arrays an index in a store needs,
        built with one copy of the rows on the device."""
        leaf_size, max_depth, rand_f, seed = self._validate()
        n_trees = int(self.n_trees)
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
        self.stats_ = {}
        return self

    def query(self, Q, k: int = 1, *, bounds=None, backtracks=_UNSET, return_stats: bool = False):
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
            Overrides the fitted ``backtracks`` for this call (``None``: unlimited), e.g. a
            small budget for the first phase of a bound synchronisation.
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
        if int(self.n_trees) != self.tree_.n_trees:
            raise InputError(f"this KDForest has n_trees={self.n_trees} but its tree_ holds {self.tree_.n_trees} "
                             "tree(s) (a forest loaded without its roots array?)")
        budget = self.backtracks if backtracks is _UNSET else backtracks
        _check_budget(budget)
        dist, ids, stats = query_kdtree(self.tree_, Q, k, method=self.method, backtracks=budget,
                                        sliding_window=self.sliding_window, bounds=bounds, return_stats=True,
                                        heap_cap=self.heap_cap, descent=self.descent,
                                        leaves_per_round=self.leaves_per_round)
        self.stats_ = stats = dict(stats, method=self.method)
        return (dist, ids, stats) if return_stats else (dist, ids)

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
