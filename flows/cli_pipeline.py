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
