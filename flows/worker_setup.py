"""What every Dask worker of a flow's cluster does before its first task: the worker plugin
(:func:`worker_plugin`) that gives it the flow's Prefect API URL, sets its allocator's
thresholds, settles numba's thread count and imports the modules every stage uses
(:data:`WORKER_PRELOAD`)."""
from __future__ import annotations

import contextlib
import importlib
import logging
import os

from scanforest.tasks.readers import FORMAT_LIBRARIES


class _LocalShutdownNoise(logging.Filter):
    """In a worker of a cluster the command started itself, a heartbeat that fails because the
    scheduler is gone happens only while the command shuts its cluster down; its ERROR and
    traceback were printed after the command's result on a busy machine."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "during heartbeat" not in record.getMessage()


#: modules every stage's unit of work uses, imported by each worker as it starts (Dask's
#: "preload"): imported by the first task instead, they cost a worker about 0.3 s alone and
#: 1-1.5 s with 8 workers importing at once on 16 cores, inside the first stage's wall time
WORKER_PRELOAD = ("zarr", "scanforest.tasks.ingest")  # tasks.ingest imports the store
#: what the workers of a cluster whose first stage is ingest import besides (the format readers:
#: about 1 s of CPU a worker, which the other stages never use)
INGEST_PRELOAD = FORMAT_LIBRARIES


#: glibc's large-allocation thresholds for a worker: arrays up to 32 MiB come from the heap, and
#: up to 64 MiB of free heap top is kept (glibc's own limits when it adapts them). Dask's nannies
#: set ``MALLOC_TRIM_THRESHOLD_=65536`` in every worker, and any explicit threshold stops glibc
#: adapting its mmap threshold: then every array over 128 KiB is a fresh mmap whose pages the
#: kernel faults in and zeroes again. A 12 MB array (one 20k-point scene's SHOT rows) costs twice
#: the time that way (5.0 -> 9.3 ms per allocate-and-fill on the 2-core development machine,
#: 260k page faults per 300 arrays instead of 7k), and the kernel's zeroing is work every worker
#: of the host shares.
MALLOC_MMAP_THRESHOLD = 32 << 20
MALLOC_TRIM_THRESHOLD = 64 << 20


def tune_allocator() -> bool:
    """Set :data:`MALLOC_MMAP_THRESHOLD` and :data:`MALLOC_TRIM_THRESHOLD` in this process
    (glibc's ``mallopt``), unless the user set ``MALLOC_MMAP_THRESHOLD_`` themselves. True when
    set; False elsewhere (not glibc, or the user's choice)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))


def leave_the_worker_pool() -> None:
    """Inside a Dask task: give this worker's slot to its next task (``distributed.secede``), for
    a task that only waits from here on (the one pass waiting on its last writes, while the next
    batch computes on the device); a no-op outside a worker."""
    try:
        from distributed import secede

        secede()
    except (ImportError, ValueError):  # not in a Dask worker's task
        pass


def quiet_interrupt() -> bool:
    """In a worker of the cluster a command started itself: a Ctrl-C (which the terminal sends to
    the command's whole process group, its workers too) ends this process at once and quietly, as
    the command stops (``scanforest.deploy.cli``: its run marked interrupted, a rerun resumes;
    what a worker had half written is left as a killed worker leaves it, and the next run redoes
    it). Python's handler printed a KeyboardInterrupt traceback in each worker, and waited for a
    long numba loop to return first; the system's default action (``SIG_DFL``) ends the process
    where it is. False (nothing done) outside the process's main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return True


def worker_plugin(env: dict[str, str], local: bool = False, preload: tuple[str, ...] = ()):
    """Worker plugin, run in every worker (present and future) before its first task: give it the
    flow's Prefect API URL, set its allocator's thresholds (:func:`tune_allocator`), settle numba's
    thread count while no numba thread runs
    (:func:`scanforest.kernels.backend.settle_numba_threads`) and import :data:`WORKER_PRELOAD`
    and ``preload`` (:data:`INGEST_PRELOAD` for ingest).
    ``local``: the command started this cluster, and its shutdown is not an error
    (:class:`_LocalShutdownNoise`)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class WorkerSetup(WorkerPlugin):
        name = "scanforest-worker-setup"

        def __init__(self, env, local, preload):
            self.env = env
            self.local = local
            self.preload = tuple(preload)

        def setup(self, worker):
            os.environ.update(self.env)
            tune_allocator()
            if self.local:
                logging.getLogger("distributed.worker").addFilter(_LocalShutdownNoise())
                quiet_interrupt()
            from scanforest.kernels.backend import settle_numba_threads

            settle_numba_threads()
            for name in WORKER_PRELOAD + self.preload:  # a missing one fails the task that needs it, with its own error
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)

    return WorkerSetup(env, local, preload)
