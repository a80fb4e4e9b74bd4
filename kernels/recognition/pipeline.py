"""3-D object recognition: model library, correspondences, grouping, verification, refinement.

The pipeline follows PCL's correspondence-grouping tutorial (``correspondence_grouping.cpp``)
stage by stage, with a GPU verification stage that scores every pose hypothesis of a scene at
once:

1. **Description** - normals (k-NN PCA), keypoints (PCL ``UniformSampling``), SHOT352
   descriptors and local reference frames (:mod:`scanforest.kernels.descriptors.shot`), for the scene and,
   once, for every model of a :class:`ModelLibrary`.
2. **Matching** (:func:`match`) - each scene descriptor takes its ``k`` nearest reference
   descriptors of the whole library (exact brute force, :func:`~scanforest.kernels.knn.bruteforce.
   knn_bruteforce`) and keeps those with squared distance ``< max_dist2`` (PCL tutorial: 0.25),
   optionally behind a ratio test. NaN descriptors (too few neighbours) are skipped on both sides.
3. **Grouping**, per model -
   :func:`group_hough` (PCL ``Hough3DGrouping``: every correspondence casts the model
   keypoint-to-centroid vector, expressed in the keypoint's local reference frame, into the scene
   through the scene keypoint's frame; a sparse 3-D accumulator with PCL's bin layout, trilinear
   interpolation and threshold; local maxima over the 6 face neighbours) or
   :func:`group_gc` (PCL ``GeometricConsistencyGrouping``: greedy consensus sets in order of
   descriptor distance, ``| |m_i - m_j| - |s_i - s_j| | <= gc_size`` against every member, kept
   when the set has more than ``gc_thresh`` members). Each group is cleaned by RANSAC
   (PCL ``CorrespondenceRejectorSampleConsensus``: 3-point samples, inlier threshold = bin size
   / ``gc_size``, up to 10,000 iterations) and its pose is the SVD/Umeyama fit
   (PCL ``TransformationEstimationSVD``) on the RANSAC inliers.
4. **Verification** (:func:`verify`) - all hypotheses scored in one pass: each hypothesis'
   model verification points are transformed into the scene, the ones whose normal faces the
   viewpoint are "visible", and a visible point is an inlier when the nearest scene point lies
   within ``inlier_dist`` (cell-list lookup on the GPU, KD-tree on the CPU) and the scene voxel
   (edge ``inlier_dist``) of that scene point is not yet claimed. The score is the inlier
   fraction. Acceptance is greedy without sorting: take the argmax among the hypotheses above
   ``min_inlier_fraction``, claim the scene voxels it explains (occupancy), rescore the rest
   (a hypothesis that overlaps an accepted one loses the inliers it shares with it) and repeat.
5. **Refinement** - in :func:`recognize` verification runs twice around point-to-plane ICP
   (:mod:`scanforest.kernels.recognition.icp`): pass 1 scores every hypothesis (no claims), the promising
   ones (``refine_min_fraction``, at most ``max_refine``) are refined by ICP against the scene,
   and pass 2 runs the greedy acceptance on the refined poses.

Libraries of full 360-degree models (synthetic meshes) are best described through rendered
partial views (``ModelLibrary.build(..., views=N)``): SHOT on a complete closed surface differs
from SHOT on the one-sided surface a scan sees, so matching a scene against whole-model
descriptors fails at occlusion boundaries. Hough voting uses SHOT local reference frames at
``rf_rad`` (PCL's tutorial uses BOARD frames; BOARD is not implemented here).

:func:`recognize` runs the whole pipeline and returns a list of :class:`Detection` with the
per-phase timings.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import is_cupy, resolve_device, to_numpy, xp_for
from ..errors import InputError
from ..hypotheses import masked_argmax
from ._scene_index import _SceneIndex

__all__ = [
    "ModelLibrary",
    "Correspondences",
    "Hypotheses",
    "Detection",
    "Detections",
    "match",
    "group_hough",
    "group_gc",
    "rigid_transform",
    "ransac_rigid",
    "verify",
    "recognize",
    "describe",
    "evaluate",
    "pose_errors",
    "render_view",
    "resolution",
]

DESCRIPTOR_LENGTH = 352


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
class _Timer:
    """Per-phase wall-clock timer; synchronises the GPU before each reading when asked."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.t = {}
        self._last = time.perf_counter()

    def _sync(self):
        if self.gpu:
            import cupy as cp

            cp.cuda.Stream.null.synchronize()

    def lap(self, name: str):
        self._sync()
        now = time.perf_counter()
        self.t[name] = self.t.get(name, 0.0) + (now - self._last)
        self._last = now


def _finite_points(a, name):
    a = to_numpy(a) if not is_cupy(a) else a
    if a.ndim != 2 or a.shape[1] != 3:
        raise InputError(f"{name} must have shape (N, 3), got {tuple(a.shape)}")
    if a.shape[0] == 0:
        raise InputError(f"{name} is empty (0 points)")
    return a


def _on(a, dev):
    if dev == "gpu":
        import cupy as cp

        return cp.asarray(a)
    return to_numpy(a)




def resolution(points) -> float:
    """Mean nearest-neighbour spacing of a cloud (the "mesh resolution"), float64."""
    from scipy.spatial import cKDTree

    p = np.asarray(to_numpy(points), np.float64)
    if len(p) < 2:
        return 0.0
    d, _ = cKDTree(p).query(p, k=2, workers=-1)
    return float(np.mean(d[:, 1]))


def describe(points, *, normals=None, normal_k: int = 10, normal_radius: float | None = None,
             keypoint_radius: float,
             descr_rad: float, rf_rad: float | None = None, viewpoint=(0.0, 0.0, 0.0),
             device: str = "auto", timer: _Timer | None = None) -> dict:
    """Normals, uniform-sampling keypoints, SHOT descriptors and frames of one cloud.

    Parameters
    ----------
    points : (N, 3) array
        Finite coordinates (numpy or CuPy).
    normals : (N, 3) array, optional
        Given normals; estimated by k-NN PCA (``normal_k``, flipped towards ``viewpoint``) when
        omitted.
    keypoint_radius : float
        Uniform-sampling leaf size.
    descr_rad : float
        SHOT support radius.
    rf_rad : float, optional
        Radius of the local reference frames used by Hough voting; when it differs from
        ``descr_rad`` the frames are computed separately at that radius (SHOT LRF).

    Returns
    -------
    dict with ``normals`` (N, 3), ``keypoints`` (K,) int64, ``kp_coords`` (K, 3),
    ``descriptors`` (K, 352), ``frames`` (K, 3, 3) and ``rf`` (K, 3, 3), on the device.
    """
    from ..descriptors.keypoints import keypoints as _keypoints
    from ..descriptors.normals import normals as _normals
    from ..descriptors.shot import shot as _shot

    dev = resolve_device(device, points)
    pts = _on(points, dev)
    timer = timer or _Timer(dev == "gpu")
    if normals is None:
        if normal_radius:
            nrm, _ = _normals(pts, radius=normal_radius, viewpoint=viewpoint, device=dev)
        else:
            nrm, _ = _normals(pts, k=normal_k, viewpoint=viewpoint, device=dev)
    else:
        nrm = _on(normals, dev).astype(np.float32)
    timer.lap("normals")
    xp = xp_for(dev)
    good = xp.isfinite(nrm).all(axis=1)
    sub = None
    if not bool(good.all()):
        # points without a normal (fewer than 3 neighbours) are left out of keypoints and SHOT
        # support (the CPU SHOT divides by zero when a support has no finite normal at all)
        sub = xp.flatnonzero(good)
        pts, nrm = xp.ascontiguousarray(pts[sub]), xp.ascontiguousarray(nrm[sub])
    kp = _keypoints(pts, radius=keypoint_radius, device=dev)
    timer.lap("keypoints")
    desc, frames = _shot(pts, nrm, kp, descr_rad, device=dev)
    if rf_rad is None or abs(rf_rad - descr_rad) < 1e-12:
        rf = frames
    else:
        _, rf = _shot(pts, nrm, kp, rf_rad, device=dev)
    timer.lap("shot")
    kc = pts[kp]
    if sub is not None:
        kp = sub[kp]
        full = xp.full((int(good.shape[0]), 3), xp.nan, dtype=xp.float32)
        full[sub] = nrm
        nrm = full
    return {"normals": nrm, "keypoints": kp, "kp_coords": kc, "descriptors": desc,
            "frames": frames, "rf": rf}


def _fibonacci_sphere(n):
    k = np.arange(n) + 0.5
    z = 1 - 2 * k / n
    r = np.sqrt(1 - z * z)
    phi = np.pi * (1 + 5 ** 0.5) * k
    return np.stack([r * np.cos(phi), r * np.sin(phi), z], axis=1)


def render_view(points, normals, camera, pixel):
    """Indices of the points a camera at ``camera`` sees (front-facing, nearest per pixel)."""
    P = np.asarray(points, np.float64)
    N = np.asarray(normals, np.float64)
    cam = np.asarray(camera, np.float64)
    front = np.einsum("ij,ij->i", N, cam - P) > 0
    idx = np.flatnonzero(front)
    if len(idx) == 0:
        return idx
    z = -cam / np.linalg.norm(cam)                      # looking at the model's origin
    x = np.cross([0.0, 0.0, 1.0] if abs(z[2]) < 0.9 else [1.0, 0.0, 0.0], z)
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    Q = (P[idx] - cam) @ np.stack([x, y, z], 1)
    depth = Q[:, 2]
    u = np.floor(Q[:, 0] / depth / pixel).astype(np.int64)
    v = np.floor(Q[:, 1] / depth / pixel).astype(np.int64)
    key = (v - v.min()) * (u.max() - u.min() + 1) + (u - u.min())
    order = np.lexsort((depth, key))
    first = np.ones(len(order), bool)
    first[1:] = key[order][1:] != key[order][:-1]
    return np.sort(idx[order[first]])


def _describe_views(P, ref_normals, views, distance, normal_k, normal_radius, model_ss, descr_rad,
                    rf_rad, dev):
    """Describe a full model through ``views`` rendered partial views (see ModelLibrary.build)."""
    res = resolution(P)
    pixel = 2.0 * res / distance
    kps, kcs, descs, frames, rfs = [], [], [], [], []
    for cam in _fibonacci_sphere(views) * distance:
        vis = render_view(P, ref_normals, cam, pixel)
        if len(vis) < max(3 * normal_k, 30):
            continue
        V = np.ascontiguousarray(P[vis])
        d = describe(V, normal_k=normal_k, normal_radius=normal_radius, keypoint_radius=model_ss,
                     descr_rad=descr_rad, rf_rad=rf_rad, viewpoint=cam, device=dev)
        kp = np.asarray(to_numpy(d["keypoints"]), np.int64)
        kps.append(vis[kp])
        kcs.append(V[kp])
        descs.append(np.asarray(to_numpy(d["descriptors"]), np.float32))
        frames.append(np.asarray(to_numpy(d["frames"]), np.float32))
        rfs.append(np.asarray(to_numpy(d["rf"]), np.float32))
    from ..descriptors.normals import normals as _normals

    if normal_radius:
        nrm, _ = _normals(P, radius=normal_radius, device="cpu")
    else:
        nrm, _ = _normals(P, k=normal_k, device="cpu")
    nrm = np.where((np.einsum("ij,ij->i", nrm, ref_normals) < 0)[:, None], -nrm, nrm).astype(np.float32)
    d = {"keypoints": np.concatenate(kps), "kp_coords": np.concatenate(kcs),
         "descriptors": np.concatenate(descs), "frames": np.concatenate(frames),
         "rf": np.concatenate(rfs)}
    return d, nrm


def _uniform_subsample(points, leaf):
    from ..descriptors.keypoints import keypoints as _keypoints

    return to_numpy(_keypoints(np.asarray(points, np.float32), radius=leaf, device="cpu"))


# ---------------------------------------------------------------------------------------------
# model library
# ---------------------------------------------------------------------------------------------
@dataclass
class ModelLibrary:
    """Many object models, described once, matched as one reference set.

    Arrays are concatenations over the models; ``*_offsets`` (M + 1,) give each model's slice.
    Every reference row ``r`` (a model keypoint) carries ``model_id[r]`` and ``kp_id[r]`` (its
    keypoint number inside its model). Everything is plain numpy so that :meth:`to_arrays` /
    :meth:`from_arrays` round-trip through any array store (Zarr, npz).
    """

    names: list[str]
    point_offsets: np.ndarray     # (M+1,) int64
    points: np.ndarray            # (P, 3) float32, each model in its own frame
    normals: np.ndarray           # (P, 3) float32
    kp_offsets: np.ndarray        # (M+1,) int64
    kp_index: np.ndarray          # (K,) int64, index into the model's own points
    kp_coords: np.ndarray         # (K, 3) float32
    descriptors: np.ndarray       # (K, 352) float32, NaN rows where SHOT is undefined
    frames: np.ndarray            # (K, 3, 3) float32, SHOT LRF at descr_rad (rows = axes)
    rf: np.ndarray                # (K, 3, 3) float32, LRF at rf_rad used by Hough voting
    model_id: np.ndarray          # (K,) int32
    kp_id: np.ndarray             # (K,) int32
    centroids: np.ndarray         # (M, 3) float64: centroid of each model's keypoints
    votes: np.ndarray             # (K, 3) float32: rf @ (centroid - keypoint)
    verify_offsets: np.ndarray    # (M+1,) int64
    verify_points: np.ndarray     # (V, 3) float32, uniform subsample for verification / ICP
    verify_normals: np.ndarray    # (V, 3) float32
    resolutions: np.ndarray       # (M,) float64 mean NN spacing of each model
    params: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, models_points, names=None, *, models_normals=None, model_ss: float = 0.01,
              descr_rad: float = 0.02, rf_rad: float = 0.015, normal_k: int = 10,
              normal_radius: float | None = None,
              viewpoint=(0.0, 0.0, 0.0), verify_leaf: float | None = None, views: int = 0,
              view_distance: float = 1.0, device: str = "auto") -> "ModelLibrary":
        """Describe every model (normals, keypoints, SHOT, frames) and stack the results.

        Parameters
        ----------
        models_points : list of (N_i, 3) arrays
            Model clouds, each in its own frame (NaN/inf rows are dropped).
        names : list of str, optional
            Model names (default ``model_000`` ...).
        models_normals : list of (N_i, 3) arrays, optional
            Reference normals (e.g. a mesh's outward normals). Normals are always re-estimated
            by k-NN PCA like the scene's, and then flipped to agree with these; without them
            they face ``viewpoint`` as in PCL (right for views cut from a scan, as
            ``milk.pcd``).
        model_ss : float
            Keypoint uniform-sampling leaf (PCL tutorial: 0.01).
        descr_rad, rf_rad : float
            SHOT support radius (0.02) and Hough reference-frame radius (0.015).
        normal_k : int
            Neighbours of the normal estimation (10).
        normal_radius : float, optional
            Radius neighbourhood for the normals instead of ``normal_k`` (better for dense,
            noisy clouds).
        verify_leaf : float, optional
            Leaf of the verification/ICP subsample (default ``model_ss / 2``).
        views : int
            0 (default): describe each model cloud as given (PCL tutorial; right for a model
            that is itself one scan view, as ``milk.pcd``). ``views > 0``: the model is a full
            360-degree surface (with ``models_normals``); it is seen from ``views`` cameras
            spread on a sphere (Fibonacci lattice) at ``view_distance``, each view keeps the
            points facing the camera and nearest in their pixel (a z-buffer of pixel 2x the
            model resolution), and every view is described like a scene (normals towards its
            camera). All views' keypoints stay in model coordinates and vote the same
            centroid, so a scene instance seen from any side meets descriptors computed on the
            same partial surface.
        device : {"auto", "cpu", "gpu"}
            Where descriptors are computed; the library itself is always stored as numpy.
        """
        if isinstance(models_points, np.ndarray) and models_points.ndim == 2:
            models_points = [models_points]
        models_points = list(models_points)
        if not models_points:
            raise InputError("models_points is empty: at least one model is needed")
        m = len(models_points)
        names = [f"model_{i:03d}" for i in range(m)] if names is None else [str(n) for n in names]
        if len(names) != m:
            raise InputError(f"{len(names)} names for {m} models")
        if models_normals is not None and len(models_normals) != m:
            raise InputError(f"{len(models_normals)} normal arrays for {m} models")
        for name, val in (("model_ss", model_ss), ("descr_rad", descr_rad), ("rf_rad", rf_rad)):
            if not (float(val) > 0 and math.isfinite(float(val))):
                raise InputError(f"{name} must be a positive number, got {val!r}")
        verify_leaf = float(verify_leaf) if verify_leaf else model_ss / 2.0
        dev = resolve_device(device)
        parts: dict[str, list] = {k: [] for k in ("points", "normals", "kp_index", "kp_coords",
                                                  "descriptors", "frames", "rf", "model_id",
                                                  "kp_id", "votes", "vpts", "vnrm")}
        centroids, res = [], []
        for i, P in enumerate(models_points):
            P = np.asarray(to_numpy(P))
            if P.ndim != 2 or P.shape[1] != 3:
                raise InputError(f"model {names[i]!r} must have shape (N, 3), got {P.shape}")
            keep = np.isfinite(P).all(axis=1)
            P = np.ascontiguousarray(P[keep], np.float32)
            if len(P) < max(normal_k, 10):
                raise InputError(f"model {names[i]!r} has only {len(P)} finite points")
            if views and views > 0:
                if models_normals is None:
                    raise InputError("views > 0 needs models_normals (outward surface normals)")
                ref = np.asarray(to_numpy(models_normals[i]), np.float32)[keep]
                d, nrm = _describe_views(P, ref, int(views), float(view_distance), normal_k,
                                         normal_radius, model_ss, descr_rad, rf_rad, dev)
                kp = d["keypoints"]
                kc = d["kp_coords"]
                rf = d["rf"]
                c = P.astype(np.float64).mean(axis=0)
            else:
                d = describe(P, normal_k=normal_k, normal_radius=normal_radius,
                             keypoint_radius=model_ss, descr_rad=descr_rad, rf_rad=rf_rad,
                             viewpoint=viewpoint, device=dev)
                nrm = np.asarray(to_numpy(d["normals"]), np.float32)
                if models_normals is not None:
                    ref = np.asarray(to_numpy(models_normals[i]), np.float32)[keep]
                    flip = np.einsum("ij,ij->i", nrm, ref) < 0
                    if flip.any():
                        nrm = nrm.copy()
                        nrm[flip] *= -1
                        # SHOT depends on the normals' signs: describe again with the oriented ones
                        d = describe(P, normals=nrm, keypoint_radius=model_ss, descr_rad=descr_rad,
                                     rf_rad=rf_rad, device=dev)
                kp = np.asarray(to_numpy(d["keypoints"]), np.int64)
                kc = P[kp]
                rf = np.asarray(to_numpy(d["rf"]), np.float32)
                c = kc.astype(np.float64).mean(axis=0) if len(kc) else P.astype(np.float64).mean(0)
            votes = np.einsum("kij,kj->ki", rf.astype(np.float64), c[None, :] - kc).astype(np.float32)
            vsel = _uniform_subsample(P, verify_leaf)
            parts["points"].append(P)
            parts["normals"].append(nrm)
            parts["kp_index"].append(kp)
            parts["kp_coords"].append(np.asarray(kc, np.float32))
            parts["descriptors"].append(np.asarray(to_numpy(d["descriptors"]), np.float32))
            parts["frames"].append(np.asarray(to_numpy(d["frames"]), np.float32))
            parts["rf"].append(rf)
            parts["model_id"].append(np.full(len(kp), i, np.int32))
            parts["kp_id"].append(np.arange(len(kp), dtype=np.int32))
            parts["votes"].append(votes)
            parts["vpts"].append(P[vsel])
            parts["vnrm"].append(nrm[vsel])
            centroids.append(c)
            res.append(resolution(P))

        def offs(lst):
            o = np.zeros(len(lst) + 1, np.int64)
            o[1:] = np.cumsum([len(x) for x in lst])
            return o

        cat = {k: np.concatenate(v) if v else v for k, v in parts.items()}
        params = {"model_ss": float(model_ss), "descr_rad": float(descr_rad), "rf_rad": float(rf_rad),
                  "normal_k": int(normal_k), "normal_radius": normal_radius,
                  "verify_leaf": float(verify_leaf), "views": int(views),
                  "viewpoint": [float(v) for v in viewpoint]}
        return cls(names=names, point_offsets=offs(parts["points"]), points=cat["points"],
                   normals=cat["normals"], kp_offsets=offs(parts["kp_index"]),
                   kp_index=cat["kp_index"], kp_coords=cat["kp_coords"],
                   descriptors=cat["descriptors"], frames=cat["frames"], rf=cat["rf"],
                   model_id=cat["model_id"], kp_id=cat["kp_id"],
                   centroids=np.asarray(centroids, np.float64), votes=cat["votes"],
                   verify_offsets=offs(parts["vpts"]), verify_points=cat["vpts"],
                   verify_normals=cat["vnrm"], resolutions=np.asarray(res, np.float64),
                   params=params)

    # ------------------------------------------------------------------ properties
    @property
    def n_models(self) -> int:
        return len(self.names)

    @property
    def valid_rows(self) -> np.ndarray:
        """Reference rows with a finite descriptor (the rows that are matched)."""
        return np.flatnonzero(np.isfinite(self.descriptors).all(axis=1))

    @property
    def resolution(self) -> float:
        return float(np.mean(self.resolutions))

    def model_points(self, i: int) -> np.ndarray:
        return self.points[self.point_offsets[i]:self.point_offsets[i + 1]]

    def __repr__(self) -> str:
        return (f"ModelLibrary({self.n_models} models, {len(self.kp_id)} reference descriptors "
                f"({len(self.valid_rows)} valid), params={self.params})")

    def _device_array(self, key, make, dev):
        """A memoised device copy of a derived array (the matched reference descriptors)."""
        if dev != "gpu":
            return make()
        cache = self.__dict__.setdefault("_gpu_cache", {})
        if key not in cache:
            import cupy as cp

            cache[key] = cp.asarray(make())
        return cache[key]

    # ------------------------------------------------------------------ persistence
    _ARRAYS = ("point_offsets", "points", "normals", "kp_offsets", "kp_index", "kp_coords",
               "descriptors", "frames", "rf", "model_id", "kp_id", "centroids", "votes",
               "verify_offsets", "verify_points", "verify_normals", "resolutions")

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(arrays, attrs)``: plain numpy arrays and JSON-able attributes (names, params)."""
        arrays = {k: np.asarray(getattr(self, k)) for k in self._ARRAYS}
        attrs = {"names": list(self.names), "params": dict(self.params), "format": "scanforest-modellib-1"}
        return arrays, attrs

    @classmethod
    def from_arrays(cls, arrays, attrs) -> "ModelLibrary":
        """Inverse of :meth:`to_arrays` (``arrays`` may be any mapping of array-likes)."""
        missing = [k for k in cls._ARRAYS if k not in arrays]
        if missing:
            raise InputError(f"model library arrays are missing {missing}")
        kw = {k: np.asarray(arrays[k]) for k in cls._ARRAYS}
        return cls(names=list(attrs["names"]), params=dict(attrs.get("params", {})), **kw)


# ---------------------------------------------------------------------------------------------
# correspondences
# ---------------------------------------------------------------------------------------------
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
          ratio: float | None = None, device: str = "auto") -> Correspondences:
    """Nearest library descriptors of every scene descriptor (exact brute force).

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

    Returns
    -------
    Correspondences
        Ordered by scene keypoint, then neighbour rank.
    """
    from ..knn.bruteforce import knn_bruteforce

    dev = resolve_device(device, scene_descriptors)
    k = int(k)
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    if ratio is not None and not (0 < float(ratio) <= 1):
        raise InputError(f"ratio must lie in (0, 1], got {ratio!r}")
    xp = xp_for(dev)
    sd = _on(scene_descriptors, dev)
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
    base = library._device_array("ref_descriptors", lambda: library.descriptors[rows], dev)
    d2, ids = knn_bruteforce(base, sd[sval], kq, device=dev)
    d2 = to_numpy(d2).astype(np.float32)
    ids = to_numpy(ids)
    sval = to_numpy(sval)
    kk = min(k, kq)
    keep = d2[:, :kk] < np.float32(max_dist2)
    if ratio is not None and kq > kk:
        den = np.maximum(d2[:, kk:kk + 1], np.float32(1e-30))
        keep &= np.sqrt(d2[:, :kk] / den) < np.float32(ratio)
    qi, j = np.nonzero(keep)
    ref = rows[ids[qi, j]]
    return Correspondences(sval[qi].astype(np.int64), ref.astype(np.int64),
                           library.model_id[ref].astype(np.int32),
                           library.kp_id[ref].astype(np.int32), d2[qi, j])


# ---------------------------------------------------------------------------------------------
# rigid fits
# ---------------------------------------------------------------------------------------------
def rigid_transform(src, dst, weights=None) -> np.ndarray:
    """Least-squares rigid transform ``dst ~ R src + t`` (PCL ``TransformationEstimationSVD``).

    Float64 SVD of the cross-covariance of the demeaned sets; the reflection case is fixed by
    negating the last column of V (as PCL/Umeyama). Returns a 4x4 float64 matrix.
    """
    s = np.asarray(src, np.float64)
    d = np.asarray(dst, np.float64)
    if s.shape != d.shape or s.ndim != 2 or s.shape[1] != 3:
        raise InputError(f"src and dst must both be (N, 3), got {s.shape} and {d.shape}")
    if len(s) < 3:
        raise InputError(f"a rigid fit needs at least 3 correspondences, got {len(s)}")
    w = np.ones(len(s)) if weights is None else np.asarray(weights, np.float64)
    ws = w.sum()
    cs = (w[:, None] * s).sum(0) / ws
    cd = (w[:, None] * d).sum(0) / ws
    H = ((s - cs) * w[:, None]).T @ (d - cd)
    U, _, Vt = np.linalg.svd(H)
    V = Vt.T
    if np.linalg.det(U) * np.linalg.det(V) < 0:
        V[:, 2] *= -1
    R = V @ U.T
    T = np.eye(4)
    T[:3, :3] = R
    T[:3, 3] = cd - R @ cs
    return T


def _kabsch_batch(S, D, W=None):
    """Batched (optionally weighted) rigid fits: S, D (B, n, 3) float64, W (B, n) weights or
    None -> R (B, 3, 3), t (B, 3).

    The unweighted fits (RANSAC's 3-point samples, tens of thousands per scene) run in one
    numba loop: Horn's quaternion form of the same least-squares rotation, the top eigenvector
    of a 4x4 symmetric matrix by Jacobi sweeps (no LAPACK call per sample)."""
    if W is None and _kabsch_nb is not None and S.dtype == np.float64 and D.dtype == np.float64:
        return _kabsch_nb(np.ascontiguousarray(S), np.ascontiguousarray(D))
    return _kabsch_svd(S, D, W)


def _kabsch_svd(S, D, W=None):
    """:func:`_kabsch_batch` by batched SVD (Kabsch with the reflection fix)."""
    if W is None:
        cs = S.mean(axis=1)
        cd = D.mean(axis=1)
        H = np.einsum("bni,bnj->bij", S - cs[:, None], D - cd[:, None])
    else:
        ws = np.maximum(W.sum(axis=1), 1e-12)
        cs = np.einsum("bn,bni->bi", W, S) / ws[:, None]
        cd = np.einsum("bn,bni->bi", W, D) / ws[:, None]
        H = np.einsum("bn,bni,bnj->bij", W, S - cs[:, None], D - cd[:, None])
    U, _, Vt = np.linalg.svd(H)
    V = np.swapaxes(Vt, 1, 2)
    bad = np.linalg.det(U) * np.linalg.det(V) < 0
    V[bad, :, 2] *= -1
    R = V @ np.swapaxes(U, 1, 2)
    t = cd - np.einsum("bij,bj->bi", R, cs)
    return R, t


def ransac_rigid(src, dst, *, threshold: float, max_iterations: int = 10000,
                 probability: float = 0.99, refine: bool = True, seed: int = 0, batch: int = 256):
    """RANSAC rigid registration of paired points (PCL ``CorrespondenceRejectorSampleConsensus``).

    3-point samples, inlier when ``|R s + t - d|^2 < threshold^2``, adaptive iteration count
    for the given ``probability`` (capped at ``max_iterations``). With ``refine`` the best
    model is refitted by SVD on its inliers (and the inliers recomputed once), which PCL leaves
    to the caller.

    Returns
    -------
    (pose 4x4 float64, inlier mask) or ``(None, None)`` with fewer than 3 pairs.
    """
    s = np.asarray(src, np.float64)
    d = np.asarray(dst, np.float64)
    n = len(s)
    if n < 3:
        return None, None
    rng = np.random.default_rng(seed)
    thr2 = float(threshold) ** 2
    best_cnt, best = -1, None
    needed, it = max_iterations, 0
    while it < min(needed, max_iterations):
        # small first batches: consistent groups (most of them) stop after a few samples
        b = min(batch, max(16, it), max_iterations - it, max(needed - it, 1))
        samp = np.stack([rng.choice(n, 3, replace=False) for _ in range(min(b, 1))]) if n == 3 \
            else _triples(rng, n, b)
        R, t = _kabsch_batch(s[samp], d[samp])
        res = np.einsum("bij,nj->bni", R, s) + t[:, None, :] - d[None]
        inl = np.einsum("bni,bni->bn", res, res) < thr2
        cnt = inl.sum(axis=1)
        j = int(np.argmax(cnt))
        if cnt[j] > best_cnt:
            best_cnt = int(cnt[j])
            best = (R[j], t[j], inl[j])
            w = best_cnt / n
            p_fail = 1.0 - w ** 3
            if p_fail <= 0:
                needed = 0
            elif p_fail < 1:
                needed = int(math.ceil(math.log(1 - probability) / math.log(p_fail)))
        it += b
        if n == 3:
            break
    R, t, inl = best
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, t
    if refine and inl.sum() >= 3:
        T = rigid_transform(s[inl], d[inl])
        res = s @ T[:3, :3].T + T[:3, 3] - d
        inl2 = np.einsum("ni,ni->n", res, res) < thr2
        if inl2.sum() >= 3 and inl2.sum() >= inl.sum():
            inl = inl2
            T = rigid_transform(s[inl], d[inl])
    return T, inl


def _triples(rng, n, b):
    s = rng.integers(0, n, size=(b, 3))
    bad = (s[:, 0] == s[:, 1]) | (s[:, 0] == s[:, 2]) | (s[:, 1] == s[:, 2])
    while bad.any():
        s[bad] = rng.integers(0, n, size=(int(bad.sum()), 3))
        bad = (s[:, 0] == s[:, 1]) | (s[:, 0] == s[:, 2]) | (s[:, 1] == s[:, 2])
    return s


# ---------------------------------------------------------------------------------------------
# grouping
# ---------------------------------------------------------------------------------------------
@dataclass
class Hypotheses:
    """Pose hypotheses: ``poses`` (H, 4, 4) float64 map model coordinates into the scene."""

    model_id: np.ndarray                 # (H,) int32
    poses: np.ndarray                    # (H, 4, 4) float64
    n_corr: np.ndarray                   # (H,) int32: correspondences kept (RANSAC inliers)
    groups: list = field(default_factory=list)  # per hypothesis: correspondence indices

    def __len__(self) -> int:
        return len(self.model_id)

    @classmethod
    def empty(cls) -> "Hypotheses":
        return cls(np.zeros(0, np.int32), np.zeros((0, 4, 4)), np.zeros(0, np.int32), [])

    @classmethod
    def concat(cls, hs) -> "Hypotheses":
        hs = [h for h in hs if len(h)]
        if not hs:
            return cls.empty()
        return cls(np.concatenate([h.model_id for h in hs]), np.concatenate([h.poses for h in hs]),
                   np.concatenate([h.n_corr for h in hs]), sum((h.groups for h in hs), []))


def hough_maxima(votes, *, bin_size: float, threshold: float, use_interpolation: bool = True,
                 weights=None):
    """PCL ``HoughSpace3D`` voting and ``findMaxima`` on a sparse accumulator.

    The accumulator spans ``[min(votes), max(votes)]`` with ``ceil(extent / bin)`` bins per
    axis (PCL's layout: a vote exactly on the upper bound falls outside and is dropped, as in
    PCL). With interpolation a vote spreads over the 8 bins around it with PCL's trilinear
    weights. A bin is a maximum when its value is ``>= threshold`` (a negative threshold in
    [-1, 0) is a fraction of the global maximum) and not smaller than any of its 6 face
    neighbours.

    Returns
    -------
    values : list of float, voters : list of int arrays (voter ids of each maximum, ascending)
    """
    V = np.asarray(votes, np.float64)
    n = len(V)
    if n == 0:
        return [], []
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    b = float(bin_size)
    dmin = V.min(axis=0)
    dmax = V.max(axis=0)
    counts = np.ceil((dmax - dmin) / b).astype(np.int64)
    if (counts <= 0).any():
        return [], []
    prod = np.array([1, counts[0], counts[0] * counts[1]], np.int64)
    rel = V - dmin
    c = np.floor(rel / b).astype(np.int64)
    ok = ((c >= 0) & (c < counts)).all(axis=1)
    if use_interpolation:
        centroid = ((2.0 * c * b + b) / 2.0).astype(np.float32)
        cw = (1.0 - np.abs(rel - centroid) / b).astype(np.float32)
        interp = np.where(rel < centroid, c - 1, np.where(rel > centroid, c + 1, c))
        offs = np.array([[(m // e) % 3 - 1 for e in (1, 3, 9)] for m in range(27)], np.int64)
        nb = c[:, None, :] + offs[None]                           # (n, 27, 3)
        valid = ((nb >= 0) & (nb < counts)).all(axis=2) & ok[:, None]
        is_i = nb == interp[:, None, :]
        is_c = nb == c[:, None, :]
        valid &= (is_i | is_c).all(axis=2)
        fw = np.where(is_i, (1.0 - cw)[:, None, :].astype(np.float32),
                      cw[:, None, :].astype(np.float32)).astype(np.float32)
        iw = fw[..., 0] * fw[..., 1] * fw[..., 2]                 # float32, as PCL's interp_weight
        keys = (nb * prod).sum(axis=2)
        vi, _ = np.nonzero(valid)
        bins = keys[valid]
        vals = w[vi] * iw[valid].astype(np.float64)
    else:
        vi = np.flatnonzero(ok)
        bins = (c[ok] * prod).sum(axis=1)
        vals = w[vi]
    if len(bins) == 0:
        return [], []
    ub, inv = np.unique(bins, return_inverse=True)
    acc = np.bincount(inv, weights=vals, minlength=len(ub))
    thr = float(threshold)
    if thr < 0:
        hmax = max(acc.max(), np.finfo(np.float64).tiny)
        thr = -thr * hmax if thr >= -1 else hmax
    cand = np.flatnonzero(acc >= thr)
    if len(cand) == 0:
        return [], []
    ck = ub[cand]
    coords = np.stack([ck % counts[0], (ck // counts[0]) % counts[1], ck // (counts[0] * counts[1])], 1)
    is_max = np.ones(len(cand), bool)
    for dim in range(3):
        for sgn in (-1, 1):
            inside = (coords[:, dim] > 0) if sgn < 0 else (coords[:, dim] < counts[dim] - 1)
            nk = ck + sgn * prod[dim]
            pos = np.searchsorted(ub, nk)
            pos_c = np.minimum(pos, len(ub) - 1)
            found = ub[pos_c] == nk
            nval = np.where(found, acc[pos_c], 0.0)
            is_max &= ~(inside & (acc[cand] < nval))
    values, voters = [], []
    order = np.argsort(inv, kind="stable")
    starts = np.searchsorted(inv[order], np.arange(len(ub) + 1))
    for ci in cand[is_max]:
        values.append(float(acc[ci]))
        voters.append(np.sort(vi[order[starts[ci]:starts[ci + 1]]]))
    return values, voters


def group_hough(corr: Correspondences, library: ModelLibrary, scene_kp_coords, scene_rf, *,
                bin_size: float = 0.01, threshold: float = 5.0, use_interpolation: bool = True,
                use_distance_weight: bool = False, ransac: bool = True,
                ransac_threshold: float | None = None, max_iterations: int = 10000,
                seed: int = 0) -> Hypotheses:
    """Hough 3-D voting with local reference frames (PCL ``Hough3DGrouping``), per model.

    Each correspondence votes ``s + F_s^T v_m`` where ``v_m = F_m (c_m - m)`` is the model
    keypoint's vector to the model centroid in its own frame (``F`` rows = axes). Maxima of the
    accumulator (see :func:`hough_maxima`) are groups; each group is cleaned by RANSAC
    (inlier threshold ``ransac_threshold``, default ``bin_size``) and fitted by SVD.
    Correspondences whose scene or model frame is undefined (NaN) do not vote.
    """
    skp = np.asarray(to_numpy(scene_kp_coords), np.float64)
    srf = np.asarray(to_numpy(scene_rf), np.float64)
    out = []
    thr = bin_size if ransac_threshold is None else ransac_threshold
    for mid in np.unique(corr.model_id):
        sel = np.flatnonzero(corr.model_id == mid)
        mrow = corr.ref_row[sel]
        F = srf[corr.scene_kp[sel]]
        v = library.votes[mrow].astype(np.float64)
        good = np.isfinite(F).all(axis=(1, 2)) & np.isfinite(v).all(axis=1)
        sel, mrow, F, v = sel[good], mrow[good], F[good], v[good]
        if len(sel) == 0:
            continue
        votes = np.einsum("nji,nj->ni", F, v) + skp[corr.scene_kp[sel]]
        wts = None
        if use_distance_weight:
            dd = corr.dist2[sel].astype(np.float64)
            mx = dd.max()
            wts = 1.0 - dd / mx if mx != 0 else None
        _, voters = hough_maxima(votes, bin_size=bin_size, threshold=threshold,
                                 use_interpolation=use_interpolation, weights=wts)
        for vs in voters:
            out.append((sel[vs], int(mid)))
    return _fit_groups(corr, library, skp, out, ransac, thr, max_iterations, seed)


def ransac_rigid_groups(srcs, dsts, *, threshold: float, max_iterations: int = 10000,
                        probability: float = 0.99, seed: int = 0, first: int = 32, cap: int = 1024):
    """:func:`ransac_rigid` for many small groups at once (the hypotheses of one scene).

    The groups are padded to a common length and sampled together: ``first`` 3-point samples
    per group in one batched Kabsch, then, for the groups whose best inlier ratio asks for more
    samples (adaptive count for ``probability``), a second batch up to ``min(max_iterations,
    cap)``; the best model is refitted on its inliers and the inliers recomputed once, as
    :func:`ransac_rigid` does. Returns a list of ``(pose, inlier mask)`` (``(None, None)`` for
    groups of fewer than 3 pairs).
    """
    G = len(srcs)
    out = [(None, None)] * G
    ok = [g for g in range(G) if len(srcs[g]) >= 3]
    if not ok:
        return out
    rng = np.random.default_rng(seed)
    thr2 = float(threshold) ** 2
    n = np.array([len(srcs[g]) for g in ok])
    L = int(n.max())
    S = np.zeros((len(ok), L, 3))
    D = np.zeros((len(ok), L, 3))
    M = np.zeros((len(ok), L), bool)
    for r, g in enumerate(ok):
        S[r, :n[r]], D[r, :n[r]], M[r, :n[r]] = srcs[g], dsts[g], True
    best_cnt = np.full(len(ok), -1)
    best_R = np.zeros((len(ok), 3, 3))
    best_t = np.zeros((len(ok), 3))

    def run(rows, b):
        rows = np.asarray(rows)[np.argsort(n[rows], kind="stable")]  # similar sizes share a chunk
        c0 = 0
        while c0 < len(rows):
            Lc = int(n[rows[min(len(rows), c0 + 256) - 1]])  # chunk padded to its largest group
            step = max(1, min(256, 2_000_000 // max(b * Lc, 1)))
            rr = rows[c0:c0 + step]
            c0 += len(rr)
            Lc = int(n[rr].max())
            nn = n[rr][:, None, None]
            smp = np.floor(rng.random((len(rr), b, 3)) * nn).astype(np.int64)
            bad = (smp[..., 0] == smp[..., 1]) | (smp[..., 0] == smp[..., 2]) | (smp[..., 1] == smp[..., 2])
            while bad.any():  # distinct triples (every group has >= 3 pairs)
                smp[bad] = np.floor(rng.random((int(bad.sum()), 3))
                                    * np.broadcast_to(nn, smp.shape)[bad]).astype(np.int64)
                bad = (smp[..., 0] == smp[..., 1]) | (smp[..., 0] == smp[..., 2]) | (smp[..., 1] == smp[..., 2])
            gi = rr[:, None, None]
            R, t = _kabsch_batch(S[gi, smp].reshape(-1, 3, 3), D[gi, smp].reshape(-1, 3, 3))
            R, t = R.reshape(len(rr), b, 3, 3), t.reshape(len(rr), b, 3)
            Sc, Dc = S[rr, :Lc], D[rr, :Lc]
            res = np.matmul(Sc[:, None], np.swapaxes(R, 2, 3)) + (t[:, :, None, :] - Dc[:, None])
            res *= res
            inl = (res.sum(axis=3) < thr2) & M[rr, :Lc][:, None, :]
            cnt = inl.sum(axis=2)
            j = np.argmax(cnt, axis=1)
            ar = np.arange(len(rr))
            cj = cnt[ar, j]
            better = cj > best_cnt[rr]
            upd = rr[better]
            best_cnt[upd] = cj[better]
            best_R[upd] = R[ar[better], j[better]]
            best_t[upd] = t[ar[better], j[better]]

    b1 = min(first, max_iterations)
    run(np.arange(len(ok)), b1)
    w = best_cnt / n
    p_fail = 1.0 - w ** 3
    with np.errstate(divide="ignore", invalid="ignore"):
        needed = np.where(p_fail <= 0, 0, np.ceil(np.log(1 - probability) / np.log(np.clip(p_fail, 1e-300, 1 - 1e-16))))
    more = np.flatnonzero(needed > b1)
    if len(more) and max_iterations > b1:
        run(more, int(min(max_iterations, cap, needed[more].max())) - b1)

    def inliers(R, t):
        res = np.einsum("gij,glj->gli", R, S) + t[:, None, :] - D
        return (np.einsum("gli,gli->gl", res, res) < thr2) & M

    inl = inliers(best_R, best_t)
    R, t = best_R, best_t
    fit = inl.sum(axis=1) >= 3
    if fit.any():  # refit on the inliers, recompute them once, keep when not worse
        R2, t2 = _kabsch_batch(S, D, inl.astype(np.float64))
        inl2 = inliers(R2, t2)
        R = np.where(fit[:, None, None], R2, R)
        t = np.where(fit[:, None], t2, t)
        take = fit & (inl2.sum(axis=1) >= 3) & (inl2.sum(axis=1) >= inl.sum(axis=1))
        if take.any():
            R3, t3 = _kabsch_batch(S, D, inl2.astype(np.float64))
            R = np.where(take[:, None, None], R3, R)
            t = np.where(take[:, None], t3, t)
            inl = np.where(take[:, None], inl2, inl)
    for r, g in enumerate(ok):
        T = np.eye(4)
        T[:3, :3], T[:3, 3] = R[r], t[r]
        out[g] = (T, inl[r, :n[r]].copy())
    return out


def _fit_groups(corr, library, skp, groups, ransac, thr, max_iterations, seed, batched_max: int = 64):
    """Hypotheses of many ``(correspondence indices, model id)`` groups: RANSAC batched over
    all groups of at most ``batched_max`` pairs, :func:`ransac_rigid` for the larger ones."""
    small = [g for g in range(len(groups)) if 3 <= len(groups[g][0]) <= batched_max]
    res = {}
    if ransac and small:
        srcs = [library.kp_coords[corr.ref_row[groups[g][0]]].astype(np.float64) for g in small]
        dsts = [skp[corr.scene_kp[groups[g][0]]] for g in small]
        for g, (T, inl) in zip(small, ransac_rigid_groups(srcs, dsts, threshold=thr, max_iterations=max_iterations,
                                                          seed=seed)):
            if T is not None and inl.sum() >= 3:
                idx = groups[g][0]
                res[g] = Hypotheses(np.array([groups[g][1]], np.int32), T[None], np.array([int(inl.sum())], np.int32),
                                    [idx[inl]])
            else:
                res[g] = None
    out = []
    for g, (idx, mid) in enumerate(groups):
        h = res[g] if g in res else _fit_group(corr, library, skp, idx, mid, ransac, thr, max_iterations, seed)
        if h is not None:
            out.append(h)
    return Hypotheses.concat(out)


def _fit_group(corr, library, skp, idx, mid, ransac, thr, max_iterations, seed):
    src = library.kp_coords[corr.ref_row[idx]].astype(np.float64)
    dst = skp[corr.scene_kp[idx]]
    if len(idx) < 3:
        return None
    if ransac:
        T, inl = ransac_rigid(src, dst, threshold=thr, max_iterations=max_iterations, seed=seed)
        if T is None or inl.sum() < 3:
            return None
        kept = idx[inl]
    else:
        T = rigid_transform(src, dst)
        kept = idx
    return Hypotheses(np.array([mid], np.int32), T[None], np.array([len(kept)], np.int32), [kept])


def group_gc(corr: Correspondences, library: ModelLibrary, scene_kp_coords, *,
             gc_size: float = 0.01, gc_threshold: int = 5, ransac: bool = True,
             max_iterations: int = 10000, seed: int = 0) -> Hypotheses:
    """Geometric-consistency grouping (PCL ``GeometricConsistencyGrouping``), per model.

    Correspondences are sorted by descriptor distance (stable); from every untaken seed a
    consensus set grows greedily: ``j`` joins when ``| |s_k - s_j| - |m_k - m_j| | <= gc_size``
    for every member ``k`` (the test of current PCL; PCL <= 1.8 compared against the first
    ``|set|`` correspondences instead of the set's members, a bug). A set with more than
    ``gc_threshold`` members is kept, its members taken, cleaned by RANSAC (threshold
    ``gc_size``) and fitted by SVD.
    """
    skp = np.asarray(to_numpy(scene_kp_coords), np.float64)
    out = []
    for mid in np.unique(corr.model_id):
        sel = np.flatnonzero(corr.model_id == mid)
        sel = sel[np.argsort(corr.dist2[sel], kind="stable")]
        S = skp[corr.scene_kp[sel]].astype(np.float32)
        M = library.kp_coords[corr.ref_row[sel]].astype(np.float32)
        labels = _gc_sets(S, M, np.float64(gc_size), int(gc_threshold))
        kept = np.flatnonzero(labels >= 0)
        if len(kept):  # the members of each set in ascending descriptor distance, for RANSAC
            kept = kept[np.argsort(labels[kept], kind="stable")]
            for members in np.split(sel[kept], np.cumsum(np.bincount(labels[kept]))[:-1]):
                out.append((members, int(mid)))
    return _fit_groups(corr, library, skp, out, ransac, gc_size, max_iterations, seed)


def _numba_threads() -> int:
    import numba

    return numba.get_num_threads()


def _gc_sets(S, M, gc_size, gc_threshold, chunk: int = 256, sequential: bool | None = None):
    """Consensus-set label of each (distance-sorted) correspondence, -1 when in no kept set.

    With ``sequential`` (default: when numba has at most 4 threads, e.g. one of several workers on
    a host) the sequential sweep :func:`_gc_sweep_seq`. On 2 threads it takes 0.14 s of a 20k-point
    scene's grouping against 0.26-0.38 s for the parallel sweep, so even perfect scaling would only
    tie at 4 threads, with 4 cores busy instead of one. In an archive the host's cores are shared
    by workers that also wait on a GPU, where chunk barriers stall: with the parallel sweep on 4
    threads each, 8 workers on 2 H200s spent 2.7 s per scene in grouping, one process alone 0.48 s.
    Otherwise the greedy sweep of PCL, made parallel without changing its result: the sets of the next
    ``chunk`` untaken seeds are grown in parallel against the current ``taken`` flags; then the
    seeds are committed in order. A seed's speculative set stays valid unless a set committed
    earlier in the same chunk took one of its members or the seed itself (a taken candidate
    that was rejected anyway changes nothing), in which case it is grown again.
    """
    n = S.shape[0]
    if sequential is None:
        sequential = _numba_threads() <= 4
    if n and sequential and _gc_sets_nb is not None:
        # few threads (a worker's share of a host): the sequential sweep beats the speculative one
        return _gc_sweep_seq(S, M, np.float64(gc_size), int(gc_threshold))
    taken = np.zeros(n, np.bool_)
    labels = np.full(n, -1, np.int64)
    if n == 0:
        return labels
    buf = np.empty((min(chunk, n), n), np.int64)
    cnt = np.empty(min(chunk, n), np.int64)
    ng = 0
    i = 0
    while i < n:
        seeds = np.flatnonzero(~taken[i:])[:chunk] + i
        if len(seeds) == 0:
            break
        _gc_grow_many(S, M, gc_size, seeds, taken, buf, cnt)
        ng = _gc_commit(S, M, gc_size, gc_threshold, seeds, taken, labels, buf, cnt, ng)
        i = int(seeds[-1]) + 1
    return labels


try:
    from numba import njit as _njit
    from numba import prange as _prange

    @_njit(cache=True, inline="always")
    def _gc_fails(S, M, k, j, gc_size):
        """Correspondence ``j`` is inconsistent with member ``k``: the scene and model distances
        of the pair differ by more than ``gc_size``."""
        dsx = S[k, 0] - S[j, 0]
        dsy = S[k, 1] - S[j, 1]
        dsz = S[k, 2] - S[j, 2]
        dmx = M[k, 0] - M[j, 0]
        dmy = M[k, 1] - M[j, 1]
        dmz = M[k, 2] - M[j, 2]
        ds = math.sqrt(dsx * dsx + dsy * dsy + dsz * dsz)
        dm = math.sqrt(dmx * dmx + dmy * dmy + dmz * dmz)
        return abs(ds - dm) > gc_size

    @_njit(cache=True, inline="always")
    def _gc_grow(S, M, gc_size, i, taken, members):
        n = S.shape[0]
        m = 1
        members[0] = i
        for j in range(n):
            if j == i or taken[j]:
                continue
            good = True
            for kk in range(m):
                if _gc_fails(S, M, members[kk], j, gc_size):
                    good = False
                    break
            if good:
                members[m] = j
                m += 1
        return m

    @_njit(cache=True, parallel=True)
    def _gc_grow_many(S, M, gc_size, seeds, taken, buf, cnt):
        for t in _prange(len(seeds)):
            cnt[t] = _gc_grow(S, M, gc_size, seeds[t], taken, buf[t])

    @_njit(cache=True)
    def _gc_commit(S, M, gc_size, gc_threshold, seeds, taken, labels, buf, cnt, ng):
        dirty = False
        for t in range(len(seeds)):
            i = seeds[t]
            if taken[i]:
                continue
            m = cnt[t]
            if dirty:
                for kk in range(m):
                    if taken[buf[t, kk]]:
                        m = _gc_grow(S, M, gc_size, i, taken, buf[t])
                        break
            if m > gc_threshold:
                for kk in range(m):
                    taken[buf[t, kk]] = True
                    labels[buf[t, kk]] = ng
                ng += 1
                dirty = True
        return ng

    @_njit(cache=True)
    def _gc_sets_nb(S, M, gc_size, gc_threshold):
        """The plain sequential sweep (the reference the parallel form is tested against)."""
        n = S.shape[0]
        taken = np.zeros(n, np.bool_)
        labels = np.full(n, -1, np.int64)
        members = np.empty(n, np.int64)
        ng = 0
        for i in range(n):
            if taken[i]:
                continue
            m = _gc_grow(S, M, gc_size, i, taken, members)
            if m > gc_threshold:
                for kk in range(m):
                    taken[members[kk]] = True
                    labels[members[kk]] = ng
                ng += 1
        return labels

    @_njit(cache=True)
    def _gc_sweep_seq(S, M, gc_size, gc_threshold):
        """PCL's sequential sweep (labels as :func:`_gc_sets_nb`), faster: each seed first tests
        every candidate against itself in one branch-free, vectorisable loop over coordinate
        columns (the arithmetic of :func:`_gc_fails`), then only the survivors against the other
        members."""
        n = S.shape[0]
        sx = np.ascontiguousarray(S[:, 0])
        sy = np.ascontiguousarray(S[:, 1])
        sz = np.ascontiguousarray(S[:, 2])
        mx = np.ascontiguousarray(M[:, 0])
        my = np.ascontiguousarray(M[:, 1])
        mz = np.ascontiguousarray(M[:, 2])
        taken = np.zeros(n, np.bool_)
        cons = np.empty(n, np.bool_)
        labels = np.full(n, -1, np.int64)
        members = np.empty(n, np.int64)
        ng = 0
        for i in range(n):
            if taken[i]:
                continue
            six, siy, siz, mix, miy, miz = sx[i], sy[i], sz[i], mx[i], my[i], mz[i]
            for j in range(n):
                dsx = six - sx[j]
                dsy = siy - sy[j]
                dsz = siz - sz[j]
                dmx = mix - mx[j]
                dmy = miy - my[j]
                dmz = miz - mz[j]
                ds = math.sqrt(dsx * dsx + dsy * dsy + dsz * dsz)
                dm = math.sqrt(dmx * dmx + dmy * dmy + dmz * dmz)
                cons[j] = not (abs(ds - dm) > gc_size)
            members[0] = i
            m = 1
            for j in range(n):
                if j == i or taken[j] or not cons[j]:
                    continue
                good = True
                for kk in range(1, m):
                    if _gc_fails(S, M, members[kk], j, gc_size):
                        good = False
                        break
                if good:
                    members[m] = j
                    m += 1
            if m > gc_threshold:
                for kk in range(m):
                    taken[members[kk]] = True
                    labels[members[kk]] = ng
                ng += 1
        return labels

    @_njit(cache=True, inline="always")
    def _top_eigvec4(N, v):
        """Eigenvector of the largest eigenvalue of the symmetric 4x4 ``N`` (cyclic Jacobi; ``N``
        is overwritten) into ``v``."""
        V = np.eye(4)
        for _sweep in range(30):
            off = 0.0
            for p in range(3):
                for q in range(p + 1, 4):
                    off += N[p, q] * N[p, q]
            scale = 0.0
            for p in range(4):
                scale += N[p, p] * N[p, p]
            if off <= 1e-30 * scale or off == 0.0:
                break
            for p in range(3):
                for q in range(p + 1, 4):
                    apq = N[p, q]
                    if apq == 0.0:
                        continue
                    theta = (N[q, q] - N[p, p]) / (2.0 * apq)
                    t = (1.0 if theta >= 0 else -1.0) / (abs(theta) + math.sqrt(theta * theta + 1.0))
                    c = 1.0 / math.sqrt(t * t + 1.0)
                    sn = t * c
                    for k in range(4):  # N <- J^T N J
                        akp = N[k, p]
                        akq = N[k, q]
                        N[k, p] = c * akp - sn * akq
                        N[k, q] = sn * akp + c * akq
                    for k in range(4):
                        apk = N[p, k]
                        aqk = N[q, k]
                        N[p, k] = c * apk - sn * aqk
                        N[q, k] = sn * apk + c * aqk
                    for k in range(4):
                        vkp = V[k, p]
                        vkq = V[k, q]
                        V[k, p] = c * vkp - sn * vkq
                        V[k, q] = sn * vkp + c * vkq
        best = 0
        for p in range(1, 4):
            if N[p, p] > N[best, best]:
                best = p
        for k in range(4):
            v[k] = V[k, best]

    @_njit(cache=True)
    def _kabsch_nb(S, D):
        """Unweighted batched rigid fits (Horn 1987): the rotation maximising sum d'^T R s'."""
        B, n = S.shape[0], S.shape[1]
        R = np.empty((B, 3, 3))
        t = np.empty((B, 3))
        N = np.empty((4, 4))
        q = np.empty(4)
        for b in range(B):
            cs0 = cs1 = cs2 = cd0 = cd1 = cd2 = 0.0
            for i in range(n):
                cs0 += S[b, i, 0]
                cs1 += S[b, i, 1]
                cs2 += S[b, i, 2]
                cd0 += D[b, i, 0]
                cd1 += D[b, i, 1]
                cd2 += D[b, i, 2]
            cs0 /= n
            cs1 /= n
            cs2 /= n
            cd0 /= n
            cd1 /= n
            cd2 /= n
            sxx = sxy = sxz = syx = syy = syz = szx = szy = szz = 0.0
            for i in range(n):
                a0 = S[b, i, 0] - cs0
                a1 = S[b, i, 1] - cs1
                a2 = S[b, i, 2] - cs2
                b0 = D[b, i, 0] - cd0
                b1 = D[b, i, 1] - cd1
                b2 = D[b, i, 2] - cd2
                sxx += a0 * b0
                sxy += a0 * b1
                sxz += a0 * b2
                syx += a1 * b0
                syy += a1 * b1
                syz += a1 * b2
                szx += a2 * b0
                szy += a2 * b1
                szz += a2 * b2
            N[0, 0] = sxx + syy + szz
            N[0, 1] = N[1, 0] = syz - szy
            N[0, 2] = N[2, 0] = szx - sxz
            N[0, 3] = N[3, 0] = sxy - syx
            N[1, 1] = sxx - syy - szz
            N[1, 2] = N[2, 1] = sxy + syx
            N[1, 3] = N[3, 1] = szx + sxz
            N[2, 2] = -sxx + syy - szz
            N[2, 3] = N[3, 2] = syz + szy
            N[3, 3] = -sxx - syy + szz
            _top_eigvec4(N, q)
            w, x, y, z = q[0], q[1], q[2], q[3]
            R[b, 0, 0] = w * w + x * x - y * y - z * z
            R[b, 0, 1] = 2.0 * (x * y - w * z)
            R[b, 0, 2] = 2.0 * (x * z + w * y)
            R[b, 1, 0] = 2.0 * (x * y + w * z)
            R[b, 1, 1] = w * w - x * x + y * y - z * z
            R[b, 1, 2] = 2.0 * (y * z - w * x)
            R[b, 2, 0] = 2.0 * (x * z - w * y)
            R[b, 2, 1] = 2.0 * (y * z + w * x)
            R[b, 2, 2] = w * w - x * x - y * y + z * z
            t[b, 0] = cd0 - (R[b, 0, 0] * cs0 + R[b, 0, 1] * cs1 + R[b, 0, 2] * cs2)
            t[b, 1] = cd1 - (R[b, 1, 0] * cs0 + R[b, 1, 1] * cs1 + R[b, 1, 2] * cs2)
            t[b, 2] = cd2 - (R[b, 2, 0] * cs0 + R[b, 2, 1] * cs1 + R[b, 2, 2] * cs2)
        return R, t
except ImportError:  # pragma: no cover - numba is a dependency
    _gc_sets_nb = _gc_sweep_seq = _kabsch_nb = None


# ---------------------------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------------------------
@dataclass
class VerifyResult:
    accepted: np.ndarray       # (A,) hypothesis indices in acceptance order
    scores: np.ndarray         # (A,) inlier fraction at acceptance
    inliers: np.ndarray        # (A,) inlier counts at acceptance
    visible: np.ndarray        # (A,) visible verification points
    first_scores: np.ndarray   # (H,) inlier fraction of every hypothesis before any claim


def _verify_nearest_cpu(idx, library, hyp, src, poses, r: float, vp):
    """CPU twin of ``_pipeline_gpu.verify_nearest``: one parallel numba pass, float32 like
    the GPU kernel, nearest scene point from the cell list (no per-point pose gather)."""
    from ..neighbors._search_cpu import verify_points

    P, order, cs, origin, inv_h, dims = idx.cells()
    T = np.ascontiguousarray(np.asarray(poses, np.float64)[:, :3, :4].reshape(-1, 12), np.float32)
    vp = np.asarray(vp, np.float32)
    return verify_points(np.ascontiguousarray(hyp, np.int64), np.ascontiguousarray(src, np.int64), T,
                         np.ascontiguousarray(library.verify_points, np.float32),
                         np.ascontiguousarray(library.verify_normals, np.float32),
                         vp[0], vp[1], vp[2], P, cs, origin, inv_h, dims, np.float32(r * r), order,
                         np.ascontiguousarray(idx.vox, np.int64))


def _hyp_points(library, model_id, poses, xp):
    """Flattened verification points of every hypothesis: (hyp index, world points, normals)."""
    vo = library.verify_offsets
    sizes = (vo[model_id + 1] - vo[model_id]).astype(np.int64)
    hyp = np.repeat(np.arange(len(model_id)), sizes)
    starts = np.repeat(vo[model_id] - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
    src = starts + np.arange(sizes.sum())
    return hyp, src, sizes


def verify(hypotheses: Hypotheses, library: ModelLibrary, scene, *, inlier_dist: float,
           min_inlier_fraction: float = 0.5, min_inliers: int = 10, viewpoint=(0.0, 0.0, 0.0),
           max_detections: int | None = None, device: str = "auto") -> VerifyResult:
    """Score all hypotheses at once and accept them greedily by argmax (no sort).

    Parameters
    ----------
    hypotheses : Hypotheses
    library : ModelLibrary
    scene : (N, 3) array or a prepared scene index
        The full scene cloud.
    inlier_dist : float
        A visible model point is an inlier when the nearest scene point is closer than this.
    min_inlier_fraction : float
        Acceptance threshold on ``inliers / visible``.
    min_inliers : int
        Acceptance also needs this many inliers.
    viewpoint : 3 floats
        Camera centre: a model point is visible when its transformed normal faces it.
    max_detections : int, optional
        Stop after this many acceptances.
    device : {"auto", "cpu", "gpu"}

    Notes
    -----
    Round ``r`` scores every remaining hypothesis in parallel; the inliers of a point are
    withdrawn when the scene voxel (edge ``inlier_dist``) of its nearest scene point is already
    claimed by an accepted hypothesis (occupancy conflict). The best remaining hypothesis above
    the thresholds (argmax of the fraction; ties go to the lower index) is accepted and claims
    its inlier voxels. The loop ends when no hypothesis qualifies.
    """
    if not (float(inlier_dist) > 0):
        raise InputError(f"inlier_dist must be > 0, got {inlier_dist!r}")
    if isinstance(scene, _SceneIndex):
        dev, idx = scene.device, scene
    else:
        dev = resolve_device(device, scene)
        idx = _SceneIndex(_finite_points(scene, "scene"), None, inlier_dist, dev)
    h = len(hypotheses)
    if h == 0:
        z = np.zeros(0)
        return VerifyResult(np.zeros(0, np.int64), z, np.zeros(0, np.int64), np.zeros(0, np.int64), z)
    xp = xp_for(dev)
    vp = np.asarray(viewpoint, np.float64).reshape(3)
    mid = np.asarray(hypotheses.model_id, np.int64)
    hyp, src, sizes = _hyp_points(library, mid, hypotheses.poses, xp)
    if dev == "gpu":
        from . import _pipeline_gpu as g

        vox = g.verify_nearest(idx, library, hyp, src, hypotheses.poses, inlier_dist, vp)
    else:
        vox = _verify_nearest_cpu(idx, library, hyp, src, hypotheses.poses, inlier_dist, vp)
    # per point: -2 invisible, -1 visible but no scene point, >= 0 voxel rank of the nearest
    hyp_x = xp.asarray(hyp)
    vis_count = xp.bincount(hyp_x, weights=(vox >= -1).astype(xp.float64), minlength=h)
    claimed = xp.zeros(max(idx.n_vox, 1), dtype=bool)
    active = xp.ones(h, dtype=bool)
    acc, scores, inls, viss = [], [], [], []
    first = None
    limit = h if max_detections is None else int(max_detections)
    while True:
        inl = (vox >= 0)
        inl &= ~claimed[xp.maximum(vox, 0)]
        cnt = xp.bincount(hyp_x, weights=inl.astype(xp.float64), minlength=h)
        frac = cnt / xp.maximum(vis_count, 1.0)
        if first is None:
            first = to_numpy(frac)
        if len(acc) >= limit:
            break
        ok = active & (frac >= min_inlier_fraction) & (cnt >= min_inliers)
        best, _ = masked_argmax(frac, ok)  # shared with flow.hypothesis_flow (hypotheses.py)
        if best < 0:
            break
        acc.append(best)
        scores.append(float(frac[best]))
        inls.append(int(cnt[best]))
        viss.append(int(vis_count[best]))
        active[best] = False
        mine = (hyp_x == best) & inl
        claimed[vox[mine]] = True
    return VerifyResult(np.asarray(acc, np.int64), np.asarray(scores), np.asarray(inls, np.int64),
                        np.asarray(viss, np.int64), first if first is not None else np.zeros(h))


# ---------------------------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------------------------
@dataclass
class Detection:
    """One recognised model instance."""

    model_id: int
    model: str
    score: float            # inlier fraction of the visible verification points at acceptance
    inliers: int
    visible: int
    pose: np.ndarray        # (4, 4) float64, model -> scene
    correspondences: int    # correspondences that supported the hypothesis (RANSAC inliers)
    hypothesis_score: float = 0.0   # score of the unrefined hypothesis (pass 1)
    icp_rmse: float | None = None
    timings: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"model_id": self.model_id, "model": self.model, "score": self.score,
                "inliers": self.inliers, "visible": self.visible, "pose": self.pose.tolist(),
                "correspondences": self.correspondences,
                "hypothesis_score": self.hypothesis_score, "icp_rmse": self.icp_rmse}


class Detections(list):
    """A list of :class:`Detection` with the scene's per-phase ``timings`` (seconds) and counts."""

    timings: dict
    info: dict


def recognize(scene_points, library: ModelLibrary, *, scene_normals=None, scene_ss: float = 0.03,
              descr_rad: float | None = None, rf_rad: float | None = None, normal_k: int = 10,
              normal_radius: float | None = None, method: str = "hough", cg_size: float = 0.01,
              cg_thresh: float = 5,
              use_interpolation: bool = True, match_k: int = 1, max_dist2: float = 0.25,
              ratio: float | None = None, ransac: bool = True, verify: bool = True,
              inlier_dist: float | None = None, min_inlier_fraction: float = 0.5,
              min_inliers: int = 10, viewpoint=(0.0, 0.0, 0.0), icp: bool = True,
              icp_iterations: int = 30, refine_min_fraction: float = 0.3, max_refine: int = 32,
              refine: str = "icp", max_detections: int | None = None, seed: int = 0,
              device: str = "auto") -> Detections:
    """Find the library's models in one scene.

    Parameters
    ----------
    scene_points : (N, 3) array
        The scene (numpy or CuPy; NaN/inf rows are dropped).
    library : ModelLibrary
    scene_normals : (N, 3) array, optional
        Given scene normals (otherwise k-NN PCA with ``normal_k`` towards ``viewpoint``).
    scene_ss : float
        Scene keypoint uniform-sampling leaf (PCL tutorial: 0.03).
    descr_rad, rf_rad : float, optional
        SHOT radius and Hough frame radius; default: the library's (0.02, 0.015).
    method : {"hough", "gc"}
        Correspondence grouping.
    cg_size : float
        Hough bin size / geometric-consistency tolerance (0.01).
    cg_thresh : float
        Hough threshold / consensus size (5).
    match_k, max_dist2, ratio :
        Matching options (see :func:`match`).
    verify : bool
        Run the verification stage; without it every hypothesis is returned (PCL tutorial).
    inlier_dist : float, optional
        Verification / ICP distance (default: 2x the library's mean model resolution).
    min_inlier_fraction, min_inliers : acceptance thresholds (see :func:`verify`), applied
        to the refined poses.
    icp : bool
        Verify -> refine -> verify: every hypothesis is scored first; those with an inlier
        fraction ``>= refine_min_fraction`` (at most ``max_refine``, best first) are refined by
        point-to-plane ICP (``icp_iterations``) and only they enter the greedy acceptance.
        Without it the unrefined hypotheses are accepted directly.
    refine : {"icp", "pcha"}
        The refinement of that step: point-to-plane ICP, or parametric chamfer alignment
        (:func:`scanforest.kernels.align.pcha.align_batch`: Levenberg-Marquardt on a distance transform
        of the scene around the candidates, all candidates advanced in lockstep, one launch per
        iteration on the GPU, Huber loss at ``inlier_dist``; each candidate aligns the model
        points that lie within ``inlier_dist`` of the scene at its hypothesis pose).
    device : {"auto", "cpu", "gpu"}
        ``auto`` follows the scene array type (numpy -> CPU, CuPy -> GPU).

    Returns
    -------
    Detections
        List of :class:`Detection` (acceptance order), with ``.timings`` (seconds per phase:
        normals, keypoints, shot, matching, grouping, verification, icp, total) and ``.info``.
    """
    from . import icp as _icp

    dev = resolve_device(device, scene_points)
    if method not in ("hough", "gc"):
        raise InputError(f"method must be 'hough' or 'gc', got {method!r}")
    if refine not in ("icp", "pcha"):
        raise InputError(f"refine must be 'icp' or 'pcha', got {refine!r}")
    if not isinstance(library, ModelLibrary):
        raise InputError(f"library must be a ModelLibrary, got {type(library).__name__}")
    xp = xp_for(dev)
    t0 = time.perf_counter()
    timer = _Timer(dev == "gpu")
    pts = _on(scene_points, dev)
    pts = _finite_points(pts, "scene_points")
    fin = xp.isfinite(pts).all(axis=1)
    nrm_in = None
    if not bool(fin.all()):
        pts = pts[fin]
        if scene_normals is not None:
            nrm_in = _on(scene_normals, dev)[fin]
    elif scene_normals is not None:
        nrm_in = _on(scene_normals, dev)
    pts = xp.ascontiguousarray(pts, dtype=xp.float32)
    descr_rad = float(library.params.get("descr_rad", 0.02) if descr_rad is None else descr_rad)
    rf_rad = float(library.params.get("rf_rad", 0.015) if rf_rad is None else rf_rad)
    if inlier_dist is None:
        inlier_dist = 2.0 * library.resolution
    inlier_dist = float(inlier_dist)
    vp = np.asarray(viewpoint, np.float64).reshape(3)

    d = describe(pts, normals=nrm_in, normal_k=normal_k, normal_radius=normal_radius,
                 keypoint_radius=scene_ss,
                 descr_rad=descr_rad, rf_rad=rf_rad if method == "hough" else None,
                 viewpoint=vp, device=dev, timer=timer)
    corr = match(d["descriptors"], library, k=match_k, max_dist2=max_dist2, ratio=ratio, device=dev)
    timer.lap("matching")
    skp = to_numpy(d["kp_coords"])
    if method == "hough":
        hyps = group_hough(corr, library, skp, to_numpy(d["rf"]), bin_size=cg_size,
                           threshold=cg_thresh, use_interpolation=use_interpolation, ransac=ransac,
                           seed=seed)
    else:
        hyps = group_gc(corr, library, skp, gc_size=cg_size, gc_threshold=int(cg_thresh),
                        ransac=ransac, seed=seed)
    timer.lap("grouping")
    out = Detections()
    vr = None
    first_scores = None
    if not verify or not len(hyps):
        timer.lap("verification")
        for hi in range(len(hyps)):
            mid = int(hyps.model_id[hi])
            out.append(Detection(mid, library.names[mid], float("nan"), 0, 0, hyps.poses[hi].copy(),
                                 int(hyps.n_corr[hi])))
        timer.lap("icp")
    else:
        sidx = _SceneIndex(pts, d["normals"], inlier_dist, dev)
        # pass 1: score every hypothesis at once (no claims)
        first_scores = verify_fn(hyps, library, sidx, inlier_dist=inlier_dist,
                                 min_inlier_fraction=2.0, min_inliers=0, viewpoint=vp,
                                 max_detections=0, device=dev).first_scores
        timer.lap("verification")
        rmse = np.full(len(hyps), np.nan)
        work = hyps
        if icp:
            # refine the promising hypotheses (at most max_refine, best first) by ICP
            cand = np.flatnonzero(first_scores >= refine_min_fraction)
            if len(cand) > max_refine:
                cand = cand[np.argpartition(-first_scores[cand], max_refine - 1)[:max_refine]]
            poses = hyps.poses.copy()
            vo = library.verify_offsets
            if refine == "pcha":
                _refine_pcha(library, hyps, cand, poses, rmse, sidx, inlier_dist, icp_iterations, dev)
            elif len(cand):  # all candidates in lockstep (one batched iteration on the GPU)
                mids = [int(hyps.model_id[hi]) for hi in cand]
                results = _icp.icp_point_to_plane_batch(
                    [library.verify_points[vo[m]:vo[m + 1]] for m in mids], sidx,
                    inits=[poses[hi] for hi in cand],
                    source_normals=[library.verify_normals[vo[m]:vo[m + 1]] for m in mids],
                    max_correspondence_distance=inlier_dist, max_iterations=icp_iterations)
                for hi, res in zip(cand, results):
                    poses[hi], rmse[hi] = res.pose, res.rmse
            keep = np.zeros(len(hyps), bool)
            keep[cand] = True
            work = Hypotheses(hyps.model_id[keep], poses[keep], hyps.n_corr[keep],
                              [g for g, k in zip(hyps.groups, keep) if k] if hyps.groups else [])
            back = np.flatnonzero(keep)
        else:
            back = np.arange(len(hyps))
        timer.lap("icp")
        # pass 2: greedy acceptance by argmax with occupancy claims
        vr = verify_fn(work, library, sidx, inlier_dist=inlier_dist,
                       min_inlier_fraction=min_inlier_fraction, min_inliers=min_inliers,
                       viewpoint=vp, max_detections=max_detections, device=dev)
        for wi, sc, inl, vis in zip(vr.accepted.tolist(), vr.scores.tolist(), vr.inliers.tolist(),
                                    vr.visible.tolist()):
            hi = int(back[wi])
            mid = int(hyps.model_id[hi])
            out.append(Detection(mid, library.names[mid], float(sc), int(inl), int(vis),
                                 work.poses[wi].copy(), int(hyps.n_corr[hi]),
                                 float(first_scores[hi]),
                                 None if np.isnan(rmse[hi]) else float(rmse[hi])))
        timer.lap("verification")
    timer.t["total"] = time.perf_counter() - t0
    out.timings = dict(timer.t)
    out.info = {"scene_points": int(pts.shape[0]), "scene_keypoints": int(len(skp)),
                "correspondences": len(corr), "hypotheses": len(hyps), "device": dev,
                "inlier_dist": inlier_dist,
                "hypothesis_scores": None if first_scores is None else first_scores.tolist()}
    for det in out:
        det.timings = out.timings
    return out


verify_fn = verify


def _refine_pcha(library, hyps, cand, poses, rmse, sidx, inlier_dist, iterations, dev):
    """Refine ``poses[cand]`` in place by parametric chamfer alignment (rigid, Huber)."""
    from ..align.edt import distance_transform
    from ..align.pcha import align_batch

    if not len(cand):
        return
    xp = xp_for(dev)
    vo = library.verify_offsets
    Ps, Ws = [], []
    for h in cand:
        mid = int(hyps.model_id[h])
        P = np.asarray(library.verify_points[vo[mid]:vo[mid + 1]], np.float64)
        Ps.append(P)
        Ws.append((P @ poses[h][:3, :3].T + poses[h][:3, 3]).astype(np.float32))
    idx, _ = sidx.nearest(xp.asarray(np.concatenate(Ws)), inlier_dist)  # one search for all candidates
    near_all = np.split(to_numpy(idx) >= 0, np.cumsum([len(W) for W in Ws])[:-1])
    obs, keep_c = [], []
    lo, hi_ = np.full(3, np.inf), np.full(3, -np.inf)
    for h, P, W, near in zip(cand, Ps, Ws, near_all):
        if near.sum() < 6:  # nothing of the model overlaps the scene here: leave the pose as it is
            continue
        obs.append(P[near].astype(np.float32))
        keep_c.append(h)
        lo, hi_ = np.minimum(lo, W[near].min(0)), np.maximum(hi_, W[near].max(0))
    if not obs:
        return
    # the distance transform covers the scene around the candidates only, cells ~ inlier_dist / 2
    margin = 4.0 * inlier_dist
    S = to_numpy(sidx.points)
    box = np.all((S >= lo - margin) & (S <= hi_ + margin), axis=1)
    ext = float(np.max(hi_ - lo + 2 * margin))
    res = int(np.clip(np.ceil(1.5 * ext / (0.5 * inlier_dist)), 32, 256 if dev == "gpu" else 160))
    grid = distance_transform(S[box], resolution=res, device=dev)  # the EDT reads its reference on the host
    out = align_batch([xp.asarray(o) for o in obs], None, "rigid", init=[poses[h] for h in keep_c], grid=grid,
                      loss="huber", huber_delta=float(inlier_dist), max_iter=int(iterations), device=dev)
    for h, r in zip(keep_c, out):
        if np.all(np.isfinite(r.transform)):
            poses[h], rmse[h] = np.asarray(r.transform, np.float64), r.rmse


# ---------------------------------------------------------------------------------------------
# evaluation against ground truth
# ---------------------------------------------------------------------------------------------
def pose_errors(pose, truth) -> tuple[float, float]:
    """(rotation error in degrees, translation error) between two 4x4 poses."""
    A = np.asarray(pose, np.float64)
    B = np.asarray(truth, np.float64)
    c = (np.trace(A[:3, :3].T @ B[:3, :3]) - 1.0) / 2.0
    return float(np.degrees(np.arccos(np.clip(c, -1.0, 1.0)))), float(np.linalg.norm(A[:3, 3] - B[:3, 3]))


def evaluate(detections, ground_truth, *, max_rotation_deg: float = 15.0,
             max_translation: float) -> dict:
    """Match detections to ground-truth instances (same model, pose within tolerance).

    Each ground-truth instance (``{"model_id", "pose"}``) is matched at most once, by the
    detection of its model with the smallest translation error within the tolerances. Returns
    ``tp``, ``fp``, ``fn`` and the per-match rotation / translation errors.
    """
    used = set()
    rot, tra = [], []
    tp = 0
    for g in ground_truth:
        best, best_t = None, None
        for i, d in enumerate(detections):
            if i in used or int(d.model_id) != int(g["model_id"]):
                continue
            re, te = pose_errors(d.pose, g["pose"])
            if re <= max_rotation_deg and te <= max_translation and (best_t is None or te < best_t):
                best, best_t, best_r = i, te, re
        if best is not None:
            used.add(best)
            tp += 1
            rot.append(best_r)
            tra.append(best_t)
    return {"tp": tp, "fp": len(detections) - len(used), "fn": len(ground_truth) - tp,
            "rotation_errors": rot, "translation_errors": tra}
