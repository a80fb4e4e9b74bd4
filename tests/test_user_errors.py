"""User errors, as a user makes them: the installed command in a subprocess, with a fresh
environment (but the test run's numba cache: the cold cache is the README demo's test). Each
prints one line naming the problem and exits 2, at once (before any cluster or server starts,
where the problem can be known then), never retried, with nothing written or created; and the
operator's cases that are not errors (an empty drop folder) are not."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _userpath import fresh_env, ok as _ok, one_line_error as _one_line_error, sf


@pytest.fixture(scope="module")
def user_env(tmp_path_factory) -> dict[str, str]:
    return fresh_env(tmp_path_factory, cold=False)


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
    (("index", "build", "{store}", "-r", "s0.pcd", "--recall", "0.9", "--backtracks", "8"), ("--recall", "not both")),
    (("index", "build", "{store}", "-r", "s0.pcd", "--recall", "1.5"), ("recall must be",)),
    (("index", "build", "{store}", "-r", "s0.pcd", "--graph", "300"), ("--graph must be in 1..256",)),
    (("recognize", "{store}", "-m", "s0.pcd", "--cg-size", "-1"), ("--cg-size",)),
    (("recognize", "{store}", "-m", "nomodel*"), ("nomodel*",)),
    (("recognize", "{store}", "-m", "s0.pcd", "--voxel", "-0.01"), ("--voxel", "positive")),
    (("library", "build", "{store}", "-m", "s0.pcd", "--voxel", "0.01", "--views", "4"), ("--voxel", "--views")),
    # a bad number is refused as it is parsed (it failed on a worker as "k must be >= 3", a run recorded)
    (("library", "build", "{store}", "-m", "s0.pcd", "--normal-k", "2"), ("--normal-k must be at least 3",)),
    (("describe", "{store}", "--workers", "0"), ("--workers",)),
    (("describe", "{store}", "--workers", "100000"), ("--workers 100000", "at most")),
    (("archive", "{store}", "{store}.new", "--method", "ransac"), ("--method",)),  # before anything is ingested
    # an empty name was the libraries' (indexes') group itself: building it removed every other one
    (("library", "build", "{store}", "-m", "s0.pcd", "--name", ""), ("library name ''",)),
    (("index", "build", "{store}", "-r", "s0.pcd", "--name", "../x"), ("index name '../x'",)),
    # outputs refused before the work (a traceback after it; -o STORE/zarr.json made the store unreadable)
    (("report", "{store}", "-o", "{store}/zarr.json"), ("--out", "inside the scan store")),
    (("recognize", "{store}", "-m", "s0.pcd", "--export", "{store}/zarr.json"), ("--export", "not a folder")),
    (("align-store", "{store}", "--pair", "s0.pcd"), ("--pair takes OBSERVED:REFERENCE", "'s0.pcd'")),  # was a box
], ids=["shot-radius", "normal-k", "scan", "k", "queries", "index", "reference", "shards", "recall-and-budget",
        "recall-range", "graph-degree", "cg-size", "models", "voxel", "voxel-views", "library-normal-k", "workers",
        "workers-many", "archive-method",
        "library-empty-name", "index-name-up", "report-into-store", "export-to-a-file", "align-pair-form"])
def test_bad_parameters_fail_in_one_line_at_once(small_store, user_env, tmp_path, args, needles):
    """A deterministic user error is never retried and prints one line: no traceback, no 12-18 s
    of retries, nothing written into the store."""
    import time

    before = _tree(small_store)
    t0 = time.perf_counter()
    proc = sf(*[a.format(store=small_store) for a in args], env=user_env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, *needles)
    assert time.perf_counter() - t0 < 15  # refused before any cluster or server starts
    assert _tree(small_store) == before
    assert not Path(f"{small_store}.new").exists()  # no store created by a refused archive


def test_an_archive_without_models_is_refused_before_anything_is_ingested(user_env, tmp_path):
    """A folder with no models/ (or a --models pattern that picks nothing) ingested the whole
    folder, creating the store, and then said no scan matched: now one line at once, no store;
    a store that already holds the models, or a source with them, passes the check."""
    from scanforest.flows.inputs import check_archive_models
    from scanforest.kernels.errors import InputError
    from scanforest.tasks.store import ScanStore

    rng = np.random.default_rng(0)
    src = tmp_path / "survey"
    (src / "day1").mkdir(parents=True)
    for name in ("day1/a.npy", "b.npy"):
        np.save(src / name, rng.random((300, 3)).astype(np.float32))
    proc = sf("archive", str(src), str(tmp_path / "new.zarr"), env=user_env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, "models pattern 'models__*'", "day1__a.npy", "--models")
    assert not (tmp_path / "new.zarr").exists()
    check_archive_models(str(src), str(tmp_path / "new.zarr"), "b.*")  # a pattern that picks one
    with pytest.raises(InputError, match="'models__x'"):
        check_archive_models(str(src / "*.npy"), str(tmp_path / "new.zarr"), "models__x")  # a glob
    st = ScanStore(tmp_path / "old.zarr", create=True)
    st.write_scan("models__milk.pcd", {"points": rng.random((300, 3)).astype(np.float32)}, {"n_points": 300})
    check_archive_models(str(src), str(tmp_path / "old.zarr"), "models__*")  # the store has them
    # the default pattern takes models/ inside an archive given as the source (odd.zip: odd__models__NAME)
    from scanforest.flows.inputs import DEFAULT_MODELS, is_model

    assert is_model("models__milk.pcd", DEFAULT_MODELS) and is_model("odd__models__milk.pcd", DEFAULT_MODELS)
    assert not is_model("scenes__mymodels__a.pcd", DEFAULT_MODELS) and not is_model("odd__models__m", "models__*x")
    # another folder given as the pattern is looked for inside archives too; a pattern without one is exact
    assert is_model("site__objects__a.pcd", "objects__*") and is_model("objects__a.pcd", "objects__*")
    assert not is_model("scenes__milk_x.pcd", "milk*") and is_model("milk_x.pcd", "milk*")


@pytest.mark.parametrize("args", [
    ("index", "build", "{store}", "-r", "s0.pcd", "--recall", "1.5"), ("match", "{store}", "-k", "0"),
    ("match", "{store}", "-q", "nomatch*"), ("describe", "{store}", "--scan", "nope.pcd"),
    ("recognize", "{store}", "-m", "s0.pcd", "--cg-size", "-1"), ("align-store", "{store}", "--pair", "s0.pcd:x"),
    ("archive", "{store}", "{store}.new", "--method", "ransac"), ("ingest", "no-such-folder", "new.zarr"),
], ids=["index-recall", "match-k", "match-queries", "describe-scan", "recognize-cg-size", "align-pair",
        "archive-method", "ingest-source"])
def test_user_errors_are_found_before_prefect_is_imported(small_store, user_env, tmp_path, args):
    """A command's user error is answered by the checks of ``flows.inputs``, before the flow
    module and Prefect are imported (3-5 s of a 2-core machine's time, where the answer takes 1)."""
    code = ("import sys\nsys.argv = ['scanforest', *sys.argv[1:]]\nfrom scanforest.deploy.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'prefect' in sys.modules, 'distributed' in sys.modules)\n")
    env = {**user_env, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # none is started: a user error needs none
    proc = subprocess.run([sys.executable, "-c", code, *[a.format(store=small_store) for a in args]], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "exit 2 False False", proc.stdout + proc.stderr[-3000:]
    assert proc.stderr.count("error: ") == 1, proc.stderr


@pytest.mark.parametrize("command", ["describe S", "match S", "info S", "recognize S -m x", "index build S -r x",
                                     "align-store S --pair a:b", "check S", "report S"])
def test_commands_on_a_missing_store_create_nothing(user_env, tmp_path, command):
    args = [("missing.zarr" if a == "S" else a) for a in command.split()]
    proc = sf(*args, env=user_env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, "missing.zarr")
    assert not (tmp_path / "missing.zarr").exists() and list(tmp_path.iterdir()) == []


def test_ingest_of_a_missing_source_creates_no_store(user_env, tmp_path):
    proc = sf("ingest", "no-such-folder", "new.zarr", env=user_env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, "no-such-folder")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_drop_folder_into_an_existing_store_is_not_an_error(small_store, user_env, tmp_path):
    """A scheduled ingest of a drop folder between deliveries finds nothing: exit 0, nothing
    ingested, answered before a cluster or Prefect's API starts (no workers), the store unchanged
    but for its count of no-op runs; into a new store it is an error that creates nothing (a
    mistyped source)."""
    drop = tmp_path / "drop"
    drop.mkdir()
    (drop / "README.md").write_text("scans arrive here")
    import json

    out = json.loads(_ok(sf("ingest", str(drop), str(small_store), "--json", env=user_env, cwd=tmp_path)))
    assert out["files"] == 0 and out["ingested"] == 0 and out["ignored"] == 1 and out["workers"] == 0, out
    from scanforest.tasks.store import ScanStore

    noop = ScanStore(str(small_store), mode="r").root["runs"].attrs["noop_runs"]["ingest"]
    assert noop["count"] >= 1 and noop["summary"]["files"] == 0
    _one_line_error(sf("ingest", str(drop), "new.zarr", env=user_env, cwd=tmp_path), str(drop))
    assert not (tmp_path / "new.zarr").exists()


def test_unreachable_scheduler_and_api_are_one_line(small_store, user_env, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import time

    t0 = time.perf_counter()
    proc = sf("describe", str(small_store), "--scheduler", f"tcp://127.0.0.1:{port}", env=user_env, cwd=tmp_path,
              timeout=180)
    _one_line_error(proc, f"tcp://127.0.0.1:{port}", "Dask scheduler")
    assert time.perf_counter() - t0 < 15  # refused before Prefect or Dask start
    env = {**user_env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    proc = sf("describe", str(small_store), env=env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, "PREFECT_API_URL", str(port))
    # the archive command asks a user's server before it starts its workers (it starts them while a
    # temporary local API boots): the one line, and nothing of a cluster's start on the terminal
    src = tmp_path / "src"
    src.mkdir()
    proc = sf("archive", str(src), str(tmp_path / "a.zarr"), env=env, cwd=tmp_path, timeout=120)
    _one_line_error(proc, "PREFECT_API_URL", str(port))
    assert "distributed" not in proc.stdout + proc.stderr and not (tmp_path / "a.zarr").exists()


def test_relative_store_with_an_external_scheduler(user_env, tmp_path):
    """``--scheduler``: a relative store path names the user's store, not one in the workers'
    working folder (they were started elsewhere)."""
    from scanforest.tasks.readers import write_cloud

    workdir = tmp_path / "workers-cwd"
    workdir.mkdir()
    sched = subprocess.Popen([sys.executable, "-c", _CLUSTER], cwd=workdir, env=user_env, stdout=subprocess.PIPE,
                             text=True)
    try:
        address = sched.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        src = tmp_path / "in"
        src.mkdir()
        write_cloud(src / "a.pcd", np.random.default_rng(1).random((500, 3)).astype(np.float32))
        out = _ok(sf("ingest", "in", "rel.zarr", "--scheduler", address, "--json", env=user_env, cwd=tmp_path))
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
