"""A stage with nothing to do answers from the store, before Prefect or Dask start.

``describe STORE`` on a store whose every scan is described (with these parameters), ``match``
with every query scan matched against the current index, ``recognize`` with every scene's
detections current, or ``ingest`` of an empty drop folder into an existing store, used to spend
7-10 s on 2 cores starting
Prefect's local API, a Dask cluster and Prefect's flow engine to find that out, and added a run
record each time. These checks read stage records only (the same tests the stages' units of work
make before they skip a scan), import neither Prefect nor the kernels, and return the summary a
run with zero work prints (the same keys; ``workers`` 0: none was started), or None when there is
work, or when anything is not as the check expects (the run then finds it, and any user error, as
it always did).

A no-op run is not stored as a run record: :func:`scanforest.flows.records.record_run` counts it
in the store's ``runs`` group attributes (``noop_runs``: per flow, how many and the last one), so a
schedule that fires every minute on an idle store does not add 1,440 records a day.
"""
from __future__ import annotations

import time
from typing import Any

from scanforest.flows.inputs import absolute_path


def _store(store: str):
    from scanforest.tasks.store import ScanStore

    return ScanStore(absolute_path(store), mode="r")


def describe_noop(store: str, scans: list[str] | None, params) -> dict[str, Any] | None:
    """The describe summary when every scan in ``scans`` (default: every scan) has its describe
    stage with ``params`` (a :class:`~scanforest.tasks.describe.DescribeParams`); else None."""
    t0 = time.perf_counter()
    try:
        st = _store(store)
        have = st.scans()
        ids = have if scans is None else list(scans)
        if not set(ids) <= set(have):
            return None  # a user error: the run says it
        p = params.as_dict()
        if not all(st.has_stage(s, "describe", **p) for s in ids):
            return None
    except Exception:
        return None
    return {"scans": len(ids), "described": 0, "skipped": len(ids), "held": 0, "failed": 0, "failures": [],
            "keypoints": 0, "task_seconds": 0.0, "seconds": time.perf_counter() - t0, "workers": 0}


def match_noop(store: str, queries: list[str] | None, k: int, name: str) -> dict[str, Any] | None:
    """The match summary when every query scan (default: every described scan the index ``name``
    was not built over) is matched against the index as it is now, with ``k``; else None."""
    from scanforest.tasks.store import stage_digest

    t0 = time.perf_counter()
    try:
        st = _store(store)
        attrs = st.catalog.find_index(name)
        if attrs is None or int(k) < 1:
            return None
        have = st.scans()
        if queries is None:
            ref = set(attrs.get("scans", []))
            ids = [s for s in have if s not in ref and st.has_stage(s, "describe")]
        else:
            ids = list(queries)
            if not set(ids) <= set(have) or not all(st.has_stage(s, "describe") for s in ids):
                return None
        tag = attrs["content_hash"]
        for sid in ids:
            described = stage_digest(st.stage(sid, "describe"))
            if not st.has_stage(sid, "match", index=name, content_hash=tag, k=int(k), describe=described):
                return None
    except Exception:
        return None
    return {"scans": len(ids), "matched": 0, "held": 0, "queries": 0, "k": int(k), "shards": len(attrs.get("shards", [])),
            "workers": 0, "batch": 0, "lanes": 0, "placement": "none: nothing to match", "plan": "",
            "scans_seconds": 0.0, "task_seconds": 0.0, "seconds": time.perf_counter() - t0}


def ingest_noop(source: str, store: str) -> dict[str, Any] | None:
    """The ingest summary when ``source`` is a folder holding no scan file and no archive (a drop
    folder between deliveries) and ``store`` exists; else None (a glob, an archive, anything to
    ingest, or a store to create: the run says what it finds)."""
    import os
    import tempfile

    from scanforest.tasks.ingest import discover, ignored_note, is_archive
    from scanforest.tasks.store import ScanStore

    t0 = time.perf_counter()
    try:
        src, dst = absolute_path(source), absolute_path(store)
        if not os.path.isdir(src) or not ScanStore.exists(dst):
            return None
        for _, _, files in os.walk(src):  # an archive is extracted to be looked into: the run does that
            if any(is_archive(f) for f in files):
                return None
        ignored: list[dict[str, str]] = []
        with tempfile.TemporaryDirectory() as staging:
            sources, problems = discover(src, staging, ignored=ignored)
        if sources or problems:
            return None
    except Exception:
        return None
    summary = {"ingested": 0, "skipped": 0, "quarantined": 0, "files": 0, "points": 0, "bytes": 0,
               "seconds": time.perf_counter() - t0, "task_seconds": 0.0, "quarantine_reasons": [],
               "ignored": len(ignored), "workers": 0}
    if ignored:
        summary["ignored_note"] = ignored_note(ignored)
    return summary


def recognize_noop(store: str, models: list[str], scenes: list[str] | None, library: str,
                   library_params: dict | None, params: dict) -> dict[str, Any] | None:
    """The recognize summary when the library is what ``recognize`` would build and every scene
    (default: every scan but the models) holds detections that are current for it, its
    parameters and its stored description and matches (the test each scene's unit of work makes:
    :func:`~scanforest.tasks.recognize.recognize_scan`); else None. It started Prefect's API and
    a cluster for 10 s to skip every scene."""
    from scanforest.tasks.recognize import library_current, recognition_current, recognition_key, stored_inputs

    from .summaries import summarize

    t0 = time.perf_counter()
    try:
        st = _store(store)
        if not library_current(st.path, list(models), library, library_params or {}):
            return None
        lib_attrs = st.catalog.library_attrs(library)
        have = st.scans()
        ids = list(scenes) if scenes is not None else [s for s in have if s not in set(models)]
        if not ids or not set(ids) <= set(have):
            return None
        recs = []
        for sid in ids:
            meta = st.attrs(sid)
            plan = stored_inputs(st, sid, library, lib_attrs, params, scan_attrs=meta)
            rec = meta.get("stages", {}).get("recognize")
            if not recognition_current(rec, recognition_key(library, lib_attrs["content_hash"], params, plan)):
                return None
            recs.append({"scan_id": sid, "status": "skipped", "detections": len(rec.get("detections", [])),
                         "evaluation": rec.get("evaluation"), "source": rec.get("source"), "seconds": 0.0})
    except Exception:
        return None
    summary = summarize(recs)
    summary.update(scenes=len(ids), workers=0, library="unchanged", seconds=time.perf_counter() - t0,
                   scenes_seconds=0.0, task_seconds=0.0)
    return summary


def _answer(flow: str, store: str, summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """A command's no-op answer, counted in the store (:func:`~scanforest.flows.records.count_noop`);
    with work to do (None), Prefect's local API starts now, in the background, to boot while the
    command imports its flow (the command line does not start it for these commands)."""
    from scanforest.flows.prefect_api import start_prefect_api
    from scanforest.flows.records import count_noop

    if summary is None:
        start_prefect_api()
        return None
    count_noop(store, flow, summary)
    return summary


def quick_describe(store: str, scans: list[str] | None, params) -> dict[str, Any] | None:
    """``describe`` on the command line: :func:`describe_noop`'s answer, or None (the API started)."""
    return _answer("describe", store, describe_noop(store, scans, params))


def quick_ingest(source: str, store: str) -> dict[str, Any] | None:
    """``ingest`` of an empty drop folder into an existing store: :func:`ingest_noop`'s answer,
    counted in the store, or None (the API started)."""
    return _answer("ingest", store, ingest_noop(source, store))


def quick_match(store: str, queries: list[str] | None, k: int, name: str) -> dict[str, Any] | None:
    """``match`` on the command line: :func:`match_noop`'s answer, or None (the API started)."""
    return _answer("match", store, match_noop(store, queries, k, name))


def quick_recognize(store: str, models: list[str], scenes: list[str] | None, library: str,
                    library_params: dict | None, params: dict) -> dict[str, Any] | None:
    """``recognize`` on the command line: :func:`recognize_noop`'s answer, or None (the API started)."""
    return _answer("recognize", store, recognize_noop(store, models, scenes, library, library_params, params))
