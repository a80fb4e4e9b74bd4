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
from .records import RUN_HOOKS, count_redone, record_run
from .summaries import (RECOMPUTED_LISTED, no_detections_note, other_libraries,  # noqa: F401 - theirs
                        replaced_note, summarize)


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
    replaced = other_libraries(st, ids, library)
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
    if replaced:
        summary["replaced_note"] = replaced_note(replaced, library)
    if export:
        summary["exports"] = export_results(store, ids, Path(export), render=render, library=library)
    record_run(st, "recognize", {"models": models, "library": library, "params": params, "device": device},
               {k: v for k, v in summary.items() if k != "exports"}, recs)
    _detections_artifact(store, ids)
    return summary


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
