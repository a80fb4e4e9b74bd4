"""The align flow over scan pairs in the store recovers known rigid transforms."""
from __future__ import annotations

import numpy as np

from scanforest.flows.align import run_align
from scanforest.kernels import synthetic
from scanforest.tasks.store import ScanStore


def test_align_flow_recovers_known_pose(tmp_path):
    lib = synthetic.model_library(2, 4_000, seed=9)
    st = ScanStore(tmp_path / "s.zarr")
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
