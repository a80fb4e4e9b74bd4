"""Correspondences: scene keypoints matched to the library's reference descriptors.

:func:`match` gives each scene descriptor its ``k`` nearest reference descriptors of the whole
library (exact brute force, :func:`~scanforest.kernels.knn.bruteforce.knn_bruteforce`) and keeps
those with squared distance ``< max_dist2`` (PCL tutorial: 0.25), optionally behind a ratio test.
NaN descriptors (too few neighbours) are skipped on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import resolve_device, to_device, to_numpy, xp_for
from ..errors import InputError
from .library import ModelLibrary

__all__ = ["Correspondences", "from_neighbours", "match"]


@dataclass
class Correspondences:
    """Scene-keypoint -> library-row matches (numpy).

    ``scene_kp`` indexes the scene keypoints, ``ref_row`` the library rows; ``model_id`` and
    ``model_kp`` (keypoint id inside its model) follow from ``ref_row``.
    """

    scene_kp: np.ndarray
    ref_row: np.ndarray
    model_id: np.ndarray
    model_kp: np.ndarray
    dist2: np.ndarray

    def __len__(self) -> int:
        return len(self.scene_kp)

    def take(self, sel) -> "Correspondences":
        return Correspondences(self.scene_kp[sel], self.ref_row[sel], self.model_id[sel],
                               self.model_kp[sel], self.dist2[sel])


def match(scene_descriptors, library: ModelLibrary, *, k: int = 1, max_dist2: float = 0.25,
          ratio: float | None = None, device: str = "auto", recall: float | None = None) -> Correspondences:
    """Nearest library descriptors of every scene descriptor (exact brute force; with ``recall``,
    the library's KD-forest at that recall).

    Parameters
    ----------
    scene_descriptors : (S, 352) array
        Scene SHOT descriptors; rows with NaN are skipped (PCL tutorial).
    library : ModelLibrary
    k : int
        Neighbours per scene descriptor (PCL tutorial: 1).
    max_dist2 : float
        Keep a pair when its squared descriptor distance is ``< max_dist2`` (PCL: 0.25).
    ratio : float, optional
        Ratio test: also query the ``k + 1``-th neighbour and keep neighbour ``j`` only when
        ``sqrt(d_j / d_{k+1}) < ratio`` (Lowe's test for ``k = 1``).
    device : {"auto", "cpu", "gpu"}
    recall : float, optional
        Search the library's KD-forest instead of the brute force, its budget calibrated for this
        recall@``k`` (``k + 1`` with ``ratio``) on the library's own rows
        (:meth:`ModelLibrary.forest_search`). ``None``: exact.

    Returns
    -------
    Correspondences
        Ordered by scene keypoint, then neighbour rank.
    """
    dev = resolve_device(device, scene_descriptors)
    k = int(k)
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    if ratio is not None and not (0 < float(ratio) <= 1):
        raise InputError(f"ratio must lie in (0, 1], got {ratio!r}")
    xp = xp_for(dev)
    sd = to_device(scene_descriptors, dev)
    if sd.ndim != 2 or sd.shape[1] != library.descriptors.shape[1]:
        raise InputError(f"scene descriptors must have shape (S, {library.descriptors.shape[1]}), "
                         f"got {tuple(sd.shape)}")
    rows = library.valid_rows
    empty = Correspondences(*(np.zeros(0, t) for t in (np.int64, np.int64, np.int32, np.int32,
                                                       np.float32)))
    if sd.shape[0] == 0 or len(rows) == 0:
        return empty
    sval = xp.flatnonzero(xp.isfinite(sd).all(axis=1))
    if int(sval.shape[0]) == 0:
        return empty
    kq = k + (1 if ratio is not None else 0)
    kq = min(kq, len(rows))
    if recall is None:
        d2, ids = library._exact_search(dev).search(sd[sval], kq)
    else:
        d2, ids = library.forest_search(dev).query(sd[sval], k=kq, recall=float(recall))
    d2 = to_numpy(d2).astype(np.float32)
    ids = to_numpy(ids)
    sval = to_numpy(sval)
    return from_neighbours(to_numpy(sval), to_numpy(d2), to_numpy(ids), library, k=k,
                           max_dist2=max_dist2, ratio=ratio if kq > min(k, kq) else None)


def from_neighbours(queries, dist2, ids, library: ModelLibrary, *, k: int = 1, max_dist2: float = 0.25,
                    ratio: float | None = None, rows=None) -> Correspondences:
    """Correspondences from a nearest-neighbour search done elsewhere (the match stage's global
    top-P from the KD-forest, or :func:`match`'s brute force): the same filters as :func:`match`.

    Parameters
    ----------
    queries : (Q,) int
        The scene keypoint of each searched row.
    dist2, ids : (Q, P)
        Squared descriptor distances (ascending) and ids of the P nearest reference rows; an id
        < 0 (fewer than P found) is skipped.
    rows : (R,) int, optional
        The library row of each reference id (default ``library.valid_rows``: the rows an index
        built from :meth:`ModelLibrary.reference` holds, in order).
    k, max_dist2, ratio :
        As :func:`match`; with ``ratio`` neighbour ``k + 1`` must be among the P.
    """
    rows = library.valid_rows if rows is None else np.asarray(rows)
    d2 = np.asarray(dist2, np.float32)
    ids = np.asarray(ids, np.int64)
    queries = np.asarray(queries, np.int64)
    if d2.ndim != 2 or d2.shape != ids.shape or len(queries) != len(ids):
        raise InputError(f"dist2 {d2.shape}, ids {ids.shape} and queries ({len(queries)},) do not agree")
    kk = min(int(k), d2.shape[1])
    keep = (d2[:, :kk] < np.float32(max_dist2)) & (ids[:, :kk] >= 0)
    if ratio is not None:
        if d2.shape[1] <= kk:
            raise InputError(f"the ratio test needs {kk + 1} neighbours per keypoint, got {d2.shape[1]}")
        den = np.maximum(d2[:, kk:kk + 1], np.float32(1e-30))
        keep &= np.sqrt(d2[:, :kk] / den) < np.float32(ratio)
    qi, j = np.nonzero(keep)
    ref = rows[ids[qi, j]]
    return Correspondences(queries[qi], ref.astype(np.int64), library.model_id[ref].astype(np.int32),
                           library.kp_id[ref].astype(np.int32), d2[qi, j])
