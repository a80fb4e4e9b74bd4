"""Flows on a real `dask scheduler` + two `dask worker` processes on loopback (--scheduler),
with one worker killed mid-run (a real SIGKILL): results complete and identical."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from scanforest.flows.describe import run_describe
from scanforest.flows.ingest import run_ingest
from scanforest.kernels.synthetic import scenes as synthetic
from scanforest.tasks.describe import DescribeParams, describe_cloud
from scanforest.tasks.readers import write_cloud
from scanforest.tasks.store import ScanStore


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _npy_folder(tmp_path, n: int, points: int, seed: int):
    """A folder ``src`` of ``n`` NPY clouds of ``points`` random points, and the clouds by name."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(seed)
    clouds = {f"s{i:02d}.npy": rng.random((points, 3)).astype(np.float32) for i in range(n)}
    for name, pts in clouds.items():
        np.save(src / name, pts)
    return src, clouds


@pytest.fixture
def cluster(tmp_path):
    port = _port()
    addr = f"tcp://127.0.0.1:{port}"
    bindir = os.path.dirname(sys.executable)
    dask = [os.path.join(bindir, "dask")] if os.path.exists(os.path.join(bindir, "dask")) else \
        [sys.executable, "-m", "dask"]
    procs = [subprocess.Popen(dask + ["scheduler", "--host", "127.0.0.1", "--port", str(port),
                                      "--dashboard-address", ":0"], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "sched.log", "w"))]
    time.sleep(1.0)
    for i in range(2):
        procs.append(subprocess.Popen(dask + ["worker", addr, "--nthreads", "1", "--name", f"w{i}",
                                              "--dashboard-address", ":0", "--no-nanny"],
                                      start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"w{i}.log", "w")))
    from distributed import Client

    with Client(addr, timeout="60s") as c:
        c.wait_for_workers(2, timeout=60)
    try:
        yield addr, procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_describe_on_external_cluster_survives_worker_kill(tmp_path, cluster):
    addr, procs = cluster
    lib = synthetic.model_library(2, 3_000, seed=4)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        sc = synthetic.make_scene(lib, n_instances=2, n_points=20_000, seed=i)
        write_cloud(src / f"s{i}.npy", sc.points)
    store = str(tmp_path / "s.zarr")
    assert run_ingest(str(src), store, scheduler=addr, progress=False)["ingested"] == 8
    params = DescribeParams(normal_k=10, keypoint_radius=0.05, shot_radius=0.04)
    import threading

    at_kill = []

    def killer():
        st = ScanStore(store, mode="r")
        deadline = time.time() + 120
        while time.time() < deadline:
            done = sum(st.has_stage(s, "describe") for s in st.scans())
            if done >= 1:
                at_kill.append(done)
                os.killpg(procs[2].pid, signal.SIGKILL)  # worker w1 dies mid-run
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer)
    t.start()
    summary = run_describe(store, params=params, device="cpu", scheduler=addr, progress=False)
    t.join()
    assert procs[2].poll() is not None and at_kill and at_kill[0] < 8, "the worker was not killed mid-run"
    assert summary["described"] == 8 and summary["skipped"] == 0  # a unit redone after the loss is not a skip
    st = ScanStore(store, mode="r")
    for sid in st.scans():
        assert st.has_stage(sid, "describe")
        ref = describe_cloud(st.read(sid), params, device="cpu")["arrays"]
        for name, arr in ref.items():
            np.testing.assert_array_equal(st.read(sid, name), arr, err_msg=f"{sid}:{name}")


def test_match_on_external_cluster_survives_worker_kill(tmp_path, cluster):
    """Shards resident on two workers; one is SIGKILLed mid-match; the answer is complete and exact."""
    import threading

    from distributed import Client

    from scanforest.flows.distributed import DistributedIndex
    from scanforest.kernels.knn.bruteforce import knn_bruteforce
    from scanforest.tasks import index as idx

    addr, procs = cluster
    rng = np.random.default_rng(1)
    X = rng.normal(size=(20_000, 32)).astype(np.float32)
    Q = rng.normal(size=(3_000, 32)).astype(np.float32)
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, shards=3, params={"method": "anns", "leaf_size": 64})
    bd, bi = knn_bruteforce(X, Q, 4, device="cpu")
    with Client(addr) as client:
        di = DistributedIndex(client, store, "t", device="cpu")
        di.wait()  # shards resident on their workers
        victim = di.placement[1]
        killed = []

        def killer():
            time.sleep(0.5)
            pid = client.run(os.getpid, workers=[victim])[victim]
            os.kill(pid, signal.SIGKILL)
            killed.append(time.time())

        t = threading.Thread(target=killer)
        t.start()
        d, i = di.query(Q, 4, block=100)
        finished = time.time()
        t.join()
    assert killed and killed[0] < finished, "the worker was not killed during the match"
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(d, bd)


def test_recognize_flow_on_external_cluster_survives_worker_kill(tmp_path, cluster):
    """The recognize flow with --scheduler on two real worker processes, one SIGKILLed mid-run:
    every scene is recognised, and the detections equal an in-process run's."""
    import threading

    from scanforest.flows.recognize import run_recognize
    from scanforest.kernels.recognition import recognize
    from scanforest.tasks.recognize import load_library
    from scanforest.tasks.synth import write_archive

    addr, procs = cluster
    write_archive(tmp_path / "arch", n_models=2, n_scenes=6, points_per_scene=12_000, points_per_model=3_000)
    store = str(tmp_path / "s.zarr")
    assert run_ingest(str(tmp_path / "arch"), store, scheduler=addr, progress=False)["ingested"] == 8
    st = ScanStore(store, mode="r")
    models = [s for s in st.scans() if s.startswith("models__")]
    scenes = [s for s in st.scans() if s.startswith("scenes__")]
    lib_params = {"model_ss": 0.01, "descr_rad": 0.04, "rf_rad": 0.03}
    params = {"scene_ss": 0.02, "cg_size": 0.02, "cg_thresh": 5}
    at_kill = []

    def killer():
        deadline = time.time() + 180
        while time.time() < deadline:
            done = sum(st.has_stage(s, "recognize") for s in scenes)
            if done >= 1:
                at_kill.append(done)
                os.killpg(procs[2].pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer)
    t.start()
    res = run_recognize(store, models, scheduler=addr, device="cpu", progress=False, batch=1,
                        library_params=lib_params, params=params)
    t.join()
    assert at_kill and at_kill[0] < 6, "the worker was not killed mid-run"
    assert res["recognized"] == 6 and res["skipped"] == 0
    lib = load_library(store, "default")
    for sid in scenes:
        assert st.has_stage(sid, "recognize")
        ref = recognize(st.read(sid, "points"), lib, device="cpu", **params)
        assert st.read(sid, "det_model").tolist() == [d.model_id for d in ref]
        if len(ref):
            np.testing.assert_allclose(st.read(sid, "det_pose"), np.array([d.pose for d in ref]), atol=1e-9)


def test_ingest_on_external_cluster_counts_each_scan_once_after_a_worker_kill(tmp_path, cluster):
    """A worker killed mid-ingest: Dask runs its units again elsewhere; a scan the lost worker had
    finished is reported as ingested by this run, not as skipped (a fresh store skips nothing)."""
    import threading

    addr, procs = cluster
    src, clouds = _npy_folder(tmp_path, 12, 400_000, seed=5)
    store = str(tmp_path / "s.zarr")
    at_kill = []

    def killer():
        deadline = time.time() + 120
        while time.time() < deadline:
            if os.path.isdir(os.path.join(store, "scans")):
                done = len(ScanStore(store, mode="r").scans())
                if done >= 1:
                    at_kill.append(done)
                    os.killpg(procs[2].pid, signal.SIGKILL)
                    return
            time.sleep(0.02)

    t = threading.Thread(target=killer)
    t.start()
    summary = run_ingest(str(src), store, scheduler=addr, progress=False)
    t.join()
    assert procs[2].poll() is not None and at_kill and at_kill[0] < 12, "the worker was not killed mid-run"
    assert summary["ingested"] == 12 and summary["skipped"] == 0, summary
    st = ScanStore(store, mode="r")
    for name, pts in clouds.items():
        np.testing.assert_array_equal(st.read(name, "points"), pts)


@pytest.mark.parametrize("n,batch,workers", [(1000, 15, 8), (10, 4, 3), (7, 32, 8), (100, 1, 8), (5, 2, 8), (0, 3, 2)])
def test_split_batches_are_even_and_a_multiple_of_the_workers(n, batch, workers):
    from scanforest.flows.batching import split_batches

    items = list(range(n))
    out = split_batches(items, batch, workers)
    assert [x for b in out for x in b] == items
    if not n:
        return
    sizes = [len(b) for b in out]
    assert max(sizes) <= batch and max(sizes) - min(sizes) <= 1
    if -(-n // batch) > 1:  # more than one task: a whole number of rounds, or one item per task
        assert len(out) % workers == 0 or len(out) == n


@pytest.mark.parametrize("n,batch,workers", [(8000, 31, 32), (2000, 31, 8), (40, 1, 2), (7, 32, 8), (3, 1, 2)])
def test_task_runs_hold_whole_batches_and_split_back_into_them(n, batch, workers):
    """map_batches with parts: a task run holds consecutive whole batches (2 runs a worker, at
    least 16), and its items split back into batches of the very sizes split_batches made: the
    cluster runs the same Dask tasks, and Prefect records fewer task runs."""
    from scanforest.flows.batching import MIN_TASK_RUNS, TASK_RUNS_PER_WORKER, even_parts, split_batches

    items = list(range(n))
    batches = split_batches(items, batch, workers)
    groups = even_parts(batches, max(MIN_TASK_RUNS, TASK_RUNS_PER_WORKER * workers))
    assert len(groups) == min(len(batches), max(MIN_TASK_RUNS, TASK_RUNS_PER_WORKER * workers))
    runs = [[x for b in g for x in b] for g in groups]
    assert [x for r in runs for x in r] == items
    parts = [p for r, g in zip(runs, groups) for p in even_parts(r, len(g))]
    assert sorted(map(len, parts)) == sorted(map(len, batches)) and len(parts) == len(batches)
    assert [x for p in parts for x in p] == items


@pytest.mark.parametrize("n,batch,workers", [(4000, 31, 16), (8000, 31, 32), (2000, 31, 8), (1984, 31, 16),
                                             (1983, 31, 16), (2000, 31, 1), (2000, 3, 8)])
def test_a_tapered_run_ends_with_a_half_and_a_quarter_batch_a_worker(n, batch, workers):
    """split_batches(taper=True): with 4 rounds of whole batches or more, the last two rounds (one
    batch a worker each) hold half and a quarter of a batch; the rest as without taper; every item
    once, in order. A task run's parts carry those sizes (in_parts splits its items by them), and
    Dask runs the smaller ones last (batch_priorities)."""
    from scanforest.flows.batching import (MIN_TASK_RUNS, TASK_RUNS_PER_WORKER, batch_priorities, even_parts,
                                           split_batches)

    items = list(range(n))
    plain = split_batches(items, batch, workers)
    out = split_batches(items, batch, workers, taper=True)
    assert [x for b in out for x in b] == items
    sizes = [len(b) for b in out]
    if n < 4 * workers * batch or workers == 1 or batch < 4:
        assert out == plain
        return
    half, quarter = -(-batch // 2), -(-batch // 4)
    assert sizes[-workers:] == [quarter] * workers and sizes[-2 * workers:-workers] == [half] * workers
    head = sizes[:-2 * workers]
    assert len(head) % workers == 0 and max(head) <= batch and max(head) - min(head) <= 1 and min(head) > half
    groups = even_parts(out, max(MIN_TASK_RUNS, TASK_RUNS_PER_WORKER * workers))
    parts = []
    for g in groups:  # as in_parts splits a task run's items by the sizes map_batches gives it
        run, at = [x for b in g for x in b], 0
        for s in [len(b) for b in g]:
            parts.append(run[at:at + s])
            at += s
    assert parts == out
    prio = batch_priorities(sizes)
    assert max(prio) == 0 and all(p < q for p, q in zip(prio[-workers:], prio[-2 * workers:-workers]))
    assert min(prio[:-2 * workers]) > max(prio[-2 * workers:])


def test_in_parts_splits_by_the_sizes_it_is_given():
    """in_parts with sizes (a tapered task run): one call a part, in order, records back in the
    items' order; sizes that do not add up to the items are refused."""
    from scanforest.flows.prefect_tasks import in_parts

    seen = []

    def fn(tag, part, scale=1):
        seen.append(list(part))
        return [(tag, x * scale) for x in part]

    out = in_parts(fn, list(range(6)), [3, 2, 1], "t", scale=10)  # no Dask client here: called in turn
    assert seen == [[0, 1, 2], [3, 4], [5]] and out == [("t", 10 * x) for x in range(6)]
    with pytest.raises(ValueError, match="do not split"):
        in_parts(fn, list(range(6)), [3, 2], "t")


def test_an_ingest_records_16_task_runs_for_40_dask_tasks(tmp_path, prefect_api):
    """40 files in batches of one on two local workers: 40 Dask tasks, 16 Prefect task runs
    (each run hands Dask its batches), every file ingested once and bit-exact."""
    import httpx
    from distributed import get_task_stream

    from scanforest.flows.cluster import cluster_scope, dask_client
    from scanforest.flows.ingest import ingest_flow

    src, clouds = _npy_folder(tmp_path, 40, 300, seed=2)
    store = str(tmp_path / "s.zarr")
    with cluster_scope(device="cpu", workers=2), dask_client(None, device="cpu") as client:
        with get_task_stream(client) as ts:
            state = ingest_flow(source=str(src), store=store, batch=1, progress=False, return_state=True)
    summary = state.result()
    assert summary["ingested"] == 40 and summary["quarantined"] == 0, summary
    assert len(ts.data) == 40
    runs, seen = None, []  # the server records task runs from their events, a moment after the flow
    for _ in range(60):
        runs = httpx.post(prefect_api + "/task_runs/count", json={"flow_runs": {"id": {"any_": [
            str(state.state_details.flow_run_id)]}}}).json()
        if seen and runs == seen[-1] and runs:
            break
        seen.append(runs)
        time.sleep(1.0)
    assert runs == 16, seen
    st = ScanStore(store, mode="r")
    for name, pts in clouds.items():
        np.testing.assert_array_equal(st.read(name, "points"), pts)


def test_a_task_run_retried_after_a_transient_error_counts_each_scan_once(tmp_path, monkeypatch, prefect_api):
    """A Dask task of a task run that holds several batches fails once with a transient error:
    Prefect retries the task run, its batches run again, and every file is counted once as
    ingested (the files the first try wrote are this run's, not skipped), bit-exact."""
    from distributed import LocalCluster

    from scanforest.flows import prefect_tasks
    from scanforest.flows.ingest import ingest_flow
    from scanforest.tasks.ingest import ingest_files

    from _faults import fails_once

    src, clouds = _npy_folder(tmp_path, 40, 300, seed=3)
    marks = tmp_path / "calls"
    monkeypatch.setattr(prefect_tasks, "ingest_files", fails_once(ingest_files, marks))  # the second Dask task
    store = str(tmp_path / "s.zarr")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None,
                      scheduler_kwargs={"dashboard_address": ":0"}) as lc:
        summary = ingest_flow(source=str(src), store=store, scheduler=lc.scheduler_address, batch=1, progress=False)
    assert len(list(marks.iterdir())) > 40  # a task run's batches ran again
    assert summary["ingested"] == 40 and summary["skipped"] == 0 and summary["files"] == 40, summary
    st = ScanStore(store, mode="r")
    for name, pts in clouds.items():
        np.testing.assert_array_equal(st.read(name, "points"), pts)


def test_local_workers_import_the_store_and_readers_as_they_start():
    """Each worker imports Zarr and the store at its start (the worker plugin), not in the first
    task of the first stage, and keeps large arrays' pages between allocations; the format readers where the cluster starts for ingest, and not
    otherwise (about 1 s of CPU a worker that the other stages never use)."""
    from scanforest.flows.cluster import dask_client
    from scanforest.flows.worker_setup import INGEST_PRELOAD, WORKER_PRELOAD

    def loaded(names):
        import sys as _sys

        return [n for n in names if n in _sys.modules]

    def profiling():
        import dask

        return dask.config.get("distributed.worker.profile.enabled")

    def page_faults_of_fresh_arrays(n=20):
        # 12 MB arrays (a scene's SHOT rows) made and freed n times: with Dask's own
        # MALLOC_TRIM_THRESHOLD_ alone each is a fresh mmap whose 3,000 pages fault in again
        import resource

        import numpy as _np

        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for i in range(n):
            a = _np.full((8_683, 352), float(i), _np.float32)
            del a
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    every = list(WORKER_PRELOAD + INGEST_PRELOAD)
    with dask_client(None, n_workers=1, device="cpu") as client:
        found = client.run(loaded, every)
        profiled = client.run(profiling)
        faults = client.run(page_faults_of_fresh_arrays)
    assert found and all(v == list(WORKER_PRELOAD) for v in found.values()), found
    # Dask's stack sampler is off in local workers (no dashboard to show it; it costs CPU)
    assert profiled and not any(profiled.values()), profiled
    # the worker's allocator keeps large arrays' pages (tune_allocator): the first array faults
    # its 3,000 pages in, the next 19 reuse them (60,000 faults without it)
    assert faults and all(f < 15_000 for f in faults.values()), faults
    with dask_client(None, n_workers=1, device="cpu", preload=INGEST_PRELOAD) as client:
        found = client.run(loaded, every)
    assert found and all(v == every for v in found.values()), found
    assert {"zarr", "scanforest.tasks.ingest"} <= set(WORKER_PRELOAD) and "pypcd4" in INGEST_PRELOAD


def test_a_scope_cluster_started_ahead_is_the_one_its_stages_use():
    """``start_scope_cluster`` (the archive command starts its workers while Prefect's API boots):
    nothing outside a scope; inside one, the cluster every later stage's client is, with the
    first stage's preload, started once."""
    import sys as _sys

    from scanforest.flows.cluster import cluster_scope, dask_client, start_scope_cluster
    from scanforest.flows.worker_setup import INGEST_PRELOAD

    assert start_scope_cluster() is False
    with cluster_scope(device="cpu", workers=1):
        assert start_scope_cluster(preload=INGEST_PRELOAD) is True
        assert start_scope_cluster() is False  # started already
        with dask_client(None, n_workers=3, device="cpu") as a, dask_client(None, device="cpu") as b:
            assert a is b and len(a.scheduler_info(n_workers=-1)["workers"]) == 1  # the scope's, not 3
            found = a.run(lambda names: [n for n in names if n in _sys.modules], list(INGEST_PRELOAD))
    assert found and all(v == list(INGEST_PRELOAD) for v in found.values()), found


def test_worker_devices_released_before_a_local_gpu_cluster_stops(monkeypatch):
    """The scope's close asks every worker of its local GPU cluster to give its cached device
    memory back (all at once, before the stop), and a worker that cannot answer does not stop
    the close; a CPU cluster is not asked."""
    from scanforest.flows import cluster as C
    from scanforest.kernels.backend import release_gpu_cache

    calls, closed = [], []

    class Client:
        def __init__(self, fail):
            self.fail = fail

        def run(self, fn, **kw):
            calls.append((fn, kw))
            if self.fail:
                raise OSError("a worker is gone")

        def close(self):
            closed.append("client")

    class Cluster:
        def close(self):
            closed.append("cluster")

    for device, fail in (("gpu", False), ("gpu", True), ("cpu", False)):
        calls.clear(), closed.clear()
        monkeypatch.setattr(C, "_want_gpu_cluster", lambda d: d == "gpu")
        with C.cluster_scope(device=device):
            C._scope.update(client=Client(fail), cluster=Cluster())
        assert closed == ["client", "cluster"]
        assert calls == ([(release_gpu_cache, {"on_error": "ignore"})] if device == "gpu" else [])


def test_a_worker_that_does_not_answer_does_not_hold_the_stop(monkeypatch):
    """The release before the stop is bounded: a cluster whose workers never answer closes
    after ``RELEASE_WAIT`` seconds."""
    import threading

    from scanforest.flows import cluster as C

    gate, closed = threading.Event(), []

    class Client:
        def run(self, fn, **kw):
            gate.wait(30)

        def close(self):
            closed.append("client")

    class Cluster:
        def close(self):
            closed.append("cluster")

    monkeypatch.setattr(C, "_want_gpu_cluster", lambda d: True)
    monkeypatch.setattr(C, "RELEASE_WAIT", 0.2)
    t = time.perf_counter()
    with C.cluster_scope(device="gpu"):
        C._scope.update(client=Client(), cluster=Cluster())
    gate.set()
    assert closed == ["client", "cluster"] and time.perf_counter() - t < 5


def test_shared_gpu_workers_are_pinned_to_their_gpus_numa_cores(monkeypatch):
    """A worker of GPU g keeps to the host cores NVML names near g (as dask-cuda pins its one
    worker a GPU), within the cores this process may use; nothing is pinned where that would
    change nothing (one NUMA node), where NVML cannot say, or with SCANFOREST_CPU_AFFINITY=0."""
    import os

    from scanforest.flows import cluster as C

    allowed = sorted(os.sched_getaffinity(0))
    near = {"0": allowed[: max(1, len(allowed) // 2)], "1": allowed + [max(allowed) + 64]}
    monkeypatch.setattr(C, "_nvml_affinity", lambda d: near[d])
    monkeypatch.delenv("SCANFOREST_CPU_AFFINITY", raising=False)
    if len(allowed) > 1:
        assert C._cores_near("0") == near["0"]
    assert C._cores_near("1") is None  # every core it may use: nothing to pin
    monkeypatch.setenv("SCANFOREST_CPU_AFFINITY", "0")
    assert C._cores_near("0") is None

    def no_nvml(d):
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.delenv("SCANFOREST_CPU_AFFINITY")
    monkeypatch.setattr(C, "_nvml_affinity", no_nvml)
    assert C._cores_near("0") is None
