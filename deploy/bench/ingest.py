"""``scanforest bench ingest``: ingest throughput of an archive of synthetic scans, on the CPU.

The flow (Dask workers, Prefect) against a baseline measured in the same run: the same files
read and written by one process in a plain loop.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import typer

from scanforest.flows.cluster import check_workers


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("ingest")
    def bench_ingest(
        scans: int = typer.Option(100, help="Synthetic scans in the archive."),
        points: int = typer.Option(300_000, help="Points per scan."),
        workers: Optional[int] = typer.Option(None, "--workers", "-w", callback=check_workers,
                                              help="Local Dask workers (default: one per core, max 8)."),
        scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Address of an existing Dask scheduler "
                                                "(tcp://host:8786); default: a local cluster started for this "
                                                "command."),
        workdir: Path = typer.Option(Path("bench-ingest"), help="Scratch folder (archive + store)."),
        out: Optional[Path] = typer.Option(None, "--out", help="JSON file or folder (default bench-results/)."),
    ):
        """Ingest throughput (MB/s, points/s) for an archive of synthetic scans, on the CPU.

        The baseline row is the same files read and written by one process in a plain loop
        (no Dask, no Prefect), measured in the same run.
        """
        import shutil

        from scanforest.flows.ingest import run_ingest
        from scanforest.kernels.synthetic import scenes as synthetic
        from scanforest.tasks.ingest import Source, ingest_file
        from scanforest.tasks.readers import write_cloud

        from ._common import BenchReport

        rep = BenchReport("ingest", {"scans": scans, "points": points})
        src = workdir / "archive"
        src.mkdir(parents=True, exist_ok=True)
        lib = synthetic.model_library(4, 10_000, seed=7)
        t0 = time.perf_counter()
        for i in range(scans):
            p = src / f"scan_{i:04d}.pcd"
            if not p.exists():
                sc = synthetic.make_scene(lib, n_instances=3, n_points=points, seed=i, occlusion=False)
                write_cloud(p, sc.points, encoding="binary_compressed")
        files = sorted(src.glob("*.pcd"))
        nbytes = sum(f.stat().st_size for f in files)
        rep.note(f"archive: {len(files)} binary_compressed PCD files, {nbytes / 1e6:.1f} MB, made in "
                 f"{time.perf_counter() - t0:.1f} s")
        # baseline: one process, plain loop, same unit of work
        base_store = workdir / "baseline.zarr"
        shutil.rmtree(base_store, ignore_errors=True)
        t0 = time.perf_counter()
        npts = 0
        from scanforest.tasks.store import ScanStore

        ScanStore(base_store, create=True)
        for f in files:
            npts += ingest_file(str(base_store), Source(str(f), f.name))["points"]
        t_base = time.perf_counter() - t0
        store = workdir / "store.zarr"
        shutil.rmtree(store, ignore_errors=True)
        summary = run_ingest(str(src), str(store), scheduler=scheduler, workers=workers, progress=False)
        t_flow = summary["seconds"]
        t0 = time.perf_counter()
        again = run_ingest(str(src), str(store), scheduler=scheduler, workers=workers, progress=False)
        t_skip = time.perf_counter() - t0
        cpu = f"cpu ({os.cpu_count()} cores, {summary['workers']} dask workers)"
        rep.add("ingest MB/s (flow)", nbytes / 1e6 / t_flow, "MB/s", cpu, baseline="1 process loop",
                baseline_value=nbytes / 1e6 / t_base)
        rep.add("ingest points/s (flow)", summary["points"] / t_flow, "points/s", cpu,
                baseline="1 process loop", baseline_value=npts / t_base)
        rep.add("ingest MB/s (1 process loop, baseline)", nbytes / 1e6 / t_base, "MB/s", "cpu (1 process)")
        rep.add("re-ingest of unchanged archive", t_skip, "s", cpu, higher_is_better=False,
                skipped=again["skipped"])
        rep.add("dask workers", summary["workers"], "workers", cpu)
        rep.note(f"flow wall {t_flow:.2f} s, summed task time {summary['task_seconds']:.2f} s; "
                 f"ingested {summary['ingested']}, skipped {summary['skipped']}, quarantined {summary['quarantined']}")
        rep.finish(out)
