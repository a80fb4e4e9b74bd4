"""A real Prefect server (SQLite, loopback): serve a deployment, trigger it through the API,
see the run complete with its results in the store."""
from __future__ import annotations

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


def _healthy(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture
def prefect_server(tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false",
               PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}",
               PYTHONUNBUFFERED="1")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait(lambda: _healthy(api), 120, "prefect server", [proc])
        yield api, env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_served_deployment_runs_through_the_api(tmp_path, prefect_server):
    api, env = prefect_server
    src = tmp_path / "drop"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        write_cloud(src / f"s{i}.npy", rng.normal(size=(1000, 3)).astype(np.float32))
    store = tmp_path / "s.zarr"
    cli = [sys.executable, "-m", "scanforest.flows.cli"]
    serve_log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(cli + ["serve", "--only", "ingest", "--no-schedules"], env=env,
                             stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def registered():
            try:
                with urllib.request.urlopen(urllib.request.Request(
                        api + "/deployments/name/scanforest-ingest/ingest"), timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        _wait(registered, 120, "deployment registration", [serve])
        res = subprocess.run(cli + ["run", "ingest", "--param", f"source={src}", "--param", f"store={store}",
                                    "--param", "workers=1", "--timeout", "240"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "serve.log").read_text()[-3000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["state"] == "COMPLETED"
        # the run is recorded by the server, and its results are in the store
        with urllib.request.urlopen(api + f"/flow_runs/{out['flow_run_id']}", timeout=5) as r:
            assert json.loads(r.read())["state_type"] == "COMPLETED"
        assert ScanStore(store, mode="r").scans() == ["s0.npy", "s1.npy", "s2.npy"]
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(30)
