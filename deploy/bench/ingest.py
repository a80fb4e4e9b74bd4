"""``scanforest bench ingest``: ingest throughput of an archive of synthetic scans, on the CPU,
and the memory the ingest holds.

The flow (Dask workers, Prefect) against a baseline measured in the same run: the same files
read and written by one process in a plain loop. The resident memory (RSS) of the flow process
and of each Dask worker is sampled through the flow's runs (:class:`RssSampler`): its peak, and
whether it grew (the first 10% of the samples against the last 10%). ``--format laz`` makes LAZ
files instead of PCD (``--format mixed``: LAS, LAZ and E57 in turn), and ``--las-points N`` one
more LAZ file of N points (written in blocks: the generator holds one block at a time), ingested
by a run of its own (block by block, see :func:`scanforest.tasks.las.open_las_blocks`), so its
peak shows the memory bound.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

import typer

from scanforest.flows.cluster import check_workers


class RssSampler:
    """Samples the resident memory of this process and of its Dask worker processes (its
    descendants started by multiprocessing) every ``every`` seconds in a thread, while in ``with``."""

    def __init__(self, every: float = 0.25):
        self.every = every
        self.samples: list[tuple[float, int, dict[int, int]]] = []  # (time, own RSS, {worker pid: RSS})
        self._stop = threading.Event()

    def __enter__(self) -> "RssSampler":
        import psutil

        me = psutil.Process()

        def loop():
            while True:
                workers = {}
                for child in me.children(recursive=True):
                    try:
                        if "spawn_main" in " ".join(child.cmdline()):  # not multiprocessing's resource tracker
                            workers[child.pid] = child.memory_info().rss
                    except psutil.Error:
                        pass
                self.samples.append((time.perf_counter(), me.memory_info().rss, workers))
                if self._stop.wait(self.every):
                    return

        self._thread = threading.Thread(target=loop, daemon=True, name="rss-sampler")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        """Peaks (MB) of the flow process and of each worker, and the growth of each: the mean of
        its last 10% of samples minus the mean of its first 10% (MB; a worker's own samples, from
        its start: its first 10% hold the imports of its start)."""
        def growth(values: list[int], start) -> float:
            # the mean of the last 10% of the samples minus the mean of the 10% from index start(n, k)
            n = len(values)
            k = max(1, n // 10)
            i = max(0, min(start(n, k), n - k))
            return (sum(values[-k:]) / k - sum(values[i:i + k]) / k) / 1e6

        def grow(values: list[int]) -> float:
            return growth(values, lambda n, k: 0)

        def late(values: list[int]) -> float:
            # the second half's growth: from the middle 10% (after the start's imports and caches;
            # a leak per file keeps growing there, a warm-up does not)
            return growth(values, lambda n, k: n // 2 - k // 2)

        own = [s[1] for s in self.samples]
        pids = sorted({p for s in self.samples for p in s[2]})
        per = {p: [s[2][p] for s in self.samples if p in s[2]] for p in pids}
        per = {p: v for p, v in per.items() if len(v) >= 2}
        return {"samples": len(self.samples),
                "flow_peak_mb": max(own, default=0) / 1e6, "flow_growth_mb": grow(own) if own else 0.0,
                "flow_late_growth_mb": late(own) if own else 0.0,
                "worker_peak_mb": [max(v) / 1e6 for v in per.values()],
                "worker_growth_mb": [grow(v) for v in per.values()],
                "worker_late_growth_mb": [late(v) for v in per.values()]}


def write_laz_files(folder: Path, files: int, points: int, *, seed: int = 0,
                    suffixes: tuple[str, ...] = (".laz",)) -> list[Path]:
    """``files`` tiles of ``points`` points each, made once (existing files are kept): LAZ / LAS
    (point format 3: coordinates, intensity, colour, classification) and E57 (one scan with
    intensity and colour), the suffixes taken in turn."""
    out = []
    for i in range(files):
        suffix = suffixes[i % len(suffixes)]
        p = folder / f"tile_{i:05d}{suffix}"
        if not p.exists():
            (write_e57 if suffix == ".e57" else write_laz)(p, points, seed=seed + i)
        out.append(p)
    return out


def _terrain(rng, start: int, m: int, side: int, step: float):
    """Points ``start .. start + m`` of the terrain tile (local x, y in 0..1000 m, height z)."""
    import numpy as np

    i = np.arange(start, start + m)
    x = (i % side) * step + rng.uniform(0, step, m)
    y = (i // side) * step + rng.uniform(0, step, m)
    z = 20 + 10 * np.sin(x / 97.0) * np.cos(y / 131.0) + rng.normal(0, 0.05, m)
    return x, y, z


def write_e57(path: Path, points: int, *, seed: int = 0) -> Path:
    """One E57 file of one scan of the terrain tile (local coordinates, intensity, colour),
    written by pye57 (the ``e57`` extra)."""
    import numpy as np
    import pye57

    rng = np.random.default_rng(seed)
    side = max(1, int(np.sqrt(points)))
    x, y, z = _terrain(rng, 0, points, side, 1000.0 / side)
    data = {"cartesianX": x, "cartesianY": y, "cartesianZ": z,
            "intensity": rng.uniform(0, 1, points),
            **{c: rng.integers(60, 200, points).astype(np.uint8) for c in ("colorRed", "colorGreen", "colorBlue")}}
    tmp = path.with_name(path.name + ".part")
    with pye57.E57(str(tmp), mode="w") as e57:
        e57.write_scan_raw(data, name=path.stem)
    os.replace(tmp, path)
    return path


def write_laz(path: Path, points: int, *, seed: int = 0, block: int = 1 << 20) -> Path:
    """One LAZ file of ``points`` points of a terrain-like tile (rows of a jittered 1 km grid in
    scan order, a smooth height plus noise, 16-bit intensity and colour, a class), written
    ``block`` points at a time: the generator holds one block, however large the file."""
    import laspy
    import numpy as np

    rng = np.random.default_rng(seed)
    header = laspy.LasHeader(point_format=3, version="1.2")
    header.scales = [0.001] * 3
    header.offsets = [500_000.0, 4_000_000.0, 0.0]
    side = max(1, int(np.sqrt(points)))
    step = 1000.0 / side
    tmp = path.with_name(path.name + ".part")
    with laspy.open(tmp, mode="w", header=header, do_compress=path.suffix.lower() == ".laz") as writer:
        for start in range(0, points, block):
            m = min(block, points - start)
            x, y, z = _terrain(rng, start, m, side, step)
            rec = laspy.ScaleAwarePointRecord.zeros(m, header=header)
            rec.x = 500_000.0 + x
            rec.y = 4_000_000.0 + y
            rec.z = z
            rec.intensity = rng.integers(0, 4096, m) * 16
            rec.red, rec.green, rec.blue = (rng.integers(60, 200, m) * 256 for _ in range(3))
            rec.classification = np.where(rng.random(m) < 0.8, 2, 5)
            writer.write_points(rec)
    os.replace(tmp, path)
    return path


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("ingest")
    def bench_ingest(
        scans: int = typer.Option(100, help="Synthetic scans in the archive."),
        points: int = typer.Option(300_000, help="Points per scan."),
        fmt: str = typer.Option("pcd", "--format", help="pcd (synthetic scenes), laz (terrain LAZ tiles) or "
                                "mixed (LAS, LAZ and E57 tiles in turn)."),
        las_points: int = typer.Option(0, "--las-points", help="Also one LAZ file of this many points, "
                                       "ingested by a run of its own (block by block); 0: none."),
        workers: Optional[int] = typer.Option(None, "--workers", "-w", callback=check_workers,
                                              help="Local Dask workers (default: one per core, max 8)."),
        scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Address of an existing Dask scheduler "
                                                "(tcp://host:8786); default: a local cluster started for this "
                                                "command."),
        workdir: Path = typer.Option(Path("bench-ingest"), help="Scratch folder (archive + store)."),
        out: Optional[Path] = typer.Option(None, "--out", help="JSON file or folder (default bench-results/)."),
    ):
        """Ingest throughput (MB/s, points/s) for an archive of synthetic scans, on the CPU, and the
        peak memory (RSS) of the flow process and of each worker, and whether it grew.

        The baseline row is the same files read and written by one process in a plain loop
        (no Dask, no Prefect), measured in the same run.
        """
        import shutil

        from scanforest.flows.ingest import run_ingest
        from scanforest.kernels.synthetic import scenes as synthetic
        from scanforest.tasks.ingest import Source, ingest_file
        from scanforest.tasks.readers import write_cloud

        from ._common import BenchReport

        if fmt not in ("pcd", "laz", "mixed"):
            raise typer.BadParameter(f"--format must be pcd, laz or mixed, got {fmt!r}")
        rep = BenchReport("ingest", {"scans": scans, "points": points, "format": fmt, "las_points": las_points},
                          out=out)
        src = workdir / {"pcd": "archive", "laz": "laz", "mixed": "mixed"}[fmt]
        src.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if fmt == "pcd":
            lib = synthetic.model_library(4, 10_000, seed=7)
            for i in range(scans):
                p = src / f"scan_{i:04d}.pcd"
                if not p.exists():
                    sc = synthetic.make_scene(lib, n_instances=3, n_points=points, seed=i, occlusion=False)
                    write_cloud(p, sc.points, encoding="binary_compressed")
            files = sorted(src.glob("*.pcd"))[:scans]
            what = "binary_compressed PCD"
        elif fmt == "laz":
            files = write_laz_files(src, scans, points)
            what = "LAZ (point format 3)"
        else:
            files = write_laz_files(src, scans, points, suffixes=(".las", ".laz", ".e57"))
            what = "LAS, LAZ (point format 3) and E57 (one scan each, in turn)"
        nbytes = sum(f.stat().st_size for f in files)
        rep.note(f"archive: {len(files)} {what} files, {nbytes / 1e6:.1f} MB, made in "
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
        shutil.rmtree(base_store, ignore_errors=True)
        store = workdir / "store.zarr"
        shutil.rmtree(store, ignore_errors=True)
        with RssSampler() as rss:
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
        _memory_rows(rep, "many files", rss.summary(), cpu)
        rep.note(f"flow wall {t_flow:.2f} s, summed task time {summary['task_seconds']:.2f} s; "
                 f"ingested {summary['ingested']}, skipped {summary['skipped']}, quarantined {summary['quarantined']}")
        if las_points:
            big = workdir / "large"
            big.mkdir(parents=True, exist_ok=True)
            f = big / f"large_{las_points}.laz"
            t0 = time.perf_counter()
            if not f.exists():
                for old in big.glob("*.laz"):
                    old.unlink()
                write_laz(f, las_points, seed=12345)
            rep.note(f"large file: {las_points:,} points, {f.stat().st_size / 1e6:.1f} MB LAZ, made in "
                     f"{time.perf_counter() - t0:.1f} s (the generator writes blocks of 1,048,576 points)")
            big_store = workdir / "large.zarr"
            shutil.rmtree(big_store, ignore_errors=True)
            with RssSampler() as rss:
                one = run_ingest(str(big), str(big_store), scheduler=scheduler, workers=workers, progress=False)
            rep.add("large LAZ ingest points/s (flow, block by block)", one["points"] / one["seconds"], "points/s",
                    cpu, points=one["points"], seconds=one["seconds"])
            m = _memory_rows(rep, "large file", rss.summary(), cpu)
            # what the whole-file path would hold: laspy's record (~34 B/point for format 3) + stored arrays
            rep.note(f"large file: stored arrays {las_points * 32 / 1e6:.0f} MB (float64 xyz, intensity, colour, "
                     f"class); worker peak {max(m['worker_peak_mb'], default=0):.0f} MB")
            shutil.rmtree(big_store, ignore_errors=True)
        rep.finish(out)


def _memory_rows(rep, what: str, m: dict[str, Any], cpu: str) -> dict[str, Any]:
    """Rows of the peak RSS of the flow process and of the workers, and their growth."""
    rep.add(f"peak RSS, flow process ({what})", m["flow_peak_mb"], "MB", cpu, higher_is_better=False,
            growth_mb=round(m["flow_growth_mb"], 1), late_growth_mb=round(m["flow_late_growth_mb"], 1),
            samples=m["samples"])
    for i, (peak, grow, late) in enumerate(zip(m["worker_peak_mb"], m["worker_growth_mb"],
                                               m["worker_late_growth_mb"])):
        rep.add(f"peak RSS, worker {i} ({what})", peak, "MB", cpu, higher_is_better=False, growth_mb=round(grow, 1),
                late_growth_mb=round(late, 1))
    rep.note(f"{what}: RSS growth, mean of the last 10% of samples minus the first 10%: flow "
             f"{m['flow_growth_mb']:+.1f} MB, workers " + ", ".join(f"{g:+.1f} MB" for g in m["worker_growth_mb"])
             + "; over the second half (the last 10% minus the middle 10%): flow "
             f"{m['flow_late_growth_mb']:+.1f} MB, workers "
             + ", ".join(f"{g:+.1f} MB" for g in m["worker_late_growth_mb"]))
    return m
