"""``scanforest align`` and the align flow over scan pairs in the store recover known rigid
transforms; the command's output and its errors."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np

from scanforest.flows.align import run_align
from scanforest.kernels.align.pcha import synthetic_problem
from scanforest.kernels.synthetic import scenes as synthetic
from scanforest.tasks.readers import read_cloud, write_cloud
from scanforest.tasks.store import ScanStore


def test_align_flow_recovers_known_pose(tmp_path):
    lib = synthetic.model_library(2, 4_000, seed=9)
    st = ScanStore(tmp_path / "s.zarr", create=True)
    truth = {}
    for m in lib:
        c = np.cos(np.radians(6.0)), np.sin(np.radians(6.0))
        R = np.array([[c[0], -c[1], 0], [c[1], c[0], 0], [0, 0, 1]])
        t = np.array([0.01, -0.008, 0.005])
        obs = (m.points.astype(np.float64) @ R.T + t).astype(np.float32)
        st.write_scan(f"{m.name}_ref", {"points": m.points}, {"n_points": len(m.points)})
        st.write_scan(f"{m.name}_obs", {"points": obs}, {"n_points": len(obs)})
        truth[m.name] = (R, t)
    pairs = [[f"{m.name}_obs", f"{m.name}_ref"] for m in lib]
    res = run_align(str(tmp_path / "s.zarr"), pairs, model="rigid", device="cpu", workers=1, progress=False)
    assert res["aligned"] == 2 and res["converged"] == 2
    for m in lib:
        R, t = truth[m.name]
        T = ScanStore(tmp_path / "s.zarr").read(f"{m.name}_obs", f"align_{m.name}_ref_transform")
        # the transform maps observed back onto the reference: T = inverse of (R, t)
        np.testing.assert_allclose(T[:3, :3], R.T, atol=2e-3)
        np.testing.assert_allclose(T[:3, 3], -R.T @ t, atol=1e-3)
    again = run_align(str(tmp_path / "s.zarr"), pairs, model="rigid", device="cpu", workers=1, progress=False)
    assert again["aligned"] == 0  # idempotent


# ----------------------------------------------------------------------------- scanforest align
def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "scanforest.deploy.cli", "align", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def _rigid(axis, degrees, t):
    """``(4, 4)`` rotation by ``degrees`` about ``axis`` (through the origin), then ``t``."""
    a = np.asarray(axis, float) / np.linalg.norm(axis)
    K = np.array([[0, -a[2], a[1]], [a[2], 0, -a[0]], [-a[1], a[0], 0]])
    th = np.radians(degrees)
    M = np.eye(4)
    M[:3, :3] = np.eye(3) + np.sin(th) * K + (1 - np.cos(th)) * K @ K
    M[:3, 3] = t
    return M


def _pose_error(T_est, M_moved, centre):
    """Rotation error (degrees) of ``T_est`` against ``inv(M_moved)``, and its translation error
    where the cloud is (at ``centre``; at the origin, metres away, a rotation error of 0.1
    degree would look like a translation error)."""
    E = T_est @ M_moved
    angle = np.degrees(np.arccos(np.clip((np.trace(E[:3, :3]) - 1) / 2, -1, 1)))
    return angle, np.linalg.norm(E[:3, :3] @ centre + E[:3, 3] - centre)


def test_align_cli_recovers_rigid_copy_of_real_cloud(tmp_path, pcl_dir):
    """A user's check: PCL's milk carton (metres, 0.77 m in front of the sensor) turned by 25
    degrees about an axis through the sensor origin and moved by a tenth of its extent, aligned
    with no options. Fails without the centroid initialisation (at the identity every observed
    point lies outside the distance-transform grid: ``no_inliers`` after 0 iterations)."""
    P = np.asarray(read_cloud(pcl_dir / "milk.pcd").points, np.float64)
    extent = float(np.linalg.norm(P.max(0) - P.min(0)))
    M = _rigid([1.0, 2.0, 0.5], 25.0, 0.1 * extent * np.array([0.6, -0.5, 0.62]) / 0.995)
    write_cloud(tmp_path / "original.pcd", P.astype(np.float32))
    write_cloud(tmp_path / "moved.pcd", (P @ M[:3, :3].T + M[:3, 3]).astype(np.float32))
    r = _cli("moved.pcd", "original.pcd", "-o", "result.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) <= 10
    assert lines[0].startswith("rigid alignment of moved.pcd onto original.pcd: converged")
    assert abs(float(re.search(r"rotation ([\d.]+) deg", r.stdout).group(1)) - 25.0) < 1.0
    assert re.search(r"\d s on (cpu|gpu)", lines[-2]) and lines[-1] == "wrote result.json"
    res = json.loads((tmp_path / "result.json").read_text())
    angle, dt = _pose_error(np.asarray(res["transform"]), M, P.mean(0))
    assert angle < 1.0 and dt < 0.01 * extent, (angle, dt / extent)
    assert res["status"] == "converged" and res["init"] == "centroids"


def test_align_cli_json_and_units(tmp_path):
    """``--json`` prints the full result; the defaults do not depend on the units: a synthetic
    shape in millimetres, 5 m from the origin, turned by 30 degrees about its own centre."""
    _, ref, _ = synthetic_problem("rigid", 3, 100, n_reference=6000, seed=4)
    ref_mm = ref * 1000.0 + 5000.0
    c = ref_mm.mean(0)
    M = _rigid([0.3, -1.0, 0.4], 30.0, 0.0)
    M[:3, 3] = c - M[:3, :3] @ c + np.array([80.0, -60.0, 50.0])
    np.save(tmp_path / "ref.npy", ref_mm)
    np.save(tmp_path / "obs.npy", ref_mm @ M[:3, :3].T + M[:3, 3])
    r = _cli("obs.npy", "ref.npy", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert {"transform", "params", "history", "status", "iterations", "rmse", "device"} <= set(res)
    angle, dt = _pose_error(np.asarray(res["transform"]), M, c)
    extent = float(np.linalg.norm(ref_mm.max(0) - ref_mm.min(0)))
    assert res["status"] == "converged"
    assert angle < 1.0 and dt < 0.01 * extent, (angle, dt / extent)


def test_align_cli_bad_input_is_one_line_exit_2(tmp_path):
    np.save(tmp_path / "ok.npy", np.random.default_rng(0).normal(size=(50, 3)))
    np.save(tmp_path / "zero.npy", np.zeros((0, 3)))
    (tmp_path / "junk.npy").write_text("not an array")
    (tmp_path / "junk.pcd").write_text("garbage")
    cases = [(["missing.pcd", "ok.npy"], "missing.pcd"), (["ok.npy", "zero.npy"], "zero.npy: zero points"),
             (["junk.npy", "ok.npy"], "junk.npy"), (["junk.pcd", "ok.npy"], "junk.pcd"),
             (["ok.npy", "ok.npy", "--model", "banana"], "banana"),
             (["ok.npy", "ok.npy", "--init", "nope.json"], "nope.json")]
    for args, what in cases:
        r = _cli(*args, cwd=tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and what in err[0], (args, r.stderr)
        assert "Traceback" not in r.stderr
