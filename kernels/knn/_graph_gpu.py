"""GPU kernels of a KD-forest's graph rounds (:meth:`scanforest.kernels.knn.kdforest.KDForest._expand`).

``graph_pair_keys``: the canonical distance of each (query, candidate row) pair, packed with the
row id into a uint64 key (:func:`scanforest.kernels.knn.topk.pack`'s layout). A block scores 128
pairs; the rows' coordinates come in 32-wide slices through shared memory, one coalesced
128-byte load per row and slice, and each thread sums its own pair in dimension order with the
same rounded operations as :func:`scanforest.kernels.knn.bruteforce.pair_dist_gpu` (the
distances are bit for bit the brute force's). One thread per pair reading its row straight from
memory (``pair_dist``) touches 32 rows per warp load: 8x the bytes the rows hold.

``graph_merge``: each query's list (``kk`` keys) and its candidates' keys merged into the
``kk`` smallest distinct keys, ascending, by a warp per query (the same key twice is the same
row: its distance to the query is one value), instead of two row-wise sorts.
"""
from __future__ import annotations

import functools

import numpy as np

#: keys a merge lane holds: a query's list and candidates together at most 32 x this many
MERGE_PER_LANE = 24
#: ``pack(inf, -1)``: an empty slot
NONE_KEY = np.uint64((0x7F800000 << 32) | 0xFFFFFFFF)

_SRC = r"""
#define TP 128
#define PER MERGE_PER_LANE
#define NONE_KEY 0x7F800000FFFFFFFFULL
extern "C" __global__ void graph_pair_keys(const float* __restrict__ X, long long n, const float* __restrict__ Q,
        const long long* __restrict__ cand, long long npairs, int C, int d, unsigned long long* __restrict__ keys) {
    __shared__ float tile[TP][33];
    __shared__ long long rid[TP];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const long long p0 = (long long)blockIdx.x * TP, p = p0 + t;
    long long b = -1;
    if (p < npairs) { b = cand[p]; if (b < 0 || b >= n) b = -1; }
    rid[t] = b;
    const float* q = Q + (p < npairs ? (p / C) : 0) * (long long)d;
    float acc = 0.0f;
    __syncthreads();
    for (int c0 = 0; c0 < d; c0 += 32) {
        const int w = min(32, d - c0);
        for (int i = 0; i < 32; ++i) {  // this warp's 32 pairs: a row slice per load
            const int pr = warp * 32 + i;
            const long long r = rid[pr];
            if (r >= 0 && lane < w) tile[pr][lane] = X[r * (long long)d + c0 + lane];
        }
        __syncthreads();
        if (b >= 0) {
            for (int j = 0; j < w; ++j) {
                float u = __fsub_rn(q[c0 + j], tile[t][j]);
                acc = __fadd_rn(acc, __fmul_rn(u, u));
            }
        }
        __syncthreads();
    }
    if (p < npairs) {
        keys[p] = b < 0 ? NONE_KEY
                        : (((unsigned long long)__float_as_uint(acc)) << 32) | (unsigned long long)(b & 0xFFFFFFFFLL);
    }
}

extern "C" __global__ void graph_merge(const unsigned long long* __restrict__ old, int kk,
        const unsigned long long* __restrict__ add, int C, long long m, unsigned long long* __restrict__ out) {
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= m) return;
    unsigned long long v[PER];
    const int tot = kk + C;
#pragma unroll
    for (int s = 0; s < PER; ++s) {
        const int j = s * 32 + lane;
        v[s] = j < kk ? old[w * kk + j] : (j < tot ? add[w * (long long)C + (j - kk)] : 0xFFFFFFFFFFFFFFFFULL);
    }
    for (int r = 0; r < kk; ++r) {
        unsigned long long mn = v[0];
#pragma unroll
        for (int s = 1; s < PER; ++s) mn = v[s] < mn ? v[s] : mn;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            unsigned long long x = __shfl_xor_sync(0xFFFFFFFFu, mn, o);
            mn = x < mn ? x : mn;
        }
        if (mn == 0xFFFFFFFFFFFFFFFFULL) mn = NONE_KEY;  // fewer distinct keys than kk
        if (lane == 0) out[w * kk + r] = mn;
#pragma unroll
        for (int s = 0; s < PER; ++s) if (v[s] == mn) v[s] = 0xFFFFFFFFFFFFFFFFULL;
    }
}
"""


@functools.cache
def _module():
    import cupy as cp

    return cp.RawModule(code=_SRC.replace("MERGE_PER_LANE", str(MERGE_PER_LANE)), options=("--std=c++14",))


def fits(kk: int) -> bool:
    """Whether :func:`merge` takes lists of ``kk`` keys (any number of candidates: they go through
    the kernel in slices of at least as many as the list holds)."""
    return 2 * int(kk) <= 32 * MERGE_PER_LANE


def pair_keys(X, Q, cand):
    """uint64 keys (canonical distance bits << 32 | id) of ``Q[r]`` against ``X[cand[r, c]]``
    ((M, C) int64; an id outside ``[0, N)`` gives :data:`NONE_KEY`). ``X`` float32 (N, d)."""
    import cupy as cp

    m, c = cand.shape
    keys = cp.empty((m, c), cp.uint64)
    n = int(m) * int(c)
    if n:
        _module().get_function("graph_pair_keys")(
            ((n + 127) // 128,), (128,),
            (X, np.int64(X.shape[0]), Q, cp.ascontiguousarray(cand, dtype=cp.int64), np.int64(n), np.int32(c),
             np.int32(X.shape[1]), keys))
    return keys


def merge(old, add, kk: int):
    """The ``kk`` smallest distinct keys of each row of ``old`` ((M, kk) uint64, distinct) and
    ``add`` ((M, C) uint64), ascending; :data:`NONE_KEY` pads a row with fewer. A warp holds at
    most ``32 x MERGE_PER_LANE`` keys, so wider candidate lists are merged in slices, each into
    the list the one before left (the same keys: a key of a later slice already in the list is
    dropped there as it is within one slice)."""
    import cupy as cp

    m, c = add.shape
    width = 32 * MERGE_PER_LANE - int(kk)
    if not fits(kk):
        raise ValueError(f"graph_merge keeps at most {16 * MERGE_PER_LANE} keys a list, got {kk}")
    out = cp.ascontiguousarray(old)
    for c0 in range(0, max(int(c), 1), width):
        part = cp.ascontiguousarray(add[:, c0:c0 + width])
        nxt = cp.empty((m, kk), cp.uint64)
        if m:
            _module().get_function("graph_merge")(
                ((m * 32 + 127) // 128,), (128,),
                (out, np.int32(kk), part, np.int32(part.shape[1]), np.int64(m), nxt))
        out = nxt
    return out
