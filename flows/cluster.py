"""The Dask cluster a flow's work runs on: an existing one (``scheduler=ADDRESS``) or a local one
started for the run (:func:`dask_client`), kept for several stages by :func:`cluster_scope`, and
the checks of the commands' cluster options (:func:`check_workers`, :func:`check_scheduler`).

Execution model (measured, see README "Orchestration"): a flow's Prefect tasks run on a thread
pool in the flow process and each hands its unit of work (a plain function from
``scanforest.tasks``) to the Dask cluster with ``client.submit``. Prefect records every task
run, retries and states; Dask places the work, moves data and reschedules work lost with a dead
worker. Running the Prefect task engine itself inside Dask workers (``DaskTaskRunner``) cost
~250 ms per task on a 2-core machine versus ~25 ms this way, so workers never need a Prefect API
(:mod:`scanforest.flows.prefect_api`); every worker is set up by the plugin of
:mod:`scanforest.flows.worker_setup`.

The embedded default needs no infrastructure: a ``LocalCluster`` of processes (or GPU workers,
8 per GPU by default, when dask-cuda is installed and GPUs are visible). ``scheduler=ADDRESS``
uses an existing Dask cluster instead.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Callable, Iterator

from scanforest.kernels.errors import ScanforestError

from .prefect_api import quiet_prefect_logs
from .worker_setup import worker_plugin


#: local workers a core at most: more only divide the same cores, and each holds its own memory
#: (``--workers 1000`` on 2 cores ran the machine out of memory and left 206 workers behind)
MAX_WORKERS_PER_CORE = 4


def check_workers(workers: int | None) -> int | None:
    """A worker count below 1, or above :data:`MAX_WORKERS_PER_CORE` a core of this machine (at
    least 8), is a user error, said in one line (the commands' ``--workers`` callback; None is the
    default count)."""
    if workers is None:
        return workers
    from scanforest.kernels.errors import InputError

    if int(workers) < 1:
        raise InputError(f"--workers must be at least 1, got {workers}")
    cores = os.cpu_count() or 1
    most = max(8, MAX_WORKERS_PER_CORE * cores)
    if int(workers) > most:
        raise InputError(f"--workers {workers}: a local cluster of more than {MAX_WORKERS_PER_CORE} workers a core "
                         f"only divides this machine's {cores} cores (and each worker holds its own memory): give "
                         f"at most {most}")
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


def _want_gpu_cluster(device: str) -> bool:
    if device == "cpu":
        return False
    from scanforest.kernels.backend import gpu_available

    if not gpu_available():
        return False
    import importlib.util

    return importlib.util.find_spec("dask_cuda") is not None


class Interrupted(ScanforestError):
    """The command was asked to stop (a Ctrl-C): work not yet sent to the cluster is not sent, and
    a task waiting on the cluster stops waiting (never retried: a user's stop)."""


_stopping = threading.Event()
_waiting: set = set()  # the Dask futures this process's task threads wait on
_waiting_lock = threading.Lock()


def stop_waiting() -> None:
    """A Ctrl-C (the command's signal handler): the flow's task threads blocked on Dask futures
    are released (the futures cancelled, in a thread of its own: the handler must not block), and
    no new work is sent. The flow then ends on its own, its cluster and API closed: the threads
    it waited for held the command until its grace timer ended it, with no clean-up run (the
    local cluster's semaphores said leaked)."""
    _stopping.set()
    # what the cluster's libraries say as they are cut short (a broadcast to an ended worker, a
    # worker that was starting: errors and asyncio tracebacks) is noise: the command said it stops
    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in ("distributed", "asyncio", "tornado"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    with _waiting_lock:
        futs = list(_waiting)
    if futs:
        threading.Thread(target=_cancel, args=(futs,), name="scanforest-stop", daemon=True).start()


def _cancel(futs: list) -> None:
    by_client: dict = {}
    for f in futs:
        by_client.setdefault(id(f.client), (f.client, []))[1].append(f)
    for client, fs in by_client.values():
        try:
            client.cancel(fs, force=True)
        except Exception:  # noqa: BLE001 - a closing client: its waiters are released by its close
            pass


def wait_for(client, futs: list, get: Callable) -> Any:
    """``get()`` (a future's result, a gather) with ``futs`` registered for :func:`stop_waiting`:
    after a Ctrl-C it raises :class:`Interrupted` instead of waiting."""
    if _stopping.is_set():
        client.cancel(futs, force=True)
        raise Interrupted("stopped by a Ctrl-C")
    with _waiting_lock:
        _waiting.update(futs)
    try:
        return get()
    except Exception:
        if _stopping.is_set():
            raise Interrupted("stopped by a Ctrl-C") from None
        raise
    finally:
        with _waiting_lock:
            _waiting.difference_update(futs)


def stopping() -> bool:
    """Whether this process was asked to stop (:func:`stop_waiting`)."""
    return _stopping.is_set()


def _end_workers(cluster) -> None:
    """After a Ctrl-C: the local cluster's worker processes end now (their nannies told not to
    start them again), so its close does not wait for the tasks they are in: a scan being written
    is written whole or not at all, as when a worker is killed. Closing waited some 4 s for a
    worker inside a numba call (the closing nannies' time-out)."""
    import signal

    for nanny in list(getattr(cluster, "workers", {}).values()):
        pid = getattr(getattr(getattr(nanny, "process", None), "process", None), "pid", None)
        if pid:
            with contextlib.suppress(Exception):
                nanny.auto_restart = False
                os.kill(pid, signal.SIGTERM)


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
        if kept.get("cluster") is not None and stopping():
            _end_workers(kept["cluster"])
        elif kept.get("cluster") is not None and _want_gpu_cluster(kept["device"]):
            release_worker_devices(kept["client"])
        for obj in (kept.get("client"), kept.get("cluster")):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()


#: seconds a local GPU cluster's stop waits for its workers to give their device memory back
RELEASE_WAIT = 10.0


def release_worker_devices(client) -> None:
    """Have every worker of a local GPU cluster give its cached device blocks and pinned host
    buffers back, all at once, before the cluster stops: otherwise each worker process's exit
    releases them, one process after another under the driver's host-wide lock. Stopping 32
    workers on four H200s that held 1 GiB each took 3.19 s, 2.49 s with this first (2026-11-28).
    Best effort: the stop goes on after :data:`RELEASE_WAIT` seconds, and a worker that does not
    answer is stopped as it is."""
    import threading

    from scanforest.kernels.backend import release_gpu_cache

    def release():
        with contextlib.suppress(Exception):
            client.run(release_gpu_cache, on_error="ignore")

    t = threading.Thread(target=release, name="sf-release-devices", daemon=True)
    t.start()
    t.join(RELEASE_WAIT)


def start_scope_cluster(preload: tuple[str, ...] = ()) -> bool:
    """Start the open :func:`cluster_scope`'s local cluster now, with ``preload`` (the first
    stage's modules, see :func:`dask_client`), instead of at its first stage's first
    :func:`dask_client` call: a command starts its workers while Prefect's local API boots rather
    than after it (on four H200s' host, 7.7 s for the API and 4.4 s for 32 workers, one after
    the other, 2026-11-28). False, doing nothing, outside a scope or once it is started."""
    if _scope is None or "client" in _scope:
        return False
    with dask_client(None, n_workers=_scope["workers"], device=_scope["device"], preload=preload):
        pass  # the scope keeps the client and closes it
    return True


@contextlib.contextmanager
def cluster_with_api(*, device: str = "auto", workers: int | None = None, scheduler: str | None = None,
                     preload: tuple[str, ...] = ()) -> Iterator[None]:
    """A :func:`cluster_scope` whose local cluster is started (:func:`start_scope_cluster`, with
    ``preload``; none with ``scheduler``) and a Prefect API that answers, for the commands that
    run several stages (``scanforest archive``, ``scanforest demo``, ``bench archive``): a
    temporary local API boots while the workers start, instead of one after the other. A user's
    own server (``PREFECT_API_URL``) is asked first, so an unreachable one is said in one line
    before any worker starts."""
    from .prefect_api import (ensure_prefect_api, import_flow_engine, local_api_pid, quiet_prefect_logs,
                              start_prefect_api)

    quiet_prefect_logs()  # the cluster's start logs nothing on the terminal either
    start_prefect_api()  # returns at once; a temporary server boots in its own process
    temporary = local_api_pid() is not None
    if not temporary:
        ensure_prefect_api()
    with cluster_scope(device=device, workers=workers):
        if scheduler is None:
            start_scope_cluster(preload=preload)
            open_gpu_contexts()  # the GPU workers' CUDA contexts, made while the API boots
        if temporary:
            import_flow_engine()  # while the API boots, not in the first stage
            ensure_prefect_api()
        yield


#: the local scheduler's HTTP server (health and metrics routes; no dashboard) on a free port:
#: Dask's default, 8787, printed "Port 8787 is already in use" on stderr whenever two commands ran
#: at once
SCHEDULER_HTTP = {"dashboard_address": ":0"}

#: configuration of the local cluster's workers (their nannies hand it to each worker process).
#: Dask's statistical profiler samples every thread's stack 100 times a second for the dashboard,
#: which local clusters do not serve: about 7% of the archive pass's worker CPU in a profile of
#: 8 workers on one H100 (2026-11-27)
LOCAL_WORKER_CONFIG = {"distributed.worker.profile.enabled": False}


def _local_cluster(n_workers: int | None, threads_per_worker: int, device: str, memory_limit):
    import dask

    # the scratch folders of a killed or Ctrl-C'd command, purged as the next one starts: not news
    logging.getLogger("distributed.diskutils").setLevel(logging.WARNING)

    with dask.config.set(LOCAL_WORKER_CONFIG):
        if _want_gpu_cluster(device):
            return _gpu_cluster(n_workers, threads_per_worker)
        from distributed import LocalCluster

        n = n_workers or max(1, min(8, os.cpu_count() or 1))
        return LocalCluster(n_workers=n, threads_per_worker=threads_per_worker, processes=True,
                            dashboard_address=None, scheduler_kwargs=SCHEDULER_HTTP, memory_limit=memory_limit,
                            silence_logs=logging.ERROR,
                            env=thread_env(n, threads_per_worker))


@contextlib.contextmanager
def dask_client(scheduler: str | None = None, *, n_workers: int | None = None,
                threads_per_worker: int = 1, device: str = "auto",
                memory_limit: str | None = "auto", preload: tuple[str, ...] = ()) -> Iterator:
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
    preload : tuple of str
        Modules the workers import as they start besides every stage's
        (:data:`~scanforest.flows.worker_setup.WORKER_PRELOAD`): the stage that starts the
        cluster (or asks a scheduler's workers) names its own (ingest: the format readers).
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
            _scope["client"].register_plugin(worker_plugin(env, local=True, preload=preload),
                                             name="scanforest-worker-setup")
        yield _scope["client"]  # closed by the scope
        return
    else:
        cluster = _local_cluster(n_workers, threads_per_worker, device, memory_limit)
        client = Client(cluster)
    quiet_prefect_logs()
    try:
        client.register_plugin(worker_plugin(env, local=cluster is not None, preload=preload),
                               name="scanforest-worker-setup")
        yield client
    finally:
        if cluster is not None and stopping():
            _end_workers(cluster)
        client.close()
        if cluster is not None:
            cluster.close()


def _host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_env(n_workers: int, threads_per_worker: int) -> dict[str, str]:
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
    whose ``CUDA_VISIBLE_DEVICES`` is GPU ``i mod G`` alone, not dask-cuda's rotated list of them all
    (32 workers on four H200s made their contexts in 7.0 s instead of 7.7 s, and closed in 2.4 s
    instead of 2.6 s). That suits stages whose work per GPU is partly host-bound (recognition's
    grouping, Zarr I/O), and it runs the multi-worker paths on a one-GPU machine. Each keeps to
    its GPU's NUMA node's cores where the host has several (:func:`_cores_near`; the x2 and x4
    H200 hosts lent so far have one, where nothing is pinned). Without ``n_workers``:
    :func:`default_gpu_workers`."""
    from scanforest.kernels.backend import gpu_count

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devs = [d for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(gpu_count())]
    if n_workers is None:
        n_workers = default_gpu_workers(len(devs))
    if n_workers <= len(devs):
        from dask_cuda import LocalCUDACluster

        return LocalCUDACluster(n_workers=n_workers, threads_per_worker=threads_per_worker, dashboard_address=None,
                                scheduler_kwargs=SCHEDULER_HTTP)
    from distributed import Nanny, Scheduler, SpecCluster
    from distributed.system import MEMORY_LIMIT

    from scanforest.kernels.backend import GPU_WORKERS_ENV

    workers = {}
    near = {d: _cores_near(d) for d in devs}
    for i in range(int(n_workers)):
        g = i % len(devs)
        sharing = n_workers // len(devs) + (g < n_workers % len(devs))  # the workers on GPU g
        workers[f"gpu{devs[g]}-{i // len(devs)}"] = {
            "cls": Nanny,
            "options": {"nthreads": threads_per_worker, "memory_limit": int(MEMORY_LIMIT // n_workers),
                        "silence_logs": logging.ERROR,
                        # each keeps at most its share of the GPU cached between chunks of scenes
                        # (tasks.pipeline.process_batch): 8 workers on one H200 holding their
                        # largest scenes' blocks left cuBLAS none (CUBLAS_STATUS_ALLOC_FAILED in 2
                        # of 2,000 scenes, 11 of 8,000 on four, 2026-11-28)
                        "env": {"CUDA_VISIBLE_DEVICES": devs[g], GPU_WORKERS_ENV: str(sharing),
                                **thread_env(n_workers, threads_per_worker)},
                        **({"plugins": [_pin(near[devs[g]])]} if near[devs[g]] else {})}}
    return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {
        "host": "127.0.0.1", "dashboard": False, **SCHEDULER_HTTP}}, silence_logs=logging.ERROR)


def _cores_near(dev: str) -> list[int] | None:
    """The host cores of GPU ``dev``'s NUMA node that this process may use (NVML's CPU affinity,
    as dask-cuda pins its one worker per GPU), or None where pinning would change nothing: one
    node, no NVML, or ``SCANFOREST_CPU_AFFINITY=0``."""
    if os.environ.get("SCANFOREST_CPU_AFFINITY", "1") == "0" or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        near = set(_nvml_affinity(dev))
    except Exception:  # no dask-cuda or NVML, a MIG or UUID name it cannot place
        return None
    allowed = os.sched_getaffinity(0)
    cores = sorted(near & allowed)
    return cores if cores and set(cores) != allowed else None


def _nvml_affinity(dev: str) -> list[int]:
    import warnings

    from dask_cuda.utils import get_cpu_affinity

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns, then answers every core, where NVML cannot say
        return get_cpu_affinity(int(dev) if dev.isdigit() else dev)


def _pin(cores):
    from dask_cuda.plugins import CPUAffinity

    return CPUAffinity(cores)


def warm_gpu_workers(device: str = "auto") -> bool:
    """Have every worker of the open :func:`cluster_scope`'s local GPU cluster warm up in the
    background (:func:`scanforest.tasks.pipeline.warm_worker`: its device's context and the one
    pass's kernels) while the flow process builds the library and the index, when its workers
    would otherwise wait. Returns at once; False (nothing done) without a scope's started GPU
    cluster. On four H100s, 32 workers paid 3.3 s for the device and 4.5 s for the index in
    their first batch of the pass (2026-11-28); warmed while ingest ran, they slowed it by more."""
    if _scope is None or "client" not in _scope or not _want_gpu_cluster(_scope["device"]):
        return False
    from scanforest.tasks.pipeline import warm_worker

    _scope["client"].run(warm_worker, "gpu")  # each starts its warm-up thread and returns
    return True


def open_gpu_contexts() -> bool:
    """Have every worker of the open :func:`cluster_scope`'s local GPU cluster create its CUDA
    context in the background (:func:`scanforest.tasks.pipeline.open_context`): a host makes
    them one after another (32 workers on four H200s: 7-8 s), which the commands overlap with
    Prefect's API booting and the ingest instead of the pass's start. Returns at once; False
    (nothing done) without a scope's started GPU cluster."""
    if _scope is None or "client" not in _scope or not _want_gpu_cluster(_scope["device"]):
        return False
    from scanforest.tasks.pipeline import open_context

    _scope["client"].run(open_context)
    return True


def n_workers(client) -> int:
    return len(client.scheduler_info(n_workers=-1)["workers"])
