"""Neighbourhoods of 3-D points: radius search and k nearest neighbours on a uniform grid.

``search`` is the module to call (CPU backend ``search_cpu``, numba; GPU backend ``search_gpu``,
CuPy); ``_search_common`` holds the CSR result type both backends return. Descriptors and
recognition build on these searches and on the backends' grids, which are public for that
reason: on the CPU ``search``'s ``radius_search_cpu``, ``knn_cpu`` and ``cpu_grid`` and the
kernels of ``search_cpu`` (``grid_radius``; ``verify_points``, recognition's verification), on the
GPU the grid and its stages in ``search_gpu`` (which the SHOT bench also times one by one).
"""
from .search import Neighbors, knn, radius_search

__all__ = [
    "Neighbors",
    "knn",
    "radius_search",
]
