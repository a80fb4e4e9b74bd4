"""Backend selection and its environment knobs."""
from __future__ import annotations

import subprocess
import sys

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
