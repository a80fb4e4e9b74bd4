"""The archive's one pass: a batch of scans described, matched and recognised on one worker, the
scan's data resident on its device from the upload of its points to its detections.

The three stages write what they write when run one by one (``describe``: normals, keypoints,
frames, SHOT; ``match``: the index's top-P per keypoint; ``recognize``: the detections), with the
same records, so every later run, staged or not, sees them as done, and :func:`recognize_scan`
would skip each of these scenes. What the pass saves:

* the store round trips between the stages: the points are read once per scan, the description
  and the matches are never read back;
* the per-stage passes over the archive (one Dask task per batch instead of one per scan and
  stage);
* device transfers: the points go up once, the description stays on the device for matching and
  recognition, and the index's shards and the library are loaded once per worker process.

The scans go through in chunks of :data:`GROUP_BATCH`: each scan is read, described and
matched, then the chunk is recognised together (:func:`~scanforest.kernels.recognition.
recognize_described_many`: on a GPU the geometric-consistency sweeps of all its scenes run in one
launch, where one scene's few (scene, model) groups would leave most of the device idle), then
each scan's arrays go to a writer thread (copied to host through pinned memory first) while the
worker computes the next chunk; the batch returns only when all of its writes are done, so a
finished task means durable stages.

Each scan is described and recognised in its local frame (its ``origin``:
:func:`~.store.local_points`), and its poses are written in the file's own coordinates, as
:func:`~.recognize.recognize_scan` does.

Resumable stage by stage: a scan whose recognition is current is skipped; a scan whose
description (or matches) is current is recognised from it (it is read, not recomputed).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from scanforest.kernels.backend import gpu_cache_share, release_gpu_cache, trim_gpu_cache
from scanforest.kernels.errors import InputError

from .store import ScanStore, local_points, scan_origin, stage_digest, stage_matches
from .store.catalog import warm
from .units import isolated

if TYPE_CHECKING:
    from scanforest.kernels.knn.sharded import Shard
    from scanforest.kernels.recognition import ModelLibrary

    from .describe import DescribeParams

DESCRIBE_ARRAYS = ("est_normals", "kp_index", "kp_frames", "kp_shot")


@warm(maxsize=2)
def _resident_index(st: ScanStore, name: str, content_hash: str, device: str):
    """Every shard of index ``name`` of the opened store ``st`` loaded on this worker's device,
    once per process (an index over a model library is small: tens of thousands of rows)."""
    from .index import load_shard

    n = len(st.catalog.index_attrs(name)["shards"])
    return [load_shard(st, name, i, device) for i in range(n)]


@dataclass(frozen=True)
class OnePass:
    """What every scan of one :func:`process_batch` shares: the store (opened once for the
    batch), the library and the index's shards (resident on ``dev``), the parameters."""

    st: ScanStore
    lib: ModelLibrary
    lib_attrs: dict[str, Any]
    library: str
    index: str
    index_hash: str
    shards: list[Shard]  # the index's, resident on ``dev``
    dparams: DescribeParams  # the description recognition uses
    params: dict[str, Any]
    k: int
    dev: str


def search_index(shards, Q, k: int):
    """Global top-``k`` of ``Q`` over resident ``shards``: ``(dist2, ids)`` as numpy (the match
    stage's answer: the same shard searches and merge)."""
    from .index import merge_parts, search_shard

    parts = [search_shard(s, Q, k) for s in shards]
    return parts[0] if len(parts) == 1 else merge_parts(*parts, k=k)


def process_batch(store_path: str, scan_ids: list[str], *, library: str, index: str, params: dict[str, Any],
                  k: int, device: str = "auto", while_writing=None) -> list[dict[str, Any]]:
    """Describe, match and recognise ``scan_ids`` in one pass on this worker (see the module).

    ``params`` are the recognition parameters; the description follows from them and the
    library's (:func:`~scanforest.tasks.recognize.describe_params_for`). One scan's failure is
    its own ``failed`` record; the batch goes on.

    Each record's ``seconds`` is the scan's own compute and write time; its ``task_seconds`` is an
    equal share of the batch's wall time on the worker (loading the library and the index
    included). The writes overlap the next scans' compute, so the ``seconds`` add up to more
    than the worker was busy, and the shares to exactly that (the busy time an orchestration
    overhead is measured against; with ``while_writing``, the batch's time up to it: the slot's
    time). ``cpu_seconds``: an equal share of the CPU time the worker
    process (all its threads: writers, CUDA's waits) spent while the batch ran.

    ``while_writing``: called once the batch's compute is done, before it waits on its last
    writes (a Dask task gives its worker slot to the next batch there, so the device computes
    while these writes finish: :func:`scanforest.flows.prefect_tasks.leave_the_worker_pool`)."""
    t_task, c_task = time.perf_counter(), time.process_time()
    from scanforest.kernels.backend import resolve_device

    _WARM.wait_done()  # a warm-up started on this worker (:func:`warm_worker`) is finished first

    from .recognize import _load_library_cached, describe_params_for

    st = ScanStore(store_path)  # the batch's one opening of the store
    lib_attrs = st.catalog.library_attrs(library)
    iattrs = st.catalog.index_attrs(index)
    src = iattrs.get("library") or {}
    if src.get("name") != library or src.get("content_hash") != lib_attrs.get("content_hash"):
        raise InputError(f"index {index!r} is not built over library {library!r} as it is now "
                         "(build it with `scanforest index build --library`)")
    # the set-up's parts, timed apart: the first batch of a worker process pays the device's
    # context, the library and the index; the later ones find them resident
    t_open = time.perf_counter()
    dev = resolve_device(device)
    t_dev = time.perf_counter()
    lib = _load_library_cached(st, library, lib_attrs["content_hash"])
    t_lib = time.perf_counter()
    shards = _resident_index(st, index, iattrs["content_hash"], dev)
    t_idx = time.perf_counter()
    ctx = OnePass(st=st, lib=lib, lib_attrs=lib_attrs, library=library, index=index,
                  index_hash=iattrs["content_hash"], shards=shards,
                  dparams=describe_params_for(params, lib_attrs.get("params")), params=dict(params or {}),
                  k=int(k), dev=dev)
    setup = time.perf_counter() - t_task  # the store, the library and the index (cached once loaded)
    first = (store_path, index, iattrs["content_hash"], dev) not in _SET_UP
    _SET_UP.add((store_path, index, iattrs["content_hash"], dev))
    parts = {"setup_open": t_open - t_task, "setup_device": t_dev - t_open, "setup_library": t_lib - t_dev,
             "setup_index": t_idx - t_lib}
    out: dict[str, dict[str, Any]] = {}
    share = gpu_cache_share() if dev == "gpu" else None
    with ThreadPoolExecutor(max_workers=WRITER_THREADS, thread_name_prefix="sf-writeback") as writer:
        pending = []

        def chunk(ids: list[str]) -> None:
            # each scan described and matched, then the chunk's recognition (its grouping in one
            # go), then each scan's writes handed to the writer while the next chunk computes
            ready = []
            for sid in ids:
                res = isolated(_prepare_scan, sid, ctx, sid)
                if "scene" in res:
                    ready.append(res)
                else:
                    out[sid] = res
            for res, dets in zip(ready, _recognize_chunk(ready, ctx)):
                sid = res["scan_id"]
                out[sid] = dets if isinstance(dets, dict) else isolated(_finish_scan, sid, ctx, res, dets, writer)
                if res.get("batched_fallback"):
                    out[sid]["batched_fallback"] = res["batched_fallback"]
                if "write" in out[sid]:
                    pending.append(out[sid])

        for c in range(0, len(scan_ids), GROUP_BATCH):
            ids = scan_ids[c:c + GROUP_BATCH]
            chunk(ids)
            short = [s for s in ids if out[s].get("device_memory")]
            if short:  # the GPU was full (other workers' cached memory, a large scene): give this
                # process's cache back and run those scans once more, alone
                logging.getLogger("scanforest").warning(
                    "%d scan(s) ran out of device memory (%s); again after releasing this worker's cached "
                    "blocks", len(short), out[short[0]]["reason"])
                release_gpu_cache()
                first = {s: out.pop(s)["reason"] for s in short}
                chunk(short)
                for s in short:
                    out[s]["device_memory_retry"] = first[s]
            if trim_gpu_cache(share):  # what this worker holds beyond its share of the GPU goes back
                out[ids[-1]]["gpu_cache_trim"] = True  # counted: each costs the next chunk new blocks
        t_wait = t_slot = time.perf_counter()
        c_slot = time.process_time()
        if while_writing is not None and pending:
            while_writing()  # the worker's slot (and its process's CPU) is the next batch's from here
        else:
            t_slot = c_slot = None
        for res in pending:  # the batch is done when its writes are
            fut = res.pop("write")
            try:
                w = fut.result()
                res["seconds"] += w
                res["timings"]["write"] = w  # in the writer thread, beside the next scans' compute
            except Exception as exc:  # noqa: BLE001 - the scan's own failure, the others stand
                sid = res["scan_id"]
                res.clear()
                res.update(isolated(_raise, sid, exc))
    t_end = time.perf_counter()
    n = max(1, len(scan_ids))
    share = ((t_end if t_slot is None else t_slot) - t_task) / n
    cpu = ((time.process_time() if c_slot is None else c_slot) - c_task) / n
    for sid in scan_ids:
        out[sid]["task_seconds"], out[sid]["cpu_seconds"] = share, cpu
        if "timings" in out[sid]:  # the batch's own shares: its set-up, and its end waiting on the writes
            tm = out[sid]["timings"]
            tm.update(write_wait=(t_end - t_wait) / n)
            # a worker's first batch's set-up apart from the later ones' (the per-process costs)
            tm["first_batch_setup" if first else "batch_setup"] = setup / n
            tm.update({k: v / n for k, v in parts.items()})
    return [out[s] for s in scan_ids]


#: (store, index, its content hash, device) this worker process has set a batch up for
_SET_UP: set[tuple[str, str, str, str]] = set()


class _Warm:
    """The warm-up of this process (:func:`warm_worker`): started at most once, waited for by
    the first batch."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.thread = None
        self.context = None  # the thread creating the device's context (:func:`open_context`)
        self.seconds: float | None = None
        self.phases: dict[str, float] = {}  # seconds: the device, the description, the search
        self.started_at: float | None = None  # wall clock (time.time()), for the bench's timeline
        self.ended_at: float | None = None
        self.error: str | None = None

    def wait_done(self) -> None:
        t = self.thread
        if t is not None:
            t.join()


_WARM = _Warm()


def warm_worker(device: str = "auto") -> bool:
    """Start, once per process and in a background thread, what the first batch of the one pass
    would otherwise pay on this worker: the device's context, and the first use (compiled or
    loaded modules, CuPy's and numba's caches) of the description and search kernels, on a small
    synthetic cloud. The archive flow starts it on every worker while ingest runs (on four H100s,
    32 workers paid 3.3 s for the device and 4.5 s for the index in their first batch, against
    0.5 and 1.3 s with 8 workers on one).

    Returns immediately (False when already started). A failed warm-up is logged and left: the
    first batch then pays and raises what it raises."""
    import threading

    with _WARM.lock:
        if _WARM.thread is not None:
            return False
        _WARM.thread = threading.Thread(target=_warm_up, args=(device,), name="sf-warm-up", daemon=True)
        _WARM.thread.start()
    return True


def gpu_pool_report() -> dict[str, int | None]:
    """This process's CuPy memory pool: the bytes it holds, of which in use, and the share of its
    GPU it may keep (:func:`~scanforest.kernels.backend.gpu_cache_share`); zeros without a GPU."""
    from scanforest.kernels.backend import gpu_available

    if not gpu_available():
        return {"held_bytes": 0, "used_bytes": 0, "share_bytes": None}
    import cupy as cp

    pool = cp.get_default_memory_pool()
    return {"held_bytes": int(pool.total_bytes()), "used_bytes": int(pool.used_bytes()),
            "share_bytes": gpu_cache_share()}


def open_context() -> bool:
    """Start creating this worker's CUDA context, once per process, in a background thread
    (:func:`~scanforest.kernels.backend.open_device_context`, which holds no GIL while the driver
    works and waits its turn on the host asleep); the warm-up (:func:`warm_worker`) waits for it.
    Returns immediately (False when already started)."""
    import threading

    from scanforest.kernels.backend import open_device_context

    def run():
        t = time.perf_counter()
        if open_device_context():  # else CuPy makes it in the warm-up, as without this
            _WARM.phases["context"] = time.perf_counter() - t

    with _WARM.lock:
        if _WARM.context is not None:
            return False
        _WARM.context = threading.Thread(target=run, name="sf-context", daemon=True)
        _WARM.context.start()
    return True


def warm_up_report() -> dict[str, Any]:
    """This process's warm-up (:func:`warm_worker`): its seconds, its start and end (wall
    clock, ``time.time()``; None while it runs or when none was started) and its error."""
    return {"seconds": _WARM.seconds, "started_at": _WARM.started_at, "ended_at": _WARM.ended_at,
            "error": _WARM.error, "phases": dict(_WARM.phases)}


def _warm_up(device: str) -> None:
    if _WARM.context is not None:  # the context a cluster had its workers open (open_context):
        _WARM.context.join()  # its time is its own phase, not the warm-up's
    t0 = time.perf_counter()
    _WARM.started_at = time.time()
    phases = _WARM.phases
    try:
        from scanforest.kernels.backend import resolve_device, to_device
        from scanforest.kernels.knn.kdforest import KDForest

        from .describe import DescribeParams, describe_cloud

        t = time.perf_counter()
        phases["imports"] = t - t0
        dev = resolve_device(device)
        to_device(np.zeros(1, np.float32), dev) + 1  # the device's context and CuPy's first kernel
        phases["device"] = time.perf_counter() - t
        rng = np.random.default_rng(0)
        # a 0.2 m patch of 4,000 points: normals, keypoints, frames and SHOT as the pass runs them
        t = time.perf_counter()
        pts = (rng.random((4_000, 3)) * [0.2, 0.2, 0.02]).astype(np.float32)
        d = describe_cloud(pts, DescribeParams(keypoint_radius=0.02, shot_radius=0.04), device=dev)
        rows = d["arrays"]["kp_shot"]
        phases["describe"] = time.perf_counter() - t
        t = time.perf_counter()
        if len(rows):
            KDForest(device=dev, method="exact").fit(rows).query(rows, k=2)
        phases["search"] = time.perf_counter() - t
        _WARM.seconds = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a warm-up only: the first batch raises what matters
        _WARM.error = f"{type(exc).__name__}: {exc}"
        logging.getLogger(__name__).warning("worker warm-up failed (the first batch pays it): %s", _WARM.error)
    finally:
        _WARM.ended_at = time.time()


#: scenes recognised together (their geometric-consistency sweeps in one launch on a GPU)
GROUP_BATCH = 16
#: threads writing finished scans back (each scan under its own claim). One H200, `bench archive
#: --scans 1000`: the one pass at 31.5 / 33.3 scans/s with 1 / 2 (2026-11-26); one worker alone,
#: 89 / 75 ms per scene
WRITER_THREADS = 2


def _raise(exc: BaseException):
    raise exc


def _prepare_scan(ctx: OnePass, sid: str) -> dict[str, Any]:
    """A scan read, described and matched (what is current is read, not recomputed), or its
    ``skipped`` record when its recognition is current."""
    from .recognize import recognition_current, recognition_key, scene_from_matches, stored_inputs

    t0 = time.perf_counter()
    st, dev, params, dparams = ctx.st, ctx.dev, ctx.params, ctx.dparams
    meta = st.attrs(sid)
    stages = meta.get("stages", {})
    plan = stored_inputs(st, sid, ctx.library, ctx.lib_attrs, params, scan_attrs=meta)
    key = recognition_key(ctx.library, ctx.lib_attrs["content_hash"], params, plan)
    if plan["fits"]:
        rec = stages.get("recognize")
        if recognition_current(rec, key):
            return {"scan_id": sid, "status": "skipped", "detections": len(rec.get("detections", [])),
                    "evaluation": rec.get("evaluation"), "seconds": time.perf_counter() - t0}
    # what is current stays: the description, and the matches made from it with this index
    drec = stages.get("describe")
    have_desc = stage_matches(drec, **dparams.as_dict())
    d_digest = stage_digest(drec) if have_desc else None
    mrec = stages.get("match")
    have_match = have_desc and stage_matches(mrec, index=ctx.index, content_hash=ctx.index_hash,
                                             k=ctx.k, describe=d_digest)
    if not have_desc:  # a scan too coarse for the radii among fine ones fails alone, here
        from .describe import check_scan_spacing

        check_scan_spacing(st, sid, meta, dparams)
    names = ["points"] + (list(DESCRIBE_ARRAYS) if have_desc else []) + (
        ["match_ids", "match_dist"] if have_match else [])
    a = st.read_many(sid, names)
    timings: dict[str, float] = {"io": time.perf_counter() - t0}
    writes = []
    desc = _describe(a, dparams, dev, timings, have_desc, meta, sid)
    if not have_desc:
        writes.append(("describe", desc["host"], {**dparams.as_dict(), "device": dev,
                                                  "keypoints": int(len(desc["host"]["kp_index"])),
                                                  "valid_descriptors": desc["valid"],
                                                  "timings": dict(desc["timings"])}))
    if have_match:
        ids, dist = a["match_ids"], a["match_dist"]
    else:
        ids, dist, n_q = _match(desc, ctx.shards, ctx.k, dev, timings)
        writes.append(("match", {"match_ids": ids, "match_dist": dist},
                       lambda w, n_q=n_q: {"index": ctx.index, "content_hash": ctx.index_hash, "k": ctx.k,
                                           "queries": n_q,
                                           "describe": stage_digest(w["describe"]) if "describe" in w else d_digest}))
    scene = scene_from_matches(desc["points"], desc["normals"], desc["keypoints"], desc["frames"], ids, dist,
                               ctx.lib, params)
    timings["matching"] = timings.get("matching", 0.0) + scene["seconds"]
    return {"scan_id": sid, "scene": scene, "writes": writes, "key": key, "meta": meta, "timings": timings,
            "digests": (d_digest, stage_digest(mrec) if have_match else None),
            "described": not have_desc, "matched": not have_match, "seconds": time.perf_counter() - t0}


def _recognize_chunk(ready: list[dict[str, Any]], ctx: OnePass) -> list:
    """The detections of the prepared scans, together (one grouping launch on a GPU); when that
    fails, scan by scan, so that a failure is the failing scan's own record."""
    from .recognize import _recognize_stored, _recognize_stored_many

    if not ready:
        return []
    lib, params, dev = ctx.lib, ctx.params, ctx.dev
    t = time.perf_counter()
    try:
        dets = _recognize_stored_many([r["scene"] for r in ready], lib, params, dev)
        share = (time.perf_counter() - t) / len(ready)
        for r in ready:
            r["seconds"] += share
        return dets
    except Exception as exc:  # noqa: BLE001 - found again below, on the scan it belongs to
        # said and counted (a GPU fault must not show up only as a slowdown): each scan's record
        # carries it, the process summary counts the scans recognised one by one
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        logging.getLogger("scanforest").warning("batched recognition of %d scans failed (%s); recognising "
                                                "them one by one", len(ready), why)
        for r in ready:
            r["batched_fallback"] = why
    out = []
    for r in ready:
        t = time.perf_counter()
        out.append(isolated(_recognize_stored, r["scan_id"], r["scene"], lib, params, dev))
        r["seconds"] += time.perf_counter() - t
    return out


def _finish_scan(ctx: OnePass, res: dict[str, Any], dets, writer) -> dict[str, Any]:
    """The scan's recognize record, and its stages handed to the writer thread."""
    from .recognize import _evaluate, box_origin, funnel, in_file_frame

    sid, timings, lib, dev = res["scan_id"], res["timings"], ctx.lib, ctx.dev
    in_file_frame(dets, scan_origin(res["meta"]))
    for ph, v in (getattr(dets, "timings", {}) or {}).items():
        if ph != "total":
            timings[ph] = timings.get(ph, 0.0) + v
    evaluation = _evaluate(dets, res["meta"].get("ground_truth"), lib)
    n = len(dets)
    det_arrays = {"det_model": np.array([d.model_id for d in dets], np.int32),
                  "det_pose": np.array([d.pose for d in dets], np.float64).reshape(n, 4, 4),
                  "det_score": np.array([d.score for d in dets], np.float32),
                  "det_inliers": np.array([d.inliers for d in dets], np.int32)}
    compute = res["seconds"]
    d_digest, m_digest = res["digests"]

    def rec_attrs(w):
        dg = stage_digest(w["describe"]) if "describe" in w else d_digest
        mg = stage_digest(w["match"]) if "match" in w else m_digest
        return {**res["key"], "inputs": {"describe": dg, "match": mg}, "source": "stored", "reason": None,
                "pipeline": "one pass", "detections": [d.as_dict() | {"model_name": d.model} for d in dets],
                "timings": timings, "evaluation": evaluation, "device": dev, "seconds": compute}

    writes = res["writes"] + [("recognize", det_arrays, rec_attrs)]

    def write() -> float:
        t = time.perf_counter()
        ctx.st.write_stages(sid, writes)
        return time.perf_counter() - t

    return {"scan_id": sid, "status": "recognized", "detections": n, "evaluation": evaluation, "source": "stored",
            "described": res["described"], "matched": res["matched"], "timings": timings, "funnel": funnel(dets),
            "seconds": compute,
            "write": writer.submit(write), **({"box_origin": True} if box_origin(res["meta"], ctx.params) else {})}


def _describe(a: dict[str, np.ndarray], dparams, dev: str, timings: dict, have: bool, meta: dict[str, Any],
              sid: str) -> dict[str, Any]:
    """The scan's description on ``dev``: computed from the points, or the stored one uploaded;
    its ``points``: the scan's in its local frame (``meta``: its attributes), as described."""
    from scanforest.kernels.backend import to_device

    from .describe import describe_cloud

    if have:
        t = time.perf_counter()
        dv = {n: to_device(a[n], dev) for n in DESCRIBE_ARRAYS}
        pts = to_device(local_points(a["points"], meta), dev)
        out = {"points": pts, "normals": dv["est_normals"], "keypoints": dv["kp_index"], "frames": dv["kp_frames"],
               "descriptors": dv["kp_shot"], "timings": {}}
        timings["io"] += time.perf_counter() - t
        return out
    res = describe_cloud(a["points"], dparams, origin=scan_origin(meta), name=f"scan {sid}", device=dev,
                         resident=True)
    d = res["resident"]
    host = res["arrays"]
    for ph, v in res["timings"].items():
        timings[ph] = timings.get(ph, 0.0) + v
    valid = int(np.isfinite(host["kp_shot"][:, 0]).sum()) if len(host["kp_shot"]) else 0
    return {"points": res["points"], "normals": d["normals"], "keypoints": d["keypoints"], "frames": d["frames"],
            "descriptors": d["descriptors"], "host": host, "valid": valid, "timings": res["timings"]}


def _match(desc: dict[str, Any], shards, k: int, dev: str, timings: dict):
    """The match stage's top-``k`` of every keypoint with a descriptor (rows without one stay
    ``(inf, -1)``), searched on the resident shards."""
    from scanforest.kernels.backend import to_numpy, xp_for

    t = time.perf_counter()
    D = desc["descriptors"]
    xp = xp_for(dev)
    ok = xp.isfinite(D).all(axis=1)
    rows = xp.flatnonzero(ok)
    n_q = int(rows.shape[0])
    m = int(D.shape[0])
    dist = np.full((m, k), np.inf, np.float32)
    ids = np.full((m, k), -1, np.int64)
    if n_q:
        d2, i2 = search_index(shards, xp.ascontiguousarray(D[rows]), k)
        r = to_numpy(rows)
        dist[r], ids[r] = d2, i2
    timings["matching"] = timings.get("matching", 0.0) + time.perf_counter() - t
    return ids, dist, n_q
