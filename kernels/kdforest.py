"""scikit-learn-style nearest-neighbour index over the array KD-tree (CPU and GPU)."""
from __future__ import annotations

import numpy as np

from ._backend import is_cupy, resolve_device
from .bruteforce import check_k, check_points, knn_bruteforce
from .errors import InputError
from .kdtree import _check_budget, _check_build_params, build_kdtree, query_kdtree

__all__ = ["KDForest"]

_METHODS = ("banns", "anns", "exact")


class KDForest:
    """Approximate (or exact) k-nearest-neighbour index on KD-trees, CPU or GPU.

    Parameters
    ----------
    n_trees : int, default 1
        Number of trees. Only 1 is implemented for now (a randomized forest sharing the query
        budget is future work); other values raise :class:`InputError` at ``fit``.
    leaf_size : int, default 64
        Maximum number of points in a leaf.
    backtracks : int or None, default None
        Maximum number of leaves scanned per query. ``None`` means unlimited: the search is
        exact (identical to brute force, ties by id).
    method : {"banns", "anns", "exact"}, default "banns"
        P-BANNS (buffered, GPU; the CPU runs the same traversal per query), P-ANNS (one query
        per thread), or the exact GEMM brute force.
    random_dims : int or None, default None
        ``None``: split on the widest box dimension (midpoint). ``F``: split on a dimension
        drawn among the F widest, seeded.
    seed : int, default 0
        Seed of the randomized split choice.
    device : {"auto", "cpu", "gpu"}, default "auto"
        ``auto`` follows the array type given to :meth:`fit`.
    max_depth : int or None, default None
        Nodes at this depth stay leaves (default 64).
    sliding_window : bool, default True
        P-BANNS leaf kernel: shared-memory sliding-window schedule or the plain one.

    Attributes
    ----------
    tree_ : KDTree or None
        The built tree (None for ``method="exact"``).
    n_samples_fit_ : int
    n_features_in_ : int
    device_ : str
        ``"cpu"`` or ``"gpu"``.
    stats_ : dict
        Statistics of the last query (rounds, heap overflows, ...).

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
                 device: str = "auto", max_depth: int | None = None, sliding_window: bool = True):
        self.n_trees = n_trees
        self.leaf_size = leaf_size
        self.backtracks = backtracks
        self.method = method
        self.random_dims = random_dims
        self.seed = seed
        self.device = device
        self.max_depth = max_depth
        self.sliding_window = sliding_window

    def get_params(self, deep: bool = True) -> dict:
        return {k: getattr(self, k) for k in ("n_trees", "leaf_size", "backtracks", "method", "random_dims",
                                              "seed", "device", "max_depth", "sliding_window")}

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
        if self.n_trees != 1:
            raise InputError("n_trees > 1 (a forest of randomized trees sharing the query budget) is not "
                             "implemented yet; use n_trees=1")
        if self.method not in _METHODS:
            raise InputError(f"method must be one of {_METHODS}, got {self.method!r}")
        if not isinstance(self.sliding_window, (bool, np.bool_)):
            raise InputError(f"sliding_window must be a bool, got {self.sliding_window!r}")
        _check_budget(self.backtracks)
        return _check_build_params(self.leaf_size, self.max_depth, self.random_dims, self.seed)

    def fit(self, X, y=None) -> "KDForest":
        """Validate the parameters and build the index of ``X`` ((N, d) float array)."""
        leaf_size, max_depth, rand_f, seed = self._validate()
        dev = resolve_device(self.device, X)
        if dev == "gpu":
            import cupy as cp

            X = check_points(cp.asarray(X), "X", xp=cp)
        else:
            from ._backend import to_numpy

            X = check_points(to_numpy(X), "X", xp=np)
        self.device_ = dev
        self.n_samples_fit_, self.n_features_in_ = int(X.shape[0]), int(X.shape[1])
        self._fit_X = X
        self.tree_ = None
        if self.method != "exact":
            self.tree_ = build_kdtree(X, leaf_size=leaf_size, max_depth=max_depth,
                                      random_dims=rand_f or None, seed=seed, device=dev)
        self.stats_ = {}
        return self

    def query(self, Q, k: int = 1):
        """The ``k`` nearest indexed points of each row of ``Q``.

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
        if self.method not in _METHODS:
            raise InputError(f"method must be one of {_METHODS}, got {self.method!r}")
        k = check_k(k, self.n_samples_fit_)
        if self.device_ == "gpu":
            import cupy as cp

            Q = check_points(cp.asarray(Q), "Q", dim=self.n_features_in_, xp=cp)
        else:
            from ._backend import to_numpy

            if is_cupy(Q):
                Q = to_numpy(Q)
            Q = check_points(Q, "Q", dim=self.n_features_in_, xp=np)
        if self.method == "exact" or self.tree_ is None:
            self.stats_ = {"method": "exact"}
            return knn_bruteforce(self._fit_X, Q, k, device=self.device_)
        dist, ids, stats = query_kdtree(self.tree_, Q, k, method=self.method, backtracks=self.backtracks,
                                        sliding_window=self.sliding_window, return_stats=True)
        self.stats_ = dict(stats, method=self.method)
        return dist, ids

    def kneighbors(self, Q, n_neighbors: int = 1):
        """scikit-learn naming: (distances, indices) with *Euclidean* distances."""
        d2, ids = self.query(Q, n_neighbors)
        xp = np
        if is_cupy(d2):
            import cupy as xp
        return xp.sqrt(d2), ids
