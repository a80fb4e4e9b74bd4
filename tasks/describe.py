"""Describe: one scan's points -> normals, keypoints, local reference frames, SHOT352 (idempotent).

Arrays written into the scan's group (``ScanStore.write_stage(scan, "describe", ...)``)::

    est_normals  (N, 3) float32   PCA normals (PCL conventions) of every point (NaN: < 3 neighbours)
    kp_index     (K,)   int64     keypoint indices into points (uniform sampling of the points
                                  with a normal)
    kp_frames    (K, 3, 3) float32 local reference frames, rows = x, y, z axes (NaN if invalid)
    kp_shot      (K, 352) float32 SHOT352 descriptors (NaN rows where the frame is invalid)

Computed in the scan's local frame (its ``origin`` attribute, :func:`~.store.local_points`): the
arrays are frame-free (normals, indices, frames, descriptors) and the viewpoint is relative to it.

The stage record holds the parameters, so asking again with the same parameters is a no-op and
with different ones recomputes. The description is the one recognition uses, so the recognize
stage reads these arrays (and the match stage's) instead of describing the scene again when the
parameters are the ones it would use (:func:`scanforest.tasks.recognize.describe_params_for`).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scanforest.kernels.backend import Timer, resolve_device, to_host

from .store import ScanStore, scan_origin, stage_matches


@dataclass(frozen=True)
class DescribeParams:
    """Descriptor parameters; defaults are PCL's correspondence-grouping tutorial (metres)."""

    normal_k: int | None = 10            # PCL tutorial: NormalEstimationOMP.setKSearch(10)
    normal_radius: float | None = None   # use a radius instead of k
    keypoint_radius: float | None = 0.03  # uniform sampling leaf; None = every point
    shot_radius: float = 0.02
    approximate: bool = False            # G-SHOT approximate mode (capped neighbour lists)
    viewpoint: tuple | None = None       # normals face this point (relative to the scan's origin); None = it

    def __post_init__(self):
        """Refuse impossible values here, in the command's process, before a cluster starts."""
        from scanforest.kernels.errors import InputError

        if self.normal_radius is None and (self.normal_k is None or int(self.normal_k) < 3):
            raise InputError(f"--normal-k must be at least 3 (a plane needs 3 neighbours), got {self.normal_k}")
        for name in ("normal_radius", "keypoint_radius", "shot_radius"):
            v = getattr(self, name)
            if v is not None and not (float(v) > 0 and np.isfinite(v)):
                raise InputError(f"--{name.replace('_', '-')} must be a positive length, got {v}")
        if self.viewpoint is not None:
            try:
                vp = tuple(float(v) for v in np.asarray(self.viewpoint, np.float64).reshape(3))
            except (TypeError, ValueError):
                vp = None
            if vp is None or not all(np.isfinite(vp)):
                raise InputError(f"viewpoint must be 3 finite numbers, got {self.viewpoint!r}")
            # the origin is the default: one record for it, the one scans described before had
            object.__setattr__(self, "viewpoint", None if vp == (0.0, 0.0, 0.0) else vp)

    def as_dict(self) -> dict[str, Any]:
        """The parameters as the stage record holds them (``viewpoint`` only when it is not the
        origin, so records written before it existed still match)."""
        d = asdict(self)
        if d["viewpoint"] is None:
            del d["viewpoint"]
        return d

    @property
    def camera(self) -> tuple[float, float, float]:
        return (0.0, 0.0, 0.0) if self.viewpoint is None else tuple(self.viewpoint)


def describe_cloud(points, params: DescribeParams, *, origin=None, name: str = "points", device: str = "auto",
                   resident: bool = False) -> dict[str, Any]:
    """Normals, keypoints, frames and SHOT for one cloud; returns numpy arrays and phase timings
    (with ``resident``, also the description and the points as they are on the device, under
    ``"resident"`` and ``"points"``, for work that goes on there).

    The description is recognition's own (:func:`scanforest.kernels.recognition.describe`):
    points without a normal (fewer than 3 neighbours) are left out of keypoints and SHOT
    support, so a scene described here with the parameters recognition uses
    (:func:`scanforest.tasks.recognize.describe_params_for`) is recognised from these arrays
    exactly as :func:`~scanforest.kernels.recognition.recognize` would describe it.

    ``origin``: the scan's local origin (:func:`~.store.scan_origin`; None: ``[0, 0, 0]``): the
    description is computed on ``points - origin`` (subtracted in float64, then cast to float32),
    and the viewpoint is relative to it. Coordinates too coarse in float32 for the radii are an
    :class:`~scanforest.kernels.errors.InputError` naming ``name``
    (:func:`~scanforest.kernels.coordinates.check_spacing`)."""
    from scanforest.kernels.coordinates import check_spacing, is_zero, to_local
    from scanforest.kernels.recognition.library import describe

    dev = resolve_device(device) if device == "auto" else resolve_device(device, points)
    if not is_zero(origin):
        points = to_local(np.asarray(points), origin)  # on the host, in float64: the device gets float32
    if dev == "gpu":
        import cupy as cp

        pts = cp.asarray(points, dtype=cp.float32)
        xp = cp
    else:
        pts = np.asarray(points, dtype=np.float32)
        xp = np
    if int(pts.shape[0]):
        check_spacing(float(xp.abs(pts).max()), {"normal_radius": params.normal_radius,
                                                 "keypoint_radius": params.keypoint_radius,
                                                 "shot_radius": params.shot_radius}, name,
                      span=lambda: float((pts.max(axis=0) - pts.min(axis=0)).max()) / 2)
    timer = Timer(dev == "gpu")
    d = describe(pts, normal_k=params.normal_k, normal_radius=params.normal_radius,
                 keypoint_radius=params.keypoint_radius, descr_rad=params.shot_radius,
                 viewpoint=params.camera, approximate=params.approximate, device=dev, timer=timer)
    # pinned device-to-host copies (several times faster than pageable ones for SHOT's 1.4 kB rows)
    out = {"est_normals": to_host(d["normals"].astype(np.float32, copy=False)),
           "kp_index": to_host(d["keypoints"].astype(np.int64, copy=False)),
           "kp_frames": to_host(d["frames"].astype(np.float32, copy=False)),
           "kp_shot": to_host(d["descriptors"].astype(np.float32, copy=False))}
    timer.lap("shot")  # the copies count with SHOT, as before
    res = {"arrays": out, "timings": dict(timer.t), "device": dev}
    if resident:
        res.update(resident=d, points=pts)
    return res


def check_scan_spacing(store: ScanStore, scan_id: str, attrs: dict[str, Any], params: DescribeParams) -> None:
    """This scan's coordinates fine in float32 for the description's radii, a float32 file's own
    precision and a LAS file's grid included (:func:`~.store.scans.scan_extent`, ``scan_grid``): a run of many refuses only when all
    are not (:meth:`ScanStore.check_coordinates`), and each such scan fails here alone. ``attrs``:
    the scan's attributes, as the caller read them."""
    from scanforest.kernels.coordinates import check_spacing

    from .store.scans import scan_extent, scan_grid

    extent = scan_extent(attrs)
    if extent is not None:
        check_spacing(extent, {"normal_radius": params.normal_radius, "keypoint_radius": params.keypoint_radius,
                               "shot_radius": params.shot_radius}, f"{store.path}: scan {scan_id}",
                      grid=scan_grid(attrs))


def describe_scan(store_path: str, scan_id: str, params: DescribeParams, *, device: str = "auto",
                  force: bool = False, run: str | None = None) -> dict[str, Any]:
    """Describe one stored scan unless it already carries descriptors with these parameters.

    Under the scan's ``describe`` claim (:meth:`ScanStore.claim_stage`, not waited for): a scan
    that another run is describing right now is left to it (status ``held``), so two runs at once
    share the work. ``run`` (the flow run's id) goes into the stage record, so the flow counts as
    its own the scans it wrote, also those whose record a lost worker took with it."""
    from .units import after_claim, held

    t0 = time.perf_counter()
    store = ScanStore(store_path)

    def skipped() -> dict[str, Any]:
        return {"scan_id": scan_id, "status": "skipped", "keypoints": 0, "seconds": time.perf_counter() - t0}

    rec = store.stage(scan_id, "describe")
    if not force and stage_matches(rec, **params.as_dict()):
        return skipped()
    with store.claim_stage(scan_id, "describe") as mine:
        if not mine:
            return held(scan_id, t0, keypoints=0)
        rec = store.stage(scan_id, "describe")  # another run may have written it meanwhile
        if not force and stage_matches(rec, **params.as_dict()):
            return skipped()
        after_claim("describe", scan_id, run)
        meta = store.attrs(scan_id)
        check_scan_spacing(store, scan_id, meta, params)
        pts = store.read(scan_id, "points")
        res = describe_cloud(pts, params, origin=scan_origin(meta), name=f"scan {scan_id}",
                             device=device)
        arrays = res["arrays"]
        n_valid = int(np.isfinite(arrays["kp_shot"][:, 0]).sum()) if len(arrays["kp_shot"]) else 0
        store.write_stage(scan_id, "describe", arrays,
                          {**params.as_dict(), "device": res["device"], "keypoints": int(len(arrays["kp_index"])),
                           "valid_descriptors": n_valid, "timings": res["timings"], **({"run": run} if run else {})})
    return {"scan_id": scan_id, "status": "described", "keypoints": int(len(arrays["kp_index"])),
            "valid": n_valid, "device": res["device"], "timings": res["timings"],
            "seconds": time.perf_counter() - t0}
