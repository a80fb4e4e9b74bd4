"""Recognition over the store: a model library persisted once, scenes recognised one by one
(idempotent), detections written into each scene's group.

Layout::

    STORE/libraries/<name>/          the ModelLibrary arrays (points, keypoints, SHOT, frames, ...)
        attrs: names, params, model_scans, content_hash, complete
    STORE/scans/<scene>/
        det_model    (D,)      int32    library model id of each detection
        det_pose     (D, 4, 4) float64  model -> scene
        det_score    (D,)      float32  verified inlier fraction
        det_inliers  (D,)      int32
        attrs.stages.recognize: library, content_hash, params, detections [...], timings, evaluation
"""
from __future__ import annotations

import functools
import hashlib
import json
import time
from typing import Any

import numpy as np

from scanforest.kernels.errors import InputError

from .store import ScanStore, _jsonable

LIBRARY_KEYS = ("model_ss", "descr_rad", "rf_rad", "normal_k", "normal_radius", "verify_leaf", "views")


def build_library(store_path: str, model_scans: list[str], *, name: str = "default",
                  params: dict[str, Any] | None = None, device: str = "auto") -> dict[str, Any]:
    """Describe the model scans and persist them as library ``name`` (no-op when unchanged)."""
    from scanforest.kernels.recognition import ModelLibrary

    st = ScanStore(store_path)
    params = {k: v for k, v in (params or {}).items() if k in LIBRARY_KEYS and v is not None}
    if not model_scans:
        raise InputError("no model scans given for the library")
    h = hashlib.sha256(json.dumps(_jsonable(params), sort_keys=True).encode())
    for s in model_scans:
        h.update(f"{s}:{st.attrs(s).get('sha256', '')}".encode())
    digest = h.hexdigest()
    libs = st.root.require_group("libraries")
    if name in libs and libs[name].attrs.get("complete") and libs[name].attrs.get("content_hash") == digest:
        return {"name": name, "status": "unchanged", "content_hash": digest, "models": len(model_scans)}
    t0 = time.perf_counter()
    pts, nrm = [], []
    for s in model_scans:
        cloud = st.read_cloud(s)
        pts.append(cloud.points.astype(np.float32))
        nrm.append(cloud.normals)
    lib = ModelLibrary.build(pts, names=list(model_scans),
                             models_normals=nrm if all(n is not None for n in nrm) else None,
                             device=device, **params)
    arrays, attrs = lib.to_arrays()
    if name in libs:
        del libs[name]
    g = libs.create_group(name)
    g.attrs.update({"complete": False})
    for k, a in arrays.items():
        st._write_array(g, k, np.asarray(a))
    g.attrs.update({**_jsonable(attrs), "model_scans": list(model_scans), "content_hash": digest,
                    "build_params": _jsonable(params), "complete": True})
    _load_library_cached.cache_clear()
    return {"name": name, "status": "built", "content_hash": digest, "models": len(model_scans),
            "reference_descriptors": int(len(lib.descriptors)), "seconds": time.perf_counter() - t0}


def library_hash(store_path: str, name: str) -> str:
    st = ScanStore(store_path, mode="r")
    libs = st.root["libraries"] if "libraries" in st.root else None
    if libs is None or name not in libs or not libs[name].attrs.get("complete"):
        raise InputError(f"{store_path}: no complete model library {name!r} (build it first)")
    return libs[name].attrs["content_hash"]


@functools.lru_cache(maxsize=4)
def _load_library_cached(store_path: str, name: str, digest: str):
    from scanforest.kernels.recognition import ModelLibrary

    g = ScanStore(store_path, mode="r").root["libraries"][name]
    arrays = {k: g[k][...] for k in g.array_keys()}
    return ModelLibrary.from_arrays(arrays, dict(g.attrs))


def load_library(store_path: str, name: str):
    """The library, loaded once per worker process (cached by content hash)."""
    return _load_library_cached(store_path, name, library_hash(store_path, name))


def recognize_scan(store_path: str, scan_id: str, library: str, params: dict[str, Any], *,
                   device: str = "auto", force: bool = False) -> dict[str, Any]:
    """Recognise the library's models in one stored scene; writes the detections (skips when done)."""
    from scanforest.kernels.backend import resolve_device
    from scanforest.kernels.recognition import evaluate, recognize

    t0 = time.perf_counter()
    st = ScanStore(store_path)
    digest = library_hash(store_path, library)
    key = {"library": library, "content_hash": digest, "params": _jsonable(params)}
    if not force and st.has_stage(scan_id, "recognize", **key):
        rec = st.attrs(scan_id)["stages"]["recognize"]
        return {"scan_id": scan_id, "status": "skipped", "detections": len(rec.get("detections", [])),
                "evaluation": rec.get("evaluation"), "seconds": time.perf_counter() - t0}
    lib = load_library(store_path, library)
    cloud = st.read_cloud(scan_id)
    dev = resolve_device(device)
    t_io = time.perf_counter() - t0
    dets = recognize(cloud.points.astype(np.float32), lib, device=dev, **params)
    n = len(dets)
    arrays = {
        "det_model": np.array([d.model_id for d in dets], np.int32),
        "det_pose": np.array([d.pose for d in dets], np.float64).reshape(n, 4, 4),
        "det_score": np.array([d.score for d in dets], np.float32),
        "det_inliers": np.array([d.inliers for d in dets], np.int32),
    }
    evaluation = None
    gt = cloud.meta.get("ground_truth")
    if gt is not None:
        # ground truth ids refer to the synthetic library order; map them through the model names
        name_to_id = {n.split("__")[-1].rsplit(".", 1)[0]: i for i, n in enumerate(lib.names)}
        truth = [{"model_id": name_to_id.get(g.get("model"), g["model_id"]), "pose": g["pose"]} for g in gt]
        res = float(np.median(lib.resolutions))
        ev = evaluate(dets, truth, max_translation=10 * res)
        evaluation = {k: ev[k] for k in ("tp", "fp", "fn")}
        evaluation.update(rotation_errors=ev["rotation_errors"], translation_errors=ev["translation_errors"],
                          resolution=res)
    timings = dict(getattr(dets, "timings", {}) or {})
    timings["io"] = t_io
    st.write_stage(scan_id, "recognize", arrays,
                   {**key, "detections": [d.as_dict() | {"model_name": d.model} for d in dets],
                    "timings": timings, "evaluation": evaluation, "device": dev,
                    "seconds": time.perf_counter() - t0})
    return {"scan_id": scan_id, "status": "recognized", "detections": n, "evaluation": evaluation,
            "timings": timings, "seconds": time.perf_counter() - t0}


def detections_table(store_path: str, scans: list[str] | None = None):
    """All stored detections as a pandas DataFrame (one row per detection)."""
    import pandas as pd

    st = ScanStore(store_path, mode="r")
    rows = []
    for sid in scans or st.scans():
        rec = st.attrs(sid).get("stages", {}).get("recognize")
        if rec is None:
            continue
        for j, d in enumerate(rec.get("detections", [])):
            pose = np.asarray(d["pose"], np.float64)
            rows.append({"scan_id": sid, "detection": j, "model_id": d["model_id"], "model": d.get("model_name", d["model"]),
                         "score": d["score"], "inliers": d["inliers"], "correspondences": d.get("correspondences"),
                         **{f"pose_{r}{c}": pose[r, c] for r in range(3) for c in range(4)},
                         "scene_seconds": rec.get("seconds"), "library": rec.get("library")})
    return pd.DataFrame(rows)
