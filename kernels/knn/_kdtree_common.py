"""The KD-tree structure shared by :mod:`.kdtree` and its GPU builder :mod:`._kdtree_gpu`.

It lives apart from :mod:`.kdtree` so that :mod:`._kdtree_gpu`, which :mod:`.kdtree` imports, can
build a :class:`KDTree` without importing :mod:`.kdtree` back. Layout and search are described in
:mod:`.kdtree`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..backend import to_numpy

#: the number each search kernel (numba and CUDA) takes for a descent bound (kdtree.DESCENTS)
DESCENT_IDS = {"box": 0, "path": 1, "incremental": 2}
#: the number each build kernel (numba and CUDA) takes for a split rule (kdtree.SPLIT_RULES)
RULE_IDS = {"midpoint": 0, "median": 1, "variance": 2}

__all__ = ["KDTree"]


@dataclass
class KDTree:
    """A built KD-tree. Arrays live on ``device`` (numpy for ``"cpu"``, CuPy for ``"gpu"``)."""

    device: str
    points: Any       # (N, d) float32 rows ordered by ``perm`` (float16 on a GPU: widened exactly in the kernels)
    perm: Any         # (N,) int64
    child: Any        # (n_nodes,) int32
    split_dim: Any    # (n_nodes,) int32
    split_val: Any    # (n_nodes,) float32
    start: Any        # (n_nodes,) int64
    end: Any          # (n_nodes,) int64
    lo: Any           # (n_nodes, d) float32
    hi: Any           # (n_nodes, d) float32
    depth: int
    leaf_size: int
    params: dict = field(default_factory=dict)
    data: Any = None  # (N, d) float32 points in input order, or None (exact fallbacks then use points + perm)
    roots: Any = None  # (T,) int32 root node of each tree of a packed forest; None: one tree, root 0

    @property
    def n_trees(self) -> int:
        return 1 if self.roots is None else int(self.roots.shape[0])

    @property
    def n_points(self) -> int:
        """Number of indexed points (each tree of a packed forest holds all of them)."""
        return int(self.perm.shape[0]) // self.n_trees

    @property
    def n_dims(self) -> int:
        return int(self.lo.shape[1])

    @property
    def n_nodes(self) -> int:
        return int(self.child.shape[0])

    @property
    def n_leaves(self) -> int:
        return int((self.child < 0).sum())

    def to_numpy(self) -> "KDTree":
        """A copy of the tree with every array on the host."""
        conv = {k: to_numpy(getattr(self, k)) for k in
                ("points", "perm", "child", "split_dim", "split_val", "start", "end", "lo", "hi")}
        return KDTree("cpu", depth=self.depth, leaf_size=self.leaf_size, params=dict(self.params),
                      data=None if self.data is None else to_numpy(self.data),
                      roots=None if self.roots is None else to_numpy(self.roots), **conv)
