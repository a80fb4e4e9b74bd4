"""The polish (:func:`.refinement.polish_poses`) of a scene held on the device: every pose at once.

The host loop (:mod:`._polish_cpu`) cuts one crop per pose out of the scene, copies it, averages
it into voxels and fits it: on a 300k-point scene about 3.5 ms a pose, most of it the cut, the
copy and the averaging, not the fit. Here:

* the crops are cut together: one pass over the scene keeps the points within any pose's ball
  (the same float32 test as the host's cut), averaged into voxels on the device where asked
  (:func:`~scanforest.kernels.descriptors.keypoints.thin`), and put in one cell list of edge
  ``dist`` (the verification's);
* every pose is fitted in lockstep, an iteration two launches and no transfer (the host looks at
  the active flags every few iterations): ``polish_accumulate`` (one block per 128 model points
  of one pose: move the point by its pose in float64, find its nearest crop point strictly within
  the pose's pairing distance (float32, the verification's search) inside that pose's ball, and
  sum the pair count, both sums and the 3x3 cross products in float64, about the ball's centre)
  and ``polish_solve`` (one thread per pose: its blocks' sums in block order, the least-squares
  rigid step of :func:`~._polish_cpu.polish_fit` (its rotation by Horn's quaternion, the RANSAC
  fits' own, where the host takes an SVD: the same optimum) and its stops: fewer than 3 pairs,
  or a step below 1e-9 (m and rotation entries) or ``iterations`` steps, which end a pose's
  stage (its next pairs within half the distance) or its fit.

A model point pairs with a crop point within ``dist`` of it, and the ball reaches ``2 dist``
beyond the model, so the pairs are those of the host loop as long as a pose moves less than
``dist`` in its fit; the sums differ from it by float64 rounding order and the averaged voxels on
the ball's rim by the points of the other balls in them.
"""
from __future__ import annotations

import functools

import numpy as np

from ._grouping_gpu import HORN
from ._icp_gpu import BLOCK_SUMS, CHUNK, blocks
from ._verification_gpu import GRID_NEAREST, _grid_args

NSTAT = 16       # the pair count, the sums of both points (3 + 3), the 3x3 sum of their products
CHECK_EVERY = 4  # iterations between looks at the active flags

_SOURCE = GRID_NEAREST + BLOCK_SUMS + HORN + r"""
#define NSTAT 16

extern "C" __global__ void ball_union(const float* __restrict__ S, long long n,
                                      const float* __restrict__ C, const float* __restrict__ R2, int nb,
                                      unsigned char* __restrict__ keep) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = S[3 * i], y = S[3 * i + 1], z = S[3 * i + 2];
    unsigned char k = 0;
    for (int b = 0; b < nb && !k; ++b) {
        float dx = x - C[3 * b], dy = y - C[3 * b + 1], dz = z - C[3 * b + 2];
        k = __fadd_rn(__fadd_rn(__fmul_rn(dx, dx), __fmul_rn(dy, dy)), __fmul_rn(dz, dz)) < R2[b];
    }
    keep[i] = k;
}

extern "C" __global__ void polish_accumulate(
        const double* __restrict__ V, const int* __restrict__ blk_prob,
        const long long* __restrict__ blk_start, const long long* __restrict__ blk_end,
        const double* __restrict__ poses, const int* __restrict__ active,
        const double* __restrict__ centre, const float* __restrict__ reach2,
        const float* __restrict__ P, const int* __restrict__ cs, float ox, float oy, float oz,
        float inv_h, int dx, int dy, int dz, const float* __restrict__ pair_r2,
        double* __restrict__ partial) {
    const int blk = blockIdx.x;
    const int b = blk_prob[blk];
    if (!active[b]) return;                       // uniform over the block
    const double* T = poses + 16 * b;
    double acc[NSTAT];
#pragma unroll
    for (int k = 0; k < NSTAT; ++k) acc[k] = 0.0;
    const long long i = blk_start[blk] + threadIdx.x;
    if (i < blk_end[blk]) {
        double sx = V[3 * i], sy = V[3 * i + 1], sz = V[3 * i + 2];
        double px = T[0] * sx + T[1] * sy + T[2] * sz + T[3];
        double py = T[4] * sx + T[5] * sy + T[6] * sz + T[7];
        double pz = T[8] * sx + T[9] * sy + T[10] * sz + T[11];
        float best;
        int bi = grid_nearest((float)px, (float)py, (float)pz, P, cs, ox, oy, oz, inv_h,
                              dx, dy, dz, pair_r2[b], &best);
        if (bi >= 0) {
            float qx = P[3 * bi], qy = P[3 * bi + 1], qz = P[3 * bi + 2];
            const double cx = centre[3 * b], cy = centre[3 * b + 1], cz = centre[3 * b + 2];
            float ex = qx - (float)cx, ey = qy - (float)cy, ez = qz - (float)cz;
            // only this pose's crop: the points within its ball (the host's float32 cut)
            if (__fadd_rn(__fadd_rn(__fmul_rn(ex, ex), __fmul_rn(ey, ey)), __fmul_rn(ez, ez)) < reach2[b]) {
                double a[3] = {px - cx, py - cy, pz - cz};
                double q[3] = {(double)qx - cx, (double)qy - cy, (double)qz - cz};
                acc[0] = 1.0;
#pragma unroll
                for (int k = 0; k < 3; ++k) { acc[1 + k] = a[k]; acc[4 + k] = q[k]; }
#pragma unroll
                for (int r = 0; r < 3; ++r)
#pragma unroll
                    for (int c = 0; c < 3; ++c) acc[7 + 3 * r + c] = a[r] * q[c];
            }
        }
    }
    block_sums<NSTAT>(acc, partial, blk);
}

// one thread per pose: its blocks' sums in block order, the Umeyama step (Horn's rotation of the
// cross-covariance about the centroids), the pose updated; a step below 1e-9 or max_it steps end
// the pose's stage (its next pairs within half the distance) or, after the last, its fit; fewer
// than 3 pairs end its fit with the pose as it is
extern "C" __global__ void polish_solve(int B, const double* __restrict__ partial,
                                        const long long* __restrict__ prob_blk, double* __restrict__ poses,
                                        int* __restrict__ active, const double* __restrict__ centre,
                                        int* __restrict__ stage, int* __restrict__ its,
                                        float* __restrict__ pair_r2, int stages, int max_it, double dist) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B || !active[b]) return;
    double s[NSTAT];
    for (int k = 0; k < NSTAT; ++k) s[k] = 0.0;
    for (long long q = prob_blk[b]; q < prob_blk[b + 1]; ++q)
        for (int k = 0; k < NSTAT; ++k) s[k] += partial[q * NSTAT + k];
    const double cnt = s[0];
    if (cnt < 3.0) { active[b] = 0; return; }
    double ca[3], cb[3], H[9], R[9], t[3];
    for (int k = 0; k < 3; ++k) { ca[k] = s[1 + k] / cnt; cb[k] = s[4 + k] / cnt; }
    for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 3; ++c) H[3 * r + c] = s[7 + 3 * r + c] - cnt * (ca[r] * cb[c]);
    horn(H, R);
    const double* C = centre + 3 * b;
    double big = 0.0;
    for (int r = 0; r < 3; ++r) {
        t[r] = (cb[r] + C[r]) - (R[3 * r] * (ca[0] + C[0]) + R[3 * r + 1] * (ca[1] + C[1])
                                 + R[3 * r + 2] * (ca[2] + C[2]));
        big = fmax(big, fabs(t[r]));
        for (int c = 0; c < 3; ++c) big = fmax(big, fabs(R[3 * r + c] - (r == c ? 1.0 : 0.0)));
    }
    double* T = poses + 16 * b;
    double N[12];
    for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 4; ++c)
            N[r * 4 + c] = R[3 * r] * T[c] + R[3 * r + 1] * T[4 + c] + R[3 * r + 2] * T[8 + c]
                           + (c == 3 ? t[r] : 0.0);
    for (int q = 0; q < 12; ++q) T[q] = N[q];
    if (big < 1e-9 || ++its[b] >= max_it) {
        its[b] = 0;
        if (++stage[b] >= stages) { active[b] = 0; return; }
        double d = dist / exp2((double)stage[b]);
        pair_r2[b] = (float)(d * d);
    }
}
"""


@functools.lru_cache(maxsize=None)
def _module():
    import cupy as cp

    return cp.RawModule(code=_SOURCE, options=("--std=c++17",))


def crops(scene, centres, reach, voxel):
    """The scene points (CuPy float32 (N, 3)) within ``reach[b]`` of ``centres[b]`` for any
    ``b`` (float32 distances, as the host's cut), in scene order, averaged into voxels of edge
    ``voxel`` when given."""
    import cupy as cp

    S = cp.ascontiguousarray(scene, cp.float32)
    n = int(S.shape[0])
    C = cp.asarray(np.ascontiguousarray(centres, np.float32))
    R2 = cp.asarray(np.square(np.asarray(reach, np.float64)).astype(np.float32))
    keep = cp.empty(n, cp.uint8)
    if n:
        _module().get_function("ball_union")(((n + 255) // 256,), (256,),
                                             (S, np.int64(n), C, R2, np.int32(len(reach)), keep))
    crop = S[keep.view(cp.bool_)]
    if voxel is not None and int(crop.shape[0]):
        from ..descriptors.keypoints import thin

        crop = thin(crop, float(voxel), "gpu")
    return crop


def polish_batch(sources, inits, centres, reach, crop, dist: float, iterations: int, stages: int = 1):
    """Point-to-point ICP of every source (float64 (m_b, 3) host arrays, m_b >= 3) from its
    pose (``inits`` (B, 4, 4) float64) against the points of ``crop`` (CuPy float32) within
    ``reach[b]`` of ``centres[b]``, pairs within ``dist`` and then, stage after stage, within
    ``dist / 2^k`` (each stage to its stop or ``iterations``; a pose goes to its next stage on
    its own): the fitted poses, (B, 4, 4) float64 on the host."""
    import cupy as cp

    from ._verification_gpu import build_grid

    B = len(sources)
    T = np.array(inits, np.float64).reshape(B, 4, 4)
    if B == 0 or int(crop.shape[0]) < 3:
        return T
    grid = build_grid(cp.ascontiguousarray(crop, cp.float32), dist)
    prob_blk, blk_prob, blk_start, blk_end = blocks(np.array([len(s) for s in sources], np.int64))
    nb = int(prob_blk[-1])
    d_blk_prob, d_blk_start, d_blk_end = cp.asarray(blk_prob), cp.asarray(blk_start), cp.asarray(blk_end)
    V = cp.asarray(np.ascontiguousarray(np.concatenate(sources), np.float64))
    c = np.ascontiguousarray(centres, np.float64).reshape(B, 3)
    d_c = cp.asarray(c)
    d_r2 = cp.asarray(np.square(np.asarray(reach, np.float64)).astype(np.float32))
    d_active = cp.ones(B, cp.int32)
    d_poses = cp.asarray(T.reshape(B, 16))
    d_stage = cp.zeros(B, cp.int32)  # each pose's stage and its steps in it
    d_its = cp.zeros(B, cp.int32)
    d_pair_r2 = cp.full(B, np.float32(dist * dist), cp.float32)
    d_prob_blk = cp.asarray(prob_blk)
    partial = cp.zeros((nb, NSTAT), cp.float64)
    acc_k, solve_k = _module().get_function("polish_accumulate"), _module().get_function("polish_solve")
    acc_args = (V, d_blk_prob, d_blk_start, d_blk_end, d_poses, d_active, d_c, d_r2, *_grid_args(grid),
                d_pair_r2, partial)
    solve_args = (np.int32(B), partial, d_prob_blk, d_poses, d_active, d_c, d_stage, d_its, d_pair_r2,
                  np.int32(stages), np.int32(iterations), np.float64(dist))
    sb = (B + 63) // 64
    last = int(stages) * int(iterations)  # no pose takes more steps
    for it in range(1, last + 1):
        acc_k((nb,), (CHUNK,), acc_args)
        solve_k((sb,), (64,), solve_args)
        if it % CHECK_EVERY == 0 and it < last and not int(d_active.max()):
            break
    T = d_poses.get().reshape(B, 4, 4)
    return T
