"""What a recognition run says about its scenes, from their records, without Prefect or the
kernels (the commands' no-op answers use it too, :mod:`.noop`): the summary's counts, precision
and recall (:func:`summarize`), the note on scenes with no detection (:func:`no_detections_note`)
and the one on another library's detections a run replaced (:func:`replaced_note`)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .records import box_origin, failures


def other_libraries(st, ids: list[str], library: str) -> dict[str, int]:
    """The scenes of ``ids`` whose detections come from another library than ``library``, counted
    per library: a scene keeps one recognition, so this run replaces them."""
    out: dict[str, int] = {}
    for sid in ids:
        rec = st.stage(sid, "recognize")
        lib = rec.get("library") if isinstance(rec, dict) else None
        if lib is not None and lib != library:
            out[lib] = out.get(lib, 0) + 1
    return out


def replaced_note(replaced: dict[str, int], library: str) -> str:
    """One line saying which detections a run replaced (:func:`other_libraries`): they used to go
    without a word."""
    parts = ", ".join(f"library {lib!r}'s in {n} scene{'s' if n != 1 else ''}" for lib, n in sorted(replaced.items()))
    return (f"replaced the detections of {parts} by library {library!r}'s (a scene keeps the detections of the "
            "library it was last recognised with; recognise with that library again to get them back)")


def no_detections_note(summary: dict[str, Any], params: dict[str, Any] | None) -> str | None:
    """Where recognised scenes gave no detection at all, the stage that lost them, in one line
    (a silent 0 sent users looking everywhere): no correspondence (the descriptors of the scenes
    and of the library do not match: another scale or unit, or radii unfit for the data), no
    hypothesis (no group of ``cg_thresh`` consistent correspondences), or hypotheses that all
    fail verification. None when there are detections or nothing was recognised."""
    from scanforest.kernels.recognition import RecognizeParams

    f = summary.get("funnel")
    n = summary.get("recognized", 0)
    if not f or not n or summary.get("detections"):
        return None
    p = RecognizeParams().replace(**(params or {}))
    scenes = f"{n} scene{'s' if n != 1 else ''}"
    if not f["correspondences"]:
        return (f"no detections in {scenes}: none of their {f['keypoints']:,} keypoints matched a library "
                "descriptor; are the scenes in the models' unit and scale, and the radii (--descr-rad, "
                "--scene-ss) fit for them?")
    if not f["hypotheses"]:
        return (f"no detections in {scenes}: {f['correspondences']:,} correspondences formed no group of "
                f"{p.cg_thresh:g} consistent ones (--cg-size {p.cg_size:g}, --cg-thresh {p.cg_thresh:g})")
    best = f.get("best_score")
    return (f"no detections in {scenes}: {f['hypotheses']:,} hypotheses, none verified (the best explains "
            f"{'?' if best is None else f'{best:.2f}'} of a model's visible points; min_inlier_fraction "
            f"{p.min_inlier_fraction:g})")


#: recomputed scenes a summary names one by one, with the reason (the run's records name them all)
RECOMPUTED_LISTED = 100


def summarize(recs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"recognized": sum(r["status"] == "recognized" for r in recs),
                           "skipped": sum(r["status"] == "skipped" for r in recs),
                           # scenes a concurrent run held (and recognises): left to it
                           "held": sum(r["status"] == "held" for r in recs),
                           "failed": sum(r["status"] == "failed" for r in recs), "failures": failures(recs),
                           "detections": int(sum(r.get("detections", 0) for r in recs))}
    # where the recognised scenes' descriptions and matches came from: the describe and match
    # stages ("stored") or a description and brute-force match of their own ("recomputed", why)
    done = [r for r in recs if r["status"] == "recognized"]
    out["from_stored"] = sum(r.get("source") == "stored" for r in done)
    out["recomputed"] = sum(r.get("source") == "recomputed" for r in done)
    reasons: dict[str, int] = {}
    per_scene: dict[str, str] = {}
    for r in done:
        if r.get("source") == "recomputed":
            why = r.get("reason") or "?"
            reasons[why] = reasons.get(why, 0) + 1
            if len(per_scene) < RECOMPUTED_LISTED:
                per_scene[str(r.get("scan_id"))] = why
    if reasons:
        out["recompute_reasons"] = reasons
        # each recomputed scene and why (the first RECOMPUTED_LISTED; the run record has them all)
        out["recomputed_scenes"] = per_scene
    out.update(box_origin(done, RECOMPUTED_LISTED))  # georeferenced scenes without a file offset
    funnels = [r["funnel"] for r in done if r.get("funnel")]
    if funnels:  # how far the recognised scenes got, summed (best_score: the best of all)
        out["funnel"] = {k: int(sum(f[k] for f in funnels))
                         for k in ("keypoints", "correspondences", "hypotheses", "detections")}
        scores = [f["best_score"] for f in funnels if f.get("best_score") is not None]
        out["funnel"]["best_score"] = max(scores) if scores else None
    phases: dict[str, float] = {}  # seconds per recognition phase, summed over the recognised scenes
    for r in recs:
        for k, v in (r.get("timings") or {}).items():
            phases[k] = phases.get(k, 0.0) + float(v)
    if phases:
        out["phase_seconds"] = phases
    evs = [r["evaluation"] for r in recs if r.get("evaluation")]
    if evs:
        tp, fp, fn = (sum(e[k] for e in evs) for k in ("tp", "fp", "fn"))
        rot = [x for e in evs for x in e["rotation_errors"]]
        tra = [x / e["resolution"] for e in evs for x in e["translation_errors"]]
        # precision of no detections and recall of no true instances are undefined (None), not 0
        out.update(tp=tp, fp=fp, fn=fn, precision=tp / (tp + fp) if tp + fp else None,
                   recall=tp / (tp + fn) if tp + fn else None,
                   rotation_error_deg_median=float(np.median(rot)) if rot else None,
                   rotation_error_deg_max=float(np.max(rot)) if rot else None,
                   translation_error_res_median=float(np.median(tra)) if tra else None)
    return out
