"""Pure compute on arrays: no I/O, no Prefect.

Each algorithm has a CPU backend (numpy/numba) and a GPU backend (CuPy kernels) with the same
signature and semantics; the backend follows the input array type or an explicit ``device=``.
"""
from ._backend import gpu_available, resolve_device, to_numpy
from .errors import DeviceError, InputError, OutOfMemory, ScanforestError, ScanReadError

__all__ = [
    "DeviceError",
    "InputError",
    "OutOfMemory",
    "ScanforestError",
    "ScanReadError",
    "gpu_available",
    "resolve_device",
    "to_numpy",
]
