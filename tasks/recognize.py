"""Recognition over the store: a model library persisted once, scenes recognised one by one
(idempotent), detections written into each scene's group.

Layout::

    STORE/libraries/<name>/          the ModelLibrary arrays (points, keypoints, SHOT, frames, ...)
        attrs: names, params, model_scans, content_hash, complete
    STORE/scans/<scene>/
        det_model    (D,)      int32    library model id of each detection
        det_pose     (D, 4, 4) float64  model -> scene, in the scene file's own coordinates
        det_score    (D,)      float32  verified inlier fraction
        det_inliers  (D,)      int32
        attrs.stages.recognize: library, content_hash, params, inputs, source, reason,
                                detections [...], timings, evaluation

One pipeline: a scene that the describe stage described with the parameters recognition uses
(:func:`describe_params_for`) and the match stage matched against an index built over this
library (``library build`` makes the library and that index, :func:`library_index_name`;
``match --library``; or ``index build --library``; with enough neighbours) is recognised from
those stored arrays (``source: "stored"``): no second description, no second brute-force match.
``recognize`` on the command line uses a stored library as it was built
(:func:`resolve_library`), so the index over it stays current. Any other
scene is described and matched here as :func:`~scanforest.kernels.recognition.recognize` does
(``source: "recomputed"``, with the reason). The stage's key holds the identities of the describe
and match records it used (``inputs``), so a scene described or matched again is recognised
again.

Every scene is recognised in its local frame (its ``origin``: :func:`~.store.local_points`; the
viewpoint is relative to it) and its detections' poses are stored in the scene file's own
coordinates (translation plus origin, float64), as exports and renders show them. A model scan
enters the library in its own local frame (its origin 0 unless its coordinates are
georeferenced).
"""
from __future__ import annotations

import functools
import hashlib
import json
import time
from typing import Any

import numpy as np

from scanforest.kernels.errors import InputError

from .store import ScanStore, _jsonable, local_points, scan_grid, scan_origin, stage_digest, stage_matches
from .store.catalog import warm

LIBRARY_KEYS = ("model_ss", "descr_rad", "rf_rad", "normal_k", "normal_radius", "verify_leaf", "views", "voxel")

#: the library parameters that ``library build`` and ``recognize`` use when none are given and the
#: store has no library of that name yet (PCL's correspondence-grouping tutorial)
LIBRARY_DEFAULTS = {"model_ss": 0.01, "descr_rad": 0.02, "rf_rad": 0.015}


def _library_params(params: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (params or {}).items() if k in LIBRARY_KEYS and v is not None}


def library_digest(st: ScanStore, model_scans: list[str], params: dict[str, Any] | None) -> str:
    """The content hash a library of ``model_scans`` (in this order) with ``params`` gets: the
    parameters and each model scan's id and sha256. Equal digests: the same library."""
    h = hashlib.sha256(json.dumps(_jsonable(_library_params(params)), sort_keys=True).encode())
    for s in model_scans:
        h.update(f"{s}:{st.attrs(s).get('sha256', '')}".encode())
    return h.hexdigest()


def library_current(store_path: str, model_scans: list[str], name: str, params: dict[str, Any] | None) -> bool:
    """Whether the stored library ``name`` is complete and what :func:`build_library` with these
    arguments would build (it would then be a no-op). Reads attributes only."""
    st = ScanStore(store_path, mode="r")
    stored = st.catalog.find_library(name)
    return stored is not None and stored.get("content_hash") == library_digest(st, model_scans, params)


def resolve_library(store_path: str, name: str, model_scans: list[str] | None,
                    given: dict[str, Any] | None) -> tuple[list[str], dict[str, Any]]:
    """The model scans and library parameters of a ``recognize`` run on library ``name``.

    ``model_scans`` None: the stored library's models (a user error when there is none). The
    parameters not ``given`` (None) are the stored library's (``build_params``), or
    :data:`LIBRARY_DEFAULTS` when the store has no such library: a library that ``library build``
    made is used as it is, not rebuilt with other parameters, so its index and the matches
    against it stay current."""
    stored = ScanStore(store_path, mode="r").catalog.find_library(name)
    if model_scans is None:
        if stored is None:
            raise InputError(f"{store_path}: no --models given and no model library {name!r} to take them from "
                             f"(build one: scanforest library build STORE -m PATTERN --name {name})")
        model_scans = list(stored.get("model_scans") or [])
    base = dict(stored.get("build_params", LIBRARY_DEFAULTS)) if stored is not None else dict(LIBRARY_DEFAULTS)
    base.update({k: v for k, v in (given or {}).items() if v is not None})
    return list(model_scans), _library_params(base)


def library_index_name(name: str) -> str:
    """The name of the index that ``library build`` makes over library ``name``."""
    return f"library-{name}"


def library_index(store_path: str, name: str) -> str:
    """The index built over library ``name`` as it is now (``library build``'s, else any other
    such index, e.g. the archive flow's), for ``match --library``; a user error when none is."""
    cat = ScanStore(store_path, mode="r").catalog
    want = {"name": name, "content_hash": cat.library_attrs(name).get("content_hash")}
    own = library_index_name(name)
    for ix in [own] + [k for k in cat.indexes() if k != own]:
        found = cat.find_index(ix)
        if found is not None and found.get("library") == want:
            return ix
    raise InputError(f"{store_path}: no index over model library {name!r} as it is now (build it: "
                     f"scanforest library build STORE -m PATTERN --name {name})")


def build_library(store_path: str, model_scans: list[str], *, name: str = "default",
                  params: dict[str, Any] | None = None, device: str = "auto") -> dict[str, Any]:
    """Describe the model scans and persist them as library ``name`` (no-op when unchanged)."""
    from scanforest.kernels.coordinates import check_spacing
    from scanforest.kernels.recognition import ModelLibrary

    st = ScanStore(store_path)
    params = _library_params(params)
    if not model_scans:
        raise InputError("no model scans given for the library")
    digest = library_digest(st, model_scans, params)
    stored = st.catalog.find_library(name)
    if stored is not None and stored.get("content_hash") == digest:
        return {"name": name, "status": "unchanged", "content_hash": digest, "models": len(model_scans)}
    t0 = time.perf_counter()
    pts, nrm = [], []
    used = {**LIBRARY_DEFAULTS, **params}  # the radii the library will use
    radii = {k: used.get(k) for k in ("model_ss", "descr_rad", "rf_rad", "normal_radius")}
    for s in model_scans:
        cloud = st.read_cloud(s)
        pts.append(local_points(cloud.points, cloud.meta))
        if len(pts[-1]):
            check_spacing(float(np.abs(pts[-1]).max()), radii,
                          f"model scan {s}", span=lambda p=pts[-1]: float((p.max(axis=0) - p.min(axis=0)).max()) / 2,
                          grid=scan_grid(cloud.meta))
        nrm.append(cloud.normals)
    lib = ModelLibrary.build(pts, names=list(model_scans),
                             models_normals=nrm if all(n is not None for n in nrm) else None,
                             device=device, **params)
    arrays, attrs = lib.to_arrays()
    with st.catalog.new_library(name) as g:  # in place of the old one once whole
        for k, a in arrays.items():
            st._write_array(g, k, np.asarray(a))
        g.attrs.update({**_jsonable(attrs), "model_scans": list(model_scans), "content_hash": digest,
                        "build_params": _jsonable(params), "complete": True})
    _load_library_cached.cache_clear()
    return {"name": name, "status": "built", "content_hash": digest, "models": len(model_scans),
            "reference_descriptors": int(len(lib.descriptors)), "seconds": time.perf_counter() - t0}


def library_hash(store_path: str, name: str) -> str:
    """The content hash of the complete library ``name`` (:meth:`Catalog.library_attrs
    <scanforest.tasks.store.catalog.Catalog.library_attrs>`)."""
    return ScanStore(store_path, mode="r").catalog.library_attrs(name)["content_hash"]


def _library_descr_rad(library_params: dict[str, Any] | None) -> float:
    """The library's SHOT radius (``ModelLibrary.build``'s default when not given), the radius
    recognition describes scenes with unless its ``descr_rad`` says otherwise."""
    import inspect

    from scanforest.kernels.recognition import ModelLibrary

    v = (library_params or {}).get("descr_rad")
    return float(inspect.signature(ModelLibrary.build).parameters["descr_rad"].default if v is None else v)


def describe_params_for(recognize_params: dict[str, Any] | None, library_params: dict[str, Any] | None):
    """The :class:`~scanforest.tasks.describe.DescribeParams` of the description recognition makes
    of a scene with these recognition parameters (a dict of ``RecognizeParams`` fields) and a
    library with these parameters (its ``params``, or the ones it is built with): normals as
    ``normal_k``/``normal_radius`` towards ``viewpoint``, keypoints at ``scene_ss``, SHOT at
    ``descr_rad`` (default: the library's), exact. A scene described with them is recognised
    from its stored description."""
    from scanforest.kernels.recognition import RecognizeParams

    from .describe import DescribeParams

    p = RecognizeParams().replace(**(recognize_params or {}))
    descr_rad = float(p.descr_rad) if p.descr_rad is not None else _library_descr_rad(library_params)
    return DescribeParams(normal_k=None if p.normal_radius else int(p.normal_k),
                          normal_radius=float(p.normal_radius) if p.normal_radius else None,
                          keypoint_radius=float(p.scene_ss), shot_radius=descr_rad, approximate=False,
                          viewpoint=p.viewpoint)


def description_key(rec: dict[str, Any]) -> dict[str, Any]:
    """What a describe record's (or ``DescribeParams.as_dict()``) parameters compute, in a form that
    compares equal exactly when two descriptions are the same (normals by radius or by k)."""
    r = rec.get("normal_radius")
    kr = rec.get("keypoint_radius")
    return {"normals": f"radius {float(r)}" if r else f"k {rec.get('normal_k')}",
            "keypoint_radius": None if kr is None else float(kr),
            "shot_radius": float(rec.get("shot_radius")),
            "approximate": bool(rec.get("approximate", False)),
            "viewpoint": [float(v) for v in (rec.get("viewpoint") or (0.0, 0.0, 0.0))]}


def stored_inputs(st: ScanStore, scan_id: str, library: str, lib_attrs: dict[str, Any],
                  params: dict[str, Any] | None, *, scan_attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Whether the scan's stored description and matches are what recognition with ``params``
    against the library (``lib_attrs``) would compute. Reads stage records and attributes only
    (``scan_attrs``: the scan's attributes when the caller has read them already).

    Returns ``{"fits": bool, "reason": why not (or None), "describe": digest of the describe
    record, "match": digest of the match record}``."""
    from scanforest.kernels.recognition import RecognizeParams

    p = RecognizeParams().replace(**(params or {}))

    def unfit(reason: str) -> dict[str, Any]:
        return {"fits": False, "reason": reason, "describe": None, "match": None}

    if p.scene_voxel is not None:
        return unfit(f"recognition thins the scene (scene_voxel {p.scene_voxel:g}): the stored description is "
                     "of every point")
    if scan_attrs is None:
        scan_attrs = st.attrs(scan_id)
    stages = scan_attrs.get("stages", {})
    drec = stages.get("describe")
    if drec is None:
        return unfit("the scan is not described")
    want = description_key(describe_params_for(params, lib_attrs.get("params")).as_dict())
    have = description_key(drec)
    diff = [f"{k} {have[k]} (recognition: {want[k]})" for k in want if have[k] != want[k]]
    if diff:
        return unfit("described with other parameters: " + ", ".join(diff))
    n_points = (scan_attrs.get("arrays", {}).get("points") or {}).get("shape", [None])[0]
    d_arrays = drec.get("arrays", {})
    if (d_arrays.get("est_normals") or {}).get("shape", [None])[0] != n_points:
        return unfit("the description does not cover the scan's points")
    mrec = stages.get("match")
    if mrec is None:
        return unfit("the scan is not matched")
    d_digest = stage_digest(drec)
    if mrec.get("describe") != d_digest:
        return unfit("the matches are older than the description (the scan was described again)")
    name = mrec.get("index")
    try:
        iattrs = st.catalog.index_attrs(name)
    except InputError:
        return unfit(f"index {name!r} of the matches is gone")
    src = iattrs.get("library") or {}
    if src.get("name") != library or src.get("content_hash") != lib_attrs.get("content_hash"):
        return unfit(f"matched against index {name!r}, which is not built over this library "
                     f"({library!r} as it is now; `scanforest library build` builds its index and "
                     f"`scanforest match --library {library}` matches against it)")
    if iattrs.get("content_hash") != mrec.get("content_hash"):
        return unfit(f"index {name!r} was rebuilt since the scan was matched")
    need = int(p.match_k) + (1 if p.ratio is not None else 0)
    if int(mrec.get("k", 0)) < need:
        return unfit(f"matched with k={mrec.get('k')}; recognition needs {need} neighbours")
    rows = (mrec.get("arrays", {}).get("match_ids") or {}).get("shape", [None])[0]
    if rows != (d_arrays.get("kp_shot") or {}).get("shape", [None])[0]:
        return unfit("the matches do not cover the scan's descriptors")
    return {"fits": True, "reason": None, "describe": d_digest, "match": stage_digest(mrec)}


@warm(maxsize=4)
def _load_library_cached(st: ScanStore, name: str, digest: str):
    """Library ``name`` of the opened store ``st`` as a ModelLibrary, loaded once per worker
    process (cached by the store's path, the name and the content hash ``digest``)."""
    from scanforest.kernels.recognition import ModelLibrary

    return ModelLibrary.from_arrays(st.catalog.library_arrays(name), st.catalog.find_library(name, complete=False))


def load_library(store_path: str, name: str):
    """The library, loaded once per worker process (cached by content hash)."""
    st = ScanStore(store_path, mode="r")
    return _load_library_cached(st, name, st.catalog.library_attrs(name)["content_hash"])


@functools.lru_cache(maxsize=1)
def _recognize_defaults() -> dict[str, Any]:
    from dataclasses import fields

    from scanforest.kernels.recognition import RecognizeParams

    default = RecognizeParams()
    return {f.name: _jsonable(getattr(default, f.name)) for f in fields(RecognizeParams)}


def _nondefault(params: dict[str, Any] | None) -> dict[str, Any]:
    """Recognition parameters less those that equal :class:`RecognizeParams`' defaults (and
    None): the same recognition whether a default is left out (the API) or given (the command
    line passes its options' defaults), so one does not redo the other's scenes."""
    default = _recognize_defaults()  # once per process: this runs for every scene of a pass
    return {k: v for k, v in _jsonable(dict(params or {})).items() if v is not None and default.get(k, object()) != v}


def recognition_current(record: dict[str, Any] | None, key: dict[str, Any]) -> bool:
    """Whether a scene's ``recognize`` record holds :func:`recognition_key`'s ``key``, the
    parameters compared less their defaults (:func:`_nondefault`)."""
    return (record is not None and _nondefault(record.get("params")) == _nondefault(key["params"])
            and stage_matches(record, **{k: v for k, v in key.items() if k != "params"}))


def recognition_key(library: str, digest: str, params: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """What a scene's ``recognize`` record must hold for its detections to be current: the
    library and its content hash, the parameters, and (from the stored description and matches:
    ``plan`` of :func:`stored_inputs`) their digests."""
    return {"library": library, "content_hash": digest, "params": _jsonable(params),
            "inputs": {"describe": plan["describe"], "match": plan["match"]} if plan["fits"] else None}


def recognize_scan(store_path: str, scan_id: str, library: str, params: dict[str, Any], *,
                   device: str = "auto", force: bool = False, run: str | None = None) -> dict[str, Any]:
    """Recognise the library's models in one stored scene; writes the detections (skips when done).

    From the scene's stored description and matches when they fit (:func:`stored_inputs`),
    otherwise by describing and matching it here (the record's ``source`` and ``reason`` say
    which and why). Under the scene's ``recognize`` claim (:meth:`ScanStore.claim_stage`, not
    waited for): a scene another run is recognising right now is left to it (status ``held``).
    ``run`` (the flow run's id) goes into the stage record."""
    from scanforest.kernels.backend import resolve_device

    from .units import after_claim, held

    t0 = time.perf_counter()
    st = ScanStore(store_path)
    lib_attrs = st.catalog.library_attrs(library)
    digest = lib_attrs["content_hash"]
    meta = st.attrs(scan_id)  # read once: the stage records below all come from it
    plan = stored_inputs(st, scan_id, library, lib_attrs, params, scan_attrs=meta)
    key = recognition_key(library, digest, params, plan)
    rec = meta.get("stages", {}).get("recognize")

    def skipped(rec: dict[str, Any]) -> dict[str, Any]:
        return {"scan_id": scan_id, "status": "skipped", "detections": len(rec.get("detections", [])),
                "evaluation": rec.get("evaluation"), "source": rec.get("source"),
                "seconds": time.perf_counter() - t0}

    if not force and recognition_current(rec, key):
        return skipped(rec)
    with st.claim_stage(scan_id, "recognize") as mine:
        if not mine:
            return held(scan_id, t0, detections=0)
        rec = st.stage(scan_id, "recognize")  # another run may have written it meanwhile
        if not force and recognition_current(rec, key):
            return skipped(rec)
        after_claim("recognize", scan_id, run)
        return _recognize_claimed(st, scan_id, library, params, digest, meta, plan, key,
                                  resolve_device(device), t0, run)


def _recognize_claimed(st: ScanStore, scan_id: str, library: str, params: dict[str, Any], digest: str,
                       meta: dict[str, Any], plan: dict[str, Any], key: dict[str, Any], dev: str, t0: float,
                       run: str | None) -> dict[str, Any]:
    """:func:`recognize_scan`'s work on a scene whose claim it holds: recognise (in the scene's
    local frame), write (poses in the file's coordinates), report."""
    from scanforest.kernels.coordinates import ZERO
    from scanforest.kernels.recognition import recognize

    lib = _load_library_cached(st, library, digest)
    if plan["fits"]:
        scene = _stored_scene(st, scan_id, lib, params, meta)
        t_io = time.perf_counter() - t0
        dets = _recognize_stored(scene, lib, params, dev)
        dets.timings["matching"] = dets.timings.get("matching", 0.0) + scene["seconds"]
    else:
        pts = local_points(st.read(scan_id, "points"), meta)
        t_io = time.perf_counter() - t0
        dets = recognize(pts, lib, origin=ZERO, device=dev, **params)
    in_file_frame(dets, scan_origin(meta))
    n = len(dets)
    arrays = {
        "det_model": np.array([d.model_id for d in dets], np.int32),
        "det_pose": np.array([d.pose for d in dets], np.float64).reshape(n, 4, 4),
        "det_score": np.array([d.score for d in dets], np.float32),
        "det_inliers": np.array([d.inliers for d in dets], np.int32),
    }
    evaluation = _evaluate(dets, meta.get("ground_truth"), lib)
    timings = dict(getattr(dets, "timings", {}) or {})
    timings["io"] = t_io
    source = "stored" if plan["fits"] else "recomputed"
    st.write_stage(scan_id, "recognize", arrays,
                   {**key, "source": source, "reason": plan["reason"],
                    "detections": [d.as_dict() | {"model_name": d.model} for d in dets],
                    "timings": timings, "evaluation": evaluation, "device": dev,
                    "seconds": time.perf_counter() - t0, **({"run": run} if run else {})})
    out = {"scan_id": scan_id, "status": "recognized", "detections": n, "evaluation": evaluation,
           "source": source, "reason": plan["reason"], "timings": timings, "funnel": funnel(dets),
           "seconds": time.perf_counter() - t0}
    if box_origin(meta, params):
        out["box_origin"] = True
    return out


def funnel(dets) -> dict[str, Any]:
    """How far a scene's recognition got: its keypoints, their correspondences with the library,
    the hypotheses grouped from them, the best first verification score among those (the share
    of a model's visible points that a hypothesis explains), and the detections."""
    info = getattr(dets, "info", None) or {}
    scores = [s for s in info.get("hypothesis_scores") or () if s == s]
    return {"keypoints": int(info.get("scene_keypoints", 0)), "correspondences": int(info.get("correspondences", 0)),
            "hypotheses": int(info.get("hypotheses", 0)), "best_score": max(scores) if scores else None,
            "detections": len(dets)}


#: formats whose files can hold an offset (the LAS header's): elsewhere an origin was chosen
#: from the bounding box or given by a sidecar
OFFSET_FORMATS = frozenset({"las", "laz", "copc"})


def box_origin(meta: dict, params: dict) -> bool:
    """Whether a scan is georeferenced with no file offset (ingest chose its origin from its
    bounding box: ``origin_from`` "box") and no viewpoint was given: its normals face the box's
    centre, not the scanner, and the summary says so. A scan ingested before ``origin_from``
    existed counts when its format holds no offset and its origin is not 0."""
    if (params or {}).get("viewpoint"):
        return False
    if "origin_from" in meta:
        return meta["origin_from"] == "box"
    return meta.get("format") not in OFFSET_FORMATS and any(float(v) for v in meta.get("origin") or ())


def in_file_frame(dets, origin):
    """The detections (recognised in a scan's local frame) with their poses in the scan file's
    own coordinates: translation plus the scan's ``origin`` (float64); in place, returned."""
    from scanforest.kernels.coordinates import is_zero, pose_to_global

    if not is_zero(origin):
        for d in dets:
            d.pose = pose_to_global(d.pose, origin)
    return dets


def _stored_scene(st: ScanStore, scan_id: str, lib, params: dict[str, Any],
                  meta: dict[str, Any]) -> dict[str, Any]:
    """The scene as the describe and match stages stored it (:func:`scene_from_matches`). The
    points are the stored ones in the scan's local frame (``meta``: its attributes), as float32:
    exactly what the describe stage described."""
    from scanforest.kernels.recognition import RecognizeParams

    p = RecognizeParams().replace(**(params or {}))
    names = ["points", "est_normals", "kp_index", "match_ids", "match_dist"]
    if p.method == "hough":
        names.append("kp_frames")
    a = st.read_many(scan_id, names)
    return scene_from_matches(local_points(a["points"], meta), a["est_normals"], a["kp_index"],
                              a.get("kp_frames"), a["match_ids"], a["match_dist"], lib, params)


def scene_from_matches(points, normals, keypoints, frames, ids, dist, lib, params: dict[str, Any]) -> dict[str, Any]:
    """A described scene and its correspondences from the match stage's top-P of every keypoint
    (``from_neighbours``: the filters of ``match``), as :func:`_recognize_stored` takes it;
    ``seconds``: the time of the filtering. Rows the match stage did not search (a NaN
    descriptor) have id -1, which ``from_neighbours`` skips, so the descriptors are not needed."""
    from scanforest.kernels.recognition import RecognizeParams, from_neighbours

    p = RecognizeParams().replace(**(params or {}))
    t = time.perf_counter()
    corr = from_neighbours(np.arange(len(ids)), dist, ids, lib, k=p.match_k, max_dist2=p.max_dist2, ratio=p.ratio)
    return {"points": points, "normals": normals, "keypoints": keypoints, "frames": frames,
            "correspondences": corr, "seconds": time.perf_counter() - t}


def _recognize_stored(scene: dict[str, Any], lib, params: dict[str, Any], dev: str):
    """Grouping, verification and refinement of a stored scene (``recognize_described``) in its
    local frame (the poses too: :func:`in_file_frame` takes them to the file's coordinates);
    Hough's frames are the stored SHOT frames when its radius is SHOT's (as ``recognize`` takes
    them)."""
    from scanforest.kernels.recognition import recognize_described

    a = _described_args(scene, lib, params)
    return recognize_described(a.pop("scene_points"), lib, device=dev, **a, **params)


def _recognize_stored_many(scenes: list[dict[str, Any]], lib, params: dict[str, Any], dev: str) -> list:
    """:func:`_recognize_stored` of many scenes (``recognize_described_many``: their grouping in
    one go on the GPU), the same detections."""
    from scanforest.kernels.recognition import recognize_described_many

    return recognize_described_many([_described_args(s, lib, params) for s in scenes], lib, device=dev, **params)


def _described_args(scene: dict[str, Any], lib, params: dict[str, Any]) -> dict[str, Any]:
    from scanforest.kernels.recognition import RecognizeParams

    p = RecognizeParams().replace(**(params or {}))
    descr_rad = float(p.descr_rad) if p.descr_rad is not None else _library_descr_rad(lib.params)
    rf_rad = float(lib.params.get("rf_rad", 0.015) if p.rf_rad is None else p.rf_rad)
    rf = scene["frames"] if p.method == "hough" and abs(rf_rad - descr_rad) < 1e-12 else None
    return {"scene_points": scene["points"], "normals": scene["normals"], "keypoints": scene["keypoints"],
            "rf": rf, "correspondences": scene["correspondences"], "origin": (0.0, 0.0, 0.0)}


def _evaluate(dets, gt, lib) -> dict[str, Any] | None:
    """tp/fp/fn and pose errors against a synthetic scene's ground truth (None without one)."""
    from scanforest.kernels.recognition import evaluate

    if gt is None:
        return None
    # ground truth ids refer to the synthetic library order; map them through the model names
    name_to_id = {n.split("__")[-1].rsplit(".", 1)[0]: i for i, n in enumerate(lib.names)}
    truth = [{"model_id": name_to_id.get(g.get("model"), g["model_id"]), "pose": g["pose"]} for g in gt]
    res = float(np.median(lib.resolutions))
    ev = evaluate(dets, truth, max_translation=10 * res)
    evaluation = {k: ev[k] for k in ("tp", "fp", "fn")}
    evaluation.update(rotation_errors=ev["rotation_errors"], translation_errors=ev["translation_errors"],
                      resolution=res)
    return evaluation


def detections_table(store_path: str, scans: list[str] | None = None):
    """All stored detections as a pandas DataFrame (one row per detection), each with the file
    it came from (``source``) and its pose (``pose_RC``) in that file's coordinates: for a scan of
    a multi-scan E57 file, in the file's common frame (the scan's stored ``pose`` applied: the
    two stations' detections of one object were exported at one and the same pose, each in its
    own scan's frame)."""
    import pandas as pd

    st = ScanStore(store_path, mode="r")
    rows = []
    for sid in scans or st.scans():
        meta = st.attrs(sid)
        rec = meta.get("stages", {}).get("recognize")
        if rec is None:
            continue
        scan_pose = np.asarray(meta.get("pose", np.eye(4)), np.float64)  # the scan's frame -> the file's
        for j, d in enumerate(rec.get("detections", [])):
            pose = scan_pose @ np.asarray(d["pose"], np.float64)
            rows.append({"scan_id": sid, "source": meta.get("source"), "detection": j, "model_id": d["model_id"],
                         "model": d.get("model_name", d["model"]),
                         "score": d["score"], "inliers": d["inliers"], "correspondences": d.get("correspondences"),
                         **{f"pose_{r}{c}": pose[r, c] for r in range(3) for c in range(4)},
                         "scene_seconds": rec.get("seconds"), "library": rec.get("library")})
    return pd.DataFrame(rows)
