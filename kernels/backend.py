"""Backend selection: numpy on the CPU, CuPy on the GPU.

Every kernel takes ``device="auto" | "cpu" | "gpu"``. ``"auto"`` follows the input arrays: a
CuPy array runs on the GPU, a numpy array on the CPU. Entry points that load data themselves
(flows, CLI) resolve ``"auto"`` with :func:`resolve_device`, which picks the GPU when one is visible.

Shared by every kernel family and used by the tasks, the flows and the CLI: device discovery,
memory queries, array conversion (:func:`to_numpy`, :func:`to_device`), numba and CUDA settings,
and the per-phase :class:`Timer`.
"""
from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any

import numpy as np

from .errors import DeviceError, InputError

DEVICES = ("auto", "cpu", "gpu")


# how a host thread waits for the GPU (CUDA's CU_CTX_SCHED_* flags of the primary context)
CUDA_SCHEDULES = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}


def cuda_schedule_flag() -> int | None:
    """The wait policy asked for by ``SCANFOREST_CUDA_SCHEDULE`` (``auto``, ``spin``, ``yield`` or
    ``blocking``), or None when unset. CUDA's default (``auto``) spins a core while it waits when
    the host has more cores than CUDA contexts; processes that share one GPU and also need the
    host's cores (several workers per GPU) may do better with ``blocking``."""
    value = os.environ.get("SCANFOREST_CUDA_SCHEDULE", "").strip().lower()
    if not value:
        return None
    if value not in CUDA_SCHEDULES:
        raise InputError(f"SCANFOREST_CUDA_SCHEDULE must be one of {sorted(CUDA_SCHEDULES)}, got {value!r}")
    return CUDA_SCHEDULES[value]


def _apply_cuda_schedule(n_devices: int) -> None:
    """Set the requested wait policy on every visible device's primary context (driver API,
    ``cuDevicePrimaryCtxSetFlags``, which also applies to a context already active)."""
    flag = cuda_schedule_flag()
    if flag is None:
        return
    import ctypes
    import warnings

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0) != 0:
            raise OSError("cuInit failed")
        setter = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
        for ordinal in range(n_devices):
            dev = ctypes.c_int()
            if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
                raise OSError(f"cuDeviceGet({ordinal}) failed")
            rc = setter(dev, ctypes.c_uint(flag))
            if rc != 0:
                raise OSError(f"cuDevicePrimaryCtxSetFlags returned CUDA error {rc}")
    except (OSError, AttributeError) as exc:
        warnings.warn(f"SCANFOREST_CUDA_SCHEDULE could not be applied ({exc}); CUDA's default is used",
                      RuntimeWarning, stacklevel=3)


#: a host-wide lock (a file in the temporary folder) that CUDA contexts are created under, one
#: process at a time (:func:`open_device_context`); None: no lock
CONTEXT_LOCK: str | None = os.path.join(tempfile.gettempdir(), "scanforest-cuda-context.lock")


def open_device_context() -> bool:
    """Create the primary CUDA context of this process's first visible GPU now (with the wait
    policy of ``SCANFOREST_CUDA_SCHEDULE``), through the driver API: ctypes gives up the GIL for
    each call, so a Dask worker runs its tasks meanwhile, and CuPy finds the context made.

    A host makes contexts one after another whatever asks (8 workers' took 2.0 s each on one
    H200, 32 workers' 7-8 s each on four, 2026-11-28). Here each process takes its turn under a
    file lock (:data:`CONTEXT_LOCK`) and sleeps until then, instead of 32 processes waiting in
    the driver at once beside the work the host has meanwhile (the ingest). False without a
    driver or a visible GPU."""
    if os.environ.get("SCANFOREST_DISABLE_GPU"):
        return False
    import ctypes

    fd = None
    if CONTEXT_LOCK:
        try:
            import fcntl

            fd = os.open(CONTEXT_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no lock where the folder cannot be written: the driver orders them anyway
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int()
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
            return False
        _apply_cuda_schedule(n.value)  # a context's flags are set before it exists
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        if cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
            return False
        return cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    except (OSError, AttributeError):
        return False
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock


def settle_numba_threads() -> int | None:
    """Make numba's thread count the one ``NUMBA_NUM_THREADS`` asks for now, before its threads start.

    numba reads ``NUMBA_NUM_THREADS`` when it is imported and again before every compilation, and
    raises once its threads are running and the two differ. A Dask worker process is spawned,
    imports the program's ``__main__`` (numba may come with it), and only then receives the
    environment its cluster gave it: a worker of a 2-core machine imported numba with 2 threads,
    ran a cached parallel kernel (threads started with 2), and its first compilation read 1 and
    failed. Called once in every worker before any task (a worker plugin, see
    ``flows.worker_setup``), this re-reads the environment while no thread has started. Returns the
    count in force, or None when numba was not imported (it then reads the environment itself).
    """
    import sys

    if "numba" not in sys.modules:
        return None
    import numba
    from numba.np.ufunc import parallel

    if not parallel._is_initialized:
        numba.config.reload_config()
        return numba.config.NUMBA_NUM_THREADS
    wanted = os.environ.get("NUMBA_NUM_THREADS")
    if wanted and wanted.isdigit() and int(wanted) != numba.config.NUMBA_NUM_THREADS:
        # threads already run with another count: keep the environment equal to it, so no later
        # compilation fails, and use at most the wanted count in this thread
        os.environ["NUMBA_NUM_THREADS"] = str(numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(max(1, min(int(wanted), numba.config.NUMBA_NUM_THREADS)))
    return numba.config.NUMBA_NUM_THREADS


def numba_cache_cold() -> str | None:
    """Where numba caches scanforest's compiled CPU kernels, when that folder holds none of them
    yet: the first run on a machine (or with a new ``NUMBA_CACHE_DIR``) then compiles them, about a
    minute on 2 cores, and says so instead of looking stuck. None when the cache is warm."""
    from .geom_cpu import eig3

    cache = getattr(eig3, "_cache", None)
    path = getattr(cache, "_cache_path", None)
    if not path:
        return None
    try:
        warm = any(name.endswith(".nbi") for name in os.listdir(path))
    except OSError:
        warm = False
    return None if warm else str(path)


#: a CPU GEMM of fewer multiply-adds than this runs BLAS on one thread (:func:`blas_one_thread`)
SMALL_GEMM = 1 << 28


@functools.lru_cache(maxsize=1)
def _blas_controller():
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # optional: without it BLAS keeps its own threads
        return None
    return ThreadpoolController()


def blas_one_thread(madds: float = 0):
    """A context in which BLAS runs on one thread when ``madds`` (the multiply-adds of the work
    inside) is below :data:`SMALL_GEMM` (``threadpoolctl``; a no-op without it or for larger
    work). Around the CPU backend's small GEMMs: OpenBLAS's worker threads otherwise keep
    spinning for a while after each call and take the cores numba's threads run on next (2-core
    machine, PCL's scene thinned: the whole scene 84 -> 44 ms with BLAS on one thread)."""
    import contextlib

    c = _blas_controller() if madds < SMALL_GEMM else None
    return contextlib.nullcontext() if c is None else c.limit(limits=1, user_api="blas")


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers. The first call also applies
    ``SCANFOREST_CUDA_SCHEDULE`` (see :func:`cuda_schedule_flag`)."""
    if os.environ.get("SCANFOREST_DISABLE_GPU"):
        return False
    try:
        import cupy as cp

        n = cp.cuda.runtime.getDeviceCount()
    except Exception:
        return False
    if n > 0:
        _apply_cuda_schedule(n)
    return n > 0


def gpu_count() -> int:
    """Number of visible CUDA devices (0 without a usable GPU)."""
    if not gpu_available():
        return 0
    import cupy as cp

    return int(cp.cuda.runtime.getDeviceCount())


def gpu_name() -> str | None:
    """Name of the current CUDA device, or None without a GPU."""
    if not gpu_available():
        return None
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def device_memory(device: str) -> list[int]:
    """Total memory of each local device of ``device`` in bytes: every visible GPU, or the host
    (one entry) for ``"cpu"``."""
    if resolve_device(device) == "gpu":
        import cupy as cp

        return [int(cp.cuda.Device(i).mem_info[1]) for i in range(gpu_count())]
    import psutil

    return [int(psutil.virtual_memory().total)]


def free_memory(device: str = "auto") -> tuple[int, str]:
    """(free bytes, what they belong to) where ``device`` computes in this process: the current
    GPU's free memory and its PCI bus id, or the host's available memory and ``"host"``."""
    if resolve_device(device) == "gpu":
        import cupy as cp

        dev = cp.cuda.Device()
        return int(dev.mem_info[0]), str(dev.pci_bus_id)
    import psutil

    return int(psutil.virtual_memory().available), "host"


#: environment variable: how many worker processes share this process's GPU (set by the local
#: GPU cluster for each of its workers, see :func:`gpu_cache_share`)
GPU_WORKERS_ENV = "SCANFOREST_GPU_WORKERS"


def release_gpu_cache(*, pinned: bool = True) -> None:
    """Give CuPy's cached device blocks (and, with ``pinned``, its pinned host blocks) back to
    the driver (a no-op without CuPy or a GPU): what a process keeps for its next arrays, which
    the other processes on its GPU cannot use meanwhile."""
    if not gpu_available():
        return
    import cupy as cp

    cp.get_default_memory_pool().free_all_blocks()
    if pinned:
        cp.get_default_pinned_memory_pool().free_all_blocks()


def gpu_cache_share() -> int | None:
    """Bytes of its GPU this process's memory pool may hold between units of work when
    ``SCANFOREST_GPU_WORKERS`` (set for each worker of a local GPU cluster) says that N worker
    processes share the GPU: 85% of the device's memory over N (the rest: their CUDA contexts
    and the libraries' own workspaces, which cuBLAS allocates outside the pool). None when the
    process is alone on its GPU or there is none."""
    try:
        n = int(os.environ.get(GPU_WORKERS_ENV, "1"))
    except ValueError:
        return None
    if n <= 1 or not gpu_available():
        return None
    import cupy as cp

    return int(0.85 * cp.cuda.Device().mem_info[1]) // n


def trim_gpu_cache(share: int | None) -> bool:
    """Release the pool's cached blocks (:func:`release_gpu_cache`) when the pool holds more than
    ``share`` bytes (:func:`gpu_cache_share`), so that one worker's large scene does not keep
    memory another worker on the GPU then fails to get. True when it released."""
    if share is None:
        return False
    import cupy as cp

    pool = cp.get_default_memory_pool()
    if pool.total_bytes() <= share or not pool.free_bytes():
        return False
    # the device's blocks only: pinned host buffers take none of the GPU, and each one given back
    # is a page-locking call into the driver (one lock for the whole host) when it is needed again
    release_gpu_cache(pinned=False)
    return True


#: what device-memory failures say: CuPy's pool, the CUDA runtime, and cuBLAS / cuSOLVER / cuFFT
#: workspaces (allocated by the libraries themselves, outside CuPy's pool)
_DEVICE_MEMORY_SIGNS = ("OutOfMemory", "ALLOC_FAILED", "cudaErrorMemoryAllocation", "out of memory")


def is_device_memory_error(exc: BaseException) -> bool:
    """True for an error of a GPU running out of memory (CuPy's ``OutOfMemoryError``, a library's
    ``*_STATUS_ALLOC_FAILED``, ``cudaErrorMemoryAllocation``): one that may pass once cached
    memory is given back, unlike a wrong input."""
    if type(exc) is MemoryError:  # the host's
        return False
    text = f"{type(exc).__name__}: {exc}"
    return any(sign in text for sign in _DEVICE_MEMORY_SIGNS)


def is_cupy(a: Any) -> bool:
    """True for a CuPy ndarray (checked without importing CuPy)."""
    return type(a).__module__.startswith("cupy")


def resolve_device(device: str | None = "auto", *arrays: Any) -> str:
    """Turn ``auto|cpu|gpu`` (plus the inputs' array types) into ``"cpu"`` or ``"gpu"``.

    ``auto`` with array inputs follows their type (any CuPy input means GPU); ``auto`` with no
    arrays picks the GPU when one is available. ``gpu`` without a usable GPU raises
    :class:`DeviceError` rather than silently running on the CPU.
    """
    device = "auto" if device is None else str(device).lower()
    if device not in DEVICES:
        raise InputError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        if arrays:
            return "gpu" if any(is_cupy(a) for a in arrays) else "cpu"
        return "gpu" if gpu_available() else "cpu"
    if device == "gpu" and not gpu_available():
        raise DeviceError(
            "device='gpu' was requested but no CUDA GPU is usable (is CuPy installed, "
            "e.g. `pip install scanforest[cuda12]`, and does `nvidia-smi` see a device?)"
        )
    return device


def xp_for(device: str):
    """The array module (numpy or cupy) of a resolved device."""
    if device == "gpu":
        import cupy as cp

        return cp
    return np


def array_module(*arrays):
    """The array module of the inputs: cupy when any of them is a CuPy array, else numpy."""
    return xp_for("gpu" if any(is_cupy(a) for a in arrays) else "cpu")


def to_device(a: Any, device: str, dtype=None):
    """Move ``a`` to the resolved device (no copy when it is already there with that dtype)."""
    if device == "gpu":
        import cupy as cp

        return cp.asarray(a, dtype=dtype)
    return np.asarray(to_numpy(a), dtype=dtype)


def to_numpy(a: Any) -> np.ndarray:
    """A numpy view/copy of a numpy or CuPy array."""
    if is_cupy(a):
        return a.get()
    return np.asarray(a)


#: below this size a device-to-host copy goes through pageable memory (pinning costs more)
PINNED_MIN_BYTES = 1 << 20


def to_host(a: Any, *, stream=None) -> np.ndarray:
    """A numpy copy of a CuPy array through page-locked (pinned) host memory.

    A copy from the device into pageable memory runs at about 2.4 GB/s on an H100 host (the
    driver stages it through a bounce buffer); into pinned memory at the link's speed, several
    times faster. The pinned buffers come from CuPy's pinned-memory pool, so a pipeline that
    copies results of similar sizes scene after scene allocates them once; each buffer returns
    to the pool when its numpy array is freed. With ``stream`` the copy is ordered on that
    stream and the call waits for it. Numpy input is returned as it is; small arrays take the
    plain path.
    """
    if not is_cupy(a):
        return np.asarray(a)
    if a.nbytes < PINNED_MIN_BYTES:
        return a.get(stream=stream)
    import cupy as cp

    a = cp.ascontiguousarray(a)
    out = pinned_empty(a.shape, a.dtype)
    a.get(stream=stream, out=out)
    return out


#: size classes of pinned buffers per doubling of the size (:func:`pinned_size_class`)
PINNED_CLASSES_PER_OCTAVE = 8


def pinned_size_class(nbytes: int) -> int:
    """The bytes :func:`pinned_empty` asks CuPy's pinned-memory pool for: ``nbytes`` rounded up
    to one of :data:`PINNED_CLASSES_PER_OCTAVE` sizes per doubling (at most 1/8 more, and a
    multiple of 512 bytes, the pool's own unit).

    CuPy's pinned pool gives a freed buffer back only for a request of exactly its size. A
    scene's SHOT rows are 1,408 bytes a keypoint, so asked for as they are, nearly every scene
    would allocate and page-lock a new buffer (a call into the driver under one lock for the
    whole host, so 32 workers on four GPUs wait on each other) and the pool would keep one
    buffer per keypoint count it ever saw. In size classes the scenes of an archive reuse a few."""
    n = int(nbytes)
    if n <= 4096:
        return max(512, -(-n // 512) * 512)
    # the octave's lower end over the classes per octave (a power of two)
    step = max(512, (1 << (n.bit_length() - 1)) // PINNED_CLASSES_PER_OCTAVE)
    return -(-n // step) * step


def pinned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised numpy array in page-locked host memory from CuPy's pinned-memory pool
    (the buffer returns to the pool when the array is freed): the target of fast, and with a
    stream asynchronous, device-to-host copies. The buffer is of the request's size class
    (:func:`pinned_size_class`), so arrays of similar sizes reuse the pool's buffers."""
    import cupy as cp

    n = int(np.prod(shape))
    nbytes = n * np.dtype(dtype).itemsize
    mem = cp.cuda.alloc_pinned_memory(pinned_size_class(nbytes))
    return np.frombuffer(mem, dtype, n).reshape(shape)


def describe_device(device: str) -> str:
    """Human-readable device description used in logs and benchmark tables."""
    if device == "gpu":
        return f"gpu ({gpu_name()})"
    import platform

    return f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


class Timer:
    """Per-phase wall-clock timer; synchronises the GPU before each reading when asked. ``t`` maps
    each phase to its seconds, summed over its laps (the phase timings of recognition and describe)."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.t = {}
        self._last = time.perf_counter()

    def _sync(self):
        if self.gpu:
            import cupy as cp

            cp.cuda.Stream.null.synchronize()

    def restart(self):
        """Start the next phase now (time spent elsewhere since the last lap is not counted)."""
        self._last = time.perf_counter()

    def lap(self, name: str):
        self._sync()
        now = time.perf_counter()
        self.t[name] = self.t.get(name, 0.0) + (now - self._last)
        self._last = now
