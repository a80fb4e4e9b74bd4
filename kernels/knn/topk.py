"""Merging per-shard top-k lists into a global top-k (CPU and GPU, same semantics).

Each list holds squared distances (float32, >= 0, ascending) and global int64 ids; the merge is
ordered by (distance, id), which is the brute force's tie rule, so merging the exact answers of
disjoint shards gives exactly the single-device answer. The (distance, id) pair is packed into
one uint64 key (the IEEE bits of a non-negative float32 sort like the float; ids < 2**32),
so one row-wise sort does the lexicographic order on either backend.
"""
from __future__ import annotations

import functools

import numpy as np

from ..backend import array_module
from ..errors import InputError

MAX_ID = (1 << 32) - 1




def pack(dist, ids):
    """uint64 keys (distance bits << 32 | id) ordering like (distance, id)."""
    xp = array_module(dist, ids)
    if xp is not np:  # one kernel (the steps below, fused)
        return _gpu_kernels()[0](xp.asarray(dist, dtype=xp.float32), ids.astype(xp.int64, copy=False))
    d = xp.ascontiguousarray(dist, dtype=xp.float32)
    d = xp.where(d < 0, xp.float32(0), d)  # -0.0 and rounding below zero sort as 0
    bits = d.view(xp.uint32).astype(xp.uint64)
    return (bits << xp.uint64(32)) | (ids.astype(xp.int64) & MAX_ID).astype(xp.uint64)


def unpack(keys):
    xp = array_module(keys)
    if xp is not np:
        return _gpu_kernels()[1](keys)
    dist = (keys >> xp.uint64(32)).astype(xp.uint32).view(xp.float32)
    ids = (keys & xp.uint64(MAX_ID)).astype(xp.int64)
    ids[ids == MAX_ID] = -1
    return dist, ids


@functools.lru_cache(maxsize=None)
def _gpu_kernels():
    """:func:`pack` and :func:`unpack` on the GPU, each one elementwise kernel (the same bits)."""
    import cupy as cp

    pack_k = cp.ElementwiseKernel(
        "float32 dist, int64 idx", "uint64 key",
        "float v = dist < 0.0f ? 0.0f : dist;"
        " key = ((unsigned long long)__float_as_uint(v) << 32) | ((unsigned long long)idx & 0xFFFFFFFFull)",
        "sf_pack_keys")
    unpack_k = cp.ElementwiseKernel(
        "uint64 key", "float32 dist, int64 idx",
        "dist = __uint_as_float((unsigned int)(key >> 32));"
        " unsigned long long u = key & 0xFFFFFFFFull; idx = u == 0xFFFFFFFFull ? -1LL : (long long)u",
        "sf_unpack_keys")
    return pack_k, unpack_k


def merge_topk(parts, k: int):
    """Global top-``k`` of several ``(dist2, ids)`` results for the same queries.

    Parameters
    ----------
    parts : sequence of (dist2 (M, k_i) float32, ids (M, k_i) int64)
        Ids must be global and below 2**32 - 1; padding entries carry id -1 and distance inf.
    k : int

    Returns
    -------
    dist2 (M, k) float32, ids (M, k) int64, ascending by (distance, id).
    """
    if not parts:
        raise InputError("merge_topk needs at least one part")
    m = parts[0][0].shape[0]
    for d, i in parts:
        if d.shape != i.shape or d.ndim != 2 or d.shape[0] != m:
            raise InputError(f"every part must be (M, k_i) with M = {m}; got {d.shape} and {i.shape}")
    xp = array_module(*[a for p in parts for a in p])
    keys = xp.concatenate([pack(xp.asarray(d), xp.asarray(i)) for d, i in parts], axis=1)
    if keys.shape[1] > k:
        keys = xp.sort(keys, axis=1)[:, :k]
    else:
        keys = xp.sort(keys, axis=1)
    return unpack(keys)


def pad_topk(dist, ids, k: int):
    """Pad a (M, j <= k) result to k columns with (inf, -1)."""
    xp = array_module(dist, ids)
    j = dist.shape[1]
    if j >= k:
        return dist, ids
    m = dist.shape[0]
    d = xp.concatenate([dist, xp.full((m, k - j), xp.inf, xp.float32)], axis=1)
    i = xp.concatenate([ids, xp.full((m, k - j), -1, xp.int64)], axis=1)
    return d, i
