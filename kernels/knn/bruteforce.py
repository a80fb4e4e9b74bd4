"""Exact k-nearest neighbours by brute force (squared L2), CPU and GPU backends.

Semantics shared by every neighbour search in scanforest (brute force, P-ANNS, P-BANNS):

* the distance is the *canonical* float32 squared L2 distance, summed in dimension order
  ``acc = acc + (q[j] - x[j])**2`` with correctly rounded float32 operations and no fused
  multiply-add, so the CPU (numba) and GPU (CUDA ``__fadd_rn``/``__fmul_rn``) backends give
  bit-identical distances;
* rows are sorted ascending by ``(distance, id)`` (ties broken by the smaller id).

The brute force runs in two passes. A coarse pass computes ``||q||^2 - 2 q.b + ||b||^2`` with a
float32 GEMM (BLAS on the CPU, cuBLAS on the GPU) on mean-centred data, per query block and base
block, and keeps a candidate superset of ``k' = 2k + 16`` per query (a per-tile top-k' merged
across tiles; on the GPU a fused warp-select kernel). The candidates are re-ranked with the
canonical distance. A rigorous float32 rounding-error bound then checks that no point outside
the candidate set can enter the top k; for the queries where the check fails (near ties, many
duplicates) every point whose coarse distance lies within the bound is re-ranked as well, so
the result is exact.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import numpy as np

from ..jit import njit, prange
from .. import validation
from ..backend import blas_one_thread, free_memory, is_cupy, resolve_device, to_numpy, xp_for
from ..errors import InputError
from ..neighbors.search_cpu import insert_sorted as _insert  # the ascending (distance, id) lists

__all__ = ["knn_bruteforce", "ExactSearch", "pair_distances", "recall", "check_points", "MAX_K"]

MAX_K = 256
_U = 2.0 ** -24
# a centred copy of the base is made when it takes at most this share of the free memory
# (available host memory, free GPU memory); otherwise tiles are centred as they are used
_COPY_SHARE = {"cpu": 0.25, "gpu": 0.5}
# an ExactSearch keeps its centred copy for its lifetime: only when it takes at most this share
_KEEP_SHARE = {"cpu": 0.05, "gpu": 0.1}


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def check_points(a, name: str, *, dim: int | None = None, xp=None, keep_half: bool = False):
    """:func:`scanforest.kernels.validation.points` for the knn family: any number of dimensions,
    C-contiguous float32 (float16 kept with ``keep_half``, as the GPU brute force reads half
    rows), and a query set of the wrong width is told the ``dim`` the index was built on."""
    if not hasattr(a, "shape"):
        a = np.asarray(a)
    if dim is not None and a.ndim == 2 and a.shape[0] and a.shape[1] != dim:
        raise InputError(f"{name} has {a.shape[1]} dimensions but the index was built on {dim}-D points")
    return validation.points(a, name, dims=None, xp=xp, keep_half=keep_half)


def check_k(k, n: int, *, max_k: int = MAX_K) -> int:
    """Validate the number of neighbours ``k`` against the size ``n`` of the indexed set."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise InputError(f"k must be an integer, got {k!r}")
    k = int(k)
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    if k > n:
        raise InputError(f"k={k} is larger than the number of indexed points ({n})")
    if k > max_k:
        raise InputError(f"k={k} is above the supported maximum of {max_k}")
    return k


# ----------------------------------------------------------------------------------------------
# CPU kernels (numba)
# ----------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _sqdist(q, x):
    acc = np.float32(0.0)
    for j in range(q.shape[0]):
        t = q[j] - x[j]
        acc += t * t
    return acc


@njit(cache=True, inline="always")
def _sqdist4(q, x0, x1, x2, x3):
    """:func:`_sqdist` of four rows at once: four independent sums, each in dimension order (the
    same bits as four calls), so the additions overlap instead of waiting on one another."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for j in range(q.shape[0]):
        qj = q[j]
        t0 = qj - x0[j]
        t1 = qj - x1[j]
        t2 = qj - x2[j]
        t3 = qj - x3[j]
        a0 += t0 * t0
        a1 += t1 * t1
        a2 += t2 * t2
        a3 += t3 * t3
    return a0, a1, a2, a3


@njit(cache=True, parallel=True)
def _select_coarse_cpu(G, qn, bn, b0, cand_d, cand_i, cnt):
    """Merge one GEMM tile into each query's ascending list of its ``kc`` smallest coarse
    distances: coarse = max((-2 G) + qn + bn, 0), in float32 as the tile math of the GPU path;
    ties by the smaller id. ``cnt`` holds each list's fill (updated)."""
    m, nb = G.shape
    kc = cand_d.shape[1]
    m2 = np.float32(-2.0)
    zero = np.float32(0.0)
    for r in prange(m):
        dist = cand_d[r]
        ids = cand_i[r]
        c = cnt[r]
        q = qn[r]
        for j in range(nb):
            v = m2 * G[r, j] + q + bn[b0 + j]
            if v < zero:
                v = zero
            if c == kc and v >= dist[kc - 1]:
                continue  # the common case: not among the kc smallest (ties keep the smaller id)
            c = _insert(dist, ids, c, kc, v, b0 + j)
        cnt[r] = c


@njit(cache=True, parallel=True)
def _rerank_cpu(base, queries, cand, k, out_d, out_i, idm):
    """Canonical distances of candidate rows (-1 = none) -> sorted top k per query, as ids
    ``idm[row]`` (the row itself when ``idm`` is empty), ties by the smaller id."""
    m, c = cand.shape
    mapped = idm.shape[0] > 0
    for qi in prange(m):
        dist = np.empty(k, np.float32)
        ids = np.empty(k, np.int64)
        cnt = 0
        q = queries[qi]
        for j in range(c):
            b = cand[qi, j]
            if b < 0:
                continue
            cnt = _insert(dist, ids, cnt, k, _sqdist(q, base[b]), idm[b] if mapped else b)
        for j in range(k):
            if j < cnt:
                out_d[qi, j] = dist[j]
                out_i[qi, j] = ids[j]
            else:
                out_d[qi, j] = np.inf
                out_i[qi, j] = -1


@njit(cache=True, parallel=True)
def _rerank_pairs_cpu(base, queries, starts, cols, k, out_d, out_i, idm):
    """Like _rerank_cpu for a CSR list of candidates: row r holds cols[starts[r]:starts[r+1]]."""
    m = starts.shape[0] - 1
    mapped = idm.shape[0] > 0
    for qi in prange(m):
        dist = np.empty(k, np.float32)
        ids = np.empty(k, np.int64)
        cnt = 0
        q = queries[qi]
        for j in range(starts[qi], starts[qi + 1]):
            b = cols[j]
            cnt = _insert(dist, ids, cnt, k, _sqdist(q, base[b]), idm[b] if mapped else b)
        for j in range(k):
            out_d[qi, j] = dist[j] if j < cnt else np.inf
            out_i[qi, j] = ids[j] if j < cnt else -1


@njit(cache=True, parallel=True)
def exact_scan_ids(base, ids_of, queries, k):
    """Exact scan with the canonical distance (O(M N d)), ties by id: row ``b`` of ``base`` has
    id ``ids_of[b]`` (an empty ``ids_of``: its row index). The one exact scan of the CPU backend:
    the brute force's reference and the KD-tree's fallback for overflowing queues."""
    m = queries.shape[0]
    mapped = ids_of.shape[0] > 0
    out_d = np.empty((m, k), np.float32)
    out_i = np.empty((m, k), np.int64)
    for qi in prange(m):
        dist = np.empty(k, np.float32)
        ids = np.empty(k, np.int64)
        cnt = 0
        q = queries[qi]
        for b in range(base.shape[0]):
            cnt = _insert(dist, ids, cnt, k, _sqdist(q, base[b]), ids_of[b] if mapped else b)
        for j in range(k):
            out_d[qi, j] = dist[j]
            out_i[qi, j] = ids[j]
    return out_d, out_i


def exact_scan_cpu(base, queries, k):
    """Reference exact scan with the canonical distance (O(M N d)), ids = row indices; used for
    small inputs and as the tests' reference."""
    return exact_scan_ids(base, np.empty(0, np.int64), queries, k)


# ----------------------------------------------------------------------------------------------
# GPU kernels (CUDA source, compiled lazily)
# ----------------------------------------------------------------------------------------------
_CUDA_COMMON = r"""
#define KEY_NONE 0xffffffffffffffffULL
__device__ __forceinline__ unsigned long long make_key(float d, long long id) {
    d = d > 0.0f ? d : 0.0f;
    return ((unsigned long long)__float_as_uint(d) << 32) | (unsigned long long)(unsigned int)id;
}
__device__ __forceinline__ float key_dist(unsigned long long k) {
    return k == KEY_NONE ? __int_as_float(0x7f800000) : __uint_as_float((unsigned int)(k >> 32));
}
__device__ __forceinline__ float canon_dist(const float* __restrict__ q, const float* __restrict__ x, int d) {
    float acc = 0.0f;
    for (int j = 0; j < d; ++j) {
        float t = __fsub_rn(q[j], x[j]);
        acc = __fadd_rn(acc, __fmul_rn(t, t));
    }
    return acc;
}
"""


def _half_rows(macro: str, row_t: str, load: str) -> str:
    """CUDA source for rows of ``float``, or of IEEE half (when ``macro`` is defined) widened
    exactly to float in registers: type ``row_t`` and loader ``load``, so a distance over half
    rows is the float one of the widened rows, bit for bit (half the bytes read)."""
    return rf"""
#ifdef {macro}
typedef unsigned short {row_t};
__device__ __forceinline__ float {load}(unsigned short h) {{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}}
#else
typedef float {row_t};
__device__ __forceinline__ float {load}(float x) {{ return x; }}
#endif
"""

_SELECT_SRC = _CUDA_COMMON + r"""
// One warp per row: every lane keeps a sorted list of its KP best keys, then the 32 lists are
// merged with KP rounds of a warp-wide min.  mode 0: d = D[r, c]; mode 1: d = qn[r] + bn[c] - 2 D[r, c].
__device__ __forceinline__ void lane_push(unsigned long long* list, int& cnt, int kp, unsigned long long key) {
    int pos;
    if (cnt == kp) {
        if (key >= list[kp - 1]) return;
        pos = kp - 1;
    } else {
        pos = cnt++;
    }
    while (pos > 0 && list[pos - 1] > key) { list[pos] = list[pos - 1]; --pos; }
    list[pos] = key;
}
extern "C" __global__ void select_topk(const float* __restrict__ D, long long ldd, int nrows, int ncols,
        const float* __restrict__ qn, const float* __restrict__ bn, int mode, long long col_offset,
        const unsigned long long* __restrict__ prev, int kp, unsigned long long* __restrict__ out) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= nrows) return;
    unsigned long long list[KMAX];
    int cnt = 0;
    if (prev != NULL) {
        for (int i = lane; i < kp; i += 32) {
            unsigned long long key = prev[(long long)row * kp + i];
            if (key != KEY_NONE) lane_push(list, cnt, kp, key);
        }
    }
    const float* Drow = D + (long long)row * ldd;
    float qv = mode ? qn[row] : 0.0f;
    // thr: the kp-th best key of the union of the lane lists (keys are distinct: they carry the
    // column), so a key at or above it is not among the row's kp best and most of the row is
    // rejected against it. It is merged exactly (kp rounds of a warp-wide min over the sorted
    // lists) after each of the first 8 chunks, then after every 8th: between merges it is stale
    // but still an upper bound. A lane-local threshold (its own kp-th best) lets about 32 kp
    // keys per row through and each costs an insertion; the exact one lets about kp ln(n / kp).
    // Each lane's 8 columns of a chunk are loaded before any is used (8 loads in flight).
    unsigned long long thr = KEY_NONE;
    int chunk = 0;
    for (int c0 = 0; c0 < ncols; c0 += 32 * 8, ++chunk) {
        float gv[8], bv[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int c = c0 + 32 * u + lane;
            gv[u] = c < ncols ? Drow[c] : 0.0f;
            bv[u] = (mode && c < ncols) ? bn[c] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int c = c0 + 32 * u + lane;
            if (c >= ncols) break;
            float d = mode ? (qv + bv[u]) - 2.0f * gv[u] : gv[u];
            unsigned long long key = make_key(d, col_offset + c);
            if (key < thr && (cnt < kp || key < list[kp - 1])) lane_push(list, cnt, kp, key);
        }
        if (chunk < 8 || (chunk & 7) == 7) {
            int h = 0, r = 0;
            unsigned long long kth = KEY_NONE;
            for (; r < kp; ++r) {
                unsigned long long mine = h < cnt ? list[h] : KEY_NONE;
                unsigned long long best = mine;
                for (int off = 16; off > 0; off >>= 1) {
                    unsigned long long o = __shfl_xor_sync(0xffffffffu, best, off);
                    best = o < best ? o : best;
                }
                if (best == KEY_NONE) break;  // fewer than kp keys so far
                if (mine == best) ++h;
                kth = best;
            }
            if (r == kp) thr = kth;
        }
    }
    int h = 0;
    for (int r = 0; r < kp; ++r) {
        unsigned long long mine = h < cnt ? list[h] : KEY_NONE;
        unsigned long long best = mine;
        for (int off = 16; off > 0; off >>= 1) {
            unsigned long long o = __shfl_xor_sync(0xffffffffu, best, off);
            best = o < best ? o : best;
        }
        if (best != KEY_NONE && mine == best) ++h;
        if (lane == 0) out[(long long)row * kp + r] = best;
    }
}
"""

_PAIR_SRC = _CUDA_COMMON + _half_rows("BASE_HALF", "BT", "ldb") + r"""
// base rows: float, or IEEE half (BASE_HALF): see _half_rows
// canonical distance of (query row qi[t], base row bi[t]); bi < 0 gives +inf
extern "C" __global__ void pair_dist(const BT* __restrict__ X, const float* __restrict__ Q,
        const long long* __restrict__ qi, const long long* __restrict__ bi, long long npairs, int d,
        float* __restrict__ out) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= npairs) return;
    long long b = bi[t];
    if (b < 0) { out[t] = __int_as_float(0x7f800000); return; }
    const float* q = Q + qi[t] * (long long)d;
    const BT* x = X + b * (long long)d;
    float acc = 0.0f;
    for (int j = 0; j < d; ++j) {
        float u = __fsub_rn(q[j], ldb(x[j]));
        acc = __fadd_rn(acc, __fmul_rn(u, u));
    }
    out[t] = acc;
}
"""


@functools.lru_cache(maxsize=None)
def _select_kernel(kmax: int):
    import cupy as cp

    return cp.RawKernel(_SELECT_SRC.replace("KMAX", str(kmax)), "select_topk")


@functools.lru_cache(maxsize=None)
def _pair_kernel(half: bool = False):
    import cupy as cp

    return cp.RawKernel(_PAIR_SRC, "pair_dist", options=("-DBASE_HALF",) if half else ())


def _select_gpu(D, k, *, qn=None, bn=None, col_offset=0, prev=None):
    """Per-row top-k (k <= 1024) keys of a distance (mode 0) or dot-product (mode 1) tile."""
    import cupy as cp

    nrows, ncols = D.shape
    kmax = max(8, 1 << (int(k) - 1).bit_length())
    out = cp.empty((nrows, k), dtype=cp.uint64)
    mode = 0 if qn is None else 1
    dummy = cp.empty(1, dtype=cp.float32)
    threads = 128
    grid = (nrows * 32 + threads - 1) // threads
    _select_kernel(kmax)((grid,), (threads,), (
        D, np.int64(D.strides[0] // 4), np.int32(nrows), np.int32(ncols),
        dummy if qn is None else qn, dummy if bn is None else bn, np.int32(mode),
        np.int64(col_offset), prev if prev is not None else np.uint64(0), np.int32(k), out))
    return out


def decode_keys(keys):
    """Split uint64 (dist_bits << 32 | id) keys into float32 distances and int64 ids."""
    xp = np
    if is_cupy(keys):
        import cupy as xp
    none = keys == np.uint64(0xFFFFFFFFFFFFFFFF)
    d = (keys >> np.uint64(32)).astype(xp.uint32).view(xp.float32)
    i = (keys & np.uint64(0xFFFFFFFF)).astype(xp.int64)
    d = xp.where(none, xp.float32(np.inf), d)
    i = xp.where(none, -1, i)
    return d, i


def pair_dist_gpu(base, queries, qi, bi):
    """Canonical distances of (queries[qi], base[bi]) pairs on the GPU (bi < 0 -> inf)."""
    import cupy as cp

    qi = cp.ascontiguousarray(qi, dtype=cp.int64).ravel()
    bi = cp.ascontiguousarray(bi, dtype=cp.int64).ravel()
    out = cp.empty(qi.size, dtype=cp.float32)
    if qi.size:
        _pair_kernel(base.dtype == cp.float16)(((qi.size + 255) // 256,), (256,),
                       (base, queries, qi, bi, np.int64(qi.size), np.int32(base.shape[1]), out))
    return out


def topk_keys_rows(keys, k):
    """Sorted top-k (ascending) of each row of a uint64 key matrix."""
    import cupy as cp

    s = cp.sort(keys, axis=1)
    return s[:, :k]


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def _gamma(d: int) -> float:
    n = d + 8
    return n * _U / (1.0 - n * _U)


def _blocks(n_rows: int, n_base: int, d: int, budget_bytes: int, block):
    """(query_block, base_block) sizes whose coarse tile fits in ``budget_bytes``."""
    if block is not None:
        if isinstance(block, (tuple, list)):
            qb, bb = int(block[0]), int(block[1])
        else:
            qb, bb = int(block), n_base
        if qb < 1 or bb < 1:
            raise InputError(f"block sizes must be >= 1, got {block!r}")
        return max(1, min(qb, n_rows)), max(1, min(bb, n_base))
    bb = min(n_base, 1 << 18)
    qb = max(1, min(n_rows, budget_bytes // (4 * bb)))
    if qb < 256 and bb > 4096:
        bb = max(4096, budget_bytes // (4 * 256))
        bb = min(bb, n_base)
        qb = max(1, min(n_rows, budget_bytes // (4 * bb)))
    return qb, bb


def _placed(base, queries, device):
    """``(device, array module, converter, base, queries)``: both validated on the device the
    inputs or ``device`` choose (a float16 base stays float16 on a GPU)."""
    dev = resolve_device(device, base, queries)
    xp, conv, base = _placed_base(base, dev)
    queries = check_points(conv(queries), "queries", dim=base.shape[1], xp=xp)
    return dev, xp, conv, base, queries


def _placed_base(base, dev: str):
    """``(array module, converter, base)``: the base validated on ``dev`` (a float16 base stays
    float16 on a GPU)."""
    xp = np
    if dev == "gpu":
        import cupy as xp
    conv = to_numpy if dev == "cpu" else xp.asarray
    return xp, conv, check_points(conv(base), "base", xp=xp, keep_half=dev == "gpu")


def knn_bruteforce(base, queries, k: int, *, device: str = "auto", block=None, ids=None):
    """Exact k nearest neighbours of every query in ``base`` (squared L2).

    Parameters
    ----------
    base : (N, d) array_like
        Indexed points (numpy or CuPy; converted to float32). A float16 CuPy array stays float16
        on the GPU (half the memory of its float32 widening) and gives that widening's answer,
        bit for bit: every row is widened exactly where it is read.
    queries : (M, d) array_like
        Query points.
    k : int
        Neighbours per query, ``1 <= k <= min(N, 256)``.
    device : {"auto", "cpu", "gpu"}, keyword-only
        ``auto`` follows the array type of the inputs.
    block : int or (int, int), optional, keyword-only
        Query block (and base block) size of the coarse GEMM tiles; by default sized to fit a
        tile budget (512 MiB on the CPU, 2 GiB on the GPU).
    ids : (N,) int array, optional, keyword-only
        The id of each base row, returned instead of the row index and used to break ties
        (e.g. a KD-tree's leaf-ordered rows with its permutation: the answer is then the one on
        the rows in input order). Distinct, ``0 <= id < 2**32``.

    Notes
    -----
    The coarse pass works on mean-centred rows. A centred copy of ``base`` is made when it fits
    (half the free GPU memory, a quarter of the available host memory); otherwise each base
    tile is centred as it is used, so the search needs no more memory than ``base`` itself plus
    the tiles.

    Returns
    -------
    dist2 : (M, k) float32
        Canonical squared distances, ascending.
    ids : (M, k) int64
        Row indices into ``base`` (or ``ids`` of them); ties broken by the smaller id.
    """
    dev, xp, conv, base, queries = _placed(base, queries, device)
    k = check_k(k, base.shape[0])
    ids = _checked_ids(ids, base.shape[0], xp, conv)
    return _search(_BaseStats(base, dev, _COPY_SHARE), queries, k, block, ids)


class ExactSearch:
    """:func:`knn_bruteforce` over fixed rows, prepared once for many query batches.

    The coarse pass needs the base's mean, its mean-centred copy and its row norms; a search
    that queries the same rows again and again (a model library matched scene after scene)
    computes them once here instead of at every call. ``search`` gives what
    :func:`knn_bruteforce` gives for the same base, bit for bit. The centred copy is kept only
    while it takes a small share of the free memory (10% on a GPU, 5% of the host's); a larger
    base is centred tile by tile at each search, as :func:`knn_bruteforce` does when short of
    memory.

    Parameters
    ----------
    base : (N, d) array_like
        As :func:`knn_bruteforce`'s (its device, unless ``device`` names one).
    device : {"auto", "cpu", "gpu"}, keyword-only
    """

    def __init__(self, base, *, device: str = "auto"):
        dev = resolve_device(device, base)
        self.device = dev
        self._xp, self._conv, self.base = _placed_base(base, dev)
        self._stats = _BaseStats(self.base, dev, _KEEP_SHARE)

    def __getstate__(self):  # its rows and device; the prepared statistics are made again
        return {"base": self.base, "device": self.device}

    def __setstate__(self, state):
        self.__init__(state["base"], device=state["device"])

    def search(self, queries, k: int, *, block=None, ids=None):
        """Exact ``k`` nearest rows of every query: ``(dist2 (M, k) float32, ids (M, k) int64)``,
        as :func:`knn_bruteforce` (``block`` and ``ids`` too)."""
        queries = check_points(self._conv(queries), "queries", dim=self.base.shape[1], xp=self._xp)
        k = check_k(k, self.base.shape[0])
        ids = _checked_ids(ids, self.base.shape[0], self._xp, self._conv)
        return _search(self._stats, queries, k, block, ids)


def _checked_ids(ids, n: int, xp, conv):
    if ids is None:
        return None
    ids = conv(ids)
    if ids.shape != (n,) or ids.dtype.kind not in "iu":
        raise InputError(f"ids must be ({n},) integers (one per base row), got {tuple(ids.shape)} {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 2 ** 32):
        raise InputError("ids must lie in [0, 2**32)")
    repeated = int(ids.size) - int(xp.unique(ids).size) if ids.size else 0  # ties are broken by id: one a row
    if repeated:
        raise InputError(f"ids must be distinct (one per base row): {repeated} repeated")
    return xp.ascontiguousarray(ids, dtype=xp.int64)


def _search(st: "_BaseStats", queries, k, block, ids):
    return (_bf_gpu if st.device == "gpu" else _bf_cpu)(st, queries, k, block, ids)


_WS_GRAIN = 1 << 22  # float32 elements (16 MiB): the coarse-tile buffers grow in these steps
_WS_KEEP = 2  # free coarse-tile buffers an ExactSearch keeps between searches (its largest)


class _CoarseBuffers:
    """Coarse-tile buffers kept between searches of one base (GPU), lent one per search.

    The tiles' sizes follow each batch's query count, so fresh ones left the memory pool a
    cached block of every size it had seen (a worker's pool held 7.15 GiB after 16 scenes).
    Kept per thread, they were made again for every Dask task of the one pass, each of which
    ends on a thread of its own (it secedes while its writes finish). So they are kept here, for
    any thread: a search borrows the smallest free buffer that is large enough (or makes one,
    in steps of :data:`_WS_GRAIN`), and gives it back with an event on its stream, which the next
    borrower's stream waits on before it writes there. Searches at once borrow different
    buffers; at most :data:`_WS_KEEP` free ones (the largest) are kept."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free: list = []  # (buffer, event recorded after its last use, or None)

    @contextlib.contextmanager
    def lend(self, need: int):
        import cupy as cp

        with self._lock:
            fits = [x for x in self._free if x[0].size >= need]
            item = min(fits, key=lambda x: x[0].size) if fits else None
            if item is not None:  # by identity: list.remove compares with ==, elementwise on CuPy arrays
                del self._free[next(i for i, x in enumerate(self._free) if x is item)]
        if item is None:
            buf = cp.empty(max(1, -(-need // _WS_GRAIN)) * _WS_GRAIN, cp.float32)
        else:
            buf, ev = item
            if ev is not None:
                cp.cuda.get_current_stream().wait_event(ev)
        try:
            yield buf
        finally:
            ev = cp.cuda.Event(block=False, disable_timing=True)
            ev.record()
            with self._lock:
                self._free.append((buf, ev))
                self._free.sort(key=lambda x: x[0].size)
                dropped = self._free[:-_WS_KEEP]
                del self._free[:-_WS_KEEP]
            for _, e in dropped:  # the pool hands a freed block to its own stream at once: its
                e.synchronize()  # last use, maybe on another stream, must be over first


class _BaseStats:
    """What the coarse pass needs of the base, computed once: its mean ``mu``, the centred
    tiles, the centred rows' squared norms ``bn`` and their maximum (the error bound's)."""

    def __init__(self, base, device: str, share: dict):
        self.base, self.device = base, device
        xp = xp_for(device)
        n, d = base.shape
        self.mu = base.mean(axis=0, dtype=xp.float64).astype(xp.float32)
        # the centred copy is float32 whatever the base (half rows are widened exactly by the
        # subtraction); without it each tile is centred as it is used
        self.tiles = _Tiles(base, self.mu, copy=n * d * 4 <= free_memory(device)[0] * share[device])
        self.bn = xp.empty(n, xp.float32)
        step = max(1, min(n, 1 << 18))
        for b0 in range(0, n, step):
            self.bn[b0:b0 + step] = _sqnorms(self.tiles(b0, step))
        self.bnmax = float(self.bn.max()) if n else 0.0
        self._ws = _CoarseBuffers()

    def coarse_buffer(self, rows: int, cols: int):
        """A float32 buffer of at least ``rows * cols`` elements for the coarse tiles of one
        search (GPU), lent by :class:`_CoarseBuffers` for the ``with`` block."""
        return self._ws.lend(rows * cols)


def _sqnorms(a):
    """Row squared norms, float32 (``einsum`` on the host; a row reduction on the device, where
    CuPy's ``einsum`` takes a slow path)."""
    if is_cupy(a):
        return (a * a).sum(axis=1, dtype=a.dtype)
    return np.einsum("ij,ij->i", a, a, dtype=np.float32)


class _Tiles:
    """Mean-centred tiles of ``base`` rows ``[b0, b0 + bb)``: views of one centred copy when
    ``copy``, else centred as they are asked for (no second copy of the base)."""

    def __init__(self, base, mu, copy: bool):
        self.base, self.mu = base, mu
        self.bc = base - mu if copy else None

    def __call__(self, b0: int, bb: int):
        if self.bc is not None:
            return self.bc[b0:b0 + bb]
        return self.base[b0:b0 + bb] - self.mu


def _candidates(k: int, n: int) -> int:
    return min(n, 2 * k + 16)


def _bf_cpu(st: _BaseStats, queries, k, block, ids=None):
    base, mu, tiles, bn, bnmax = st.base, st.mu, st.tiles, st.bn, st.bnmax
    n, d = base.shape
    m = queries.shape[0]
    kc = _candidates(k, n)
    idm = np.empty(0, np.int64) if ids is None else ids
    qb, bb = _blocks(m, n, d, 512 << 20, block)
    out_d = np.empty((m, k), np.float32)
    out_i = np.empty((m, k), np.int64)
    g = _gamma(d)
    with blas_one_thread(float(m) * n * d):  # small GEMMs: BLAS's spinning workers would slow numba's
        return _bf_cpu_blocks(base, mu, tiles, bn, bnmax, queries, k, kc, idm, qb, bb, g, out_d, out_i)


def _bf_cpu_blocks(base, mu, tiles, bn, bnmax, queries, k, kc, idm, qb, bb, g, out_d, out_i):
    n = base.shape[0]
    m = queries.shape[0]
    for q0 in range(0, m, qb):
        qs = queries[q0:q0 + qb]
        qc = qs - mu
        qn = np.einsum("ij,ij->i", qc, qc, dtype=np.float32)
        cand_d = np.empty((qs.shape[0], kc), np.float32)
        cand = np.empty((qs.shape[0], kc), np.int64)
        cnt = np.zeros(qs.shape[0], np.int32)
        for b0 in range(0, n, bb):
            # BLAS tile, then one fused parallel pass keeps each row's kc smallest coarse distances
            _select_coarse_cpu(qc @ tiles(b0, bb).T, qn, bn, b0, cand_d, cand, cnt)
        rd = np.empty((qs.shape[0], k), np.float32)
        ri = np.empty((qs.shape[0], k), np.int64)
        _rerank_cpu(base, qs, cand, k, rd, ri, idm)
        if kc < n:
            clast = cand_d[:, -1].astype(np.float64)  # lists are full (kc <= n) and ascending
            err = 4 * g * (qn.astype(np.float64) + bnmax) + 2 * g * rd[:, -1] + 1e-30
            bad = np.nonzero(~(rd[:, -1].astype(np.float64) + err < clast))[0]
            if bad.size:
                thr = rd[bad, -1].astype(np.float64) + err[bad]
                _fix_cpu(base, qs, bad, thr, mu, tiles, bn, bb, k, rd, ri, idm)
        out_d[q0:q0 + qb] = rd
        out_i[q0:q0 + qb] = ri
    return out_d, out_i


def _fix_cpu(base, qs, bad, thr, mu, tiles, bn, bb, k, rd, ri, idm):
    """Re-rank every point whose coarse distance is within the error bound (exact fallback)."""
    qc = qs[bad] - mu
    qn = np.einsum("ij,ij->i", qc, qc, dtype=np.float32)
    rows, cols = [], []
    for b0 in range(0, base.shape[0], bb):
        D = (qn[:, None] + bn[None, b0:b0 + bb]) - 2.0 * (qc @ tiles(b0, bb).T)
        r, c = np.nonzero(D <= thr[:, None])
        rows.append(r)
        cols.append(c.astype(np.int64) + b0)
    rows = np.concatenate(rows)
    cols = np.concatenate(cols)
    order = np.argsort(rows, kind="stable")
    cols = cols[order]
    starts = np.searchsorted(rows[order], np.arange(bad.size + 1))
    fd = np.empty((bad.size, k), np.float32)
    fi = np.empty((bad.size, k), np.int64)
    _rerank_pairs_cpu(base, np.ascontiguousarray(qs[bad]), starts.astype(np.int64), cols, k, fd, fi, idm)
    rd[bad] = fd
    ri[bad] = fi


def _bf_gpu(st: _BaseStats, queries, k, block, ids=None):
    import cupy as cp

    base, mu, tiles, bn, bnmax = st.base, st.mu, st.tiles, st.bn, st.bnmax
    n, d = base.shape
    m = queries.shape[0]
    kc = _candidates(k, n)
    free = cp.cuda.Device().mem_info[0]
    budget = int(min(2 << 30, max(64 << 20, free // 4)))
    qb, bb = _blocks(m, n, d, budget, block)
    out_d = cp.empty((m, k), cp.float32)
    out_i = cp.empty((m, k), cp.int64)
    g = _gamma(d)
    # one buffer of the largest tile for every tile of this search (see _CoarseBuffers)
    with st.coarse_buffer(min(qb, m), min(bb, n)) as buf:
        for q0 in range(0, m, qb):
            qs = queries[q0:q0 + qb]
            qc = qs - mu
            qn = _sqnorms(qc)
            keys = None
            for b0 in range(0, n, bb):
                t = tiles(b0, bb)
                G = cp.matmul(qc, t.T, out=buf[:qc.shape[0] * t.shape[0]].reshape(qc.shape[0], t.shape[0]))
                keys = _select_gpu(G, kc, qn=qn, bn=bn[b0:b0 + bb], col_offset=b0, prev=keys)
            cd, ci = decode_keys(keys)
            clast = cd[:, -1].astype(cp.float64)
            nq = qs.shape[0]
            qidx = cp.repeat(cp.arange(nq, dtype=cp.int64), kc)
            dist = pair_dist_gpu(base, qs, qidx, ci).reshape(nq, kc)
            rkeys = _keys_from(dist, ci if ids is None else cp.where(ci >= 0, ids[cp.maximum(ci, 0)], -1))
            top = topk_keys_rows(rkeys, k)
            rd, ri = decode_keys(top)
            if kc < n:
                err = 4 * g * (qn.astype(cp.float64) + bnmax) + 2 * g * rd[:, -1] + 1e-30
                bad = cp.nonzero(~(rd[:, -1].astype(cp.float64) + err < clast))[0]
                if int(bad.size):
                    thr = rd[bad, -1].astype(cp.float64) + err[bad]
                    _fix_gpu(base, qs, bad, thr, mu, tiles, bn, bb, k, rd, ri, ids)
            out_d[q0:q0 + qb] = rd
            out_i[q0:q0 + qb] = ri
    return out_d, out_i


def _keys_from(dist, ids):
    """uint64 (dist_bits << 32 | id) keys; id < 0 or non-finite distance -> KEY_NONE."""
    import cupy as cp

    dist = cp.maximum(dist, cp.float32(0))
    k = (dist.view(cp.uint32).astype(cp.uint64) << np.uint64(32)) | ids.astype(cp.uint64) & np.uint64(0xFFFFFFFF)
    none = (ids < 0) | ~cp.isfinite(dist)
    return cp.where(none, np.uint64(0xFFFFFFFFFFFFFFFF), k)


def _fix_gpu(base, qs, bad, thr, mu, tiles, bn, bb, k, rd, ri, ids=None):
    import cupy as cp

    qsub = cp.ascontiguousarray(qs[bad])
    qc = qsub - mu
    qn = _sqnorms(qc)
    rows, cols = [], []
    for b0 in range(0, base.shape[0], bb):
        D = (qn[:, None] + bn[None, b0:b0 + bb]) - 2.0 * (qc @ tiles(b0, bb).T)
        r, c = cp.nonzero(D <= thr[:, None].astype(cp.float32) * (1 + 1e-6))
        rows.append(r.astype(cp.int64))
        cols.append(c.astype(cp.int64) + b0)
    rows = cp.concatenate(rows)
    cols = cp.concatenate(cols)
    dist = pair_dist_gpu(base, qsub, rows, cols)
    keys = _keys_from(dist, cols if ids is None else ids[cols])
    o1 = cp.argsort(keys)
    o2 = cp.argsort(rows[o1])  # cupy sorts are stable
    order = o1[o2]
    rows = rows[order]
    keys = keys[order]
    starts = cp.searchsorted(rows, cp.arange(bad.size, dtype=cp.int64))
    take = starts[:, None] + cp.arange(k)[None, :]
    ends = cp.searchsorted(rows, cp.arange(bad.size, dtype=cp.int64), side="right")
    ok = take < ends[:, None]
    sel = cp.where(ok, keys[cp.minimum(take, keys.size - 1)], np.uint64(0xFFFFFFFFFFFFFFFF))
    fd, fi = decode_keys(sel)
    rd[bad] = fd
    ri[bad] = fi


# ----------------------------------------------------------------------------------------------
# recall
# ----------------------------------------------------------------------------------------------
@njit(parallel=True, cache=True)
def _pair_dist_cpu(base, queries, ids, out):
    for r in prange(ids.shape[0]):
        for c in range(ids.shape[1]):
            i = ids[r, c]
            out[r, c] = _sqdist(queries[r], base[i]) if 0 <= i < base.shape[0] else np.inf


def pair_distances(base, queries, ids, *, device: str = "auto"):
    """Canonical squared distances of each query to the base rows it names.

    For answers found elsewhere (another library's index, a stored match): ``ids[r, c]`` is a
    row of ``base`` for query ``r``; an id outside ``[0, N)`` (a library's ``-1`` pad) gives
    ``+inf``. The distances are the ones :func:`knn_bruteforce` gives for the same pairs, bit
    for bit, so :func:`recall` compares them with the exact answer without rounding noise.

    Parameters
    ----------
    base : (N, d) array_like
    queries : (M, d) array_like
    ids : (M, k) integer array_like
    device : {"auto", "cpu", "gpu"}, keyword-only

    Returns
    -------
    dist2 : (M, k) float32
    """
    dev, xp, conv, base, queries = _placed(base, queries, device)
    ids = conv(ids)
    if ids.ndim != 2 or ids.shape[0] != queries.shape[0] or ids.dtype.kind not in "iu":
        raise InputError(f"ids must be an (M, k) integer array with M = {queries.shape[0]}, "
                         f"got {ids.dtype} {ids.shape}")
    return pair_distances_checked(base, queries, ids, dev)


def pair_distances_checked(base, queries, ids, dev: str):
    """:func:`pair_distances` of arrays already checked and placed on ``dev`` (a search's own
    rows, queries and candidate ids: no pass over the base to check it again)."""
    xp = np
    if dev == "gpu":
        import cupy as xp
    ids = ids.astype(xp.int64, copy=False)
    if dev == "gpu":
        n = base.shape[0]
        bi = xp.where((ids >= 0) & (ids < n), ids, -1)
        qi = xp.broadcast_to(xp.arange(ids.shape[0], dtype=xp.int64)[:, None], ids.shape)
        return pair_dist_gpu(base, queries, qi, bi).reshape(ids.shape)
    out = np.empty(ids.shape, np.float32)
    _pair_dist_cpu(base, queries, np.ascontiguousarray(ids), out)
    return out


def recall(dist_found, dist_exact, k: int | None = None) -> float:
    """Recall@k of an approximate search against exact distances.

    A returned neighbour counts when its distance is ``<=`` the exact k-th distance of its query
    (so ties count). Returns the fraction over all queries and the first ``k`` returned slots
    (missing neighbours, +inf or id -1, never count).
    """
    f = np.asarray(to_numpy(dist_found), dtype=np.float64)
    e = np.asarray(to_numpy(dist_exact), dtype=np.float64)
    if f.ndim != 2 or e.ndim != 2 or f.shape[0] != e.shape[0]:
        raise InputError(f"dist_found {f.shape} and dist_exact {e.shape} must be (M, k) arrays with "
                         "the same number of rows")
    if f.shape[0] == 0:  # the mean of nothing would be a NaN "recall"
        raise InputError("dist_found and dist_exact have no rows (no queries): recall is undefined")
    k = min(f.shape[1], e.shape[1]) if k is None else int(k)
    if not 1 <= k <= min(f.shape[1], e.shape[1]):
        raise InputError(f"k={k} must be within 1..{min(f.shape[1], e.shape[1])}")
    thr = e[:, k - 1:k]
    hit = np.isfinite(f[:, :k]) & (f[:, :k] <= thr)
    return float(hit.mean())
