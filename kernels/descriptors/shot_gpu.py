"""CUDA source and drivers of the GPU normals and SHOT352 (CuPy RawModule, compiled lazily).

Mapping: a group of ``LPK`` lanes (LPK in {4, 8, 16, 32}; a sub-warp or a whole warp) per
keypoint. The group strides over the keypoint's neighbour list (CSR from the grid search,
entries pointing into the cell-sorted surface, so that a group's loads are mostly contiguous):

1. frame: the (R - d)-weighted covariance in float64, reduced with ``__shfl_xor_sync``; every
   lane solves the same 3x3 problem (float64 Jacobi, the CPU backend's algorithm); the sign
   votes are reduced the same way; a tied vote ranks the neighbours by (distance, index) to
   find the 5 around the median, as PCL does;
2. histogram: each group owns 352 float32 bins in shared memory and adds the (up to 5)
   interpolated contributions of every neighbour with shared-memory atomics;
3. L2 normalisation and the store.

Measured on an H200 (``scanforest bench shot``, PCL Kinect scene, 241k keypoints, 100M neighbour
entries): the SHOT kernel takes 11.2 / 14.9 / 25.8 / 49.3 ms with 32 / 16 / 8 / 4 lanes per
keypoint, so a whole warp per keypoint is the default.

All code paths that shuffle are uniform across the warp (groups without work run empty
loops). The module is compiled with ``--fmad=false`` so that float32/float64 arithmetic rounds
exactly as the numba backend does.
"""
from __future__ import annotations

import functools

import numpy as np

from ..neighbors import search_gpu as ng

LPK_CHOICES = (4, 8, 16, 32)
DEFAULT_LPK = 32   # measured fastest (bench shot, H200): 32 > 16 > 8 > 4 lanes per keypoint
BLOCK = 128

_SOURCE = r"""
#define FULL_MASK 0xffffffffu
#define NBINS 10
#define DESC_LEN 352
#define PST_RAD_45 0.78539816339744830961566084581988
#define PST_RAD_90 1.5707963267948966192313216916398
#define PST_RAD_135 2.3561944901923449288469825374596
#define PST_RAD_PI_7_8 2.7488935718910690836548129603691

__device__ __forceinline__ float dot32(float ax, float ay, float az, float bx, float by, float bz) {
    return __fadd_rn(__fadd_rn(__fmul_rn(ax, bx), __fmul_rn(ay, by)), __fmul_rn(az, bz));
}

// Cyclic Jacobi, float64: identical operations to kernels/geom_cpu.py::eig3.
__device__ bool eig3(double a00, double a01, double a02, double a11, double a12, double a22,
                     double w[3], double V[3][3]) {
    double A[3][3] = {{a00, a01, a02}, {a01, a11, a12}, {a02, a12, a22}};
    for (int i = 0; i < 3; ++i) for (int j = 0; j < 3; ++j) V[i][j] = (i == j) ? 1.0 : 0.0;
    if (!(isfinite(a00) && isfinite(a01) && isfinite(a02) && isfinite(a11) && isfinite(a12) && isfinite(a22))) {
        w[0] = w[1] = w[2] = nan("");
        return false;
    }
    for (int sweep = 0; sweep < 32; ++sweep) {
        double off = __dadd_rn(__dadd_rn(__dmul_rn(A[0][1], A[0][1]), __dmul_rn(A[0][2], A[0][2])), __dmul_rn(A[1][2], A[1][2]));
        double dia = __dadd_rn(__dadd_rn(__dmul_rn(A[0][0], A[0][0]), __dmul_rn(A[1][1], A[1][1])), __dmul_rn(A[2][2], A[2][2]));
        if (off <= __dmul_rn(1e-34, dia) || off == 0.0) break;
        #pragma unroll
        for (int pq = 0; pq < 3; ++pq) {
            int p = (pq == 2) ? 1 : 0;
            int q = (pq == 0) ? 1 : 2;
            double apq = A[p][q];
            if (apq == 0.0) continue;
            double theta = __ddiv_rn(__dsub_rn(A[q][q], A[p][p]), __dmul_rn(2.0, apq));
            double t = __ddiv_rn(1.0, __dadd_rn(fabs(theta), __dsqrt_rn(__dadd_rn(__dmul_rn(theta, theta), 1.0))));
            if (theta < 0.0) t = -t;
            double c = __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(__dmul_rn(t, t), 1.0)));
            double s = __dmul_rn(t, c);
            #pragma unroll
            for (int k = 0; k < 3; ++k) {
                double akp = A[k][p], akq = A[k][q];
                A[k][p] = __dsub_rn(__dmul_rn(c, akp), __dmul_rn(s, akq));
                A[k][q] = __dadd_rn(__dmul_rn(s, akp), __dmul_rn(c, akq));
            }
            #pragma unroll
            for (int k = 0; k < 3; ++k) {
                double apk = A[p][k], aqk = A[q][k];
                A[p][k] = __dsub_rn(__dmul_rn(c, apk), __dmul_rn(s, aqk));
                A[q][k] = __dadd_rn(__dmul_rn(s, apk), __dmul_rn(c, aqk));
            }
            #pragma unroll
            for (int k = 0; k < 3; ++k) {
                double vkp = V[k][p], vkq = V[k][q];
                V[k][p] = __dsub_rn(__dmul_rn(c, vkp), __dmul_rn(s, vkq));
                V[k][q] = __dadd_rn(__dmul_rn(s, vkp), __dmul_rn(c, vkq));
            }
        }
    }
    for (int i = 0; i < 3; ++i) for (int j = 0; j < 3; ++j) if (fabs(V[i][j]) < 1e-15) V[i][j] = 0.0;
    double d0 = A[0][0], d1 = A[1][1], d2 = A[2][2], tmp;
    int o0 = 0, o1 = 1, o2 = 2, ti;
    if (d1 < d0) { tmp = d0; d0 = d1; d1 = tmp; ti = o0; o0 = o1; o1 = ti; }
    if (d2 < d1) { tmp = d1; d1 = d2; d2 = tmp; ti = o1; o1 = o2; o2 = ti; }
    if (d1 < d0) { tmp = d0; d0 = d1; d1 = tmp; ti = o0; o0 = o1; o1 = ti; }
    w[0] = d0; w[1] = d1; w[2] = d2;
    double T[3][3];
    for (int k = 0; k < 3; ++k) { T[k][0] = V[k][o0]; T[k][1] = V[k][o1]; T[k][2] = V[k][o2]; }
    for (int k = 0; k < 3; ++k) for (int j = 0; j < 3; ++j) V[k][j] = T[k][j];
    return isfinite(d0) && isfinite(d1) && isfinite(d2);
}

template <int LPK>
__device__ __forceinline__ double gsum(double v) {
    #pragma unroll
    for (int o = LPK / 2; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
template <int LPK>
__device__ __forceinline__ int gsumi(int v) {
    #pragma unroll
    for (int o = LPK / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// ------------------------------------------------------------------------------------------
// Normals: centroid + covariance (float64, two passes), smallest eigenvector, viewpoint flip.
// ------------------------------------------------------------------------------------------
template <int LPK>
__device__ void normals_body(const float* __restrict__ Q, int nq, const float* __restrict__ P,
                             const long long* __restrict__ off, const int* __restrict__ nidx,
                             double vpx, double vpy, double vpz, float* __restrict__ out_n,
                             float* __restrict__ out_c) {
    int g = (blockIdx.x * blockDim.x + threadIdx.x) / LPK;
    int lane = threadIdx.x % LPK;
    bool active = g < nq;
    long long s = active ? off[g] : 0, e = active ? off[g + 1] : 0;
    long long cnt = e - s;
    double cx = 0, cy = 0, cz = 0;
    for (long long j = s + lane; j < e; j += LPK) {
        int p = nidx[j];
        if (p < 0) continue;
        cx = __dadd_rn(cx, (double)P[3 * p]); cy = __dadd_rn(cy, (double)P[3 * p + 1]); cz = __dadd_rn(cz, (double)P[3 * p + 2]);
    }
    cx = gsum<LPK>(cx); cy = gsum<LPK>(cy); cz = gsum<LPK>(cz);
    double dn = (double)(cnt > 0 ? cnt : 1);
    cx = __ddiv_rn(cx, dn); cy = __ddiv_rn(cy, dn); cz = __ddiv_rn(cz, dn);
    double c00 = 0, c01 = 0, c02 = 0, c11 = 0, c12 = 0, c22 = 0;
    for (long long j = s + lane; j < e; j += LPK) {
        int p = nidx[j];
        if (p < 0) continue;
        double dx = __dsub_rn((double)P[3 * p], cx), dy = __dsub_rn((double)P[3 * p + 1], cy), dz = __dsub_rn((double)P[3 * p + 2], cz);
        c00 = __dadd_rn(c00, __dmul_rn(dx, dx)); c01 = __dadd_rn(c01, __dmul_rn(dx, dy));
        c02 = __dadd_rn(c02, __dmul_rn(dx, dz)); c11 = __dadd_rn(c11, __dmul_rn(dy, dy));
        c12 = __dadd_rn(c12, __dmul_rn(dy, dz)); c22 = __dadd_rn(c22, __dmul_rn(dz, dz));
    }
    c00 = gsum<LPK>(c00); c01 = gsum<LPK>(c01); c02 = gsum<LPK>(c02);
    c11 = gsum<LPK>(c11); c12 = gsum<LPK>(c12); c22 = gsum<LPK>(c22);
    if (!active || lane != 0) return;
    float nanf_ = __int_as_float(0x7fc00000);
    if (cnt < 3) {
        out_n[3 * g] = out_n[3 * g + 1] = out_n[3 * g + 2] = nanf_; out_c[g] = nanf_;
        return;
    }
    c00 = __ddiv_rn(c00, dn); c01 = __ddiv_rn(c01, dn); c02 = __ddiv_rn(c02, dn);
    c11 = __ddiv_rn(c11, dn); c12 = __ddiv_rn(c12, dn); c22 = __ddiv_rn(c22, dn);
    double w[3], V[3][3];
    if (!eig3(c00, c01, c02, c11, c12, c22, w, V)) {
        out_n[3 * g] = out_n[3 * g + 1] = out_n[3 * g + 2] = nanf_; out_c[g] = nanf_;
        return;
    }
    double nx = V[0][0], ny = V[1][0], nz = V[2][0];
    double tr = __dadd_rn(__dadd_rn(c00, c11), c22);
    double curv = tr != 0.0 ? fabs(__ddiv_rn(w[0], tr)) : 0.0;
    if (w[1] <= __dmul_rn(1e-12, tr)) {  // collinear / coincident: undefined normal (PCL: NaN)
        out_n[3 * g] = out_n[3 * g + 1] = out_n[3 * g + 2] = nanf_; out_c[g] = (float)curv;
        return;
    }
    double vx = __dsub_rn(vpx, (double)Q[3 * g]), vy = __dsub_rn(vpy, (double)Q[3 * g + 1]), vz = __dsub_rn(vpz, (double)Q[3 * g + 2]);
    if (__dadd_rn(__dadd_rn(__dmul_rn(vx, nx), __dmul_rn(vy, ny)), __dmul_rn(vz, nz)) < 0.0) { nx = -nx; ny = -ny; nz = -nz; }
    out_n[3 * g] = (float)nx; out_n[3 * g + 1] = (float)ny; out_n[3 * g + 2] = (float)nz;
    out_c[g] = (float)curv;
}

extern "C" __global__ void normals8(const float* Q, int nq, const float* P, const long long* off, const int* nidx,
                                    double vpx, double vpy, double vpz, float* out_n, float* out_c) {
    normals_body<8>(Q, nq, P, off, nidx, vpx, vpy, vpz, out_n, out_c);
}
extern "C" __global__ void normals32(const float* Q, int nq, const float* P, const long long* off, const int* nidx,
                                     double vpx, double vpy, double vpz, float* out_n, float* out_c) {
    normals_body<32>(Q, nq, P, off, nidx, vpx, vpy, vpz, out_n, out_c);
}

// ------------------------------------------------------------------------------------------
// SHOT352: one group of LPK lanes per keypoint.
// ------------------------------------------------------------------------------------------
template <int LPK>
__device__ void shot_body(const float* __restrict__ KP, int nk, const float* __restrict__ P,
                          const float* __restrict__ N, const int* __restrict__ order,
                          const long long* __restrict__ off, const int* __restrict__ nidx,
                          const float* __restrict__ nd2, double R, float* __restrict__ desc,
                          float* __restrict__ frames) {
    constexpr int GPB = 128 / LPK;
    __shared__ float hist[GPB][DESC_LEN];
    int gl = threadIdx.x / LPK;
    int g = blockIdx.x * GPB + gl;
    int lane = threadIdx.x % LPK;
    bool active = g < nk;
    long long s = active ? off[g] : 0, e = active ? off[g + 1] : 0;
    float cx = active ? KP[3 * g] : 0.f, cy = active ? KP[3 * g + 1] : 0.f, cz = active ? KP[3 * g + 2] : 0.f;
    const float nanf_ = __int_as_float(0x7fc00000);

    // ---- 1. weighted covariance --------------------------------------------------------
    double c00 = 0, c01 = 0, c02 = 0, c11 = 0, c12 = 0, c22 = 0, wsum = 0;
    int valid = 0;
    for (long long j = s + lane; j < e; j += LPK) {
        int p = nidx[j];
        float px = P[3 * p], py = P[3 * p + 1], pz = P[3 * p + 2];
        if (px == cx && py == cy && pz == cz) continue;
        double vx = (double)__fsub_rn(px, cx), vy = (double)__fsub_rn(py, cy), vz = (double)__fsub_rn(pz, cz);
        double w = __dsub_rn(R, (double)__fsqrt_rn(nd2[j]));
        c00 = __dadd_rn(c00, __dmul_rn(w, __dmul_rn(vx, vx)));
        c01 = __dadd_rn(c01, __dmul_rn(w, __dmul_rn(vx, vy)));
        c02 = __dadd_rn(c02, __dmul_rn(w, __dmul_rn(vx, vz)));
        c11 = __dadd_rn(c11, __dmul_rn(w, __dmul_rn(vy, vy)));
        c12 = __dadd_rn(c12, __dmul_rn(w, __dmul_rn(vy, vz)));
        c22 = __dadd_rn(c22, __dmul_rn(w, __dmul_rn(vz, vz)));
        wsum = __dadd_rn(wsum, w);
        ++valid;
    }
    c00 = gsum<LPK>(c00); c01 = gsum<LPK>(c01); c02 = gsum<LPK>(c02);
    c11 = gsum<LPK>(c11); c12 = gsum<LPK>(c12); c22 = gsum<LPK>(c22);
    wsum = gsum<LPK>(wsum);
    valid = gsumi<LPK>(valid);
    bool ok = active && valid >= 5;
    double x0 = 0, x1 = 0, x2 = 0, z0 = 0, z1 = 0, z2 = 0;
    if (ok) {
        double ev[3], V[3][3];
        ok = eig3(__ddiv_rn(c00, wsum), __ddiv_rn(c01, wsum), __ddiv_rn(c02, wsum), __ddiv_rn(c11, wsum),
                  __ddiv_rn(c12, wsum), __ddiv_rn(c22, wsum), ev, V);
        x0 = V[0][2]; x1 = V[1][2]; x2 = V[2][2];
        z0 = V[0][0]; z1 = V[1][0]; z2 = V[2][0];
    }
    // ---- 2. sign votes -------------------------------------------------------------------
    int px_ = 0, pz_ = 0;
    long long vs = ok ? s : 0, ve = ok ? e : 0;
    for (long long j = vs + lane; j < ve; j += LPK) {
        int p = nidx[j];
        float qx = P[3 * p], qy = P[3 * p + 1], qz = P[3 * p + 2];
        if (qx == cx && qy == cy && qz == cz) continue;
        double vx = (double)__fsub_rn(qx, cx), vy = (double)__fsub_rn(qy, cy), vz = (double)__fsub_rn(qz, cz);
        if (__dadd_rn(__dadd_rn(__dmul_rn(vx, x0), __dmul_rn(vy, x1)), __dmul_rn(vz, x2)) >= 0.0) ++px_;
        if (__dadd_rn(__dadd_rn(__dmul_rn(vx, z0), __dmul_rn(vy, z1)), __dmul_rn(vz, z2)) >= 0.0) ++pz_;
    }
    px_ = 2 * gsumi<LPK>(px_) - valid;
    pz_ = 2 * gsumi<LPK>(pz_) - valid;
    bool tie = ok && (px_ == 0 || pz_ == 0);
    if (__any_sync(FULL_MASK, tie)) {
        // the 5 non-coincident neighbours around the median of the (distance, index) order
        int med = valid / 2, tx = 0, tz = 0;
        long long ts = tie ? s : 0, te = tie ? e : 0;
        for (long long j = ts + lane; j < te; j += LPK) {
            int p = nidx[j];
            float qx = P[3 * p], qy = P[3 * p + 1], qz = P[3 * p + 2];
            if (qx == cx && qy == cy && qz == cz) continue;
            float dj = nd2[j];
            int oj = order[p], rank = 0;
            for (long long t = s; t < e && rank <= med + 2; ++t) {
                float dt = nd2[t];
                if (dt > dj) continue;
                int pt = nidx[t];
                // only a zero distance can belong to a point coinciding with the keypoint
                if (dt == 0.f && P[3 * pt] == cx && P[3 * pt + 1] == cy && P[3 * pt + 2] == cz) continue;
                if (dt < dj || order[pt] < oj) ++rank;
            }
            if (rank >= med - 2 && rank <= med + 2) {
                double vx = (double)__fsub_rn(qx, cx), vy = (double)__fsub_rn(qy, cy), vz = (double)__fsub_rn(qz, cz);
                if (__dadd_rn(__dadd_rn(__dmul_rn(vx, x0), __dmul_rn(vy, x1)), __dmul_rn(vz, x2)) > 0.0) ++tx;
                if (__dadd_rn(__dadd_rn(__dmul_rn(vx, z0), __dmul_rn(vy, z1)), __dmul_rn(vz, z2)) > 0.0) ++tz;
            }
        }
        tx = gsumi<LPK>(tx); tz = gsumi<LPK>(tz);
        if (tie && px_ == 0) px_ = tx < 3 ? -1 : 1;
        if (tie && pz_ == 0) pz_ = tz < 3 ? -1 : 1;
    }
    if (px_ < 0) { x0 = -x0; x1 = -x1; x2 = -x2; }
    if (pz_ < 0) { z0 = -z0; z1 = -z1; z2 = -z2; }
    float fx0 = (float)x0, fx1 = (float)x1, fx2 = (float)x2;
    float fz0 = (float)z0, fz1 = (float)z1, fz2 = (float)z2;
    float fy0 = __fsub_rn(__fmul_rn(fz1, fx2), __fmul_rn(fz2, fx1));
    float fy1 = __fsub_rn(__fmul_rn(fz2, fx0), __fmul_rn(fz0, fx2));
    float fy2 = __fsub_rn(__fmul_rn(fz0, fx1), __fmul_rn(fz1, fx0));
    bool describe = ok && (e - s) >= 5;

    // ---- 3. histogram ----------------------------------------------------------------------
    float* h = hist[gl];
    for (int b = lane; b < DESC_LEN; b += LPK) h[b] = 0.f;
    __syncwarp();
    const double r12 = R / 2, r14 = R / 4, r34 = (R * 3) / 4;
    long long hs = describe ? s : 0, he = describe ? e : 0;
    for (long long j = hs + lane; j < he; j += LPK) {
        int p = nidx[j];
        float nx = N[3 * p], ny = N[3 * p + 1], nz = N[3 * p + 2];
        if (!(isfinite(nx) && isfinite(ny) && isfinite(nz))) continue;
        double distance = (double)__fsqrt_rn(nd2[j]);
        if (fabs(distance) < 1e-15) continue;
        double cosd = (double)dot32(nx, ny, nz, fz0, fz1, fz2);
        if (cosd > 1.0) cosd = 1.0;
        if (cosd < -1.0) cosd = -1.0;
        double bdist = __ddiv_rn(__dmul_rn(__dadd_rn(1.0, cosd), (double)NBINS), 2.0);
        float dx = __fsub_rn(P[3 * p], cx), dy = __fsub_rn(P[3 * p + 1], cy), dz = __fsub_rn(P[3 * p + 2], cz);
        double xr = (double)dot32(dx, dy, dz, fx0, fx1, fx2);
        double yr = (double)dot32(dx, dy, dz, fy0, fy1, fy2);
        double zr = (double)dot32(dx, dy, dz, fz0, fz1, fz2);
        if (fabs(yr) < 1e-30) yr = 0;
        if (fabs(xr) < 1e-30) xr = 0;
        if (fabs(zr) < 1e-30) zr = 0;
        int bit4 = ((yr > 0) || ((yr == 0.0) && (xr < 0))) ? 1 : 0;
        int bit3 = ((xr > 0) || ((xr == 0.0) && (yr > 0))) ? !bit4 : bit4;
        int di = ((bit4 << 3) + (bit3 << 2)) << 1;
        if ((__dmul_rn(xr, yr) > 0) || (xr == 0.0)) di += (fabs(xr) >= fabs(yr)) ? 0 : 4;
        else di += (fabs(xr) > fabs(yr)) ? 4 : 0;
        di += zr > 0 ? 1 : 0;
        di += (distance > r12) ? 2 : 0;
        int step = (int)floor(__dadd_rn(bdist, 0.5));
        int vol = di * (NBINS + 1);
        bdist = __dsub_rn(bdist, (double)step);
        double iw = __dsub_rn(1.0, fabs(bdist));
        if (bdist > 0) atomicAdd(&h[vol + ((step + 1) % NBINS)], (float)bdist);
        else atomicAdd(&h[vol + ((step - 1 + NBINS) % NBINS)], -(float)bdist);
        if (distance > r12) {
            double rd = __ddiv_rn(__dsub_rn(distance, r34), r12);
            if (distance > r34) iw = __dadd_rn(iw, __dsub_rn(1.0, rd));
            else { iw = __dadd_rn(iw, __dadd_rn(1.0, rd)); atomicAdd(&h[(di - 2) * (NBINS + 1) + step], -(float)rd); }
        } else {
            double rd = __ddiv_rn(__dsub_rn(distance, r14), r12);
            if (distance < r14) iw = __dadd_rn(iw, __dadd_rn(1.0, rd));
            else { iw = __dadd_rn(iw, __dsub_rn(1.0, rd)); atomicAdd(&h[(di + 2) * (NBINS + 1) + step], (float)rd); }
        }
        double icos = __ddiv_rn(zr, distance);
        if (icos < -1.0) icos = -1.0;
        if (icos > 1.0) icos = 1.0;
        double incl = acos(icos);
        if (incl > PST_RAD_90 || (fabs(__dsub_rn(incl, PST_RAD_90)) < 1e-30 && zr <= 0)) {
            double idist = __ddiv_rn(__dsub_rn(incl, PST_RAD_135), PST_RAD_90);
            if (incl > PST_RAD_135) iw = __dadd_rn(iw, __dsub_rn(1.0, idist));
            else { iw = __dadd_rn(iw, __dadd_rn(1.0, idist)); atomicAdd(&h[(di + 1) * (NBINS + 1) + step], -(float)idist); }
        } else {
            double idist = __ddiv_rn(__dsub_rn(incl, PST_RAD_45), PST_RAD_90);
            if (incl < PST_RAD_45) iw = __dadd_rn(iw, __dadd_rn(1.0, idist));
            else { iw = __dadd_rn(iw, __dsub_rn(1.0, idist)); atomicAdd(&h[(di - 1) * (NBINS + 1) + step], (float)idist); }
        }
        if (yr != 0.0 || xr != 0.0) {
            double az = atan2(yr, xr);
            int sel = di >> 2;
            double ad = __ddiv_rn(__dsub_rn(az, __dadd_rn(-PST_RAD_PI_7_8, __dmul_rn(PST_RAD_45, (double)sel))), PST_RAD_45);
            ad = fmax(-0.5, fmin(ad, 0.5));
            if (ad > 0) {
                iw = __dadd_rn(iw, __dsub_rn(1.0, ad));
                atomicAdd(&h[((di + 4) % 32) * (NBINS + 1) + step], (float)ad);
            } else {
                iw = __dadd_rn(iw, __dadd_rn(1.0, ad));
                atomicAdd(&h[((di - 4 + 32) % 32) * (NBINS + 1) + step], -(float)ad);
            }
        }
        atomicAdd(&h[vol + step], (float)iw);
    }
    __syncwarp();
    // ---- 4. L2 normalisation + store -------------------------------------------------------
    double acc = 0;
    for (int b = lane; b < DESC_LEN; b += LPK) { float v = h[b]; acc = __dadd_rn(acc, (double)__fmul_rn(v, v)); }
    acc = gsum<LPK>(acc);
    float fa = (float)sqrt(acc);
    if (active) {
        float* out = desc + (long long)g * DESC_LEN;
        for (int b = lane; b < DESC_LEN; b += LPK) out[b] = describe ? __fdiv_rn(h[b], fa) : nanf_;
        if (lane == 0) {
            float* f = frames + 9LL * g;
            if (describe) {
                f[0] = fx0; f[1] = fx1; f[2] = fx2; f[3] = fy0; f[4] = fy1; f[5] = fy2; f[6] = fz0; f[7] = fz1; f[8] = fz2;
            } else {
                for (int t = 0; t < 9; ++t) f[t] = nanf_;
            }
        }
    }
}

#define SHOT_ENTRY(L) \
extern "C" __global__ void __launch_bounds__(128) shot##L(const float* KP, int nk, const float* P, const float* N, \
        const int* order, const long long* off, const int* nidx, const float* nd2, double R, float* desc, float* frames) { \
    shot_body<L>(KP, nk, P, N, order, off, nidx, nd2, R, desc, frames); }
SHOT_ENTRY(4)
SHOT_ENTRY(8)
SHOT_ENTRY(16)
SHOT_ENTRY(32)
"""


@functools.lru_cache(maxsize=None)
def _module():
    import cupy as cp

    return cp.RawModule(code=_SOURCE, options=("--std=c++17", "--fmad=false"))


def kernel(name):
    return _module().get_function(name)


# ---------------------------------------------------------------------------------------------
# normals
# ---------------------------------------------------------------------------------------------
def normals_gpu(pts, surf, *, k=None, radius=None, viewpoint=(0, 0, 0), grid=None,
                batch_entries: int = 1 << 28):
    import cupy as cp

    n = pts.shape[0]
    out_n = cp.empty((n, 3), cp.float32)
    out_c = cp.empty(n, cp.float32)
    if n == 0:
        return out_n, out_c
    vp = [np.float64(v) for v in viewpoint]
    if k is not None:
        g = grid if grid is not None else ng.build_grid_knn(surf, k)
        idx, _ = ng.knn(g, pts, k)
        off = cp.arange(0, (n + 1) * k, k, dtype=cp.int64)
        launch_normals(pts, g.points, off, idx.reshape(-1), vp, out_n, out_c, lpk=8)
        return out_n, out_c
    g = grid if grid is not None else ng.build_grid(surf, radius)
    counts = ng.count(g, pts, radius)
    for s, e in batches(counts, batch_entries):
        q = pts[s:e]
        off = ng.offsets_from_counts(counts[s:e])
        idx, _ = ng.fill(g, q, radius, off, int(off[-1]))
        launch_normals(q, g.points, off, idx, vp, out_n[s:e], out_c[s:e], lpk=32)
    return out_n, out_c


def launch_normals(q, P, off, idx, vp, out_n, out_c, *, lpk):
    """Launch the normals kernel (``lpk`` lanes per query) on the CSR lists ``off``/``idx`` into
    the cell-sorted surface ``P``, oriented towards ``vp``; writes ``out_n`` and ``out_c``."""
    nq = q.shape[0]
    grid = ((nq * lpk + BLOCK - 1) // BLOCK,)
    kernel(f"normals{lpk}")(grid, (BLOCK,), (q, np.int32(nq), P, off, idx, *vp, out_n, out_c))


def batches(counts, budget):
    """Split queries into consecutive batches whose lists hold <= ``budget`` entries."""
    import cupy as cp

    n = counts.shape[0]
    csum = cp.cumsum(counts.astype(cp.int64))
    total = int(csum[-1])
    if total <= budget:
        return [(0, n)]
    marks = cp.searchsorted(csum, cp.arange(budget, total, budget, dtype=cp.int64)).get()
    cuts = sorted(set([0] + [int(m) for m in marks if 0 < m < n] + [n]))
    return list(zip(cuts[:-1], cuts[1:]))


# ---------------------------------------------------------------------------------------------
# SHOT
# ---------------------------------------------------------------------------------------------
def shot_gpu(kp, surf, snrm, r, *, approximate=False, cap=None, lpk=None, grid=None,
             batch_entries: int = 1 << 28, timings=None):
    """Descriptors and frames on the GPU (inputs already CuPy float32, validated)."""
    import cupy as cp

    lpk = int(lpk or DEFAULT_LPK)
    if lpk not in LPK_CHOICES:
        raise ValueError(f"lpk must be one of {LPK_CHOICES}")
    nk = kp.shape[0]
    desc = cp.empty((nk, 352), cp.float32)
    frames = cp.empty((nk, 3, 3), cp.float32)
    if nk == 0:
        return desc, frames
    g = grid if grid is not None else ng.build_grid(surf, r)
    nrm = cp.ascontiguousarray(snrm[g.order])
    counts = ng.count(g, kp, r)
    if approximate and cap is None:
        from ._shot_common import median_count

        cap = median_count(counts)
    for s, e in batches(counts, batch_entries):
        q = kp[s:e]
        off = ng.offsets_from_counts(counts[s:e])
        idx, d2 = ng.fill(g, q, r, off, int(off[-1]))
        if approximate:
            off, idx, d2 = ng.cap_lists(g, off, idx, d2, int(cap))
        launch_shot(q, g, nrm, off, idx, d2, r, desc[s:e], frames[s:e], lpk=lpk)
    return desc, frames


def launch_shot(q, g, nrm, off, idx, d2, r, desc, frames, *, lpk=DEFAULT_LPK):
    """Launch the SHOT kernel (``lpk`` lanes per keypoint) on the CSR lists ``off``/``idx``/``d2``
    into the grid ``g`` (normals ``nrm`` in its cell order); writes ``desc`` and ``frames``."""
    nq = q.shape[0]
    gpb = BLOCK // lpk
    kernel(f"shot{lpk}")(((nq + gpb - 1) // gpb,), (BLOCK,),
                         (q, np.int32(nq), g.points, nrm, g.order, off, idx, d2, np.float64(r),
                          desc, frames))
