"""The recognition pipeline: :func:`recognize` finds a library's models in one scene.

It follows PCL's correspondence-grouping tutorial (``correspondence_grouping.cpp``) stage by
stage, with a verification stage that scores every pose hypothesis of a scene at once:

1. **Description** (:func:`~.library.describe`) - normals, keypoints, SHOT352 and frames of the
   scene (the library's models were described once, :class:`~.library.ModelLibrary`).
2. **Matching** (:func:`~.correspondences.match`) - nearest library descriptors of every scene
   descriptor.
3. **Grouping** (:func:`~.grouping.group_hough` or :func:`~.grouping.group_gc`), per model, each
   group cleaned by RANSAC and fitted (:mod:`.rigid`).
4. **Verification** (:func:`~.verification.verify`) twice around a **refinement**
   (:func:`~.refinement.refine_hypotheses`): pass 1 scores every hypothesis (no claims), the
   promising ones are refined by ICP or chamfer alignment against the scene, and pass 2 runs the
   greedy acceptance on the refined poses.

Every tuning parameter lives on :class:`RecognizeParams` (a frozen dataclass, checked when it is
made); :func:`recognize` takes one, or its fields as keyword arguments, or both (the keywords
override the object's fields). It returns :class:`Detections`, a list of :class:`Detection` with
the per-phase timings.
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..backend import Timer, is_cupy, resolve_device, to_device, to_numpy, xp_for
from ..coordinates import check_spacing, choose_origin, is_zero, pose_to_global, to_local
from ..errors import InputError
from ..validation import integer, points, positive
from ._scene_index import _SceneIndex
from .correspondences import match
from .grouping import group_gc, group_hough
from .library import ModelLibrary, describe
from .refinement import polish_poses, refine_hypotheses
from .verification import verify

__all__ = ["RecognizeParams", "Detection", "Detections", "recognize", "recognize_many", "recognize_described",
           "recognize_described_many"]


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecognizeParams:
    """Every tuning parameter of :func:`recognize`, with the defaults of PCL's tutorial.

    Frozen: derive variants with ``dataclasses.replace(params, method="gc")`` (or pass the
    changed fields to :func:`recognize` as keywords). Values are checked when the object is made
    (:class:`~scanforest.kernels.errors.InputError`, one line naming the field).
    """

    scene_ss: float = 0.03
    """Scene keypoint uniform-sampling leaf (PCL tutorial: 0.03)."""
    scene_voxel: float | None = None
    """Thin the scene first to one point per voxel of this edge, the centroid of its points
    (PCL ``VoxelGrid``, :func:`~scanforest.kernels.descriptors.keypoints.voxel_grid`): normals,
    keypoints, SHOT, grouping, verification and refinement run on the thinned scene, as Open3D's
    global registration does on its downsampled clouds; then each accepted pose is polished by
    point-to-point ICP against the scene's own points around it
    (:func:`~.refinement.polish_poses`). Pair it with a library built at the same ``voxel`` and
    radii scaled to it (docs/algorithms.md: 15 mm, ``scene_ss`` 0.045, SHOT 0.06, ``cg_size``
    0.03, ``inlier_dist`` 0.015 on PCL's Kinect scene); ``None`` (default): every scene point.
    :func:`recognize` and :func:`recognize_many` only (a described scene is described already)."""
    polish_voxel: float | None = None
    """With ``scene_voxel``: the final polish fits the scene's own points around each detection
    averaged into voxels of this edge (noise averaged out, as Open3D registers on averaged
    clouds); ``None`` (default): the points as they are."""
    polish_stages: int = 3
    """With ``scene_voxel``: the polish's stages, coarse to fine: the pairs' distance is
    ``inlier_dist`` in the first and halves at each next one, each stage iterated to convergence
    (a pose found on centroids is within ``inlier_dist``; pairs that close to the surface measure
    it with less of the neighbouring clutter: on the synthetic 300k scenes 0.63 -> 0.51 mm median
    translation error from 1 to 3 stages, docs/benchmarks.md)."""
    descr_rad: float | None = None
    """SHOT support radius; default: the library's (0.02)."""
    rf_rad: float | None = None
    """Hough local-reference-frame radius; default: the library's (0.015)."""
    normal_k: int = 10
    """Neighbours of the scene's k-NN PCA normals (towards ``viewpoint``)."""
    normal_radius: float | None = None
    """Radius neighbourhood for the scene normals instead of ``normal_k``."""
    method: str = "hough"
    """Correspondence grouping: ``"hough"`` (PCL ``Hough3DGrouping``) or ``"gc"`` (PCL
    ``GeometricConsistencyGrouping``)."""
    cg_size: float = 0.01
    """Hough bin size / geometric-consistency tolerance (also the RANSAC inlier threshold)."""
    cg_thresh: float = 5
    """Hough threshold (a negative value in [-1, 0) is a fraction of the maximum) / consensus
    set size (a set needs more than this many members)."""
    use_interpolation: bool = True
    """Hough: trilinear vote interpolation (PCL's default)."""
    match_k: int = 1
    """Library neighbours per scene descriptor (see :func:`~.correspondences.match`)."""
    max_dist2: float = 0.25
    """Keep a match when its squared descriptor distance is below this (PCL: 0.25)."""
    ratio: float | None = None
    """Optional ratio test in (0, 1] (see :func:`~.correspondences.match`)."""
    match_recall: float | None = None
    """``None``: the library's descriptors are matched by exact brute force (PCL's answer). A
    recall in (0, 1): by the library's KD-forest (:class:`~scanforest.kernels.knn.kdforest.KDForest`
    with the device's defaults), its budget calibrated once per library for this recall@k
    (``match_k``, plus one with ``ratio``) on its own rows. On the CPU, 56k reference rows and a
    20k-point synthetic scene: matching 7.4 s exact; the forest 9.4x / 4.7x faster than the brute
    force on the same queries at recall 0.9 / 0.95 (docs/benchmarks.md, 2026-11-28)."""
    ransac: bool = True
    """Clean every group by RANSAC before the pose fit."""
    verify: bool = True
    """Run the verification stage; without it every hypothesis is returned (PCL tutorial)."""
    inlier_dist: float | None = None
    """Verification / refinement distance; default: 2x the library's mean model resolution
    (``scene_voxel`` when the scene is thinned)."""
    min_inlier_fraction: float = 0.5
    """Acceptance threshold on ``inliers / visible`` of the refined poses (see
    :func:`~.verification.verify`)."""
    min_inliers: int = 10
    """Acceptance also needs this many inliers."""
    viewpoint: tuple = (0.0, 0.0, 0.0)
    """Camera centre, relative to the scene's origin (see :func:`recognize`; the scene's own
    coordinates where its origin is 0): scene normals face it, and a model point is visible when
    its transformed normal faces it."""
    icp: bool = True
    """Verify -> refine -> verify: every hypothesis is scored first; those with an inlier fraction
    ``>= refine_min_fraction`` (at most ``max_refine``, best first) are refined (``refine``,
    ``icp_iterations``) and only they enter the greedy acceptance. Without it the unrefined
    hypotheses are accepted directly."""
    icp_iterations: int = 30
    """Iterations of the refinement."""
    refine_min_fraction: float = 0.3
    """Pass-1 inlier fraction a hypothesis needs to be refined."""
    max_refine: int = 32
    """At most this many hypotheses are refined (best first)."""
    refine: str = "icp"
    """The refinement: ``"icp"`` (point-to-plane ICP) or ``"pcha"`` (parametric chamfer
    alignment, :func:`scanforest.kernels.align.pcha.align_batch`: Levenberg-Marquardt on a
    distance transform of the scene around the candidates, Huber loss at ``inlier_dist``; each
    candidate aligns the model points that lie within ``inlier_dist`` of the scene at its
    hypothesis pose)."""
    max_detections: int | None = None
    """Stop accepting after this many detections."""
    seed: int = 0
    """RANSAC seed."""
    backend: str = "auto"
    """Where grouping, verification and refinement run when the scene is described on the GPU:
    ``"gpu"``; ``"cpu"``, the described scene, its normals and keypoints copied to the host once
    (the polish's crops of a thinned scene's own points are cut out on the device); ``"auto"``
    (default): the host for a scene recognised alone with at most :data:`HOST_BACKEND_POINTS`
    described points and :data:`HOST_BACKEND_CORRESPONDENCES` correspondences, where each of
    these phases on the device is bound on launches and synchronisations, not on work (PCL's
    thinned scene on an H100 host: 15.6 against 17.9 ms a scene, medians of 60 interleaved runs);
    the device otherwise (more correspondences cost the host far more than the device), and for
    the scenes of a batch (:func:`recognize_many`, the archive), whose grouping runs for all of
    them in one launch. The phases are the same algorithms on either device (their results agree
    to float32 rounding, and RANSAC's where its inliers are unambiguous);
    ``Detections.info["backend"]`` says where they ran."""

    def __post_init__(self):
        if self.method not in ("hough", "gc"):
            raise InputError(f"method must be 'hough' or 'gc', got {self.method!r}")
        if self.backend not in ("auto", "gpu", "cpu"):
            raise InputError(f"backend must be 'auto', 'gpu' or 'cpu', got {self.backend!r}")
        if self.refine not in ("icp", "pcha"):
            raise InputError(f"refine must be 'icp' or 'pcha', got {self.refine!r}")
        for name in ("scene_ss", "cg_size", "max_dist2"):
            positive(getattr(self, name), name)
        for name in ("descr_rad", "rf_rad", "normal_radius", "inlier_dist", "scene_voxel", "polish_voxel"):
            if getattr(self, name) is not None:
                positive(getattr(self, name), name)
        for name in ("normal_k", "match_k", "icp_iterations", "max_refine"):
            positive(getattr(self, name), name, integer=True)
        integer(self.polish_stages, "polish_stages")
        if self.normal_k < 3:  # a plane needs 3 points: fewer gave NaN normals and "points is empty"
            raise InputError(f"normal_k must be >= 3, got {self.normal_k}")
        if self.match_k > 256:  # the matching's top-k kernels hold at most 256 a row
            raise InputError(f"match_k must be at most 256, got {self.match_k}")
        if self.match_recall is not None:
            from ..knn.kdforest import check_recall

            check_recall(self.match_recall, "match_recall")
        if self.max_detections is not None:
            positive(self.max_detections, "max_detections", integer=True)
        for name in ("use_interpolation", "ransac", "verify", "icp"):
            if getattr(self, name) not in (True, False):
                raise InputError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _is_int(self.min_inliers) or self.min_inliers < 0:
            raise InputError(f"min_inliers must be an integer >= 0, got {self.min_inliers!r}")
        if not _is_int(self.seed):
            raise InputError(f"seed must be an integer, got {self.seed!r}")
        for name in ("min_inlier_fraction", "refine_min_fraction"):
            v = getattr(self, name)
            if not (_is_real(v) and 0.0 <= v <= 1.0):
                raise InputError(f"{name} must be a fraction in [0, 1], got {v!r}")
        if not _is_real(self.cg_thresh) or (self.method == "gc" and self.cg_thresh < 3):
            raise InputError(f"cg_thresh must be a finite number (>= 3 for method 'gc': a pose needs 3 "
                             f"correspondences), got {self.cg_thresh!r}")
        if self.ratio is not None and not (_is_real(self.ratio) and 0.0 < self.ratio <= 1.0):
            raise InputError(f"ratio must lie in (0, 1], got {self.ratio!r}")
        try:
            vp = tuple(float(v) for v in np.asarray(self.viewpoint, np.float64).reshape(3))
        except (TypeError, ValueError):
            vp = None
        if vp is None or not all(math.isfinite(v) for v in vp):
            raise InputError(f"viewpoint must be 3 finite numbers, got {self.viewpoint!r}")
        object.__setattr__(self, "viewpoint", vp)  # a hashable, comparable tuple of floats

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes) -> "RecognizeParams":
        """A copy with ``changes`` applied (``dataclasses.replace``, checked again); an unknown
        name is an :class:`~scanforest.kernels.errors.InputError` that lists the known ones."""
        names = self.names()
        for key in changes:
            if key not in names:
                raise InputError(f"recognize() got an unknown parameter {key!r}; RecognizeParams has: "
                                 f"{', '.join(names)}")
        return dataclasses.replace(self, **changes) if changes else self


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
        and math.isfinite(float(v))


# ---------------------------------------------------------------------------------------------
# results
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


# ---------------------------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------------------------
def recognize(scene_points, library: ModelLibrary, params: RecognizeParams | None = None, *,
              scene_normals=None, origin=None, device: str = "auto", **overrides) -> Detections:
    """Find the library's models in one scene.

    Parameters
    ----------
    scene_points : (N, 3) array
        The scene (numpy or CuPy; NaN/inf rows are dropped).
    library : ModelLibrary
    params : RecognizeParams, optional
        The tuning parameters (default: ``RecognizeParams()``).
    scene_normals : (N, 3) array, optional
        Given scene normals (otherwise k-NN PCA with ``normal_k`` towards ``viewpoint``).
    origin : (3,) float, optional
        The scene's local origin, in its own coordinates: every stage computes on ``scene_points
        - origin`` (subtracted in float64, then cast to float32), ``viewpoint`` is relative to it,
        and the detections' poses come back in the scene's own coordinates (translation plus
        origin, float64). Default: :func:`~scanforest.kernels.coordinates.choose_origin` of the
        scene's bounding box (``[0, 0, 0]`` for coordinates below 1024 m; georeferenced ones, e.g.
        UTM, get their centre rounded to 1 m). Coordinates still too coarse in float32 for the
        radii in use are an :class:`~scanforest.kernels.errors.InputError`
        (:func:`~scanforest.kernels.coordinates.check_spacing`).
    device : {"auto", "cpu", "gpu"}
        ``auto`` follows the scene array type (numpy -> CPU, CuPy -> GPU).
    **overrides
        Fields of :class:`RecognizeParams` (e.g. ``method="gc", cg_size=0.02``), applied over
        ``params``; an unknown name is an :class:`~scanforest.kernels.errors.InputError`.

    Returns
    -------
    Detections
        List of :class:`Detection` (acceptance order), with ``.timings`` (seconds per phase:
        normals, keypoints, shot, matching, grouping, verification, icp, total) and ``.info``.
    """
    dev, p = _setup(scene_points, library, params, overrides, device)
    return _recognize_matched(_prepare(scene_points, scene_normals, library, p, dev, origin), library)


def recognize_many(scenes, library: ModelLibrary, params: RecognizeParams | None = None, *,
                   device: str = "auto", **overrides) -> list:
    """:func:`recognize` of many scenes (a list of point arrays), with the same detections: each
    scene is described and matched alone, then they are grouped together
    (:func:`recognize_described_many`: the archive's batches). Each result's ``grouping`` time
    is its share of the batch's, and ``total`` the sum of its phases."""
    if getattr(scenes, "ndim", None) == 2:  # list() would make each point a "scene" of shape (3,)
        raise InputError(f"scenes is one array of shape {tuple(scenes.shape)}: give a list of scenes "
                         f"([points, ...]), or recognize() for one")
    scenes = list(scenes)
    if not scenes:
        return []
    dev, p = _setup(scenes[0], library, params, overrides, device)
    prepared = []
    for i, s in enumerate(scenes):
        try:
            prepared.append(_prepare(s, None, library, p, dev))
        except InputError as exc:  # which scene of the batch
            raise InputError(f"scenes[{i}]: {exc}") from None
    return _recognize_batch(prepared, library)


def _prepare(scene_points, scene_normals, library, p: RecognizeParams, dev: str, origin=None) -> "_Matched":
    """:func:`recognize` up to its correspondences (the timer running)."""
    xp = xp_for(dev)
    t0 = time.perf_counter()
    timer = Timer(dev == "gpu")
    # NaN/inf rows are dropped here (and the normals beside them), not refused
    pts = points(to_device(scene_points, dev), "scene_points", finite=False, dtype=None)
    nrm_in = None if scene_normals is None else to_device(scene_normals, dev)
    box = None
    if dev == "cpu":  # one pass: the non-finite rows' count and the finite rows' bounds
        from ..geom_cpu import finite_bounds

        bad, lo, hi = finite_bounds(pts)
        box = (lo, hi) if int(pts.shape[0]) > bad else None
    else:
        bad = int(pts.shape[0]) - int(xp.isfinite(pts).all(axis=1).sum())
    if bad:
        fin = xp.isfinite(pts).all(axis=1)
        pts = pts[fin]
        if nrm_in is not None:
            nrm_in = nrm_in[fin]
    descr_rad = float(library.params.get("descr_rad", 0.02) if p.descr_rad is None else p.descr_rad)
    rf_rad = float(library.params.get("rf_rad", 0.015) if p.rf_rad is None else p.rf_rad)
    inlier_dist = float(p.inlier_dist if p.inlier_dist is not None else p.scene_voxel if p.scene_voxel is not None
                        else 2.0 * library.resolution)
    pts, origin = _local(pts, origin, xp, {"scene_ss": p.scene_ss, "descr_rad": descr_rad, "normal_radius":
                                           p.normal_radius, "rf_rad": rf_rad if p.method == "hough" else None,
                                           "cg_size": p.cg_size, "inlier_dist": inlier_dist,
                                           "scene_voxel": p.scene_voxel}, box)
    if p.scene_voxel is not None:
        if nrm_in is not None:
            raise InputError("scene_normals cannot be given with scene_voxel (the thinned scene's normals are "
                             "estimated from its points)")
        from ..descriptors.keypoints import thin

        full, pts = pts, thin(pts, p.scene_voxel, dev)
        if int(full.shape[0]) and int(pts.shape[0]) <= p.normal_k:
            raise InputError(f"scene_voxel {p.scene_voxel:g} leaves {int(pts.shape[0])} of the scene's "
                             f"{int(full.shape[0])} points, too few for normals from {p.normal_k} neighbours: "
                             "choose a smaller voxel")
        timer.lap("thinning")
    vp = np.asarray(p.viewpoint, np.float64).reshape(3)

    d = describe(pts, normals=nrm_in, normal_k=p.normal_k, normal_radius=p.normal_radius,
                 keypoint_radius=p.scene_ss, descr_rad=descr_rad,
                 rf_rad=rf_rad if p.method == "hough" else None, viewpoint=vp, device=dev, timer=timer)
    corr = match(d["descriptors"], library, k=p.match_k, max_dist2=p.max_dist2, ratio=p.ratio, device=dev,
                 recall=p.match_recall)
    timer.lap("matching")
    return _Matched(pts, d, corr, p, dev, timer, t0, inlier_dist, vp, origin,
                    full if p.scene_voxel is not None else None)


def _local(pts, origin, xp, radii: dict, box=None):
    """The scene's points in its local frame (float32) and its origin (float64, (3,)):
    ``origin`` None is chosen from the points' bounding box (``box``: ``(lo, hi)`` when known);
    the coordinates are checked against the radii in use
    (:func:`~scanforest.kernels.coordinates.check_spacing`)."""
    if box is None and int(pts.shape[0]):
        box = (to_numpy(pts.min(axis=0)), to_numpy(pts.max(axis=0)))
    if origin is None:
        if int(pts.shape[0]):
            origin = choose_origin(*box, radii=radii)  # a scene too far for its radii is moved
        else:
            origin = np.zeros(3)
        if not is_zero(origin):  # said, not silent: the viewpoint is relative to this origin
            warnings.warn(f"scene_points are far from 0: computed about the origin {origin.tolist()} chosen from "
                          "their bounding box, and `viewpoint` is relative to it; pass origin= (the file's "
                          "offset or the scanner's position) to choose it", UserWarning, stacklevel=4)
    given = origin
    try:
        origin = np.asarray(origin, np.float64).reshape(3)
    except (TypeError, ValueError):
        origin = np.full(1, np.nan)
    if origin.shape != (3,) or not np.isfinite(origin).all():
        raise InputError(f"origin must be 3 finite numbers (a point in the scene's coordinates), got {given!r}")
    local = to_local(pts, origin, xp)
    if int(local.shape[0]):  # the largest magnitude in the local frame, from the box's corners
        far = np.abs(np.stack([np.asarray(b, np.float64) for b in box]) - origin).astype(np.float32)
        half = float((np.asarray(box[1], np.float64) - np.asarray(box[0], np.float64)).max()) / 2
        check_spacing(float(far.max()), radii, "scene_points", span=half)
    return local, origin


def recognize_described(scene_points, library: ModelLibrary, params: RecognizeParams | None = None, *,
                        normals, keypoints, descriptors=None, rf=None, correspondences=None, origin=None,
                        device: str = "auto", **overrides) -> Detections:
    """Recognition of a scene described elsewhere: the archive's describe stage gave its normals,
    keypoints and SHOT, its match stage the keypoints' nearest library descriptors.

    :func:`recognize` is ``describe`` + :func:`match` + this function's steps (grouping,
    verification, refinement), so given the same description and matches both return the same
    detections.

    Parameters
    ----------
    scene_points : (N, 3) array
        Finite scene points (the ones that were described).
    normals : (N, 3) array
        Their normals (NaN where a point had too few neighbours).
    keypoints : (K,) int
        Keypoint indices into ``scene_points``.
    descriptors : (K, 352) array, optional
        The keypoints' SHOT, matched here by exact brute force when ``correspondences`` is not
        given.
    rf : (K, 3, 3) array, optional
        The keypoints' frames at the library's ``rf_rad`` (Hough voting only; computed when
        missing).
    correspondences : Correspondences, optional
        Matches found elsewhere (``correspondences.from_neighbours`` over the match stage's
        stored top-P); ``scene_kp`` indexes ``keypoints``.
    origin : (3,) float, optional
        As :func:`recognize`: the frame the description was computed in (its normals and frames
        are those of ``scene_points - origin``).
    params, device, **overrides :
        As :func:`recognize` (the description parameters among them are not used).
    """
    m = _prepare_described(scene_points, library, params, normals=normals, keypoints=keypoints,
                           descriptors=descriptors, rf=rf, correspondences=correspondences, origin=origin,
                           device=device, **overrides)
    return _recognize_matched(m, library)


def _prepare_described(scene_points, library, params, *, normals, keypoints, descriptors, rf, correspondences,
                       device, origin=None, **overrides) -> "_Matched":
    """:func:`recognize_described` up to its correspondences."""
    dev, p = _setup(scene_points, library, params, overrides, device)
    if p.scene_voxel is not None:
        raise InputError("scene_voxel applies to recognize() and recognize_many(): a described scene was "
                         "described at its own resolution")
    if descriptors is None and correspondences is None:
        raise InputError("recognize_described needs the keypoints' descriptors or their correspondences")
    xp = xp_for(dev)
    t0 = time.perf_counter()
    timer = Timer(dev == "gpu")
    pts = points(to_device(scene_points, dev), "scene_points", dtype=None)
    rf_rad = float(library.params.get("rf_rad", 0.015) if p.rf_rad is None else p.rf_rad)
    inlier_dist = float(2.0 * library.resolution if p.inlier_dist is None else p.inlier_dist)
    pts, origin = _local(pts, origin, xp, {"rf_rad": rf_rad if p.method == "hough" else None,
                                           "cg_size": p.cg_size, "inlier_dist": inlier_dist})
    nrm = points(to_device(normals, dev), "normals", finite=False, rows=int(pts.shape[0]))
    kp = to_device(keypoints, dev)
    if kp.ndim != 1 or (kp.size and kp.dtype.kind not in "iu"):
        raise InputError(f"keypoints must be a 1-D array of point indices, got shape {tuple(kp.shape)} dtype {kp.dtype}")
    kp = kp.astype(xp.int64)
    if int(kp.shape[0]) and (int(kp.min()) < 0 or int(kp.max()) >= int(pts.shape[0])):
        raise InputError(f"keypoints must index the {int(pts.shape[0])} scene points")
    nk = int(kp.shape[0])
    if descriptors is not None and correspondences is None:  # one descriptor a keypoint, the library's width
        descriptors = points(to_device(descriptors, dev), "descriptors", dims=library.descriptors.shape[1],
                             finite=False, allow_empty=True, rows=nk)
    if rf is not None and tuple(getattr(rf, "shape", np.shape(rf))) != (nk, 3, 3):
        raise InputError(f"rf must be the keypoints' frames, shape ({nk}, 3, 3), got "
                         f"{tuple(getattr(rf, 'shape', np.shape(rf)))}")
    vp = np.asarray(p.viewpoint, np.float64).reshape(3)
    d = {"normals": nrm, "keypoints": kp, "kp_coords": pts[kp]}
    if p.method == "hough":
        if rf is None:
            from ..descriptors.shot import shot as _shot

            good = xp.isfinite(nrm).all(axis=1)
            sub = xp.flatnonzero(good)
            pos = xp.cumsum(good) - 1  # keypoint index among the points with a normal
            _, rf = _shot(xp.ascontiguousarray(pts[sub]), xp.ascontiguousarray(nrm[sub]), pos[kp], rf_rad,
                          device=dev)
        d["rf"] = to_device(rf, dev)
    if correspondences is None:
        correspondences = match(to_device(descriptors, dev), library, k=p.match_k, max_dist2=p.max_dist2,
                                ratio=p.ratio, device=dev, recall=p.match_recall)
    timer.lap("matching")
    return _Matched(pts, d, correspondences, p, dev, timer, t0, inlier_dist, vp, origin)


def recognize_described_many(scenes, library: ModelLibrary, params: RecognizeParams | None = None, *,
                             device: str = "auto", **overrides) -> list:
    """:func:`recognize_described` of many scenes, with the same detections: ``scenes`` are
    dicts of its arguments (``scene_points``, ``normals``, ``keypoints`` and ``descriptors``
    or ``correspondences``, optionally ``rf`` and ``origin``). Geometric-consistency grouping on
    the GPU runs for all of them at once (:func:`~.grouping.group_gc_many`: a sweep is sequential
    within a (scene, model) group, so one scene leaves most of the device idle); the other phases
    run scene by scene. Each result's ``grouping`` time is its share of the batch's, and ``total``
    the sum of its phases."""
    ms = [_prepare_described(s["scene_points"], library, params, normals=s["normals"], keypoints=s["keypoints"],
                             descriptors=s.get("descriptors"), rf=s.get("rf"),
                             correspondences=s.get("correspondences"), origin=s.get("origin"), device=device,
                             **overrides)
          for s in scenes]
    return _recognize_batch(ms, library)


def _recognize_batch(ms: list, library) -> list:
    """Grouping (all scenes at once where the method allows), verification and refinement of
    described and matched scenes."""
    from .grouping import group_gc_many

    if not ms:
        return []
    for m in ms:  # a scene's total: the sum of its phases (its wall time holds the others')
        m.t0 = None
    p = ms[0].p
    for i, m in enumerate(ms):  # where each scene's grouping, verification and refinement run
        m.timer.restart()
        ms[i] = _backend(m, alone=len(ms) == 1)
        ms[i].timer.lap("grouping")
    if p.method == "gc":  # each scene's grouping time: its share of its device's batch
        hyps = [None] * len(ms)
        for dev in ("gpu", "cpu"):
            idx = [i for i, m in enumerate(ms) if m.dev == dev]
            if not idx:
                continue
            t = time.perf_counter()
            got = group_gc_many([ms[i].corr for i in idx], library, [ms[i].d["kp_coords"] for i in idx],
                                gc_size=p.cg_size, gc_threshold=int(p.cg_thresh), ransac=p.ransac, seed=p.seed,
                                device=dev)
            share = (time.perf_counter() - t) / len(idx)
            for i, h in zip(idx, got):
                hyps[i] = h
                ms[i].timer.t["grouping"] = ms[i].timer.t.get("grouping", 0.0) + share
    else:
        hyps = []
        for m in ms:
            m.timer.restart()
            hyps.append(_group(m.corr, m.d, library, m.p, m.dev))
            m.timer.lap("grouping")
    out = []
    for m, h in zip(ms, hyps):
        m.timer.restart()
        out.append(_verified(m, h, library))
    return out


def _setup(scene_points, library, params, overrides, device: str) -> tuple[str, RecognizeParams]:
    """The device (``auto`` follows ``scene_points``) and the parameters of a recognition call,
    its library checked (in this order)."""
    dev = resolve_device(device, scene_points)
    p = _params(params, overrides)
    if not isinstance(library, ModelLibrary):
        raise InputError(f"library must be a ModelLibrary, got {type(library).__name__}")
    return dev, p


def _params(params, overrides) -> RecognizeParams:
    if params is None:
        params = RecognizeParams()
    elif not isinstance(params, RecognizeParams):
        raise InputError(f"params must be a RecognizeParams, got {type(params).__name__} "
                         f"(pass a dict of parameters as **params)")
    return params.replace(**overrides)


@dataclass
class _Matched:
    """A described and matched scene, ready for grouping (with its timer running)."""

    pts: object
    d: dict
    corr: object
    p: RecognizeParams
    dev: str
    timer: Timer
    t0: float | None
    inlier_dist: float
    vp: np.ndarray
    origin: np.ndarray
    full: object = None  # the scene's own points where ``pts`` is thinned (scene_voxel)
    described_on: str | None = None  # the device that described it, where ``dev`` is the host (backend)


#: ``backend="auto"``: a scene described on the GPU with at most this many points (after
#: thinning) and at most :data:`HOST_BACKEND_CORRESPONDENCES` correspondences, recognised alone,
#: is grouped, verified and refined on the host
HOST_BACKEND_POINTS = 50_000
#: ... the host's grouping and verification grow with the correspondences and hypotheses, the
#: device's barely: measured on an H100 host (16 cores), the host's three phases took 6.2 against
#: 8.2 ms at 485 correspondences (PCL's thinned scene), 16.8 against 9.7 ms at 1,080 and 603
#: against 26 ms at 13,502 (a synthetic scene of 20k points)
HOST_BACKEND_CORRESPONDENCES = 600


def _backend(m: _Matched, alone: bool = True) -> _Matched:
    """``m`` on the device its grouping, verification and refinement run on (``backend``; a
    scene of a batch stays on the device under ``"auto"``): a GPU scene moved to the host is
    copied once, every array of its description with it."""
    if m.dev != "gpu" or m.p.backend == "gpu" or (m.p.backend == "auto" and (
            not alone or int(m.pts.shape[0]) > HOST_BACKEND_POINTS
            or len(m.corr) > HOST_BACKEND_CORRESPONDENCES)):
        return m
    d = {k: to_numpy(v) if is_cupy(v) else v for k, v in m.d.items()}
    # the scene's own points (``full``) stay on the device: the polish cuts its crops out there
    return dataclasses.replace(m, pts=to_numpy(m.pts), d=d, dev="cpu", described_on=m.dev)


def _recognize_matched(m: _Matched, library) -> Detections:
    """Grouping, verification and refinement of a described and matched scene."""
    m = _backend(m)
    hyps = _group(m.corr, m.d, library, m.p, m.dev)
    m.timer.lap("grouping")
    return _verified(m, hyps, library)


def _group(corr, d, library, p, dev):
    if p.method == "hough":
        return group_hough(corr, library, to_numpy(d["kp_coords"]), to_numpy(d["rf"]), bin_size=p.cg_size,
                           threshold=p.cg_thresh, use_interpolation=p.use_interpolation,
                           ransac=p.ransac, seed=p.seed)
    return group_gc(corr, library, d["kp_coords"], gc_size=p.cg_size, gc_threshold=int(p.cg_thresh),
                    ransac=p.ransac, seed=p.seed, device=dev)


def _verified(m: _Matched, hyps, library) -> Detections:
    """Verification and refinement of a scene's hypotheses (the timer goes on from grouping)."""
    pts, d, corr, p, dev, timer, inlier_dist, vp = m.pts, m.d, m.corr, m.p, m.dev, m.timer, m.inlier_dist, m.vp
    skp = to_numpy(d["kp_coords"])
    out = Detections()
    first_scores = None
    if not p.verify or not len(hyps):
        timer.lap("verification")
        for hi in range(len(hyps)):
            mid = int(hyps.model_id[hi])
            out.append(Detection(mid, library.names[mid], float("nan"), 0, 0, hyps.poses[hi].copy(),
                                 int(hyps.n_corr[hi])))
        timer.lap("icp")
    else:
        sidx = _SceneIndex(pts, d["normals"], inlier_dist, dev)
        # pass 1: score every hypothesis at once (no claims)
        first_scores = verify(hyps, library, sidx, inlier_dist=inlier_dist, min_inlier_fraction=2.0,
                              min_inliers=0, viewpoint=vp, max_detections=0, device=dev).first_scores
        timer.lap("verification")
        if p.icp:  # refine the promising hypotheses (at most max_refine, best first)
            work, back, rmse = refine_hypotheses(hyps, first_scores, library, sidx, method=p.refine,
                                                 min_fraction=p.refine_min_fraction,
                                                 max_refine=p.max_refine, inlier_dist=inlier_dist,
                                                 iterations=p.icp_iterations)
        else:
            work, back, rmse = hyps, np.arange(len(hyps)), np.full(len(hyps), np.nan)
        timer.lap("icp")
        # pass 2: greedy acceptance by argmax with occupancy claims
        vr = verify(work, library, sidx, inlier_dist=inlier_dist,
                    min_inlier_fraction=p.min_inlier_fraction, min_inliers=p.min_inliers,
                    viewpoint=vp, max_detections=p.max_detections, device=dev)
        for wi, sc, inl, vis in zip(vr.accepted.tolist(), vr.scores.tolist(), vr.inliers.tolist(),
                                    vr.visible.tolist()):
            hi = int(back[wi])
            mid = int(hyps.model_id[hi])
            out.append(Detection(mid, library.names[mid], float(sc), int(inl), int(vis),
                                 work.poses[wi].copy(), int(hyps.n_corr[hi]),
                                 float(first_scores[hi]),
                                 None if np.isnan(rmse[hi]) else float(rmse[hi])))
        timer.lap("verification")
        if m.full is not None and len(out):  # thinned scene: each pose fitted to the scene's own points
            polished = polish_poses([det.pose for det in out], [det.model_id for det in out], library, m.full,
                                    dist=inlier_dist, iterations=p.icp_iterations, viewpoint=vp,
                                    voxel=p.polish_voxel, stages=p.polish_stages)
            for det, pose in zip(out, polished):
                det.pose = pose
            timer.lap("icp")
    # one scene alone: wall time; one of a batch: the sum of its phases
    timer.t["total"] = time.perf_counter() - m.t0 if m.t0 is not None else sum(timer.t.values())
    out.timings = dict(timer.t)
    out.info = {"scene_points": int(pts.shape[0]), "scene_keypoints": int(len(skp)),
                "correspondences": len(corr), "hypotheses": len(hyps), "device": m.described_on or dev,
                "backend": dev,
                "inlier_dist": inlier_dist,
                "hypothesis_scores": None if first_scores is None else first_scores.tolist()}
    for det in out:
        det.timings = out.timings
        if not is_zero(m.origin):  # back in the scene's own coordinates
            det.pose = pose_to_global(det.pose, m.origin)
    out.info["origin"] = m.origin.tolist()
    return out
