"""The recognize flow over the store: PCL's correspondence-grouping scene, exports, resume."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from scanforest.flows.ingest import run_ingest
from scanforest.flows.recognize import run_recognize
from scanforest.tasks.store import ScanStore


def test_recognize_flow_finds_the_milk_carton(tmp_path, pcl_dir):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("milk.pcd", "milk_cartoon_all_small_clorox.pcd"):
        (src / name).write_bytes((pcl_dir / name).read_bytes())
    store = str(tmp_path / "s.zarr")
    assert run_ingest(str(src), store, workers=1, progress=False)["ingested"] == 2
    out = tmp_path / "exports"
    # PCL tutorial defaults: model_ss 0.01, scene_ss 0.03, rf 0.015, descr 0.02, Hough bin 0.01, threshold 5
    res = run_recognize(store, ["milk.pcd"], workers=1, device="cpu", progress=False, export=str(out))
    assert res["recognized"] == 1 and res["detections"] == 1
    st = ScanStore(store, mode="r")
    sid = "milk_cartoon_all_small_clorox.pcd"
    pose = st.read(sid, "det_pose")[0]
    # milk.pcd was cut out of this scene: the true pose is the identity
    angle = np.degrees(np.arccos(np.clip((np.trace(pose[:3, :3]) - 1) / 2, -1, 1)))
    assert angle < 2.0 and np.linalg.norm(pose[:3, 3]) < 0.01
    assert st.read(sid, "det_model").tolist() == [0]
    df = pd.read_parquet(out / "detections.parquet")
    assert len(df) == 1 and df.loc[0, "model"] == "milk.pcd"
    assert len(pd.read_csv(out / "detections.csv")) == 1
    assert (out / "renders" / f"{sid}.png").stat().st_size > 1000
    again = run_recognize(store, ["milk.pcd"], workers=1, device="cpu", progress=False)
    assert again["skipped"] == 1 and again["library"] == "unchanged"
    # `recognize --export` with every scene current: exported from the store, no cluster (it started one, 21 s)
    from typer.testing import CliRunner

    from scanforest.deploy.cli import app

    res = CliRunner().invoke(app, ["recognize", store, "-m", "milk.pcd", "--export", str(tmp_path / "again"), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert (got["workers"], got["skipped"], got["detections"]) == (0, 1, 1), got
    assert pd.read_csv(tmp_path / "again" / "detections.csv").equals(pd.read_csv(out / "detections.csv"))
    assert (tmp_path / "again" / "renders" / f"{sid}.png").is_file() and set(got["exports"]) == {"csv", "parquet",
                                                                                                  "renders"}
    # thinned (`recognize --voxel 0.015`): a library of thinned models, the scene thinned as they
    # are, the pose polished on the scene's own points; the stored full description is not used
    thin = run_recognize(store, ["milk.pcd"], library="thin", workers=1, device="cpu", progress=False,
                         library_params=dict(voxel=0.015, model_ss=0.03, descr_rad=0.06, rf_rad=0.045),
                         params=dict(scene_voxel=0.015, scene_ss=0.045, method="gc", cg_size=0.03))
    assert thin["recognized"] == 1 and thin["detections"] == 1 and thin["recomputed"] == 1
    assert any("scene_voxel" in r for r in thin["recompute_reasons"])
    pose = ScanStore(store, mode="r").read(sid, "det_pose")[0]
    assert np.abs(pose - np.eye(4)).max() < 1e-4


def test_flow_process_killed_midway_then_rerun(tmp_path, prefect_api):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-archive: the command
    stops within seconds, exit 130 (it waited for its killed workers for good), on its own: its
    flow's threads stop waiting on the cluster (they held it until the grace timer ended it,
    without its clean-up); the run is marked interrupted; a rerun does every scene exactly once.
    (SIGKILL: test_archive_resume and test_prefect_server's killed command.)"""
    import os
    import signal
    import subprocess
    import sys
    import time

    from scanforest.tasks.synth import write_archive

    write_archive(tmp_path / "arch", n_models=2, n_scenes=4, points_per_scene=12_000, points_per_model=3_000)
    store = str(tmp_path / "s.zarr")
    run_ingest(str(tmp_path / "arch"), store, workers=1, progress=False)
    st = ScanStore(store, mode="r")
    scenes = [s for s in st.scans() if s.startswith("scenes__")]
    args = [sys.executable, "-m", "scanforest.deploy.cli", "recognize", store, "-m", "models__*",
            "--model-ss", "0.01", "--descr-rad", "0.04", "--rf-rad", "0.03", "--scene-ss", "0.02",
            "--cg-size", "0.02", "--device", "cpu", "--workers", "1"]
    env = {**os.environ, "PREFECT_API_URL": prefect_api}  # a user with a server (conftest)
    errfile = open(tmp_path / "stderr.txt", "w")  # a file, not a pipe: its progress output never blocks it
    proc = subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=errfile)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and sum(st.has_stage(s, "recognize") for s in scenes) < 1:
            assert proc.poll() is None, "recognize finished before it could be killed"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.time()
        proc.wait(30)
        errfile.close()
        err = (tmp_path / "stderr.txt").read_text()
        assert proc.returncode == 130, err
        assert time.time() - t0 < 15  # the grace is 6 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done_before = [s for s in scenes if st.has_stage(s, "recognize")]
    # the scenes a worker had in hand may still be written as the command stops (on CI's 2 cores
    # all four were): the rerun then skips them all
    assert 1 <= len(done_before) <= len(scenes)
    assert [r["status"] for r in st.runs() if r.get("flow") == "recognize"] == ["interrupted"]
    before = {s: st.read(s, "det_pose").copy() for s in done_before}
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    st = ScanStore(store, mode="r")
    for s in scenes:  # no scene missing, none duplicated, finished ones untouched
        assert st.has_stage(s, "recognize")
        n = len(st.attrs(s)["stages"]["recognize"]["detections"])
        assert len(st.read(s, "det_model")) == n == len(st.read(s, "det_pose"))
    for s, pose in before.items():
        np.testing.assert_array_equal(st.read(s, "det_pose"), pose)
    runs = [r for r in st.runs() if r.get("flow") == "recognize"]
    done = [r for r in runs if r.get("status") == "completed"]
    if len(done_before) < len(scenes):
        assert len(done) == 1 and done[0]["summary"]["skipped"] == len(done_before)
    else:  # every scene was written as the command stopped: the rerun found nothing to do (counted, not kept)
        noop = dict(st.root["runs"].attrs.get("noop_runs") or {}).get("recognize") or {}
        assert not done and noop.get("count") == 1 and noop["summary"]["skipped"] == len(scenes), noop
    # the interrupted run's record says so (its crash hook wrote it as the command stopped)
    killed = [r for r in runs if r.get("status") == "interrupted"]
    assert len(killed) == 1 and killed[0]["pid"] == proc.pid and "interrupt" in killed[0]["error"]
    assert not [r for r in runs if r.get("status") == "running"]
    # quietly: the workers end where they are (each printed a KeyboardInterrupt traceback)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    # on its own, not by the grace timer (which says so; its exit skipped the clean-up: leaked semaphores)
    assert "not stopped within" not in err and "leaked semaphore" not in err, err
    assert "Crash detected" not in err and "Interrupted" not in err, err  # Prefect's lines: the command said it


@pytest.mark.parametrize("ctrl_c", [True, False])
def test_a_run_ended_by_the_grace_timer_after_a_ctrl_c_is_recorded_so(tmp_path, ctrl_c):
    """A Ctrl-C while the command's main thread is in a long numba call: the grace timer ends the
    process (os._exit: no hook runs) and its watchdog records the run. It recorded it as
    killed; the handler now tells the watchdog first (records.note_interrupt)."""
    import subprocess
    import sys
    import time

    store = ScanStore(tmp_path / "s.zarr", create=True)
    store.write_run("r1", {"flow": "process", "status": "running", "pid": 1, "host": "h"})
    code = (f"import os; from scanforest.flows import records; records._watchdog.watch({str(store.path)!r}, 'r1', None)"
            f"{'; records.note_interrupt()' if ctrl_c else ''}; os._exit(130)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 130
    deadline = time.time() + 60
    while (run := ScanStore(store.path, mode="r").catalog.run("r1"))["status"] == "running" and time.time() < deadline:
        time.sleep(0.2)
    assert run["status"] == "interrupted", run
    assert run["error"].endswith("(stopped by a Ctrl-C)" if ctrl_c else "(killed)"), run["error"]


def test_summary_sums_the_phase_timings_of_recognised_scenes():
    from scanforest.flows.recognize import summarize

    recs = [{"status": "recognized", "detections": 2, "timings": {"grouping": 0.5, "icp": 0.25}},
            {"status": "recognized", "detections": 1, "timings": {"grouping": 1.5, "total": 2.0}},
            {"status": "skipped", "detections": 3}]
    s = summarize(recs)
    assert s["recognized"] == 2 and s["skipped"] == 1 and s["detections"] == 6
    assert s["phase_seconds"] == {"grouping": 2.0, "icp": 0.25, "total": 2.0}
    assert "phase_seconds" not in summarize([{"status": "skipped", "detections": 0}])


def test_precision_of_no_detections_is_undefined_not_zero():
    """Scenes with ground truth and no detection: precision is undefined (None, "n/a" in the
    table), recall 0; with detections and no true instance the recall is undefined."""
    from scanforest.deploy.cli.core import _cell
    from scanforest.flows.recognize import summarize

    def ev(tp, fp, fn):
        return {"status": "recognized", "evaluation": {"tp": tp, "fp": fp, "fn": fn, "rotation_errors": [],
                                                       "translation_errors": [], "resolution": 1.0}}

    s = summarize([ev(0, 0, 3), ev(0, 0, 1)])
    assert s["tp"] == 0 and s["fn"] == 4 and s["precision"] is None and s["recall"] == 0.0
    assert _cell("precision", s["precision"]) == "n/a"
    s = summarize([ev(0, 2, 0)])
    assert s["precision"] == 0.0 and s["recall"] is None
    s = summarize([ev(3, 1, 1)])
    assert s["precision"] == 0.75 and s["recall"] == 0.75


def test_no_detections_say_which_stage_lost_them():
    """Recognised scenes with no detection at all: the summary sums each scene's funnel and one
    note names the stage that lost them (no correspondence, no hypothesis, none verified)."""
    from scanforest.flows.recognize import no_detections_note, summarize

    def rec(kp, corr, hyp, best, det=0):
        return {"status": "recognized", "detections": det, "funnel": {
            "keypoints": kp, "correspondences": corr, "hypotheses": hyp, "best_score": best, "detections": det}}

    s = summarize([rec(100, 0, 0, None), rec(50, 0, 0, None)])
    assert s["funnel"] == {"keypoints": 150, "correspondences": 0, "hypotheses": 0, "detections": 0,
                           "best_score": None}
    assert "none of their 150 keypoints matched" in no_detections_note(s, {})
    s = summarize([rec(100, 40, 0, None), rec(50, 2, 0, None)])
    assert "42 correspondences formed no group of 4" in no_detections_note(s, {"cg_thresh": 4, "method": "gc"})
    s = summarize([rec(100, 40, 3, 0.31), rec(50, 20, 1, 0.12)])
    note = no_detections_note(s, {"min_inlier_fraction": 0.7})
    assert "4 hypotheses, none verified" in note and "0.31" in note and "0.7" in note
    assert no_detections_note(summarize([rec(100, 40, 3, 0.9, det=1)]), {}) is None
    assert no_detections_note(summarize([{"status": "skipped", "detections": 0}]), {}) is None


def test_a_run_with_another_library_says_whose_detections_it_replaces(tmp_path):
    """A scene keeps one recognition: recognising it with library B replaced library A's
    detections without a word. The run counts them per library and says so in one line."""
    from scanforest.flows.recognize import other_libraries, replaced_note

    st = ScanStore(tmp_path / "s.zarr", create=True)
    rng = np.random.default_rng(0)
    for sid, lib in (("a", "boxes"), ("b", "boxes"), ("c", "default"), ("d", None)):
        st.write_scan(sid, {"points": rng.random((50, 3)).astype(np.float32)}, {"n_points": 50})
        if lib is not None:
            st.write_stage(sid, "recognize", {"det_model": np.zeros(0, np.int32)}, {"library": lib})
    assert other_libraries(st, ["a", "b", "c", "d"], "default") == {"boxes": 2}
    assert other_libraries(st, ["c", "d"], "default") == {}
    note = replaced_note({"boxes": 2}, "default")
    assert "library 'boxes''s in 2 scenes by library 'default''s" in note and len(note.splitlines()) == 1
