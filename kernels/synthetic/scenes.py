"""Synthetic object models and scenes with ground truth (the embedded default data).

Models are sampled surfaces of non-symmetric composite shapes: each is a union of 3-5 random
primitives (boxes, ellipsoids, capped cylinders) with its points inside other primitives removed,
so every model is a closed, asymmetric outer surface with well-defined normals. Sizes are those
of table-top objects (10-25 cm) in metres.

A scene places several model instances at known random poses on a table plane, adds distractor
shapes that are not in the library (clutter), keeps only what a depth camera at the origin
looking along +z would see (a z-buffer: self- and mutual occlusion), subsamples to the requested
size (10^3 to 10^8 points) and adds Gaussian noise in units of the model mesh resolution.
Everything is seeded: the same arguments give the same arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError


@dataclass
class Model:
    """An object model in its own frame (centred at its centroid)."""

    name: str
    points: np.ndarray        # (N, 3) float32
    normals: np.ndarray       # (N, 3) float32, outward
    resolution: float         # mean nearest-neighbour spacing (the "mesh resolution"), metres

    @property
    def radius(self) -> float:
        return float(np.linalg.norm(self.points, axis=1).max())


@dataclass
class Scene:
    points: np.ndarray        # (N, 3) float32
    normals: np.ndarray       # (N, 3) float32, oriented towards the camera
    labels: np.ndarray        # (N,) int32: instance index, -1 for table/clutter
    ground_truth: list[dict] = field(default_factory=list)  # [{"model_id", "model", "pose" (4x4)}]
    resolution: float = 0.0
    noise: float = 0.0        # sigma in mesh resolutions


# ---------------------------------------------------------------------------------- primitives

def _sample_box(rng, half, n):
    areas = 4 * np.array([half[1] * half[2], half[0] * half[2], half[0] * half[1]])
    face = rng.choice(6, size=n, p=np.repeat(areas, 2) / (2 * areas.sum()))
    axis, sign = face // 2, np.where(face % 2 == 0, 1.0, -1.0)
    p = (rng.random((n, 3)) * 2 - 1) * half
    p[np.arange(n), axis] = sign * half[axis]
    nrm = np.zeros((n, 3))
    nrm[np.arange(n), axis] = sign
    return p, nrm


def _sample_ellipsoid(rng, radii, n):
    # rejection-free approximate area sampling: sample directions, weight by local area element
    m = n * 3
    d = rng.normal(size=(m, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    p = d * radii
    nrm = d / radii
    w = np.linalg.norm(nrm, axis=1) * np.prod(radii)  # area element of the mapped sphere
    keep = rng.random(m) < w / w.max()
    p, nrm = p[keep][:n], nrm[keep][:n]
    nrm /= np.linalg.norm(nrm, axis=1, keepdims=True)
    return p, nrm


def _sample_cylinder(rng, r, h, n):
    side, cap = 2 * np.pi * r * h, np.pi * r * r
    kind = rng.choice(3, size=n, p=np.array([side, cap, cap]) / (side + 2 * cap))
    t = rng.random(n) * 2 * np.pi
    p = np.empty((n, 3))
    nrm = np.zeros((n, 3))
    s = kind == 0
    p[s] = np.stack([r * np.cos(t[s]), r * np.sin(t[s]), (rng.random(s.sum()) - 0.5) * h], 1)
    nrm[s] = np.stack([np.cos(t[s]), np.sin(t[s]), np.zeros(s.sum())], 1)
    for k, z in ((1, h / 2), (2, -h / 2)):
        c = kind == k
        rr = r * np.sqrt(rng.random(c.sum()))
        p[c] = np.stack([rr * np.cos(t[c]), rr * np.sin(t[c]), np.full(c.sum(), z)], 1)
        nrm[c, 2] = np.sign(z)
    return p, nrm


def _inside(kind, params, q):
    if kind == "box":
        return np.all(np.abs(q) < params[0] - 1e-9, axis=1)
    if kind == "ellipsoid":
        return (np.sum((q / params[0]) ** 2, axis=1)) < 1 - 1e-9
    r, h = params
    return (q[:, 0] ** 2 + q[:, 1] ** 2 < r * r - 1e-12) & (np.abs(q[:, 2]) < h / 2 - 1e-9)


def random_rotation(rng) -> np.ndarray:
    """A uniformly distributed rotation matrix (from a random unit quaternion)."""
    q = rng.normal(size=4)
    q /= np.linalg.norm(q)
    w, x, y, z = q
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ])


def _composite(rng, n_points: int, size: float):
    """Union of 3-5 random primitives; returns surface points/normals (outer surface only)."""
    prims = []
    for i in range(int(rng.integers(3, 6))):
        kind = ("box", "ellipsoid", "cylinder")[int(rng.integers(0, 3))] if i else "box"
        R = random_rotation(rng) if i else np.eye(3)
        c = rng.uniform(-0.35, 0.35, 3) * size if i else np.zeros(3)
        if kind == "box":
            params = (rng.uniform(0.15, 0.5, 3) * size,)
        elif kind == "ellipsoid":
            params = (rng.uniform(0.12, 0.4, 3) * size,)
        else:
            params = (rng.uniform(0.08, 0.25) * size, rng.uniform(0.3, 0.8) * size)
        prims.append((kind, params, R, c))
    pts, nrms = [], []
    per = max(64, 4 * n_points // len(prims))
    for kind, params, R, c in prims:
        if kind == "box":
            p, nm = _sample_box(rng, params[0], per)
        elif kind == "ellipsoid":
            p, nm = _sample_ellipsoid(rng, params[0], per)
        else:
            p, nm = _sample_cylinder(rng, params[0], params[1], per)
        pts.append(p @ R.T + c)
        nrms.append(nm @ R.T)
    P, N = np.concatenate(pts), np.concatenate(nrms)
    keep = np.ones(len(P), bool)
    for kind, params, R, c in prims:
        keep &= ~_inside(kind, params, (P - c) @ R)
    P, N = P[keep], N[keep]
    sel = rng.permutation(len(P))[:n_points]
    P, N = P[sel], N[sel]
    return P - P.mean(0), N


def _resolution(points: np.ndarray) -> float:
    from scipy.spatial import cKDTree

    d, _ = cKDTree(points).query(points, k=2)
    return float(np.mean(d[:, 1]))


def model_library(n_models: int = 5, points_per_model: int = 20_000, *, size: float = 0.18,
                  seed: int = 0) -> list[Model]:
    """A library of ``n_models`` distinct non-symmetric object models (seeded)."""
    if n_models < 1 or points_per_model < 100:
        raise InputError("model_library needs n_models >= 1 and points_per_model >= 100")
    rng = np.random.default_rng(seed)
    models = []
    for i in range(n_models):
        P, N = _composite(rng, points_per_model, size * rng.uniform(0.8, 1.3))
        models.append(Model(f"model_{i:03d}", P.astype(np.float32), N.astype(np.float32), _resolution(P)))
    return models


def pose_matrix(R: np.ndarray, t: np.ndarray) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, t
    return T


def make_scene(models: list[Model], *, n_instances: int = 3, n_points: int = 100_000, noise: float = 0.2,
               clutter: int = 3, occlusion: bool = True, seed: int = 0, model_ids=None) -> Scene:
    """A scene with ``n_instances`` library models at random poses on a table, seen from the origin.

    Parameters
    ----------
    models : list of Model
    n_instances : int
        Model instances placed (ids drawn from the library without repetition where possible,
        or given by ``model_ids``).
    n_points : int
        Points in the scene after occlusion (10^3 .. 10^8).
    noise : float
        Gaussian noise sigma in units of the mean model mesh resolution.
    clutter : int
        Distractor shapes (not in the library) placed among the instances.
    occlusion : bool
        Keep only points visible from the camera (a z-buffer) - self and mutual occlusion.
    """
    if not 1_000 <= n_points <= 100_000_000:
        raise InputError(f"n_points must be within 10^3..10^8, got {n_points}")
    if not len(models):
        raise InputError("models is empty: a scene places library models (synthetic.model_library)")
    if model_ids is None and (isinstance(n_instances, bool) or int(n_instances) != n_instances or n_instances < 0):
        raise InputError(f"n_instances must be an integer >= 0, got {n_instances!r}")
    rng = np.random.default_rng(seed)
    res = float(np.mean([m.resolution for m in models]))
    if model_ids is None:
        pool = rng.permutation(len(models))
        model_ids = [int(pool[i % len(models)]) for i in range(n_instances)]
    n_instances = len(model_ids)
    # table plane z = depth, objects resting in front of it; positions on a jittered grid
    depth = 1.0
    slots = n_instances + clutter
    cols = int(np.ceil(np.sqrt(slots)))
    spacing = 2.2 * max(m.radius for m in models)
    grid = [(i % cols, i // cols) for i in rng.permutation(cols * cols)[:slots]]
    # sample density: enough that every pixel of the z-buffer is covered
    oversample = 6 if occlusion else 1
    total_area_pts = max(n_points * oversample, 20_000)
    parts, normals, labels, gt = [], [], [], []
    extent = cols * spacing
    table_pts = int(total_area_pts * 0.5)
    tp = np.column_stack([(rng.random(table_pts) - 0.5) * extent,
                          (rng.random(table_pts) - 0.5) * extent,
                          np.full(table_pts, depth + 0.1)])
    parts.append(tp)
    normals.append(np.tile([0, 0, -1.0], (table_pts, 1)))
    labels.append(np.full(table_pts, -1, np.int32))
    obj_pts = int(total_area_pts * 0.5 / max(1, slots))
    for slot, (gx, gy) in enumerate(grid):
        center = np.array([(gx - (cols - 1) / 2) * spacing, (gy - (cols - 1) / 2) * spacing, depth - 0.05])
        center[:2] += rng.uniform(-0.1, 0.1, 2) * spacing
        R = random_rotation(rng)
        if slot < n_instances:
            m = models[model_ids[slot]]
            base = m.points.astype(np.float64)
            bn = m.normals.astype(np.float64)
            reps = int(np.ceil(obj_pts / len(base)))
            if reps > 1:  # densify by jittering copies within a fraction of the resolution
                jit = rng.normal(scale=0.25 * m.resolution, size=(reps * len(base), 3))
                base = np.tile(base, (reps, 1)) + jit
                bn = np.tile(bn, (reps, 1))
            sel = rng.permutation(len(base))[:obj_pts]
            P, N = base[sel], bn[sel]
            label = slot
            gt.append({"model_id": int(model_ids[slot]), "model": m.name,
                       "pose": pose_matrix(R, center).tolist()})
        else:
            P, N = _composite(rng, obj_pts, 0.15)
            label = -1
        parts.append(P @ R.T + center)
        normals.append(N @ R.T)
        labels.append(np.full(len(P), label, np.int32))
    P = np.concatenate(parts)
    N = np.concatenate(normals)
    L = np.concatenate(labels)
    if occlusion:
        target = n_points
        keep = _zbuffer(P, target)
        for _ in range(4):  # holes behind objects: shrink the pixel until the view holds n_points
            if len(keep) >= n_points:
                break
            target = int(target * 1.1 * n_points / max(1, len(keep)))
            keep = _zbuffer(P, target)
        P, N, L = P[keep], N[keep], L[keep]
    if len(P) > n_points:
        sel = np.sort(rng.permutation(len(P))[:n_points])
        P, N, L = P[sel], N[sel], L[sel]
    flip = np.einsum("ij,ij->i", N, P) > 0  # orient towards the camera at the origin
    N[flip] *= -1
    if noise > 0:
        P = P + rng.normal(scale=noise * res, size=P.shape)
    return Scene(P.astype(np.float32), N.astype(np.float32), L, gt, res, noise)


def _zbuffer(P: np.ndarray, target: int) -> np.ndarray:
    """Indices of the points nearest the camera in each pixel of a pinhole image (camera at 0, +z)."""
    u, v = P[:, 0] / P[:, 2], P[:, 1] / P[:, 2]
    area = (u.max() - u.min()) * (v.max() - v.min())
    pix = np.sqrt(area / (target * 1.15))
    iu = np.floor((u - u.min()) / pix).astype(np.int64)
    iv = np.floor((v - v.min()) / pix).astype(np.int64)
    key = iv * (iu.max() + 1) + iu
    order = np.lexsort((P[:, 2], key))
    first = np.ones(len(order), bool)
    first[1:] = key[order][1:] != key[order][:-1]
    return np.sort(order[first])


def transform(points: np.ndarray, pose: np.ndarray) -> np.ndarray:
    pose = np.asarray(pose)
    return points @ pose[:3, :3].T + pose[:3, 3]


# Recognition settings that work on these synthetic worlds (models 0.15-0.35 m, ~3 mm resolution).
# The PCL tutorial's settings are tuned for the Kinect milk scene; on these scenes Hough grouping
# misses models, so the synthetic preset groups by geometric consistency and describes the models
# through rendered views (one-sided, like a scan sees them). Measured: precision and recall 1.0 at
# noise 0.1-0.5 resolutions on 150k-point scenes (``scanforest bench recognize --synthetic``).
# ``min_inlier_fraction`` 0.8: on 300k-point scenes (noise 0.2, seeds 50033-50050, CPU backend)
# every true instance scored >= 0.844 and every false one <= 0.764; at 0.7 three false instances
# on clutter objects passed (precision 0.946).
SYNTHETIC_LIBRARY = dict(model_ss=0.008, descr_rad=0.04, rf_rad=0.03, normal_radius=0.015, views=30)
SYNTHETIC_RECOGNIZE = dict(scene_ss=0.015, method="gc", cg_size=0.02, cg_thresh=5, normal_radius=0.015,
                           inlier_dist=0.008, min_inlier_fraction=0.8, match_k=2)
# a lighter library for CPU-only runs (demo, CI): fewer views, coarser model sampling
SYNTHETIC_LIBRARY_LIGHT = dict(SYNTHETIC_LIBRARY, model_ss=0.012, views=20)
# and sparser scene keypoints. Measured in the demo (60k-point scenes, 2 cores, 2026-12-07; the pass is
# matching-bound: the exact search of each keypoint against the 46.5k library rows): scene_ss 0.02 /
# 0.025 / 0.03 gave tp/fp/fn 17/2/1, 17/1/1, 15/0/3 on the demo's 6 scenes and 31/1/5, 31/0/5, 30/0/6
# on 12 more (`demo --scenes 18`), the pass 71.3 / 52.9 / 22.8 s
SYNTHETIC_RECOGNIZE_LIGHT = dict(SYNTHETIC_RECOGNIZE, scene_ss=0.025, min_inlier_fraction=0.7)


# sparse scenes (tens of thousands of points, e.g. the archive bench's 20k): the light library, denser
# scene keypoints and a lower inlier fraction, since a sparse scene covers less of each model's
# verification points. Measured on 10 scenes of 20k points, noise 0.2, 4 models, CPU: precision 1.0,
# recall 0.83 (the light preset: 0.94 / 0.53). Consensus sets of 4 correspondences (cg_thresh 3; a
# sparse instance of 400-800 points gives few keypoints): 36 scenes of 20k points (seeds 1-36),
# tp/fp/fn 80/8/28 -> 87/9/21, recall 0.741 -> 0.806 at precision 0.909 -> 0.906; on the 24 scenes
# not used to choose it, 0.736 -> 0.806 at 0.883 -> 0.879.
SYNTHETIC_RECOGNIZE_SPARSE = dict(SYNTHETIC_RECOGNIZE_LIGHT, scene_ss=0.015, min_inlier_fraction=0.6,
                                  cg_thresh=3)
# ...and a wider SHOT support and reference frame for them (the scene is described with the
# library's radii): at ~6 mm point spacing a 4 cm sphere holds too few points for SHOT's 32
# bins. CPU, 5 models, noise 0.2, 36 scenes of 20k points to choose (seeds 1-36) and 36 held out
# (60000-60035), tp/fp/fn and recall / precision (2026-11-26):
#   descr_rad 0.04, rf_rad 0.03 (the light library): 86/2/22, 88/3/20 -> 0.796 / 0.977, 0.815 / 0.967
#   0.05 / 0.04: 96/4/12, 100/0/8 -> 0.889 / 0.960, 0.926 / 1.0
#   0.06 / 0.05: 103/3/5, 102/2/6 -> 0.954 / 0.972, 0.944 / 0.981 (adopted)
# Views rendered coarser, to match the scene's density (pixel 3 or 4 model resolutions instead of
# 2), lost recall: 0.731 / 0.815 and 0.630 / 0.667.
SYNTHETIC_LIBRARY_SPARSE = dict(SYNTHETIC_LIBRARY_LIGHT, descr_rad=0.06, rf_rad=0.05)
SPARSE_SCENE_POINTS = 100_000


def recognition_presets(device: str, scene_points: int | None = None) -> tuple[dict, dict]:
    """(library params, recognize params) for a resolved device and, when known, the points per
    scene: scenes under :data:`SPARSE_SCENE_POINTS` get the sparse presets on any device; otherwise
    the CPU backend gets the lighter library and coarser scene sampling (demo, CI), the GPU the
    lighter library with the full scene sampling (tuned on 300k-point scenes).

    The GPU's library was :data:`SYNTHETIC_LIBRARY` (148k reference rows) until 2026-11-26: on 60
    scenes of 300k points (noise 0.2, one H200, the same run) the light one (56k rows) gives
    tp/fp/fn 177/0/3 against 179/0/1 (recall 0.983 vs 0.994, precision 1.0 both) in 84 ms per
    scene instead of 118 (matching 47 -> 24 ms)."""
    if scene_points is not None and scene_points < SPARSE_SCENE_POINTS:
        return SYNTHETIC_LIBRARY_SPARSE, SYNTHETIC_RECOGNIZE_SPARSE
    if device == "cpu":
        return SYNTHETIC_LIBRARY_LIGHT, SYNTHETIC_RECOGNIZE_LIGHT
    return SYNTHETIC_LIBRARY_LIGHT, SYNTHETIC_RECOGNIZE
