"""Where flows run: a Dask cluster for the compute, Prefect's API for the orchestration record.

Execution model (measured, see README "Orchestration"): a flow's Prefect tasks run on a thread
pool in the flow process and each hands its unit of work (a plain function from
``scanforest.tasks``) to the Dask cluster with ``client.submit``. Prefect records every task
run, retries and states; Dask places the work, moves data and reschedules work lost with a dead
worker. Running the Prefect task engine itself inside Dask workers (``DaskTaskRunner``) cost
~250 ms per task on a 2-core machine versus ~25 ms this way, so workers never need a Prefect API;
they still receive the flow's API URL (a worker plugin sets ``PREFECT_API_URL``) so any Prefect
call made there talks to the flow's server instead of starting a temporary one.

The embedded default needs no infrastructure: a ``LocalCluster`` of processes (or
GPU workers, 8 per GPU by default, when dask-cuda is installed and GPUs are visible) and
Prefect's temporary local API, started once per process. ``scheduler=ADDRESS`` uses an existing
Dask cluster instead; ``PREFECT_API_URL`` set in the environment uses that Prefect server.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from typing import Iterator

from scanforest.tasks.readers import FORMAT_LIBRARIES

from . import _watchdog

log = logging.getLogger("scanforest")

_server_lock = threading.Lock()
_server: "_LocalAPI | None" = None


class _LocalAPI:
    """Prefect's API for this process when none is set: a uvicorn child serving
    ``prefect.server.api.server:create_app``, which is what Prefect's own temporary server runs.

    Started here rather than through ``prefect.server.api.server.SubprocessASGIServer`` because
    importing that module loads the whole server stack (FastAPI, SQLAlchemy: 2.6 s of a 12 s
    command on 2 cores) in the command's process, which only needs the client; and because
    :func:`start_prefect_api` can then start it early, so it boots while the command imports
    its flow and checks its input. Its output goes to ``PREFECT_HOME/scanforest-server.log``: when
    the command ends the server is terminated, possibly mid-rollback, and it used to print a
    SQLAlchemy traceback after the command's result.
    """

    def __init__(self):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/api"
        home = os.path.expanduser(os.environ.get("PREFECT_HOME", "~/.prefect"))
        os.makedirs(home, exist_ok=True)
        self.log = os.path.join(home, "scanforest-server.log")
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        self._env = env
        self._spawn()

    def _spawn(self) -> None:
        import subprocess
        import sys

        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
                 "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
                env=self._env, stdout=out, stderr=out, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 90.0, attempts: int = 3) -> str:
        """Block until the API answers its health check (the first start migrates its database).

        Two commands started together on a new ``PREFECT_HOME`` both migrate its database, and the
        loser's server exits ("table ... already exists"); it is started again (same port), up
        to ``attempts`` times, and then finds the database migrated."""
        import time

        import httpx

        deadline = time.monotonic() + timeout
        tries = 1
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if tries >= attempts:
                    break
                tries += 1
                time.sleep(0.5 * tries)
                self._spawn()
                continue
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        exited = self.proc.poll()
        self.stop()
        why = (f"exited with code {exited} ({tries} starts)" if exited is not None
               else f"did not answer within {timeout:.0f} s")
        raise RuntimeError(f"Prefect's local API {why}; its log: {self.log} "
                           "(or set PREFECT_API_URL to a running `prefect server start`)")

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_prefect_api() -> None:
    """Start the local Prefect API in the background when none is set (no-op otherwise), so it
    boots while the command does other work; :func:`ensure_prefect_api` waits for it.

    Its URL is exported at once (``PREFECT_API_URL``), and Prefect's settings are refreshed if
    Prefect is already imported, so nothing starts a second temporary server."""
    global _server
    if os.environ.get("PREFECT_API_URL"):
        return
    with _server_lock:
        if _server is None:
            _server = _LocalAPI()
            import atexit

            atexit.register(_stop_server)
        os.environ["PREFECT_API_URL"] = _server.url
        import sys

        if "prefect.context" in sys.modules:
            sys.modules["prefect.context"].refresh_global_settings_context()


def ensure_prefect_api() -> str:
    """The Prefect API URL the flows report to, starting a temporary local server if none is set.

    The URL is exported in ``os.environ`` so worker processes started afterwards inherit it.
    """
    quiet_prefect_logs()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    start_prefect_api()
    url = os.environ["PREFECT_API_URL"]
    if _server is not None and url == _server.url:
        return _server.wait_ready()
    _check_api(url)  # the user's own server
    return url


def _check_api(url: str, timeout: float = 5.0) -> None:
    """A set ``PREFECT_API_URL`` that does not answer is a user error, said in one line (not the
    connection traceback the first flow call would print after its retries)."""
    import httpx

    from scanforest.kernels.errors import InputError

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout).raise_for_status()
    except httpx.HTTPError as exc:
        raise InputError(f"cannot reach the Prefect API at PREFECT_API_URL={url} ({type(exc).__name__}); "
                         "start it (`prefect server start`) or unset PREFECT_API_URL to use a temporary "
                         "local one") from None


def check_workers(workers: int | None) -> int | None:
    """A worker count below 1 is a user error, said in one line (the commands' ``--workers``
    callback; None is the default count)."""
    if workers is not None and int(workers) < 1:
        from scanforest.kernels.errors import InputError

        raise InputError(f"--workers must be at least 1, got {workers}")
    return workers


def check_scheduler(address: str | None, timeout: float = 5.0) -> None:
    """An unreachable ``--scheduler`` is a user error, said in one line before anything starts
    (a refused connection would otherwise be retried for the whole connect timeout)."""
    if not address:
        return
    import socket
    from urllib.parse import urlsplit

    from scanforest.kernels.errors import InputError

    url = urlsplit(address if "://" in address else f"tcp://{address}")
    if url.scheme not in ("tcp", "tls") or not url.hostname:
        return  # other protocols (ucx, inproc): left to Dask
    try:
        socket.create_connection((url.hostname, url.port or 8786), timeout=timeout).close()
    except OSError as exc:
        raise InputError(f"cannot reach the Dask scheduler at {address} ({exc.strerror or exc})") from None


def absolute_path(path: str) -> str:
    """A store (or source) path as every process must see it: absolute in the flow process, before
    any work is submitted (a worker of an existing cluster has another working folder, and a
    relative path there names another store). URLs (``s3://...``) are kept."""
    path = str(path)
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def open_store(store: str, mode: str = "a"):
    """An existing scan store, or a user error in one line (``ScanStore`` says which: none there,
    or something else there; for ``mode="a"``, :func:`~scanforest.tasks.preflight.check_store_location`
    says when it cannot be written: read-only, full); only ingest creates stores. The stages'
    input checks open their store here, before a cluster starts."""
    from scanforest.tasks.preflight import check_store_location
    from scanforest.tasks.store import ScanStore

    path = absolute_path(store)
    st = ScanStore(path, mode=mode)
    if mode == "a":
        check_store_location(path)
    return st


def count_redone(records: list[dict], st, stage: str, since: str, status: str, *, run: str | None = None,
                 fields: dict[str, str] | None = None) -> None:
    """Count as ``status`` every scan whose ``stage`` this run wrote, whatever its unit reported.

    A unit that a lost worker had finished before Dask ran it again reports ``skipped`` (the
    stage is there), and one that Dask ran again while the first copy still held the scan
    reports ``held``; the stage record says who wrote it. A record naming its run (``run``: the
    flow run's id, default the current one, :func:`scanforest.tasks.units.current_run`) is this
    run's when it names this run, and never another's, so two runs at once never both claim a
    scan; a record without one (an older version's, or a unit that does not record its run) is
    this run's when written at or after ``since`` (the run's start in the store's ISO format).
    ``fields``: record key -> stage-record key, the figures taken from the stored record for such
    a scan (``{"keypoints": "keypoints"}``: the summary counts what was stored, not the redone
    unit's zero)."""
    from scanforest.tasks.units import HELD, current_run

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
    return [{"scan_id": r.get("scan_id"), "reason": r.get("reason", "")}
            for r in records if r.get("status") == "failed"]


def require_scans(st, ids, kind: str = "scan") -> None:
    """Every id names a scan of the store ``st`` (a user error in one line otherwise)."""
    from scanforest.kernels.errors import InputError

    have = set(st.scans())
    missing = [s for s in ids or () if s not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{st.path}: no {kind} {missing[0]!r}{more}")


def _stop_server() -> None:
    global _server
    if _server is not None:
        logging.disable(logging.INFO)  # at interpreter exit the log streams may already be closed
        with contextlib.suppress(Exception):
            _server.stop()
        logging.disable(logging.NOTSET)
        if os.environ.get("PREFECT_API_URL") == _server.url:
            os.environ.pop("PREFECT_API_URL", None)
        _server = None


class _LocalShutdownNoise(logging.Filter):
    """In a worker of a cluster the command started itself, a heartbeat that fails because the
    scheduler is gone happens only while the command shuts its cluster down; its ERROR and
    traceback were printed after the command's result on a busy machine."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "during heartbeat" not in record.getMessage()


#: modules every stage's unit of work uses, imported by each worker as it starts (Dask's
#: "preload"): imported by the first task instead, they cost a worker about 0.3 s alone and
#: 1-1.5 s with 8 workers importing at once on 16 cores, inside the first stage's wall time
WORKER_PRELOAD = ("zarr", "scanforest.tasks.ingest") + FORMAT_LIBRARIES  # tasks.ingest imports the store


def _worker_plugin(env: dict[str, str], local: bool = False):
    """Worker plugin, run in every worker (present and future) before its first task: give it the
    flow's Prefect API URL, settle numba's thread count while no numba thread runs
    (:func:`scanforest.kernels.backend.settle_numba_threads`) and import :data:`WORKER_PRELOAD`.
    ``local``: the command started this cluster, and its shutdown is not an error
    (:class:`_LocalShutdownNoise`)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class WorkerSetup(WorkerPlugin):
        name = "scanforest-worker-setup"

        def __init__(self, env, local):
            self.env = env
            self.local = local

        def setup(self, worker):
            os.environ.update(self.env)
            if self.local:
                logging.getLogger("distributed.worker").addFilter(_LocalShutdownNoise())
            from scanforest.kernels.backend import settle_numba_threads

            settle_numba_threads()
            for name in WORKER_PRELOAD:  # a missing one fails the task that needs it, with its own error
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)

    return WorkerSetup(env, local)


def _want_gpu_cluster(device: str) -> bool:
    if device == "cpu":
        return False
    from scanforest.kernels.backend import gpu_available

    if not gpu_available():
        return False
    import importlib.util

    return importlib.util.find_spec("dask_cuda") is not None


#: the local cluster kept by an open :func:`cluster_scope` (None: no scope is open)
_scope: dict | None = None


@contextlib.contextmanager
def cluster_scope(*, device: str = "auto", workers: int | None = None) -> Iterator[None]:
    """Keep one local cluster for every stage run inside: the first :func:`dask_client` call
    without a scheduler starts it (on ``device``, with ``workers`` workers: the scope's, whatever
    the call asks, so an archive's ingest runs on the workers its recognition will use), the
    later ones reuse it with its workers' loaded libraries and indexes, and it closes when the
    scope does. A run of several stages (the archive flow, the demo, ``bench archive``) starts
    its workers once instead of once per stage. Nested scopes use the outermost one."""
    global _scope
    if _scope is not None:
        yield
        return
    _scope = {"device": device, "workers": workers}
    try:
        yield
    finally:
        kept, _scope = _scope, None
        for obj in (kept.get("client"), kept.get("cluster")):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()


#: configuration of the local cluster's workers (their nannies hand it to each worker process).
#: Dask's statistical profiler samples every thread's stack 100 times a second for the dashboard,
#: which local clusters do not serve: on one H100 with 8 workers, 7% of the archive pass's worker
#: CPU (2026-11-27), and on four GPUs the pass is bound by the host's CPU
LOCAL_WORKER_CONFIG = {"distributed.worker.profile.enabled": False}


def _local_cluster(n_workers: int | None, threads_per_worker: int, device: str, memory_limit):
    import dask

    with dask.config.set(LOCAL_WORKER_CONFIG):
        if _want_gpu_cluster(device):
            return _gpu_cluster(n_workers, threads_per_worker)
        from distributed import LocalCluster

        n = n_workers or max(1, min(8, os.cpu_count() or 1))
        return LocalCluster(n_workers=n, threads_per_worker=threads_per_worker, processes=True,
                            dashboard_address=None, memory_limit=memory_limit, silence_logs=logging.ERROR,
                            env=_thread_env(n, threads_per_worker))


@contextlib.contextmanager
def dask_client(scheduler: str | None = None, *, n_workers: int | None = None,
                threads_per_worker: int = 1, device: str = "auto",
                memory_limit: str | None = "auto") -> Iterator:
    """A Dask client: connect to ``scheduler`` or start a local cluster for the duration (inside
    a :func:`cluster_scope`: the scope's cluster, started once).

    Parameters
    ----------
    scheduler : str, optional
        Address of an existing scheduler (``tcp://host:8786``). Its workers are used as they are.
    n_workers : int, optional
        Local workers (default: one per core, at most 8; on GPUs :func:`default_gpu_workers`,
        8 per GPU where the host has the cores; more workers than GPUs share the GPUs, see
        :func:`_gpu_cluster`).
    device : {"auto", "cpu", "gpu"}
        ``gpu``/``auto`` with dask-cuda and a visible GPU start ``LocalCUDACluster``.
    """
    from distributed import Client

    env = {k: os.environ[k] for k in ("PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED") if k in os.environ}
    if scheduler:
        try:
            client = Client(scheduler, timeout="10s")
        except (OSError, ValueError, TypeError) as exc:  # timeouts are OSErrors; a bad address a ValueError
            from scanforest.kernels.errors import InputError

            raise InputError(f"cannot reach the Dask scheduler at {scheduler} "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        cluster = None
    elif _scope is not None:
        if "client" not in _scope:
            cluster = _local_cluster(_scope["workers"] or n_workers, threads_per_worker, _scope["device"],
                                     memory_limit)
            _scope["cluster"], _scope["client"] = cluster, Client(cluster)
            quiet_prefect_logs()
            _scope["client"].register_plugin(_worker_plugin(env, local=True), name="scanforest-worker-setup")
        yield _scope["client"]  # closed by the scope
        return
    else:
        cluster = _local_cluster(n_workers, threads_per_worker, device, memory_limit)
        client = Client(cluster)
    quiet_prefect_logs()
    try:
        client.register_plugin(_worker_plugin(env, local=cluster is not None), name="scanforest-worker-setup")
        yield client
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _thread_env(n_workers: int, threads_per_worker: int) -> dict[str, str]:
    """Numba threads per local worker process: the host's cores shared out, so that W workers
    running parallel numba kernels do not start W x cores threads (Dask already sets the BLAS and
    OpenMP pools of its workers to one thread). ``NUMBA_NUM_THREADS`` set by the user wins."""
    if "NUMBA_NUM_THREADS" in os.environ:
        return {"NUMBA_NUM_THREADS": os.environ["NUMBA_NUM_THREADS"]}
    cores = _host_cores()
    return {"NUMBA_NUM_THREADS": str(max(1, cores // max(1, n_workers * threads_per_worker)))}


#: default worker processes per GPU (fewer where the host has under 2 cores per worker). The
#: archive's GPU stages are partly host-bound (Zarr I/O, launches, host syncs). On one H200 with 16
#: cores, `bench archive --scans 1000 --device gpu` ran its one pass at 17.05 / 20.71 scans/s with
#: 4 / 8 workers (2026-11-26, early) and 17.75 / 22.98 after the device matching and grouping got
#: faster (the same day, later): once recognition stopped being host-bound, 8 processes overlap
#: their host work with one another's kernels. (On 2026-11-25's host-bound code, an H100 ran
#: 2.92 scans/s with 4 workers and 1.89 with 8.)
GPU_WORKERS_PER_DEVICE = 8


def default_gpu_workers(n_gpus: int) -> int:
    """Workers for ``n_gpus`` GPUs when none is asked for: :data:`GPU_WORKERS_PER_DEVICE` per GPU,
    at most one per 2 cores of the host."""
    cores = _host_cores()
    per = max(1, min(GPU_WORKERS_PER_DEVICE, cores // max(1, 2 * n_gpus)))
    return max(1, n_gpus) * per


def _gpu_cluster(n_workers: int | None, threads_per_worker: int):
    """One dask-cuda worker per GPU (``LocalCUDACluster``) when one worker per GPU is asked for.
    More workers than GPUs share the GPUs round-robin: worker ``i`` is a plain Dask worker process
    whose ``CUDA_VISIBLE_DEVICES`` starts with GPU ``i mod G``. That suits stages whose work per GPU
    is partly host-bound (recognition's grouping, Zarr I/O), and it runs the multi-worker paths on a
    one-GPU machine. Without ``n_workers``: :func:`default_gpu_workers`."""
    from scanforest.kernels.backend import gpu_count

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devs = [d for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(gpu_count())]
    if n_workers is None:
        n_workers = default_gpu_workers(len(devs))
    if n_workers <= len(devs):
        from dask_cuda import LocalCUDACluster

        return LocalCUDACluster(n_workers=n_workers, threads_per_worker=threads_per_worker, dashboard_address=None)
    from distributed import Nanny, Scheduler, SpecCluster
    from distributed.system import MEMORY_LIMIT

    workers = {}
    for i in range(int(n_workers)):
        g = i % len(devs)
        workers[f"gpu{devs[g]}-{i // len(devs)}"] = {
            "cls": Nanny,
            "options": {"nthreads": threads_per_worker, "memory_limit": int(MEMORY_LIMIT // n_workers),
                        "silence_logs": logging.ERROR,
                        "env": {"CUDA_VISIBLE_DEVICES": ",".join(devs[g:] + devs[:g]),
                                **_thread_env(n_workers, threads_per_worker)}}}
    return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {
        "host": "127.0.0.1", "dashboard": False, "dashboard_address": None}}, silence_logs=logging.ERROR)


def n_workers(client) -> int:
    return len(client.scheduler_info(n_workers=-1)["workers"])


_USER_ERRORS = ("ScanforestError", "InputError", "ScanReadError", "DeviceError", "OutOfMemory")


class _UserErrorFilter(logging.Filter):
    """Drop Prefect's log lines about a run that failed with a user error (an ``InputError`` and
    the like): the command prints that error in one line and exits 2; a traceback and the
    run's final-state line would bury it. Unexpected errors keep their tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        from scanforest.kernels.errors import ScanforestError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ScanforestError):
            return False
        try:
            msg = record.getMessage()
        except Exception:
            return True
        return not (("Finished in state" in msg or "Retries are exhausted" in msg or "encountered an exception" in msg)
                    and any(name + ":" in msg or name + "(" in msg for name in _USER_ERRORS))


_FILTER = _UserErrorFilter()


def quiet_prefect_logs() -> None:
    """Keep the terminal for our progress bar: Prefect's per-task INFO lines go to the API only,
    and runs that end in a user error say so once, through the command."""
    import warnings

    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)

    # query blocks are embedded in their tasks on purpose: a lost worker's block is recomputable
    warnings.filterwarnings("ignore", message=".*Sending large graph.*")
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.engine", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.core",
                 "distributed.worker", "distributed.batched", "distributed.http.proxy"):
        logging.getLogger(name).setLevel(logging.ERROR)


def auto_batch(n_items: int, workers: int, *, max_batch: int = 32) -> int:
    """Items per Prefect task: one each for small runs; for archives, enough per task that the
    per-task orchestration (~25-50 ms on 2 cores) stays a few percent of the work, while keeping
    at least 8 tasks per worker in flight for balance and progress."""
    return max(1, min(max_batch, n_items // max(1, 8 * workers)))


def split_batches(items: list, batch: int, workers: int = 1) -> list[list]:
    """``items`` in consecutive batches of at most ``batch``, sized evenly (they differ by at most
    one item), and as many of them as a multiple of ``workers`` where there are enough items:
    equal tasks dealt out to the workers finish together, where a remainder batch (or one
    task more than a round) leaves all but a few workers idle for the run's last task."""
    n = len(items)
    if not n:
        return []
    t = -(-n // max(1, batch))
    if workers > 1 and t > 1:
        t = min(n, -(-t // workers) * workers)
    q, r = divmod(n, t)
    out, i = [], 0
    for j in range(t):
        size = q + (j < r)
        out.append(items[i:i + size])
        i += size
    return out


def map_batches(task, items: list, *, item_param: str, common: dict, label: str, batch: int,
                progress: bool = True, workers: int = 1) -> list:
    """Run ``task(**common, item_param=batch_of_items)`` over batches of at most ``batch`` items
    (:func:`split_batches` over ``workers``); each task returns one record per item. Returns the
    flat list of records in input order."""
    batches = split_batches(list(items), batch, workers)
    out = map_units(task, [{**common, item_param: b} for b in batches], label=label, progress=progress,
                    weights=[len(b) for b in batches])
    return [rec for recs in out for rec in recs]


def map_units(task, kwargs_list: list[dict], *, label: str, progress: bool = True, weights=None) -> list:
    """Submit one Prefect task run per item on the flow's thread-pool task runner (each run
    dispatches its work to Dask) and collect the results in input order, with a progress bar."""
    from prefect.futures import as_completed

    results: list = [None] * len(kwargs_list)
    if not kwargs_list:
        return results
    import time

    weights = weights or [1] * len(kwargs_list)
    futures = {task.submit(**kw): i for i, kw in enumerate(kwargs_list)}
    with _Bar(label, sum(weights), progress) as bar:
        for fut in as_completed(list(futures)):
            res = fut.result()
            now = time.time()
            for r in res if isinstance(res, list) else [res]:
                if isinstance(r, dict):
                    r.setdefault("finished_at", now)
            results[futures[fut]] = res
            bar.advance(weights[futures[fut]])
    return results


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


def _mark_interrupted(st) -> None:
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
    marked interrupted (:func:`_mark_interrupted`)."""
    st = _existing_store(flow_run.parameters.get("store"))
    if st is not None:
        import socket

        _mark_interrupted(st)
        run_id = _run_id(_flow_key(flow), flow_run)
        # the watchdog first: a process killed once its record says running is noticed at once (not
        # when the next flow opens the store); killed before that, its watchdog finds no such record
        local = _server is not None and os.environ.get("PREFECT_API_URL") == _server.url
        _watchdog.watch(st.path, run_id, str(flow_run.id), _server.proc.pid if local else None)
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
    try:
        return dict(store.root["runs"][run_id].attrs)
    except KeyError:
        return {}


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
    from scanforest.tasks.store import LOCKS, ScanStore, _jsonable, file_lock

    with contextlib.suppress(Exception):
        st = store if isinstance(store, ScanStore) else ScanStore(absolute_path(store), mode="a")
        runs = st.root.require_group("runs")
        with file_lock(os.path.join(st.path, LOCKS, "runs", "noop.lock")):
            if run_id is not None and run_id in runs:
                del runs[run_id]
            counts = dict(runs.attrs.get("noop_runs") or {})
            now = _iso()
            old = counts.get(flow) or {}
            counts[flow] = {"count": int(old.get("count", 0)) + 1, "first": old.get("first", now), "last": now,
                            "summary": {k: v for k, v in summary.items() if not isinstance(v, (list, dict))}}
            runs.attrs["noop_runs"] = _jsonable(counts)


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


class _Bar:
    """A rich progress bar on the terminal (silent when stderr is not a terminal)."""

    def __init__(self, label: str, total: int, enabled: bool):
        import sys

        self.enabled = enabled and sys.stderr.isatty()
        self.total = total
        self.label = label

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

            self._p = Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
            self._p.__enter__()
            self._t = self._p.add_task(self.label, total=self.total)
        return self

    def advance(self, n: int = 1):
        if self.enabled:
            self._p.advance(self._t, n)

    def __exit__(self, *exc):
        if self.enabled:
            self._p.__exit__(*exc)
