"""Core commands: ingest, info, demo (``bench ingest`` is :mod:`scanforest.deploy.bench.ingest`)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import typer

from scanforest.flows.cluster import check_scheduler, check_workers

from ._store import existing_store, new_store, output_folder


def _scheduler(address: Optional[str]) -> Optional[str]:
    """--scheduler checked as it is parsed: an unreachable one is said in one line, also by a
    command that turns out to have nothing to do."""
    check_scheduler(address)
    return address


def _device(device: str) -> str:
    """--device checked as it is parsed, also when there is nothing to do: a mistyped name, and
    ``gpu`` asked for by name where no GPU is usable (the same command failed with work to do and
    answered 0 without); ``auto`` asks nothing here."""
    from scanforest.kernels.backend import DEVICES
    from scanforest.kernels.errors import InputError

    if str(device).lower() not in DEVICES:
        raise InputError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if str(device).lower() == "gpu":
        from scanforest.kernels.backend import resolve_device

        resolve_device("gpu")  # the one-line reason where CuPy or a device is missing
    return device


def number(param: typer.CallbackParam, value):
    """The callback of every ``int`` and ``float`` option: its value checked by the option's rule
    (:data:`scanforest.tasks.options.OPTIONS`) as it is parsed, so a bad one is one line naming the
    option, exit 2, before any flow, cluster or Prefect API starts (an ``rf_rad`` or a ``k`` of a
    worker's kernel, 5-9 s in, with a failed run recorded in the store)."""
    from scanforest.tasks.options import check_option

    return check_option(next((o for o in param.opts if o.startswith("--")), param.opts[0]), value)


SchedulerOpt = typer.Option(None, "--scheduler", callback=_scheduler, help="Address of an existing Dask scheduler "
                            "(tcp://host:8786); default: a local cluster started for this command.")
WorkersOpt = typer.Option(None, "--workers", "-w", callback=check_workers,
                          help="Local Dask workers (default: one per core, at most 8; on a GPU host 8 per GPU).")
#: STORE of the commands that write into an existing store, checked as it is parsed (see ``_store``)
StoreArg = typer.Argument(..., callback=existing_store, help="The Zarr scan store.")
DeviceOpt = typer.Option("auto", "--device", callback=_device, help="auto | cpu | gpu: auto uses the GPU when one is visible.")


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
#: the COPC query of ``ingest`` and ``archive`` (:func:`scanforest.tasks.las.copc_settings`)
CopcLevelOpt = typer.Option(None, "--copc-level", callback=number,
                            help="COPC files: keep the octree's levels 0..L (a decimated cloud); default all.")
CopcResolutionOpt = typer.Option(None, "--copc-resolution", callback=number,
                                 help="COPC files: keep the levels that give this point spacing (laspy's rule).")
BoundsOpt = typer.Option(None, "--bounds", help="COPC files: keep the points in xmin,ymin,zmin,xmax,ymax,zmax "
                         "(a file with none there is counted 'outside', not quarantined).")


def _cell(key: str, value) -> str:
    """A figure as a person reads it: thousands separated, 3-4 significant digits, units."""
    if key in ("precision", "recall") and value is None:
        return "n/a"
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


def _ratio(x) -> str:
    """A precision or recall as read: two decimals, "n/a" where it is undefined (no detections,
    no true instances)."""
    return "n/a" if x is None else f"{x:.2f}"


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
        # notes are lines of their own (ingest's ignored files go to stderr): not table rows too
        if key not in summary or isinstance(value, (list, dict)) or key.startswith("_") or key.endswith("_note"):
            continue
        table.add_row(key.replace("_", " "), _cell(key, value))
    Console(soft_wrap=True).print(table)
    for q in summary.get("quarantine_reasons", []):
        typer.secho(f"quarantined: {q['source']}: {q['reason']}", fg=typer.colors.YELLOW)
    for f in summary.get("failures", []):
        typer.secho(f"failed: {f['scan_id']}: {f['reason']}", fg=typer.colors.YELLOW)
    if summary.get("staging_note"):
        typer.echo(f"note: {summary['staging_note']}")


INGEST_KEYS = ("files", "ingested", "skipped", "quarantined", "outside", "ignored", "points", "bytes", "seconds",
               "workers")


def warn_box_origin(summary: dict, noun: str) -> None:
    """One warning line when a summary counts scans georeferenced with no file offset (ingest
    chose their origin from their bounding box: ``box_origin``, ``box_origin_scans``)."""
    n = summary.get("box_origin")
    if n:
        typer.echo(f"warning: {n} {noun}{'s' if n != 1 else ''} in georeferenced coordinates without a file offset near "
                   f"the points (first: {summary['box_origin_scans'][0]}): computed about the bounding box's centre "
                   "(rounded to 1 m; a LAS header's offset is taken only within 1024 m of every point), which the "
                   "normals face instead of the scanner, so detections may be missed; give the scanner's "
                   "position as \"origin\" in the scan's sidecar (NAME.gt.json beside the file) and ingest it again")


def exit_if_failed(summary: dict) -> None:
    """Exit 1 when some scans (scenes, pairs) of a batch failed: the others were done and
    recorded, the summary said which failed and why; a script or a scheduler sees it."""
    if summary.get("failed"):
        raise typer.Exit(1)


def note_replaced(summary: dict) -> None:
    """One line where a recognition replaced another library's detections (``replaced_note``)."""
    if summary.get("replaced_note"):
        typer.secho(f"note: {summary['replaced_note']}", fg=typer.colors.YELLOW)


def note_no_detections(summary: dict, params: dict | None, store: str | None = None,
                       scenes: list[str] | None = None, library_params: dict | None = None,
                       library: str | None = None) -> None:
    """One line where recognised scenes gave no detection: the stage that lost them, the
    scenes' file grid where it is coarse enough to be why (``store``'s ``scenes``: a LAS scale
    :func:`~scanforest.kernels.coordinates.grid_hint` names), and models of another unit than
    the scenes (:func:`scale_hint`, ``library``'s models)."""
    from scanforest.flows.summaries import no_detections_note

    line = no_detections_note(summary, params)
    if line and store is not None:
        from scanforest.kernels.coordinates import grid_hint
        from scanforest.tasks.recognize import LIBRARY_DEFAULTS
        from scanforest.tasks.store import ScanStore

        st = ScanStore(store, mode="r")
        grids = st.coordinate_grids(scenes)
        lp = {**LIBRARY_DEFAULTS, **{k: v for k, v in (library_params or {}).items() if v is not None}}
        hint = grid_hint(max(grids.values()), {k: lp.get(k) for k in ("descr_rad", "rf_rad")}) if grids else None
        try:  # a hint never costs the command its result
            scale = scale_hint(st, scenes, library)
        except Exception:  # noqa: BLE001
            scale = None
        for h in (hint, scale):
            if h:
                line += f"; {h}"
    if line:
        typer.echo(f"note: {line}")


#: :func:`scale_hint` reads the sizes of at most this many scenes
SCALE_HINT_SCENES = 200


def scale_hint(st, scenes: list[str] | None, library: str | None) -> str | None:
    """Where the library's models are of another unit than the scenes: their recorded units
    differ (``ingest --units`` records a unit, it converts nothing), or the models are larger
    than the scenes they are looked for in (a CAD model in millimetres against scans in metres:
    0 correspondences, and the note asked only about radii). None otherwise, and where the
    sizes are not known."""
    import statistics

    try:
        models = list(st.catalog.library_attrs(library or "default").get("model_scans") or [])
    except Exception:  # noqa: BLE001 - no library: nothing to compare
        return None
    if scenes is None:
        model_set = set(models)
        scenes = [s for s in st.scans() if s not in model_set]
    scenes = list(scenes)[:SCALE_HINT_SCENES]

    def sizes(ids):
        out, units = [], set()
        for sid in ids:
            a = st.attrs(sid)
            units.add(a.get("units"))
            box = a.get("bbox") or {}
            lo, hi = box.get("min"), box.get("max")
            if lo is not None and hi is not None:
                out.append(max(float(h) - float(v) for v, h in zip(lo, hi)))
        return out, units - {None}

    (m, mu), (s, su) = sizes(models), sizes(scenes)
    if mu and su and mu != su:
        return (f"the models were ingested in {', '.join(sorted(mu))} and the scenes in {', '.join(sorted(su))} "
                "(--units records the unit and converts nothing: convert one of them)")
    if m and s and statistics.median(m) > 3 * statistics.median(s):
        mm, ss = statistics.median(m), statistics.median(s)
        return (f"the models ({mm:.4g} across) are {mm / ss:.3g} times the size of the scenes ({ss:.4g} across): "
                "are they in another unit (millimetres against metres)?")
    return None


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command()
    def ingest(
        source: str = typer.Argument(..., help="A folder, a glob ('scans/**/*.pcd') or an archive (.tar, .tar.gz, .zip)."),
        store: str = typer.Argument(..., callback=new_store, help="The Zarr scan store (created if missing; "
                                    "its folder must exist)."),
        units: str = typer.Option("m", help="Length unit recorded for the scans."),
        copc_level: Optional[int] = CopcLevelOpt,
        copc_resolution: Optional[float] = CopcResolutionOpt,
        bounds: Optional[str] = BoundsOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
        as_json: bool = JsonOpt,
    ):
        """Ingest scans (PCD, PLY, LAS/LAZ, COPC, XYZ/CSV, NPY, E57) into a Zarr v3 store; resumable.

        Unchanged files already in the store are skipped (a COPC file also when read with the same
        query); unreadable files are quarantined with the reason and the batch goes on.
        """
        from scanforest.flows.inputs import check_ingest

        # a bad source or COPC query answered before the flow (and Prefect) is imported
        copc = check_ingest(source, store, {"level": copc_level, "resolution": copc_resolution, "bounds": bounds})
        from scanforest.flows.ingest import run_ingest

        summary = run_ingest(source, store, scheduler=scheduler, workers=workers, units=units, progress=not as_json,
                             copc=copc)
        print_summary(f"ingest {source} -> {store}", summary, as_json=as_json, keys=INGEST_KEYS)
        if not as_json:
            warn_box_origin(summary, "scan")

    @app.command()
    def info(store: str = typer.Argument(..., help="The Zarr scan store."),
             scans: bool = typer.Option(False, "--scans", help="List every scan: id, points, format, stages, "
                                        "the file it came from."),
             as_json: bool = JsonOpt):
        """Summarise a store: scans, points, formats, stages done, quarantine, runs."""
        from scanforest.flows.inputs import open_store

        st = open_store(store, mode="r")
        summary = st.info()
        if scans:  # each scan's attributes read once; its source file beside its id (ids are ASCII-safe)
            summary["scan_list"] = [{"scan_id": sid, "points": a.get("n_points", 0), "format": a.get("format"),
                                     "stages": sorted(a.get("stages", {})), "source": a.get("source")}
                                    for sid, a in ((sid, st.attrs(sid)) for sid in st.scans())]
        if as_json:
            summary["quarantine"] = st.quarantined()
            typer.echo(json.dumps(summary, indent=2, default=str))
            return
        flat = {k: (", ".join(f"{n} {c}" for n, c in v.items()) if isinstance(v, dict) and
                    all(isinstance(c, (int, float)) for c in v.values()) else len(v) if k == "incomplete" else v)
                for k, v in summary.items() if k != "scan_list"}
        print_summary(f"store {store}", flat)
        for row in summary.get("scan_list", []):
            typer.echo(f"{row['scan_id']}\t{row['points']:>10,}\t{row['format']}\t{','.join(row['stages'])}"
                       f"\t{row['source'] or ''}")
        for q in st.quarantined():
            typer.secho(f"quarantined: {q['source']}: {q['reason']}", fg=typer.colors.YELLOW)

    @app.command()
    def demo(
        workdir: Optional[Path] = typer.Option(None, callback=_demo_workdir,
                                               help="Folder for the synthetic archive and the store (default: "
                                               "$XDG_CACHE_HOME/scanforest/demo, i.e. ~/.cache/scanforest/demo; "
                                               "a rerun on the same folder resumes it)."),
        scenes: int = typer.Option(6, callback=number, help="Synthetic scenes."),
        models: int = typer.Option(4, callback=number, help="Library models."),
        points: int = typer.Option(60_000, callback=number, help="Points per scene."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
    ):
        """End to end on synthetic data, as the archive flow runs an archive: a synthetic archive (with one
        corrupt file) -> ingest -> model library -> index -> one pass of describe + match + recognize per scene,
        with precision and recall against the ground truth. Exit 0 only when every stage did all its work."""
        from scanforest.flows.archive import run_archive
        from scanforest.kernels.synthetic.scenes import (SYNTHETIC_LIBRARY_LIGHT, SYNTHETIC_RECOGNIZE_LIGHT,
                                                         recognition_presets)
        from scanforest.tasks.synth import corrupt_copy, write_archive

        dev = choose_device(device)
        typer.echo(f"demo folder: {workdir} (the synthetic archive and the store; a rerun resumes it)")
        t0 = time.perf_counter()
        archive = workdir / "archive"
        made = write_archive(archive, n_models=models, n_scenes=scenes, points_per_scene=points)
        broken = archive / "scenes" / "broken_scan.pcd"
        corrupt_copy(made["scenes"][0], broken, 0.4)
        typer.echo(f"synthetic archive: {len(made['models'])} models, {len(made['scenes'])} scenes "
                   f"(+1 corrupt file) in {archive} ({time.perf_counter() - t0:.1f} s)")
        store = workdir / "store.zarr"
        if points < DEMO_SPARSE_BELOW:
            lib_params, rec_params = recognition_presets(dev, points)
        else:  # the light presets on any device (DEMO_SPARSE_BELOW's note)
            lib_params, rec_params = SYNTHETIC_LIBRARY_LIGHT, SYNTHETIC_RECOGNIZE_LIGHT
        t0 = time.perf_counter()
        # the archive flow, as a served `archive` deployment and `bench archive` run it: ingest, the
        # library, an index over it, then ONE pass over the scenes (describe + match + recognize)
        out = run_archive(store=str(store), source=str(archive), models="models__*", index="models",
                          library="demo", index_params=DEMO_INDEX, shards=1, k=4,
                          library_params=lib_params, recognize=rec_params, device=dev, scheduler=scheduler,
                          workers=workers, progress=True, pipeline="one-pass")
        _demo_report(store, out, made, broken, time.perf_counter() - t0)


#: scenes of fewer points get the sparse presets in the demo (the light ones otherwise). 6 scenes,
#: 18 instances, CPU, 2026-11-28, precision / recall light vs sparse: 12k points 0 detections vs
#: 0.90 / 0.50; 20k 0.92 / 0.61 vs 0.89 / 0.89; 30k 0.94 / 0.83 vs 0.78 / 1.00; 60k (the default)
#: 0.89 / 0.94 vs 0.67 / 0.89. From this size up the demo takes the light presets on a GPU too: the
#: GPU's own (tuned on 300k-point scenes) found 13 of the 6 default scenes' 18 instances (precision
#: 0.93, recall 0.72, one H100 and the CPU alike), the light ones 17 (0.94 / 0.94), 2026-12-07
DEMO_SPARSE_BELOW = 25_000

#: the demo's index over its model library: the exact search. A KD-tree with a budget (P-ANNS,
#: leaf 32, 64 leaves) gave the same 19 detections and a faster pass once compiled (31.7 vs 43.6 s
#: on 2 cores), but a first run compiles the tree's kernels too: a fresh clone's demo took 154 s
#: instead of 124 s (2026-11-27), and the demo is mostly a first run
DEMO_INDEX = {"method": "exact"}


def demo_folder() -> Path:
    """The demo's default folder: ``$XDG_CACHE_HOME/scanforest/demo`` (``~/.cache/...`` without it),
    never the current folder (a clone's work tree)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "scanforest" / "demo"


def _demo_workdir(folder: Optional[Path]) -> Path:
    """``--workdir`` callback: the folder given, or :func:`demo_folder`, checked as it is parsed
    (``_store.output_folder``), as an absolute path."""
    from scanforest.flows.inputs import absolute_path

    folder = output_folder(folder if folder is not None else demo_folder())
    return Path(absolute_path(str(folder)))


def _demo_report(store: Path, out: dict, made: dict, broken: Path, seconds: float) -> None:
    """Print what each stage of the demo's archive run did, then check the README's promise against
    the store: ingest quarantined exactly the corrupt file and holds every other one, the library and
    its index are there, and every scene is described, matched and recognised with no failure. Any
    shortfall is named on stderr and the command exits 1."""
    from scanforest.tasks.store import ScanStore

    ing, lib, ix, p = out["ingest"], out["library"], out["index-build"], out["process"]
    print_summary(f"ingest -> {store}", ing, keys=INGEST_KEYS)
    st = ScanStore(str(store), mode="r")
    info = st.info()
    typer.echo(f"store {store}: {info['scans']} scans, {info['points']:,} points, {info['quarantined']} quarantined")
    n_models = len(made["models"])
    typer.echo(f"library 'demo': {n_models} models described through rendered views ({lib['status']})")
    typer.echo(f"index 'models': {ix['n']:,} reference descriptors of the library 'demo' ({ix['status']})")
    typer.echo(f"one pass over {p['scenes']} scenes (describe + match + recognize each, as the archive flow runs "
               f"them): {p['described']} described, {p['matched']} matched, {p['recognized']} recognised, "
               f"{p['skipped']} already done, in {p['scenes_seconds']:.1f} s on {p['workers']} workers")
    pr = (f"precision {_ratio(p['precision'])}, recall {_ratio(p['recall'])} against the ground truth"
          if "tp" in p else "no ground truth")
    typer.echo(f"recognize: {p['scenes']} scenes, {p.get('detections', 0)} detections of {n_models} models "
               f"in {p['scenes_seconds']:.1f} s on {p['workers']} workers; {pr}")
    typer.echo(f"recognize: {p['from_stored']} scenes from their stored description and matches, "
               f"{p['recomputed']} described and matched again"
               + "".join(f"; {n}: {why}" for why, n in p.get("recompute_reasons", {}).items()))
    for f in p.get("failures", []):
        typer.secho(f"failed: {f['scan_id']}: {f['reason']}", fg=typer.colors.RED, err=True)

    problems = []
    quarantined = [q.get("source", "") for q in st.quarantined()]
    if len(quarantined) != 1 or not quarantined[0].endswith(broken.name):
        problems.append(f"ingest quarantined {quarantined or 'nothing'}, not exactly the corrupt file {broken.name}")
    ids = st.scans()
    model_ids = [s for s in ids if s.startswith("models__")]
    scene_ids = [s for s in ids if not s.startswith("models__")]
    if len(model_ids) != n_models or len(scene_ids) != len(made["scenes"]):
        problems.append(f"the store holds {len(model_ids)} models and {len(scene_ids)} scenes, not the archive's "
                        f"{n_models} and {len(made['scenes'])}")
    if lib.get("status") not in ("built", "unchanged") or lib.get("models") != n_models:
        problems.append(f"the library has {lib.get('models')} of {n_models} models ({lib.get('status')})")
    if ix.get("status") not in ("built", "unchanged") or not ix.get("n"):
        problems.append(f"the index over the library has {ix.get('n', 0)} rows ({ix.get('status')})")
    if p.get("failed"):
        problems.append(f"{p['failed']} scenes failed")
    for stage in ("describe", "match", "recognize"):
        missing = [s for s in scene_ids if not st.has_stage(s, stage)]
        if missing:
            problems.append(f"{len(missing)} scenes lack the {stage} stage ({', '.join(missing[:3])})")
    if "tp" not in p:
        problems.append("no precision/recall: the scenes' ground truth is missing")
    elif p["precision"] is None or p["recall"] is None:
        problems.append(f"precision {_ratio(p['precision'])}, recall {_ratio(p['recall'])}: no detections "
                        "or no ground-truth instances")
    if problems:
        for line in problems:
            typer.secho(f"demo: {line}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    typer.echo(f"demo: every stage did all its work in {seconds:.1f} s; the store: {store}")
    typer.echo(f"report: scanforest report {store}  (HTML report with plots, written beside the store)")
