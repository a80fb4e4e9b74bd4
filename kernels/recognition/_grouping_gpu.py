"""Geometric-consistency grouping on the GPU: PCL's greedy sweep for many groups in one launch.

A group is the distance-sorted correspondences of one (scene, model) pair. One thread block
sweeps one group with PCL's acceptance order, so the labels equal the sequential CPU sweep
(``grouping._gc_sets_nb``) label for label:

* first the pairwise consistency of every group is one bit matrix, computed by all SMs;
* ``W`` warps grow the consensus sets of the next ``W`` untaken seeds at once, each warp one
  seed, against the ``taken`` flags at the start of the round (speculation);
* warp 0 then commits the seeds in order. A seed's speculative set stays exact unless a set
  committed earlier in the round took one of its members (a rejected candidate that became taken
  changes nothing), in which case warp 0 grows it again; a set of more than ``gc_threshold``
  members is kept and its members taken.

A warp grows a set from the seed's bit row (its consistent pairs, 32 words per step), testing
each candidate, in order, against the other members' bits with the warp's lanes spread over
them. The bit matrix takes ``n^2 / 8`` bytes per group (3 MB at 5,000 correspondences). The arithmetic is the CPU sweep's, in float32 without fused multiply-adds (``__fmul_rn``
/ ``__fadd_rn``, IEEE ``sqrtf``), the comparison against ``gc_size`` in float64.
"""
from __future__ import annotations

import numpy as np

WARPS = 32  # seeds grown at once per group (one block of 1,024 threads per group)

_SRC = r"""
#define W %(W)d
#define FULL 0xffffffffu

__device__ __forceinline__ bool gc_ok(const float* S, const float* M, int k, int j, double gc) {
    // correspondence j is consistent with member k (the CPU sweep's arithmetic, no FMA)
    float dsx = __fsub_rn(S[3 * k], S[3 * j]), dsy = __fsub_rn(S[3 * k + 1], S[3 * j + 1]);
    float dsz = __fsub_rn(S[3 * k + 2], S[3 * j + 2]);
    float dmx = __fsub_rn(M[3 * k], M[3 * j]), dmy = __fsub_rn(M[3 * k + 1], M[3 * j + 1]);
    float dmz = __fsub_rn(M[3 * k + 2], M[3 * j + 2]);
    float ds = sqrtf(__fadd_rn(__fadd_rn(__fmul_rn(dsx, dsx), __fmul_rn(dsy, dsy)), __fmul_rn(dsz, dsz)));
    float dm = sqrtf(__fadd_rn(__fadd_rn(__fmul_rn(dmx, dmx), __fmul_rn(dmy, dmy)), __fmul_rn(dmz, dmz)));
    return !((double)fabsf(__fsub_rn(ds, dm)) > gc);
}

// the pairwise consistency of every group as a bit matrix: row j of group g holds bit k when
// pair (j, k) is consistent; one thread per 32-bit word, all SMs busy
extern "C" __global__ void gc_matrix(const float* __restrict__ S_all, const float* __restrict__ M_all,
                                     const long long* __restrict__ offs, const long long* __restrict__ woffs,
                                     double gc, unsigned* __restrict__ C_all) {
    const int g = blockIdx.y;
    const long long o = offs[g];
    const int n = (int)(offs[g + 1] - o);
    const int words = (n + 31) >> 5;
    const long long total = (long long)n * words;
    const float* S = S_all + 3 * o;
    const float* M = M_all + 3 * o;
    unsigned* C = C_all + woffs[g];
    for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < total;
         w += (long long)gridDim.x * blockDim.x) {
        int j = (int)(w / words), k0 = (int)(w %% words) << 5;
        unsigned bits = 0;
        for (int b = 0; b < 32 && k0 + b < n; b++) bits |= (unsigned)gc_ok(S, M, j, k0 + b, gc) << b;
        C[w] = bits;
    }
}

__device__ __forceinline__ bool cbit(const unsigned* C, int words, int j, int k) {
    return (C[(long long)j * words + (k >> 5)] >> (k & 31)) & 1u;
}

// the consensus set of seed i grown by one warp into mt (mt[0] = i); returns its size.
// Candidates are the seed's consistent, untaken pairs in order (bit row i); each joins when
// consistent with every member so far.
__device__ int grow(const unsigned* C, int n, int words, int i, const volatile unsigned char* taken,
                    int* mt, int lane) {
    int m = 1;
    if (lane == 0) mt[0] = i;
    __syncwarp();
    const unsigned* row = C + (long long)i * words;
    for (int base = 0; base < words; base += 32) {
        int wi = base + lane;
        unsigned mine = 0;
        if (wi < words) {
            mine = row[wi];
            if (mine) {  // drop taken pairs and the seed itself
                for (int b = 0; b < 32; b++) {
                    int j = (wi << 5) + b;
                    if (((mine >> b) & 1u) && (j == i || j >= n || taken[j])) mine &= ~(1u << b);
                }
            }
        }
        unsigned any = __ballot_sync(FULL, mine != 0);
        while (any) {  // words in order
            int src = __ffs(any) - 1;
            any &= any - 1;
            unsigned bitsw = __shfl_sync(FULL, mine, src);
            int wbase = (base + src) << 5;
            while (bitsw) {
                int jj = wbase + __ffs(bitsw) - 1;
                bitsw &= bitsw - 1;
                bool bad = false;
                for (int k = 1 + lane; k < m; k += 32)
                    if (!cbit(C, words, jj, mt[k])) { bad = true; break; }
                if (!__any_sync(FULL, bad)) {
                    if (lane == 0) mt[m] = jj;
                    m++;
                    __syncwarp();
                }
            }
        }
    }
    return m;
}

extern "C" __global__ void gc_sweep(const unsigned* __restrict__ C_all, const long long* __restrict__ offs,
                                    const long long* __restrict__ woffs, int thr,
                                    int* members, unsigned char* taken_all, int* labels_all,
                                    int* nsets) {
    const int g = blockIdx.x;
    const long long o = offs[g];
    const int n = (int)(offs[g + 1] - o);
    const int words = (n + 31) >> 5;
    const unsigned* C = C_all + woffs[g];
    volatile unsigned char* taken = taken_all + o;
    int* labels = labels_all + o;
    int* mem = members + (long long)W * o;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ int seeds[W], cnt[W], ns, pos, ng;
    if (threadIdx.x == 0) { pos = 0; ng = 0; }
    __syncthreads();
    while (true) {
        if (threadIdx.x == 0) {  // the next W untaken seeds, in order
            int k = 0, p = pos;
            while (k < W && p < n) { if (!taken[p]) seeds[k++] = p; p++; }
            ns = k;
            pos = p;
        }
        __syncthreads();
        if (ns == 0) break;
        if (warp < ns) {
            int m = grow(C, n, words, seeds[warp], taken, mem + (long long)warp * n, lane);
            if (lane == 0) cnt[warp] = m;
        }
        __syncthreads();
        if (warp == 0) {  // commit in seed order
            bool dirty = false;
            int label = ng;
            for (int t = 0; t < ns; t++) {
                int i = seeds[t];
                if (taken[i]) continue;
                int* mt = mem + (long long)t * n;
                int m = cnt[t];
                if (dirty) {
                    bool hit = false;
                    for (int k = lane; k < m; k += 32) if (taken[mt[k]]) { hit = true; break; }
                    if (__any_sync(FULL, hit)) m = grow(C, n, words, i, taken, mt, lane);
                }
                if (m > thr) {
                    for (int k = lane; k < m; k += 32) { taken[mt[k]] = 1; labels[mt[k]] = label; }
                    label++;
                    dirty = true;
                    __syncwarp();
                }
            }
            if (lane == 0) ng = label;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) nsets[g] = ng;
}
"""

_kernels: dict = {}


def _kernel():
    import cupy as cp

    dev = cp.cuda.Device().id
    if dev not in _kernels:
        mod = cp.RawModule(code=_SRC % {"W": WARPS}, options=("--std=c++14", "--fmad=false"))
        _kernels[dev] = (mod.get_function("gc_matrix"), mod.get_function("gc_sweep"))
    return _kernels[dev]


def gc_sets_batch(S, M, offsets, gc_size: float, gc_threshold: int):
    """Consensus-set labels of many groups at once.

    Parameters
    ----------
    S, M : (N, 3) float32 CuPy arrays
        Scene and model keypoints of the correspondences, groups back to back, each group
        sorted by descriptor distance (stable).
    offsets : (G + 1,) int64
        Group ``g`` is rows ``offsets[g]:offsets[g + 1]``.

    Returns
    -------
    labels : (N,) int32 CuPy array
        The set of each correspondence within its group (0, 1, ... in acceptance order), -1 when
        in no kept set.
    nsets : (G,) int32 CuPy array
    """
    import cupy as cp

    S = cp.ascontiguousarray(cp.asarray(S), dtype=cp.float32)
    M = cp.ascontiguousarray(cp.asarray(M), dtype=cp.float32)
    offs = cp.asarray(np.asarray(offsets, np.int64) if not isinstance(offsets, cp.ndarray) else offsets,
                      dtype=cp.int64)
    n = int(S.shape[0])
    G = int(offs.shape[0]) - 1
    labels = cp.full(n, -1, cp.int32)
    nsets = cp.zeros(max(G, 0), cp.int32)
    if n == 0 or G <= 0:
        return labels, nsets
    sizes = offs[1:] - offs[:-1]
    words = sizes * ((sizes + 31) // 32)
    woffs = cp.concatenate([cp.zeros(1, cp.int64), cp.cumsum(words)])
    total, widest = (int(v) for v in cp.stack([woffs[-1], words.max()]).get())
    C = cp.empty(max(total, 1), cp.uint32)
    taken = cp.zeros(n, cp.uint8)
    members = cp.empty(WARPS * n, cp.int32)
    k_matrix, k_sweep = _kernel()
    bx = min(max(1, (widest + 255) // 256), 4096)
    k_matrix((bx, G), (256,), (S, M, offs, woffs, np.float64(gc_size), C))
    k_sweep((G,), (32 * WARPS,), (C, offs, woffs, np.int32(gc_threshold), members, taken, labels, nsets))
    return labels, nsets


# ---------------------------------------------------------------------------------------------
# RANSAC rigid fits of many groups at once
# ---------------------------------------------------------------------------------------------
#: Horn's rotation from a 3x3 cross-covariance (CUDA), shared with the polish (._polish_gpu)
HORN = r"""
// Horn (1987): the rotation maximising sum d'^T R s' from the 3x3 cross-covariance H
// (H[a][b] = sum s'_a d'_b): top eigenvector of a symmetric 4x4 by cyclic Jacobi sweeps.
__device__ void horn(const double* H, double* R) {
    double N[4][4], V[4][4];
    double sxx = H[0], sxy = H[1], sxz = H[2], syx = H[3], syy = H[4], syz = H[5], szx = H[6], szy = H[7], szz = H[8];
    N[0][0] = sxx + syy + szz; N[0][1] = N[1][0] = syz - szy; N[0][2] = N[2][0] = szx - sxz;
    N[0][3] = N[3][0] = sxy - syx; N[1][1] = sxx - syy - szz; N[1][2] = N[2][1] = sxy + syx;
    N[1][3] = N[3][1] = szx + sxz; N[2][2] = -sxx + syy - szz; N[2][3] = N[3][2] = syz + szy;
    N[3][3] = -sxx - syy + szz;
    for (int a = 0; a < 4; a++) for (int b = 0; b < 4; b++) V[a][b] = (a == b);
    for (int sweep = 0; sweep < 30; sweep++) {
        double off = 0.0, scale = 0.0;
        for (int p = 0; p < 3; p++) for (int q = p + 1; q < 4; q++) off += N[p][q] * N[p][q];
        for (int p = 0; p < 4; p++) scale += N[p][p] * N[p][p];
        if (off <= 1e-30 * scale || off == 0.0) break;
        for (int p = 0; p < 3; p++) for (int q = p + 1; q < 4; q++) {
            double apq = N[p][q];
            if (apq == 0.0) continue;
            double theta = (N[q][q] - N[p][p]) / (2.0 * apq);
            double t = (theta >= 0 ? 1.0 : -1.0) / (fabs(theta) + sqrt(theta * theta + 1.0));
            double c = 1.0 / sqrt(t * t + 1.0), sn = t * c;
            for (int k = 0; k < 4; k++) { double akp = N[k][p], akq = N[k][q]; N[k][p] = c * akp - sn * akq; N[k][q] = sn * akp + c * akq; }
            for (int k = 0; k < 4; k++) { double apk = N[p][k], aqk = N[q][k]; N[p][k] = c * apk - sn * aqk; N[q][k] = sn * apk + c * aqk; }
            for (int k = 0; k < 4; k++) { double vkp = V[k][p], vkq = V[k][q]; V[k][p] = c * vkp - sn * vkq; V[k][q] = sn * vkp + c * vkq; }
        }
    }
    int best = 0;
    for (int p = 1; p < 4; p++) if (N[p][p] > N[best][best]) best = p;
    double w = V[0][best], x = V[1][best], y = V[2][best], z = V[3][best];
    R[0] = w * w + x * x - y * y - z * z; R[1] = 2.0 * (x * y - w * z); R[2] = 2.0 * (x * z + w * y);
    R[3] = 2.0 * (x * y + w * z); R[4] = w * w - x * x + y * y - z * z; R[5] = 2.0 * (y * z - w * x);
    R[6] = 2.0 * (x * z - w * y); R[7] = 2.0 * (y * z + w * x); R[8] = w * w - x * x - y * y + z * z;
}
"""

_RANSAC_SRC = r"""
#define FULL 0xffffffffu

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

""" + HORN + r"""
__device__ __forceinline__ double wsum(double v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// least-squares fit of the pairs with mask (or the 3 listed ones) by one warp; the pose
// lands in T (12 doubles, row-major 3x4) of every lane
__device__ void fit_warp(const double* S, const double* D, int n, const unsigned char* mask,
                         int lane, double* T) {
    double cs[3] = {0, 0, 0}, cd[3] = {0, 0, 0}, w = 0;
    for (int i = lane; i < n; i += 32) if (mask[i]) {
        w += 1; for (int a = 0; a < 3; a++) { cs[a] += S[3 * i + a]; cd[a] += D[3 * i + a]; }
    }
    w = wsum(w);
    for (int a = 0; a < 3; a++) { cs[a] = wsum(cs[a]) / w; cd[a] = wsum(cd[a]) / w; }
    double H[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = lane; i < n; i += 32) if (mask[i])
        for (int a = 0; a < 3; a++) for (int b = 0; b < 3; b++)
            H[3 * a + b] += (S[3 * i + a] - cs[a]) * (D[3 * i + b] - cd[b]);
    for (int k = 0; k < 9; k++) H[k] = wsum(H[k]);
    double R[9];
    horn(H, R);
    for (int a = 0; a < 3; a++) {
        T[4 * a] = R[3 * a]; T[4 * a + 1] = R[3 * a + 1]; T[4 * a + 2] = R[3 * a + 2];
        T[4 * a + 3] = cd[a] - (R[3 * a] * cs[0] + R[3 * a + 1] * cs[1] + R[3 * a + 2] * cs[2]);
    }
}

__device__ __forceinline__ bool inlier(const double* T, const double* S, const double* D, int i, double thr2) {
    double r2 = 0;
    for (int a = 0; a < 3; a++) {
        double r = T[4 * a] * S[3 * i] + T[4 * a + 1] * S[3 * i + 1] + T[4 * a + 2] * S[3 * i + 2] + T[4 * a + 3] - D[3 * i + a];
        r2 += r * r;
    }
    return r2 < thr2;
}

__device__ int mark(const double* T, const double* S, const double* D, int n, double thr2,
                    unsigned char* mask, int lane) {
    int c = 0;
    for (int i = lane; i < n; i += 32) { bool in = inlier(T, S, D, i, thr2); mask[i] = in; c += in; }
    for (int o = 16; o; o >>= 1) c += __shfl_xor_sync(FULL, c, o);
    __syncwarp();
    return c;
}

// one warp per group: 32 three-point samples per round (one per lane), adaptive count for
// `prob`, capped at max_iter; the best sample refitted on its inliers, inliers recomputed once
extern "C" __global__ void ransac_groups(const double* __restrict__ S_all, const double* __restrict__ D_all,
                                         const long long* __restrict__ offs, int G, double thr2,
                                         int max_iter, int cap_small, double prob, unsigned long long seed,
                                         const int* __restrict__ hash_ids,
                                         unsigned char* mask_all, unsigned char* tmp_all,
                                         double* poses, int* counts) {
    int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (gw >= G) return;
    // the group's number in the samples' hash: its own index, or the one given (a group of a
    // batch of scenes draws the samples it draws in its scene alone)
    const unsigned long long hg = hash_ids ? (unsigned long long)hash_ids[gw] : (unsigned long long)gw;
    long long o = offs[gw];
    int n = (int)(offs[gw + 1] - o);
    const double* S = S_all + 3 * o;
    const double* D = D_all + 3 * o;
    unsigned char* mask = mask_all + o;
    unsigned char* tmp = tmp_all + o;
    if (n < 3) { if (lane == 0) counts[gw] = 0; return; }
    int best_cnt = -1, best_it = -1;
    double bestT[12];
    if (n <= 64 && max_iter > cap_small) max_iter = cap_small;  // as the CPU's batched RANSAC
    long long needed = max_iter;
    for (int it = 0; it < max_iter && it < needed; it += 32) {
        int my = it + lane;
        int cnt = -1;
        double T[12];
        if (my < max_iter) {
            unsigned long long h = mix64(seed ^ mix64((hg << 32) | (unsigned)my));
            int a = (int)(h % n), b, c;
            h = mix64(h); b = (int)(h % (n - 1)); if (b >= a) b++;
            h = mix64(h); c = (int)(h % (n - 2));
            int lo = a < b ? a : b, hi = a < b ? b : a;
            if (c >= lo) c++;
            if (c >= hi) c++;
            int idx[3] = {a, b, c};
            double cs[3] = {0, 0, 0}, cd[3] = {0, 0, 0};
            for (int k = 0; k < 3; k++) for (int q = 0; q < 3; q++) { cs[q] += S[3 * idx[k] + q] / 3.0; cd[q] += D[3 * idx[k] + q] / 3.0; }
            double H[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
            for (int k = 0; k < 3; k++) for (int p = 0; p < 3; p++) for (int q = 0; q < 3; q++)
                H[3 * p + q] += (S[3 * idx[k] + p] - cs[p]) * (D[3 * idx[k] + q] - cd[q]);
            double R[9];
            horn(H, R);
            for (int p = 0; p < 3; p++) {
                T[4 * p] = R[3 * p]; T[4 * p + 1] = R[3 * p + 1]; T[4 * p + 2] = R[3 * p + 2];
                T[4 * p + 3] = cd[p] - (R[3 * p] * cs[0] + R[3 * p + 1] * cs[1] + R[3 * p + 2] * cs[2]);
            }
            cnt = 0;
            for (int i = 0; i < n; i++) cnt += inlier(T, S, D, i, thr2);
        }
        // the round's best (ties: the lower sample) against the best so far
        int bc = cnt, bl = lane;
        for (int off = 16; off; off >>= 1) {
            int oc = __shfl_xor_sync(FULL, bc, off), ol = __shfl_xor_sync(FULL, bl, off);
            if (oc > bc || (oc == bc && ol < bl)) { bc = oc; bl = ol; }
        }
        if (bc > best_cnt) {
            best_cnt = bc;
            best_it = it + bl;
            for (int k = 0; k < 12; k++) bestT[k] = __shfl_sync(FULL, T[k], bl);
            double w = (double)best_cnt / n, pf = 1.0 - w * w * w;
            if (pf <= 0) needed = 0;
            else if (pf < 1) {
                double nd = ceil(log(1.0 - prob) / log(pf));
                needed = nd > (double)max_iter ? (long long)max_iter : (long long)nd;
            }
        }
    }
    int c1 = mark(bestT, S, D, n, thr2, mask, lane);
    if (c1 >= 3) {  // refit on the inliers; recompute them once; keep when not fewer
        double T2[12];
        fit_warp(S, D, n, mask, lane, T2);
        int c2 = mark(T2, S, D, n, thr2, tmp, lane);
        if (c2 >= 3 && c2 >= c1) {
            double T3[12];
            fit_warp(S, D, n, tmp, lane, T3);
            for (int i = lane; i < n; i += 32) mask[i] = tmp[i];
            __syncwarp();
            for (int k = 0; k < 12; k++) bestT[k] = T3[k];
            c1 = c2;
        } else {
            for (int k = 0; k < 12; k++) bestT[k] = T2[k];
        }
    }
    if (lane < 12) poses[12 * gw + lane] = bestT[lane];
    if (lane == 0) counts[gw] = c1;
}
"""


def _ransac_kernel():
    import cupy as cp

    key = ("ransac", cp.cuda.Device().id)
    if key not in _kernels:
        _kernels[key] = cp.RawModule(code=_RANSAC_SRC, options=("--std=c++14",)).get_function("ransac_groups")
    return _kernels[key]


def ransac_groups(S, D, offsets, *, threshold: float, max_iterations: int = 10000,
                  probability: float = 0.99, seed: int = 0, cap_small: int = 1024, hash_ids=None):
    """RANSAC rigid fits ``D ~ R S + t`` of many groups in one launch (one warp per group).

    ``S``, ``D`` (N, 3) float64 CuPy arrays, groups back to back at ``offsets`` (G + 1). As
    :func:`~scanforest.kernels.recognition.rigid.ransac_rigid`: 3-point samples (32 per round,
    drawn by a counter-based hash of ``seed``, group and sample), inlier when
    ``|R s + t - d|^2 < threshold^2``, adaptive count for ``probability`` capped at
    ``max_iterations``; the best model refitted on its inliers (Horn's least-squares rotation)
    and the inliers recomputed once, kept when not fewer.

    ``hash_ids`` (G,) int32: the number each group's samples are hashed with (default: its
    index), so that a group fitted in a batch of scenes draws the samples it draws alone.

    Returns ``poses`` (G, 4, 4) float64, ``inliers`` (N,) bool, ``counts`` (G,) int32 (0 for
    groups of fewer than 3 pairs), all CuPy.
    """
    import cupy as cp

    S = cp.ascontiguousarray(cp.asarray(S), dtype=cp.float64)
    D = cp.ascontiguousarray(cp.asarray(D), dtype=cp.float64)
    offs = cp.asarray(offsets, dtype=cp.int64)
    G = int(offs.shape[0]) - 1
    n = int(S.shape[0])
    mask = cp.zeros(max(n, 1), cp.uint8)
    tmp = cp.zeros(max(n, 1), cp.uint8)
    P = cp.zeros((max(G, 0), 12), cp.float64)
    counts = cp.zeros(max(G, 0), cp.int32)
    if G > 0 and n > 0:
        threads = 128
        blocks = (G * 32 + threads - 1) // threads
        _ransac_kernel()((blocks,), (threads,), (S, D, offs, np.int32(G), np.float64(float(threshold) ** 2),
                                                 np.int32(max_iterations), np.int32(cap_small),
                                                 np.float64(probability),
                                                 np.uint64(seed & 0xFFFFFFFFFFFFFFFF),
                                                 None if hash_ids is None else cp.asarray(hash_ids, dtype=cp.int32),
                                                 mask, tmp, P, counts))
    poses = cp.zeros((max(G, 0), 4, 4), cp.float64)
    poses[:, :3, :] = P.reshape(-1, 3, 4)
    poses[:, 3, 3] = 1.0
    return poses, mask[:n].astype(bool), counts


def gc_hypotheses(model_id, scene_kp, ref_row, dist2, scene_kp_coords, model_kp_coords, *,
                  gc_size: float, gc_threshold: int, max_iterations: int = 10000, seed: int = 0):
    """Geometric-consistency grouping and RANSAC fits of one scene's correspondences on the GPU.

    The correspondences (host or device arrays) are grouped per model in ascending descriptor
    distance (stable), as the CPU's ``group_gc``; every kept consensus set is fitted by
    :func:`ransac_groups` (threshold ``gc_size``). Returns host arrays ``(model_id (H,),
    poses (H, 4, 4), n_corr (H,), groups)``, ``groups`` a list of correspondence indices
    (the RANSAC inliers of each hypothesis, in ascending descriptor distance), in the CPU's
    order: by model, then by acceptance.
    """
    return gc_hypotheses_many([(model_id, scene_kp, ref_row, dist2, scene_kp_coords)], model_kp_coords,
                              gc_size=gc_size, gc_threshold=gc_threshold, max_iterations=max_iterations,
                              seed=seed)[0]


def gc_hypotheses_many(scenes, model_kp_coords, *, gc_size: float, gc_threshold: int,
                       max_iterations: int = 10000, seed: int = 0) -> list:
    """:func:`gc_hypotheses` of many scenes at once: every (scene, model) group swept in one
    launch, every kept set of every scene fitted in one RANSAC launch (each set hashed with its
    number in its own scene, so it draws the samples it draws alone), and one set of host
    transfers for the batch. ``scenes``: ``(model_id, scene_kp, ref_row, dist2,
    scene_kp_coords)`` per scene. Returns :func:`gc_hypotheses`'s tuple per scene, equal to it."""
    import cupy as cp

    B = len(scenes)
    empty = (np.zeros(0, np.int32), np.zeros((0, 4, 4)), np.zeros(0, np.int32), [])
    ns = [int(len(s[0])) for s in scenes]
    coffs = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)  # each scene's correspondences
    if B == 0 or coffs[-1] == 0:
        return [empty] * B
    kps = [cp.asarray(s[4]) for s in scenes]
    koffs = np.concatenate([[0], np.cumsum([int(k.shape[0]) for k in kps])]).astype(np.int64)
    skp = cp.concatenate(kps) if B > 1 else kps[0]
    mkp = cp.asarray(model_kp_coords)
    mid = cp.concatenate([cp.asarray(s[0]).astype(cp.int64) for s in scenes])
    nm = int(mid.max()) + 1
    scn = cp.repeat(cp.arange(B, dtype=cp.int64), ns)
    key = scn * nm + mid  # a group: one model in one scene
    sk_all = cp.concatenate([cp.asarray(s[1]).astype(cp.int64) + int(koffs[b]) for b, s in enumerate(scenes)])
    rr_all = cp.concatenate([cp.asarray(s[2]).astype(cp.int64) for s in scenes])
    d2 = cp.concatenate([cp.asarray(s[3]) for s in scenes])
    order = cp.lexsort(cp.stack([d2, key.astype(d2.dtype)]))  # by group, then distance (stable)
    groups_key, counts = cp.unique(key[order], return_counts=True)
    offs = cp.concatenate([cp.zeros(1, cp.int64), cp.cumsum(counts)])
    labels, nsets = gc_sets_batch(skp[sk_all[order]].astype(cp.float32), mkp[rr_all[order]].astype(cp.float32),
                                  offs, gc_size, gc_threshold)
    # global set id: sets of earlier groups first, then acceptance order within the group
    counts_h, nsets_h = counts.get().tolist(), nsets.get().tolist()
    grp_of_row = cp.repeat(cp.arange(len(counts_h)), counts_h)
    set_base = cp.concatenate([cp.zeros(1, cp.int64), cp.cumsum(nsets.astype(cp.int64))])
    kept = cp.flatnonzero(labels >= 0)
    if int(kept.shape[0]) == 0:
        return [empty] * B
    gid = set_base[grp_of_row[kept]] + labels[kept]
    by_set = cp.lexsort(cp.stack([kept, gid]))  # by set, then position (ascending distance)
    k2, gid = kept[by_set], gid[by_set]
    H = int(sum(nsets_h))
    sizes = cp.bincount(gid, minlength=H)
    goffs = cp.concatenate([cp.zeros(1, cp.int64), cp.cumsum(sizes)])
    rows = order[k2]  # correspondence indices (of the batch), grouped, ascending distance within a group
    src = mkp[rr_all[rows]].astype(cp.float64)
    dst = skp[sk_all[rows]].astype(cp.float64)
    set_key = groups_key[cp.repeat(cp.arange(len(nsets_h)), nsets_h)]
    set_scene = set_key // nm  # sets are ordered by group, so by scene
    first = cp.searchsorted(set_scene, cp.arange(B, dtype=cp.int64))
    hid = (cp.arange(H, dtype=cp.int64) - first[set_scene]).astype(cp.int32)
    poses, inl, cnt = ransac_groups(src, dst, goffs, threshold=gc_size, max_iterations=max_iterations,
                                    seed=seed, hash_ids=hid)
    rows_h, inl_h, goffs_h = rows.get(), inl.get(), goffs.get()
    ok_h, scene_h, model_h = (cnt >= 3).get(), set_scene.get(), (set_key % nm).get()
    poses_h, cnt_h = poses.get(), cnt.get()
    from ._groups import GroupList

    # each kept hypothesis' RANSAC inliers, flat: a set's members are contiguous and sets are in
    # (scene, acceptance) order, so one mask gives every scene's groups in hypothesis order
    set_of = np.repeat(np.arange(H), np.diff(goffs_h))
    member = inl_h & ok_h[set_of]
    member_scene = scene_h[set_of]
    out = []
    for b in range(B):
        sel = np.flatnonzero(ok_h & (scene_h == b))
        if not len(sel):
            out.append(empty)
            continue
        m = member & (member_scene == b)
        sizes = np.bincount(set_of[m], minlength=H)[sel]
        groups = GroupList(rows_h[m] - coffs[b], np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        out.append((model_h[sel].astype(np.int32), poses_h[sel], cnt_h[sel].astype(np.int32), groups))
    return out
