"""``scanforest shot FILE -o OUT.npy``: SHOT352 descriptors and local reference frames of one scan.

``scanforest bench shot`` and ``bench shot-recall`` are :mod:`scanforest.deploy.bench.shot` and
:mod:`scanforest.deploy.bench.shot_recall`.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import typer

from .core import number


def register(app: typer.Typer, bench: typer.Typer) -> None:
    app.command("shot")(shot_command)


def outputs(out) -> tuple[str, str, str]:
    """The files ``shot -o OUT`` writes: OUT's name without a trailing ``.npy`` (``desc.npy`` and
    ``desc``: ``desc``; ``desc.pcd``: ``desc.pcd``), then ``.npy``, ``.frames.npy`` and
    ``.keypoints.npy``. ``np.save`` adds ``.npy`` to a name without it, and the frames' name
    dropped any other suffix: ``-o X.pcd`` wrote ``X.pcd.npy`` beside ``X.frames.npy``."""
    base = str(out)[:-4] if str(out).lower().endswith(".npy") else str(out)
    return f"{base}.npy", f"{base}.frames.npy", f"{base}.keypoints.npy"


def shot_command(
    file: Path = typer.Argument(..., help="Point cloud file (pcd/ply/las/xyz/npy)."),
    out: Path = typer.Option(..., "-o", "--out", help="Descriptors OUT.npy (K, 352), NaN rows where a "
                             "keypoint has no frame; the frames (K, 3, 3) and the keypoints' indices (K,) go "
                             "beside it as OUT.frames.npy and OUT.keypoints.npy (OUT: the name given, without "
                             "its .npy: -o desc.npy and -o desc write desc.npy, desc.frames.npy, "
                             "desc.keypoints.npy)."),
    radius: float = typer.Option(0.02, callback=number, help="SHOT support radius (m)."),
    normal_radius: float = typer.Option(None, callback=number, help="Normals from neighbours within this radius."),
    normal_k: int = typer.Option(10, callback=number, help="Normals from k nearest neighbours (when no "
                                 "--normal-radius)."),
    keypoint_radius: float = typer.Option(None, callback=number, help="Uniform-sampling leaf; 0 or omitted: "
                                          "every point (as describe's 0)."),
    approximate: bool = typer.Option(False, help="G-SHOT approximate mode (lists capped at the median)."),
    max_neighbors: int = typer.Option(None, callback=number, help="Cap for --approximate (default: median count)."),
    device: str = typer.Option("auto", help="auto | cpu | gpu"),
) -> None:
    """Compute SHOT352 descriptors and local reference frames for one scan."""
    from scanforest.kernels.backend import resolve_device, to_device, to_numpy
    from scanforest.kernels.descriptors.keypoints import keypoints
    from scanforest.kernels.descriptors.normals import normals
    from scanforest.kernels.descriptors.shot import shot
    from scanforest.tasks.preflight import check_output_file
    from scanforest.tasks.readers import read_cloud

    desc_path, frames_path, kp_path = outputs(out)
    check_output_file(desc_path, "-o")  # a folder, a path inside a store, one that cannot be written: before the work
    cloud = read_cloud(file)
    dev = resolve_device(device)
    pts = to_device(_local(cloud, file, {"--radius": radius, "--normal-radius": normal_radius,
                                         "--keypoint-radius": keypoint_radius or None}), dev)
    t0 = time.perf_counter()
    if normal_radius is not None:
        nrm, _ = normals(pts, radius=normal_radius, device=dev)
    else:
        nrm, _ = normals(pts, k=normal_k, device=dev)
    kp = keypoints(pts, radius=keypoint_radius or None, device=dev)
    desc, frames = shot(pts, nrm, kp, radius, approximate=approximate,
                        max_neighbors=max_neighbors, device=dev)
    desc, frames, kp = to_numpy(desc), to_numpy(frames), to_numpy(kp)
    dt = time.perf_counter() - t0
    Path(desc_path).parent.mkdir(parents=True, exist_ok=True)
    np.save(desc_path, desc)
    np.save(frames_path, frames)
    np.save(kp_path, kp)
    valid = int(np.isfinite(desc[:, 0]).sum())
    typer.echo(f"{file}: {len(cloud.points)} points, {len(kp)} keypoints ({valid} valid) "
               f"on {dev} in {dt:.3f} s -> {desc_path} (frames: {frames_path}, keypoints: {kp_path})")


def _local(cloud, file: str, radii: dict) -> np.ndarray:
    """The cloud's points as float32 in the frame ``describe`` computes its scan in: less the
    origin ingest would choose (none below 1024 m; else the file's own offset where it lies near
    the points, e.g. a LAS header's; else the box's centre), subtracted in float64, with the
    viewpoint at that origin. Cast to float32 as read, UTM-sized coordinates fell on a 0.25-0.5 m
    grid and the neighbour search ran for good. Coordinates still too coarse for the radii (a
    float32 file of georeferenced points, a LAS file's scale) are one line, exit 2."""
    from scanforest.kernels.coordinates import check_spacing, choose_origin, to_local
    from scanforest.tasks.store import scan_grid

    pts = np.asarray(cloud.points)
    finite = pts[np.isfinite(pts).all(axis=1)] if pts.ndim == 2 and len(pts) else pts
    origin = np.zeros(3)
    if pts.dtype == np.float64 and len(finite):
        origin = choose_origin(finite.min(axis=0), finite.max(axis=0), cloud.meta.get("offsets"))
    local = to_local(pts, origin)
    if len(finite):
        check_spacing(float(np.abs(finite - origin).max()), radii, file,
                      span=lambda: float((finite.max(axis=0) - finite.min(axis=0)).max()) / 2,
                      grid=scan_grid(cloud.meta))  # a LAS file's scale
    return local

