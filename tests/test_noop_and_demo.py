"""Commands with nothing to do, and where the demo and the report write (issue 38, findings 9 and
10), run as a user runs them: the installed command in a subprocess.

A stage with nothing to do answers from the store before Prefect's API or a Dask cluster starts:
it is run with ``--scheduler`` at a port that accepts connections but never answers (a client
there would wait out its timeout) and ``PREFECT_API_URL`` at a port where nothing listens (a run
that reached for it would end with exit 2), and once with the defaults in a fresh Prefect
home, where the local API would leave its log. It prints the summary shape a real run prints, and
the store counts it instead of keeping a run record per no-op. ``report STORE`` writes beside the
store, never into the current folder. The demo's own run (the archive flow, its default folder,
its exit code on the good path) is the README test's in ``test_user_paths.py``; its exit code on a
stage that fell short is checked here from its report function.

One small store (2 scans of 3,000 points: ingest, describe, index build, match) serves every test.
"""
from __future__ import annotations

import json
import resource
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from _userpath import fresh_env, ok, one_line_error, sf

DESCRIBE = ("--keypoint-radius", "0.2", "--shot-radius", "0.2")
#: where nothing listens: a command that reaches for a cluster or an API there fails
NOWHERE = "tcp://127.0.0.1:9"
#: loose bounds on the no-op command (about 1 s of CPU and of wall time on an idle 2-core machine; a
#: run that starts the API and a cluster spends 6-8 s and well over 5 s of CPU in its processes):
#: CPU time is the check that holds on a loaded machine, wall time only catches a hang
CPU_SECONDS, WALL_SECONDS = 4.0, 15.0


@pytest.fixture(scope="module")
def silent_scheduler():
    """``--scheduler`` at a socket that accepts connections and never answers: the option's check
    (a TCP connection) passes, a Dask client would wait out its connect timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield ("--scheduler", f"tcp://127.0.0.1:{s.getsockname()[1]}")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return fresh_env(tmp_path_factory, cold=False)


@pytest.fixture(scope="module")
def done(env, tmp_path_factory) -> dict:
    """A store whose 2 scans are described and matched (against an index over the first), and
    the real runs' summaries (what their commands print with ``--json``). Made by the flows in
    this process on one shared cluster: the state is the tests' input, the commands under test run
    in subprocesses (four commands here took 62 s of CI's 2 cores)."""
    from scanforest.flows.cluster import cluster_scope
    from scanforest.flows.describe import run_describe
    from scanforest.flows.ingest import run_ingest
    from scanforest.flows.match import run_index_build, run_match
    from scanforest.flows.prefect_api import ensure_prefect_api
    from scanforest.tasks.describe import DescribeParams
    from scanforest.tasks.readers import write_cloud

    work = tmp_path_factory.mktemp("noop")
    src = work / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        write_cloud(src / f"s{i}.pcd", rng.random((3_000, 3)).astype(np.float32))
    store = str(work / "s.zarr")
    ensure_prefect_api()
    # the describe command's parameters for DESCRIBE (its defaults otherwise)
    params = DescribeParams(normal_k=10, normal_radius=None, keypoint_radius=0.2, shot_radius=0.2, approximate=False)
    with cluster_scope(device="cpu", workers=1):
        run_ingest(str(src), store, workers=1, progress=False)
        described = run_describe(store, params=params, device="cpu", workers=1, progress=False)
        assert described["described"] == 2, described
        run_index_build(store, ["s0.pcd"], name="i", params={"method": "exact"}, device="cpu")
        matched = run_match(store, name="i", device="cpu", workers=1, progress=False)
    assert matched["matched"] == 1, matched
    as_printed = lambda summary: json.loads(json.dumps(summary, default=str))  # noqa: E731
    return {"store": Path(store), "work": work, "describe": as_printed(described), "match": as_printed(matched)}


def _runs(store: Path) -> tuple[int, dict]:
    from scanforest.tasks.store import ScanStore

    st = ScanStore(str(store), mode="r")
    return len(st.runs()), dict(st.root["runs"].attrs.get("noop_runs") or {})


def _noop(args: tuple[str, ...], env: dict, cwd: Path, tmp_path: Path, flow: str, store: Path, real: dict,
          no_cluster: tuple[str, str]) -> None:
    """``args`` with nothing to do: exit 0 with the real run's summary keys and zero work, with no
    cluster (a ``--scheduler`` that never answers) and no Prefect API (an unreachable ``PREFECT_API_URL``;
    then the defaults in a fresh Prefect home: no local API log), fast; counted in the store, not
    recorded as a run."""
    n_runs, before = _runs(store)
    away = {**env, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    res = json.loads(ok(sf(*args, *no_cluster, "--json", env=away, cwd=cwd, timeout=120)))
    wall, r1 = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)  # the command and every process it waited for
    assert set(res) == set(real), (sorted(res), sorted(real))  # the summary a real run prints
    assert res["scans"] == real["scans"] and res[{"describe": "described", "match": "matched"}[flow]] == 0, res
    assert res["workers"] == 0, res  # no cluster
    assert cpu < CPU_SECONDS and wall < WALL_SECONDS, f"{cpu:.1f} s of CPU, {wall:.1f} s"
    home = tmp_path / "prefect-home"
    out = ok(sf(*args, env={**env, "PREFECT_HOME": str(home)}, cwd=cwd, timeout=120))
    assert "skipped" in out or "matched" in out
    assert not (home / "scanforest-server.log").exists(), "the no-op started Prefect's local API"
    n_after, after = _runs(store)
    assert n_after == n_runs  # no run record per no-op ...
    assert after[flow]["count"] == before.get(flow, {}).get("count", 0) + 2, after  # ... counted instead
    assert after[flow]["summary"][{"describe": "skipped", "match": "scans"}[flow]] == real["scans"]


def test_describe_with_nothing_to_do_answers_before_any_cluster_or_api(done, env, tmp_path, silent_scheduler):
    _noop(("describe", str(done["store"]), *DESCRIBE), env, done["work"], tmp_path, "describe", done["store"],
          done["describe"], silent_scheduler)


def test_match_with_nothing_to_do_answers_before_any_cluster_or_api(done, env, tmp_path, silent_scheduler):
    _noop(("match", str(done["store"]), "--name", "i"), env, done["work"], tmp_path, "match", done["store"],
          done["match"], silent_scheduler)


@pytest.mark.parametrize("cmd", ["describe", "match"])
def test_nothing_to_do_still_refuses_a_bad_device_or_an_unreachable_scheduler(done, env, cmd):
    """A mistyped --device, ``--device gpu`` without a usable GPU, or a --scheduler nobody listens at
    is said in one line, exit 2, also when the store has nothing for the command to do
    (deploy/README.md's errors section)."""
    args = ("describe", str(done["store"]), *DESCRIBE) if cmd == "describe" else ("match", str(done["store"]), "--name", "i")
    one_line_error(sf(*args, "--device", "quantum", env=env, cwd=done["work"], timeout=120), "--device", "quantum")
    from scanforest.kernels.backend import gpu_available

    if not gpu_available():  # gpu by name where none is usable: as with work to do (it answered 0)
        one_line_error(sf(*args, "--device", "gpu", env=env, cwd=done["work"], timeout=120), "no CUDA GPU is usable")
    one_line_error(sf(*args, "--scheduler", NOWHERE, env=env, cwd=done["work"], timeout=120),
                   "cannot reach the Dask scheduler", NOWHERE)


def test_a_flow_that_found_nothing_to_do_is_counted_not_recorded(done, monkeypatch):
    """Inside a flow (a served deployment's run, the describe flow's own no-op path) the record its
    start hook opened is removed and the run counted."""
    from scanforest.flows import records
    from scanforest.tasks.store import ScanStore

    st = ScanStore(str(done["store"]))
    n, before = _runs(done["store"])
    monkeypatch.setattr(records, "_run_id", lambda flow, flow_run=None: f"{flow}-opened-by-its-hook")
    st.write_run("describe-opened-by-its-hook", {"flow": "describe", "status": "running"})
    assert _runs(done["store"])[0] == n + 1
    noop = {**done["describe"], "described": 0, "skipped": 2, "keypoints": 0}
    records.record_run(st, "describe", {}, noop, [])
    n_after, after = _runs(done["store"])
    assert n_after == n and after["describe"]["count"] == before.get("describe", {}).get("count", 0) + 1


def test_report_writes_beside_the_store_not_into_the_current_folder(done, env, tmp_path):
    out = ok(sf("report", str(done["store"]), env=env, cwd=tmp_path))
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    path = Path(out.strip().split("wrote ", 1)[1])
    assert path == done["work"] / "s-report.html" and "<html" in path.read_text().lower()


def test_the_demo_and_report_defaults_are_git_ignored_in_a_clone():
    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["scanforest-demo/store.zarr/zarr.json", "scanforest-report.html"]
    res = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=repo, capture_output=True, text=True)
    assert res.stdout.split() == paths, res


def test_the_demo_exits_1_naming_each_stage_that_fell_short(done, capsys):
    """The demo's exit code checks the store, not only failures: a store with no quarantined file,
    other scans than the archive's and scenes without their stages is exit 1, each shortfall named."""
    import typer

    from scanforest.deploy.cli.core import _demo_report

    out = {"ingest": {"files": 2, "ingested": 2, "skipped": 0, "quarantined": 0},
           "library": {"status": "built", "models": 1}, "index-build": {"status": "built", "n": 10},
           "process": {"scenes": 2, "described": 2, "matched": 2, "recognized": 1, "skipped": 0, "failed": 1,
                       "failures": [{"scan_id": "s1.pcd", "reason": "too few points"}], "detections": 0,
                       "from_stored": 1, "recomputed": 0, "scenes_seconds": 1.0, "workers": 1}}
    made = {"models": [Path("models/m0.pcd")], "scenes": [Path("scenes/s0.pcd"), Path("scenes/s1.pcd")]}
    with pytest.raises(typer.Exit) as exc:
        _demo_report(done["store"], out, made, Path("broken_scan.pcd"), 1.0)
    assert exc.value.exit_code == 1
    err = capsys.readouterr().err
    for needle in ("not exactly the corrupt file broken_scan.pcd", "1 scenes failed", "lack the recognize stage",
                   "no precision/recall", "failed: s1.pcd: too few points"):
        assert needle in err, err
