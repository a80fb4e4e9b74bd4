"""Sharded nearest-neighbour index: the reference set split into contiguous shards, one
KD-forest per shard, every query visiting every shard, per-shard top-k merged into the global
top-k (:func:`scanforest.kernels.topk.merge_topk`).

This module is the single-process form (shards searched one after the other on one device);
:mod:`scanforest.flows.match` runs the same shards resident on Dask workers, one per GPU.
With an unlimited backtrack budget (or ``method="exact"``) the answer equals the single-device
brute force exactly, ids and distances, because shards are contiguous id ranges and the merge
orders by (distance, id).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._backend import is_cupy, xp_for
from .errors import InputError
from .topk import merge_topk, pad_topk


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

    def query(self, Q, k: int, **search):
        """Top-min(k, shard size) of this shard with *global* ids, padded to k with (inf, -1).

        ``search`` (``bounds=``, ``backtracks=``) goes to :meth:`KDForest.query`."""
        kk = min(k, self.stop - self.start)
        d, i = self.forest.query(Q, kk, **search)
        xp = xp_for("gpu" if is_cupy(i) else "cpu")
        i = xp.where(i >= 0, i + self.start, -1)  # -1 pads (fewer than k found) stay -1
        return pad_topk(d, i, k)


class ShardedIndex:
    """A reference set in ``shards`` contiguous shards, each indexed by its own KD-forest.

    Parameters
    ----------
    shards : int
        Number of shards (one per GPU worker in the distributed form).
    **forest_params
        Passed to :class:`scanforest.kernels.kdforest.KDForest` for every shard (``method``,
        ``leaf_size``, ``backtracks``, ``random_dims``, ``device`` ...). Each shard's ``seed``
        is ``seed + shard index``, so randomized trees differ between shards.
    """

    def __init__(self, *, shards: int = 1, **forest_params):
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
