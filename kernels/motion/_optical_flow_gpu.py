"""CUDA kernels of the flow methods (CuPy RawKernels; see :mod:`scanforest.kernels.motion.optical_flow`).

Design (the paper's CUDA rules, Sec. 5, carried to a current GPU):

* **One thread per pixel, all pairs of a call in one launch** (``blockIdx.y`` = pair). Frames
  live once in a ``(F, H, W)`` ``float4`` array (RGB + a zero lane) so a pixel is one aligned
  16-byte load: neighbouring threads read neighbouring words, the coalescing the paper forced
  through shared-memory staging of 3-byte pixels. A sequence's frames are stored once; pair
  ``b`` reads frames ``pairs[b]``.
* **Feature table tiled through shared memory.** The paper kept the feature table in constant
  memory (every thread reads the same feature at the same time: a broadcast). With several
  pairs per launch, each with its own table of any size, the block instead stages ``TILE``
  features (two ``float4`` each: ``x sx, y sx, r sc, g sc | b sc, u, v, 0``) into shared memory
  and every thread walks the tile: the same broadcast reads, no size limit, no host-side
  ``cudaMemcpyToSymbol`` per pair.
* **The Gaussian is computed** (``exp2f`` on pre-scaled coordinates: one MUFU op per
  pixel-feature), as the paper found faster than a lookup table.
* **No data-dependent branches in the feature loops**: two passes over the features (the
  minimum scaled distance ``m``, then the weights ``2^(m - d)``), single path.
* **Method 2 keeps its accumulator in registers**: a chunk of ``LCHUNK`` labels is scored per
  pass over the features (``acc[l] += w_i K[l, i]``, ``K`` staged in shared memory per tile as
  ``float4`` rows), then change-tested and folded into a running masked argmax (strictly greater
  replaces: ties keep the lower label, the rule of :func:`~scanforest.kernels.hypotheses.
  masked_argmax`). The paper's label-major global accumulator (Fig. 2) was the coalesced
  layout for a separate scoring pass; fusing scoring, test and argmax removes the accumulator
  and its traffic altogether. Labels beyond ``LCHUNK`` take further passes (``w`` recomputed,
  amortised over the chunk).
* **No host round trip inside a call**: one upload of the packed integer table (pairs,
  offsets, DFS per pair, track->pair map) and one of the tracks; feature colours are sampled on
  the device (``flow_features``); results stay on the device.

Measured (``scanforest bench motion``, NVIDIA H200, 156 tracks, 8 pairs per launch): the
interpolation kernel takes 0.020 ms per 320x240 pair and 0.39 ms per 1920x1080 pair (about
0.8e12 pixel-track pairs per second), the hypotheses kernel with 8 labels 0.025 and 0.54 ms;
hypotheses time grows about linearly beyond 8 labels (8.3 ms per 1080p pair at 256 labels,
about 1e13 multiply-adds per second, a third of the FP32 peak; not profiled further: the inner
loop issues one shared-memory ``float4`` read of the ``K`` tile per four multiply-adds, and
two pixels per thread would halve that).
"""
from __future__ import annotations

import functools

import numpy as np

THREADS = 256
TILE = 128

_SRC = r"""
#ifndef LCHUNK
#define LCHUNK 8
#endif
#define TILE %(TILE)d

__device__ __forceinline__ float d5(const float4 a, const float4 b, float qx, float qy, float qr,
                                    float qg, float qb) {
    float dx = a.x - qx, dy = a.y - qy, dr = a.z - qr, dg = a.w - qg, db = b.x - qb;
    return dx * dx + dy * dy + dr * dr + dg * dg + db * db;
}

__device__ __forceinline__ float4 lerp4(float4 a, float4 b, float f) {
    return make_float4(a.x + f * (b.x - a.x), a.y + f * (b.y - a.y), a.z + f * (b.z - a.z), 0.f);
}

// bilinear colour at (X, Y) inside the frame; x1 / y1 clamped to the last column / row
__device__ __forceinline__ float4 bilinear(const float4* __restrict__ I, int H, int W, float X,
                                           float Y) {
    int x0 = (int)floorf(X), y0 = (int)floorf(Y);
    float fx = X - (float)x0, fy = Y - (float)y0;
    int x1 = min(x0 + 1, W - 1), y1 = min(y0 + 1, H - 1);
    float4 top = lerp4(I[(long long)y0 * W + x0], I[(long long)y0 * W + x1], fx);
    float4 bot = lerp4(I[(long long)y1 * W + x0], I[(long long)y1 * W + x1], fx);
    return lerp4(top, bot, fy);
}

__device__ __forceinline__ bool unchanged(float4 c0, float4 c1, float tau) {
    float d = fmaxf(fabsf(c1.x - c0.x), fmaxf(fabsf(c1.y - c0.y), fabsf(c1.z - c0.z)));
    return d <= tau;
}

// stage features t0 .. t0 + n - 1 (two float4 each) into shared memory
__device__ __forceinline__ void load_tile(float4* tile, const float4* __restrict__ feat, int t0,
                                          int n) {
    for (int k = threadIdx.x; k < 2 * n; k += blockDim.x) tile[k] = feat[2LL * t0 + k];
}

// pass 1: minimum scaled squared 5-D distance over the pair's features
__device__ __forceinline__ float min_distance(float4* tile, const float4* __restrict__ feat,
                                              int s, int e, float qx, float qy, float qr,
                                              float qg, float qb) {
    float m = __int_as_float(0x7f800000);
    for (int t0 = s; t0 < e; t0 += TILE) {
        const int n = min(TILE, e - t0);
        __syncthreads();
        load_tile(tile, feat, t0, n);
        __syncthreads();
        for (int k = 0; k < n; ++k) m = fminf(m, d5(tile[2 * k], tile[2 * k + 1], qx, qy, qr, qg, qb));
    }
    return m;
}

// one thread per feature: colour of I0 at the track start (bilinear), pre-scaled table rows
extern "C" __global__ void flow_features(const float4* __restrict__ frames, int H, int W,
                                         const int* __restrict__ pairs,
                                         const int* __restrict__ tpair,
                                         const float4* __restrict__ tracks, int M, float sx,
                                         float sc, float4* __restrict__ feat) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= M) return;
    const float4 t = tracks[k];
    const int b = tpair[k];
    const float4* I0 = frames + (long long)pairs[2 * b] * H * W;
    float X = fminf(fmaxf(t.x, 0.f), (float)(W - 1)), Y = fminf(fmaxf(t.y, 0.f), (float)(H - 1));
    float4 c = bilinear(I0, H, W, X, Y);
    feat[2 * k] = make_float4(t.x * sx, t.y * sx, c.x * sc, c.y * sc);
    feat[2 * k + 1] = make_float4(c.z * sc, t.z - t.x, t.w - t.y, 0.f);
}

// Method 1: u = sum w u_i / sum w with w = 2^(m - d_i); bilinear change test
extern "C" __global__ void __launch_bounds__(256)
flow_interp(const float4* __restrict__ frames, int H, int W, const int* __restrict__ pairs,
            const float4* __restrict__ feat, const int* __restrict__ offs, float sx, float sc,
            float tau, int test, float2* __restrict__ flow, unsigned char* __restrict__ valid) {
    __shared__ float4 tile[2 * TILE];
    const int b = blockIdx.y;
    const long long HW = (long long)H * W;
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = p < HW;
    const long long q = live ? p : 0;          // dead threads still help load tiles
    const int y = (int)(q / W), x = (int)(q - (long long)y * W);
    const float4* I0 = frames + (long long)pairs[2 * b] * HW;
    const float4* I1 = frames + (long long)pairs[2 * b + 1] * HW;
    const float4 c0 = I0[q];
    const float qx = (float)x * sx, qy = (float)y * sx;
    const float qr = c0.x * sc, qg = c0.y * sc, qb = c0.z * sc;
    const int s = offs[b], e = offs[b + 1];
    const float m = min_distance(tile, feat, s, e, qx, qy, qr, qg, qb);
    float sw = 0.f, su = 0.f, sv = 0.f;
    for (int t0 = s; t0 < e; t0 += TILE) {
        const int n = min(TILE, e - t0);
        __syncthreads();
        load_tile(tile, feat, t0, n);
        __syncthreads();
        for (int k = 0; k < n; ++k) {
            const float4 fa = tile[2 * k], fb = tile[2 * k + 1];
            const float w = exp2f(m - d5(fa, fb, qx, qy, qr, qg, qb));
            sw += w;
            su += w * fb.y;
            sv += w * fb.z;
        }
    }
    if (!live) return;
    const float u = su / sw, v = sv / sw;
    flow[(long long)b * HW + p] = make_float2(u, v);
    bool ok = true;
    if (test) {
        const float X = (float)x + u, Y = (float)y + v;
        ok = (X >= 0.f && X <= (float)(W - 1) && Y >= 0.f && Y <= (float)(H - 1));
        if (ok) ok = unchanged(c0, bilinear(I1, H, W, X, Y), tau);
    }
    valid[(long long)b * HW + p] = ok ? 1 : 0;
}

// Method 2 (Algorithm 3): score every DFS label, change-test it, masked argmax in registers
extern "C" __global__ void __launch_bounds__(256)
flow_hyp(const float4* __restrict__ frames, int H, int W, const int* __restrict__ pairs,
         const float4* __restrict__ feat, const int* __restrict__ offs,
         const int* __restrict__ dfs, float sx, float sc, float sf2, float tau, int test,
         float2* __restrict__ flow, unsigned char* __restrict__ valid, int* __restrict__ label) {
    __shared__ float4 tile[2 * TILE];
    __shared__ float4 ktile[TILE * (LCHUNK / 4)];      // K[k][l]: LCHUNK floats per feature
    const int b = blockIdx.y;
    const long long HW = (long long)H * W;
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = p < HW;
    const long long q = live ? p : 0;
    const int y = (int)(q / W), x = (int)(q - (long long)y * W);
    const float4* I0 = frames + (long long)pairs[2 * b] * HW;
    const float4* I1 = frames + (long long)pairs[2 * b + 1] * HW;
    const float4 c0 = I0[q];
    const float qx = (float)x * sx, qy = (float)y * sx;
    const float qr = c0.x * sc, qg = c0.y * sc, qb = c0.z * sc;
    const int s = offs[b], e = offs[b + 1];
    const int u0 = dfs[4 * b], v0 = dfs[4 * b + 1], nu = dfs[4 * b + 2];
    const int nl = nu * dfs[4 * b + 3];
    const float m = min_distance(tile, feat, s, e, qx, qy, qr, qg, qb);
    float best = -1.f, abest = -1.f;                  // scores are >= 0
    int bl = -1, al = 0;
    float* kt = reinterpret_cast<float*>(ktile);
    for (int c = 0; c < nl; c += LCHUNK) {
        float acc[LCHUNK];
#pragma unroll
        for (int l = 0; l < LCHUNK; ++l) acc[l] = 0.f;
        for (int t0 = s; t0 < e; t0 += TILE) {
            const int n = min(TILE, e - t0);
            __syncthreads();
            load_tile(tile, feat, t0, n);
            for (int j = threadIdx.x; j < n * LCHUNK; j += blockDim.x) {
                const int k = j / LCHUNK, l = j - k * LCHUNK, lab = c + l;
                float val = 0.f;
                if (lab < nl) {
                    const int hv = lab / nu, hu = lab - hv * nu;
                    const float4 fb = feat[2LL * (t0 + k) + 1];
                    const float du = (float)(u0 + hu) - fb.y, dv = (float)(v0 + hv) - fb.z;
                    val = exp2f(-(du * du + dv * dv) * sf2);
                }
                kt[j] = val;
            }
            __syncthreads();
            for (int k = 0; k < n; ++k) {
                const float w = exp2f(m - d5(tile[2 * k], tile[2 * k + 1], qx, qy, qr, qg, qb));
#pragma unroll
                for (int l4 = 0; l4 < LCHUNK / 4; ++l4) {
                    const float4 kv = ktile[k * (LCHUNK / 4) + l4];
                    acc[4 * l4 + 0] += w * kv.x;
                    acc[4 * l4 + 1] += w * kv.y;
                    acc[4 * l4 + 2] += w * kv.z;
                    acc[4 * l4 + 3] += w * kv.w;
                }
            }
        }
#pragma unroll
        for (int l = 0; l < LCHUNK; ++l) {
            const int lab = c + l;
            if (lab < nl) {
                const int hv = lab / nu, hu = lab - hv * nu;
                bool ok = true;
                if (test) {
                    const int xx = x + u0 + hu, yy = y + v0 + hv;
                    ok = xx >= 0 && xx < W && yy >= 0 && yy < H;
                    if (ok) ok = unchanged(c0, I1[(long long)yy * W + xx], tau);
                }
                if (acc[l] > abest) { abest = acc[l]; al = lab; }
                if (ok && acc[l] > best) { best = acc[l]; bl = lab; }
            }
        }
    }
    if (!live) return;
    const int lb = bl >= 0 ? bl : al;
    const int hv = lb / nu, hu = lb - hv * nu;
    flow[(long long)b * HW + p] = make_float2((float)(u0 + hu), (float)(v0 + hv));
    valid[(long long)b * HW + p] = bl >= 0 ? 1 : 0;
    label[(long long)b * HW + p] = lb;
}
""" % {"TILE": TILE}

LCHUNKS = (4, 8, 16, 32)


@functools.lru_cache(maxsize=None)
def _module(lchunk: int):
    import cupy as cp

    return cp.RawModule(code=_SRC, options=("--std=c++17", "-use_fast_math", f"-DLCHUNK={lchunk}"))


def kernel(name: str, lchunk: int = 8):
    return _module(lchunk).get_function(name)


def lchunk_for(n_labels: int) -> int:
    """Labels per register chunk: the smallest of 4/8/16/32 covering the DFS (32 beyond)."""
    for c in LCHUNKS:
        if n_labels <= c:
            return c
    return LCHUNKS[-1]


def frames4(parts):
    """Stack frame arrays (N_i, H, W, C) into one (F, H, W, 4) float32 device array."""
    import cupy as cp

    n = sum(int(p.shape[0]) for p in parts)
    _, h, w, c = parts[0].shape
    out = cp.zeros((n, h, w, 4), cp.float32)
    i = 0
    for p in parts:
        k = int(p.shape[0])
        out[i:i + k, :, :, :c] = cp.asarray(p)     # one upload in the input dtype, cast on device
        i += k
    return out


def _grid(h: int, w: int, b: int):
    return ((h * w + THREADS - 1) // THREADS, b)


def features(f4, pairs, tracks, tpair, offs, sx, sc, dfs=None):
    """Upload the packed tables (one int32 array: pairs, offsets, DFS, track -> pair; one
    float32 array: the tracks) and build the (M, 2) float4 feature table on the device."""
    import cupy as cp

    m = len(tracks)
    nb = len(pairs)
    dfs = np.zeros((nb, 4), np.int32) if dfs is None else np.asarray(dfs, np.int32)
    ints = np.concatenate([pairs.reshape(-1), offs, dfs.reshape(-1), tpair]).astype(np.int32)
    d_ints = cp.asarray(ints)
    d_tr = cp.asarray(np.ascontiguousarray(tracks, np.float32))
    d_pairs = d_ints[:2 * nb]
    d_offs = d_ints[2 * nb:3 * nb + 1]
    d_dfs = d_ints[3 * nb + 1:7 * nb + 1]
    d_tpair = d_ints[7 * nb + 1:]
    feat = cp.empty((m, 8), cp.float32)
    h, w = f4.shape[1:3]
    kernel("flow_features")(((m + 127) // 128,), (128,),
                            (f4, np.int32(h), np.int32(w), d_pairs, d_tpair, d_tr, np.int32(m),
                             np.float32(sx), np.float32(sc), feat))
    return dict(feat=feat, pairs=d_pairs, offs=d_offs, dfs=d_dfs, dfs_host=dfs)


def interpolate(f4, pairs, dev, offs, sx, sc, tau, test):
    import cupy as cp

    nb = len(pairs)
    h, w = f4.shape[1:3]
    flow = cp.empty((nb, h, w, 2), cp.float32)
    valid = cp.empty((nb, h, w), cp.uint8)
    kernel("flow_interp")(_grid(h, w, nb), (THREADS,),
                          (f4, np.int32(h), np.int32(w), dev["pairs"], dev["feat"], dev["offs"],
                           np.float32(sx), np.float32(sc), np.float32(tau), np.int32(bool(test)),
                           flow, valid))
    return flow, valid.view(cp.bool_)


def hypotheses(f4, pairs, dev, offs, dfs, sx, sc, sf2, tau, test):
    import cupy as cp

    nb = len(pairs)
    h, w = f4.shape[1:3]
    dfs = dev["dfs_host"] if dfs is None else np.ascontiguousarray(dfs, np.int32)
    lchunk = lchunk_for(int((dfs[:, 2] * dfs[:, 3]).max()))
    d_dfs = dev["dfs"] if np.array_equal(dfs, dev["dfs_host"]) else cp.asarray(dfs.reshape(-1))
    flow = cp.empty((nb, h, w, 2), cp.float32)
    valid = cp.empty((nb, h, w), cp.uint8)
    label = cp.empty((nb, h, w), cp.int32)
    kernel("flow_hyp", lchunk)(_grid(h, w, nb), (THREADS,),
                               (f4, np.int32(h), np.int32(w), dev["pairs"], dev["feat"],
                                dev["offs"], d_dfs, np.float32(sx), np.float32(sc),
                                np.float32(sf2), np.float32(tau), np.int32(bool(test)), flow,
                                valid, label))
    return flow, valid.view(cp.bool_), label
