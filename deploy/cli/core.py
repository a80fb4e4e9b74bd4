"""Core commands: ingest, info, demo (``bench ingest`` is :mod:`scanforest.deploy.bench.ingest`)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from scanforest.flows._runner import check_workers

from ._store import existing_store, new_store, output_folder

SchedulerOpt = typer.Option(None, "--scheduler", help="Address of an existing Dask scheduler "
                            "(tcp://host:8786); default: a local cluster started for this command.")
WorkersOpt = typer.Option(None, "--workers", "-w", callback=check_workers,
                          help="Local Dask workers (default: one per core, at most 8; on a GPU host 8 per GPU).")
#: STORE of the commands that write into an existing store, checked as it is parsed (see ``_store``)
StoreArg = typer.Argument(..., callback=existing_store, help="The Zarr scan store.")
DeviceOpt = typer.Option("auto", "--device", help="auto | cpu | gpu: auto uses the GPU when one is visible.")


def choose_device(device: str) -> str:
    """Resolve --device and say what was chosen (stderr), e.g. 'device: gpu (NVIDIA H100 80GB HBM3)'."""
    from scanforest.kernels.backend import describe_device, resolve_device

    dev = resolve_device(device)
    typer.echo(f"device: {describe_device(dev)}" + (" [auto]" if device == "auto" else ""), err=True)
    from scanforest.kernels.backend import numba_cache_cold

    cold = numba_cache_cold()
    if cold:
        typer.echo(f"note: first run here: compiling the CPU kernels (about a minute on 2 cores; cached in "
                   f"{cold} for later runs)", err=True)
    return dev


JsonOpt = typer.Option(False, "--json", help="Print the result as JSON (for machines) instead of a table.")


def _cell(key: str, value) -> str:
    """A figure as a person reads it: thousands separated, 3-4 significant digits, units."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if key == "bytes" and isinstance(value, (int, float)):
        return f"{value / 1e6:,.1f} MB"
    if key.endswith("seconds") and isinstance(value, (int, float)):
        return f"{value:,.2f} s"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def print_summary(title: str, summary: dict, *, as_json: bool = False, keys: tuple[str, ...] | None = None) -> None:
    """A command's result: a two-column table of its scalar figures (``keys`` first, in that
    order), then one line per quarantined file and per failed item; ``as_json`` prints the
    whole summary as JSON on stdout instead."""
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    order = list(keys or ()) + [k for k in summary if k not in (keys or ())]
    for key in order:
        value = summary.get(key)
        if key not in summary or isinstance(value, (list, dict)) or key.startswith("_"):
            continue
        table.add_row(key.replace("_", " "), _cell(key, value))
    Console(soft_wrap=True).print(table)
    for q in summary.get("quarantine_reasons", []):
        typer.secho(f"quarantined: {q['source']}: {q['reason']}", fg=typer.colors.YELLOW)
    for f in summary.get("failures", []):
        typer.secho(f"failed: {f['scan_id']}: {f['reason']}", fg=typer.colors.YELLOW)


INGEST_KEYS = ("files", "ingested", "skipped", "quarantined", "ignored", "points", "bytes", "seconds", "workers")


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command()
    def ingest(
        source: str = typer.Argument(..., help="A folder, a glob ('scans/**/*.pcd') or an archive (.tar, .tar.gz, .zip)."),
        store: str = typer.Argument(..., callback=new_store, help="The Zarr scan store (created if missing; "
                                    "its folder must exist)."),
        units: str = typer.Option("m", help="Length unit recorded for the scans."),
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
        as_json: bool = JsonOpt,
    ):
        """Ingest scans (PCD, PLY, LAS/LAZ, XYZ/CSV, NPY) into a Zarr v3 store; resumable.

        Unchanged files already in the store are skipped; unreadable files are quarantined with
        the reason and the batch goes on.
        """
        from scanforest.flows.ingest import run_ingest

        summary = run_ingest(source, store, scheduler=scheduler, workers=workers, units=units, progress=not as_json)
        print_summary(f"ingest {source} -> {store}", summary, as_json=as_json, keys=INGEST_KEYS)

    @app.command()
    def info(store: str = typer.Argument(..., help="The Zarr scan store."),
             scans: bool = typer.Option(False, "--scans", help="List every scan."),
             as_json: bool = JsonOpt):
        """Summarise a store: scans, points, formats, stages done, quarantine, runs."""
        from scanforest.flows._runner import open_store

        st = open_store(store, mode="r")
        summary = st.info()
        if scans:
            summary["scan_list"] = [{"scan_id": sid, "points": st.attrs(sid).get("n_points", 0),
                                     "format": st.attrs(sid).get("format"),
                                     "stages": sorted(st.attrs(sid).get("stages", {}))} for sid in st.scans()]
        if as_json:
            summary["quarantine"] = st.quarantined()
            typer.echo(json.dumps(summary, indent=2, default=str))
            return
        flat = {k: (", ".join(f"{n} {c}" for n, c in v.items()) if isinstance(v, dict) and
                    all(isinstance(c, (int, float)) for c in v.values()) else len(v) if k == "incomplete" else v)
                for k, v in summary.items() if k != "scan_list"}
        print_summary(f"store {store}", flat)
        for row in summary.get("scan_list", []):
            typer.echo(f"{row['scan_id']}\t{row['points']:>10,}\t{row['format']}\t{','.join(row['stages'])}")
        for q in st.quarantined():
            typer.secho(f"quarantined: {q['source']}: {q['reason']}", fg=typer.colors.YELLOW)

    @app.command()
    def demo(
        workdir: Path = typer.Option(Path("scanforest-demo"), callback=output_folder,
                                     help="Folder for the synthetic archive and the store."),
        scenes: int = typer.Option(6, help="Synthetic scenes."),
        models: int = typer.Option(4, help="Library models."),
        points: int = typer.Option(60_000, help="Points per scene."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
    ):
        """End to end on synthetic data: an archive (with one corrupt file) -> ingest -> describe -> index -> match
        -> recognize, with precision and recall against the ground truth."""
        from scanforest.flows._runner import cluster_scope
        from scanforest.flows.ingest import run_ingest
        from scanforest.tasks.synth import corrupt_copy, write_archive

        dev = choose_device(device)
        t0 = time.perf_counter()
        archive = workdir / "archive"
        made = write_archive(archive, n_models=models, n_scenes=scenes, points_per_scene=points)
        corrupt_copy(made["scenes"][0], archive / "scenes" / "broken_scan.pcd", 0.4)
        typer.echo(f"synthetic archive: {len(made['models'])} models, {len(made['scenes'])} scenes "
                   f"(+1 corrupt file) in {archive} ({time.perf_counter() - t0:.1f} s)")
        store = workdir / "store.zarr"
        with cluster_scope(device=dev, workers=workers):  # the stages share one local cluster
            summary = run_ingest(str(archive), str(store), scheduler=scheduler, workers=workers)
            print_summary(f"ingest {archive} -> {store}", summary)
            _demo_stages(store, dev, scheduler, workers)


def _demo_stages(store: Path, device: str, scheduler: str | None = None, workers: int | None = None) -> None:
    """Later stages of the demo on the ingested store: one pipeline, as the archive flow runs it
    (the library first, the scenes described as recognition describes them and matched against an
    index over the library, recognition from those stored outputs), on ``scheduler``'s cluster or
    a local one of ``workers`` workers."""
    from scanforest.flows.describe import run_describe
    from scanforest.flows.match import run_index_build, run_match
    from scanforest.flows.recognize import run_recognize
    from scanforest.kernels.backend import resolve_device
    from scanforest.kernels.synthetic.scenes import recognition_presets
    from scanforest.tasks.recognize import build_library, describe_params_for
    from scanforest.tasks.store import ScanStore

    info = ScanStore(str(store), mode="r").info()
    typer.echo(f"store {store}: {info['scans']} scans, {info['points']:,} points, "
               f"{info['quarantined']} quarantined")
    st = ScanStore(str(store), mode="r")
    models = [s for s in st.scans() if s.startswith("models__")]
    scenes = [s for s in st.scans() if not s.startswith("models__")]
    lib_params, rec_params = recognition_presets(resolve_device(device))
    t0 = time.perf_counter()
    lib = build_library(str(store), models, name="demo", params=lib_params, device=device)
    typer.echo(f"library 'demo': {len(models)} models described through rendered views "
               f"({lib['status']}, {time.perf_counter() - t0:.1f} s)")
    # the scenes, with the parameters recognition describes them with (synthetic models are ~0.15-0.25 m across)
    cluster = dict(scheduler=scheduler, workers=workers)
    d = run_describe(str(store), scans=scenes, params=describe_params_for(rec_params, lib_params), device=device,
                     **cluster)
    typer.echo(f"describe: {d['described']} scenes described ({d['skipped']} already done), "
               f"{d['keypoints']:,} keypoints with SHOT352 in {d['seconds']:.1f} s on {d['workers']} workers")
    b = run_index_build(str(store), None, library="demo", name="models", shards=2,
                        params={"method": "exact"})  # a few thousand rows: brute force wins
    typer.echo(f"index 'models': {b['n']:,} reference descriptors of the library 'demo', "
               f"{b.get('shards', 2)} shards ({b['status']})")
    m = run_match(str(store), k=4, name="models", device=device, progress=True, **cluster)
    typer.echo(f"match: {m['queries']:,} scene descriptors x top-{m['k']} over {m['shards']} shards "
               f"on {m['workers']} workers in {m['seconds']:.1f} s")
    r = run_recognize(str(store), models, library="demo", device=device, progress=True, render=False,
                      library_params=lib_params, params=rec_params, **cluster)
    pr = (f"precision {r['precision']:.2f}, recall {r['recall']:.2f} against the ground truth"
          if "precision" in r else "no ground truth")
    typer.echo(f"recognize: {r['scenes']} scenes, {r.get('detections', 0)} detections of {len(models)} models "
               f"in {r['scenes_seconds']:.1f} s on {r['workers']} workers; {pr}")
    typer.echo(f"recognize: {r['from_stored']} scenes from their stored description and matches, "
               f"{r['recomputed']} described and matched again"
               + "".join(f"; {n}: {why}" for why, n in r.get("recompute_reasons", {}).items()))
    failed = d.get("failures", []) + r.get("failures", [])
    for f in failed:
        typer.secho(f"failed: {f['scan_id']}: {f['reason']}", fg=typer.colors.RED, err=True)
    if failed:
        raise typer.Exit(1)
    typer.echo(f"detections: scanforest report {store}  (HTML report with plots)")
