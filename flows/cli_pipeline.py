"""Pipeline commands over a store: describe (and, as they land, index, match, recognize)."""
from __future__ import annotations

import json
from typing import Optional

import typer

from .cli_core import DeviceOpt, SchedulerOpt, WorkersOpt, choose_device


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command()
    def describe(
        store: str = typer.Argument(..., help="The Zarr scan store."),
        scan: Optional[list[str]] = typer.Option(None, "--scan", help="Only these scan ids (repeatable)."),
        normal_k: int = typer.Option(10, help="Normals from the k nearest points (PCL tutorial: 10)."),
        normal_radius: Optional[float] = typer.Option(None, help="Normals from a radius instead of k."),
        keypoint_radius: Optional[float] = typer.Option(0.03, help="Uniform-sampling leaf size; 0 = every point."),
        shot_radius: float = typer.Option(0.02, help="SHOT support radius (store units)."),
        approximate: bool = typer.Option(False, help="G-SHOT approximate mode (neighbour lists capped at the median)."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
    ):
        """Normals, keypoints, local reference frames and SHOT352 for every scan; resumable."""
        from scanforest.tasks.describe import DescribeParams

        from .describe import run_describe

        dev = choose_device(device)
        params = DescribeParams(normal_k=None if normal_radius else normal_k, normal_radius=normal_radius,
                                keypoint_radius=keypoint_radius or None, shot_radius=shot_radius,
                                approximate=approximate)
        summary = run_describe(store, scans=scan, params=params, device=dev, scheduler=scheduler, workers=workers)
        typer.echo(json.dumps(summary, indent=2))

    from . import bench_archive, bench_match

    bench_match.register_bench(bench)
    bench_archive.register_bench(bench)

    index_app = typer.Typer(help="Nearest-neighbour indexes over stored descriptors.", no_args_is_help=True)
    app.add_typer(index_app, name="index")

    @index_app.command("build")
    def index_build(
        store: str = typer.Argument(..., help="The Zarr scan store."),
        reference: list[str] = typer.Option(..., "--reference", "-r",
                                            help="Reference scan ids or glob patterns on ids (repeatable), e.g. 'models__*'."),
        name: str = typer.Option("default", help="Index name."),
        shards: str = typer.Option("1", help="Shards (one per GPU worker), or 'auto': one per local GPU, "
                                   "checked against their memory before anything is written."),
        method: str = typer.Option("banns", help="banns | anns | exact."),
        leaf_size: int = typer.Option(64, help="KD-tree leaf size."),
        backtracks: Optional[int] = typer.Option(None, help="Leaf visits per query (None = exact search)."),
        random_dims: Optional[int] = typer.Option(None, help="Randomized split among the F widest dimensions."),
        seed: int = typer.Option(0),
        dtype: str = typer.Option("float32", help="Stored rows: float32, or float16 (half the disk and host "
                                  "memory; searches are exact for the rounded rows)."),
        device: str = DeviceOpt,
    ):
        """Build a sharded KD-forest index over the SHOT descriptors of the reference scans (kept when unchanged)."""
        import fnmatch

        from scanforest.tasks.store import ScanStore

        from .match import run_index_build

        ids = ScanStore(store, mode="r").scans()
        chosen = sorted({s for pat in reference for s in ids if fnmatch.fnmatchcase(s, pat)})
        if not chosen:
            raise typer.BadParameter(f"no scan id matches {reference}")
        params = {"method": method, "leaf_size": leaf_size, "backtracks": backtracks,
                  "random_dims": random_dims, "seed": seed}
        if shards != "auto" and not shards.isdigit():
            raise typer.BadParameter(f"--shards takes a number or 'auto', got {shards!r}")
        typer.echo(json.dumps(run_index_build(store, chosen, name=name, params=params, device=choose_device(device),
                                              shards=shards if shards == "auto" else int(shards), dtype=dtype),
                                   indent=2))

    @app.command("match")
    def match_cmd(
        store: str = typer.Argument(..., help="The Zarr scan store."),
        queries: Optional[list[str]] = typer.Option(None, "--queries", "-q",
                                                    help="Query scan ids or glob patterns (default: every described non-reference scan)."),
        k: int = typer.Option(4, "-k", help="Neighbours per descriptor (P)."),
        name: str = typer.Option("default", help="Index name."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
    ):
        """Match query scans' descriptors against an index on the Dask cluster; writes match_ids/match_dist."""
        import fnmatch

        from scanforest.tasks.store import ScanStore

        from .match import run_match

        dev = choose_device(device)
        chosen = None
        if queries:
            ids = ScanStore(store, mode="r").scans()
            chosen = sorted({s for pat in queries for s in ids if fnmatch.fnmatchcase(s, pat)})
        typer.echo(json.dumps(run_match(store, queries=chosen, k=k, name=name, device=dev,
                                        scheduler=scheduler, workers=workers), indent=2))

    @app.command("align-store")
    def align_store(
        store: str = typer.Argument(..., help="The Zarr scan store."),
        pair: list[str] = typer.Option(..., "--pair", help="OBSERVED:REFERENCE scan ids (repeatable)."),
        model: str = typer.Option("rigid", help="2-D: euclidean|similarity|affine|projective; 3-D: rigid|similarity|affine."),
        chain: bool = typer.Option(False, help="Coarse-to-fine chain of models ending at --model."),
        loss: str = typer.Option("l2", help="l2 | huber."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
    ):
        """Parametric chamfer alignment for a batch of scan pairs in the store (results stored per scan)."""
        from .align import run_align

        pairs = []
        for p in pair:
            if ":" not in p:
                raise typer.BadParameter(f"--pair takes OBSERVED:REFERENCE, got {p!r}")
            pairs.append(p.split(":", 1))
        dev = choose_device(device)
        res = run_align(store, pairs, model=model, chain=chain, loss=loss, device=dev, scheduler=scheduler,
                        workers=workers)
        typer.echo(json.dumps(res, indent=2, default=str))

    @app.command("recognize")
    def recognize_cmd(
        store: str = typer.Argument(..., help="The Zarr scan store."),
        models: list[str] = typer.Option(..., "--models", "-m", help="Model scan ids or glob patterns (repeatable)."),
        scenes: Optional[list[str]] = typer.Option(None, "--scenes", "-s",
                                                   help="Scene scan ids or patterns (default: every non-model scan)."),
        library: str = typer.Option("default", help="Library name in the store."),
        model_ss: float = typer.Option(0.01, help="Model keypoint sampling (PCL tutorial 0.01)."),
        scene_ss: float = typer.Option(0.03, help="Scene keypoint sampling (0.03)."),
        rf_rad: float = typer.Option(0.015, help="Hough reference-frame radius (0.015)."),
        descr_rad: float = typer.Option(0.02, help="SHOT radius (0.02)."),
        method: str = typer.Option("hough", help="hough | gc."),
        cg_size: float = typer.Option(0.01, help="Hough bin / GC consensus size (0.01)."),
        cg_thresh: float = typer.Option(5, help="Hough / GC threshold (5)."),
        export: Optional[str] = typer.Option(None, help="Folder for detections.csv/.parquet and renders/."),
        device: str = DeviceOpt,
        scheduler: Optional[str] = SchedulerOpt,
        workers: Optional[int] = WorkersOpt,
    ):
        """Recognise library models in scenes: correspondences, grouping, GPU verification, ICP."""
        import fnmatch

        from scanforest.tasks.store import ScanStore

        from .recognize import run_recognize

        ids = ScanStore(store, mode="r").scans()
        pick = lambda pats: sorted({s for p in pats for s in ids if fnmatch.fnmatchcase(s, p)})  # noqa: E731
        model_ids = pick(models)
        if not model_ids:
            raise typer.BadParameter(f"no scan id matches {models}")
        dev = choose_device(device)
        res = run_recognize(store, model_ids, scenes=pick(scenes) if scenes else None, library=library,
                            library_params={"model_ss": model_ss, "descr_rad": descr_rad, "rf_rad": rf_rad},
                            params={"scene_ss": scene_ss, "method": method, "cg_size": cg_size,
                                    "cg_thresh": cg_thresh},
                            device=dev, scheduler=scheduler, workers=workers, export=export)
        typer.echo(json.dumps(res, indent=2, default=str))
