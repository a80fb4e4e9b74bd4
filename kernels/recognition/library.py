"""The model library: every model described once (normals, keypoints, SHOT, frames), stacked.

:func:`describe` computes normals (k-NN PCA), keypoints (PCL ``UniformSampling``), SHOT352
descriptors and local reference frames (:mod:`scanforest.kernels.descriptors.shot`) of one cloud,
for the scene and, once, for every model of a :class:`ModelLibrary`.

Libraries of full 360-degree models (synthetic meshes) are best described through rendered
partial views (``ModelLibrary.build(..., views=N)``, :func:`render_view`): SHOT on a complete
closed surface differs from SHOT on the one-sided surface a scan sees, so matching a scene
against whole-model descriptors fails at occlusion boundaries. Hough voting uses SHOT local
reference frames at ``rf_rad`` (PCL's tutorial uses BOARD frames; BOARD is not implemented here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import Timer, resolve_device, to_device, to_numpy, xp_for
from ..errors import InputError

__all__ = ["ModelLibrary", "describe", "render_view", "resolution"]


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
             approximate: bool = False, device: str = "auto", timer: Timer | None = None) -> dict:
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
    approximate : bool
        G-SHOT approximate mode (neighbour lists capped; see
        :func:`~scanforest.kernels.descriptors.shot.shot`). Recognition describes exactly.

    Returns
    -------
    dict with ``normals`` (N, 3), ``keypoints`` (K,) int64, ``kp_coords`` (K, 3),
    ``descriptors`` (K, 352), ``frames`` (K, 3, 3) and ``rf`` (K, 3, 3), on the device.
    """
    from ..descriptors.keypoints import keypoints as _keypoints
    from ..descriptors.normals import normals as _normals
    from ..descriptors.shot import shot as _shot

    dev = resolve_device(device, points)
    pts = to_device(points, dev)
    timer = timer or Timer(dev == "gpu")
    if normals is None:
        if normal_radius:
            nrm, _ = _normals(pts, radius=normal_radius, viewpoint=viewpoint, device=dev)
        else:
            if int(normal_k) > int(pts.shape[0]):  # said with the parameter's name (normals says k=)
                raise InputError(f"normal_k={normal_k} is larger than the number of points ({int(pts.shape[0])})")
            nrm, _ = _normals(pts, k=normal_k, viewpoint=viewpoint, device=dev)
    else:
        nrm = to_device(normals, dev).astype(np.float32)
    timer.lap("normals")
    xp = xp_for(dev)
    good = xp.isfinite(nrm).all(axis=1)
    sub = None
    if not bool(good.all()):
        # points without a normal (fewer than 3 neighbours) are left out of keypoints and SHOT
        # support (the CPU SHOT divides by zero when a support has no finite normal at all)
        sub = xp.flatnonzero(good)
        if int(sub.shape[0]) == 0:  # said as it is, not as an empty cloud further on
            how = f"normal_radius={normal_radius:g}" if normal_radius and normals is None else f"normal_k={normal_k}"
            raise InputError(f"none of the {int(pts.shape[0]):,} points has a normal "
                             + ("(the given normals are all NaN)" if normals is not None else
                                f"({how}: their neighbours are all at one place or on one line, or too few)"))
        pts, nrm = xp.ascontiguousarray(pts[sub]), xp.ascontiguousarray(nrm[sub])
    kp = _keypoints(pts, radius=keypoint_radius, device=dev)
    timer.lap("keypoints")
    own = normals is None  # normals computed here are unit: given ones are checked (once)
    desc, frames = _shot(pts, nrm, kp, descr_rad, approximate=approximate, device=dev, _unit_normals=own)
    if rf_rad is None or abs(rf_rad - descr_rad) < 1e-12:
        rf = frames
    else:
        _, rf = _shot(pts, nrm, kp, rf_rad, approximate=approximate, device=dev, _unit_normals=True)
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


def _nearest(points, queries):
    """Index of each query's nearest point (exact k-NN of the neighbours module, k = 1)."""
    from ..neighbors.search import knn_cpu

    return knn_cpu(np.ascontiguousarray(points, np.float32), np.ascontiguousarray(queries, np.float32), 1)[0][:, 0]


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
              view_distance: float = 1.0, voxel: float | None = None,
              device: str = "auto") -> "ModelLibrary":
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
        voxel : float, optional
            Thin each model first to one point per voxel of this edge, the centroid of its points
            (:func:`~scanforest.kernels.descriptors.keypoints.voxel_grid`), and describe that:
            the library for scenes recognised with the same ``scene_voxel`` (with
            ``models_normals``, each thinned point takes its nearest model point's). The
            verification points stay the model's own points (``verify_leaf`` apart), each with
            its nearest thinned point's normal: the final polish fits them to the scene's own
            points. Not with ``views``.
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
        if len(set(names)) != m:
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InputError(f"model names must differ (a detection names its model): {', '.join(map(repr, dup))} repeated")
        if models_normals is not None and len(models_normals) != m:
            raise InputError(f"{len(models_normals)} normal arrays for {m} models")
        for name, val in (("model_ss", model_ss), ("descr_rad", descr_rad), ("rf_rad", rf_rad)):
            if not (float(val) > 0 and math.isfinite(float(val))):
                raise InputError(f"{name} must be a positive number, got {val!r}")
        if voxel is not None:
            if not (float(voxel) > 0 and math.isfinite(float(voxel))):
                raise InputError(f"voxel must be a positive number, got {voxel!r}")
            if views and views > 0:
                raise InputError("voxel cannot be combined with views (the views are rendered from the model)")
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
            if models_normals is not None and np.shape(to_numpy(models_normals[i])) != P.shape:
                raise InputError(f"model {names[i]!r}: its normals have shape {np.shape(to_numpy(models_normals[i]))}, "
                                 f"its points {P.shape}")
            keep = np.isfinite(P).all(axis=1)
            P = np.ascontiguousarray(P[keep], np.float32)
            near = full = None  # full: the model's own points where it is thinned
            if voxel is not None and len(P):
                from ..descriptors.keypoints import thin

                full, P = P, thin(P, float(voxel), "cpu")
                if models_normals is not None:  # thinned point -> its nearest model point's normal
                    near = _nearest(full, P)
            if len(P) < max(normal_k, 10):
                raise InputError(f"model {names[i]!r} has only {len(P)} finite points"
                                 + ("" if full is None else f" after thinning to {voxel:g} m voxels (choose a "
                                                            "smaller voxel)"))
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
                    if near is not None:
                        ref = ref[near]
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
            if full is None:
                vsel = _uniform_subsample(P, verify_leaf)
                vpts, vnrm = P[vsel], nrm[vsel]
            else:  # verification points from the model's own points (the final polish fits them to
                # the scene's): each with the normal of its nearest thinned point
                vpts = full[_uniform_subsample(full, verify_leaf)]
                vnrm = nrm[_nearest(P, vpts)]
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
            parts["vpts"].append(vpts)
            parts["vnrm"].append(vnrm)
            centroids.append(c)
            res.append(resolution(P))

        def offs(lst):
            o = np.zeros(len(lst) + 1, np.int64)
            o[1:] = np.cumsum([len(x) for x in lst])
            return o

        cat = {k: np.concatenate(v) if v else v for k, v in parts.items()}
        if len(cat["descriptors"]) and not np.isfinite(cat["descriptors"]).all(axis=1).any():
            raise InputError(f"no keypoint of any model has a descriptor at descr_rad={descr_rad:g} (no neighbours "
                             f"within it; the models' resolution is about {float(np.median(res)):.3g}): the library "
                             f"could match nothing")
        params = {"model_ss": float(model_ss), "descr_rad": float(descr_rad), "rf_rad": float(rf_rad),
                  "normal_k": int(normal_k), "normal_radius": normal_radius,
                  "verify_leaf": float(verify_leaf), "views": int(views),
                  "voxel": None if voxel is None else float(voxel),
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
        """Reference rows with a finite descriptor (the rows that are matched); computed once
        per descriptor array (a scan of 148k x 352 floats took 15-46 ms of every scene's matching)."""
        memo = self.__dict__.get("_valid_rows_memo")
        if memo is None or memo[0] is not self.descriptors:
            memo = (self.descriptors, np.flatnonzero(np.isfinite(self.descriptors).all(axis=1)))
            self.__dict__["_valid_rows_memo"] = memo
        return memo[1]

    def reference(self) -> np.ndarray:
        """The descriptors an index over this library holds: the valid rows, in order (id ``i``
        of a search is library row ``valid_rows[i]``; see ``correspondences.from_neighbours``)."""
        return self.descriptors[self.valid_rows]

    @property
    def resolution(self) -> float:
        return float(np.mean(self.resolutions))

    def model_points(self, i: int) -> np.ndarray:
        return self.points[self.point_offsets[i]:self.point_offsets[i + 1]]

    def __repr__(self) -> str:
        return (f"ModelLibrary({self.n_models} models, {len(self.kp_id)} reference descriptors "
                f"({len(self.valid_rows)} valid), params={self.params})")

    def _exact_search(self, dev: str):
        """The exact search over the matched reference descriptors (``descriptors[valid_rows]``)
        on ``dev``, prepared once per device (:class:`~scanforest.kernels.knn.bruteforce.ExactSearch`:
        on a GPU the rows stay resident between scenes)."""
        from ..knn.bruteforce import ExactSearch

        cache = self.__dict__.setdefault("_search_cache", {})
        memo = cache.get(dev)
        if memo is None or memo[0] is not self.descriptors:
            memo = cache[dev] = (self.descriptors, ExactSearch(self.reference(), device=dev))
        return memo[1]

    def forest_search(self, dev: str):
        """The KD-forest over the matched reference descriptors (``descriptors[valid_rows]``, the
        ids of :meth:`_exact_search`) on ``dev`` with the device's defaults, built once per device;
        its ``query(..., recall=r)`` calibrates its budget once per (k, r) and keeps it."""
        from ..knn.kdforest import KDForest

        cache = self.__dict__.setdefault("_search_cache", {})
        key = ("forest", dev)
        memo = cache.get(key)
        if memo is None or memo[0] is not self.descriptors:
            memo = cache[key] = (self.descriptors, KDForest(device=dev).fit(self.reference()))
        return memo[1]

    def __getstate__(self):
        # a pickled library (sent to a Dask worker) carries its arrays, not the searches built on them
        state = dict(self.__dict__)
        state.pop("_search_cache", None)
        return state

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
