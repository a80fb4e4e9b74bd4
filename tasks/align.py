"""Align: one (observed scan, reference scan) pair in the store -> a transform (idempotent).

The result is written into the observed scan as the stage ``align:<reference>`` with arrays
``align_<ref>_transform`` ((d+1, d+1) float64) and ``align_<ref>_history`` (objective per
LM iteration), and attrs model, init, status, iterations, rmse, inliers.

LM starts from the translation between the two scans' centroids (``init="centroids"``, as
``scanforest align`` does), because scans of one object taken in different frames usually start
outside each other's distance-transform grid (:mod:`scanforest.kernels.align.pcha`); pass
``init="identity"`` or a matrix when the observed scan covers only part of the reference.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from .store import ScanStore, scan_id_for


def align_pair(store_path: str, observed: str, reference: str, *, model: str = "rigid", chain: bool = False,
               loss: str = "l2", outside: str = "clamp", max_iter: int = 100, init="centroids",
               device: str = "auto", force: bool = False) -> dict[str, Any]:
    from scanforest.kernels.align.pcha import align
    from scanforest.kernels.backend import resolve_device

    t0 = time.perf_counter()
    st = ScanStore(store_path)
    stage = f"align:{reference}"
    params = {"model": model, "chain": chain, "loss": loss, "outside": outside, "max_iter": max_iter,
              "init": init if isinstance(init, str) else np.asarray(init, np.float64).tolist()}
    if not force and st.has_stage(observed, stage, **params):
        return {"scan_id": observed, "reference": reference, "status": "skipped", "seconds": time.perf_counter() - t0}
    obs = st.read(observed, "points").astype(np.float32)
    ref = st.read(reference, "points").astype(np.float32)
    dev = resolve_device(device)
    res = align(obs, ref, model, init=init, chain=chain, loss=loss, outside=outside, max_iter=max_iter, device=dev)
    tag = scan_id_for(reference)
    st.write_stage(observed, stage, {f"align_{tag}_transform": np.asarray(res.transform, np.float64),
                                     f"align_{tag}_history": np.asarray(res.history, np.float64)},
                   {**params, "status": res.status, "iterations": int(res.iterations),
                    "rmse": float(res.rmse), "inliers": int(res.n_inliers), "device": dev})
    return {"scan_id": observed, "reference": reference, "status": res.status, "iterations": int(res.iterations),
            "rmse": float(res.rmse), "transform": np.asarray(res.transform).tolist(),
            "seconds": time.perf_counter() - t0}
