"""Evaluation against ground truth: pose errors and detection counts (true / false positives)."""
from __future__ import annotations

import numpy as np

__all__ = ["evaluate", "pose_errors"]


def pose_errors(pose, truth) -> tuple[float, float]:
    """(rotation error in degrees, translation error) between two 4x4 poses."""
    A = np.asarray(pose, np.float64)
    B = np.asarray(truth, np.float64)
    c = (np.trace(A[:3, :3].T @ B[:3, :3]) - 1.0) / 2.0
    return float(np.degrees(np.arccos(np.clip(c, -1.0, 1.0)))), float(np.linalg.norm(A[:3, 3] - B[:3, 3]))


def evaluate(detections, ground_truth, *, max_rotation_deg: float = 15.0,
             max_translation: float) -> dict:
    """Match detections to ground-truth instances (same model, pose within tolerance).

    Each ground-truth instance (``{"model_id", "pose"}``) is matched at most once, by the
    detection of its model with the smallest translation error within the tolerances. Returns
    ``tp``, ``fp``, ``fn`` and the per-match rotation / translation errors.
    """
    used = set()
    rot, tra = [], []
    tp = 0
    for g in ground_truth:
        best, best_t = None, None
        for i, d in enumerate(detections):
            if i in used or int(d.model_id) != int(g["model_id"]):
                continue
            re, te = pose_errors(d.pose, g["pose"])
            if re <= max_rotation_deg and te <= max_translation and (best_t is None or te < best_t):
                best, best_t, best_r = i, te, re
        if best is not None:
            used.add(best)
            tp += 1
            rot.append(best_r)
            tra.append(best_t)
    return {"tp": tp, "fp": len(detections) - len(used), "fn": len(ground_truth) - tp,
            "rotation_errors": rot, "translation_errors": tra}
