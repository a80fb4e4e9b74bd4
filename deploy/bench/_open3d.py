"""Open3D's documented global registration, the recognition peer of ``scanforest bench recognize``.

The pipeline of Open3D's tutorial (http://www.open3d.org/docs/release/tutorial/pipelines/
global_registration.html), unchanged but for the ICP clouds: voxel downsampling, normals
(hybrid search, radius 2 voxels, 30 neighbours), FPFH (radius 5 voxels, 100 neighbours), RANSAC
on feature matches (no mutual filter, distance 1.5 voxels, point-to-point estimation, 3 points per
hypothesis, edge-length 0.9 and distance checkers, 100000 iterations at confidence 0.999, seeded
with ``o3d.utility.random.seed(0)``), then point-to-plane ICP at 0.4 voxel. The ICP runs on the
downsampled clouds (which carry the normals point-to-plane needs) rather than on the full clouds
as the tutorial does: normals of a whole 300k-point scene would add seconds to every Open3D scene,
so this choice can only make Open3D faster.

Recognition with it: every model of the library is registered against the scene (one pose per
model: Open3D's pipeline has no verification and no multiple instances); the model side (a
model's downsampled cloud and FPFH per voxel size) is computed once, like scanforest's model
library, and timed apart from the scenes. A scene's seconds are its conversion from a numpy
array, downsampling, normals and FPFH plus the registration of every model.

Open3D is optional (``pip install 'scanforest[bench]'``); :func:`load` returns None without it.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np

# the tutorial's parameters, in voxel sizes
NORMAL_RADIUS, NORMAL_MAX_NN = 2.0, 30
FPFH_RADIUS, FPFH_MAX_NN = 5.0, 100
RANSAC_DISTANCE, RANSAC_N, EDGE_LENGTH = 1.5, 3, 0.9
RANSAC_MAX_ITERATIONS, RANSAC_CONFIDENCE = 100_000, 0.999
ICP_DISTANCE = 0.4
SEED = 0


def load(threads: int = 0):
    """The ``open3d`` module, or None when it does not import. ``threads`` (0: Open3D's default)
    sets ``OMP_NUM_THREADS`` before the first import: Open3D's OpenMP reads it once, at load.
    Returns ``(module, note)`` where ``note`` says why it is missing or how many threads it got."""
    if threads and "open3d" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = str(int(threads))
    try:
        import open3d as o3d
    except Exception as exc:  # ImportError, or a broken install (missing shared library)
        return None, (f"Open3D not importable ({type(exc).__name__}: {exc}): the Open3D peer is skipped; "
                      "install it with `pip install 'scanforest[bench]'` (open3d-cpu)")
    omp = os.environ.get("OMP_NUM_THREADS")
    return o3d, f"Open3D {o3d.__version__}, OMP_NUM_THREADS={omp or 'unset (all cores)'}"


@dataclass
class Features:
    cloud: object    # downsampled open3d.geometry.PointCloud with normals
    fpfh: object     # open3d.pipelines.registration.Feature
    points: int      # points after downsampling
    seconds: float


def features(o3d, points: np.ndarray, voxel: float) -> Features:
    """numpy points -> Open3D cloud (non-finite points removed) -> voxel downsampling -> normals -> FPFH."""
    t0 = time.perf_counter()
    pcd = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(np.asarray(points, np.float64)))
    pcd = pcd.remove_non_finite_points()
    down = pcd.voxel_down_sample(voxel)
    down.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=NORMAL_RADIUS * voxel,
                                                               max_nn=NORMAL_MAX_NN))
    fpfh = o3d.pipelines.registration.compute_fpfh_feature(
        down, o3d.geometry.KDTreeSearchParamHybrid(radius=FPFH_RADIUS * voxel, max_nn=FPFH_MAX_NN))
    return Features(down, fpfh, len(down.points), time.perf_counter() - t0)


def register(o3d, model: Features, scene: Features, voxel: float):
    """Pose of ``model`` in ``scene`` (4x4) with RANSAC's and ICP's fitness: the tutorial's global
    registration then point-to-plane ICP."""
    reg = o3d.pipelines.registration
    dist = RANSAC_DISTANCE * voxel
    o3d.utility.random.seed(SEED)
    ransac = reg.registration_ransac_based_on_feature_matching(
        model.cloud, scene.cloud, model.fpfh, scene.fpfh, False, dist,
        reg.TransformationEstimationPointToPoint(False), RANSAC_N,
        [reg.CorrespondenceCheckerBasedOnEdgeLength(EDGE_LENGTH), reg.CorrespondenceCheckerBasedOnDistance(dist)],
        reg.RANSACConvergenceCriteria(RANSAC_MAX_ITERATIONS, RANSAC_CONFIDENCE))
    icp = reg.registration_icp(model.cloud, scene.cloud, ICP_DISTANCE * voxel, ransac.transformation,
                               reg.TransformationEstimationPointToPlane())
    return np.asarray(icp.transformation, np.float64).copy(), float(ransac.fitness), float(icp.fitness)


@dataclass
class Found:
    """One pose per library model (the shape :func:`instance_errors` reads, like a detection)."""
    model_id: int
    pose: np.ndarray
    fitness: float


class Open3DRecognizer:
    """Open3D's pipeline over a library of models at one voxel size; model features built once."""

    def __init__(self, o3d, models: list[np.ndarray], voxel: float):
        self.o3d, self.voxel = o3d, float(voxel)
        t0 = time.perf_counter()
        self.models = [features(o3d, m, self.voxel) for m in models]
        self.model_seconds = time.perf_counter() - t0

    def recognize(self, scene_points: np.ndarray) -> tuple[list[Found], float]:
        """(one pose per model, seconds for the scene: its features + every model's registration)."""
        t0 = time.perf_counter()
        scene = features(self.o3d, scene_points, self.voxel)
        found = []
        for i, m in enumerate(self.models):
            pose, _, fit = register(self.o3d, m, scene, self.voxel)
            found.append(Found(i, pose, fit))
        return found, time.perf_counter() - t0


def instance_errors(detections, ground_truth, max_rotation_deg: float, max_translation: float):
    """Per ground-truth instance (``{"model_id", "pose"}``): ``(found, rotation error deg,
    translation error)`` of the detection of its model nearest in translation, (False, nan, nan)
    when there is none. The same rule for scanforest's detections and Open3D's poses."""
    from scanforest.kernels.recognition import pose_errors

    out = []
    for g in ground_truth:
        errs = [pose_errors(d.pose, g["pose"]) for d in detections if int(d.model_id) == int(g["model_id"])]
        if not errs:
            out.append((False, float("nan"), float("nan")))
            continue
        r, t = min(errs, key=lambda e: e[1])
        out.append((r <= max_rotation_deg and t <= max_translation, r, t))
    return out
