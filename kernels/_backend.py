"""Backend selection: numpy on the CPU, CuPy on the GPU.

Every kernel takes ``device="auto" | "cpu" | "gpu"``. ``"auto"`` follows the input arrays: a
CuPy array runs on the GPU, a numpy array on the CPU. Entry points that load data themselves
(flows, CLI) resolve ``"auto"`` with :func:`resolve_device`, which picks the GPU when one is visible.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from .errors import DeviceError, InputError

DEVICES = ("auto", "cpu", "gpu")


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers."""
    if os.environ.get("SCANFOREST_DISABLE_GPU"):
        return False
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


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


def describe_device(device: str) -> str:
    """Human-readable device description used in logs and benchmark tables."""
    if device == "gpu":
        return f"gpu ({gpu_name()})"
    import platform

    return f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
