"""CUDA kernels of the sparse tracker (CuPy RawKernels; see
:mod:`scanforest.kernels.motion.tracking`).

A translation of the numba kernels in ``_tracking_cpu.py`` (same layouts, same
integer arithmetic, the same float32 expressions in the same order; compiled with
``--fmad=false`` so no multiply-add is contracted and without ``-use_fast_math`` so ``sqrtf``
and divisions round as on the CPU): both backends give the same corners and the same track
positions. Design:

* **Pyramids once per frame, all frames per launch**: ``trk_pyr_down`` (one thread per output
  pixel of every frame, one launch per level) and ``trk_scharr`` (derivatives of every level);
  a frame's pyramid serves every pair it belongs to, forward and backward.
* **Corners**: ``trk_sobel`` (int16 pairs), ``trk_min_eig`` (exact 64-bit box sums, the
  float32 eigenvalue), ``trk_candidates`` (threshold against the frame's maximum, 3x3
  maximum); the candidates are compacted and sorted on the device (``cupy.lexsort``: frame,
  then response descending, then raster index descending, OpenCV's order), and
  ``trk_greedy`` runs the minimum-distance pass with one block per frame: candidates in order,
  the block's threads test a candidate against the kept corners (in shared memory) in
  parallel, ``__syncthreads_or`` decides; the pass stops at ``max_features`` kept.
* **Lucas-Kanade, one warp per point, all points of all pairs in one launch, the whole
  pyramid walked inside it** (coarse to fine): the lanes share the window's pixels (stride
  32), keep the sampled patch and derivatives in shared memory for the Newton steps, and
  reduce the 64-bit integer sums with ``__shfl_xor_sync`` - exact, so every lane holds the same
  sums and takes the same (warp-uniform) branches. Point slots beyond a problem's count exit
  as whole warps. The forward launch is followed by the backward one (the same kernel,
  frames swapped); the forward-backward test is elementwise CuPy in the caller.
* No host round trip of data: the small index tables (levels, frame pairs) are one upload a
  call, the corner counts and points stay on the device; the one synchronisation is the
  candidate count (``cupy.flatnonzero``).
"""
from __future__ import annotations

import functools

import numpy as np

THREADS = 256
GREEDY_THREADS = 256

_SRC = r"""
#define W_BITS 14
#define FLT_SCALE (1.0f / (float)(1 << 20))
#define FLT_EPS 1.1920928955078125e-07f

__device__ __forceinline__ int reflect101(int i, int n) {
    if (n == 1) return 0;
    while (i < 0 || i >= n) i = i < 0 ? -i : 2 * n - 2 - i;
    return i;
}

// thread t of a launch over n planes of h x w: plane f, offset r in it, pixel (x, y); false
// past the end
__device__ __forceinline__ bool pixel_of(int n, int h, int w, long long& t, int& f, long long& r,
                                         int& y, int& x) {
    t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long plane = (long long)h * w;
    if (t >= (long long)n * plane) return false;
    f = (int)(t / plane);
    r = t - (long long)f * plane;
    y = (int)(r / w);
    x = (int)(r - (long long)y * w);
    return true;
}

// the 3x3 neighbourhood of (x, y), reflect-101: a = column x-1, b = x, c = x+1; 0/1/2 = rows
struct N3 { int a0, a1, a2, b0, b2, c0, c1, c2; };

__device__ __forceinline__ N3 nbhd3(const unsigned char* __restrict__ I, int h, int w, int y, int x) {
    const long long r0 = (long long)reflect101(y - 1, h) * w, r1 = (long long)y * w,
                    r2 = (long long)reflect101(y + 1, h) * w;
    const int xl = reflect101(x - 1, w), xr = reflect101(x + 1, w);
    return N3{I[r0 + xl], I[r1 + xl], I[r2 + xl], I[r0 + x], I[r2 + x], I[r0 + xr], I[r1 + xr],
              I[r2 + xr]};
}

__device__ __forceinline__ int w5(int i) { return i == 2 ? 6 : ((i == 1 || i == 3) ? 4 : 1); }

// level d of every frame from level s: [1 4 6 4 1]/16 both ways, (sum + 128) >> 8
extern "C" __global__ void trk_pyr_down(unsigned char* __restrict__ pyr, long long S, int n,
                                        long long soff, int sh, int sw, long long doff, int dh,
                                        int dw) {
    long long t, r;
    int f, y, x;
    if (!pixel_of(n, dh, dw, t, f, r, y, x)) return;
    const unsigned char* src = pyr + (long long)f * S + soff;
    int s = 0;
    for (int j = 0; j < 5; ++j) {
        const long long row = (long long)reflect101(2 * y + j - 2, sh) * sw;
        int acc = 0;
        for (int i = 0; i < 5; ++i) acc += w5(i) * (int)src[row + reflect101(2 * x + i - 2, sw)];
        s += w5(j) * acc;
    }
    pyr[(long long)f * S + doff + r] = (unsigned char)((s + 128) >> 8);
}

// Scharr derivatives (3/10/3, reflect-101) of one level of every frame
extern "C" __global__ void trk_scharr(const unsigned char* __restrict__ pyr,
                                      short2* __restrict__ der, long long S, int n,
                                      long long off, int h, int w) {
    long long t, r;
    int f, y, x;
    if (!pixel_of(n, h, w, t, f, r, y, x)) return;
    const unsigned char* I = pyr + (long long)f * S + off;
    const N3 q = nbhd3(I, h, w, y, x);
    const int dx = 3 * (q.c0 + q.c2) + 10 * q.c1 - (3 * (q.a0 + q.a2) + 10 * q.a1);
    const int dy = 3 * (q.a2 + q.c2) + 10 * q.b2 - (3 * (q.a0 + q.c0) + 10 * q.b0);
    der[(long long)f * S + off + r] = make_short2((short)dx, (short)dy);
}

// 3x3 Sobel (reflect-101) of frames fidx
extern "C" __global__ void trk_sobel(const unsigned char* __restrict__ grey, int h, int w,
                                     const long long* __restrict__ fidx, int nk,
                                     short2* __restrict__ out) {
    long long t, r;
    int i, y, x;
    if (!pixel_of(nk, h, w, t, i, r, y, x)) return;
    const unsigned char* I = grey + fidx[i] * ((long long)h * w);
    const N3 q = nbhd3(I, h, w, y, x);
    out[t] = make_short2((short)((q.c0 + 2 * q.c1 + q.c2) - (q.a0 + 2 * q.a1 + q.a2)),
                         (short)((q.a2 + 2 * q.b2 + q.c2) - (q.a0 + 2 * q.b0 + q.c0)));
}

// minimum eigenvalue of the block-summed structure tensor (exact integer sums, then float32)
extern "C" __global__ void trk_min_eig(const short2* __restrict__ sob, int h, int w, int nk,
                                       int block, float s2, float* __restrict__ out) {
    long long t, r;
    int i, y, x;
    if (!pixel_of(nk, h, w, t, i, r, y, x)) return;
    const short2* D = sob + (long long)i * ((long long)h * w);
    const int lo = block / 2;
    long long sxx = 0, sxy = 0, syy = 0;
    for (int j = 0; j < block; ++j) {
        const long long row = (long long)reflect101(y + j - lo, h) * w;
        for (int q = 0; q < block; ++q) {
            const short2 d = D[row + reflect101(x + q - lo, w)];
            const long long dx = d.x, dy = d.y;
            sxx += dx * dx;
            sxy += dx * dy;
            syy += dy * dy;
        }
    }
    const float a = (float)sxx * s2 * 0.5f;
    const float b = (float)sxy * s2;
    const float c = (float)syy * s2 * 0.5f;
    const float d = a - c;
    out[t] = (a + c) - sqrtf(d * d + b * b);
}

// candidates: interior, above quality x the frame maximum, maximum of the 3x3 neighbourhood
extern "C" __global__ void trk_candidates(const float* __restrict__ resp, int h, int w, int nk,
                                          const float* __restrict__ fmax, double quality,
                                          unsigned char* __restrict__ mask) {
    long long t, r;
    int i, y, x;
    if (!pixel_of(nk, h, w, t, i, r, y, x)) return;
    unsigned char ok = 0;
    if (y >= 1 && y < h - 1 && x >= 1 && x < w - 1) {
        const float thr = (float)((double)fmax[i] * quality);
        const float* R = resp + (long long)i * ((long long)h * w);
        const float v = R[r];
        if (v > thr) {
            ok = 1;
            for (int dy = -1; dy <= 1; ++dy)
                for (int dx = -1; dx <= 1; ++dx)
                    if (R[r + (long long)dy * w + dx] > v) ok = 0;
        }
    }
    mask[t] = ok;
}

// greedy minimum-distance pass, one block per problem, candidates in sorted order
extern "C" __global__ void trk_greedy(const long long* __restrict__ cx,
                                      const long long* __restrict__ cy,
                                      const long long* __restrict__ starts, int max_features,
                                      double min_d2, float2* __restrict__ out,
                                      int* __restrict__ counts) {
    extern __shared__ int2 kept[];
    const int i = blockIdx.x;
    const long long s = starts[i], e = starts[i + 1];
    int n = 0;                                  // the same in every thread
    for (long long k = s; k < e && n < max_features; ++k) {
        const long long x = cx[k], y = cy[k];
        int bad = 0;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const long long dx = x - kept[j].x, dy = y - kept[j].y;
            if ((double)(dx * dx + dy * dy) < min_d2) bad = 1;
        }
        bad = __syncthreads_or(bad);
        if (!bad) {
            if (threadIdx.x == 0) {
                kept[n] = make_int2((int)x, (int)y);
                out[(long long)i * max_features + n] = make_float2((float)x, (float)y);
            }
            ++n;
            __syncthreads();
        }
    }
    if (threadIdx.x == 0) counts[i] = n;
}

__device__ __forceinline__ long long img_at(const unsigned char* __restrict__ I, int h, int w,
                                            int x, int y) {
    return (long long)I[(long long)reflect101(y, h) * w + reflect101(x, w)];
}

__device__ __forceinline__ long long der_at(const short2* __restrict__ D, int h, int w, int x,
                                            int y, int c) {
    if (x < 0 || x >= w || y < 0 || y >= h) return 0;
    const short2 v = D[(long long)y * w + x];
    return c == 0 ? (long long)v.x : (long long)v.y;
}

// bilinear samples with the fixed-point weights: the image (reflect-101) and a derivative
// channel (zero outside)
__device__ __forceinline__ long long img_bilinear(const unsigned char* __restrict__ I, int h, int w,
                                                  int X, int Y, long long w00, long long w01,
                                                  long long w10, long long w11) {
    return img_at(I, h, w, X, Y) * w00 + img_at(I, h, w, X + 1, Y) * w01
           + img_at(I, h, w, X, Y + 1) * w10 + img_at(I, h, w, X + 1, Y + 1) * w11;
}

__device__ __forceinline__ long long der_bilinear(const short2* __restrict__ D, int h, int w, int X,
                                                  int Y, int c, long long w00, long long w01,
                                                  long long w10, long long w11) {
    return der_at(D, h, w, X, Y, c) * w00 + der_at(D, h, w, X + 1, Y, c) * w01
           + der_at(D, h, w, X, Y + 1, c) * w10 + der_at(D, h, w, X + 1, Y + 1, c) * w11;
}

__device__ __forceinline__ long long descale(long long v, int n) {
    return (v + (1LL << (n - 1))) >> n;
}

__device__ __forceinline__ void lk_weights(float a, float b, long long& w00, long long& w01,
                                           long long& w10, long long& w11) {
    const float sc = (float)(1 << W_BITS);
    w00 = __float2ll_rn((1.f - a) * (1.f - b) * sc);
    w01 = __float2ll_rn(a * (1.f - b) * sc);
    w10 = __float2ll_rn((1.f - a) * b * sc);
    w11 = (1LL << W_BITS) - w00 - w01 - w10;
}

__device__ __forceinline__ long long warp_sum(long long v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// pyramidal Lucas-Kanade, one warp per point slot (k, i), levels coarse to fine in the launch
extern "C" __global__ void trk_lk(const unsigned char* __restrict__ pyr,
                                  const short2* __restrict__ der, long long S,
                                  const long long* __restrict__ tab, int nlev, int nk, int npt,
                                  const float2* __restrict__ pts, const float2* __restrict__ init,
                                  int use_init, const int* __restrict__ counts, int win,
                                  int iters, double eps2, float min_eig_thr,
                                  float2* __restrict__ out, unsigned char* __restrict__ status) {
    extern __shared__ int smem[];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const long long g = (long long)blockIdx.x * (blockDim.x >> 5) + wib;
    if (g >= (long long)nk * npt) return;                 // whole warps leave together
    const int k = (int)(g / npt), i = (int)(g - (long long)k * npt);
    if (i >= counts[k]) return;
    const int area = win * win;
    int* sI = smem + (long long)wib * 3 * area;
    int* sX = sI + area;
    int* sY = sX + area;
    const long long* lv = tab;                            // nlev x (h, w, off)
    const long long fp = tab[3 * nlev + k], fn = tab[3 * nlev + nk + k];
    const float half = (float)(win - 1) * 0.5f;
    const float mdiv = (float)(2 * area);
    const float2 p0 = pts[g];
    float nx = 0.f, ny = 0.f;
    bool st = true;
    for (int level = nlev - 1; level >= 0; --level) {
        const int h = (int)lv[3 * level], w = (int)lv[3 * level + 1];
        const long long off = lv[3 * level + 2];
        const unsigned char* I = pyr + fp * S + off;
        const unsigned char* J = pyr + fn * S + off;
        const short2* DI = der + fp * S + off;
        const float sc = 1.0f / (float)(1 << level);
        float px = p0.x * sc, py = p0.y * sc;
        if (level == nlev - 1) {
            if (use_init) {
                nx = init[g].x * sc;
                ny = init[g].y * sc;
            } else {
                nx = px;
                ny = py;
            }
        } else {
            nx = nx * 2.f;
            ny = ny * 2.f;
        }
        px = px - half;
        py = py - half;
        if (!(px >= (float)(-win) && px < (float)w && py >= (float)(-win) && py < (float)h)) {
            if (level == 0) st = false;
            continue;
        }
        const int ipx = (int)floorf(px), ipy = (int)floorf(py);
        float a = px - (float)ipx, b = py - (float)ipy;
        long long w00, w01, w10, w11;
        lk_weights(a, b, w00, w01, w10, w11);
        long long s11 = 0, s12 = 0, s22 = 0;
        for (int q = lane; q < area; q += 32) {
            const int yy = q / win, xx = q - yy * win;
            const int X = ipx + xx, Y = ipy + yy;
            const long long ival = descale(img_bilinear(I, h, w, X, Y, w00, w01, w10, w11), W_BITS - 5);
            const long long ixv = descale(der_bilinear(DI, h, w, X, Y, 0, w00, w01, w10, w11), W_BITS);
            const long long iyv = descale(der_bilinear(DI, h, w, X, Y, 1, w00, w01, w10, w11), W_BITS);
            sI[q] = (int)ival;
            sX[q] = (int)ixv;
            sY[q] = (int)iyv;
            s11 += ixv * ixv;
            s12 += ixv * iyv;
            s22 += iyv * iyv;
        }
        __syncwarp();
        s11 = warp_sum(s11);
        s12 = warp_sum(s12);
        s22 = warp_sum(s22);
        const float A11 = (float)s11 * FLT_SCALE, A12 = (float)s12 * FLT_SCALE,
                    A22 = (float)s22 * FLT_SCALE;
        float D = A11 * A22 - A12 * A12;
        const float dd = A11 - A22;
        const float mev = (A22 + A11 - sqrtf(dd * dd + 4.0f * A12 * A12)) / mdiv;
        if (mev < min_eig_thr || D < FLT_EPS) {
            if (level == 0) st = false;
            continue;
        }
        D = 1.0f / D;
        float qx = nx - half, qy = ny - half;
        float pdx = 0.f, pdy = 0.f;
        for (int j = 0; j < iters; ++j) {
            if (!(qx >= (float)(-win) && qx < (float)w && qy >= (float)(-win) && qy < (float)h)) {
                if (level == 0) st = false;
                break;
            }
            const int inx = (int)floorf(qx), iny = (int)floorf(qy);
            a = qx - (float)inx;
            b = qy - (float)iny;
            lk_weights(a, b, w00, w01, w10, w11);
            long long b1 = 0, b2 = 0;
            for (int q = lane; q < area; q += 32) {
                const int yy = q / win, xx = q - yy * win;
                const int X = inx + xx, Y = iny + yy;
                const long long diff = descale(img_bilinear(J, h, w, X, Y, w00, w01, w10, w11), W_BITS - 5)
                                       - (long long)sI[q];
                b1 += diff * (long long)sX[q];
                b2 += diff * (long long)sY[q];
            }
            b1 = warp_sum(b1);
            b2 = warp_sum(b2);
            const float fb1 = (float)b1 * FLT_SCALE, fb2 = (float)b2 * FLT_SCALE;
            const float ddx = (A12 * fb2 - A22 * fb1) * D;
            const float ddy = (A12 * fb1 - A11 * fb2) * D;
            qx = qx + ddx;
            qy = qy + ddy;
            nx = qx + half;
            ny = qy + half;
            if ((double)ddx * (double)ddx + (double)ddy * (double)ddy <= eps2) break;
            if (j > 0 && (double)fabsf(ddx + pdx) < 0.01 && (double)fabsf(ddy + pdy) < 0.01) {
                nx = nx - ddx * 0.5f;
                ny = ny - ddy * 0.5f;
                break;
            }
            pdx = ddx;
            pdy = ddy;
        }
        __syncwarp();                                     // patch reused by the next level
    }
    if (lane == 0) {
        out[g] = make_float2(nx, ny);
        status[g] = st ? 1 : 0;
    }
}
"""


@functools.lru_cache(maxsize=None)
def _module(device_id: int):
    import cupy as cp

    return cp.RawModule(code=_SRC, options=("--std=c++17", "--fmad=false"))


def kernel(name: str):
    import cupy as cp

    return _module(cp.cuda.Device().id).get_function(name)


def _blocks(n: int, threads: int = THREADS) -> tuple[int]:
    return (max(1, (int(n) + threads - 1) // threads),)


def build_pyramids(grey, lv: np.ndarray):
    """Pyramids (``pyr``, (N, S) uint8) and Scharr derivatives (``der``, (N, S, 2) int16) of
    every frame of ``grey`` ((N, H, W) uint8 on the device)."""
    import cupy as cp

    n = int(grey.shape[0])
    size = int(lv[-1, 2] + lv[-1, 0] * lv[-1, 1])
    pyr = cp.empty((n, size), cp.uint8)
    pyr[:, :int(lv[0, 0] * lv[0, 1])] = cp.ascontiguousarray(grey).reshape(n, -1)
    S = np.int64(size)
    for level in range(1, len(lv)):
        (sh, sw, so), (dh, dw, do) = lv[level - 1], lv[level]
        kernel("trk_pyr_down")(_blocks(n * dh * dw), (THREADS,),
                               (pyr, S, np.int32(n), np.int64(so), np.int32(sh), np.int32(sw),
                                np.int64(do), np.int32(dh), np.int32(dw)))
    der = cp.empty((n, size, 2), cp.int16)
    for h, w, off in lv:
        kernel("trk_scharr")(_blocks(n * h * w), (THREADS,),
                             (pyr, der, S, np.int32(n), np.int64(off), np.int32(h), np.int32(w)))
    return pyr, der


def response_scale(block_size: int) -> np.float32:
    s = 1.0 / (4.0 * block_size * 255.0)
    return np.float32(s * s)


def detect(grey, fidx, max_features: int, quality: float, min_d2: float, block_size: int):
    """Shi-Tomasi corners of frames ``fidx``: ``(K, max_features, 2)`` float32 slots and ``(K,)``
    int32 counts, both on the device."""
    import cupy as cp

    k = len(fidx)
    h, w = int(grey.shape[1]), int(grey.shape[2])
    grey = cp.ascontiguousarray(grey)
    d_fidx = cp.asarray(np.ascontiguousarray(fidx, np.int64))
    n = k * h * w
    sob = cp.empty((k, h, w, 2), cp.int16)
    kernel("trk_sobel")(_blocks(n), (THREADS,),
                        (grey, np.int32(h), np.int32(w), d_fidx, np.int32(k), sob))
    resp = cp.empty((k, h, w), cp.float32)
    kernel("trk_min_eig")(_blocks(n), (THREADS,),
                          (sob, np.int32(h), np.int32(w), np.int32(k), np.int32(block_size),
                           response_scale(block_size), resp))
    fmax = resp.reshape(k, -1).max(axis=1)
    mask = cp.empty((k, h, w), cp.uint8)
    kernel("trk_candidates")(_blocks(n), (THREADS,),
                             (resp, np.int32(h), np.int32(w), np.int32(k), fmax,
                              np.float64(quality), mask))
    idx = cp.flatnonzero(mask)
    plane = h * w
    kk = idx // plane
    lin = idx - kk * plane
    if idx.size:
        vbits = resp.reshape(-1)[idx].view(cp.int32).astype(cp.int64)  # responses > 0: bits order
        order = cp.lexsort(cp.stack([-lin, -vbits, kk]))
        kk, lin = kk[order], lin[order]
        starts = cp.searchsorted(kk, cp.arange(k + 1, dtype=kk.dtype)).astype(cp.int64)
    else:                                          # a flat image: no corner anywhere
        starts = cp.zeros(k + 1, cp.int64)
    cx = cp.ascontiguousarray(lin % w)
    cy = cp.ascontiguousarray(lin // w)
    out = cp.zeros((k, max_features, 2), cp.float32)
    counts = cp.zeros(k, cp.int32)
    kernel("trk_greedy")((k,), (GREEDY_THREADS,),
                         (cx, cy, starts, np.int32(max_features), np.float64(min_d2), out, counts),
                         shared_mem=8 * int(max_features))
    return out, counts


def track(pyr, der, lv, fprev, fnext, pts, counts, init, win, iters, eps2, min_eig_thr):
    """Lucas-Kanade of the point slots ``pts`` (K, P, 2) on the device: ``(out (K, P, 2)
    float32, status (K, P) uint8)``, one warp per slot, one launch for all levels."""
    import cupy as cp

    nk, npt = int(pts.shape[0]), int(pts.shape[1])
    out = cp.zeros((nk, npt, 2), cp.float32)
    status = cp.zeros((nk, npt), cp.uint8)
    if nk * npt == 0:
        return out, status
    tab = np.concatenate([np.asarray(lv, np.int64).reshape(-1), np.asarray(fprev, np.int64),
                          np.asarray(fnext, np.int64)])
    d_tab = cp.asarray(tab)                                    # one small upload
    pts = cp.ascontiguousarray(cp.asarray(pts, cp.float32))
    use_init = init is not None
    d_init = cp.ascontiguousarray(cp.asarray(init, cp.float32)) if use_init else pts
    d_counts = cp.asarray(counts, cp.int32)
    per_warp = 3 * win * win * 4
    wpb = max(1, min(8, (48 * 1024) // per_warp))
    grid = ((nk * npt + wpb - 1) // wpb,)
    kernel("trk_lk")(grid, (32 * wpb,),
                     (pyr, der, np.int64(pyr.shape[1]), d_tab, np.int32(len(lv)), np.int32(nk),
                      np.int32(npt), pts, d_init, np.int32(use_init), d_counts, np.int32(win),
                      np.int32(iters), np.float64(eps2), np.float32(min_eig_thr), out, status),
                     shared_mem=wpb * per_warp)
    return out, status
