"""The recognize flow: a model library from model scans, every scene recognised, detections
stored per scene and exported as CSV/Parquet, with per-scene PNG renders and a Prefect artifact."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from scanforest.tasks.recognize import build_library, detections_table, load_library
from scanforest.tasks.store import ScanStore, utc_now

from .batching import TASKS_IN_FLIGHT, auto_batch, map_batches
from .cluster import check_scheduler, dask_client, n_workers
from .inputs import absolute_path, check_recognize
from .prefect_api import ensure_prefect_api
from .prefect_tasks import recognize_batch_task
from .records import RUN_HOOKS, box_origin, count_redone, failures, record_run


@flow(name="scanforest-recognize", task_runner=ThreadPoolTaskRunner(max_workers=TASKS_IN_FLIGHT), **RUN_HOOKS)
def recognize_flow(store: str, models: list[str], scenes: list[str] | None = None, library: str = "default",
                   library_params: dict | None = None, params: dict | None = None, device: str = "auto",
                   scheduler: str | None = None, workers: int | None = None, batch: int | None = None,
                   export: str | None = None, render: bool = True, progress: bool = True) -> dict[str, Any]:
    """Recognise the ``models`` (scan ids) in the ``scenes`` (default: every other scan).

    A scene that cannot be recognised is recorded as failed (its id and the reason) and the rest
    go on."""
    t0 = time.perf_counter()
    store = absolute_path(store)
    st = check_recognize(store, models, scenes, library_params, params)
    lib_res = build_library(store, models, name=library, params=library_params or {}, device=device)
    ids = list(scenes) if scenes is not None else [s for s in st.scans() if s not in set(models)]
    params = dict(params or {})
    with dask_client(scheduler, n_workers=workers, device=device) as client:
        nw = n_workers(client)
        t1 = time.perf_counter()
        since = utc_now()
        recs = map_batches(recognize_batch_task, ids, item_param="scan_ids",
                           common=dict(store=store, library=library, params=params, device=device),
                           label="recognize", batch=batch or auto_batch(len(ids), nw), progress=progress, workers=nw)
        t_scenes = time.perf_counter() - t1
    count_redone(recs, st, "recognize", since, "recognized")
    summary = summarize(recs)
    summary.update(scenes=len(ids), workers=nw, library=lib_res["status"], seconds=time.perf_counter() - t0,
                   scenes_seconds=t_scenes, task_seconds=float(sum(r["seconds"] for r in recs)))
    if export:
        summary["exports"] = export_results(store, ids, Path(export), render=render, library=library)
    record_run(st, "recognize", {"models": models, "library": library, "params": params, "device": device},
               {k: v for k, v in summary.items() if k != "exports"}, recs)
    _detections_artifact(store, ids)
    return summary


def no_detections_note(summary: dict[str, Any], params: dict[str, Any] | None) -> str | None:
    """Where recognised scenes gave no detection at all, the stage that lost them, in one line
    (a silent 0 sent users looking everywhere): no correspondence (the descriptors of the scenes
    and of the library do not match: another scale or unit, or radii unfit for the data), no
    hypothesis (no group of ``cg_thresh`` consistent correspondences), or hypotheses that all
    fail verification. None when there are detections or nothing was recognised."""
    from scanforest.kernels.recognition import RecognizeParams

    f = summary.get("funnel")
    n = summary.get("recognized", 0)
    if not f or not n or summary.get("detections"):
        return None
    p = RecognizeParams().replace(**(params or {}))
    scenes = f"{n} scene{'s' if n != 1 else ''}"
    if not f["correspondences"]:
        return (f"no detections in {scenes}: none of their {f['keypoints']:,} keypoints matched a library "
                "descriptor; are the scenes in the models' unit and scale, and the radii (--descr-rad, "
                "--scene-ss) fit for them?")
    if not f["hypotheses"]:
        return (f"no detections in {scenes}: {f['correspondences']:,} correspondences formed no group of "
                f"{p.cg_thresh:g} consistent ones (--cg-size {p.cg_size:g}, --cg-thresh {p.cg_thresh:g})")
    best = f.get("best_score")
    return (f"no detections in {scenes}: {f['hypotheses']:,} hypotheses, none verified (the best explains "
            f"{'?' if best is None else f'{best:.2f}'} of a model's visible points; min_inlier_fraction "
            f"{p.min_inlier_fraction:g})")


#: recomputed scenes a summary names one by one, with the reason (the run's records name them all)
RECOMPUTED_LISTED = 100


def summarize(recs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"recognized": sum(r["status"] == "recognized" for r in recs),
                           "skipped": sum(r["status"] == "skipped" for r in recs),
                           # scenes a concurrent run held (and recognises): left to it
                           "held": sum(r["status"] == "held" for r in recs),
                           "failed": sum(r["status"] == "failed" for r in recs), "failures": failures(recs),
                           "detections": int(sum(r.get("detections", 0) for r in recs))}
    # where the recognised scenes' descriptions and matches came from: the describe and match
    # stages ("stored") or a description and brute-force match of their own ("recomputed", why)
    done = [r for r in recs if r["status"] == "recognized"]
    out["from_stored"] = sum(r.get("source") == "stored" for r in done)
    out["recomputed"] = sum(r.get("source") == "recomputed" for r in done)
    reasons: dict[str, int] = {}
    per_scene: dict[str, str] = {}
    for r in done:
        if r.get("source") == "recomputed":
            why = r.get("reason") or "?"
            reasons[why] = reasons.get(why, 0) + 1
            if len(per_scene) < RECOMPUTED_LISTED:
                per_scene[str(r.get("scan_id"))] = why
    if reasons:
        out["recompute_reasons"] = reasons
        # each recomputed scene and why (the first RECOMPUTED_LISTED; the run record has them all)
        out["recomputed_scenes"] = per_scene
    out.update(box_origin(done, RECOMPUTED_LISTED))  # georeferenced scenes without a file offset
    funnels = [r["funnel"] for r in done if r.get("funnel")]
    if funnels:  # how far the recognised scenes got, summed (best_score: the best of all)
        out["funnel"] = {k: int(sum(f[k] for f in funnels))
                         for k in ("keypoints", "correspondences", "hypotheses", "detections")}
        scores = [f["best_score"] for f in funnels if f.get("best_score") is not None]
        out["funnel"]["best_score"] = max(scores) if scores else None
    phases: dict[str, float] = {}  # seconds per recognition phase, summed over the recognised scenes
    for r in recs:
        for k, v in (r.get("timings") or {}).items():
            phases[k] = phases.get(k, 0.0) + float(v)
    if phases:
        out["phase_seconds"] = phases
    evs = [r["evaluation"] for r in recs if r.get("evaluation")]
    if evs:
        tp, fp, fn = (sum(e[k] for e in evs) for k in ("tp", "fp", "fn"))
        rot = [x for e in evs for x in e["rotation_errors"]]
        tra = [x / e["resolution"] for e in evs for x in e["translation_errors"]]
        # precision of no detections and recall of no true instances are undefined (None), not 0
        out.update(tp=tp, fp=fp, fn=fn, precision=tp / (tp + fp) if tp + fp else None,
                   recall=tp / (tp + fn) if tp + fn else None,
                   rotation_error_deg_median=float(np.median(rot)) if rot else None,
                   rotation_error_deg_max=float(np.max(rot)) if rot else None,
                   translation_error_res_median=float(np.median(tra)) if tra else None)
    return out


def export_results(store: str, scenes: list[str], out: Path, *, render: bool, library: str) -> dict[str, str]:
    """Detections as CSV and Parquet, and a PNG per scene with the detected models overlaid."""
    out.mkdir(parents=True, exist_ok=True)
    df = detections_table(store, scenes)
    paths = {"csv": str(out / "detections.csv"), "parquet": str(out / "detections.parquet")}
    df.to_csv(paths["csv"], index=False)
    df.to_parquet(paths["parquet"], index=False)
    if render:
        lib = load_library(store, library)
        rdir = out / "renders"
        rdir.mkdir(exist_ok=True)
        for sid in scenes:
            render_scene(store, sid, lib, rdir / f"{sid}.png")
        paths["renders"] = str(rdir)
    return paths


def render_scene(store: str, scan_id: str, lib, path: Path, max_points: int = 60_000) -> Path:
    """Top view (camera x-y) of the scene in grey with every detected model overlaid in colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = ScanStore(store, mode="r")
    P = st.read(scan_id, "points")
    if len(P) > max_points:
        P = P[np.random.default_rng(0).choice(len(P), max_points, replace=False)]
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.scatter(P[:, 0], P[:, 1], s=0.2, c="0.75", linewidths=0)
    rec = st.attrs(scan_id).get("stages", {}).get("recognize", {})
    colors = plt.cm.tab10.colors
    for j, d in enumerate(rec.get("detections", [])):
        pose = np.asarray(d["pose"])
        a, b = lib.verify_offsets[d["model_id"]], lib.verify_offsets[d["model_id"] + 1]
        M = lib.verify_points[a:b] @ pose[:3, :3].T + pose[:3, 3]
        ax.scatter(M[:, 0], M[:, 1], s=0.5, color=colors[j % 10], linewidths=0,
                   label=f"{d.get('model_name', d['model'])} ({d['score']:.2f})")
    ax.set_aspect("equal")
    ax.set_title(f"{scan_id}: {len(rec.get('detections', []))} detections")
    if rec.get("detections"):
        ax.legend(fontsize=7, markerscale=10, loc="upper right")
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path


def _detections_artifact(store: str, scenes: list[str]) -> None:
    try:
        from prefect.artifacts import create_table_artifact

        df = detections_table(store, scenes)
        cols = [c for c in ("scan_id", "model", "score", "inliers", "correspondences") if c in df.columns]
        create_table_artifact(df[cols].head(1000).to_dict("records") if len(df) else [],
                              key="scanforest-detections", description=f"detections in {len(scenes)} scenes")
    except Exception:
        pass


def run_recognize(store, models, **kw):
    store = absolute_path(store)
    check_recognize(store, list(models), kw.get("scenes"), kw.get("library_params"), kw.get("params"))
    check_scheduler(kw.get("scheduler"))
    ensure_prefect_api()
    return recognize_flow(store=store, models=list(models), **kw)
