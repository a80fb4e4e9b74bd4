"""Pipeline commands over a store: archive, describe, index build, match, align-store, recognize."""
from __future__ import annotations

from typing import Optional

import typer

from ._store import new_store
from .core import (
    INGEST_KEYS,
    BoundsOpt,
    CopcLevelOpt,
    CopcResolutionOpt,
    DeviceOpt,
    JsonOpt,
    SchedulerOpt,
    StoreArg,
    WorkersOpt,
    choose_device,
    exit_if_failed,
    note_replaced,
    note_no_detections,
    number,
    print_summary,
    warn_box_origin,
)


def _check_export(export: str | None) -> None:
    """``--export`` names a folder that can be made and written: said before the work (an
    existing file there was a traceback after the recognition)."""
    if export:
        import os

        from scanforest.kernels.errors import InputError
        from scanforest.tasks.preflight import check_output_folder

        try:
            check_output_folder(os.path.abspath(export))
        except InputError as exc:
            raise InputError(f"--export: {exc}") from None


#: the recognition options of ``recognize`` and ``archive`` (PCL tutorial values)
SceneSsOpt = typer.Option(0.03, callback=number, help="Scene keypoint sampling (0.03).")
MethodOpt = typer.Option("hough", help="hough | gc.")
CgSizeOpt = typer.Option(0.01, callback=number, help="Hough bin / GC consensus size (0.01).")
CgThreshOpt = typer.Option(5, callback=number, help="Hough / GC threshold (5).")


def _pick(store: str, patterns: list[str], what: str) -> list[str]:
    """Scan ids of the store matching any of the glob ``patterns``; none is a user error."""
    import fnmatch

    from scanforest.flows.inputs import open_store, resolve_scan_names

    st = open_store(store, mode="r")
    ids = st.scans()
    patterns = resolve_scan_names(st, patterns)  # a file's own name for its scan's id
    chosen = sorted({s for pat in patterns for s in ids if fnmatch.fnmatchcase(s, pat)})
    if not chosen:
        from scanforest.kernels.errors import InputError

        raise InputError(f"{store}: no scan id matches {what} {' '.join(patterns)}")
    return chosen


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command()
    def describe(
        store: str = StoreArg,
        scan: Optional[list[str]] = typer.Option(None, "--scan",
                                                 help="Only these scans (repeatable): ids, or the files' own names."),
        normal_k: int = typer.Option(10, callback=number, help="Normals from the k nearest points (PCL tutorial: 10)."),
        normal_radius: Optional[float] = typer.Option(None, callback=number,
                                                      help="Normals from a radius instead of k."),
        keypoint_radius: Optional[float] = typer.Option(0.03, callback=number,
                                                        help="Uniform-sampling leaf size; 0 = every point."),
        shot_radius: float = typer.Option(0.02, callback=number, help="SHOT support radius (store units)."),
        approximate: bool = typer.Option(False, help="G-SHOT approximate mode (neighbour lists capped at the median)."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
        as_json: bool = JsonOpt,
    ):
        """Normals, keypoints, local reference frames and SHOT352 for every scan; resumable."""
        from scanforest.flows.noop import quick_describe
        from scanforest.tasks.describe import DescribeParams

        params = DescribeParams(normal_k=None if normal_radius else normal_k, normal_radius=normal_radius,
                                keypoint_radius=keypoint_radius or None, shot_radius=shot_radius,
                                approximate=approximate)
        if scan:  # a file's own name for its scan's id
            from scanforest.flows.inputs import open_store, resolve_scan_names

            scan = resolve_scan_names(open_store(store, mode="r"), scan)
        summary = quick_describe(store, scan, params)  # nothing to do: answered before Prefect or Dask start
        if summary is None:
            from scanforest.flows.inputs import check_describe

            check_describe(store, scan)  # a user error answered before the flow (and Prefect) is imported
            from scanforest.flows.describe import run_describe

            dev = choose_device(device)
            summary = run_describe(store, scans=scan, params=params, device=dev, scheduler=scheduler,
                                   workers=workers, progress=not as_json)
        print_summary(f"describe {store}", summary, as_json=as_json,
                      keys=("scans", "described", "skipped", "failed", "keypoints", "seconds", "workers"))
        exit_if_failed(summary)

    index_app = typer.Typer(help="Nearest-neighbour indexes over stored descriptors.", no_args_is_help=True)
    app.add_typer(index_app, name="index")

    @index_app.command("build")
    def index_build(
        store: str = StoreArg,
        reference: Optional[list[str]] = typer.Option(
            None, "--reference", "-r",
            help="Reference scan ids or glob patterns on ids (repeatable), e.g. 'models__*'."),
        library: Optional[str] = typer.Option(
            None, "--library", "-l",
            help="Index the model library NAME of the store instead of scans (the rows recognition matches "
                 "against: `recognize` then uses this index's matches instead of matching again)."),
        name: str = typer.Option("default", help="Index name."),
        shards: str = typer.Option("1", help="Shards (one per GPU worker), or 'auto': one per local GPU, "
                                   "checked against their memory before anything is written."),
        method: str = typer.Option("banns", help="banns | anns | exact."),
        leaf_size: int = typer.Option(64, callback=number, help="KD-tree leaf size."),
        backtracks: Optional[int] = typer.Option(None, callback=number,
                                                 help="Leaf visits per query (None = exact search)."),
        recall: Optional[float] = typer.Option(None, "--recall", callback=number,
                                               help="Target recall@k in (0, 1) instead of "
                                               "--backtracks: each shard calibrates its leaf budget on its own "
                                               "rows (per k, at its first search)."),
        random_dims: Optional[int] = typer.Option(None, callback=number,
                                                  help="Randomized split among the F widest dimensions."),
        seed: int = typer.Option(0, callback=number),
        graph: Optional[int] = typer.Option(None, "--graph", callback=number,
                                            help="Also a neighbour graph of this many neighbours "
                                            "a row in every shard: a search with a budget walks it from the "
                                            "forest's answer (more found at the same budget; its build searches "
                                            "every row, ~10x the trees' time)."),
        graph_budget: int = typer.Option(128, "--graph-budget", callback=number,
                                         help="Leaves a row's graph search scans."),
        graph_expand: int = typer.Option(4, "--graph-expand", callback=number,
                                         help="List entries whose graph neighbours a round "
                                         "scores."),
        graph_rounds: int = typer.Option(2, "--graph-rounds", callback=number, help="Rounds of the walk."),
        dtype: str = typer.Option("float32", help="Stored rows: float32, or float16 (half the disk and host "
                                  "memory; searches are exact for the rounded rows)."),
        device: str = DeviceOpt,
        as_json: bool = JsonOpt,
    ):
        """Build a sharded KD-forest index over the SHOT descriptors of the reference scans, or of a model
        library (kept when unchanged)."""
        from scanforest.flows.inputs import check_index_build
        from scanforest.kernels.errors import InputError

        if (library is None) == (not reference):
            raise InputError("give the index's reference: --reference SCANS or --library NAME (one of them)")
        chosen = _pick(store, reference, "--reference") if reference else None
        params = {"method": method, "leaf_size": leaf_size, "backtracks": backtracks,
                  "random_dims": random_dims, "seed": seed, **({} if recall is None else {"recall": recall}),
                  **({} if graph is None else {"graph_degree": graph, "graph_budget": graph_budget,
                                               "graph_expand": graph_expand, "graph_rounds": graph_rounds})}
        check_index_build(store, chosen, shards, params, dtype, library=library, name=name)
        from scanforest.flows.match import run_index_build

        res = run_index_build(store, chosen, name=name, params=params, device=choose_device(device),
                              shards=shards if shards == "auto" else int(shards), dtype=dtype, library=library)
        print_summary(f"index {name!r} in {store}", res, as_json=as_json)

    @app.command("match")
    def match_cmd(
        store: str = StoreArg,
        queries: Optional[list[str]] = typer.Option(None, "--queries", "-q",
                                                    help="Query scan ids or glob patterns (default: every described non-reference scan)."),
        k: int = typer.Option(4, "-k", callback=number, help="Neighbours per descriptor (P)."),
        name: Optional[str] = typer.Option(None, help="Index name (default: 'default')."),
        library: Optional[str] = typer.Option(
            None, "--library", "-l", help="Match against the index over this model library (`scanforest library "
                                          "build` makes it): the matches `recognize --library NAME` takes."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
        as_json: bool = JsonOpt,
    ):
        """Match query scans' descriptors against an index on the Dask cluster; writes match_ids/match_dist."""
        from scanforest.flows.noop import quick_match
        from scanforest.kernels.errors import InputError

        if library is not None and name is not None:
            raise InputError("give the index by --name INDEX or by --library NAME, not both")
        if library is not None:
            from scanforest.flows.inputs import library_index_for_match

            name = library_index_for_match(store, library)
        name = name or "default"
        chosen = _pick(store, queries, "--queries") if queries else None
        res = quick_match(store, chosen, k, name)  # nothing to do: answered before Prefect or Dask start
        if res is None:
            from scanforest.flows.inputs import check_match

            check_match(store, chosen, k, name)
            from scanforest.flows.match import run_match

            dev = choose_device(device)
            res = run_match(store, queries=chosen, k=k, name=name, device=dev, scheduler=scheduler,
                            workers=workers, progress=not as_json)
        if library is not None:
            res = {"library": library, "index": name, **res}
        title = f"library {library!r} (index {name!r})" if library is not None else f"index {name!r}"
        print_summary(f"match {store} against {title}", res, as_json=as_json,
                      keys=("scans", "matched", "queries", "k", "shards", "seconds", "workers"))
        exit_if_failed(res)

    @app.command("align-store")
    def align_store(
        store: str = StoreArg,
        pair: list[str] = typer.Option(..., "--pair", help="OBSERVED:REFERENCE scan ids (repeatable)."),
        model: str = typer.Option("rigid", help="2-D: euclidean|similarity|affine|projective; 3-D: rigid|similarity|affine."),
        chain: bool = typer.Option(False, help="Coarse-to-fine chain of models ending at --model."),
        loss: str = typer.Option("l2", help="l2 | huber."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
        as_json: bool = JsonOpt,
    ):
        """Parametric chamfer alignment for a batch of scan pairs in the store (results stored per scan)."""
        from scanforest.flows.inputs import check_align

        pairs = []
        for p in pair:
            if ":" not in p:
                from scanforest.kernels.errors import InputError

                raise InputError(f"--pair takes OBSERVED:REFERENCE (two scan ids), got {p!r}")
            pairs.append(p.split(":", 1))
        check_align(store, pairs)
        from scanforest.flows.align import run_align

        dev = choose_device(device)
        res = run_align(store, pairs, model=model, chain=chain, loss=loss, device=dev, scheduler=scheduler,
                        workers=workers, progress=not as_json)
        print_summary(f"align-store {store}", res, as_json=as_json)
        if not as_json:
            for r in res.get("results", []):
                if r.get("status") != "failed":
                    typer.echo(f"{r.get('scan_id', '?')} -> {r.get('reference', '?')}: {r.get('status')}"
                               + (f", {r['iterations']} iterations" if "iterations" in r else ""))
        exit_if_failed(res)

    @app.command("archive")
    def archive_cmd(
        source: str = typer.Argument(..., help="Folder, glob, tar or zip of scans: the models under "
                                               "models/ (or as --models picks them), the scenes elsewhere."),
        store: str = typer.Argument(..., callback=new_store, help="The Zarr scan store (created if missing; "
                                    "its folder must exist)."),
        models: str = typer.Option("models__*", "--models", "-m",
                                   help="Glob of the model scans' ids (a file models/milk.pcd is models__milk.pcd; "
                                   "a pattern that starts with a folder also takes it inside an archive or folder: "
                                   "ARCHIVE__models__NAME)."),
        library: str = typer.Option("default", help="Library name in the store."),
        model_ss: Optional[float] = typer.Option(None, callback=number,
                                                 help="Model keypoint sampling (the PCL tutorial's 0.01)."),
        scene_ss: float = SceneSsOpt,
        rf_rad: Optional[float] = typer.Option(None, callback=number, help="Hough reference-frame radius (0.015)."),
        descr_rad: Optional[float] = typer.Option(None, callback=number, help="SHOT radius (0.02)."),
        method: str = MethodOpt,
        cg_size: float = CgSizeOpt,
        cg_thresh: float = CgThreshOpt,
        export: Optional[str] = typer.Option(None, help="Folder for detections.csv/.parquet (file coordinates)."),
        copc_level: Optional[int] = CopcLevelOpt,
        copc_resolution: Optional[float] = CopcResolutionOpt,
        bounds: Optional[str] = BoundsOpt,
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
        as_json: bool = JsonOpt,
    ):
        """The archive flow on your scans, as the `archive` deployment and the demo run it: ingest SOURCE
        into STORE (bad files quarantined), build the model library from the model scans and an index over
        it, then one pass over the scenes (describe + match + recognize each). Georeferenced scans (LAS/LAZ,
        E57) are computed in a local frame and their poses stored and exported in the file's coordinates.
        A rerun resumes: what is done is skipped."""
        from scanforest.flows.inputs import check_archive_models, check_recognize_params
        from scanforest.tasks.las import copc_settings

        library_params = {k: v for k, v in {"model_ss": model_ss, "descr_rad": descr_rad, "rf_rad": rf_rad}.items()
                          if v is not None}
        params = {"scene_ss": scene_ss, "method": method, "cg_size": cg_size, "cg_thresh": cg_thresh}
        check_recognize_params(library_params, params)  # before Prefect's API or any ingest starts
        _check_export(export)
        copc = copc_settings(level=copc_level, resolution=copc_resolution, bounds=bounds)
        check_archive_models(source, store, models)
        from scanforest.flows.archive import run_archive, stage_reports
        from scanforest.flows.recognize import export_results

        def ingest_table(stage: str, summary: dict) -> None:  # as ingest ends: kept if a later stage stops the run
            if stage == "ingest" and not as_json:
                print_summary(f"ingest {source} -> {store}", summary, keys=INGEST_KEYS)

        dev = choose_device(device)
        with stage_reports(ingest_table):
            out = run_archive(store=store, source=source, models=models, library=library, index="models",
                              library_params=library_params, recognize=params, device=dev, scheduler=scheduler,
                              workers=workers, progress=not as_json, pipeline="one-pass", copc=copc)
        p = out["process"]
        res = {"library": out["library"].get("status"), **{k: p.get(k) for k in (
                   "scenes", "recognized", "skipped", "failed", "detections", "precision", "recall", "workers")},
               "seconds": p.get("seconds"), "failures": p.get("failures"),
               **{k: p[k] for k in ("box_origin", "box_origin_scans") if k in p}}
        if as_json:
            res["ingest"] = out["ingest"]
        if export:
            from pathlib import Path

            from scanforest.flows.inputs import is_model
            from scanforest.tasks.store import ScanStore

            scenes = [s for s in ScanStore(store, mode="r").scans() if not is_model(s, models)]
            res["exports"] = export_results(store, scenes, Path(export), render=False, library=library)
        print_summary(f"one pass over the scenes of {store}", res, as_json=as_json)
        if not as_json:
            warn_box_origin(res, "scene")
            note_no_detections(p, params, store, library_params=library_params, library=library)
            note_replaced(p)
            if p.get("note"):
                typer.echo(f"note: {p['note']}")
        if not as_json and res.get("exports"):
            typer.echo("exported: " + ", ".join(f"{k} {v}" for k, v in res["exports"].items()))
        exit_if_failed(p)

    @app.command("recognize")
    def recognize_cmd(
        store: str = StoreArg,
        models: Optional[list[str]] = typer.Option(
            None, "--models", "-m", help="Model scan ids or glob patterns (repeatable); default: the models of "
                                         "the stored library --library (`scanforest library build`)."),
        scenes: Optional[list[str]] = typer.Option(None, "--scenes", "-s",
                                                   help="Scene scan ids or patterns (default: every non-model scan)."),
        library: str = typer.Option("default", help="Library name in the store."),
        model_ss: Optional[float] = typer.Option(None, callback=number,
                                                 help="Model keypoint sampling (default: the stored "
                                                 "library's, else the PCL tutorial's 0.01)."),
        scene_ss: float = SceneSsOpt,
        rf_rad: Optional[float] = typer.Option(None, callback=number,
                                               help="Hough reference-frame radius (the library's, else 0.015)."),
        descr_rad: Optional[float] = typer.Option(None, callback=number,
                                                  help="SHOT radius (the library's, else 0.02)."),
        voxel: Optional[float] = typer.Option(None, callback=number,
                                              help="Thin models and scenes first to one point per voxel of "
                                              "this edge (m), then polish each pose on the scene's own points; "
                                              "scale --scene-ss, --descr-rad, --cg-size with it (default: the "
                                              "stored library's; none)."),
        method: str = MethodOpt,
        cg_size: float = CgSizeOpt,
        cg_thresh: float = CgThreshOpt,
        export: Optional[str] = typer.Option(None, help="Folder for detections.csv/.parquet and renders/."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
        as_json: bool = JsonOpt,
    ):
        """Recognise library models in scenes: correspondences, grouping, GPU verification, ICP. A scene
        described (describe) and matched against the library's index (match --library) is recognised
        from those stored results; the summary says how many were, and why any others were recomputed."""
        from scanforest.flows.inputs import check_recognize
        from scanforest.tasks.recognize import resolve_library

        model_ids = _pick(store, models, "--models") if models else None
        scene_ids = _pick(store, scenes, "--scenes") if scenes else None
        # library parameters not given are the stored library's: a built library is used, not rebuilt
        model_ids, library_params = resolve_library(store, library, model_ids,
                                                    {"model_ss": model_ss, "descr_rad": descr_rad, "rf_rad": rf_rad,
                                                     "voxel": voxel})
        params = {"scene_ss": scene_ss, "method": method, "cg_size": cg_size, "cg_thresh": cg_thresh}
        if library_params.get("voxel") is not None:  # the scenes thinned as the library's models are
            params["scene_voxel"] = library_params["voxel"]
        check_recognize(store, model_ids, scene_ids, library_params, params)
        _check_export(export)
        from scanforest.flows.noop import quick_recognize

        # nothing to do (every scene's detections current): answered before Prefect's API or Dask start,
        # and exported from the store (it started both for 21 s)
        res = quick_recognize(store, model_ids, scene_ids, library, library_params, params)
        if res is not None and export:
            from pathlib import Path

            from scanforest.flows.recognize import export_results
            from scanforest.tasks.store import ScanStore

            ids = scene_ids if scene_ids is not None else [s for s in ScanStore(store, mode="r").scans()
                                                           if s not in set(model_ids)]
            res["exports"] = export_results(store, ids, Path(export), render=True, library=library)
        if res is None:
            from scanforest.flows.recognize import run_recognize

            dev = choose_device(device)
            res = run_recognize(store, model_ids, scenes=scene_ids, library=library, library_params=library_params,
                                params=params, device=dev, scheduler=scheduler, workers=workers, export=export,
                                progress=not as_json)
        print_summary(f"recognize in {store}", res, as_json=as_json,
                      keys=("scenes", "recognized", "skipped", "failed", "detections", "from_stored", "recomputed",
                            "precision", "recall", "seconds", "workers"))
        if not as_json:
            note_no_detections(res, params, store, scene_ids, library_params, library=library)
            note_replaced(res)
            for reason, n in res.get("recompute_reasons", {}).items():
                typer.echo(f"described and matched again ({n} scene{'s' if n != 1 else ''}): {reason}")
            listed = res.get("recomputed_scenes", {})
            for sid, reason in list(listed.items())[:10]:
                typer.echo(f"recomputed: {sid}: {reason}")
            if res.get("recomputed", 0) > 10:
                typer.echo(f"recomputed: ... and {res['recomputed'] - 10} more (`--json` or the run record)")
        if not as_json:
            warn_box_origin(res, "scene")
        if not as_json and res.get("exports"):
            typer.echo("exported: " + ", ".join(f"{k} {v}" for k, v in res["exports"].items()))
        exit_if_failed(res)
