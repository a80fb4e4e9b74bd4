"""Write synthetic archives (models + scenes with ground-truth sidecars) to disk.

The arrays come from :mod:`scanforest.kernels.synthetic.scenes`; this module only does the I/O.
Layout of an archive folder::

    ROOT/models/model_000.pcd ...          library models (points + normals), binary_compressed PCD
    ROOT/scenes/scene_0000.pcd ...         scenes
    ROOT/scenes/scene_0000.gt.json         {"ground_truth": [{"model_id", "model", "pose"}], "noise", "resolution"}
"""
from __future__ import annotations

import functools
import json
from pathlib import Path


from scanforest.kernels.synthetic import scenes as synthetic

from .readers import write_cloud


def write_archive(root: str | Path, *, n_models: int = 5, n_scenes: int = 4, points_per_scene: int = 100_000,
                  points_per_model: int = 20_000, n_instances: int = 3, noise: float = 0.2, seed: int = 0,
                  fmt: str = "pcd", encoding: str = "binary_compressed", models=None, jobs: int = 1) -> dict:
    """Create a synthetic archive folder; returns {"models": [...paths], "scenes": [...paths]}.

    ``jobs > 1`` writes the scenes from that many processes (each scene depends only on its seed,
    so the archive is the same)."""
    root = Path(root)
    (root / "models").mkdir(parents=True, exist_ok=True)
    (root / "scenes").mkdir(parents=True, exist_ok=True)
    lib = models or synthetic.model_library(n_models, points_per_model, seed=seed)
    out = {"models": [], "scenes": []}
    for m in lib:
        p = root / "models" / f"{m.name}.{fmt}"
        if not p.exists():
            write_cloud(p, m.points, normals=m.normals, encoding=encoding)
            p.with_name(f"{m.name}.gt.json").write_text(json.dumps({"model": m.name, "resolution": m.resolution}))
        out["models"].append(p)
    paths = [root / "scenes" / f"scene_{i:04d}.{fmt}" for i in range(n_scenes)]
    todo = [i for i, p in enumerate(paths) if not p.exists()]
    write = functools.partial(_write_scene, lib=lib, n_instances=min(n_instances, len(lib)),
                              n_points=points_per_scene, noise=noise, seed=seed, encoding=encoding)
    if jobs > 1 and len(todo) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=mp.get_context("spawn")) as ex:
            list(ex.map(write, [paths[i] for i in todo], todo, chunksize=8))
    else:
        for i in todo:
            write(paths[i], i)
    out["scenes"] = paths
    return out


def _write_scene(p: Path, i: int, *, lib, n_instances: int, n_points: int, noise: float, seed: int,
                 encoding: str) -> None:
    sc = synthetic.make_scene(lib, n_instances=n_instances, n_points=n_points, noise=noise,
                              seed=seed * 100_003 + i + 1)
    write_cloud(p, sc.points, encoding=encoding)
    side = {"ground_truth": sc.ground_truth, "noise": sc.noise, "resolution": sc.resolution}
    p.with_name(f"{p.stem}.gt.json").write_text(json.dumps(side))


def corrupt_copy(src: str | Path, dst: str | Path, keep_fraction: float = 0.5) -> Path:
    """A truncated copy of a file (for fault-injection demos and tests)."""
    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[: max(1, int(len(data) * keep_fraction))])
    return Path(dst)
