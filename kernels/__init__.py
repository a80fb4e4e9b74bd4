"""Pure compute on arrays: no I/O, no Prefect.

Each algorithm has a CPU backend (numpy/numba) and a GPU backend (CuPy kernels) with the same
signature and semantics; the backend follows the input array type or an explicit ``device=``.

One subpackage per family, each with its public modules and their ``_<module>_cpu`` /
``_<module>_gpu`` backends beside them (``_<module>_common``: what a module and its backend
share; a backend other families build on is public: ``neighbors.search_cpu``/``search_gpu``,
``descriptors.shot_gpu``); each family's ``__init__`` re-exports its public names. A family uses
another only through its public names (no private name or module is imported across families):

* :mod:`.neighbors` - radius search and k-NN of 3-D points on a uniform grid;
* :mod:`.descriptors` - normals, keypoints, SHOT352;
* :mod:`.knn` - exact brute force, KD-trees and forests, sharded indexes;
* :mod:`.recognition` - model library, correspondence grouping, verification, ICP;
* :mod:`.align` - parametric chamfer alignment, exact distance transform, transformation models;
* :mod:`.motion` - dense optical flow and its metrics;
* :mod:`.synthetic` - synthetic scenes and image sequences with ground truth.

Shared by every family, at this level: :mod:`.backend` (device choice, array conversion, numba
and CUDA settings), :mod:`.errors`, :mod:`.validation` (the input checks: point arrays, positive
numbers), :mod:`.hypotheses` (the masked-argmax selection rule of recognition and motion),
:mod:`.coordinates` (the local frame that georeferenced coordinates are computed in) and
:mod:`.geom_cpu` (numba geometry helpers: the one covariance step and the one cyclic-Jacobi
eigen-solver, 3x3 for normals and SHOT frames, 4x4 for Horn's rigid fits).
"""
from .backend import gpu_available, resolve_device, to_numpy
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
