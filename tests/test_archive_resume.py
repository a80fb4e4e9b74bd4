"""A killed archive run, resumed as a user resumes it: the same command again.

``scanforest demo`` runs the archive chain (ingest -> library -> describe -> index -> match ->
recognize) on a synthetic archive. The run is killed (SIGKILL to its whole process group: the
command and its Dask workers; it reports to the test process's Prefect API, a user's server) while
recognize is writing detections; the
same command then finishes the job. Nothing may be lost or written twice: every scene has one
recognize record, its detection arrays agree with the record, the scenes done before the kill are
not redone, and the detections equal those of an uninterrupted recognize stage: every scene
recognised again, in this process, from the same stored description and matches (a copy of the
store, ``recognize_scan(force=True)``, the stage's own unit of work).

The numba cache is the test run's (a user's second run): the cold cache is the README demo's test.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
from _userpath import SCANFOREST, fresh_env, ok, sf

SCENES = 4  # enough for a kill between the first and the last recognised scene
# small scenes for CI's minutes (the demo's sparse presets); the detections below are compared, so
# they must find instances (before the demo chose its presets by scene size, 12,000-point scenes
# gave none, and the comparison compared empty lists)
DEMO = ("--scenes", str(SCENES), "--points", "12000")


@pytest.fixture(scope="module")
def env(prefect_api, tmp_path_factory) -> dict[str, str]:
    return fresh_env(tmp_path_factory, cold=False, api=prefect_api)


def _recognized(store) -> dict[str, dict]:
    """The scenes' recognize records as they are on disk now (a read during a write may fail:
    that scene counts as not done yet)."""
    from scanforest.tasks.store import ScanStore

    out = {}
    try:
        st = ScanStore(str(store), mode="r")
        ids = [s for s in st.scans() if not s.startswith("models__")]
    except Exception:
        return out
    for sid in ids:
        try:
            rec = st.stage(sid, "recognize")
        except Exception:
            continue
        if rec is not None:
            out[sid] = rec
    return out


def _detections(store) -> dict[str, list]:
    from scanforest.tasks.store import ScanStore

    st = ScanStore(str(store), mode="r")
    out = {}
    for sid, rec in _recognized(store).items():
        model = st.read(sid, "det_model")
        pose = st.read(sid, "det_pose")
        assert len(model) == len(pose) == len(rec["detections"]), sid  # arrays and record agree
        out[sid] = sorted((int(m), tuple(np.round(p, 6).ravel())) for m, p in zip(model, pose))
    return out


def test_a_killed_archive_run_resumes_without_duplicates_or_losses(env, tmp_path):
    work = tmp_path / "killed"
    store = work / "store.zarr"
    proc = subprocess.Popen([SCANFOREST, "demo", "--workdir", str(work), *DEMO], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    done_at_kill: dict[str, dict] = {}
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            done_at_kill = _recognized(store) if store.exists() else {}
            if done_at_kill:
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
    assert done_at_kill, f"recognize never wrote a scene before the run ended:\n{out[-3000:]}"
    assert proc.returncode == -signal.SIGKILL, f"the run finished before it could be killed:\n{out[-3000:]}"
    assert len(done_at_kill) < SCENES
    kept = {sid: rec["written"] for sid, rec in done_at_kill.items()}

    # the same command again finishes the job
    again = ok(sf("demo", "--workdir", str(work), *DEMO, env=env, cwd=tmp_path, timeout=900))
    m = re.search(r"recognize: (\d+) scenes, (\d+) detections", again)
    assert m and int(m[1]) == SCENES, again
    after = _recognized(store)
    assert len(after) == SCENES, sorted(after)
    for sid, stamp in kept.items():  # done before the kill: kept, not redone
        assert after[sid]["written"] == stamp, sid

    # the detections equal an uninterrupted recognize stage's: every scene again from the stored inputs
    from scanforest.tasks.recognize import recognize_scan

    clean = tmp_path / "clean.zarr"
    shutil.copytree(store, clean)
    for sid, rec in after.items():
        assert rec["source"] == "stored", (sid, rec.get("reason"))
        res = recognize_scan(str(clean), sid, rec["library"], rec["params"], device=rec.get("device", "cpu"),
                             force=True)
        assert res["status"] == "recognized", res
    got, want = _detections(store), _detections(clean)
    assert sorted(got) == sorted(want) and len(want) == SCENES
    assert sum(len(v) for v in want.values()) >= SCENES, want  # instances found: the comparison compares
    for sid in want:
        assert len(got[sid]) == len(want[sid]), sid
        for (mg, pg), (mw, pw) in zip(got[sid], want[sid]):
            assert mg == mw, sid
            np.testing.assert_allclose(pg, pw, atol=1e-4, err_msg=sid)
