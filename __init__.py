"""scanforest: find known objects in large archives of 3-D scans, on GPU clusters.

The public API is small and is what the CLI, the Prefect flows and users all call::

    import numpy as np
    import scanforest as sf
    cloud = sf.read("scene.pcd")                       # PointCloud (points, normals, colour, ...)
    n, curv = sf.normals(cloud.points, radius=0.01)    # (N, 3) normals, (N,) curvature
    kp = sf.keypoints(cloud.points, radius=0.03)       # uniform-sampling keypoint indices
    desc, frames = sf.shot(cloud.points, n, kp, 0.02)  # SHOT352 + local reference frames
    desc = desc[np.isfinite(desc).all(axis=1)]         # NaN rows: keypoints without neighbours (PCL's rule)
    index = sf.KDForest(method="banns").fit(model_desc)
    dist, ids = index.query(desc, k=4)
    lib = sf.ModelLibrary.build([model_points], names=["milk"])
    detections = sf.recognize(scene_points, lib)
    result = sf.align(observed, reference, model="rigid")

Submodules: :mod:`scanforest.kernels` (pure array compute, CPU and GPU backends),
:mod:`scanforest.tasks` (Prefect tasks: store I/O around kernels), :mod:`scanforest.flows`
(Prefect flows on Dask clusters), :mod:`scanforest.deploy` (the operator's side: the CLI in
:mod:`scanforest.deploy.cli`, the benchmarks in :mod:`scanforest.deploy.bench`).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> (module, attribute); imported on first use so `import scanforest` stays fast and
# does not pull Prefect, Dask or CuPy in until they are needed.
_API = {
    "read": ("scanforest.tasks.readers", "read_cloud"),
    "PointCloud": ("scanforest.tasks.readers", "PointCloud"),
    "ScanStore": ("scanforest.tasks.store", "ScanStore"),
    "normals": ("scanforest.kernels.descriptors.normals", "normals"),
    "keypoints": ("scanforest.kernels.descriptors.keypoints", "keypoints"),
    "shot": ("scanforest.kernels.descriptors.shot", "shot"),
    "KDForest": ("scanforest.kernels.knn.kdforest", "KDForest"),
    "ShardedIndex": ("scanforest.kernels.knn.sharded", "ShardedIndex"),
    "knn_bruteforce": ("scanforest.kernels.knn.bruteforce", "knn_bruteforce"),
    "recall": ("scanforest.kernels.knn.bruteforce", "recall"),
    "match": ("scanforest.flows.distributed", "match"),
    "ModelLibrary": ("scanforest.kernels.recognition", "ModelLibrary"),
    "recognize": ("scanforest.kernels.recognition", "recognize"),
    "RecognizeParams": ("scanforest.kernels.recognition", "RecognizeParams"),
    "recognize_many": ("scanforest.kernels.recognition", "recognize_many"),
    "recognize_described": ("scanforest.kernels.recognition", "recognize_described"),
    "align": ("scanforest.kernels.align.pcha", "align"),
    "align_batch": ("scanforest.kernels.align.pcha", "align_batch"),
    "distance_transform": ("scanforest.kernels.align.edt", "distance_transform"),
    "synthetic": ("scanforest.kernels.synthetic.scenes", None),
    "ScanforestError": ("scanforest.kernels.errors", "ScanforestError"),
    "InputError": ("scanforest.kernels.errors", "InputError"),
    "ScanReadError": ("scanforest.kernels.errors", "ScanReadError"),
    "DeviceError": ("scanforest.kernels.errors", "DeviceError"),
    "OutOfMemory": ("scanforest.kernels.errors", "OutOfMemory"),
    "gpu_available": ("scanforest.kernels.backend", "gpu_available"),
}

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str):
    try:
        module, attr = _API[name]
    except KeyError:
        raise AttributeError(f"module 'scanforest' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return __all__
