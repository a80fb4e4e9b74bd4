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

``graph_walk``: every round of a query's graph walk in one warp (:func:`walk`): the seeds
chosen, their neighbours scored and merged into the list in shared memory, with no round trip
through memory and no launch a round. The walk waits on its row loads: a lane loads
:data:`WALK_VEC` values of a row at once (float16 rows two: 128 bytes a row a warp load, which
took the walk from 4.99 to 3.42 ms at 10k SHOT queries on an H100), packed in the tile and widened
as they are summed.
"""
from __future__ import annotations

import functools

import numpy as np

#: keys a merge lane holds: a query's list and candidates together at most 32 x this many
MERGE_PER_LANE = 24
#: ``pack(inf, -1)``: an empty slot
NONE_KEY = np.uint64((0x7F800000 << 32) | 0xFFFFFFFF)

_SRC = r"""
// @@ROWS@@
#define TP 128
#define PER MERGE_PER_LANE
#define NONE_KEY 0x7F800000FFFFFFFFULL
extern "C" __global__ void graph_pair_keys(const RT* __restrict__ X, long long n, const float* __restrict__ Q,
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
            if (r >= 0 && lane < w) tile[pr][lane] = ldr(X[r * (long long)d + c0 + lane]);
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
// A query's whole walk in one warp: ``rounds`` rounds, each expanding the first ``e`` entries of its
// list not expanded before (flag F), the graph neighbours of each scored like graph_pair_keys (the
// rows in 32-wide slices through shared memory, each lane summing its own pair in dimension order)
// and merged into the list (ascending distinct keys, kk of them) by rank. A neighbour scored before
// (a lossy table of ids, WALK_HASH slots) is not scored again: it is in the list, or the list
// dropped or refused its key, and the list only gets smaller, so it would be refused again. A
// neighbour the table forgot is scored again and found in the list by its key (binary search).
// An entry's flag lost with its entry is never needed again (a dropped key never comes back).
#define HB WALK_HASH_BITS
#ifndef WALK_V
#define WALK_V 1
#endif
#if WALK_V == 1
#define WTB 4
#elif WALK_V == 2 && defined(ROWS_HALF)
#define WTB 4
typedef unsigned int WT;  // two halves, the first in the low bits
__device__ __forceinline__ float wval(WT v, int s) { return ldr((unsigned short)(v >> (16 * s))); }
#elif WALK_V == 4 && defined(ROWS_HALF)
#define WTB 8
typedef uint2 WT;
__device__ __forceinline__ float wval(WT v, int s) {
    return ldr((unsigned short)((s < 2 ? v.x : v.y) >> (16 * (s & 1))));
}
#elif WALK_V == 2
#define WTB 8
typedef float2 WT;
__device__ __forceinline__ float wval(WT v, int s) { return s ? v.y : v.x; }
#elif WALK_V != 1
#error WALK_V: 1, 2, or 4 on half rows
#endif
extern "C" __global__ void graph_walk(const RT* __restrict__ X, long long n, int d,
        const int* __restrict__ G, int deg, const float* __restrict__ Q, long long m,
        unsigned long long* __restrict__ keys, int kk, int e, int rounds, const long long* __restrict__ excl,
        int wpb, int per) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned FULL = 0xFFFFFFFFu, below = (1u << (threadIdx.x & 31)) - 1u;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long w = (long long)blockIdx.x * wpb + warp;
    if (w >= m) return;  // warps only sync among themselves
    unsigned char* base = smem + (size_t)warp * per;
    unsigned long long* A = (unsigned long long*)base;       // kk keys: the list
    unsigned long long* B = A + kk;                           // kk keys: the next list
    unsigned long long* NK = B + kk;                          // the new keys entering (at most 32)
    long long* C = (long long*)(NK + 32);                     // the candidates to score (at most 32)
    float* tile = (float*)(C + 32);                           // 32 x 33 words (WTB bytes each)
    int* H = (int*)((unsigned char*)tile + 32 * 33 * WTB);    // 1 << HB ids scored
    int* S = H + (1 << HB);                                   // e seeds
    unsigned char* F = (unsigned char*)(S + e);               // kk flags
    unsigned char* F2 = F + kk;                               // kk flags
    const long long ex = excl ? excl[w] : -2;
    const float* q = Q + w * (long long)d;  // read by every lane at once: one broadcast load
    for (int t = lane; t < (1 << HB); t += 32) H[t] = -1;
    __syncwarp();
    for (int t = lane; t < kk; t += 32) {
        const unsigned long long kv = keys[w * (long long)kk + t];
        A[t] = kv;
        const long long id = kv == NONE_KEY ? -1 : (long long)(kv & 0xFFFFFFFFULL);
        F[t] = (id < 0 || id == ex) ? 1 : 0;
        if (id >= 0) H[((unsigned)id * 2654435761u) >> (32 - HB)] = (int)id;
    }
    __syncwarp();
    for (int r = 0; r < rounds; ++r) {
        int ns = 0;
        for (int b0 = 0; b0 < kk && ns < e; b0 += 32) {
            const int t = b0 + lane;
            const bool ok = t < kk && F[t] == 0;
            const unsigned bal = __ballot_sync(FULL, ok);
            const int before = __popc(bal & below);
            if (ok && ns + before < e) { S[ns + before] = (int)(A[t] & 0xFFFFFFFFULL); F[t] = 1; }
            ns += __popc(bal);
        }
        ns = ns < e ? ns : e;
        __syncwarp();
        if (ns == 0) break;
        for (int j = 0; j < ns; ++j) {
            const long long sid = S[j];
            for (int c0 = 0; c0 < deg; c0 += 32) {
                long long cid = -1;
                if (c0 + lane < deg) cid = G[sid * deg + c0 + lane];
                if (cid >= n) cid = -1;
                // an id twice in one graph row (a graph not built here) is scored once: two lanes entering
                // the same key would leave a slot of the next list unwritten
                if (__match_any_sync(FULL, cid) & below) cid = -1;
                if (cid >= 0) {
                    const unsigned h = ((unsigned)cid * 2654435761u) >> (32 - HB);
                    if (H[h] == (int)cid) cid = -1; else H[h] = (int)cid;
                }
                const unsigned sb = __ballot_sync(FULL, cid >= 0);
                if (sb == 0u) continue;
                const int nsc = __popc(sb);
                if (cid >= 0) C[__popc(sb & below)] = cid;
                __syncwarp();
                const long long my = lane < nsc ? C[lane] : -1;
                float acc = 0.0f;
#if WALK_V == 1
                for (int a = 0; a < d; a += 32) {
                    const int wd = min(32, d - a);
                    // a fixed, unrolled count: the 32 loads go out before the first store waits on one
                    // (a loop over the nsc candidates waited for each row in turn: 0.6x)
#pragma unroll
                    for (int i = 0; i < 32; ++i) {
                        const long long rr = __shfl_sync(FULL, my, i);
                        if (rr >= 0 && lane < wd) tile[i * 33 + lane] = ldr(X[rr * (long long)d + a + lane]);
                    }
                    __syncwarp();
                    if (lane < nsc) {
                        for (int jj = 0; jj < wd; ++jj) {
                            const float u = __fsub_rn(q[a + jj], tile[lane * 33 + jj]);
                            acc = __fadd_rn(acc, __fmul_rn(u, u));
                        }
                    }
                    __syncwarp();
                }
#else
                // WALK_V values of a row a lane a load (a word WT: 128 or 256 bytes a row a warp load),
                // kept packed in the tile and widened as they are summed, still in dimension order
                const WT* XW = reinterpret_cast<const WT*>(X);
                WT* TW = reinterpret_cast<WT*>(tile);
                const long long dw = d / WALK_V;
                for (int a = 0; a < dw; a += 32) {
                    const int ww = min(32, (int)(dw - a));
#pragma unroll
                    for (int i = 0; i < 32; ++i) {
                        const long long rr = __shfl_sync(FULL, my, i);
                        if (rr >= 0 && lane < ww) TW[i * 33 + lane] = XW[rr * dw + a + lane];
                    }
                    __syncwarp();
                    if (lane < nsc) {
                        const float* qa = q + (long long)a * WALK_V;
                        for (int jw = 0; jw < ww; ++jw) {
                            const WT v = TW[lane * 33 + jw];
#pragma unroll
                            for (int s = 0; s < WALK_V; ++s) {
                                const float u = __fsub_rn(qa[jw * WALK_V + s], wval(v, s));
                                acc = __fadd_rn(acc, __fmul_rn(u, u));
                            }
                        }
                    }
                    __syncwarp();
                }
#endif
                const unsigned long long key = my < 0 ? NONE_KEY
                    : (((unsigned long long)__float_as_uint(acc)) << 32) | (unsigned long long)(my & 0xFFFFFFFFLL);
                bool live = false;
                int rl = 0;
                if (my >= 0 && key < A[kk - 1]) {  // its rank in the list, and whether the list holds it
                    int lo = 0, hi = kk;
                    while (lo < hi) { const int mid = (lo + hi) >> 1; if (A[mid] < key) lo = mid + 1; else hi = mid; }
                    rl = lo;
                    live = A[lo] != key;
                }
                const unsigned lb = __ballot_sync(FULL, live);
                if (lb == 0u) continue;
                const int nl = __popc(lb);
                if (live) NK[__popc(lb & below)] = key;
                __syncwarp();
                for (int t = lane; t < kk; t += 32) {  // each list entry moves down by the new keys below it
                    const unsigned long long kv = A[t];
                    int c = 0;
                    for (int i = 0; i < nl; ++i) c += NK[i] < kv;
                    if (t + c < kk) { B[t + c] = kv; F2[t + c] = F[t]; }
                }
                if (live) {
                    int pos = rl;
                    for (int i = 0; i < nl; ++i) pos += NK[i] < key;
                    if (pos < kk) { B[pos] = key; F2[pos] = (my == ex) ? 1 : 0; }
                }
                __syncwarp();
                unsigned long long* T = A; A = B; B = T;
                unsigned char* U = F; F = F2; F2 = U;
            }
        }
    }
    for (int t = lane; t < kk; t += 32) keys[w * (long long)kk + t] = A[t];
}
"""


@functools.cache
def _module(half: bool = False, vec: int = 1):
    """The kernels over float32 rows, or float16 ones (``half``: widened exactly as they are read,
    so a distance is the float32 one of the widened row, bit for bit); the walk loading ``vec``
    values of a row a lane (:data:`WALK_VEC`)."""
    import cupy as cp

    from .bruteforce import _half_rows

    src = (_SRC.replace("// @@ROWS@@", _half_rows("ROWS_HALF", "RT", "ldr"))
           .replace("MERGE_PER_LANE", str(MERGE_PER_LANE)).replace("WALK_HASH_BITS", str(WALK_HASH_BITS)))
    return cp.RawModule(code=src, options=("--std=c++14", f"-DWALK_V={int(vec)}") + (("-DROWS_HALF",) if half else ()))


def _rows(X):
    """``X`` as the kernels take it (C-contiguous float32, or float16 kept as it is) and whether half."""
    import cupy as cp

    half = X.dtype == cp.float16
    return cp.ascontiguousarray(X, dtype=cp.float16 if half else cp.float32), bool(half)


#: warps (queries) a block of :func:`walk` runs at most, and the shared memory it may take
WALK_WARPS, WALK_SHARED = 4, 48 * 1024
#: the walk's table of ids scored a query (a power of two): 256 slots, 1 KiB of shared memory a warp
#: (the walk waits on its row loads: shared memory a warp takes is occupancy lost)
WALK_HASH_BITS = 8
#: values of a row each lane of the walk loads at once, by row type (float16 rows: ``True``), where
#: the row length divides by it: a warp's load of a row is 32 x this many values (float32 x 2 or
#: float16 x 2: 256 / 128 bytes), the tile's words that many values
WALK_VEC = {False: 1, True: 2}


def _word_bytes(half: bool, vec: int) -> int:
    return 4 if vec == 1 or (half and vec == 2) else 8


def _walk_bytes(kk: int, e: int, wb: int = 8) -> int:
    """Shared memory of one warp of ``graph_walk`` (its layout there, a tile of ``wb``-byte
    words), 16-byte aligned."""
    b = 8 * (2 * kk + 64) + wb * 32 * 33 + 4 * ((1 << WALK_HASH_BITS) + e) + 2 * kk
    return (b + 15) // 16 * 16


def walk_fits(kk: int, e: int) -> bool:
    """Whether :func:`walk` takes lists of ``kk`` keys and ``e`` seeds a round (at any word size)."""
    return _walk_bytes(kk, e) <= WALK_SHARED


def walk(X, Q, G, keys, e: int, rounds: int, exclude=None, vec: int | None = None):
    """``rounds`` graph rounds of every query in one kernel (a warp each): each round the graph
    neighbours (``G`` (N, D) int32, -1: none) of the first ``e`` entries of the list not
    expanded in an earlier round (nor ``exclude[r]``) are scored with the canonical distance and
    merged into the list. ``keys``: (M, kk) uint64 lists, ascending and distinct
    (:func:`scanforest.kernels.knn.topk.pack`); the walked lists come back, the same shape: the
    answer of :meth:`~scanforest.kernels.knn.kdforest.KDForest._expand` round after round."""
    import cupy as cp

    m, kk = keys.shape
    n, d = X.shape
    out = cp.array(keys, dtype=cp.uint64, order="C", copy=True)
    if not m or not rounds or not e:
        return out
    X, half = _rows(X)
    vec = int(WALK_VEC[half] if vec is None else vec)
    if vec not in ((1, 2, 4) if half else (1, 2)) or d % vec or X.data.ptr % _word_bytes(half, vec):
        vec = 1  # a row length the width does not divide, or rows not aligned to its words
    per = _walk_bytes(kk, e, _word_bytes(half, vec))
    wpb = max(1, min(WALK_WARPS, WALK_SHARED // per))
    ex = None if exclude is None else cp.ascontiguousarray(exclude, dtype=cp.int64)
    _module(half, vec).get_function("graph_walk")(
        ((m + wpb - 1) // wpb,), (32 * wpb,),
        (X, np.int64(n), np.int32(d), cp.ascontiguousarray(G, dtype=cp.int32),
         np.int32(G.shape[1]), cp.ascontiguousarray(Q, dtype=cp.float32), np.int64(m), out, np.int32(kk), np.int32(e),
         np.int32(rounds), ex if ex is not None else np.uint64(0), np.int32(wpb), np.int32(per)),
        shared_mem=per * wpb)
    return out


def fits(kk: int) -> bool:
    """Whether :func:`merge` takes lists of ``kk`` keys (any number of candidates: they go through
    the kernel in slices of at least as many as the list holds)."""
    return 2 * int(kk) <= 32 * MERGE_PER_LANE


def pair_keys(X, Q, cand):
    """uint64 keys (canonical distance bits << 32 | id) of ``Q[r]`` against ``X[cand[r, c]]``
    ((M, C) int64; an id outside ``[0, N)`` gives :data:`NONE_KEY`). ``X`` float32 or float16
    (N, d), ``Q`` float32."""
    import cupy as cp

    m, c = cand.shape
    keys = cp.empty((m, c), cp.uint64)
    n = int(m) * int(c)
    if n:
        X, half = _rows(X)
        _module(half).get_function("graph_pair_keys")(
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
