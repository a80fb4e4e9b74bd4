"""What every Dask worker of a flow's cluster does before its first task: the worker plugin
(:func:`worker_plugin`) that gives it the flow's Prefect API URL, settles numba's thread count and
imports the modules every stage uses (:data:`WORKER_PRELOAD`)."""
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


def leave_the_worker_pool() -> None:
    """Inside a Dask task: give this worker's slot to its next task (``distributed.secede``), for
    a task that only waits from here on (the one pass waiting on its last writes, while the next
    batch computes on the device); a no-op outside a worker."""
    try:
        from distributed import secede

        secede()
    except (ImportError, ValueError):  # not in a Dask worker's task
        pass


def worker_plugin(env: dict[str, str], local: bool = False, preload: tuple[str, ...] = ()):
    """Worker plugin, run in every worker (present and future) before its first task: give it the
    flow's Prefect API URL, settle numba's thread count while no numba thread runs
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
            if self.local:
                logging.getLogger("distributed.worker").addFilter(_LocalShutdownNoise())
            from scanforest.kernels.backend import settle_numba_threads

            settle_numba_threads()
            for name in WORKER_PRELOAD + self.preload:  # a missing one fails the task that needs it, with its own error
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)

    return WorkerSetup(env, local, preload)
