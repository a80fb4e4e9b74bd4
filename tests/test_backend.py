"""Backend selection and its environment knobs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from scanforest.kernels.backend import CUDA_SCHEDULES, cuda_schedule_flag, resolve_device
from scanforest.kernels.errors import InputError


def test_cuda_schedule_knob_is_parsed_and_checked(monkeypatch):
    monkeypatch.delenv("SCANFOREST_CUDA_SCHEDULE", raising=False)
    assert cuda_schedule_flag() is None
    for name, flag in CUDA_SCHEDULES.items():
        monkeypatch.setenv("SCANFOREST_CUDA_SCHEDULE", name.upper())
        assert cuda_schedule_flag() == flag
    monkeypatch.setenv("SCANFOREST_CUDA_SCHEDULE", "sleepy")
    with pytest.raises(InputError, match="SCANFOREST_CUDA_SCHEDULE must be one of"):
        cuda_schedule_flag()


def test_resolve_device_rejects_unknown_devices():
    with pytest.raises(InputError, match="device must be one of"):
        resolve_device("tpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["blocking", "spin"])
def test_cuda_schedule_reaches_the_primary_context(schedule):
    """In a fresh process: the first GPU check sets the policy, and the context CuPy then uses
    carries it (cuCtxGetFlags)."""
    code = (
        "import ctypes, cupy as cp\n"
        "from scanforest.kernels.backend import gpu_available\n"
        "assert gpu_available()\n"
        "cp.arange(10).sum().item()\n"
        "f = ctypes.c_uint()\n"
        "assert ctypes.CDLL('libcuda.so.1').cuCtxGetFlags(ctypes.byref(f)) == 0\n"
        "print(f.value & 7)\n")
    env = {**__import__("os").environ, "SCANFOREST_CUDA_SCHEDULE": schedule}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == CUDA_SCHEDULES[schedule]


def test_pinned_size_classes_bound_the_waste_and_are_few():
    """Pinned buffers are asked for in size classes: never smaller than the request, at most 1/8
    (or the pool's 512-byte unit) more, monotone, and few across a scene's range of SHOT row
    counts, so CuPy's exact-size pinned pool reuses them scene after scene."""
    from scanforest.kernels.backend import pinned_size_class

    prev = 0
    for n in range(1, 6_000_000, 769):
        c = pinned_size_class(n)
        assert c >= n and c % 512 == 0 and c >= prev and c <= max(n * 1.125, n + 512), n
        prev = c
    # SHOT352 rows of 1,500-3,000 keypoints: 1,501 distinct requests, a handful of classes
    classes = {pinned_size_class(k * 352 * 4) for k in range(1_500, 3_001)}
    assert len(classes) <= 9
    assert pinned_size_class(1 << 22) == 1 << 22  # a class boundary is its own class


@pytest.mark.gpu
def test_pinned_buffers_are_reused_across_nearby_sizes_and_trim_keeps_them():
    """Two device-to-host copies of nearby sizes (one scene's SHOT rows, then the next's) share
    one pinned buffer, and the trim of a worker's device cache leaves the pinned pool alone."""
    import cupy as cp

    from scanforest.kernels.backend import to_host, trim_gpu_cache

    pinned = cp.get_default_pinned_memory_pool()
    pinned.free_all_blocks()
    a = cp.arange(2_000 * 352, dtype=cp.float32).reshape(2_000, 352)
    h = to_host(a)
    np_a = h.copy()
    del h
    assert pinned.n_free_blocks() == 1
    b = cp.arange(2_013 * 352, dtype=cp.float32).reshape(2_013, 352)
    h = to_host(b)
    assert pinned.n_free_blocks() == 0  # the freed buffer served the next, larger request
    assert (h == b.get()).all() and (np_a == a.get()).all()
    del h
    pool = cp.get_default_memory_pool()
    big = cp.empty(64 << 20, cp.uint8)
    del big
    assert trim_gpu_cache(1)  # holds more than a 1-byte share: the device blocks go back
    assert pool.free_bytes() == 0 and pinned.n_free_blocks() == 1


def test_contexts_are_created_one_process_at_a_time(tmp_path, monkeypatch):
    """open_device_context waits, asleep, while another process holds the host's context lock,
    and goes on once it is released (on a machine without a GPU it then answers False)."""
    import fcntl
    import os
    import threading
    import time

    from scanforest.kernels import backend

    lock = tmp_path / "ctx.lock"
    monkeypatch.setattr(backend, "CONTEXT_LOCK", str(lock))
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    done = []
    t = threading.Thread(target=lambda: done.append(backend.open_device_context()))
    t.start()
    time.sleep(0.3)
    assert not done  # waiting its turn
    os.close(fd)
    t.join(60)
    assert len(done) == 1
    monkeypatch.setattr(backend, "CONTEXT_LOCK", str(tmp_path / "no" / "such" / "folder.lock"))
    assert backend.open_device_context() in (True, False)  # an unusable lock is no lock, not an error


@pytest.mark.gpu
def test_a_context_opened_through_the_driver_is_the_one_cupy_then_uses():
    """In a fresh process: open_device_context makes the primary context (active before CuPy
    touches the device, with the asked wait policy), and CuPy computes in it."""
    code = (
        "import ctypes\n"
        "from scanforest.kernels.backend import open_device_context\n"
        "cuda = ctypes.CDLL('libcuda.so.1')\n"
        "assert open_device_context()\n"
        "flags, active = ctypes.c_uint(), ctypes.c_int()\n"
        "assert cuda.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0\n"
        "import cupy as cp\n"
        "assert int(cp.arange(10).sum()) == 45\n"
        "f = ctypes.c_uint()\n"
        "assert cuda.cuCtxGetFlags(ctypes.byref(f)) == 0\n"
        "print(active.value, f.value & 7)\n")
    env = {**__import__("os").environ, "SCANFOREST_CUDA_SCHEDULE": "blocking"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["1", str(CUDA_SCHEDULES["blocking"])]


def test_small_gemms_run_blas_on_one_thread():
    """Small CPU GEMMs (the brute force against a small library) hold BLAS at one thread, so its
    spinning workers leave the cores to numba's; large ones keep BLAS's own threads."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from scanforest.kernels.backend import SMALL_GEMM, blas_one_thread

    def blas_threads():
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

    before = blas_threads()
    with blas_one_thread(1_000):
        assert all(n == 1 for n in blas_threads())
    assert blas_threads() == before
    with blas_one_thread(SMALL_GEMM):
        assert blas_threads() == before


_KERNEL = '''
import numpy as np
from scanforest.kernels.jit import njit


@njit(cache=True)
def inner(x, i):
    s = 0.0
    for j in range(x.shape[1]):
        s += np.sin(x[i, j]) * np.cos(x[i, j]) + np.sqrt(abs(x[i, j]))
    return s


@njit(cache=True)
def outer(x):
    out = np.empty(x.shape[0])
    for i in range(x.shape[0]):
        out[i] = inner(x, i)
    return out[np.argsort(out)]
'''

_CALLER = '''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import kern
while not os.path.exists(sys.argv[2]):
    time.sleep(0.002)
got = kern.outer(np.arange(12.0).reshape(3, 4))
print(json.dumps({"misses": sum(kern.outer.stats.cache_misses.values()),
                  "hits": sum(kern.outer.stats.cache_hits.values()), "sum": float(got.sum())}))
'''


def test_processes_compile_a_cached_kernel_once_between_them(tmp_path):
    """Two processes that reach the same uncompiled kernel at the same moment (the archive's
    workers on a fresh machine): one compiles it, the other waits and loads what it wrote
    (numba alone compiles it in both, 28 s of CPU each for the demo's workers on 2 cores)."""
    (tmp_path / "kern.py").write_text(_KERNEL)
    (tmp_path / "cache").mkdir()
    (tmp_path / "caller.py").write_text(_CALLER)
    go = tmp_path / "go"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "caller.py"), str(tmp_path), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(1.5)  # both have imported numba and wait at the start line
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted((o["misses"], o["hits"]) for o in outs) == [(0, 1), (1, 0)], outs
    assert outs[0]["sum"] == outs[1]["sum"]
    assert list((tmp_path / "cache").rglob("kern.outer-*.nbi.lock"))  # the lock beside the function's index
