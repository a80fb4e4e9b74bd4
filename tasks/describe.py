"""Describe: one scan's points -> normals, keypoints, local reference frames, SHOT352 (idempotent).

Arrays written into the scan's group (``ScanStore.write_stage(scan, "describe", ...)``)::

    est_normals  (N, 3) float32   PCA normals (PCL conventions) of every point
    kp_index     (K,)   int64     keypoint indices into points (uniform sampling)
    kp_frames    (K, 3, 3) float32 local reference frames, rows = x, y, z axes (NaN if invalid)
    kp_shot      (K, 352) float32 SHOT352 descriptors (NaN rows where the frame is invalid)

The stage record holds the parameters, so asking again with the same parameters is a no-op and
with different ones recomputes.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scanforest.kernels.backend import resolve_device, to_host

from .store import ScanStore


@dataclass(frozen=True)
class DescribeParams:
    """Descriptor parameters; defaults are PCL's correspondence-grouping tutorial (metres)."""

    normal_k: int | None = 10            # PCL tutorial: NormalEstimationOMP.setKSearch(10)
    normal_radius: float | None = None   # use a radius instead of k
    keypoint_radius: float | None = 0.03  # uniform sampling leaf; None = every point
    shot_radius: float = 0.02
    approximate: bool = False            # G-SHOT approximate mode (capped neighbour lists)

    def __post_init__(self):
        """Refuse impossible values here, in the command's process, before a cluster starts."""
        from scanforest.kernels.errors import InputError

        if self.normal_radius is None and (self.normal_k is None or int(self.normal_k) < 3):
            raise InputError(f"--normal-k must be at least 3 (a plane needs 3 neighbours), got {self.normal_k}")
        for name in ("normal_radius", "keypoint_radius", "shot_radius"):
            v = getattr(self, name)
            if v is not None and not (float(v) > 0 and np.isfinite(v)):
                raise InputError(f"--{name.replace('_', '-')} must be a positive length, got {v}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe_cloud(points, params: DescribeParams, *, device: str = "auto") -> dict[str, Any]:
    """Normals, keypoints, frames and SHOT for one cloud; returns numpy arrays and phase timings."""
    from scanforest.kernels.descriptors.keypoints import keypoints
    from scanforest.kernels.descriptors.normals import normals
    from scanforest.kernels.descriptors.shot import shot

    dev = resolve_device(device) if device == "auto" else resolve_device(device, points)
    timings = {}
    t = time.perf_counter()
    if dev == "gpu":
        import cupy as cp

        pts = cp.asarray(points, dtype=cp.float32)
    else:
        pts = np.asarray(points, dtype=np.float32)
    if params.normal_radius is not None:
        nrm, _ = normals(pts, radius=params.normal_radius, device=dev)
    else:
        nrm, _ = normals(pts, k=params.normal_k, device=dev)
    timings["normals"] = time.perf_counter() - t
    t = time.perf_counter()
    kp = keypoints(pts, radius=params.keypoint_radius, device=dev)
    timings["keypoints"] = time.perf_counter() - t
    t = time.perf_counter()
    desc, frames = shot(pts, nrm, kp, params.shot_radius, approximate=params.approximate, device=dev)
    # pinned device-to-host copies (several times faster than pageable ones for SHOT's 1.4 kB rows)
    out = {"est_normals": to_host(nrm.astype(np.float32, copy=False)),
           "kp_index": to_host(kp.astype(np.int64, copy=False)),
           "kp_frames": to_host(frames.astype(np.float32, copy=False)),
           "kp_shot": to_host(desc.astype(np.float32, copy=False))}
    timings["shot"] = time.perf_counter() - t
    return {"arrays": out, "timings": timings, "device": dev}


def describe_scan(store_path: str, scan_id: str, params: DescribeParams, *, device: str = "auto",
                  force: bool = False) -> dict[str, Any]:
    """Describe one stored scan unless it already carries descriptors with these parameters."""
    t0 = time.perf_counter()
    store = ScanStore(store_path)
    if not force and store.has_stage(scan_id, "describe", **params.as_dict()):
        return {"scan_id": scan_id, "status": "skipped", "keypoints": 0, "seconds": time.perf_counter() - t0}
    pts = store.read(scan_id, "points")
    res = describe_cloud(pts, params, device=device)
    arrays = res["arrays"]
    n_valid = int(np.isfinite(arrays["kp_shot"][:, 0]).sum()) if len(arrays["kp_shot"]) else 0
    store.write_stage(scan_id, "describe", arrays,
                      {**params.as_dict(), "device": res["device"], "keypoints": int(len(arrays["kp_index"])),
                       "valid_descriptors": n_valid, "timings": res["timings"]})
    return {"scan_id": scan_id, "status": "described", "keypoints": int(len(arrays["kp_index"])),
            "valid": n_valid, "device": res["device"], "timings": res["timings"],
            "seconds": time.perf_counter() - t0}
