"""CuPy backend of the neighbour search: a uniform grid (cell list).

The surface is sorted into cubic cells of edge ``h >= radius`` (a radix sort of the cell ids,
then a binary search per cell for the cell starts; the bounding box in one launch); queries scan the 3x3x3 block of cells
around their own, whose x-runs are contiguous in the sorted order (9 ranges per query).
Neighbour lists are built in two passes (count, exclusive scan, fill) and refer to positions in
the cell-sorted surface; :func:`radius_search` maps them back to input indices.

A public module: the GPU backends of descriptors (normals, SHOT) and recognition (verification)
build on its grid and stages (:func:`build_grid`, :func:`count`, :func:`fill`, :func:`cap_lists`,
:func:`knn`, :func:`bounds`), and the SHOT bench times them one by one.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ._search_common import Neighbors

KNN_KMAX = 64
MAX_CELLS = 1 << 26

_SOURCE = r"""
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ int cell_coord(float v, float o, float inv_h, int d) {
    int c = (int)floorf(__fmul_rn(__fsub_rn(v, o), inv_h));
    return min(max(c, 0), d - 1);
}

__device__ __forceinline__ float sqd(float qx, float qy, float qz, float px, float py, float pz) {
    float dx = __fsub_rn(qx, px), dy = __fsub_rn(qy, py), dz = __fsub_rn(qz, pz);
    return __fadd_rn(__fadd_rn(__fmul_rn(dx, dx), __fmul_rn(dy, dy)), __fmul_rn(dz, dz));
}

extern "C" __global__ void cell_ids(const float* __restrict__ P, int n, float ox, float oy, float oz,
                                    float inv_h, int dx, int dy, int dz, int* __restrict__ cid) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int cx = cell_coord(P[3 * i], ox, inv_h, dx);
    int cy = cell_coord(P[3 * i + 1], oy, inv_h, dy);
    int cz = cell_coord(P[3 * i + 2], oz, inv_h, dz);
    cid[i] = (cz * dy + cy) * dx + cx;
}

template <bool FILL>
__device__ void rs_body(const float* __restrict__ Q, int nq, const float* __restrict__ P,
                        const int* __restrict__ cs, float ox, float oy, float oz, float inv_h,
                        int dx, int dy, int dz, float r2, int* __restrict__ counts,
                        const long long* __restrict__ offsets, int* __restrict__ oidx,
                        float* __restrict__ od2) {
    int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= nq) return;
    float qx = Q[3 * q], qy = Q[3 * q + 1], qz = Q[3 * q + 2];
    int cx = cell_coord(qx, ox, inv_h, dx), cy = cell_coord(qy, oy, inv_h, dy),
        cz = cell_coord(qz, oz, inv_h, dz);
    int x0 = max(cx - 1, 0), x1 = min(cx + 1, dx - 1);
    int cnt = 0;
    long long w = FILL ? offsets[q] : 0;
    for (int z = max(cz - 1, 0); z <= min(cz + 1, dz - 1); ++z)
        for (int y = max(cy - 1, 0); y <= min(cy + 1, dy - 1); ++y) {
            int base = (z * dy + y) * dx;
            int a = cs[base + x0], b = cs[base + x1 + 1];
            for (int j = a; j < b; ++j) {
                float d = sqd(qx, qy, qz, P[3 * j], P[3 * j + 1], P[3 * j + 2]);
                if (d < r2) {
                    if (FILL) { oidx[w] = j; od2[w] = d; ++w; }
                    else ++cnt;
                }
            }
        }
    if (!FILL) counts[q] = cnt;
}

extern "C" __global__ void rs_count(const float* __restrict__ Q, int nq, const float* __restrict__ P,
                                    const int* __restrict__ cs, float ox, float oy, float oz, float inv_h,
                                    int dx, int dy, int dz, float r2, int* __restrict__ counts) {
    rs_body<false>(Q, nq, P, cs, ox, oy, oz, inv_h, dx, dy, dz, r2, counts, nullptr, nullptr, nullptr);
}

extern "C" __global__ void rs_fill(const float* __restrict__ Q, int nq, const float* __restrict__ P,
                                   const int* __restrict__ cs, float ox, float oy, float oz, float inv_h,
                                   int dx, int dy, int dz, float r2, const long long* __restrict__ offsets,
                                   int* __restrict__ oidx, float* __restrict__ od2) {
    rs_body<true>(Q, nq, P, cs, ox, oy, oz, inv_h, dx, dy, dz, r2, nullptr, offsets, oidx, od2);
}

// k nearest neighbours: one thread per query, growing shells of cells, sorted insertion by
// (squared distance, original index).
extern "C" __global__ void knn_kernel(const float* __restrict__ Q, int nq, const float* __restrict__ P,
                                      const int* __restrict__ cs, const int* __restrict__ order,
                                      float ox, float oy, float oz, float inv_h, float h,
                                      int dx, int dy, int dz, int k, int* __restrict__ oidx,
                                      float* __restrict__ od2) {
    int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= nq) return;
    float bd[KMAX];
    int bi[KMAX], bo[KMAX];
    int found = 0;
    float qx = Q[3 * q], qy = Q[3 * q + 1], qz = Q[3 * q + 2];
    int cx = cell_coord(qx, ox, inv_h, dx), cy = cell_coord(qy, oy, inv_h, dy),
        cz = cell_coord(qz, oz, inv_h, dz);
    int smax = max(dx, max(dy, dz));
    for (int s = 0; s <= smax; ++s) {
        for (int z = cz - s; z <= cz + s; ++z) {
            if (z < 0 || z >= dz) continue;
            for (int y = cy - s; y <= cy + s; ++y) {
                if (y < 0 || y >= dy) continue;
                bool face = (z == cz - s) || (z == cz + s) || (y == cy - s) || (y == cy + s);
                for (int pass = 0; pass < (face ? 1 : 2); ++pass) {
                    int xa, xb;
                    if (face) { xa = cx - s; xb = cx + s; }
                    else if (pass == 0) { xa = xb = cx - s; }
                    else { xa = xb = cx + s; }
                    xa = max(xa, 0); xb = min(xb, dx - 1);
                    if (xa > xb) continue;
                    int base = (z * dy + y) * dx;
                    int a = cs[base + xa], b = cs[base + xb + 1];
                    for (int j = a; j < b; ++j) {
                        float d = sqd(qx, qy, qz, P[3 * j], P[3 * j + 1], P[3 * j + 2]);
                        int oj = order[j];
                        if (found == k && (d > bd[k - 1] || (d == bd[k - 1] && oj > bo[k - 1]))) continue;
                        int pos = found < k ? found : k - 1;
                        while (pos > 0 && (bd[pos - 1] > d || (bd[pos - 1] == d && bo[pos - 1] > oj))) {
                            bd[pos] = bd[pos - 1]; bi[pos] = bi[pos - 1]; bo[pos] = bo[pos - 1]; --pos;
                        }
                        bd[pos] = d; bi[pos] = j; bo[pos] = oj;
                        if (found < k) ++found;
                    }
                }
            }
        }
        if (found == k) {
            float lb = (s - 0.01f) * h;
            if (s > 0 && bd[k - 1] <= lb * lb) break;
        }
    }
    for (int t = 0; t < k; ++t) {
        oidx[(long long)q * k + t] = t < found ? bi[t] : -1;
        od2[(long long)q * k + t] = t < found ? bd[t] : __int_as_float(0x7fc00000);
    }
}

// Approximate mode: keep the m nearest entries (by squared distance, then original index) of
// every list; one warp per list, binary search on the float bits of the threshold.
// order-preserving uint32 code of a float (a < b <=> code(a) < code(b)), for atomic min / max
__device__ __forceinline__ unsigned int fcode(float f) {
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// bounding box of (n, 3) points: out[0..2] = min codes, out[3..5] = max codes (preset to
// 0xffffffff / 0); a grid-stride loop, then a warp min / max and one atomic per warp and axis.
extern "C" __global__ void bounds3(const float* __restrict__ P, long long n, unsigned int* __restrict__ out) {
    float lo0 = __int_as_float(0x7f800000), lo1 = lo0, lo2 = lo0;
    float hi0 = -lo0, hi1 = -lo0, hi2 = -lo0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float x = P[3 * i], y = P[3 * i + 1], z = P[3 * i + 2];
        lo0 = fminf(lo0, x); lo1 = fminf(lo1, y); lo2 = fminf(lo2, z);
        hi0 = fmaxf(hi0, x); hi1 = fmaxf(hi1, y); hi2 = fmaxf(hi2, z);
    }
    for (int o = 16; o > 0; o >>= 1) {
        lo0 = fminf(lo0, __shfl_xor_sync(FULL_MASK, lo0, o)); hi0 = fmaxf(hi0, __shfl_xor_sync(FULL_MASK, hi0, o));
        lo1 = fminf(lo1, __shfl_xor_sync(FULL_MASK, lo1, o)); hi1 = fmaxf(hi1, __shfl_xor_sync(FULL_MASK, hi1, o));
        lo2 = fminf(lo2, __shfl_xor_sync(FULL_MASK, lo2, o)); hi2 = fmaxf(hi2, __shfl_xor_sync(FULL_MASK, hi2, o));
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMin(out, fcode(lo0)); atomicMin(out + 1, fcode(lo1)); atomicMin(out + 2, fcode(lo2));
        atomicMax(out + 3, fcode(hi0)); atomicMax(out + 4, fcode(hi1)); atomicMax(out + 5, fcode(hi2));
    }
}

// cs[c] = the first position of the sorted cell ids sc (n of them) whose cell is >= c, for
// c = 0..ncell (a binary search per cell: no atomics, no host sync, any gaps between cells)
extern "C" __global__ void cell_starts(const int* __restrict__ sc, int n, int ncell, int* __restrict__ cs) {
    long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (c > ncell) return;
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (sc[mid] < c) lo = mid + 1; else hi = mid;
    }
    cs[c] = lo;
}

extern "C" __global__ void cap_select(const long long* __restrict__ off, const int* __restrict__ nidx,
                                      const float* __restrict__ nd2, const int* __restrict__ order,
                                      int nq, int m, const long long* __restrict__ out_off,
                                      int* __restrict__ out_idx, float* __restrict__ out_d2) {
    int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (q >= nq) return;  // whole warp leaves together
    long long s = off[q], e = off[q + 1], o = out_off[q];
    long long n = e - s;
    if (n <= m) {
        for (long long j = s + lane; j < e; j += 32) {
            out_idx[o + (j - s)] = nidx[j]; out_d2[o + (j - s)] = nd2[j];
        }
        return;
    }
    unsigned lo = 0u, hi = 0x7f800000u;  // smallest T with count(bits <= T) >= m
    while (lo < hi) {
        unsigned mid = lo + ((hi - lo) >> 1);
        int c = 0;
        for (long long j = s + lane; j < e; j += 32) c += (__float_as_uint(nd2[j]) <= mid);
        for (int o2 = 16; o2 > 0; o2 >>= 1) c += __shfl_xor_sync(FULL_MASK, c, o2);
        if (c >= m) hi = mid; else lo = mid + 1;
    }
    unsigned T = lo;
    int less = 0;
    for (long long j = s + lane; j < e; j += 32) less += (__float_as_uint(nd2[j]) < T);
    for (int o2 = 16; o2 > 0; o2 >>= 1) less += __shfl_xor_sync(FULL_MASK, less, o2);
    int need = m - less;
    long long w = o;
    for (long long base = s; base < e; base += 32) {
        long long j = base + lane;
        bool keep = false;
        if (j < e) {
            unsigned b = __float_as_uint(nd2[j]);
            if (b < T) keep = true;
            else if (b == T) {
                int oj = order[nidx[j]], r = 0;
                for (long long t = s; t < e; ++t)
                    if (__float_as_uint(nd2[t]) == T && order[nidx[t]] < oj) ++r;
                keep = r < need;
            }
        }
        unsigned mask = __ballot_sync(FULL_MASK, keep);
        if (keep) {
            long long pos = w + __popc(mask & ((1u << lane) - 1u));
            out_idx[pos] = nidx[j]; out_d2[pos] = nd2[j];
        }
        w += __popc(mask);
    }
}
"""


@functools.lru_cache(maxsize=None)
def _module():
    import cupy as cp

    return cp.RawModule(code=_SOURCE, options=("--std=c++17", "--fmad=false", f"-DKMAX={KNN_KMAX}"),
                        name_expressions=None)


def kernel(name):
    return _module().get_function(name)


@dataclass
class Grid:
    points: object          # (M, 3) float32, cell-sorted
    order: object           # (M,) int32: sorted position -> input index
    cell_start: object      # (ncells + 1,) int32
    origin: tuple
    inv_h: float
    h: float
    dims: tuple

    def args(self):
        return (np.float32(self.origin[0]), np.float32(self.origin[1]), np.float32(self.origin[2]),
                np.float32(self.inv_h))

    def dim_args(self):
        return tuple(np.int32(d) for d in self.dims)


def bounds(pts) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``: the per-axis minimum and maximum of (M, 3) float32 device points, as float64
    host arrays holding the float32 values (one launch and one small copy; CuPy's ``min(axis=0)``
    reduces each of the 3 columns in a single block). Empty points: ``(+inf, -inf)``."""
    import cupy as cp

    n = int(pts.shape[0])
    out = cp.empty(6, cp.uint32)
    out[:3] = 0xFFFFFFFF
    out[3:] = 0
    if n:
        blocks = min((n + 255) // 256, 1024)
        kernel("bounds3")((blocks,), (256,), (cp.ascontiguousarray(pts, dtype=cp.float32), np.int64(n), out))
    u = out.get()
    if not n:
        return np.full(3, np.inf), np.full(3, -np.inf)
    bits = np.where(u & 0x80000000, u & 0x7FFFFFFF, ~u).astype(np.uint32)
    v = bits.view(np.float32).astype(np.float64)
    return v[:3], v[3:]


def build_grid(pts, cell: float, *, max_cells: int = MAX_CELLS) -> Grid:
    """Counting-sort ``pts`` (CuPy (M, 3) float32) into cells of edge >= ``cell``."""
    import cupy as cp

    n = pts.shape[0]
    lo, hi = bounds(pts)
    h = float(cell) * 1.001
    ext = np.maximum(hi - lo, 0.0)
    while True:
        dims = (np.floor(ext / h).astype(np.int64) + 1)
        if int(np.prod(dims)) <= max(max_cells, 27):
            break
        h *= 1.25
    dims = tuple(int(d) for d in dims)
    inv_h = np.float32(1.0 / h)
    origin = tuple(float(np.float32(v)) for v in lo)
    ncell = dims[0] * dims[1] * dims[2]
    cid = cp.empty(n, cp.int32)
    if n:
        kernel("cell_ids")(((n + 255) // 256,), (256,),
                           (pts, np.int32(n), np.float32(origin[0]), np.float32(origin[1]),
                            np.float32(origin[2]), inv_h, np.int32(dims[0]), np.int32(dims[1]),
                            np.int32(dims[2]), cid))
    order = cp.argsort(cid).astype(cp.int32)
    cs = cp.empty(ncell + 1, cp.int32)
    kernel("cell_starts")(((ncell + 256) // 256,), (256,), (cid[order], np.int32(n), np.int32(ncell), cs))
    return Grid(cp.ascontiguousarray(pts[order]), order, cs, origin, float(inv_h), h, dims)


def build_grid_knn(pts, k: int) -> Grid:
    """A grid for k-NN whose cells hold about ``k`` points on a surface.

    A first grid sized from the bounding-box volume measures the mean occupancy ``m`` of its
    non-empty cells; taking the data as a surface, the point spacing is ``h0 / sqrt(m)`` and the
    cell edge becomes ``1.2 sqrt(k)`` spacings (for volumetric data this is within a factor ~1.2
    of the volumetric estimate too).
    """
    import cupy as cp

    n = max(pts.shape[0], 1)
    lo, hi = bounds(pts)
    ext = np.maximum(hi - lo, 1e-9)
    ext = np.maximum(ext, ext.max() * 1e-3)
    h0 = (float(np.prod(ext)) / n * 64) ** (1 / 3)
    g0 = build_grid(pts, h0)
    cs = g0.cell_start
    nonempty = max(int((cs[1:] != cs[:-1]).sum()), 1)
    m = n / nonempty
    h = 1.2 * math.sqrt(max(k, 1)) * g0.h / math.sqrt(max(m, 1.0))
    return build_grid(pts, max(h, g0.h * 1e-3))


def count(grid: Grid, qs, r: float):
    import cupy as cp

    nq = qs.shape[0]
    counts = cp.empty(nq, cp.int32)
    if nq:
        kernel("rs_count")(((nq + 127) // 128,), (128,),
                           (qs, np.int32(nq), grid.points, grid.cell_start, *grid.args(),
                            *grid.dim_args(), np.float32(r * r), counts))
    return counts


def fill(grid: Grid, qs, r: float, offsets, total: int):
    import cupy as cp

    nq = qs.shape[0]
    idx = cp.empty(total, cp.int32)
    d2 = cp.empty(total, cp.float32)
    if nq and total:
        kernel("rs_fill")(((nq + 127) // 128,), (128,),
                          (qs, np.int32(nq), grid.points, grid.cell_start, *grid.args(),
                           *grid.dim_args(), np.float32(r * r), offsets, idx, d2))
    return idx, d2


def offsets_from_counts(counts):
    import cupy as cp

    off = cp.zeros(counts.shape[0] + 1, cp.int64)
    off[1:] = cp.cumsum(counts.astype(cp.int64))
    return off


def cap_lists(grid: Grid, off, idx, d2, m: int):
    """Keep the m nearest entries of each list (unsorted output)."""
    import cupy as cp

    nq = off.shape[0] - 1
    kept = cp.minimum(off[1:] - off[:-1], m)
    out_off = offsets_from_counts(kept)
    total = int(out_off[-1])
    oi = cp.empty(total, cp.int32)
    od = cp.empty(total, cp.float32)
    if nq:
        kernel("cap_select")(((nq * 32 + 255) // 256,), (256,),
                             (off, idx, d2, grid.order, np.int32(nq), np.int32(m), out_off, oi, od))
    return out_off, oi, od


def sort_lists(grid: Grid, off, idx, d2):
    """Sort every segment by (squared distance, original index)."""
    import cupy as cp

    nq = off.shape[0] - 1
    if idx.size == 0:
        return idx, d2
    seg = cp.repeat(cp.arange(nq, dtype=cp.int64), (off[1:] - off[:-1]).astype(cp.int64))
    orig = grid.order[idx]
    # stable sorts: original index, then (segment, distance bits)
    p = cp.argsort(orig)
    key = (seg[p] << 32) | d2[p].view(cp.uint32).astype(cp.int64)
    p2 = cp.argsort(key)
    perm = p[p2]
    return idx[perm], d2[perm]


def radius_search(grid: Grid, qs, r: float, *, max_neighbors=None, sort=True,
                  original_indices=True) -> Neighbors:
    counts = count(grid, qs, r)
    off = offsets_from_counts(counts)
    idx, d2 = fill(grid, qs, r, off, int(off[-1]))
    if max_neighbors is not None:
        off, idx, d2 = cap_lists(grid, off, idx, d2, int(max_neighbors))
    if sort:
        idx, d2 = sort_lists(grid, off, idx, d2)
    if original_indices:
        idx = grid.order[idx]
    return Neighbors(off, idx, d2)


def knn(grid: Grid, qs, k: int):
    import cupy as cp

    nq = qs.shape[0]
    idx = cp.empty((nq, k), cp.int32)
    d2 = cp.empty((nq, k), cp.float32)
    if nq:
        kernel("knn_kernel")(((nq + 127) // 128,), (128,),
                             (qs, np.int32(nq), grid.points, grid.cell_start, grid.order,
                              *grid.args(), np.float32(grid.h), *grid.dim_args(), np.int32(k),
                              idx, d2))
    return idx, d2
