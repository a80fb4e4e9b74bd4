"""Runs of one stage on one store at once share the work, summaries count what was stored, and a
store that fills up or turns read-only mid-run is one user error (issue 38, findings 5 and 6).

The two concurrent runs are two ``scanforest describe`` commands, as a user starts them. They
really overlap because of a test hook (``SCANFOREST_TEST_CLAIMED``, :func:`scanforest.tasks.units.after_claim`):
a unit of work that has claimed a scan announces it in a folder and waits there, its claim held,
until the test lets it go, so the test starts both runs, sees each hold a scan, and lets one run
finish while the other still holds its scan. The lost-worker test uses the same hook to kill the
worker at a known point: after it stored one scan of its batch, while it holds the next.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

SCANFOREST = str(Path(sys.executable).with_name("scanforest"))
HOOK = "SCANFOREST_TEST_CLAIMED"
#: cheap descriptors for tiny clouds in the unit cube (a few keypoints each)
DESCRIBE_ARGS = ("--keypoint-radius", "0.2", "--shot-radius", "0.2")


def _store(path: Path, n: int, points: int = 400) -> list[str]:
    """A store of ``n`` tiny random scans, written directly (no ingest run: seconds saved)."""
    from scanforest.tasks.store import ScanStore

    st = ScanStore(path, create=True)
    rng = np.random.default_rng(7)
    ids = [f"scan_{i:02d}.npy" for i in range(n)]
    for sid in ids:
        pts = rng.random((points, 3)).astype(np.float32)
        st.write_scan(sid, {"points": pts}, {"source": sid, "n_points": points, "format": "npy"})
    return ids


def _claims(folder: Path) -> list[tuple[str, str, str]]:
    """(stage, run, scan) of every claim announced in the hook folder."""
    out = []
    for f in folder.iterdir():
        parts = f.name.split("~")
        if len(parts) == 3 and not f.name.endswith(".go"):
            out.append((parts[0], parts[1], parts[2]))
    return out


@pytest.fixture(scope="module")
def prefect_api() -> str:
    """One Prefect API for the module, the flows run here and the commands started from here (a
    user's running server: each command skips starting its own, ~3.5 s of 2 cores apiece)."""
    from scanforest.flows.prefect_api import ensure_prefect_api

    return ensure_prefect_api()


def _env(api: str, hook: Path) -> dict[str, str]:
    """A user's environment with a Prefect server set (``PREFECT_API_URL``) and the test hook."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCANFOREST_")}
    env.update(PREFECT_API_URL=api, PYTHONUNBUFFERED="1", COLUMNS="120", **{HOOK: str(hook)})
    return env


def _wait(cond, timeout: float, procs=()) -> bool:
    """Poll ``cond`` until it holds (True), ``timeout`` passes or every process in ``procs`` ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if procs and all(p.poll() is not None for p in procs):
            return bool(cond())
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------ finding 5
def test_two_describes_at_once_share_the_scans(tmp_path, prefect_api):
    """Two ``scanforest describe STORE --workers 1`` at once (before: both described every scan,
    150 + 148 for 150, and each summary claimed them): each scan is described once, by one run;
    the other run leaves it (``held``: the run holding it is describing it; ``skipped``: done
    already), and the two summaries' ``described`` add up to the scans."""
    store = tmp_path / "s.zarr"
    ids = _store(store, 6)
    hook = tmp_path / "hook"
    hook.mkdir()
    procs = [subprocess.Popen([SCANFOREST, "describe", str(store), "--workers", "1", "--device", "cpu", "--json",
                               *DESCRIBE_ARGS], env=_env(prefect_api, hook), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        # both runs hold a scan: they overlap for sure
        both = _wait(lambda: len({run for _, run, _ in _claims(hook)}) >= 2, 240, procs)
        if both:
            first = _claims(hook)[0][1]
            (hook / f"go~{first}").touch()  # one run goes on; the other still holds its scan
            _wait(lambda: any(p.poll() is not None for p in procs), 120)
        (hook / "go").touch()
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        (hook / "go").touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in err, f"exit {p.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    sums = [json.loads(out) for out, _ in outs]
    described = [s["described"] for s in sums]
    assert both, f"the two runs did not both hold a scan at once: {sums}"
    assert sum(described) == len(ids) and min(described) >= 1, sums
    for s in sums:  # every scan accounted for once in each run: its own, left to the other, or done
        assert s["described"] + s["skipped"] + s["held"] + s["failed"] == len(ids), s
    assert sum(s["held"] for s in sums) >= 1, sums  # the run that went on found the other's scan held
    # nothing described twice: one claim per scan over both runs, and the runs' records are disjoint
    claimed = [sid for stage, _, sid in _claims(hook) if stage == "describe"]
    assert sorted(claimed) == sorted(ids), claimed
    from scanforest.tasks.store import ScanStore

    st = ScanStore(store, mode="r")
    runs = [r for r in st.runs() if r.get("flow") == "describe" and r.get("status") == "completed"]
    assert len(runs) == 2, runs
    mine = [{r["scan_id"] for r in run["records"] if r["status"] == "described"} for run in runs]
    assert not (mine[0] & mine[1]) and mine[0] | mine[1] == set(ids), mine
    writers = {st.stage(sid, "describe")["run"] for sid in ids}
    assert writers == {run["flow_run_id"] for run in runs}, writers
    assert sum(st.stage(sid, "describe")["keypoints"] for sid in ids) == sum(s["keypoints"] for s in sums)


# ------------------------------------------------------------------ finding 6
def test_summary_counts_what_a_killed_worker_stored(tmp_path, monkeypatch, prefect_api):
    """The worker is SIGKILLed after it stored one scan of its batch, while it holds the next:
    Dask runs the batch again on the restarted worker, and the stored scan's unit then finds its
    stage written (before: ``keypoints`` counted it as 0, e.g. 234,205 where 244,323 were
    stored). The summary counts it as described with its stored keypoints."""
    from scanforest.flows.describe import describe_flow
    from scanforest.tasks.describe import DescribeParams
    from scanforest.tasks.store import ScanStore

    store = tmp_path / "s.zarr"
    ids = _store(store, 4)
    hook = tmp_path / "hook"
    hook.mkdir()
    monkeypatch.setenv(HOOK, str(hook))  # the local cluster's worker inherits it
    st = ScanStore(store, mode="r")
    killed: list[str] = []
    done = threading.Event()

    def killer():
        if not _wait(lambda: _claims(hook) or done.is_set(), 120) or done.is_set():
            return
        stage, run, first = _claims(hook)[0]
        (hook / f"{stage}~{run}~{first}.go").touch()  # the worker stores this scan, then claims the next
        if not _wait(lambda: len(_claims(hook)) >= 2 or done.is_set(), 120) or done.is_set():
            return
        nxt = next(c for c in _claims(hook) if c[2] != first)
        pid = int((hook / "~".join(nxt)).read_text())
        if st.has_stage(first, "describe"):
            os.kill(pid, signal.SIGKILL)
            killed.append(first)
        (hook / "go").touch()

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        summary = describe_flow(store=str(store), params=DescribeParams(keypoint_radius=0.2, shot_radius=0.2),
                                device="cpu", workers=1, batch=len(ids), progress=False)
    finally:
        done.set()
        (hook / "go").touch()
        t.join(30)
    assert killed, f"the worker was not killed after storing a scan: {summary}"
    stored = sum(st.stage(sid, "describe")["keypoints"] for sid in ids)
    assert summary["described"] == len(ids) and summary["skipped"] == 0 and summary["held"] == 0, summary
    assert summary["keypoints"] == stored > 0, summary


def test_count_redone_takes_only_this_runs_scans(tmp_path):
    """A skipped or held unit counts as this run's work only where the stage record names this run
    (with the stored figures); another run's scans stay skipped/held whenever they were written."""
    from scanforest.flows.describe import summarize
    from scanforest.tasks.store import ScanStore, utc_now

    store = tmp_path / "s.zarr"
    ids = _store(store, 4, points=8)
    st = ScanStore(store)
    since = utc_now()
    for sid, run, kp in zip(ids, ["me", "me", "other", "other"], [5, 7, 11, 13]):
        st.write_stage(sid, "describe", {"kp_index": np.arange(kp)}, {"keypoints": kp, "run": run})
    recs = [{"scan_id": ids[0], "status": "described", "keypoints": 5, "seconds": 0.1},
            {"scan_id": ids[1], "status": "skipped", "keypoints": 0, "seconds": 0.0},  # redone after a loss
            {"scan_id": ids[2], "status": "skipped", "keypoints": 0, "seconds": 0.0},  # the other run's, just now
            {"scan_id": ids[3], "status": "held", "keypoints": 0, "seconds": 0.0}]
    s = summarize(recs, st, since=since, run="me")
    assert (s["described"], s["skipped"], s["held"], s["keypoints"]) == (2, 1, 1, 12), s


# ------------------------------------------------------------------ a store that cannot be written
def test_a_full_or_read_only_store_is_one_user_error(tmp_path, monkeypatch):
    """ENOSPC/EDQUOT/EROFS inside the store's writes is a user error naming the store and the
    reason: not retried, not one scan's failure (it ends the run), one line from the command."""
    import scanforest.tasks.store.scans as store_mod
    from scanforest.flows.prefect_tasks import not_a_user_error
    from scanforest.kernels.errors import InputError
    from scanforest.tasks.store import ScanStore, StoreWriteError
    from scanforest.tasks.units import isolated

    store = tmp_path / "s.zarr"
    (sid,) = _store(store, 1, points=8)
    st = ScanStore(store)

    def fail(code, where):
        def raiser(*args, **kwargs):
            raise OSError(code, os.strerror(code), str(where))
        return raiser

    inside = store / "scans" / sid / "kp_index" / "c" / "0"
    monkeypatch.setattr(store_mod, "_write_arrays", fail(errno.ENOSPC, inside))
    with pytest.raises(StoreWriteError) as full:
        st.write_stage(sid, "describe", {"kp_index": np.arange(3)}, {"keypoints": 3})
    assert isinstance(full.value, InputError)
    assert str(full.value) == f"cannot write to {store}: no space left on device"
    assert st.stage(sid, "describe") is None
    again = pickle.loads(pickle.dumps(full.value))  # as it comes back from a Dask worker
    assert type(again) is StoreWriteError and str(again) == str(full.value)
    assert not not_a_user_error(None, None, SimpleNamespace(data=full.value))  # never retried
    with pytest.raises(StoreWriteError):  # ends the run: not recorded as this scan's failure
        isolated(st.write_stage, sid, sid, "describe", {"kp_index": np.arange(3)}, {})

    monkeypatch.setattr(store_mod, "_write_arrays", fail(errno.EROFS, inside))  # write_scan's arrays
    with pytest.raises(StoreWriteError, match="read-only file system"):
        st.write_scan("new.npy", {"points": np.zeros((4, 3), np.float32)}, {"n_points": 4})
    monkeypatch.setattr(store_mod, "_jsonable", fail(errno.EDQUOT, store / "runs"))
    with pytest.raises(StoreWriteError, match=str(store)):
        st.write_run("r1", {"status": "running"})
    # a file outside the store that fails the same way is not blamed on the store
    monkeypatch.setattr(store_mod, "_write_arrays", fail(errno.ENOSPC, tmp_path / "elsewhere"))
    with pytest.raises(OSError) as other:
        st.write_stage(sid, "describe", {"kp_index": np.arange(3)}, {})
    assert not isinstance(other.value, StoreWriteError)
