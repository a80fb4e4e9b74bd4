"""What a flow run leaves on record: the run records in the store's ``runs`` group (opened as
``running`` by the flows' start hook, :data:`RUN_HOOKS`, and closed as ``completed`` by
:func:`record_run`, ``failed`` or ``interrupted`` by the other hooks), the count of runs that found
nothing to do (:func:`count_noop`), the runs killed processes left ``running``
(:func:`mark_interrupted`), and a stage's records of its scans (:func:`count_redone`,
:func:`failures`)."""
from __future__ import annotations

import contextlib
import logging
import os

from . import _watchdog
from .inputs import absolute_path
from .prefect_api import local_api_pid

#: tell this process's run watchdogs that a Ctrl-C is stopping it (:func:`._watchdog.note_interrupt`)
note_interrupt = _watchdog.note_interrupt


def count_redone(records: list[dict], st, stage: str, since: str, status: str, *, run: str | None = None,
                 fields: dict[str, str] | None = None) -> None:
    """Count as ``status`` every scan whose ``stage`` this run wrote, whatever its unit reported.

    A unit that a lost worker had finished before Dask ran it again reports ``skipped`` (the
    stage is there), and one that Dask ran again while the first copy still held the scan
    reports ``held``; the stage record says who wrote it. A record naming its run (``run``: the
    flow run's id, default the current one, :func:`scanforest.flows.prefect_tasks.current_run`) is this
    run's when it names this run, and never another's, so two runs at once never both claim a
    scan; a record without one (an older version's, or a unit that does not record its run) is
    this run's when written at or after ``since`` (the run's start in the store's ISO format).
    ``fields``: record key -> stage-record key, the figures taken from the stored record for such
    a scan (``{"keypoints": "keypoints"}``: the summary counts what was stored, not the redone
    unit's zero)."""
    from scanforest.tasks.units import HELD

    from .prefect_tasks import current_run

    run = run or current_run()
    for r in records:
        if r.get("status") not in ("skipped", HELD):
            continue
        rec = st.stage(r["scan_id"], stage) or {}
        owner = rec.get("run")
        mine = (owner == run) if owner and run else (r["status"] == "skipped" and bool(rec)
                                                      and rec.get("written", "") >= since)
        if mine:
            r["status"] = status
            r.pop("reason", None)
            for key, field in (fields or {}).items():
                if field in rec:
                    r[key] = rec[field]


def failures(records: list[dict]) -> list[dict]:
    """The failed items of a stage: id and reason, for the summary and the report."""
    return [{"scan_id": r.get("scan_id"), "reason": r.get("reason", ""),
             **({"where": r["where"]} if r.get("where") else {})}
            for r in records if r.get("status") == "failed"]


def box_origin(records: list[dict], listed: int = 100) -> dict:
    """The scans of a stage's records (an E57 file's under its ``scans``) flagged ``box_origin``:
    georeferenced with no file offset, their origin chosen from the bounding box. ``box_origin``
    (how many) and ``box_origin_scans`` (the first ``listed`` ids) for the summary; nothing when
    there are none."""
    ids = [str(s.get("scan_id")) for r in records for s in (r.get("scans") or [r]) if s.get("box_origin")]
    return {"box_origin": len(ids), "box_origin_scans": ids[:listed]} if ids else {}


def _started_at(summary: dict) -> float:
    import time

    return time.time() - float(summary.get("seconds") or 0.0)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("scanforest", "numpy", "numba", "zarr", "dask", "distributed", "prefect", "cupy-cuda12x",
                 "cupy-cuda13x", "dask-cuda"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


_RECORD_KEYS = ("scan_id", "status", "seconds", "finished_at", "points", "keypoints", "reason", "detections")


def _iso(t: float | None = None) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _run_id(flow: str, flow_run=None) -> str:
    """The store's key of a run: its flow, start time and (inside a Prefect flow run) the run's id,
    so the record written when it starts, when it ends and when it fails is one record."""
    import time
    import uuid

    if flow_run is None:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        flow_run = ctx.flow_run if ctx is not None else None
    if flow_run is None:
        return f"{flow}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    started = flow_run.expected_start_time or flow_run.created
    return f"{flow}-{started.strftime('%Y%m%dT%H%M%S')}-{flow_run.id.hex[:6]}"


def _existing_store(path) -> "object | None":
    """The store at ``path`` when one exists (run records never create a store)."""
    from scanforest.tasks.store import ScanStore

    if not path or not ScanStore.exists(absolute_path(path)):
        return None

    try:
        return ScanStore(absolute_path(path), mode="a")
    except Exception as exc:  # noqa: BLE001 - the run goes on; its record is lost, and that is said
        logging.getLogger("scanforest").warning("run records not written to %s: %s: %s", path,
                                                type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def _flow_key(flow) -> str:
    return flow.name.removeprefix("scanforest-")


def process_gone(run: dict) -> bool | None:
    """Whether the process that wrote a ``running`` run record has ended: True or False on the
    host that ran it, None elsewhere (another host's processes cannot be seen from here)."""
    import socket

    pid = run.get("pid")
    if not pid or run.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by another user
        return False
    return False


def mark_interrupted(st) -> None:
    """Runs of this store that a killed process left ``running`` (on this host) become
    ``interrupted`` in the store and ``Crashed`` in Prefect (when that API holds them), so an
    operator sees them as failures, not as runs still going (what the run's watchdog does at once;
    this catches runs whose watchdog was killed too)."""
    for run in st.runs():
        if run.get("status") == "running" and process_gone(run):
            _watchdog.interrupt(st, run)


def _on_running(flow, flow_run, state) -> None:
    """Flow hook: a run that started is in the store as ``running`` at once, with its host,
    process id and Prefect flow run id; runs that earlier killed processes left ``running`` are
    marked interrupted (:func:`mark_interrupted`)."""
    st = _existing_store(flow_run.parameters.get("store"))
    if st is not None:
        import socket

        mark_interrupted(st)
        run_id = _run_id(_flow_key(flow), flow_run)
        # the watchdog first: a process killed once its record says running is noticed at once (not
        # when the next flow opens the store); killed before that, its watchdog finds no such record
        _watchdog.watch(st.path, run_id, str(flow_run.id), local_api_pid())
        st.write_run(run_id,
                     {"flow": _flow_key(flow), "status": "running", "started": _iso(),
                      "host": socket.gethostname(), "pid": os.getpid(), "flow_run_id": str(flow_run.id),
                      "parameters": _public_params(flow_run.parameters), "versions": versions()})


def _on_failure(flow, flow_run, state, status: str = "failed") -> None:
    """Flow hook (failed): the run is in the store as ``failed`` with its error in one line."""
    st = _existing_store(flow_run.parameters.get("store"))
    if st is None:
        return
    run_id = _run_id(_flow_key(flow), flow_run)
    old = _run_attrs(st, run_id)
    msg = (state.message or state.name or status).strip().splitlines()
    st.write_run(run_id, {"flow": _flow_key(flow), "status": status, "started": old.get("started", _iso()),
                          "finished": _iso(), "error": msg[0] if msg else status,
                          "parameters": _public_params(flow_run.parameters), "versions": versions()})
    _watchdog.release(run_id)


def _on_crashed(flow, flow_run, state) -> None:
    """Flow hook (crashed: a served run's process killed, seen by its runner): ``interrupted``."""
    _on_failure(flow, flow_run, state, status="interrupted")


def _run_attrs(store, run_id: str) -> dict:
    return store.catalog.run(run_id) or {}


def _public_params(params: dict) -> dict:
    return {k: v for k, v in (params or {}).items() if k not in ("progress",)}


#: hooks every scanforest flow carries: ``@flow(..., **RUN_HOOKS)``
RUN_HOOKS = {"on_running": [_on_running], "on_failure": [_on_failure], "on_crashed": [_on_crashed]}


#: the figures of a stage's summary that count work done: a run with all of them 0, no failure
#: (and no library built) did nothing (:func:`is_noop`)
WORK_FIGURES = {"describe": ("described",), "match": ("matched",), "recognize": ("recognized",),
                "process": ("recognized", "described", "matched")}


def is_noop(flow: str, summary: dict) -> bool:
    """Whether a run of ``flow`` with this summary found nothing to do (ingest and the other flows:
    never; an index build when it kept the index unchanged)."""
    if flow == "index-build":
        return summary.get("status") == "unchanged"
    keys = WORK_FIGURES.get(flow)
    if (keys is None or summary.get("failed") or summary.get("failures") or summary.get("held")
            or summary.get("library") == "built"):  # failures, and scans left to a concurrent run, stay on record
        return False
    return all(not summary.get(k) for k in keys)


def count_noop(store, flow: str, summary: dict, run_id: str | None = None) -> None:
    """A run that found nothing to do, summarised instead of stored: the record its start hook
    opened (``run_id``) is removed, and the store's ``runs`` group keeps, per flow, how many such
    runs there were, the first and last one's time and the last one's scalar figures (attribute
    ``noop_runs``), so an idle store's schedule adds no record per run. ``store``: a
    :class:`~scanforest.tasks.store.ScanStore` or a path; best effort (a store that cannot be
    written keeps no count)."""
    from scanforest.tasks.store import ScanStore

    with contextlib.suppress(Exception):
        st = store if isinstance(store, ScanStore) else ScanStore(absolute_path(store), mode="a")
        st.count_noop_run(flow, summary, _iso(), run_id)


def record_run(store, flow: str, parameters: dict, summary: dict, records: list[dict]) -> str:
    """Write the run manifest into the store (the record the run's start hook opened, now
    ``completed``) and a Prefect table artifact for the run. A run that found nothing to do
    (:func:`is_noop`) is counted instead (:func:`count_noop`)."""
    run_id = _run_id(flow)
    if is_noop(flow, summary):
        count_noop(store, flow, summary, run_id)
        _watchdog.release(run_id)
        return run_id
    old = _run_attrs(store, run_id)
    slim = [{k: r[k] for k in _RECORD_KEYS if k in r} for r in records]
    store.write_run(run_id, {"flow": flow, "status": "completed", "parameters": parameters, "summary": summary,
                             "versions": versions(), "records": slim,
                             "started": old.get("started") or _iso(_started_at(summary)), "finished": _iso()})
    _watchdog.release(run_id)
    try:
        from prefect.artifacts import create_table_artifact

        rows = [{"figure": k, "value": str(v)} for k, v in summary.items() if not isinstance(v, (list, dict))]
        create_table_artifact(rows, key=f"scanforest-{flow}", description=f"{flow} summary ({run_id})")
    except Exception:  # outside a flow run, or the API refused: the manifest is what counts
        pass
    return run_id
