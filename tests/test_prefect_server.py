"""A real Prefect server (SQLite, loopback), driven as an operator drives it: `scanforest serve`
registers a deployment with a cron schedule of every minute, the server's scheduler fires it and
the run completes with its results in the store; `scanforest run` triggers one by hand, and says
in one line when the deployment is not registered or nothing serves it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from scanforest.tasks.readers import write_cloud
from scanforest.tasks.store import ScanStore

CLI = [sys.executable, "-m", "scanforest.deploy.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout, what, procs=()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"{what}: a process exited early with {p.returncode}")
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def _api(url, body=None):
    """GET (or POST ``body``) one API endpoint; None when the server does not answer or says no."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


def _stop(proc):
    """SIGTERM the process group (the serve process, its flow runs and their Dask workers), then
    SIGKILL whatever is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """One real server for the module's tests (each keeps to its own deployment, store and runs)."""
    tmp_path = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false",
               PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}",
               PYTHONUNBUFFERED="1", PREFECT_RUNNER_POLL_FREQUENCY="3", PREFECT_WORKER_QUERY_SECONDS="3",
               # a deployment nothing polled for 15 s (a minute by default) is marked not ready
               PREFECT_SERVER_SERVICES_FOREMAN_LOOP_SECONDS="3",
               PREFECT_SERVER_SERVICES_FOREMAN_DEPLOYMENT_LAST_POLLED_TIMEOUT_SECONDS="15")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait(lambda: _api(api + "/health") is not None, 120, "prefect server", [proc])
        yield api, env
    finally:
        _stop(proc)


def _one_line_error(res, *words):
    assert res.returncode == 2, res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("error: "), res.stderr
    for w in words:
        assert w in res.stderr


def test_cron_schedule_fires_on_a_real_server(tmp_path, prefect_server):
    api, env = prefect_server
    drop, batch = tmp_path / "drop", tmp_path / "batch"
    rng = np.random.default_rng(0)
    for folder, names in ((drop, ("a0", "a1", "a2")), (batch, ("b0",))):
        folder.mkdir()
        for n in names:
            write_cloud(folder / f"{n}.npy", rng.normal(size=(1000, 3)).astype(np.float32))
    store = tmp_path / "s.zarr"

    def cli(*args):
        return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True, timeout=300)

    _one_line_error(cli("run", "ingest"), "not registered", "scanforest serve --only ingest")
    # registered but served by no process (as after `prefect deploy` with no worker running)
    subprocess.run([sys.executable, "-c", "from scanforest.flows.deployments import runner_deployments; "
                    f"runner_deployments(['describe'], parameters={{'store': {str(store)!r}}}, "
                    "schedules=False)[0].apply()"], env=env, check=True, timeout=120)
    _one_line_error(cli("run", "describe"), "no process serves", "scanforest-describe/describe")

    serve_log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(CLI + ["serve", "--only", "ingest", "--cron", "* * * * *", "--param", f"source={drop}",
                                    "--param", f"store={store}", "--param", "workers=1"],
                             env=env, stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail():
        return (tmp_path / "serve.log").read_text()[-3000:]

    try:
        dep_url = api + "/deployments/name/scanforest-ingest/ingest"
        _wait(lambda: (_api(dep_url) or {}).get("status") == "READY", 120, "serve polling", [serve])
        dep = _api(dep_url)
        assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["* * * * *"]
        # a run by hand while the schedule is pending: --param replaces the served source
        res = cli("run", "ingest", "--param", f"source={batch}", "--timeout", "240")
        assert res.returncode == 0, res.stdout + res.stderr + log_tail()
        manual = json.loads(res.stdout.strip().splitlines()[-1])
        assert manual["state"] == "COMPLETED"

        def scheduled_run():
            runs = _api(api + "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}}) or []
            auto = [r for r in runs if r["auto_scheduled"] and r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
            if auto and auto[0]["state_type"] != "COMPLETED":
                pytest.fail(f"scheduled run ended {auto[0]['state_type']} ({auto[0]['state']['message']}): "
                            f"{log_tail()}")
            return bool(auto)

        # the next minute boundary, the runner's poll (10 s) and the run itself
        _wait(scheduled_run, 150, "a scheduled run to complete", [serve])
    finally:
        _stop(serve)
    # a stopped serve pauses its deployment, still READY for a minute: `run` says nothing serves it
    # (it waited its whole --timeout). Stopped while a scheduled run had just started (the minute's
    # boundary) it may be killed before it pauses it: `run` then says so once Prefect marks the
    # deployment not ready (test_run_of_a_deployment_whose_serve_died_is_said_and_cancelled)
    res = cli("run", "ingest", "--timeout", "240")
    _one_line_error(res, "no process serves")
    assert "paused" in res.stderr or "the run is cancelled" in res.stderr, res.stderr
    # the hand-triggered run is not the scheduled one, and both did their work in the store
    assert _api(api + f"/flow_runs/{manual['flow_run_id']}")["auto_scheduled"] is False
    assert ScanStore(store, mode="r").scans() == ["a0.npy", "a1.npy", "a2.npy", "b0.npy"]


def test_run_of_a_deployment_whose_serve_died_is_said_and_cancelled(tmp_path, prefect_server):
    """A deployment polled a moment ago (as its ``serve`` polls it) whose serve then died without
    pausing it (SIGKILL, a lost machine): ``run`` finds it ready and triggers a run that nothing
    picks up. Once Prefect marks the deployment not ready (15 s after the last poll on this
    server, a minute by default) ``run`` says so in one line and cancels the run, which would
    otherwise start whenever a serve came back; it waited its whole --timeout (an hour by
    default) and printed SCHEDULED."""
    api, env = prefect_server
    store = tmp_path / "s.zarr"
    subprocess.run([sys.executable, "-c", "from scanforest.flows.deployments import runner_deployments; "
                    f"runner_deployments(['describe'], parameters={{'store': {str(store)!r}}}, "
                    "schedules=False)[0].apply()"], env=env, check=True, timeout=120)
    dep = _api(api + "/deployments/name/scanforest-describe/describe")
    assert _api(api + "/deployments/get_scheduled_flow_runs", {"deployment_ids": [dep["id"]]}) == []  # a serve's poll
    _wait(lambda: (_api(api + f"/deployments/{dep['id']}") or {}).get("status") == "READY", 30, "the poll's mark")
    t0 = time.time()
    res = subprocess.run(CLI + ["run", "describe", "--timeout", "240"], env=env, capture_output=True, text=True,
                         timeout=300)
    _one_line_error(res, "no process serves deployment scanforest-describe/describe", "the run is cancelled")
    assert time.time() - t0 < 90, time.time() - t0
    runs = _api(api + "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}})
    assert [r["state_type"] for r in runs] == ["CANCELLED"], runs


def test_a_killed_run_is_marked_interrupted_and_crashed(tmp_path):
    """A run whose process was killed stays "running" in the store and in Prefect; the next flow
    on that store marks it interrupted in the store and Crashed in Prefect (same API)."""
    from prefect import flow
    from prefect.client.orchestration import get_client

    from scanforest.flows.prefect_api import ensure_prefect_api
    from scanforest.flows.records import RUN_HOOKS, mark_interrupted

    ensure_prefect_api()
    st = ScanStore(tmp_path / "s.zarr", create=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    @flow(name="scanforest-probe", **RUN_HOOKS)
    def probe(store: str) -> str:
        from prefect.runtime import flow_run

        return flow_run.id

    run_id = probe(str(tmp_path / "s.zarr"))  # a real flow run, then pretend its process was killed
    with get_client(sync_client=True) as client:
        from prefect.states import Running

        client.set_flow_run_state(run_id, Running(), force=True)
    rec = next(r for r in st.runs() if r.get("flow_run_id") == run_id)
    st.write_run(rec["id"], {"status": "running", "pid": dead.pid, "finished": None})
    mark_interrupted(st)
    rec = next(r for r in st.runs() if r["id"] == rec["id"])
    assert rec["status"] == "interrupted" and f"pid {dead.pid}" in rec["error"]
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run_id).state.is_crashed()


def test_local_api_starts_again_when_its_first_server_exits(tmp_path, monkeypatch):
    """Two commands started together on a new PREFECT_HOME both migrate its database and the
    loser's server exits ("table ... already exists"): the local API starts it again. The
    migrated database is marked; a new database file in its place is migrated again."""
    from scanforest.flows import prefect_api

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    real_spawn = prefect_api._LocalAPI._spawn
    spawned = []

    def spawn(self):
        if not spawned:  # the first server dies at once, as the loser of the migration does
            self.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        else:
            real_spawn(self)
        spawned.append(self.proc)

    monkeypatch.setattr(prefect_api._LocalAPI, "_spawn", spawn)
    api = prefect_api._LocalAPI()
    try:
        url = api.wait_ready(timeout=120)
        assert len(spawned) == 2 and spawned[0].returncode == 3
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
    finally:
        api.stop()
    # the migrated database is marked (prefect_api.create_local_app), so the next start skips the migration
    # check; a database made again (another file) is migrated again, not taken for the marked one
    home = tmp_path / "home"
    first = (home / "scanforest-api-migrated").read_text()
    assert str(home / "prefect.db") in first and first.count("|") == 2 and not first.endswith("|")
    for f in home.glob("prefect.db*"):
        f.unlink()
    (home / "prefect.db").write_bytes(b"")  # a new, empty SQLite file: no tables
    monkeypatch.setattr(prefect_api._LocalAPI, "_spawn", real_spawn)
    api = prefect_api._LocalAPI()
    try:
        url = api.wait_ready(timeout=120)
        req = urllib.request.Request(url + "/flows/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:  # answered from migrated tables
            assert r.status == 200 and json.loads(r.read()) == []
    finally:
        api.stop()
    assert (home / "scanforest-api-migrated").read_text() == first  # the same revision, migrated again


def test_a_killed_command_is_crashed_at_once_on_a_real_server(tmp_path, prefect_server):
    """A command-line run killed with SIGKILL while a Prefect server runs is Crashed in Prefect
    and ``interrupted`` in the store within seconds, with no other flow started: its watchdog,
    a process of its own session, sees the killed process's end of a pipe close."""
    api, env = prefect_server
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        write_cloud(src / f"s{i}.npy", rng.normal(size=(2000, 3)).astype(np.float32))
    store = tmp_path / "s.zarr"
    res = subprocess.run(CLI + ["ingest", str(src), str(store), "--workers", "1"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    proc = subprocess.Popen(CLI + ["describe", str(store), "--workers", "1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)

    def run_of(flow):
        return next((r for r in ScanStore(store, mode="r").runs() if r.get("flow") == flow), None)

    try:
        _wait(lambda: (run_of("describe") or {}).get("status") == "running", 120, "the describe run to start",
              [proc])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        killed = time.time()
        rec = run_of("describe")
        _wait(lambda: (run_of("describe") or {}).get("status") == "interrupted", 120, "the store record")
        _wait(lambda: (_api(api + f"/flow_runs/{rec['flow_run_id']}") or {}).get("state_type") == "CRASHED", 120,
              "Prefect's Crashed state")
        assert time.time() - killed < 120
        assert f"pid {proc.pid}" in run_of("describe")["error"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the killed command's Dask workers


def test_flow_runs_on_a_temporary_api_send_no_heartbeats(prefect_api, monkeypatch):
    """The temporary local API ends with its process, so no automation can act on heartbeats:
    they are off there, and a flow run's end no longer waits for the heartbeat thread's 1-second
    sleep (1.0 s at the end of every flow run); a user who sets the frequency keeps it."""
    import time

    from prefect import flow
    from prefect.settings import get_current_settings

    from scanforest.flows.prefect_api import local_api_pid, no_heartbeats_for_a_temporary_api

    assert local_api_pid() is not None  # this process's own temporary API
    assert get_current_settings().flows.heartbeat_frequency is None

    @flow
    def quick():
        return time.perf_counter()

    quick()
    ends = []
    for _ in range(3):
        ends.append(time.perf_counter() - quick())
    assert min(ends) < 0.5, ends  # with the heartbeat thread joined: 1.0 s each
    monkeypatch.setenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "60")
    assert no_heartbeats_for_a_temporary_api() is False


def test_the_local_api_is_asked_its_version_before_the_first_flow(prefect_api, monkeypatch):
    """ensure_prefect_api makes the process's first request to the local API (Prefect's version
    check, made once per process and API) in a background thread, so the first flow's start does
    not wait on it: once per API, and a failing request is left for the flow to report."""
    import threading

    from prefect.client.orchestration import SyncPrefectClient

    import scanforest.flows.prefect_api as pa

    assert os.environ["PREFECT_API_URL"] in pa._WARMED  # this process's API: warmed as it started
    calls = []

    def check(self):
        calls.append((str(self.api_url), threading.current_thread().name))

    monkeypatch.setattr(SyncPrefectClient, "raise_for_api_version_mismatch_once", check)
    monkeypatch.setattr(pa, "_WARMED", set())
    assert pa.warm_api_client() is True
    deadline = time.monotonic() + 30
    while not calls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert calls == [(calls[0][0], "sf-api-warm-up")] and calls[0][0].startswith(prefect_api.rstrip("/"))
    assert pa.warm_api_client() is False  # once per API

    def boom(self):
        raise RuntimeError("Failed to reach API")

    monkeypatch.setattr(SyncPrefectClient, "raise_for_api_version_mismatch_once", boom)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert pa.warm_api_client() is True  # tried in the background: nothing raised here
