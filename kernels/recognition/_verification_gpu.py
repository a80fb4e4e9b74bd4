"""CuPy backend of recognition verification and ICP correspondence search.

The scene is counting-sorted into a uniform grid (cell list, :func:`scanforest.kernels.
neighbors.search_gpu.build_grid`) of edge >= the search distance, so a query scans the 3x3x3 block
of cells around its own. Two kernels:

* ``nearest_grid`` - nearest scene point strictly within ``r`` of each query (ICP);
* ``verify_points`` - one thread per (hypothesis, model verification point) pair, all
  hypotheses of a scene in one launch: transform the point and its normal by the hypothesis'
  pose (float32, poses in a flat (H, 12) array), test visibility (normal facing the viewpoint)
  and write the voxel rank of the nearest scene point within ``r`` (-1: none, -2: invisible);
* ``accept_greedy`` - the acceptance rounds of a scene in one block, one launch for all the
  rounds (and one block per scene for a batch of scenes): a warp per hypothesis counts its
  visible points and unclaimed inliers over its contiguous run of points, the block takes the
  argmax of the inlier fraction (ties to the lower index, as :func:`~scanforest.kernels.
  hypotheses.masked_argmax`), claims its voxels and counts again. The fractions are float64
  divisions of the same integer counts as the CPU rounds, so the choices are the same;
* ``first_fractions`` - round 0 alone (scoring without acceptance), spread over the device.
"""
from __future__ import annotations

import functools

import numpy as np

#: the cell-list nearest-neighbour search, shared with the device ICP (:mod:`._icp_gpu`)
GRID_NEAREST = r"""
__device__ __forceinline__ int cell_coord(float v, float o, float inv_h, int d) {
    int c = (int)floorf((v - o) * inv_h);
    return min(max(c, 0), d - 1);
}

__device__ __forceinline__ int grid_nearest(float qx, float qy, float qz, const float* __restrict__ P,
                                            const int* __restrict__ cs, float ox, float oy, float oz,
                                            float inv_h, int dx, int dy, int dz, float r2,
                                            float* best_out) {
    int cx = cell_coord(qx, ox, inv_h, dx), cy = cell_coord(qy, oy, inv_h, dy),
        cz = cell_coord(qz, oz, inv_h, dz);
    int x0 = max(cx - 1, 0), x1 = min(cx + 1, dx - 1);
    float best = r2;
    int bi = -1;
    for (int z = max(cz - 1, 0); z <= min(cz + 1, dz - 1); ++z)
        for (int y = max(cy - 1, 0); y <= min(cy + 1, dy - 1); ++y) {
            int row = (z * dy + y) * dx;
            int s = cs[row + x0], e = cs[row + x1 + 1];
            for (int j = s; j < e; ++j) {
                float ddx = qx - P[3 * j], ddy = qy - P[3 * j + 1], ddz = qz - P[3 * j + 2];
                float d = ddx * ddx + ddy * ddy + ddz * ddz;
                if (d < best) { best = d; bi = j; }
            }
        }
    *best_out = best;
    return bi;
}
"""

_SOURCE = GRID_NEAREST + r"""
extern "C" __global__ void nearest_grid(const float* __restrict__ Q, int nq,
                                        const float* __restrict__ P, const int* __restrict__ cs,
                                        float ox, float oy, float oz, float inv_h,
                                        int dx, int dy, int dz, float r2,
                                        const int* __restrict__ order,
                                        long long* __restrict__ out_idx, float* __restrict__ out_d2) {
    int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= nq) return;
    float best;
    int bi = grid_nearest(Q[3 * q], Q[3 * q + 1], Q[3 * q + 2], P, cs, ox, oy, oz, inv_h,
                          dx, dy, dz, r2, &best);
    out_idx[q] = bi >= 0 ? (long long)order[bi] : -1LL;
    out_d2[q] = bi >= 0 ? best : __int_as_float(0x7f800000);
}

extern "C" __global__ void verify_points(const long long* __restrict__ hyp,
                                         const long long* __restrict__ src, long long n,
                                         const float* __restrict__ poses,
                                         const float* __restrict__ VP, const float* __restrict__ VN,
                                         float vx, float vy, float vz,
                                         const float* __restrict__ P, const int* __restrict__ cs,
                                         float ox, float oy, float oz, float inv_h,
                                         int dx, int dy, int dz, float r2,
                                         const int* __restrict__ order, const int* __restrict__ vox,
                                         int* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float* T = poses + 12 * hyp[i];
    long long s = src[i];
    float px = VP[3 * s], py = VP[3 * s + 1], pz = VP[3 * s + 2];
    float nx = VN[3 * s], ny = VN[3 * s + 1], nz = VN[3 * s + 2];
    float wx = T[0] * px + T[1] * py + T[2] * pz + T[3];
    float wy = T[4] * px + T[5] * py + T[6] * pz + T[7];
    float wz = T[8] * px + T[9] * py + T[10] * pz + T[11];
    float mx = T[0] * nx + T[1] * ny + T[2] * nz;
    float my = T[4] * nx + T[5] * ny + T[6] * nz;
    float mz = T[8] * nx + T[9] * ny + T[10] * nz;
    if (mx * (wx - vx) + my * (wy - vy) + mz * (wz - vz) >= 0.f) { out[i] = -2; return; }
    float best;
    int bi = grid_nearest(wx, wy, wz, P, cs, ox, oy, oz, inv_h, dx, dy, dz, r2, &best);
    out[i] = bi >= 0 ? vox[order[bi]] : -1;
}

__device__ __forceinline__ int warp_sum(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

// (f, i) beats (bf, bi): a larger fraction, or the same fraction at a lower index; i < 0: none
__device__ __forceinline__ bool beats(double f, long long i, double bf, long long bi) {
    return i >= 0 && (bi < 0 || f > bf || (f == bf && i < bi));
}

// round 0 alone (no acceptance asked): every hypothesis' fraction, a warp each, over the whole device
extern "C" __global__ void first_fractions(const int* __restrict__ vox, const long long* __restrict__ seg,
                                           long long H, double* __restrict__ out) {
    const long long h = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (h >= H) return;
    int nv = 0, c = 0;
    for (long long j = seg[h] + lane; j < seg[h + 1]; j += 32) {
        int v = vox[j];
        nv += v >= -1;
        c += v >= 0;
    }
    nv = warp_sum(nv);
    c = warp_sum(c);
    if (lane == 0) out[h] = (double)c / (double)max(nv, 1);
}

extern "C" __global__ void accept_greedy(const int* __restrict__ vox, const long long* __restrict__ seg,
                                         const long long* __restrict__ scene_hyp,
                                         const long long* __restrict__ scene_vox,
                                         unsigned char* __restrict__ claimed, unsigned char* __restrict__ active,
                                         int* __restrict__ vis, int* __restrict__ cnt,
                                         double min_frac, int min_inl, int limit,
                                         double* __restrict__ out) {
    // out, per hypothesis h (global index, H in all): out[h] first fraction; acceptances of a
    // scene at rows scene_hyp[s].. of the next four H-blocks (local index, fraction, inliers,
    // visible); out[5H + s] the scene's number of acceptances.
    const int s = blockIdx.x;
    const long long h0 = scene_hyp[s], h1 = scene_hyp[s + 1], H = scene_hyp[gridDim.x];
    unsigned char* cl = claimed + scene_vox[s];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    __shared__ double s_f[32];
    __shared__ long long s_i[32];
    __shared__ long long s_pick;
    __shared__ int s_n;
    for (long long h = h0 + warp; h < h1; h += nwarp) {
        int c = 0;
        for (long long j = seg[h] + lane; j < seg[h + 1]; j += 32) c += vox[j] >= -1;
        c = warp_sum(c);
        if (lane == 0) { vis[h] = c; active[h] = 1; }
    }
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    for (int round = 0;; ++round) {
        for (long long h = h0 + warp; h < h1; h += nwarp) {
            int c = 0;
            for (long long j = seg[h] + lane; j < seg[h + 1]; j += 32) {
                int v = vox[j];
                c += v >= 0 && !cl[v];
            }
            c = warp_sum(c);
            if (lane == 0) {
                cnt[h] = c;
                if (round == 0) out[h] = (double)c / (double)max(vis[h], 1);
            }
        }
        __syncthreads();
        if (s_n >= limit) break;
        double bf = 0.0;
        long long bi = -1;
        for (long long h = h0 + threadIdx.x; h < h1; h += blockDim.x) {
            double f = (double)cnt[h] / (double)max(vis[h], 1);
            if (active[h] && f >= min_frac && cnt[h] >= min_inl && beats(f, h, bf, bi)) { bf = f; bi = h; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            double f = __shfl_down_sync(0xffffffffu, bf, o);
            long long i = __shfl_down_sync(0xffffffffu, bi, o);
            if (beats(f, i, bf, bi)) { bf = f; bi = i; }
        }
        if (lane == 0) { s_f[warp] = bf; s_i[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < nwarp; ++w)
                if (beats(s_f[w], s_i[w], bf, bi)) { bf = s_f[w]; bi = s_i[w]; }
            s_pick = bi;
            if (bi >= 0) {
                long long r = h0 + s_n;
                out[H + r] = (double)(bi - h0);
                out[2 * H + r] = bf;
                out[3 * H + r] = (double)cnt[bi];
                out[4 * H + r] = (double)vis[bi];
                active[bi] = 0;
                s_n += 1;
            }
        }
        __syncthreads();
        const long long pick = s_pick;
        if (pick < 0) break;
        for (long long j = seg[pick] + threadIdx.x; j < seg[pick + 1]; j += blockDim.x) {
            int v = vox[j];
            if (v >= 0) cl[v] = 1;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[5 * H + s] = (double)s_n;
}
"""


@functools.lru_cache(maxsize=None)
def _module():
    import cupy as cp

    return cp.RawModule(code=_SOURCE, options=("--std=c++17",))


def kernel(name):
    return _module().get_function(name)


def build_grid(points, cell: float):
    """Cell list of the scene (reuses the neighbour-search grid of ``neighbors.search_gpu``)."""
    from ..neighbors.search_gpu import build_grid as _bg

    return _bg(points, cell)


def voxel_ranks(points, cell: float):
    """Dense rank of each point's voxel (edge ``cell``, origin at the min corner), int32."""
    import cupy as cp

    from ..neighbors.search_gpu import bounds

    if points.shape[0] == 0:
        return cp.zeros(0, cp.int32)
    lo, hi = (v.astype(np.float32) for v in bounds(points))
    inv = np.float32(1.0 / cell)
    ijk = cp.floor((points - cp.asarray(lo)) * inv).astype(cp.int64)
    # the largest voxel index per axis is the top corner's: float32 subtraction, product and
    # floor are monotone, so this is ijk.max(axis=0) without a column reduction
    dims = np.floor((hi - lo) * inv).astype(np.int64) + 1
    key = ijk[:, 0] + int(dims[0]) * (ijk[:, 1] + int(dims[1]) * ijk[:, 2])
    _, rank = cp.unique(key, return_inverse=True)
    return rank.astype(cp.int32).reshape(-1)


def _grid_args(grid):
    return (grid.points, grid.cell_start, np.float32(grid.origin[0]), np.float32(grid.origin[1]),
            np.float32(grid.origin[2]), np.float32(grid.inv_h), np.int32(grid.dims[0]),
            np.int32(grid.dims[1]), np.int32(grid.dims[2]))


def nearest(grid, queries, r: float):
    """Nearest grid point strictly within ``r`` of each query: (int64 index | -1, float32 d2)."""
    import cupy as cp

    if r > grid.h * 1.0000001:
        raise ValueError(f"search distance {r} exceeds the grid cell {grid.h}")
    q = cp.ascontiguousarray(cp.asarray(queries, dtype=cp.float32))
    n = q.shape[0]
    idx = cp.empty(n, cp.int64)
    d2 = cp.empty(n, cp.float32)
    if n:
        kernel("nearest_grid")(((n + 127) // 128,), (128,),
                               (q, np.int32(n), *_grid_args(grid), np.float32(r * r), grid.order,
                                idx, d2))
    return idx, d2


def verify_nearest(sidx, library, hyp, src, poses, r: float, viewpoint):
    """Per (hypothesis, verification point): voxel rank of the nearest scene point (see module)."""
    import cupy as cp

    grid = sidx.grid
    if r > grid.h * 1.0000001:
        raise ValueError(f"inlier distance {r} exceeds the grid cell {grid.h}")
    n = len(hyp)
    T = np.ascontiguousarray(np.asarray(poses, np.float64)[:, :3, :4].reshape(-1, 12), np.float32)
    cache = getattr(library, "_gpu_verify_cache", None)
    if cache is None or cache[0] is not library.verify_points:
        cache = (library.verify_points, cp.asarray(library.verify_points, dtype=cp.float32),
                 cp.asarray(library.verify_normals, dtype=cp.float32))
        try:
            object.__setattr__(library, "_gpu_verify_cache", cache)
        except Exception:
            pass
    out = cp.empty(n, cp.int32)
    if n:
        kernel("verify_points")(((n + 255) // 256,), (256,),
                                (cp.asarray(hyp, dtype=cp.int64), cp.asarray(src, dtype=cp.int64),
                                 np.int64(n), cp.asarray(T), cache[1], cache[2],
                                 np.float32(viewpoint[0]), np.float32(viewpoint[1]),
                                 np.float32(viewpoint[2]), *_grid_args(grid), np.float32(r * r),
                                 grid.order, sidx.vox, out))
    return out


def accept_greedy(vox, sizes, n_vox, *, min_fraction: float, min_inliers: int, limit: int):
    """The acceptance rounds of :func:`~.verification.verify` for scenes whose hypotheses' points
    are concatenated in ``vox`` (int32, the output of :func:`verify_nearest`): ``sizes`` (host) is
    a list, per scene, of its hypotheses' point counts; ``n_vox`` its scene's voxel count. One
    launch, one copy back. Returns per scene ``(accepted, scores, inliers, visible, first)``
    (numpy)."""
    import cupy as cp

    per = [np.asarray(z, np.int64) for z in sizes]
    hs = np.array([len(z) for z in per], np.int64)
    H = int(hs.sum())
    S = len(per)
    seg = np.zeros(H + 1, np.int64)
    np.cumsum(np.concatenate(per) if H else np.zeros(0, np.int64), out=seg[1:])
    scene_hyp = np.concatenate([[0], np.cumsum(hs)]).astype(np.int64)
    nv = np.maximum(np.asarray(n_vox, np.int64), 1)
    scene_vox = np.concatenate([[0], np.cumsum(nv)]).astype(np.int64)
    out = cp.zeros(5 * H + S, cp.float64)
    if H and limit <= 0:  # the fractions before any claim: no rounds, so no block per scene
        kernel("first_fractions")(((H * 32 + 255) // 256,), (256,),
                                  (cp.asarray(vox, dtype=cp.int32), cp.asarray(seg), np.int64(H), out))
    elif H:
        vis = cp.empty(H, cp.int32)
        cnt = cp.empty(H, cp.int32)
        kernel("accept_greedy")((S,), (1024,),
                                (cp.asarray(vox, dtype=cp.int32), cp.asarray(seg), cp.asarray(scene_hyp),
                                 cp.asarray(scene_vox), cp.zeros(int(scene_vox[-1]), cp.uint8),
                                 cp.empty(H, cp.uint8), vis, cnt, np.float64(min_fraction),
                                 np.int32(min(int(min_inliers), 2**31 - 1)),
                                 np.int32(min(int(limit), 2**31 - 1)), out))
    o = out.get()
    res = []
    for s in range(S):
        a, b = int(scene_hyp[s]), int(scene_hyp[s + 1])
        n = int(o[5 * H + s])
        res.append((o[H + a:H + a + n].astype(np.int64), o[2 * H + a:2 * H + a + n].copy(),
                    o[3 * H + a:3 * H + a + n].astype(np.int64), o[4 * H + a:4 * H + a + n].astype(np.int64),
                    o[a:b].copy()))
    return res
