"""Neighbourhoods of 3-D points: radius search and k nearest neighbours on a uniform grid.

``search`` is the public module (CPU backend ``_search_cpu``, numba; GPU backend ``_search_gpu``,
CuPy); ``_search_common`` holds the CSR result type both backends return. Descriptors and
recognition build on these searches.
"""
from .search import Neighbors, knn, radius_search

__all__ = [
    "Neighbors",
    "knn",
    "radius_search",
]
