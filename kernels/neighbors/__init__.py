"""Neighbourhoods of 3-D points: radius search and k nearest neighbours on a uniform grid.

``search`` is the public module (CPU backend ``_search_cpu``, numba; GPU backend ``search_gpu``,
CuPy); ``_search_common`` holds the CSR result type both backends return. Descriptors and
recognition build on these searches: on the CPU through ``search``'s ``radius_search_cpu``,
``knn_cpu`` and ``cpu_grid``, on the GPU through the grid and its stages in ``search_gpu``
(public for that reason, and for the SHOT bench that times them).
"""
from .search import Neighbors, knn, radius_search

__all__ = [
    "Neighbors",
    "knn",
    "radius_search",
]
