"""Nearest neighbours in descriptor space: exact brute force, KD-trees and forests, shards.

``bruteforce`` (exact, the canonical distance every search shares), ``kdtree`` (the array
KD-tree and its P-ANNS / P-BANNS search; numba build and search in ``_kdtree_cpu``, GPU ones in
``_kdtree_gpu`` with their CUDA source in ``cuda/*.cu``, the tree structure in
``_kdtree_common``), ``kdforest`` (the scikit-learn-style index), ``topk`` (merging per-shard
top-k) and ``sharded`` (an index split into contiguous shards).
"""
from .bruteforce import MAX_K, check_points, knn_bruteforce, pair_distances, recall
from .kdforest import KDForest, merge_topk_unique
from .kdtree import (DEFAULT_MAX_DEPTH, HEAP_CAP, MAX_HEAP_CAP, KDTree, build_kdforest,
                     build_kdtree, check_bounds, heap_capacity, pack_forest, query_kdtree)
from .sharded import (MAX_BLOCK, Shard, ShardPlan, ShardedIndex, fit_block, gather_rows,
                      plan_shards, search_working_bytes, shard_ranges, shard_resident_bytes)
from .topk import merge_topk, pad_topk

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "HEAP_CAP",
    "KDForest",
    "KDTree",
    "MAX_BLOCK",
    "MAX_HEAP_CAP",
    "MAX_K",
    "Shard",
    "ShardPlan",
    "ShardedIndex",
    "build_kdforest",
    "build_kdtree",
    "check_bounds",
    "check_points",
    "fit_block",
    "gather_rows",
    "heap_capacity",
    "knn_bruteforce",
    "merge_topk",
    "merge_topk_unique",
    "pack_forest",
    "pad_topk",
    "pair_distances",
    "plan_shards",
    "query_kdtree",
    "recall",
    "search_working_bytes",
    "shard_ranges",
    "shard_resident_bytes",
]
