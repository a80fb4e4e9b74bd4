"""The user's paths, run as a user runs them: the installed ``scanforest`` command in a subprocess,
a fresh working folder, a cold numba cache (``NUMBA_CACHE_DIR`` set to an empty folder, shared by
this module's tests in the order a user would run them) and the default worker count.

A test with one worker and warm caches once hid a crash of the main command (numba's thread count
in spawned Dask workers); a happy-path test hid a report that crashed after recognize. These
tests keep both from coming back, and hold every user error to one line and exit 2.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCANFOREST = str(Path(sys.executable).with_name("scanforest"))


@pytest.fixture(scope="module")
def cold_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a fresh machine: an empty numba cache, no Prefect API set, no thread
    settings of ours, nothing but what a user's shell has."""
    cache = tmp_path_factory.mktemp("numba-cache-cold")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_API_URL", "NUMBA_NUM_THREADS", "SCANFOREST_"))}
    env.update(NUMBA_CACHE_DIR=str(cache), PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home")),
               PYTHONUNBUFFERED="1", COLUMNS="120")
    return env


def sf(*args: str, env: dict, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([SCANFOREST, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    return proc.stdout


# ------------------------------------------------------------------ the main job
def test_readme_demo_command_on_a_fresh_machine(cold_env, tmp_path):
    """README: ``scanforest demo`` (default options, default workers, cold caches) exits 0, every
    stage runs, recognition finds the synthetic instances, and the report renders after it."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "pip install -e . && scanforest demo" in readme  # the command this test runs
    out = _ok(sf("demo", env=cold_env, cwd=tmp_path, timeout=900))
    assert "+1 corrupt file" in out and "quarantined: " in out
    m = re.search(r"recognize: (\d+) scenes, (\d+) detections .* precision ([\d.]+), recall ([\d.]+)", out)
    assert m, out
    scenes, dets, precision, recall = int(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert scenes == 6 and dets > 0
    assert precision >= 0.75 and recall >= 0.75, out
    assert "failed:" not in out
    store = tmp_path / "scanforest-demo" / "store.zarr"
    rep = _ok(sf("report", str(store), "-o", str(tmp_path / "demo-report.html"), env=cold_env, cwd=tmp_path))
    assert "wrote" in rep
    html = (tmp_path / "demo-report.html").read_text()
    assert "Detections" in html and "scene_0000" in html


# ------------------------------------------------------------------ real data, every stage
def test_pcl_clouds_through_every_stage_and_the_report(cold_env, tmp_path, pcl_dir):
    """PCL's test clouds: ingest (the folder's README.md is not a failure) -> describe -> index
    build -> match -> recognize -> report. The milk carton is found once in PCL's tutorial scene
    at the identity (the model was cut out of that scene), as PCL's own tutorial finds it; the
    report opens in headless Chromium."""
    store = str(tmp_path / "pcl.zarr")
    out = _ok(sf("ingest", str(pcl_dir), store, "--json", env=cold_env, cwd=tmp_path))
    import json

    ing = json.loads(out)
    n_pcd = len(list(pcl_dir.glob("*.pcd")))
    assert ing["ingested"] == n_pcd and ing["quarantined"] == 0, ing
    scene = "milk_cartoon_all_small_clorox.pcd"
    _ok(sf("describe", store, "--scan", "milk.pcd", "--scan", scene, env=cold_env, cwd=tmp_path))
    _ok(sf("index", "build", store, "-r", "milk.pcd", "--name", "milk", "--method", "exact",
           env=cold_env, cwd=tmp_path))
    mt = json.loads(_ok(sf("match", store, "--name", "milk", "-q", scene, "--json", env=cold_env, cwd=tmp_path)))
    assert mt["matched"] == 1 and mt["queries"] > 100
    rc = json.loads(_ok(sf("recognize", store, "-m", "milk.pcd", "-s", scene, "--json", env=cold_env,
                           cwd=tmp_path)))
    assert rc["recognized"] == 1 and rc["failed"] == 0 and rc["detections"] == 1, rc
    from scanforest.tasks.store import ScanStore

    det = ScanStore(store, mode="r").attrs(scene)["stages"]["recognize"]["detections"]
    pose = np.asarray(det[0]["pose"])
    assert np.abs(pose[:3, :3] - np.eye(3)).max() < 0.02 and np.abs(pose[:3, 3]).max() < 0.005, pose
    info = _ok(sf("info", store, env=cold_env, cwd=tmp_path))
    assert "recognize 1" in info and "describe 2" in info
    html = tmp_path / "report.html"
    _ok(sf("report", store, "-o", str(html), env=cold_env, cwd=tmp_path))
    _render_in_chromium(html, tmp_path)


def _render_in_chromium(html: Path, tmp_path: Path) -> None:
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                    None)
    if chromium is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1200,1600"]
    shot = tmp_path / "report.png"
    res = subprocess.run([chromium, *flags, f"--screenshot={shot}", html.as_uri()], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    dom = subprocess.run([chromium, *flags, "--dump-dom", html.as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert "milk.pcd" in dom.stdout and "Detections" in dom.stdout
    from PIL import Image

    assert np.asarray(Image.open(shot).convert("L"), dtype=np.float32).std() > 5  # not a blank page


# ------------------------------------------------------------------ user errors: one line, exit 2
def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines()
             if ln.strip() and not ln.startswith(("device:", "note:"))]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> Path:
    """A store of three small described scans and an exact index (made through the task API: the
    tests below are about the commands refusing bad input, not about making it)."""
    from scanforest.tasks import index as idx
    from scanforest.tasks.describe import DescribeParams, describe_scan
    from scanforest.tasks.store import ScanStore

    store = tmp_path_factory.mktemp("small") / "store.zarr"
    st = ScanStore(store, create=True)
    rng = np.random.default_rng(3)
    for i in range(3):
        st.write_scan(f"s{i}.pcd", {"points": rng.random((2_000, 3)).astype(np.float32)}, {"sha256": f"s{i}"})
        describe_scan(str(store), f"s{i}.pcd", DescribeParams(keypoint_radius=0.2, shot_radius=0.2), device="cpu")
    ref, ref_scan, ref_row = idx.collect_reference(st, ["s0.pcd"])
    idx.build_index(str(store), "default", ref, params={"method": "exact"}, ref_scan=ref_scan, ref_row=ref_row,
                    scans=["s0.pcd"])
    return store


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.mark.parametrize("args,needles", [
    (("describe", "{store}", "--shot-radius", "-0.5"), ("--shot-radius", "-0.5")),
    (("describe", "{store}", "--normal-k", "0"), ("--normal-k",)),
    (("describe", "{store}", "--scan", "nope.pcd"), ("nope.pcd",)),
    (("match", "{store}", "-k", "0"), ("-k",)),
    (("match", "{store}", "-q", "nomatch*"), ("nomatch*",)),
    (("match", "{store}", "--name", "nosuchindex"), ("nosuchindex",)),
    (("index", "build", "{store}", "-r", "zz*"), ("zz*",)),
    (("index", "build", "{store}", "-r", "s0.pcd", "--shards", "0"), ("--shards",)),
    (("recognize", "{store}", "-m", "s0.pcd", "--cg-size", "-1"), ("--cg-size",)),
    (("recognize", "{store}", "-m", "nomodel*"), ("nomodel*",)),
], ids=["shot-radius", "normal-k", "scan", "k", "queries", "index", "reference", "shards", "cg-size", "models"])
def test_bad_parameters_fail_in_one_line_at_once(small_store, cold_env, tmp_path, args, needles):
    """A deterministic user error is never retried and prints one line: no traceback, no 12-18 s
    of retries, nothing written into the store."""
    import time

    before = _tree(small_store)
    t0 = time.perf_counter()
    proc = sf(*[a.format(store=small_store) for a in args], env=cold_env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, *needles)
    assert time.perf_counter() - t0 < 15  # refused before any cluster or server starts
    assert _tree(small_store) == before


@pytest.mark.parametrize("command", ["describe S", "match S", "info S", "recognize S -m x", "index build S -r x",
                                     "align-store S --pair a:b", "check S", "report S"])
def test_commands_on_a_missing_store_create_nothing(cold_env, tmp_path, command):
    args = [("missing.zarr" if a == "S" else a) for a in command.split()]
    proc = sf(*args, env=cold_env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, "missing.zarr")
    assert not (tmp_path / "missing.zarr").exists() and list(tmp_path.iterdir()) == []


def test_ingest_of_a_missing_source_creates_no_store(cold_env, tmp_path):
    proc = sf("ingest", "no-such-folder", "new.zarr", env=cold_env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, "no-such-folder")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_drop_folder_into_an_existing_store_is_not_an_error(small_store, cold_env, tmp_path):
    """A scheduled ingest of a drop folder between deliveries finds nothing: exit 0, nothing
    ingested, the store unchanged but for the run record; into a new store it is an error that
    creates nothing (a mistyped source)."""
    drop = tmp_path / "drop"
    drop.mkdir()
    (drop / "README.md").write_text("scans arrive here")
    import json

    out = json.loads(_ok(sf("ingest", str(drop), str(small_store), "--json", env=cold_env, cwd=tmp_path)))
    assert out["files"] == 0 and out["ingested"] == 0 and out["ignored"] == 1
    _one_line_error(sf("ingest", str(drop), "new.zarr", env=cold_env, cwd=tmp_path), str(drop))
    assert not (tmp_path / "new.zarr").exists()


def test_unreachable_scheduler_and_api_are_one_line(small_store, cold_env, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import time

    t0 = time.perf_counter()
    proc = sf("describe", str(small_store), "--scheduler", f"tcp://127.0.0.1:{port}", env=cold_env, cwd=tmp_path,
              timeout=180)
    _one_line_error(proc, f"tcp://127.0.0.1:{port}", "Dask scheduler")
    assert time.perf_counter() - t0 < 15  # refused before Prefect or Dask start
    env = {**cold_env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    proc = sf("describe", str(small_store), env=env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, "PREFECT_API_URL", str(port))


def test_a_scan_that_cannot_be_described_fails_alone(cold_env, tmp_path):
    """One bad scan (2 points) in a batch: recorded as failed with its id and reason, the others
    are described, the command says so and exits 0; the run record and the report show it."""
    from scanforest.tasks.readers import write_cloud

    src = tmp_path / "scans"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        write_cloud(src / f"ok{i}.pcd", rng.random((3_000, 3)).astype(np.float32))
    write_cloud(src / "tiny.pcd", rng.random((2, 3)).astype(np.float32))
    store = tmp_path / "s.zarr"
    _ok(sf("ingest", str(src), str(store), "--workers", "1", env=cold_env, cwd=tmp_path))
    out = _ok(sf("describe", str(store), "--keypoint-radius", "0.2", "--shot-radius", "0.2",
                 env=cold_env, cwd=tmp_path))
    assert re.search(r"failed: tiny\.pcd: .+", out), out
    assert re.search(r"described\s*│\s*3", out), out
    from scanforest.tasks.store import ScanStore

    st = ScanStore(store, mode="r")
    assert st.has_stage("ok0.pcd", "describe") and not st.has_stage("tiny.pcd", "describe")
    run = [r for r in st.runs() if r["flow"] == "describe"][-1]
    assert run["status"] == "completed"
    assert [r["scan_id"] for r in run["records"] if r["status"] == "failed"] == ["tiny.pcd"]
    _ok(sf("report", str(store), "-o", str(tmp_path / "r.html"), env=cold_env, cwd=tmp_path))
    assert "tiny.pcd" in (tmp_path / "r.html").read_text()


def test_relative_store_with_an_external_scheduler(cold_env, tmp_path):
    """``--scheduler``: a relative store path names the user's store, not one in the workers'
    working folder (they were started elsewhere)."""
    from scanforest.tasks.readers import write_cloud

    workdir = tmp_path / "workers-cwd"
    workdir.mkdir()
    sched = subprocess.Popen([sys.executable, "-c", _CLUSTER], cwd=workdir, env=cold_env, stdout=subprocess.PIPE,
                             text=True)
    try:
        address = sched.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        src = tmp_path / "in"
        src.mkdir()
        write_cloud(src / "a.pcd", np.random.default_rng(1).random((500, 3)).astype(np.float32))
        out = _ok(sf("ingest", "in", "rel.zarr", "--scheduler", address, "--json", env=cold_env, cwd=tmp_path))
        assert '"ingested": 1' in out
        from scanforest.tasks.store import ScanStore

        assert ScanStore(tmp_path / "rel.zarr", mode="r").scans() == ["a.pcd"]
        assert not (workdir / "rel.zarr").exists()
    finally:
        sched.terminate()
        sched.wait(timeout=60)


_CLUSTER = """
import time
from distributed import LocalCluster
if __name__ == "__main__":
    c = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None)
    print(c.scheduler_address, flush=True)
    time.sleep(600)
"""
