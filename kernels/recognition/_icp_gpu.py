"""Point-to-plane ICP of many sources against one scene, iterated on the device.

The GPU backend of :func:`~scanforest.kernels.recognition.icp.icp_point_to_plane_batch` (and of
the single-source ICP, a batch of one). An iteration is two launches and no host transfer:

* ``icp_accumulate`` - one block per chunk of 128 source points of one problem (a chunk never
  spans two problems): transform each point by its problem's pose (float64), find its nearest
  scene point strictly within ``r`` in the scene's cell list (float32, the verification search),
  drop it when the scene normal is undefined or disagrees with the rotated source normal, and
  sum the 21 + 6 terms of the normal equations, the pair count and the squared residual
  (float64, warp shuffles then shared memory) into the chunk's row of a partials table;
* ``icp_solve`` - one thread per problem: add its chunks' partials in chunk order (so the result
  does not depend on scheduling), solve the 6x6 system (Gaussian elimination with partial
  pivoting; an exactly singular system gets the minimum-norm least-squares solution, as
  ``numpy.linalg.lstsq``, from a Jacobi eigen-decomposition), apply the increment on the left
  (Rodrigues) and retire the problem when the step is below the tolerance or fewer than 6 points
  pair.

The host only launches, and looks at the active flags every few iterations to stop early.
Semantics are those of the CPU loop in :mod:`.icp`; the sums differ from it by float64 rounding
order and the search by float32 ties.
"""
from __future__ import annotations

import functools

import numpy as np

from ._verification_gpu import GRID_NEAREST, _grid_args

CHUNK = 128          # source points per block of icp_accumulate (= its block size)
NSTAT = 29           # 21 upper-triangle entries of J^T J, 6 of -J^T e, the count, sum e^2
CHECK_EVERY = 4      # iterations between looks at the active flags

#: each block's per-thread terms summed into its row of a partials table (warp shuffles, then
#: shared memory; a fixed order): the ICP's and the polish's (._polish_gpu) accumulations
BLOCK_SUMS = r"""
template <int NS>
__device__ __forceinline__ void block_sums(const double* acc, double* __restrict__ partial, int blk) {
    __shared__ double sh[(128 / 32) * NS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int k = 0; k < NS; ++k) {
        double v = acc[k];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
        if (lane == 0) sh[warp * NS + k] = v;
    }
    __syncthreads();
    if (threadIdx.x < NS) {
        double v = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) v += sh[w * NS + threadIdx.x];
        partial[(long long)blk * NS + threadIdx.x] = v;
    }
}
"""

_SOURCE = GRID_NEAREST + BLOCK_SUMS + r"""
#define NSTAT 29

extern "C" __global__ void icp_accumulate(
        const double* __restrict__ S, const double* __restrict__ SN, int has_sn,
        const int* __restrict__ blk_prob, const long long* __restrict__ blk_start,
        const long long* __restrict__ blk_end,
        const double* __restrict__ poses, const int* __restrict__ active,
        const float* __restrict__ P, const int* __restrict__ cs, float ox, float oy, float oz,
        float inv_h, int dx, int dy, int dz, const int* __restrict__ order,
        const float* __restrict__ TN, float r2, double agree, double* __restrict__ partial) {
    const int blk = blockIdx.x;
    const int b = blk_prob[blk];
    if (!active[b]) return;                       // uniform over the block
    const double* T = poses + 16 * b;
    double acc[NSTAT];
#pragma unroll
    for (int k = 0; k < NSTAT; ++k) acc[k] = 0.0;
    const long long i = blk_start[blk] + threadIdx.x;
    if (i < blk_end[blk]) {
        double sx = S[3 * i], sy = S[3 * i + 1], sz = S[3 * i + 2];
        double px = T[0] * sx + T[1] * sy + T[2] * sz + T[3];
        double py = T[4] * sx + T[5] * sy + T[6] * sz + T[7];
        double pz = T[8] * sx + T[9] * sy + T[10] * sz + T[11];
        float best;
        int bi = grid_nearest((float)px, (float)py, (float)pz, P, cs, ox, oy, oz, inv_h,
                              dx, dy, dz, r2, &best);
        bool ok = bi >= 0;
        double nx = 0.0, ny = 0.0, nz = 0.0, qx = 0.0, qy = 0.0, qz = 0.0;
        if (ok) {
            int j = order[bi];
            nx = TN[3 * j]; ny = TN[3 * j + 1]; nz = TN[3 * j + 2];
            ok = isfinite(nx) && isfinite(ny) && isfinite(nz);
            qx = P[3 * bi]; qy = P[3 * bi + 1]; qz = P[3 * bi + 2];
        }
        if (ok && has_sn) {
            double ax = SN[3 * i], ay = SN[3 * i + 1], az = SN[3 * i + 2];
            double mx = T[0] * ax + T[1] * ay + T[2] * az;
            double my = T[4] * ax + T[5] * ay + T[6] * az;
            double mz = T[8] * ax + T[9] * ay + T[10] * az;
            ok = mx * nx + my * ny + mz * nz >= agree;
        }
        if (ok) {
            double e = (px - qx) * nx + (py - qy) * ny + (pz - qz) * nz;
            double J[6] = {py * nz - pz * ny, pz * nx - px * nz, px * ny - py * nx, nx, ny, nz};
            int k = 0;
#pragma unroll
            for (int a = 0; a < 6; ++a)
#pragma unroll
                for (int c = a; c < 6; ++c) acc[k++] = J[a] * J[c];
#pragma unroll
            for (int a = 0; a < 6; ++a) acc[21 + a] = -J[a] * e;
            acc[27] = 1.0;
            acc[28] = e * e;
        }
    }
    block_sums<NSTAT>(acc, partial, blk);
}

// minimum-norm least squares of a symmetric 6x6 system (numpy.linalg.lstsq's cut-off)
__device__ void pinv_solve6(const double A0[36], const double b[6], double x[6]) {
    double A[36], V[36];
    for (int k = 0; k < 36; ++k) { A[k] = A0[k]; V[k] = (k % 7 == 0) ? 1.0 : 0.0; }
    for (int sweep = 0; sweep < 50; ++sweep) {
        double off = 0.0;
        for (int p = 0; p < 6; ++p) for (int q = p + 1; q < 6; ++q) off += A[p * 6 + q] * A[p * 6 + q];
        if (off == 0.0) break;
        for (int p = 0; p < 6; ++p) for (int q = p + 1; q < 6; ++q) {
            double apq = A[p * 6 + q];
            if (apq == 0.0) continue;
            double th = (A[q * 6 + q] - A[p * 6 + p]) / (2.0 * apq);
            double t = (th >= 0 ? 1.0 : -1.0) / (fabs(th) + sqrt(th * th + 1.0));
            double c = 1.0 / sqrt(t * t + 1.0), s = t * c;
            for (int k = 0; k < 6; ++k) {
                double akp = A[k * 6 + p], akq = A[k * 6 + q];
                A[k * 6 + p] = c * akp - s * akq; A[k * 6 + q] = s * akp + c * akq;
            }
            for (int k = 0; k < 6; ++k) {
                double apk = A[p * 6 + k], aqk = A[q * 6 + k];
                A[p * 6 + k] = c * apk - s * aqk; A[q * 6 + k] = s * apk + c * aqk;
            }
            for (int k = 0; k < 6; ++k) {
                double vkp = V[k * 6 + p], vkq = V[k * 6 + q];
                V[k * 6 + p] = c * vkp - s * vkq; V[k * 6 + q] = s * vkp + c * vkq;
            }
        }
    }
    double big = 0.0;
    for (int k = 0; k < 6; ++k) big = fmax(big, fabs(A[k * 7]));
    const double cut = 6.0 * 2.220446049250313e-16 * big;
    for (int k = 0; k < 6; ++k) x[k] = 0.0;
    for (int k = 0; k < 6; ++k) {
        double lam = A[k * 7];
        if (fabs(lam) <= cut) continue;
        double c = 0.0;
        for (int m = 0; m < 6; ++m) c += V[m * 6 + k] * b[m];
        c /= lam;
        for (int m = 0; m < 6; ++m) x[m] += c * V[m * 6 + k];
    }
}

// Gaussian elimination with partial pivoting (LAPACK getrf/getrs); false when exactly singular
__device__ bool lu_solve6(const double A0[36], const double b0[6], double x[6]) {
    double A[36], b[6];
    for (int k = 0; k < 36; ++k) A[k] = A0[k];
    for (int k = 0; k < 6; ++k) b[k] = b0[k];
    for (int c = 0; c < 6; ++c) {
        int piv = c;
        for (int r = c + 1; r < 6; ++r) if (fabs(A[r * 6 + c]) > fabs(A[piv * 6 + c])) piv = r;
        if (A[piv * 6 + c] == 0.0) return false;
        if (piv != c) {
            for (int k = 0; k < 6; ++k) { double t = A[c * 6 + k]; A[c * 6 + k] = A[piv * 6 + k]; A[piv * 6 + k] = t; }
            double t = b[c]; b[c] = b[piv]; b[piv] = t;
        }
        for (int r = c + 1; r < 6; ++r) {
            double f = A[r * 6 + c] / A[c * 6 + c];
            for (int k = c; k < 6; ++k) A[r * 6 + k] -= f * A[c * 6 + k];
            b[r] -= f * b[c];
        }
    }
    for (int r = 5; r >= 0; --r) {
        double v = b[r];
        for (int k = r + 1; k < 6; ++k) v -= A[r * 6 + k] * x[k];
        x[r] = v / A[r * 6 + r];
    }
    return true;
}

extern "C" __global__ void icp_solve(int B, const double* __restrict__ partial,
                                     const long long* __restrict__ prob_blk,
                                     const long long* __restrict__ n_src, double* __restrict__ poses,
                                     int* __restrict__ active, double* __restrict__ rmse,
                                     double* __restrict__ fit, int* __restrict__ its,
                                     int* __restrict__ conv, int it, double tol) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B || !active[b]) return;
    its[b] = it;
    double s[NSTAT];
    for (int k = 0; k < NSTAT; ++k) s[k] = 0.0;
    for (long long q = prob_blk[b]; q < prob_blk[b + 1]; ++q)
        for (int k = 0; k < NSTAT; ++k) s[k] += partial[q * NSTAT + k];
    const double cnt = s[27];
    fit[b] = cnt / (double)n_src[b];
    if (cnt < 6.0) { active[b] = 0; return; }
    rmse[b] = sqrt(s[28] / cnt);
    double A[36], rhs[6], x[6];
    int k = 0;
    for (int a = 0; a < 6; ++a)
        for (int c = a; c < 6; ++c) { A[a * 6 + c] = s[k]; A[c * 6 + a] = s[k]; ++k; }
    for (int a = 0; a < 6; ++a) rhs[a] = s[21 + a];
    if (!lu_solve6(A, rhs, x)) pinv_solve6(A, rhs, x);
    // increment on the left: D = [Rodrigues(x[0:3]) | x[3:6]], pose <- D @ pose
    double D[9] = {1, 0, 0, 0, 1, 0, 0, 0, 1};
    double th = sqrt(x[0] * x[0] + x[1] * x[1] + x[2] * x[2]);
    if (th >= 1e-15) {
        double kx = x[0] / th, ky = x[1] / th, kz = x[2] / th;
        double K[9] = {0, -kz, ky, kz, 0, -kx, -ky, kx, 0};
        double K2[9];
        for (int r = 0; r < 3; ++r)
            for (int c = 0; c < 3; ++c)
                K2[r * 3 + c] = K[r * 3] * K[c] + K[r * 3 + 1] * K[3 + c] + K[r * 3 + 2] * K[6 + c];
        double sn = sin(th), cs1 = 1.0 - cos(th);
        for (int q = 0; q < 9; ++q) D[q] += sn * K[q] + cs1 * K2[q];
    }
    double* T = poses + 16 * b;
    double N[12];
    for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 4; ++c)
            N[r * 4 + c] = D[r * 3] * T[c] + D[r * 3 + 1] * T[4 + c] + D[r * 3 + 2] * T[8 + c]
                           + (c == 3 ? x[3 + r] : 0.0);
    for (int q = 0; q < 12; ++q) T[q] = N[q];
    double step = 0.0;
    for (int a = 0; a < 6; ++a) step += x[a] * x[a];
    if (sqrt(step) < tol) { conv[b] = 1; active[b] = 0; }
}
"""


@functools.lru_cache(maxsize=None)
def _module():
    import cupy as cp

    return cp.RawModule(code=_SOURCE, options=("--std=c++17",))


def blocks(n):
    """The launch layout of per-problem point sets of sizes ``n`` (int64) in chunks of
    :data:`CHUNK` (a chunk never spans two problems): each problem's first block and the end
    (``prob_blk``, (B + 1,)), and each block's problem (int32), first and end point (int64)."""
    B = len(n)
    nblk = -(-n // CHUNK)                                     # ceil; 0 for an empty source
    prob_blk = np.zeros(B + 1, np.int64)
    prob_blk[1:] = np.cumsum(nblk)
    starts = np.zeros(B, np.int64)                            # first point of each problem
    starts[1:] = np.cumsum(n)[:-1]
    within = np.arange(int(prob_blk[-1]), dtype=np.int64) - np.repeat(prob_blk[:-1], nblk)
    return (prob_blk, np.repeat(np.arange(B, dtype=np.int32), nblk), np.repeat(starts, nblk) + within * CHUNK,
            np.repeat(starts + n, nblk))


def icp_batch(sources, source_normals, inits, index, r: float, max_iterations: int, tol: float,
              agree: float):
    """Run the device ICP loop. ``sources``: list of (n_b, 3) float64 host arrays; ``source_normals``:
    a list of the same shapes or None; ``inits``: (B, 4, 4) float64. Returns host arrays
    (poses (B, 4, 4), rmse, fit, iterations, converged)."""
    import cupy as cp

    grid = index.grid
    if r > grid.h * 1.0000001:
        raise ValueError(f"correspondence distance {r} exceeds the grid cell {grid.h}")
    B = len(sources)
    n = np.array([len(s) for s in sources], np.int64)
    prob_blk, blk_prob, blk_start, blk_end = blocks(n)
    nb = int(prob_blk[-1])
    S = cp.asarray(np.ascontiguousarray(np.concatenate(sources), np.float64))
    has_sn = source_normals is not None
    SN = cp.asarray(np.ascontiguousarray(np.concatenate(source_normals), np.float64)) if has_sn else S
    poses = cp.asarray(np.ascontiguousarray(inits, np.float64).reshape(B, 16))
    active = cp.ones(B, cp.int32)
    rmse = cp.full(B, np.nan, cp.float64)
    fit = cp.zeros(B, cp.float64)
    its = cp.zeros(B, cp.int32)
    conv = cp.zeros(B, cp.int32)
    partial = cp.zeros((max(nb, 1), NSTAT), cp.float64)
    d_blk_prob, d_blk_start, d_blk_end = cp.asarray(blk_prob), cp.asarray(blk_start), cp.asarray(blk_end)
    d_prob_blk, d_n = cp.asarray(prob_blk), cp.asarray(n)
    acc_k, solve_k = _module().get_function("icp_accumulate"), _module().get_function("icp_solve")
    g = _grid_args(grid)
    tn = index.normals
    acc_args = (S, SN, np.int32(has_sn), d_blk_prob, d_blk_start, d_blk_end, poses, active, *g,
                grid.order, tn, np.float32(r * r), np.float64(agree), partial)
    sb = (B + 63) // 64
    for it in range(1, int(max_iterations) + 1):
        if nb:
            acc_k((nb,), (CHUNK,), acc_args)
        solve_k((sb,), (64,), (np.int32(B), partial, d_prob_blk, d_n, poses, active, rmse, fit, its,
                               conv, np.int32(it), np.float64(tol)))
        if it % CHECK_EVERY == 0 and it < max_iterations and not int(active.max()):
            break
    out = cp.concatenate([poses.ravel(), rmse, fit, its.astype(cp.float64), conv.astype(cp.float64)]).get()
    P = out[:16 * B].reshape(B, 4, 4)
    rm, ft, it_, cv = out[16 * B:].reshape(4, B)
    return P, rm, ft, it_.astype(int), cv.astype(bool)
