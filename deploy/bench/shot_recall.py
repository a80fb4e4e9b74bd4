"""``scanforest bench shot-recall``: descriptiveness of exact vs approximate SHOT, the G-SHOT
paper's protocol (recall vs 1-precision of nearest-neighbour matches under noise).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    bench.command("shot-recall")(bench_shot_recall)


def mesh_resolution(pts) -> float:
    """Mean distance of each point to its nearest other point."""
    from scanforest.kernels.neighbors.search import knn

    _, d2 = knn(pts, k=2, device="cpu")
    return float(np.sqrt(d2[:, 1].astype(np.float64)).mean())


def recall_curve(scene_desc, model_desc, truth, scene_kp_xyz, model_kp_xyz_in_scene, tol):
    """Recall vs 1-precision of nearest-neighbour matches swept over the distance threshold.

    Every scene keypoint is matched to its nearest model descriptor (Euclidean). A match is
    correct when the matched model keypoint, moved by the ground-truth pose, lies within ``tol``
    of the scene keypoint. Recall = correct matches below the threshold / scene keypoints with a
    valid descriptor; 1-precision = wrong matches / matches below the threshold.
    """
    from scipy.spatial import cKDTree

    okm = np.isfinite(model_desc[:, 0])
    oks = np.isfinite(scene_desc[:, 0])
    tree = cKDTree(model_desc[okm].astype(np.float64))
    d, j = tree.query(scene_desc[oks].astype(np.float64), k=1)
    mj = np.nonzero(okm)[0][j]
    correct = np.linalg.norm(model_kp_xyz_in_scene[mj] - scene_kp_xyz[oks], axis=1) <= tol
    order = np.argsort(d)
    c = np.cumsum(correct[order])
    n = np.arange(1, len(order) + 1)
    recall = c / max(int(oks.sum()), 1)
    one_minus_precision = (n - c) / n
    return one_minus_precision, recall


def bench_shot_recall(
    model: Path = typer.Option(None, help="Model cloud (default ../shared/data/pcl/milk.pcd)."),
    scenes: int = typer.Option(8, help="Synthetic scenes per noise level."),
    radius: float = typer.Option(0.02, help="SHOT radius (m)."),
    keypoint_radius: float = typer.Option(0.01, help="Uniform-sampling leaf of the keypoints."),
    normal_k: int = typer.Option(10, help="k of the normal estimation."),
    device: str = typer.Option("auto", help="auto | cpu | gpu"),
    out: Path = typer.Option(None, help="JSON file or folder for the record."),
) -> None:
    """Descriptiveness of exact vs approximate SHOT: recall vs 1-precision under noise."""
    from scanforest.kernels.backend import describe_device, resolve_device, to_device, to_numpy
    from scanforest.kernels.descriptors.keypoints import keypoints
    from scanforest.kernels.descriptors.normals import normals
    from scanforest.kernels.descriptors.shot import shot
    from scanforest.tasks.readers import read_cloud

    from ._common import BenchReport

    if model is None:
        from ._data import pcl_data_dir

        model = pcl_data_dir() / "milk.pcd"
    mpts = np.ascontiguousarray(read_cloud(model).points, dtype=np.float32)
    dev = resolve_device(device)
    mr = mesh_resolution(mpts)
    rep = BenchReport("shot-recall", {"model": str(model), "points": len(mpts), "scenes": scenes,
                                      "radius": radius, "keypoint_radius": keypoint_radius,
                                      "normal_k": normal_k, "mesh_resolution": mr}, out=out)
    ddev = describe_device(dev)
    kp = to_numpy(keypoints(mpts, radius=keypoint_radius, device="cpu"))
    tol = 2.0 * mr
    rng = np.random.default_rng(7)

    def describe(p, approximate, cap=None):
        P = to_device(p, dev)
        n, _ = normals(P, k=normal_k, device=dev)
        d, _ = shot(P, n, to_device(kp, dev), radius, approximate=approximate, max_neighbors=cap,
                    device=dev)
        return to_numpy(d)

    model_desc = {False: describe(mpts, False), True: describe(mpts, True)}
    grid = np.linspace(0, 1, 101)
    for sigma in (0.1, 0.2):
        curves = {False: [], True: []}
        for s in range(scenes):
            q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
            q *= np.sign(np.linalg.det(q))
            t = rng.uniform(-1, 1, 3)
            noisy = (mpts.astype(np.float64) + rng.normal(scale=sigma * mr, size=mpts.shape))
            scene = (noisy @ q.T + t).astype(np.float32)
            truth_xyz = (mpts[kp].astype(np.float64) @ q.T + t)     # model keypoints in the scene
            for approx in (False, True):
                sd = describe(scene, approx)
                fp, rc = recall_curve(sd, model_desc[approx], None, scene[kp].astype(np.float64),
                                      truth_xyz, tol)
                # recall as a function of 1-precision (best recall reached at or below each level)
                best = np.array([rc[fp <= g].max() if np.any(fp <= g) else 0.0 for g in grid])
                curves[approx].append(best)
        for approx in (False, True):
            c = np.mean(curves[approx], axis=0)
            auc = float(np.trapezoid(c, grid)) if hasattr(np, "trapezoid") else float(np.trapz(c, grid))
            label = "approximate" if approx else "exact"
            ex = np.mean(curves[False], axis=0)
            ex_auc = float(np.trapezoid(ex, grid)) if hasattr(np, "trapezoid") else float(np.trapz(ex, grid))
            rep.add(f"area under recall vs 1-precision, noise {sigma} mr, {label}", auc, "AUC", ddev,
                    baseline="exact" if approx else None, baseline_value=ex_auc if approx else None,
                    recall_at_0_1=float(c[10]), recall_at_0_2=float(c[20]), recall_max=float(c[-1]))
    rep.note(f"mesh resolution {mr:.5f} m; a match is correct within {tol:.5f} m (2 mr); "
             f"{len(kp)} keypoints (uniform sampling {keypoint_radius} m) per cloud; "
             f"scenes = the model under a random rigid motion + Gaussian noise")
    rep.finish(out)
