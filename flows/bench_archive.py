"""``scanforest bench archive``: a synthetic archive through ingest -> describe -> match ->
recognize on the local cluster; scans/s per stage and the orchestration overhead.

Overhead of a stage = 1 - (time spent inside the units of work, i.e. kernels and store I/O,
summed over scans) / (wall time x workers): everything that is neither kernels nor I/O —
Prefect task runs, Dask scheduling, transfers, idle workers at the tail of the run. The match
stage's workers are the ones holding index shards; its store I/O runs in the flow process beside
them, so its busy time can exceed that capacity (overhead 0, counted as the stage's wall time in
the whole-archive figure, never as credit against the other stages).
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Optional

from ._bench import BenchReport


def run(scans: int, points: int, models: int, workers: int | None, device: str, workdir: Path, out,
        keep: bool = False) -> BenchReport:
    from scanforest.kernels._backend import describe_device, gpu_count, resolve_device
    from scanforest.tasks.describe import DescribeParams
    from scanforest.tasks.store import ScanStore
    from scanforest.tasks.synth import write_archive

    from ._runner import ensure_prefect_api
    from .describe import run_describe
    from .ingest import run_ingest
    from .match import run_index_build, run_match
    from .recognize import run_recognize
    from scanforest.kernels.synthetic import recognition_presets

    dev = resolve_device(device)
    rep = BenchReport("archive", {"scans": scans, "points": points, "models": models, "device": dev}, echo=True)
    ensure_prefect_api()
    archive = workdir / "archive"
    t0 = time.perf_counter()
    write_archive(archive, n_models=models, n_scenes=scans, points_per_scene=points, points_per_model=12_000,
                  jobs=min(16, os.cpu_count() or 1))
    rep.note(f"archive of {scans} scenes x {points:,} points + {models} models made in "
             f"{time.perf_counter() - t0:.1f} s (not counted)")
    store = workdir / "store.zarr"
    shutil.rmtree(store, ignore_errors=True)
    devname = describe_device(dev)
    stages = []

    def stage(name, wall, task_s, nw, n):  # rows printed as each stage ends (a cut-off run keeps them)
        stages.append((name, wall, task_s, nw, n))
        what = f"{devname}, {nw} {'shard workers' if name == 'match' else 'workers'}"
        rep.add(f"{name}: scans/s", n / wall, "scans/s", what)
        if task_s is not None:
            overhead = max(0.0, 1.0 - task_s / (wall * nw))
            rep.add(f"{name}: orchestration overhead", 100 * overhead, "%", what,
                    higher_is_better=False, wall=wall, task_seconds=task_s)

    t_all = time.perf_counter()
    s = run_ingest(str(archive), str(store), workers=workers, progress=False)
    stage("ingest", s["seconds"], s["task_seconds"], s["workers"], s["files"])
    params = DescribeParams(normal_k=10, keypoint_radius=0.02, shot_radius=0.04)
    s = run_describe(str(store), params=params, device=dev, workers=workers, progress=False)
    stage("describe", s["seconds"], s["task_seconds"], s["workers"], s["scans"])
    st = ScanStore(str(store), mode="r")
    model_ids = [x for x in st.scans() if x.startswith("models__")]
    # the model index is small (tens of thousands of rows): one shard per GPU, or one per CPU worker
    shards = gpu_count() if dev == "gpu" else max(1, workers or 2)
    run_index_build(str(store), model_ids, name="models", shards=shards, params={"method": "exact"})
    s = run_match(str(store), k=4, name="models", device=dev, workers=workers, progress=False)
    # match: the busy time is store I/O (in the flow process) plus the shard searches and merges
    # (on the workers); its capacity is the wall time x the workers that hold shards
    stage("match", s["scans_seconds"], s["task_seconds"], s["lanes"], s["scans"])
    lib_params, rec_params = recognition_presets(dev, points)
    s = run_recognize(str(store), model_ids, library="bench", device=dev, workers=workers, progress=False,
                      library_params=lib_params, params=rec_params)
    stage("recognize", s["scenes_seconds"], s["task_seconds"], s["workers"], s["scenes"])
    total = time.perf_counter() - t_all
    timed = [(wall, task_s, nw) for _, wall, task_s, nw, _ in stages if task_s is not None]
    if timed:  # every stage, weighted by its wall time
        busy = sum(min(w, t / nw) for w, t, nw in timed)
        span = sum(w for w, _, _ in timed)
        rep.add("whole archive (all stages): orchestration overhead", 100 * max(0.0, 1.0 - busy / span), "%",
                devname, higher_is_better=False, wall=span, busy=busy)
    rep.add("archive end to end: scans/s", scans / total, "scans/s", devname,
            stages_wall=sum(st[1] for st in stages), total_wall=total)
    if "precision" in s:
        rep.add("recognize precision", s["precision"], "", devname)
        rep.add("recognize recall", s["recall"], "", devname)
    rep.finish(out)
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return rep


def register_bench(bench) -> None:
    import typer

    @bench.command("archive")
    def bench_archive(
        scans: int = typer.Option(1000, help="Synthetic scenes in the archive."),
        points: int = typer.Option(20_000, help="Points per scene."),
        models: int = typer.Option(4, help="Library models."),
        workers: Optional[int] = typer.Option(None, "--workers", "-w"),
        device: str = typer.Option("auto"),
        workdir: Path = typer.Option(Path("bench-archive"), help="Scratch folder (removed afterwards)."),
        keep: bool = typer.Option(False, help="Keep the scratch folder."),
        out: Optional[str] = typer.Option(None, "--out"),
    ):
        """Archive throughput through every stage and the orchestration overhead per stage."""
        run(scans, points, models, workers, device, workdir, out, keep)
