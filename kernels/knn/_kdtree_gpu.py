"""GPU backend of :mod:`scanforest.kernels.knn.kdtree`: level-by-level construction, P-ANNS, P-BANNS.

Construction (one host sync per level, for the number of nodes split):

1. ``split_level_sample`` (the sample rules: one block per node, sample extents and variances
   in shared memory, the sample mean or median) or ``split_level`` (midpoint rule: one thread
   per node, from the node box)
   chooses (dim, value), same rule and hash as the numba build;
2. child ids by an exclusive scan of the split flags (children numbered breadth first);
3. ``mark_left``: one thread per point position tests ``x[dim] <= value`` of its owner node;
4. one global inclusive scan of the left flags gives, inside every node range, the stable
   partition destination of each position (``scatter_level``), so child ranges stay contiguous;
5. ``box_level``: child boxes by a chunked segmented min/max over the new ranges (one block per
   chunk of positions, threads over dimensions, order-preserving float->uint atomics).

This replaces the paper's K presorted index lists (K x N words per array, 14 GB per array at
N = 10M, d = 352) by one scan over the N positions per level.

Search kernels keep the numba semantics bit for bit (canonical distance, (dist, id) keys, the
same binary heap), so P-ANNS on the GPU returns what the CPU returns, for any budget.
"""
from __future__ import annotations

import functools
import time

import numpy as np

from .bruteforce import _CUDA_COMMON, _half_rows, decode_keys, knn_bruteforce
from ._kdtree_common import DESCENT_IDS  # the kernels' `path` argument

HCAP = 256   # default heap capacity (kdtree.HEAP_CAP); a search passes kdtree.heap_capacity's
QB = 64      # queries per block of the "tile" leaf kernel (one per thread)
RQ = 32      # queries per block of the "rotate" leaf kernel
RP = 64      # leaf points per tile (= threads) of the "rotate" leaf kernel
WINDOW_KERNEL = "stream"  # sliding-window leaf kernel: "stream", "rotate" (threads over points) or "tile"
HALF_REDO_ROWS = 1 << 22  # rows widened at a time by the exact fallback over float16 rows
SQ = 4       # queries per block of the "stream" leaf kernel (staged whole in shared memory)
SP = 32      # threads (leaf points in flight) per block of the "stream" leaf kernel
PB = 32      # leaf points per shared-memory tile
DC = 32      # dimensions per shared-memory chunk
MQ = 32      # queries per block of the tensor-core leaf scan (float16 rows)
MR = 32      # leaf rows per tile of the tensor-core leaf scan
MT = 128     # threads per block of the tensor-core leaf scan
# batched rounds: score leaves on tensor cores first, canonical distances only where needed.
# "half": over float16 rows (10M x 352 float16, one H200: 199k -> 513k queries/s at recall
# 0.956); float32 rows keep the canonical stream kernel, which was as fast or faster on PCL SHOT
# (1.15M rows, 20k queries: 0.73-0.87x at 64-128 leaves, 1.01-1.14x at 256-512). True: every
# row type; False: never.
MMA_FILTER = "half"

_SRC = _CUDA_COMMON + r"""
#define HCAP 256
#define RQ 32
#define RP 64
#define QB 64
#define PB 32
#define DC 32
#define SQ 4
#define SP 32
#define F_INF __int_as_float(0x7f800000)

// leaf-ordered rows: float, or IEEE half (PT_HALF): see bruteforce._half_rows
""" + _half_rows("PT_HALF", "PT", "ldp") + r"""
__device__ __forceinline__ float canon_dist_p(const float* __restrict__ q, const PT* __restrict__ x, int d) {
    float acc = 0.0f;
    for (int j = 0; j < d; ++j) {
        float t = __fsub_rn(q[j], ldp(x[j]));
        acc = __fadd_rn(acc, __fmul_rn(t, t));
    }
    return acc;
}

__device__ __forceinline__ unsigned long long sf_hash(unsigned long long seed, unsigned long long node) {
    unsigned long long z = seed * 0x9E3779B97F4A7C15ULL + node + 0x632BE59BD9B4E019ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
__device__ __forceinline__ unsigned int f2o(float f) {
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float o2f(unsigned int e) {
    return __uint_as_float((e & 0x80000000u) ? (e & 0x7fffffffu) : ~e);
}

__device__ void choose_split(const float* L, const float* H, int d, int i, int rand_f,
        unsigned long long seed, int* dim_out, float* val_out) {
    int dim = -1;
    if (rand_f <= 1) {
        float bext = 0.0f;
        for (int j = 0; j < d; ++j) { float e = __fsub_rn(H[j], L[j]); if (e > bext) { bext = e; dim = j; } }
    } else {
        int topd[32]; float tope[32]; int cnt = 0;
        for (int j = 0; j < d; ++j) {
            float e = __fsub_rn(H[j], L[j]);
            if (!(e > 0.0f)) continue;
            int pos;
            if (cnt < rand_f) { pos = cnt++; }
            else if (e > tope[rand_f - 1]) { pos = rand_f - 1; }
            else continue;
            while (pos > 0 && tope[pos - 1] < e) { tope[pos] = tope[pos - 1]; topd[pos] = topd[pos - 1]; --pos; }
            tope[pos] = e; topd[pos] = j;
        }
        if (cnt > 0) dim = topd[(int)(sf_hash(seed, (unsigned long long)i) % (unsigned long long)cnt)];
    }
    *dim_out = dim;
    *val_out = 0.0f;
    if (dim < 0) return;
    float a = L[dim], b = H[dim];
    float v = __fadd_rn(__fmul_rn(0.5f, a), __fmul_rn(0.5f, b));
    if (!(v < b)) v = a;
    *val_out = v;
}

extern "C" __global__ void split_level(const float* __restrict__ lo, const float* __restrict__ hi, int d,
        const long long* __restrict__ start, const long long* __restrict__ end, int l0, int nl,
        long long leaf_size, int depth, int max_depth, int rand_f, unsigned long long seed,
        int* __restrict__ dims, float* __restrict__ vals) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nl) return;
    int i = l0 + t;
    dims[t] = -1; vals[t] = 0.0f;
    if (!(end[i] - start[i] > leaf_size && depth < max_depth)) return;
    int dim; float v;
    choose_split(lo + (long long)i * d, hi + (long long)i * d, d, i, rand_f, seed, &dim, &v);
    dims[t] = dim; vals[t] = v;
}

// the sample rules of kdtree._choose_split_sample (rule 1: median, 2: variance): one block per
// node, threads over the dimensions for the sample extents (and variances) in shared memory,
// thread 0 picks the dimension and the cut; every sum in sample order, correctly rounded
#define SAMPLE 64
__device__ __forceinline__ float sample_mean(const float* __restrict__ X, int d, const long long* rows, int ns,
        int j) {
    float acc = 0.0f;
    for (int k = 0; k < ns; ++k) acc = __fadd_rn(acc, X[rows[k] * d + j]);
    return __fdiv_rn(acc, (float)ns);
}
extern "C" __global__ void split_level_sample(const float* __restrict__ X, int d,
        const long long* __restrict__ perm, const float* __restrict__ lo, const float* __restrict__ hi,
        const long long* __restrict__ start, const long long* __restrict__ end, int l0,
        long long leaf_size, int depth, int max_depth, int rand_f, unsigned long long seed, int rule,
        int* __restrict__ dims, float* __restrict__ vals) {
    extern __shared__ float sh[];          // smin[d], smax[d], zero[d], buf[SAMPLE]
    __shared__ long long rows[SAMPLE];
    int t = blockIdx.x;
    int i = l0 + t;
    long long s = start[i], cnt = end[i] - s;
    if (!(cnt > leaf_size && depth < max_depth)) {
        if (threadIdx.x == 0) { dims[t] = -1; vals[t] = 0.0f; }
        return;
    }
    int ns = cnt < SAMPLE ? (int)cnt : SAMPLE;
    for (int k = threadIdx.x; k < ns; k += blockDim.x) rows[k] = perm[s + ((long long)k * cnt) / ns];
    __syncthreads();
    float* smin = sh;
    float* smax = sh + d;
    float* zero = sh + 2 * d;
    float* buf = sh + 3 * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float mn = F_INF, mx = -F_INF;
        for (int k = 0; k < ns; ++k) {
            float v = __fadd_rn(X[rows[k] * d + j], 0.0f);
            if (v < mn) mn = v;
            if (v > mx) mx = v;
        }
        smin[j] = mn; smax[j] = mx;
        if (rule == 2) {  // smax[j]: the sample variance (x ns), 0 without extent
            zero[j] = 0.0f;
            float var = 0.0f;
            if (mx > mn) {
                float mean = sample_mean(X, d, rows, ns, j);
                for (int k = 0; k < ns; ++k) {
                    float u = __fsub_rn(X[rows[k] * d + j], mean);
                    var = __fadd_rn(var, __fmul_rn(u, u));
                }
            }
            smax[j] = var;
        }
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    const float* H = hi + (long long)i * d;
    int dim; float v;
    choose_split(rule == 2 ? zero : smin, smax, d, i, rand_f, seed, &dim, &v);
    if (dim < 0) {
        choose_split(lo + (long long)i * d, H, d, i, rand_f, seed, &dim, &v);
        dims[t] = dim; vals[t] = v;
        return;
    }
    if (rule == 2) {
        v = sample_mean(X, d, rows, ns, dim);
        if (!(v >= smin[dim])) v = smin[dim];
        if (!(v < H[dim])) v = smin[dim];  // < the sample maximum <= hi: both children non-empty
        dims[t] = dim; vals[t] = v;
        return;
    }
    for (int k = 0; k < ns; ++k) buf[k] = __fadd_rn(X[rows[k] * d + dim], 0.0f);
    for (int a = 1; a < ns; ++a) {
        float x = buf[a]; int b = a - 1;
        while (b >= 0 && buf[b] > x) { buf[b + 1] = buf[b]; --b; }
        buf[b + 1] = x;
    }
    int h = ns / 2;
    v = buf[h];
    if (!(v < H[dim])) {
        while (h > 0 && !(buf[h] < v)) --h;
        v = buf[h];
    }
    dims[t] = dim; vals[t] = v;
}

extern "C" __global__ void mark_left(const float* __restrict__ X, int d, const long long* __restrict__ perm,
        const int* __restrict__ owner, const int* __restrict__ sdim, const float* __restrict__ sval,
        long long n, long long* __restrict__ isleft) {
    long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n) return;
    int o = owner[p];
    long long r = 0;
    if (o >= 0) {
        int dm = sdim[o];
        if (dm >= 0) r = X[perm[p] * d + dm] <= sval[o] ? 1 : 0;
    }
    isleft[p] = r;
}

extern "C" __global__ void scatter_level(const long long* __restrict__ perm, const int* __restrict__ owner,
        const int* __restrict__ sdim, const int* __restrict__ child, const long long* __restrict__ start,
        const long long* __restrict__ end, const long long* __restrict__ isleft, const long long* __restrict__ C,
        long long n, long long* __restrict__ nperm, int* __restrict__ nowner) {
    long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n) return;
    int o = owner[p];
    if (o < 0 || sdim[o] < 0) { nperm[p] = perm[p]; nowner[p] = -1; return; }
    long long s = start[o], e = end[o];
    long long base = C[s] - isleft[s];
    long long lb = (C[p] - isleft[p]) - base;
    long long nleft = C[e - 1] - base;
    long long dest;
    int c = child[o];
    if (isleft[p]) { dest = s + lb; }
    else { dest = s + nleft + (p - s - lb); c += 1; }
    nperm[dest] = perm[p];
    nowner[dest] = c;
}

extern "C" __global__ void ranges_level(const int* __restrict__ child, const int* __restrict__ sdim,
        const long long* __restrict__ isleft, const long long* __restrict__ C, int l0, int nl,
        long long* __restrict__ start, long long* __restrict__ end) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nl) return;
    int i = l0 + t;
    if (sdim[i] < 0) return;
    long long s = start[i], e = end[i];
    long long nleft = C[e - 1] - (C[s] - isleft[s]);
    int c = child[i];
    start[c] = s; end[c] = s + nleft; start[c + 1] = s + nleft; end[c + 1] = e;
}

extern "C" __global__ void box_level(const float* __restrict__ X, int d, const long long* __restrict__ perm,
        const int* __restrict__ owner, long long n, int chunk, int first,
        unsigned int* __restrict__ elo, unsigned int* __restrict__ ehi) {
    long long p0 = (long long)blockIdx.x * chunk;
    long long p1 = p0 + chunk < n ? p0 + chunk : n;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        int cur = -1; float mn = F_INF, mx = -F_INF;
        for (long long p = p0; p < p1; ++p) {
            int o = owner[p];
            if (o != cur) {
                if (cur >= 0) {
                    atomicMin(elo + (long long)(cur - first) * d + j, f2o(mn));
                    atomicMax(ehi + (long long)(cur - first) * d + j, f2o(mx));
                }
                cur = o; mn = F_INF; mx = -F_INF;
            }
            if (o >= 0) {
                float v = __fadd_rn(X[perm[p] * d + j], 0.0f);
                mn = fminf(mn, v); mx = fmaxf(mx, v);
            }
        }
        if (cur >= 0) {
            atomicMin(elo + (long long)(cur - first) * d + j, f2o(mn));
            atomicMax(ehi + (long long)(cur - first) * d + j, f2o(mx));
        }
    }
}

extern "C" __global__ void decode_box(const unsigned int* __restrict__ e, long long n, float* __restrict__ out) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) out[t] = o2f(e[t]);
}

// ---------------------------------------------------------------------------- search helpers
__device__ __forceinline__ float box_term(float v, float l, float h) {
    float t;
    if (v < l) t = __fsub_rn(l, v);
    else if (v > h) t = __fsub_rn(v, h);
    else t = 0.0f;
    return __fmul_rn(t, t);
}
// squared distance from q to the box [L, H], summed in dimension order (float4 loads when the
// rows are 16-byte aligned: the same sum, bit for bit)
__device__ __forceinline__ float box_dist(const float* __restrict__ q, const float* __restrict__ L,
                                          const float* __restrict__ H, int d) {
    float acc = 0.0f;
    if (((d & 3) | (((unsigned long long)q | (unsigned long long)L | (unsigned long long)H) & 15)) == 0) {
        const float4* q4 = (const float4*)q;
        const float4* L4 = (const float4*)L;
        const float4* H4 = (const float4*)H;
#pragma unroll 2
        for (int j = 0; j < (d >> 2); ++j) {
            float4 v = __ldg(q4 + j), l = __ldg(L4 + j), h = __ldg(H4 + j);
            acc = __fadd_rn(acc, box_term(v.x, l.x, h.x));
            acc = __fadd_rn(acc, box_term(v.y, l.y, h.y));
            acc = __fadd_rn(acc, box_term(v.z, l.z, h.z));
            acc = __fadd_rn(acc, box_term(v.w, l.w, h.w));
        }
        return acc;
    }
    for (int j = 0; j < d; ++j) acc = __fadd_rn(acc, box_term(q[j], L[j], H[j]));
    return acc;
}
// insert a key into the ascending top-k list unless it is already there (a point reached through a
// second tree of a forest has the same key)
__device__ __forceinline__ void top_insert(unsigned long long* top, int& cnt, int k, unsigned long long key) {
    if (cnt == k && key >= top[k - 1]) return;
    for (int i = 0; i < cnt; ++i) if (top[i] == key) return;
    int pos;
    if (cnt == k) pos = k - 1;
    else pos = cnt++;
    while (pos > 0 && top[pos - 1] > key) { top[pos] = top[pos - 1]; --pos; }
    top[pos] = key;
}
// the queue of pending boxes: a min-max heap, as kdtree._heap_* (same code order, same ties)
__device__ __forceinline__ void mm_swap(float* hd, int* hn, int a, int b) {
    float t = hd[a]; hd[a] = hd[b]; hd[b] = t;
    int u = hn[a]; hn[a] = hn[b]; hn[b] = u;
}
__device__ __forceinline__ bool mm_min_level(int i) { return ((31 - __clz(i + 1)) & 1) == 0; }
__device__ __forceinline__ bool mm_before(bool is_min, float a, float b) { return is_min ? a < b : a > b; }
__device__ __forceinline__ void mm_up(float* hd, int* hn, int pos) {
    if (pos == 0) return;
    int par = (pos - 1) >> 1;
    bool is_min = mm_min_level(pos);
    if (mm_before(!is_min, hd[pos], hd[par])) {  // min level above its (max) parent, or the reverse
        mm_swap(hd, hn, pos, par);
        pos = par;
        is_min = !is_min;
    }
    while (pos >= 3) {
        int g = (((pos - 1) >> 1) - 1) >> 1;
        if (mm_before(is_min, hd[pos], hd[g])) { mm_swap(hd, hn, pos, g); pos = g; }
        else break;
    }
}
__device__ __forceinline__ void mm_down(float* hd, int* hn, int pos, int size) {
    bool is_min = mm_min_level(pos);
    while (true) {
        int c = 2 * pos + 1;
        if (c >= size) return;
        int m = c;
        int cand[5] = {c + 1, 2 * c + 1, 2 * c + 2, 2 * c + 3, 2 * c + 4};
#pragma unroll
        for (int t = 0; t < 5; ++t) {
            int j = cand[t];
            if (j < size && mm_before(is_min, hd[j], hd[m])) m = j;
        }
        if (m > c + 1) {  // a grandchild
            if (mm_before(is_min, hd[m], hd[pos])) {
                mm_swap(hd, hn, m, pos);
                int p = (m - 1) >> 1;
                if (mm_before(!is_min, hd[m], hd[p])) mm_swap(hd, hn, m, p);
                pos = m;
            } else return;
        } else {
            if (mm_before(is_min, hd[m], hd[pos])) mm_swap(hd, hn, m, pos);
            return;
        }
    }
}
__device__ __forceinline__ int heap_push(float* hd, int* hn, int size, float dv, int nv) {
    hd[size] = dv; hn[size] = nv;
    mm_up(hd, hn, size);
    return size + 1;
}
__device__ __forceinline__ int heap_remove(float* hd, int* hn, int size, int pos) {
    size -= 1;
    if (pos < size) { hd[pos] = hd[size]; hn[pos] = hn[size]; mm_down(hd, hn, pos, size); }
    return size;
}
// remove the root (the closest box; the caller read hd[0], hn[0]); returns the new size
__device__ __forceinline__ int heap_pop(float* hd, int* hn, int size) { return heap_remove(hd, hn, size, 0); }
// keeps the HCAP closest boxes: when full the farthest entry is replaced by a closer new one;
// returns the evicted distance (or -1)
__device__ __forceinline__ float heap_push_bounded(float* hd, int* hn, int& size, float dv, int nv) {
    if (size < HCAP) { size = heap_push(hd, hn, size, dv, nv); return -1.0f; }
    int mi = size <= 2 ? size - 1 : (hd[2] > hd[1] ? 2 : 1);
    if (!(dv < hd[mi])) return dv;
    float ev = hd[mi];
    size = heap_remove(hd, hn, size, mi);
    size = heap_push(hd, hn, size, dv, nv);
    return ev;
}
// the O(1) descent bound, as kdtree._path_bound (same operation order): P's box distance dp with
// its term on the split dimension (P's interval [a, b]) replaced by the far side of the cut at v
#define PATH_SAFE 0.999996185302734375f
__device__ __forceinline__ float path_bound(float dp, float qs, float a, float b, float v, bool near_left) {
    float c = 0.0f, t;
    if (qs < a) { t = __fsub_rn(a, qs); c = __fmul_rn(t, t); }
    else if (qs > b) { t = __fsub_rn(qs, b); c = __fmul_rn(t, t); }
    if (near_left) { float e = v > a ? v : a; t = __fsub_rn(e, qs); }
    else { float e = v < b ? v : b; t = __fsub_rn(qs, e); }
    return __fmul_rn(__fadd_rn(__fsub_rn(dp, c), __fmul_rn(t, t)), PATH_SAFE);
}
// descend from the popped `node` (its queue key `key`) to a leaf, pushing far siblings with their
// box distance (`path` 0: kdtree's "box" descent), with the O(1) bound from the popped box's
// distance (1: "path") or from its key (2: "incremental", no O(d) work); returns the leaf, or -1
// when the popped box's distance exceeds `worst` (path) or check_near (bounded search) finds the
// near child's box farther than `worst`
__device__ __forceinline__ int descend(int node, const float* __restrict__ q, int d, const int* __restrict__ child,
        const int* __restrict__ sdim, const float* __restrict__ sval, const float* __restrict__ lo,
        const float* __restrict__ hi, float worst, float* hd, int* hn, int& hs, int& ovf, bool check_near,
        int path, float key) {
    const float* pl = lo + (long long)node * d;
    const float* ph = hi + (long long)node * d;
    float dp = 0.0f;
    if (path == 2) {
        dp = key;  // incremental: P's key (a lower bound of its box distance, already <= worst)
    } else if (path) {
        dp = box_dist(q, pl, ph, d);
        if (dp > worst) return -1;
    }
    while (child[node] >= 0) {
        int c = child[node];
        int near_, far_;
        const int s = sdim[node];
        const bool left = q[s] <= sval[node];
        if (left) { near_ = c; far_ = c + 1; } else { near_ = c + 1; far_ = c; }
        float bd = path ? path_bound(dp, q[s], pl[s], ph[s], sval[node], left)
                        : box_dist(q, lo + (long long)far_ * d, hi + (long long)far_ * d, d);
        if (bd <= worst) {
            float ev = heap_push_bounded(hd, hn, hs, bd, far_);
            if (ev >= 0.0f && ev <= worst) ovf = 1;
        }
        if (check_near && box_dist(q, lo + (long long)near_ * d, hi + (long long)near_ * d, d) > worst) return -1;
        node = near_;
    }
    return node;
}
// pop boxes until one is within `worst`; returns it (its key in `key`) or -1 (the queue is then empty)
__device__ __forceinline__ int pop_within(float* hd, int* hn, int& hs, float worst, float& key) {
    while (hs > 0) {
        float bd = hd[0]; int nd = hn[0];
        hs = heap_pop(hd, hn, hs);
        if (bd <= worst) { key = bd; return nd; }
        hs = 0;
    }
    return -1;
}

// ---------------------------------------------------------------------------- P-ANNS
// One queue over the boxes of every tree of a (packed) forest: the roots are pushed first, then
// "pop the closest box -> descend to its nearest leaf pushing far siblings -> scan the leaf".
// lim[qi]: boxes farther than it are pruned (the float below the query's bound, or +inf).
extern "C" __global__ void anns(const PT* __restrict__ points, const long long* __restrict__ perm,
        const int* __restrict__ child, const int* __restrict__ sdim, const float* __restrict__ sval,
        const long long* __restrict__ start, const long long* __restrict__ end, const float* __restrict__ lo,
        const float* __restrict__ hi, int d, const float* __restrict__ Q, int m, int k, int budget,
        const int* __restrict__ roots, int nroots, const float* __restrict__ lim,
        unsigned long long* __restrict__ out, int* __restrict__ overflow, int* __restrict__ visits_out,
        int path) {
    int qi = blockIdx.x * blockDim.x + threadIdx.x;
    if (qi >= m) return;
    const float* q = Q + (long long)qi * d;
    const float bl = lim[qi];
    unsigned long long top[__KP__];
    int cnt = 0;
    float hd[HCAP]; int hn[HCAP]; int hs = 0;
    int ovf = 0, visits = 0, node = 0;
    const bool check_near = bl < F_INF;
    for (int t = 0; t < nroots; ++t) {
        int r = roots[t];
        float bd = box_dist(q, lo + (long long)r * d, hi + (long long)r * d, d);
        if (bd <= bl) {
            float ev = heap_push_bounded(hd, hn, hs, bd, r);
            if (ev >= 0.0f && ev <= bl) ovf = 1;
        }
    }
    while (true) {
        float worst = cnt == k ? key_dist(top[k - 1]) : F_INF;
        worst = fminf(worst, bl);
        float key;
        node = pop_within(hd, hn, hs, worst, key);
        if (node < 0) break;
        node = descend(node, q, d, child, sdim, sval, lo, hi, worst, hd, hn, hs, ovf, check_near, path, key);
        if (node < 0) continue;
        for (long long p = start[node]; p < end[node]; ++p) {
            unsigned long long key = make_key(canon_dist_p(q, points + p * d, d), perm[p]);
            if (cnt < k || key < top[k - 1]) top_insert(top, cnt, k, key);
        }
        visits += 1;
        if (budget > 0 && visits >= budget) break;
    }
    for (int j = 0; j < k; ++j) out[(long long)qi * k + j] = j < cnt ? top[j] : KEY_NONE;
    overflow[qi] = ovf;
    visits_out[qi] = visits;
}

// ---------------------------------------------------------------------------- P-BANNS
extern "C" __global__ void banns_descend(const int* __restrict__ active, int na, const float* __restrict__ Q, int d,
        const int* __restrict__ child, const int* __restrict__ sdim, const float* __restrict__ sval,
        const float* __restrict__ lo, const float* __restrict__ hi, int k,
        const unsigned long long* __restrict__ top, const int* __restrict__ target, const float* __restrict__ TK,
        const float* __restrict__ lim, float* __restrict__ HD, int* __restrict__ HN, int* __restrict__ HS,
        int* __restrict__ OVF, int* __restrict__ leaf_of, int path) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= na) return;
    int qi = active[i];
    const float* q = Q + (long long)qi * d;
    const float bl = lim[qi];
    float worst = fminf(key_dist(top[(long long)qi * k + k - 1]), bl);
    int hs = HS[qi], ovf = OVF[qi];
    float* hd = HD + (long long)qi * HCAP;
    int* hn = HN + (long long)qi * HCAP;
    int leaf = descend(target[qi], q, d, child, sdim, sval, lo, hi, worst, hd, hn, hs, ovf, bl < F_INF, path,
                       TK[qi]);
    while (leaf < 0) {  // the descent was pruned: take the next box (-1: query done)
        float key;
        int nd = pop_within(hd, hn, hs, worst, key);
        if (nd < 0) break;
        leaf = descend(nd, q, d, child, sdim, sval, lo, hi, worst, hd, hn, hs, ovf, bl < F_INF, path, key);
    }
    HS[qi] = hs; OVF[qi] = ovf;
    leaf_of[i] = leaf;
}

// one block per (leaf, chunk of <= QB buffered queries); thread t owns query t of the chunk.
// Leaf points are staged in shared memory PB at a time, DC dimensions at a time; in slide s thread
// t pairs its query with point (t + s) mod PB, so a warp reads 32 different rows (no bank conflict
// with the +1 padding) and every query's top-P list has a single writer.
extern "C" __global__ void __launch_bounds__(QB) banns_leaf_window(const int* __restrict__ blk_leaf,
        const int* __restrict__ blk_first, const int* __restrict__ blk_cnt, const int* __restrict__ sorted_q,
        const float* __restrict__ Q, const PT* __restrict__ points, const long long* __restrict__ perm,
        const long long* __restrict__ start, const long long* __restrict__ end, int d, int k,
        unsigned long long* __restrict__ top) {
    __shared__ float qs[QB][DC + 1];
    __shared__ float ps[PB][DC + 1];
    __shared__ int qid[QB];
    int b = blockIdx.x, t = threadIdx.x;
    int leaf = blk_leaf[b], f = blk_first[b], qc = blk_cnt[b];
    if (leaf < 0) return;  // queries whose bounded descent found nothing (whole block)
    if (t < qc) qid[t] = sorted_q[f + t];
    __syncthreads();
    long long p_beg = start[leaf], p_end = end[leaf];
    unsigned long long* mytop = t < qc ? top + (long long)qid[t] * k : NULL;
    int cnt = 0;
    if (mytop) while (cnt < k && mytop[cnt] != KEY_NONE) ++cnt;
    for (long long p0 = p_beg; p0 < p_end; p0 += PB) {
        int np = (int)(p_end - p0 < PB ? p_end - p0 : PB);
        float acc[PB];
#pragma unroll
        for (int s = 0; s < PB; ++s) acc[s] = 0.0f;
        for (int c0 = 0; c0 < d; c0 += DC) {
            for (int idx = t; idx < QB * DC; idx += QB) {
                int r = idx / DC, j = idx % DC;
                qs[r][j] = (r < qc && c0 + j < d) ? Q[(long long)qid[r] * d + c0 + j] : 0.0f;
            }
            for (int idx = t; idx < PB * DC; idx += QB) {
                int r = idx / DC, j = idx % DC;
                ps[r][j] = (r < np && c0 + j < d) ? ldp(points[(p0 + r) * d + c0 + j]) : 0.0f;
            }
            __syncthreads();
            if (t < qc) {
                for (int j = 0; j < DC; ++j) {
                    float qv = qs[t][j];
#pragma unroll
                    for (int s = 0; s < PB; ++s) {
                        float df = __fsub_rn(qv, ps[(t + s) & (PB - 1)][j]);
                        acc[s] = __fadd_rn(acc[s], __fmul_rn(df, df));
                    }
                }
            }
            __syncthreads();
        }
        if (t < qc) {
#pragma unroll
            for (int s = 0; s < PB; ++s) {
                int p = (t + s) & (PB - 1);
                if (p < np) {
                    unsigned long long key = make_key(acc[s], perm[p0 + p]);
                    if (cnt < k || key < mytop[k - 1]) top_insert(mytop, cnt, k, key);
                }
            }
        }
    }
}

// Sliding window with threads over the leaf points (the paper's "threads = the shorter list" for
// leaves with more points than buffered queries): block of RP threads, chunk of <= RQ queries.
// Slide s pairs thread t (point t of the tile) with query (t + s) mod qc; the qc x np distances
// go to shared memory and thread r then merges row r into query r's top-P list (one writer).
extern "C" __global__ void __launch_bounds__(RP) banns_leaf_rotate(const int* __restrict__ blk_leaf,
        const int* __restrict__ blk_first, const int* __restrict__ blk_cnt, const int* __restrict__ sorted_q,
        const float* __restrict__ Q, const PT* __restrict__ points, const long long* __restrict__ perm,
        const long long* __restrict__ start, const long long* __restrict__ end, int d, int k,
        unsigned long long* __restrict__ top) {
    __shared__ float qs[RQ][DC + 1];
    __shared__ float ps[RP][DC + 1];
    __shared__ float dist[RQ][RP + 1];
    __shared__ int qid[RQ];
    __shared__ long long pid[RP];
    int b = blockIdx.x, t = threadIdx.x;
    int leaf = blk_leaf[b], f = blk_first[b], qc = blk_cnt[b];
    if (leaf < 0) return;  // queries whose bounded descent found nothing (whole block)
    if (t < qc) qid[t] = sorted_q[f + t];
    __syncthreads();
    long long p_beg = start[leaf], p_end = end[leaf];
    unsigned long long* mytop = t < qc ? top + (long long)qid[t] * k : NULL;
    int cnt = 0;
    if (mytop) while (cnt < k && mytop[cnt] != KEY_NONE) ++cnt;
    int roff[RQ];  // slide s: thread t pairs with query (t + s) mod qc, whose row starts at roff[s]
    {
        int r0 = t % qc;
#pragma unroll
        for (int s = 0; s < RQ; ++s) {
            int r = r0 + s;
            while (r >= qc) r -= qc;
            roff[s] = r * (DC + 1);
        }
    }
    const float* qsf = &qs[0][0];
    float* distf = &dist[0][0];
    for (long long p0 = p_beg; p0 < p_end; p0 += RP) {
        int np = (int)(p_end - p0 < RP ? p_end - p0 : RP);
        if (t < np) pid[t] = perm[p0 + t];
        float acc[RQ];
#pragma unroll
        for (int s = 0; s < RQ; ++s) acc[s] = 0.0f;
        for (int c0 = 0; c0 < d; c0 += DC) {
            for (int idx = t; idx < qc * DC; idx += RP) {
                int r = idx / DC, j = idx % DC;
                qs[r][j] = (c0 + j < d) ? Q[(long long)qid[r] * d + c0 + j] : 0.0f;
            }
            for (int idx = t; idx < np * DC; idx += RP) {
                int r = idx / DC, j = idx % DC;
                ps[r][j] = (c0 + j < d) ? ldp(points[(p0 + r) * d + c0 + j]) : 0.0f;
            }
            __syncthreads();
            if (t < np) {
                for (int j = 0; j < DC; ++j) {
                    float pv = ps[t][j];
#pragma unroll
                    for (int s = 0; s < RQ; ++s) {
                        if (s < qc) {
                            float df = __fsub_rn(qsf[roff[s] + j], pv);
                            acc[s] = __fadd_rn(acc[s], __fmul_rn(df, df));
                        }
                    }
                }
            }
            __syncthreads();
        }
        if (t < np) {
#pragma unroll
            for (int s = 0; s < RQ; ++s) {
                if (s < qc) distf[(roff[s] / (DC + 1)) * (RP + 1) + t] = acc[s];
            }
        }
        __syncthreads();
        if (t < qc) {
            for (int p = 0; p < np; ++p) {
                unsigned long long key = make_key(dist[t][p], pid[p]);
                if (cnt < k || key < mytop[k - 1]) top_insert(mytop, cnt, k, key);
            }
        }
        __syncthreads();
    }
}

// the same work without staging: each thread reads its query and the leaf points from global memory
extern "C" __global__ void banns_leaf_plain(const int* __restrict__ blk_leaf,
        const int* __restrict__ blk_first, const int* __restrict__ blk_cnt, const int* __restrict__ sorted_q,
        const float* __restrict__ Q, const PT* __restrict__ points, const long long* __restrict__ perm,
        const long long* __restrict__ start, const long long* __restrict__ end, int d, int k,
        unsigned long long* __restrict__ top) {
    int b = blockIdx.x, t = threadIdx.x;
    int leaf = blk_leaf[b], f = blk_first[b], qc = blk_cnt[b];
    if (leaf < 0) return;  // queries whose bounded descent found nothing (whole block)
    if (t >= qc) return;
    int qi = sorted_q[f + t];
    const float* q = Q + (long long)qi * d;
    unsigned long long* mytop = top + (long long)qi * k;
    int cnt = 0;
    while (cnt < k && mytop[cnt] != KEY_NONE) ++cnt;
    for (long long p = start[leaf]; p < end[leaf]; ++p) {
        unsigned long long key = make_key(canon_dist_p(q, points + p * d, d), perm[p]);
        if (cnt < k || key < mytop[k - 1]) top_insert(mytop, cnt, k, key);
    }
}

// Streaming leaf scan for the few queries a leaf gets per round (the common case: 1-2 at 65k
// buffered queries over 10^5 leaves, where the tiled kernels above are bound on their own
// per-block overhead, not on memory). One block of SP threads per (leaf, chunk of <= SQ
// queries); the chunk's queries are staged whole in shared memory, thread t streams leaf point t
// straight from global memory (float4 when d % 4 == 0) and keeps one running sum per query, in
// dimension order (canon_dist's rounding, bit for bit). Only keys below a query's current k-th
// key become candidates; thread r then merges query r's candidates (one writer per list).
//
// With `slot_of` (the batched rounds, several leaves of a query scanned at once), the list a
// block's query r merges into is its pair's own slot top + slot_of[f + r] * k (empty at the start,
// one writer), and only keys below the query's current k-th key in `qtop` become candidates;
// banns_merge_slots then merges a query's slots into its list.
template <bool SLOTS>
__device__ __forceinline__ void leaf_stream(const int* __restrict__ blk_leaf,
        const int* __restrict__ blk_first, const int* __restrict__ blk_cnt, const int* __restrict__ sorted_q,
        const float* __restrict__ Q, const PT* __restrict__ points, const long long* __restrict__ perm,
        const long long* __restrict__ start, const long long* __restrict__ end, int d, int k,
        unsigned long long* __restrict__ top, const int* __restrict__ slot_of,
        const unsigned long long* __restrict__ qtop) {
    extern __shared__ float4 qs4[];                      // [SQ][d] floats
    float* qs = (float*)qs4;
    __shared__ unsigned long long cand[SQ][SP];
    __shared__ unsigned long long thr[SQ];
    __shared__ int ncand[SQ];
    __shared__ int qid[SQ];
    int b = blockIdx.x, t = threadIdx.x;
    int leaf = blk_leaf[b], f = blk_first[b], qc = blk_cnt[b];
    if (leaf < 0) return;  // queries whose bounded descent found nothing (whole block)
    if (t < qc) qid[t] = sorted_q[f + t];
    if (t < SQ) ncand[t] = 0;
    __syncthreads();
    for (int idx = t; idx < qc * d; idx += SP) {
        int r = idx / d;
        qs[idx] = Q[(long long)qid[r] * d + (idx - r * d)];
    }
    unsigned long long* mytop = t >= qc ? NULL : top + (long long)(SLOTS ? slot_of[f + t] : qid[t]) * k;
    unsigned long long qthr = KEY_NONE;  // SLOTS: the query's own k-th key (read only here)
    if (SLOTS && mytop) qthr = qtop[(long long)qid[t] * k + k - 1];
    int cnt = 0;
    if (mytop) {
        while (cnt < k && mytop[cnt] != KEY_NONE) ++cnt;
        thr[t] = (cnt == k && mytop[k - 1] < qthr) ? mytop[k - 1] : qthr;
    }
    __syncthreads();
    const bool vec = ((d & 3) | ((unsigned long long)points & (4 * sizeof(PT) - 1))) == 0;
    long long p_beg = start[leaf], p_end = end[leaf];
    for (long long p0 = p_beg; p0 < p_end; p0 += SP) {
        long long p = p0 + t;
        if (p < p_end) {
            float acc[SQ];
#pragma unroll
            for (int s = 0; s < SQ; ++s) acc[s] = 0.0f;
            if (vec) {
#ifdef PT_HALF
                const uint2* x4 = (const uint2*)(points + p * d);  // 4 halves per load
#else
                const float4* x4 = (const float4*)(points + p * d);
#endif
                int d4 = d >> 2;
#pragma unroll 4
                for (int j = 0; j < d4; ++j) {
#ifdef PT_HALF
                    uint2 h = __ldg(x4 + j);
                    float4 v = make_float4(ldp((unsigned short)(h.x & 0xffffu)), ldp((unsigned short)(h.x >> 16)),
                                           ldp((unsigned short)(h.y & 0xffffu)), ldp((unsigned short)(h.y >> 16)));
#else
                    float4 v = __ldg(x4 + j);
#endif
#pragma unroll
                    for (int s = 0; s < SQ; ++s) {
                        if (s < qc) {
                            float4 qv = qs4[s * d4 + j];
                            float e;
                            e = __fsub_rn(qv.x, v.x); acc[s] = __fadd_rn(acc[s], __fmul_rn(e, e));
                            e = __fsub_rn(qv.y, v.y); acc[s] = __fadd_rn(acc[s], __fmul_rn(e, e));
                            e = __fsub_rn(qv.z, v.z); acc[s] = __fadd_rn(acc[s], __fmul_rn(e, e));
                            e = __fsub_rn(qv.w, v.w); acc[s] = __fadd_rn(acc[s], __fmul_rn(e, e));
                        }
                    }
                }
            } else {
                const PT* x = points + p * d;
                for (int j = 0; j < d; ++j) {
                    float v = ldp(__ldg(x + j));
#pragma unroll
                    for (int s = 0; s < SQ; ++s) {
                        if (s < qc) {
                            float e = __fsub_rn(qs[s * d + j], v);
                            acc[s] = __fadd_rn(acc[s], __fmul_rn(e, e));
                        }
                    }
                }
            }
            long long id = perm[p];
#pragma unroll
            for (int s = 0; s < SQ; ++s) {
                if (s < qc) {
                    unsigned long long key = make_key(acc[s], id);
                    if (key < thr[s]) cand[s][atomicAdd(&ncand[s], 1)] = key;
                }
            }
        }
        __syncthreads();
        if (mytop) {
            int nc = ncand[t];
            for (int c = 0; c < nc; ++c) {
                unsigned long long key = cand[t][c];
                if (cnt < k || key < mytop[k - 1]) top_insert(mytop, cnt, k, key);
            }
            ncand[t] = 0;
            thr[t] = (cnt == k && mytop[k - 1] < qthr) ? mytop[k - 1] : qthr;
        }
        __syncthreads();
    }
}
extern "C" __global__ void __launch_bounds__(SP) banns_leaf_stream(const int* __restrict__ blk_leaf,
        const int* __restrict__ blk_first, const int* __restrict__ blk_cnt, const int* __restrict__ sorted_q,
        const float* __restrict__ Q, const PT* __restrict__ points, const long long* __restrict__ perm,
        const long long* __restrict__ start, const long long* __restrict__ end, int d, int k,
        unsigned long long* __restrict__ top) {
    leaf_stream<false>(blk_leaf, blk_first, blk_cnt, sorted_q, Q, points, perm, start, end, d, k, top, NULL, NULL);
}
extern "C" __global__ void __launch_bounds__(SP) banns_leaf_stream_slots(const int* __restrict__ blk_leaf,
        const int* __restrict__ blk_first, const int* __restrict__ blk_cnt, const int* __restrict__ sorted_q,
        const float* __restrict__ Q, const PT* __restrict__ points, const long long* __restrict__ perm,
        const long long* __restrict__ start, const long long* __restrict__ end, int d, int k,
        unsigned long long* __restrict__ slots, const int* __restrict__ slot_of,
        const unsigned long long* __restrict__ qtop) {
    leaf_stream<true>(blk_leaf, blk_first, blk_cnt, sorted_q, Q, points, perm, start, end, d, k, slots, slot_of,
                      qtop);
}

// ---------------------------------------------------------------------------- tensor-core rounds
// The batched rounds (d % 16 == 0, k <= 16) score the rows on tensor cores and compute the
// canonical distance only of the rows that can enter a list. A block of MT threads takes a
// (leaf, chunk of <= MQ pairs) bucket, stages the pairs' queries rounded to half in shared
// memory and scores MR leaf rows at a time (float rows rounded to half as they are read) against
// all of them with mma.sync (m16n8k16, half x half -> float): dt = |q|^2 + |x|^2 - 2 q.x,
// within e = eps_rel (|q|^2 + |x|^2) + eps_abs of the canonical distance (kdtree_gpu.mma_eps).
// Per round:
//   mma_scan<false>: (first round only) each pair's k smallest (dt + e, id)   -> pair_ub
//   mma_bound:       each query's T = min(its list's k-th distance, in the first round the
//                    k-th smallest bound over distinct ids of its pairs): k rows are no farther
//   mma_scan<true>:  every row with dt - e <= T (or without a finite estimate) -> (query, row)
//   mma_keys:        the canonical key of each such row (one thread each)
//   mma_merge:       the keys inserted into their query's list
// A row left out has a canonical distance above T: above the list's k-th, or above k rows of
// the round that are in: it is not among the k smallest of the list and the round's rows,
// which is what the list becomes (the stream kernels' slots merge to the same).
#define MQ 32
#define MR 32
#define MT 128
__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// two consecutive row values as a half2 register (the lower index in the low half): half rows as
// they are, float rows rounded to half (their rounding is inside mma_eps's bound for float rows)
__device__ __forceinline__ unsigned ld_half2(const PT* __restrict__ x) {
#ifdef PT_HALF
    return __ldg((const unsigned int*)x);
#else
    float2 v = __ldg((const float2*)x);
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(v.y), "f"(v.x));
    return r;
#endif
}
template <bool EMIT>
__device__ __forceinline__ void mma_scan(const int* __restrict__ blk_leaf, const int* __restrict__ blk_first,
        const int* __restrict__ blk_cnt, const int* __restrict__ sorted_pair, int L,
        const int* __restrict__ active, const unsigned short* __restrict__ Qh, const float* __restrict__ QN,
        const unsigned char* __restrict__ QOK, const PT* __restrict__ points,
        const float* __restrict__ XN, const long long* __restrict__ perm, const long long* __restrict__ start,
        const long long* __restrict__ end, int d, int k, long long npts, float eps_rel, float eps_abs,
        unsigned long long* __restrict__ pair_ub, const float* __restrict__ T,
        int* __restrict__ ent_i, long long* __restrict__ ent_p, unsigned long long* __restrict__ ent_n,
        long long ent_cap) {
    extern __shared__ float4 dyn4[];
    const int QS = d + 8;                                   // halves per staged query (bank spread)
    unsigned short* qh = (unsigned short*)dyn4;            // [MQ][QS]
    float* S = (float*)(qh + MQ * QS);                      // [MQ][MR + 1] q.x of the tile
    __shared__ float nq[MQ], tq[MQ], nx[MR];
    __shared__ int qi_[MQ], ai_[MQ], qok[MQ];
    __shared__ unsigned short ebuf[MQ * MR];
    __shared__ int en;
    __shared__ unsigned long long ebase;
    int b = blockIdx.x, t = threadIdx.x;
    int leaf = blk_leaf[b], f = blk_first[b], qc = blk_cnt[b];
    if (leaf < 0) return;
    if (t < qc) {
        int pr = sorted_pair[f + t], i = pr / L;
        ai_[t] = i;
        qi_[t] = active[i];
        if (EMIT) tq[t] = T[i];
    }
    __syncthreads();
    if (t < MQ) {
        qok[t] = t < qc ? QOK[qi_[t]] : 0;
        nq[t] = t < qc ? QN[qi_[t]] : 0.0f;
    }
    {   // the queries in half (rows >= qc: 0), 8 halves a load
        const int d8 = d >> 3, qs8 = QS >> 3;
        const uint4* src = (const uint4*)Qh;
        uint4* dst = (uint4*)qh;
        for (int idx = t; idx < MQ * d8; idx += MT) {
            int r = idx / d8, j = idx - r * d8;
            dst[r * qs8 + j] = r < qc ? __ldg(src + (long long)qi_[r] * d8 + j) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    unsigned long long kb[__KP__];                          // pass 1, thread t < qc: k smallest (dt + e, id)
    int nk = 0;
    if (t == 0) en = 0;
    __syncthreads();
    const int w = t >> 5, lane = t & 31, g = lane >> 2, tg = lane & 3;
    const int mi = w & 1, nb = (w >> 1) * 16;               // warp: 16 queries x 16 rows of the tile
    long long p_beg = start[leaf], p_end = end[leaf];
    for (long long p0 = p_beg; p0 < p_end; p0 += MR) {
        long long base = p0 + MR <= npts ? p0 : npts - MR;  // the tile's MR rows stay inside the array
        int r_lo = (int)(p0 - base), r_hi = (int)min((long long)MR, p_end - base);
        if (t < MR) nx[t] = XN[base + t];
        float c0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const unsigned short* a0p = qh + (mi * 16 + g) * QS + tg * 2;
        const unsigned short* a1p = a0p + 8 * QS;
        const PT* b0p = points + (base + nb + g) * d + tg * 2;
        const PT* b1p = points + (base + nb + 8 + g) * d + tg * 2;
#pragma unroll 2
        for (int k0 = 0; k0 < d; k0 += 16) {
            unsigned a0 = *(const unsigned*)(a0p + k0), a1 = *(const unsigned*)(a1p + k0);
            unsigned a2 = *(const unsigned*)(a0p + k0 + 8), a3 = *(const unsigned*)(a1p + k0 + 8);
            unsigned b00 = ld_half2(b0p + k0), b01 = ld_half2(b0p + k0 + 8);
            unsigned b10 = ld_half2(b1p + k0), b11 = ld_half2(b1p + k0 + 8);
            mma16816(c0, a0, a1, a2, a3, b00, b01);
            mma16816(c1, a0, a1, a2, a3, b10, b11);
        }
        {
            float* s0 = S + (mi * 16 + g) * (MR + 1) + nb + tg * 2;
            float* s1 = s0 + 8 * (MR + 1);
            s0[0] = c0[0]; s0[1] = c0[1]; s1[0] = c0[2]; s1[1] = c0[3];
            s0[8] = c1[0]; s0[9] = c1[1]; s1[8] = c1[2]; s1[9] = c1[3];
        }
        __syncthreads();
        if (!EMIT) {
            if (t < qc && qok[t]) {
                const float* srow = S + t * (MR + 1);
                float qn = nq[t];
                for (int r = r_lo; r < r_hi; ++r) {
                    float ub = qn + nx[r] - 2.0f * srow[r] + (eps_rel * (qn + nx[r]) + eps_abs);
                    if (!isfinite(ub)) continue;
                    unsigned long long key = make_key(ub, perm[base + r]);  // raised to 0: still a bound
                    if (nk == k && key >= kb[k - 1]) continue;
                    int pos = nk < k ? nk++ : k - 1;
                    while (pos > 0 && kb[pos - 1] > key) { kb[pos] = kb[pos - 1]; --pos; }
                    kb[pos] = key;
                }
            }
        } else {
            for (int idx = t; idx < qc * MR; idx += MT) {
                int q = idx / MR, r = idx - q * MR;
                if (r < r_lo || r >= r_hi) continue;
                float qn = nq[q];
                float e = eps_rel * (qn + nx[r]) + eps_abs;
                float dt = qn + nx[r] - 2.0f * S[q * (MR + 1) + r];
                if (!qok[q] || !isfinite(dt + e) || !(dt - e > tq[q]))
                    ebuf[atomicAdd(&en, 1)] = (unsigned short)(q * MR + r);
            }
            __syncthreads();
            if (t == 0 && en) ebase = atomicAdd(ent_n, (unsigned long long)en);
            __syncthreads();
            for (int j = t; j < en; j += MT) {
                long long o = (long long)ebase + j;
                if (o < ent_cap) {
                    int q = ebuf[j] / MR, r = ebuf[j] - q * MR;
                    ent_i[o] = ai_[q];
                    ent_p[o] = base + r;
                }
            }
            __syncthreads();
            if (t == 0) en = 0;
        }
        __syncthreads();
    }
    if (!EMIT && t < qc) {
        unsigned long long* out = pair_ub + (long long)sorted_pair[f + t] * k;
        for (int j = 0; j < nk; ++j) out[j] = kb[j];
    }
}
extern "C" __global__ void __launch_bounds__(MT) mma_scan_ub(const int* __restrict__ blk_leaf,
        const int* __restrict__ blk_first, const int* __restrict__ blk_cnt, const int* __restrict__ sorted_pair,
        int L, const int* __restrict__ active, const unsigned short* __restrict__ Qh, const float* __restrict__ QN,
        const unsigned char* __restrict__ QOK, const PT* __restrict__ points, const float* __restrict__ XN,
        const long long* __restrict__ perm, const long long* __restrict__ start, const long long* __restrict__ end,
        int d, int k, long long npts, float eps_rel, float eps_abs, unsigned long long* __restrict__ pair_ub) {
    mma_scan<false>(blk_leaf, blk_first, blk_cnt, sorted_pair, L, active, Qh, QN, QOK, points, XN, perm, start, end,
                    d, k, npts,
                    eps_rel, eps_abs, pair_ub, NULL, NULL, NULL, NULL, 0);
}
extern "C" __global__ void __launch_bounds__(MT) mma_scan_emit(const int* __restrict__ blk_leaf,
        const int* __restrict__ blk_first, const int* __restrict__ blk_cnt, const int* __restrict__ sorted_pair,
        int L, const int* __restrict__ active, const unsigned short* __restrict__ Qh, const float* __restrict__ QN,
        const unsigned char* __restrict__ QOK, const PT* __restrict__ points, const float* __restrict__ XN,
        const long long* __restrict__ perm, const long long* __restrict__ start, const long long* __restrict__ end,
        int d, int k, long long npts, float eps_rel, float eps_abs, const float* __restrict__ T,
        int* __restrict__ ent_i, long long* __restrict__ ent_p, unsigned long long* __restrict__ ent_n,
        long long ent_cap) {
    mma_scan<true>(blk_leaf, blk_first, blk_cnt, sorted_pair, L, active, Qh, QN, QOK, points, XN, perm, start, end,
                   d, k, npts,
                   eps_rel, eps_abs, NULL, T, ent_i, ent_p, ent_n, ent_cap);
}
// T of each active query: its list's k-th distance, or the k-th smallest upper bound of its L
// pairs' (bound, id) keys over distinct ids (a forest's trees reach a row more than once); L = 0:
// the list's alone
extern "C" __global__ void mma_bound(const int* __restrict__ active, int na, int L, int k,
        const unsigned long long* __restrict__ pair_ub, const unsigned long long* __restrict__ top,
        float* __restrict__ T) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= na) return;
    unsigned long long kb[__KP__];
    int nk = 0;
    const unsigned long long* u = pair_ub + (long long)i * L * k;
    for (int j = 0; j < L * k; ++j) {
        unsigned long long key = u[j];
        if (key == KEY_NONE || (nk == k && key >= kb[k - 1])) continue;
        bool seen = false;
        for (int c = 0; c < nk; ++c) seen |= (unsigned int)kb[c] == (unsigned int)key;
        if (seen) continue;
        int pos = nk < k ? nk++ : k - 1;
        while (pos > 0 && kb[pos - 1] > key) { kb[pos] = kb[pos - 1]; --pos; }
        kb[pos] = key;
    }
    float tl = key_dist(top[(long long)active[i] * k + k - 1]);
    float tb = nk == k ? key_dist(kb[k - 1]) : F_INF;
    T[i] = tb < tl ? tb : tl;
}
// the canonical key of every kept (query, row) entry, one thread each (canon_dist_p's sum, in
// dimension order, with 4-wide loads: d % 16 == 0 keeps every row and query 16-byte aligned)
extern "C" __global__ void mma_keys(long long n, const int* __restrict__ ent_i, const long long* __restrict__ ent_p,
        const int* __restrict__ active, const float* __restrict__ Q, const PT* __restrict__ points,
        const long long* __restrict__ perm, int d, unsigned long long* __restrict__ keys) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    long long p = ent_p[e];
    const float4* q4 = (const float4*)(Q + (long long)active[ent_i[e]] * d);
#ifdef PT_HALF
    const uint2* x4 = (const uint2*)(points + p * d);
#else
    const float4* x4 = (const float4*)(points + p * d);
#endif
    float acc = 0.0f;
#pragma unroll 4
    for (int j = 0; j < (d >> 2); ++j) {
        float4 qv = __ldg(q4 + j);
#ifdef PT_HALF
        uint2 h = __ldg(x4 + j);
        float4 v = make_float4(ldp((unsigned short)(h.x & 0xffffu)), ldp((unsigned short)(h.x >> 16)),
                               ldp((unsigned short)(h.y & 0xffffu)), ldp((unsigned short)(h.y >> 16)));
#else
        float4 v = __ldg(x4 + j);
#endif
        float t;
        t = __fsub_rn(qv.x, v.x); acc = __fadd_rn(acc, __fmul_rn(t, t));
        t = __fsub_rn(qv.y, v.y); acc = __fadd_rn(acc, __fmul_rn(t, t));
        t = __fsub_rn(qv.z, v.z); acc = __fadd_rn(acc, __fmul_rn(t, t));
        t = __fsub_rn(qv.w, v.w); acc = __fadd_rn(acc, __fmul_rn(t, t));
    }
    keys[e] = make_key(acc, perm[p]);
}
// each active query's entries (sorted by query: [first[i], first[i + 1])) into its list
extern "C" __global__ void mma_merge(const int* __restrict__ active, int na, const long long* __restrict__ first,
        const unsigned long long* __restrict__ keys, int k, unsigned long long* __restrict__ top) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= na) return;
    unsigned long long* mytop = top + (long long)active[i] * k;
    int cnt = 0;
    while (cnt < k && mytop[cnt] != KEY_NONE) ++cnt;
    for (long long e = first[i]; e < first[i + 1]; ++e) {
        unsigned long long key = keys[e];
        if (cnt < k || key < mytop[k - 1]) top_insert(mytop, cnt, k, key);
    }
}

// ---------------------------------------------------------------------------- batched rounds
// A round takes up to L leaves per active query: pop -> descend -> record, L times, against the
// pruning distance of the round's start (the k-th distance after the last merge, or lim), then
// every (query, leaf) pair is bucketed by leaf and scanned into its own slot (leaf_stream<true>),
// and banns_merge_slots merges each query's L slots into its list. L = 1 is P-BANNS itself;
// kdtree._anns_cpu with the same L returns the same answer (the order of the scans of a round
// does not change the final (dist, id)-ordered list).
// target[qi] >= 0: a box already popped (banns_init's first); keep[i]: the query goes on.
extern "C" __global__ void banns_collect(const int* __restrict__ active, int na, int L,
        const float* __restrict__ Q, int d, const int* __restrict__ child, const int* __restrict__ sdim,
        const float* __restrict__ sval, const float* __restrict__ lo, const float* __restrict__ hi, int k,
        const unsigned long long* __restrict__ top, int* __restrict__ target, const float* __restrict__ TK,
        const float* __restrict__ lim, float* __restrict__ HD, int* __restrict__ HN, int* __restrict__ HS,
        int* __restrict__ OVF, int* __restrict__ visits, int budget, int* __restrict__ leaf_of,
        unsigned char* __restrict__ keep, int path) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= na) return;
    int qi = active[i];
    const float* q = Q + (long long)qi * d;
    const float bl = lim[qi];
    const float worst = fminf(key_dist(top[(long long)qi * k + k - 1]), bl);
    int hs = HS[qi], ovf = OVF[qi], v = visits[qi];
    float* hd = HD + (long long)qi * HCAP;
    int* hn = HN + (long long)qi * HCAP;
    int nd = target[qi];
    float key = TK[qi];
    int n = 0;
    int* out = leaf_of + (long long)i * L;
    while (n < L && !(budget > 0 && v >= budget)) {
        if (nd < 0) {
            nd = pop_within(hd, hn, hs, worst, key);
            if (nd < 0) break;
        }
        int leaf = descend(nd, q, d, child, sdim, sval, lo, hi, worst, hd, hn, hs, ovf, bl < F_INF, path, key);
        nd = -1;
        if (leaf < 0) continue;
        out[n++] = leaf;
        ++v;
    }
    for (int j = n; j < L; ++j) out[j] = -1;
    keep[i] = (n == L && hs > 0 && !(budget > 0 && v >= budget)) ? 1 : 0;
    target[qi] = -1;
    HS[qi] = hs; OVF[qi] = ovf; visits[qi] = v;
}

// merge the L slots of each active query (ascending lists, KEY_NONE-padded) into its top-k list
extern "C" __global__ void banns_merge_slots(const int* __restrict__ active, int na, int L, int k,
        const unsigned long long* __restrict__ slots, unsigned long long* __restrict__ top) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= na) return;
    unsigned long long* mytop = top + (long long)active[i] * k;
    int cnt = 0;
    while (cnt < k && mytop[cnt] != KEY_NONE) ++cnt;
    const unsigned long long* s = slots + (long long)i * L * k;
    for (int j = 0; j < L; ++j) {
        for (int c = 0; c < k; ++c) {
            unsigned long long key = s[j * k + c];
            if (key == KEY_NONE || (cnt == k && key >= mytop[k - 1])) break;  // the slot is ascending
            top_insert(mytop, cnt, k, key);
        }
    }
}

extern "C" __global__ void banns_advance(const int* __restrict__ active, int na, int k, int budget,
        const unsigned long long* __restrict__ top, const float* __restrict__ lim,
        const int* __restrict__ leaf_of, float* __restrict__ HD, int* __restrict__ HN,
        int* __restrict__ HS, int* __restrict__ visits, int* __restrict__ target, float* __restrict__ TK,
        unsigned char* __restrict__ keep) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= na) return;
    int qi = active[i];
    keep[i] = 0;
    if (leaf_of[i] < 0) { HS[qi] = 0; return; }  // bounded search found nothing left to scan
    int v = visits[qi] + 1;
    visits[qi] = v;
    if (budget > 0 && v >= budget) return;
    float worst = fminf(key_dist(top[(long long)qi * k + k - 1]), lim[qi]);
    float* hd = HD + (long long)qi * HCAP;
    int* hn = HN + (long long)qi * HCAP;
    int hs = HS[qi];
    while (hs > 0) {
        float bd = hd[0]; int nd = hn[0];
        hs = heap_pop(hd, hn, hs);
        if (bd <= worst) { target[qi] = nd; TK[qi] = bd; keep[i] = 1; break; }
        hs = 0;
    }
    HS[qi] = hs;
}

// per query: push the roots of every tree (pruned by lim) and pop the closest as the first target;
// keep[qi] = 0 when every root is pruned (the query has nothing to search)
extern "C" __global__ void banns_init(int m, const float* __restrict__ Q, int d, const int* __restrict__ roots,
        int nroots, const float* __restrict__ lo, const float* __restrict__ hi, const float* __restrict__ lim,
        float* __restrict__ HD, int* __restrict__ HN, int* __restrict__ HS, int* __restrict__ OVF,
        int* __restrict__ target, float* __restrict__ TK, unsigned char* __restrict__ keep) {
    int qi = blockIdx.x * blockDim.x + threadIdx.x;
    if (qi >= m) return;
    const float* q = Q + (long long)qi * d;
    const float bl = lim[qi];
    float* hd = HD + (long long)qi * HCAP;
    int* hn = HN + (long long)qi * HCAP;
    int hs = 0, ovf = 0;
    for (int t = 0; t < nroots; ++t) {
        int r = roots[t];
        float bd = box_dist(q, lo + (long long)r * d, hi + (long long)r * d, d);
        if (bd <= bl) {
            float ev = heap_push_bounded(hd, hn, hs, bd, r);
            if (ev >= 0.0f && ev <= bl) ovf = 1;
        }
    }
    keep[qi] = 0;
    target[qi] = 0;
    if (hs > 0) { target[qi] = hn[0]; TK[qi] = hd[0]; hs = heap_pop(hd, hn, hs); keep[qi] = 1; }
    HS[qi] = hs;
    OVF[qi] = ovf;
}
"""


@functools.lru_cache(maxsize=None)
def stream_fits(d: int) -> bool:
    """Whether the stream leaf kernel's queries (SQ rows of d floats) fit its shared memory."""
    return SQ * int(d) * 4 <= 40 * 1024


def mma_fits(tree, d: int, k: int) -> bool:
    """Whether P-BANNS's batched rounds score ``tree``'s leaves on tensor cores (the
    ``mma_*`` kernels): ``d`` a multiple of 16 whose half queries fit the shared memory,
    ``k <= 16``, at least one tile of rows, and :data:`MMA_FILTER` on for these rows."""
    rows = MMA_FILTER is True or (MMA_FILTER == "half" and _is_half(tree))
    return (rows and int(d) % 16 == 0 and 16 <= int(d) <= 512 and int(k) <= 16
            and int(tree.points.shape[0]) >= MR)


def _mma_smem(d: int) -> int:
    """Dynamic shared memory of a tensor-core leaf block: the queries in half, the tile's q.x."""
    return MQ * (int(d) + 8) * 2 + MQ * (MR + 1) * 4


@functools.lru_cache(maxsize=None)
def mma_eps(d: int, half_rows: bool = True) -> tuple:
    """``(eps_rel, eps_abs)``: ``|dt - c| <= eps_rel (|q|^2 + |x|^2) + eps_abs`` for the
    tensor-core estimate ``dt = |q|^2 + |x|^2 - 2 q.x`` (query, and float rows, rounded to half;
    float accumulation; float norms) and the canonical distance ``c`` of the same pair.

    With ``u = 2**-24`` and ``g = (d + 8) u / (1 - (d + 8) u)`` (:func:`bruteforce._gamma`): a
    vector's rounding to half moves ``2 q.x`` by at most ``2**-11 (|q|^2 + |x|^2)`` (normal
    halves: ``|v_j - h_j| <= 2**-11 |v_j|``; ``2 |q||x| <= |q|^2 + |x|^2``) plus ``2**-25
    sqrt(d) (1 + |other|^2)`` (subnormal halves); the queries are rounded, and float rows too
    (half rows are exact). The float accumulation (counted at twice the round-to-nearest bound:
    tensor cores truncate) and the two norms add at most ``3 g (|q|^2 + |x|^2)``, the last two
    roundings ``4 u`` of that, and the canonical sum ``c`` is within ``g`` of the exact
    distance, itself at most ``2 (|q|^2 + |x|^2)``. Both terms are doubled here (the bound's own
    evaluation in float is inside that margin)."""
    from .bruteforce import _gamma

    g = _gamma(int(d))
    root = float(np.sqrt(d))
    rounded = 1 if half_rows else 2  # vectors rounded to half: the query, and float rows
    return (np.float32(2 * (rounded * 2.0 ** -11 + 6 * g + 2.0 ** -25 * root)),
            np.float32(2 * rounded * 2.0 ** -25 * root + 1e-30))


def _mma_args(tree, d: int) -> tuple:
    rel, ab = mma_eps(int(d), _is_half(tree))
    return (np.int64(tree.points.shape[0]), rel, ab)


def _module(kp: int, half: bool = False, hcap: int = HCAP):
    """The search kernels for top-``kp`` lists over float32 rows, or float16 ones (``half``),
    with queues of ``hcap`` pending boxes."""
    import cupy as cp

    opts = ("--std=c++14",) + (("-DPT_HALF",) if half else ())
    src = _SRC.replace("__KP__", str(kp)).replace("#define HCAP 256", f"#define HCAP {int(hcap)}")
    return cp.RawModule(code=src, options=opts)


def _is_half(tree) -> bool:
    return tree.points is not None and tree.points.dtype == np.float16


def _kp(k: int) -> int:
    return max(8, 1 << (int(k) - 1).bit_length())


def _grid(n: int, threads: int = 256):
    return (max(1, (int(n) + threads - 1) // threads),)


# ----------------------------------------------------------------------------------------------
# construction
# ----------------------------------------------------------------------------------------------
def build(X, leaf_size, max_depth, rand_f, seed, params, rule=2, leaf_rows=True):
    """Level-by-level build (module docstring); ``rule``: ``kdtree.RULE_IDS`` of the split rule."""
    import cupy as cp

    from ._kdtree_common import KDTree

    mod = _module(8)
    k_split = mod.get_function("split_level")
    k_split_s = mod.get_function("split_level_sample")
    k_mark = mod.get_function("mark_left")
    k_scatter = mod.get_function("scatter_level")
    k_ranges = mod.get_function("ranges_level")
    k_box = mod.get_function("box_level")
    k_dec = mod.get_function("decode_box")
    n, d = X.shape
    shm = 4 * (3 * d + 64)
    if rule > 0 and shm + 8 * 64 > 48 * 1024:
        from ..errors import InputError

        raise InputError(f"the sample split rules on the GPU support up to 4,032 dimensions (got d={d}); "
                         "use split='midpoint'")
    cap = max(3, 4 * (n // max(leaf_size, 1)) + 3)
    child = cp.full(cap, -1, cp.int32)
    sdim = cp.full(cap, -1, cp.int32)
    sval = cp.zeros(cap, cp.float32)
    start = cp.zeros(cap, cp.int64)
    end = cp.zeros(cap, cp.int64)
    lo = cp.empty((cap, d), cp.float32)
    hi = cp.empty((cap, d), cp.float32)
    perm = cp.arange(n, dtype=cp.int64)
    owner = cp.zeros(n, cp.int32)
    end[0] = n
    lo[0] = X.min(axis=0) + cp.float32(0)
    hi[0] = X.max(axis=0) + cp.float32(0)
    isleft = cp.empty(n, cp.int64)
    nperm = cp.empty_like(perm)
    nowner = cp.empty_like(owner)
    bt = min(256, max(32, (d + 31) // 32 * 32))
    chunk = max(32, 16384 // d)
    l0, l1, depth = 0, 1, 0
    while True:
        nl = l1 - l0
        dims = cp.empty(nl, cp.int32)
        vals = cp.empty(nl, cp.float32)
        if rule > 0:
            k_split_s((nl,), (64,), (X, np.int32(d), perm, lo, hi, start, end, np.int32(l0),
                                     np.int64(leaf_size), np.int32(depth), np.int32(max_depth),
                                     np.int32(rand_f), np.uint64(seed), np.int32(rule), dims, vals),
                      shared_mem=shm)
        else:
            k_split(_grid(nl), (256,), (lo, hi, np.int32(d), start, end, np.int32(l0), np.int32(nl),
                                        np.int64(leaf_size), np.int32(depth), np.int32(max_depth),
                                        np.int32(rand_f), np.uint64(seed), dims, vals))
        fl = dims >= 0
        cs = cp.cumsum(fl, dtype=cp.int32)
        ns = int(cs[-1])  # the one host sync of this level
        if ns == 0:
            break
        need = l1 + 2 * ns
        if need > child.shape[0]:
            newcap = max(need, 2 * child.shape[0])
            child, sdim, sval, start, end, lo, hi = [_grow(a, newcap) for a in (child, sdim, sval, start, end, lo, hi)]
            child[l1:] = -1
            sdim[l1:] = -1
            sval[l1:] = 0  # leaves keep split_val 0 (grown arrays are uninitialised)
        child[l0:l1] = cp.where(fl, l1 + 2 * (cs - 1), -1)
        sdim[l0:l1] = dims
        sval[l0:l1] = vals
        k_mark(_grid(n), (256,), (X, np.int32(d), perm, owner, sdim, sval, np.int64(n), isleft))
        C = cp.cumsum(isleft)
        k_scatter(_grid(n), (256,), (perm, owner, sdim, child, start, end, isleft, C, np.int64(n), nperm, nowner))
        k_ranges(_grid(nl), (256,), (child, sdim, isleft, C, np.int32(l0), np.int32(nl), start, end))
        elo = cp.full((2 * ns, d), 0xFFFFFFFF, cp.uint32)
        ehi = cp.zeros((2 * ns, d), cp.uint32)
        k_box(((n + chunk - 1) // chunk,), (bt,), (X, np.int32(d), nperm, nowner, np.int64(n), np.int32(chunk),
                                                  np.int32(l1), elo, ehi))
        k_dec(_grid(elo.size), (256,), (elo, np.int64(elo.size), lo[l1:l1 + 2 * ns]))
        k_dec(_grid(ehi.size), (256,), (ehi, np.int64(ehi.size), hi[l1:l1 + 2 * ns]))
        perm, nperm = nperm, perm
        owner, nowner = nowner, owner
        l0, l1 = l1, need
        depth += 1
    nn = l1
    points = cp.take(X, perm, axis=0) if leaf_rows else None  # leaf_rows=False: no second copy
    tree = KDTree("gpu", points, perm, child[:nn].copy(), sdim[:nn].copy(), sval[:nn].copy(),
                  start[:nn].copy(), end[:nn].copy(), cp.ascontiguousarray(lo[:nn]),
                  cp.ascontiguousarray(hi[:nn]), depth, leaf_size, params, data=X if leaf_rows else None)
    return tree


def _grow(a, cap):
    import cupy as cp

    b = cp.empty((cap,) + a.shape[1:], a.dtype)
    b[: a.shape[0]] = a
    return b


# ----------------------------------------------------------------------------------------------
# search
# ----------------------------------------------------------------------------------------------
def _tree_args(tree):
    return (tree.child, tree.split_dim, tree.split_val)


def _exact_redo(tree, queries, idx, k, out_d, out_i):
    """Exact brute force for the queries ``idx`` (heap overflow or residual)."""
    if tree.data is not None:
        d2, i2 = knn_bruteforce(tree.data, queries[idx], k, device="gpu")
    elif not _is_half(tree):  # a one-copy tree: the first tree's leaf-ordered rows, by input-order id
        n = tree.n_points
        d2, i2 = knn_bruteforce(tree.points[:n], queries[idx], k, device="gpu", ids=tree.perm[:n])
    else:  # half rows: widened a slice at a time (a float32 copy of all of them may not fit)
        from .topk import merge_topk

        n = tree.n_points
        step = HALF_REDO_ROWS
        parts = [knn_bruteforce(tree.points[a:min(n, a + step)].astype(np.float32), queries[idx],
                                min(k, min(n, a + step) - a), device="gpu", ids=tree.perm[a:min(n, a + step)])
                 for a in range(0, n, step)]
        d2, i2 = parts[0] if len(parts) == 1 else merge_topk(parts, k)
    out_d[idx] = d2
    out_i[idx] = i2


def anns(tree, queries, k, budget, *, roots=None, lim=None, hcap=HCAP, descent="path"):
    """P-ANNS: one thread per query, private heap and top-k in local memory.

    ``roots``: (T,) int32 roots of a packed forest (default: one tree, root 0); ``lim``: (M,)
    float32 per-query pruning limit (default +inf); ``descent``: kdtree.DESCENTS. Returns
    (dist2, ids, stats).
    """
    import cupy as cp

    m, d = queries.shape
    if roots is None:
        roots = cp.zeros(1, cp.int32)
    if lim is None:
        lim = cp.full(m, np.inf, cp.float32)
    roots = cp.ascontiguousarray(roots, dtype=cp.int32)
    lim = cp.ascontiguousarray(lim, dtype=cp.float32)
    kp = _kp(k)
    fn = _module(kp, _is_half(tree), hcap).get_function("anns")
    out = cp.empty((m, k), cp.uint64)
    ovf = cp.zeros(m, cp.int32)
    visits = cp.zeros(m, cp.int32)
    threads = 64
    fn(((m + threads - 1) // threads,), (threads,), (
        tree.points, tree.perm, tree.child, tree.split_dim, tree.split_val, tree.start, tree.end,
        tree.lo, tree.hi, np.int32(d), queries, np.int32(m), np.int32(k), np.int32(budget),
        roots, np.int32(roots.size), lim, out, ovf, visits, np.int32(DESCENT_IDS[descent])))
    out_d, out_i = decode_keys(out)
    n_ovf = int(ovf.sum())
    if n_ovf and budget == 0:
        _exact_redo(tree, queries, cp.nonzero(ovf)[0], k, out_d, out_i)
    return out_d, out_i, {"heap_overflow": n_ovf, "leaves_visited": cp.asnumpy(visits)}


def banns(tree, queries, k, budget, sliding_window, finish_below, *, roots=None, lim=None, hcap=HCAP,
          descent="path", leaves_per_round=1):
    """P-BANNS: rounds of descend -> bucket by leaf -> one block per leaf chunk -> advance.

    ``roots``: (T,) int32 roots of a packed forest (one queue per query over all trees);
    ``lim``: (M,) float32 per-query pruning limit (default +inf); ``descent``: kdtree.DESCENTS;
    ``leaves_per_round``: leaves a query takes per round (> 1: :func:`_banns_batched`, with the
    stream leaf kernel; the other kernels take one).
    """
    import cupy as cp

    m, d = queries.shape
    if roots is None:
        roots = cp.zeros(1, cp.int32)
    if lim is None:
        lim = cp.full(m, np.inf, cp.float32)
    roots = cp.ascontiguousarray(roots, dtype=cp.int32)
    lim = cp.ascontiguousarray(lim, dtype=cp.float32)
    mod = _module(_kp(k), _is_half(tree), hcap)
    f_desc = mod.get_function("banns_descend")
    smem = 0
    window = WINDOW_KERNEL if sliding_window is True else sliding_window  # a name picks the kernel
    if not window:
        f_leaf, qb, threads = mod.get_function("banns_leaf_plain"), QB, QB
    elif window == "tile":
        f_leaf, qb, threads = mod.get_function("banns_leaf_window"), QB, QB
    elif window == "stream" and stream_fits(d):
        f_leaf, qb, threads = mod.get_function("banns_leaf_stream"), SQ, SP
        smem = SQ * d * 4
    else:
        f_leaf, qb, threads = mod.get_function("banns_leaf_rotate"), RQ, RP
    if finish_below is None:
        finish_below = max(32, m // 256)
    if leaves_per_round > 1 and window == "stream" and smem:
        return _banns_batched(tree, queries, k, budget, finish_below, roots, lim, mod, int(leaves_per_round),
                              descent, hcap)
    f_adv = mod.get_function("banns_advance")
    st = _BannsState(mod, tree, queries, k, roots, lim, hcap)
    active, na = st.active, int(st.active.size)
    ev = []  # per round: the events between its phases and its leaf blocks, read once at the end
    E = cp.cuda.Event
    while na > finish_below:
        e0 = E(); e0.record()
        leaf_of = cp.empty(na, cp.int32)
        f_desc(_grid(na, 128), (128,), (active, np.int32(na), queries, np.int32(d), tree.child, tree.split_dim,
                                       tree.split_val, tree.lo, tree.hi, np.int32(k), st.top, st.target, st.TK, lim,
                                       st.HD, st.HN, st.HS, st.OVF, leaf_of, np.int32(DESCENT_IDS[descent])))
        e1 = E(); e1.record()
        blocks = _leaf_blocks(leaf_of, qb, drop_none=False)
        e2 = E(); e2.record()
        nb = 0
        if blocks is not None:
            pair, bleaf, first, cnt = blocks
            nb = int(bleaf.size)
            f_leaf((nb,), (threads,), (bleaf, first, cnt, active[pair], queries, tree.points, tree.perm, tree.start,
                                      tree.end, np.int32(d), np.int32(k), st.top), shared_mem=smem)
        e3 = E(); e3.record()
        keep = cp.empty(na, cp.uint8)
        f_adv(_grid(na, 128), (128,), (active, np.int32(na), np.int32(k), np.int32(budget), st.top, lim, leaf_of,
                                      st.HD, st.HN, st.HS, st.visits, st.target, st.TK, keep))
        active = active[keep.astype(cp.bool_)]
        na = int(active.size)
        e4 = E(); e4.record()
        ev.append((e0, e1, e2, e3, e4, nb))
    return st.finish(tree, queries, k, budget, active, ev)


class _BannsState:
    """A P-BANNS search's per-query state (top-k keys, queue, visits, the popped target and its
    key), the roots pushed and the first box popped (``banns_init``); ``active``: the queries
    with a box to search."""

    def __init__(self, mod, tree, queries, k, roots, lim, hcap):
        import cupy as cp

        m, d = queries.shape
        self.top = cp.full((m, k), np.uint64(0xFFFFFFFFFFFFFFFF), cp.uint64)
        self.HD = cp.empty((m, hcap), cp.float32)
        self.HN = cp.empty((m, hcap), cp.int32)
        self.HS = cp.zeros(m, cp.int32)
        self.OVF = cp.zeros(m, cp.int32)
        self.visits = cp.zeros(m, cp.int32)
        self.target = cp.zeros(m, cp.int32)
        self.TK = cp.zeros(m, cp.float32)
        keep0 = cp.empty(m, cp.uint8)
        mod.get_function("banns_init")(_grid(m, 128), (128,), (
            np.int32(m), queries, np.int32(d), roots, np.int32(roots.size), tree.lo, tree.hi, lim, self.HD, self.HN,
            self.HS, self.OVF, self.target, self.TK, keep0))
        self.active = cp.nonzero(keep0)[0].astype(cp.int32)

    def finish(self, tree, queries, k, budget, active, ev):
        """Decode the lists, redo exactly the still ``active`` queries (and, with an unlimited
        budget, those whose queue overflowed); (dist2, ids, stats), with the phase times of the
        rounds' events ``ev`` ((e0, .., e4, leaf blocks) per round)."""
        import cupy as cp

        phase = np.zeros(4)
        leaf_blocks = 0
        if ev:
            ev[-1][4].synchronize()
            for e0, e1, e2, e3, e4, nb in ev:
                phase += [cp.cuda.get_elapsed_time(a, b) for a, b in ((e0, e1), (e1, e2), (e2, e3), (e3, e4))]
                leaf_blocks += nb
        t0 = time.perf_counter()
        out_d, out_i = decode_keys(self.top)
        n_ovf = int(self.OVF.sum())
        redo = active
        if n_ovf and budget == 0:
            redo = cp.unique(cp.concatenate([active, cp.nonzero(self.OVF)[0].astype(cp.int32)]))
        if int(redo.size):
            _exact_redo(tree, queries, redo, k, out_d, out_i)
        cp.cuda.get_current_stream().synchronize()  # this search's stream: others may run beside it
        t_fin = (time.perf_counter() - t0) * 1e3
        return out_d, out_i, {"rounds": len(ev), "finished_by_bruteforce": int(active.size), "heap_overflow": n_ovf,
                              "leaf_blocks": leaf_blocks, "leaves_visited": cp.asnumpy(self.visits),
                              "ms_descend": round(float(phase[0]), 3), "ms_bucket": round(float(phase[1]), 3),
                              "ms_leaf_scan": round(float(phase[2]), 3), "ms_advance": round(float(phase[3]), 3),
                              "ms_finish": round(t_fin, 3)}


SLOT_KEYS = 1 << 26  # slot keys of a batched round (512 MB): queries are taken L * k slot keys each


def _leaf_blocks(leaf_of, qb, drop_none=True):
    """Bucket the pairs of ``leaf_of`` by leaf into blocks of at most ``qb``: (pair of each
    sorted position, block leaf, block first position, block count), or None when there are
    none. ``drop_none``: leave out the pairs without a leaf (-1; the batched rounds, whose
    rounds leave many); else they make blocks of leaf -1, which the leaf kernels skip (one
    leaf per query and round: no host sync to count them)."""
    import cupy as cp

    if drop_none:
        valid = cp.nonzero(leaf_of >= 0)[0].astype(cp.int32)
        if int(valid.size) == 0:
            return None
        pair = valid[cp.argsort(leaf_of[valid])]
    else:
        pair = cp.argsort(leaf_of).astype(cp.int32)
    n = int(pair.size)
    sleaf = leaf_of[pair]
    brk = cp.nonzero(sleaf[1:] != sleaf[:-1])[0].astype(cp.int32) + 1
    gstart = cp.concatenate([cp.zeros(1, cp.int32), brk])
    gend = cp.concatenate([brk, cp.full(1, n, cp.int32)])
    nblk_g = (gend - gstart + qb - 1) // qb
    bcum = cp.cumsum(nblk_g)
    nb = int(bcum[-1])
    bidx = cp.arange(nb, dtype=cp.int32)
    bg = cp.searchsorted(bcum, bidx, side="right").astype(cp.int32)
    first = (gstart[bg] + (bidx - (bcum[bg] - nblk_g[bg]).astype(cp.int32)) * qb).astype(cp.int32)
    cnt = cp.minimum(qb, gend[bg] - first).astype(cp.int32)
    return pair, sleaf[gstart[bg]], first, cnt


def _mma_round(mod, tree, queries, k, active, na, L, blocks, top, state):
    """One batched round's scan and merge on tensor cores (see the kernels' comment): the pairs'
    k smallest upper bounds, each query's bound T, the rows that can still enter a list (an entry
    buffer kept in ``state`` across rounds, grown and the pass redone when it overflows), their
    canonical keys merged into the lists. The round's phase events go to ``state["ev"]``, read
    once at the end of the search (no host sync for them here)."""
    import cupy as cp

    pair, bleaf, first, cnt = blocks
    nb = int(bleaf.size)
    d = queries.shape[1]
    npts, rel, ab = _mma_args(tree, d)
    smem = _mma_smem(d)
    if "Qh" not in state:  # the queries in half, their squared norms, whether half holds them
        state["Qh"] = queries.astype(cp.float16)
        state["QN"] = cp.sum(queries * queries, axis=1, dtype=cp.float32)
        state["QOK"] = (cp.isfinite(state["Qh"]).all(axis=1) & cp.isfinite(state["QN"])).astype(cp.uint8)
        state["ev"] = []
    E = cp.cuda.Event
    ev = [E() for _ in range(5)]
    ev[0].record()
    common = (bleaf, first, cnt, pair, np.int32(L), active, state["Qh"], state["QN"], state["QOK"], tree.points,
              _row_sqnorms(tree), tree.perm, tree.start, tree.end, np.int32(d), np.int32(k), npts, rel, ab)
    T = cp.empty(na, cp.float32)
    if state.get("rounds", 0) == 0:  # the first round: the lists are empty, bound by the round's rows
        pair_ub = cp.full((na * L, k), np.uint64(0xFFFFFFFFFFFFFFFF), cp.uint64)
        mod.get_function("mma_scan_ub")((nb,), (MT,), common + (pair_ub,), shared_mem=smem)
        mod.get_function("mma_bound")(_grid(na, 128), (128,), (active, np.int32(na), np.int32(L), np.int32(k),
                                                               pair_ub, top, T))
        del pair_ub
    else:  # later rounds: the lists' k-th distances (few of the round's rows beat them)
        mod.get_function("mma_bound")(_grid(na, 128), (128,), (active, np.int32(na), np.int32(0), np.int32(k),
                                                               top, top, T))
    state["rounds"] = state.get("rounds", 0) + 1
    ev[1].record()
    f_emit = mod.get_function("mma_scan_emit")
    ent_n = cp.zeros(1, cp.uint64)
    while True:
        cap = state.setdefault("cap", max(1 << 16, 4 * k * na))
        if state.get("ent_i") is None or state["ent_i"].size < cap:
            state["ent_i"], state["ent_p"] = cp.empty(cap, cp.int32), cp.empty(cap, cp.int64)
        ent_i, ent_p = state["ent_i"], state["ent_p"]
        ent_n.fill(0)
        f_emit((nb,), (MT,), common + (T, ent_i, ent_p, ent_n, np.int64(ent_i.size)), shared_mem=smem)
        n = int(ent_n.get()[0])
        if n <= ent_i.size:
            break
        state["cap"], state["ent_i"] = n + n // 4 + 1024, None
    ev[2].record()
    state["entries"] = state.get("entries", 0) + n
    if n:
        order = cp.argsort(ent_i[:n])
        si, sp = ent_i[:n][order], ent_p[:n][order]
        firsts = cp.searchsorted(si, cp.arange(na + 1, dtype=cp.int32)).astype(cp.int64)
        ev[3].record()
        keys = cp.empty(n, cp.uint64)
        mod.get_function("mma_keys")(_grid(n, 128), (128,), (np.int64(n), si, sp, active, queries, tree.points,
                                                             tree.perm, np.int32(d), keys))
        mod.get_function("mma_merge")(_grid(na, 128), (128,), (active, np.int32(na), firsts, keys, np.int32(k), top))
    else:
        ev[3].record()
    ev[4].record()
    state["ev"].append(ev)


def _row_sqnorms(tree):
    """Squared norms of ``tree.points``' rows (float32, any summation order: inside the
    tensor-core bound), computed once per tree and kept on it (4 bytes a row)."""
    import cupy as cp

    key = (tree.points.data.ptr, tree.points.shape)
    got = tree.__dict__.get("_row_sq")
    if got is None or got[0] != key:
        X = tree.points
        out = cp.empty(X.shape[0], cp.float32)
        step = 1 << 20
        for a in range(0, X.shape[0], step):
            blk = X[a:a + step].astype(cp.float32)
            out[a:a + step] = cp.sum(blk * blk, axis=1)
        # complete before it is shared: a search on another thread's stream may read it next
        cp.cuda.get_current_stream().synchronize()
        tree.__dict__["_row_sq"] = got = (key, out)
    return got[1]


def _banns_batched(tree, queries, k, budget, finish_below, roots, lim, mod, L, descent, hcap):
    """P-BANNS in batched rounds: each active query takes up to ``L`` leaves a round (pop ->
    descend, against the round's pruning distance: ``banns_collect``), every (query, leaf) pair
    is bucketed by leaf and a leaf is read once for all the queries of its bucket
    (``banns_leaf_stream_slots``: a pair's candidates go to its own slot), then each query's
    slots are merged into its list (``banns_merge_slots``). A budget of B leaves takes
    ceil(B / L) rounds instead of B, and a leaf gathers the queries of L rounds at once.
    Queries are taken ``SLOT_KEYS // (L * k)`` at a time (a query's answer does not depend on
    the others)."""
    import cupy as cp

    m, d = queries.shape
    f_col = mod.get_function("banns_collect")
    f_scan = mod.get_function("banns_leaf_stream_slots")
    f_merge = mod.get_function("banns_merge_slots")
    mma = {} if mma_fits(tree, d, k) else None  # the same answer, rows scored on tensor cores first
    qb = MQ if mma is not None else SQ
    chunk = max(1, SLOT_KEYS // (L * k))
    if m > chunk:  # at most SLOT_KEYS slot keys at a time
        parts = [_banns_batched(tree, queries[a:a + chunk], k, budget, finish_below, roots, lim[a:a + chunk], mod,
                                L, descent, hcap) for a in range(0, m, chunk)]
        stats = {key: sum(p[2][key] for p in parts) for key in parts[0][2] if key != "leaves_visited"}
        stats["rounds"] = max(p[2]["rounds"] for p in parts)
        stats["leaves_visited"] = np.concatenate([p[2]["leaves_visited"] for p in parts])
        return cp.concatenate([p[0] for p in parts]), cp.concatenate([p[1] for p in parts]), stats
    st = _BannsState(mod, tree, queries, k, roots, lim, hcap)
    active, na = st.active, int(st.active.size)
    ev = []
    E = cp.cuda.Event
    while na > finish_below:
        e0 = E(); e0.record()
        leaf_of = cp.empty(na * L, cp.int32)
        keep = cp.empty(na, cp.uint8)
        f_col(_grid(na, 64), (64,), (active, np.int32(na), np.int32(L), queries, np.int32(d), tree.child,
                                     tree.split_dim, tree.split_val, tree.lo, tree.hi, np.int32(k), st.top, st.target,
                                     st.TK, lim, st.HD, st.HN, st.HS, st.OVF, st.visits, np.int32(budget), leaf_of,
                                     keep, np.int32(DESCENT_IDS[descent])))
        e1 = E(); e1.record()
        blocks = _leaf_blocks(leaf_of, qb)
        e2 = E(); e2.record()
        nb = 0
        if blocks is not None:
            pair, bleaf, first, cnt = blocks
            nb = int(bleaf.size)
            if mma is not None:
                _mma_round(mod, tree, queries, k, active, na, L, blocks, st.top, mma)
            else:
                slots = cp.full((na * L, k), np.uint64(0xFFFFFFFFFFFFFFFF), cp.uint64)
                f_scan((nb,), (SP,), (bleaf, first, cnt, active[pair // L], queries, tree.points, tree.perm,
                                      tree.start, tree.end, np.int32(d), np.int32(k), slots, pair, st.top),
                       shared_mem=SQ * d * 4)
        e3 = E(); e3.record()
        if blocks is not None and mma is None:
            f_merge(_grid(na, 128), (128,), (active, np.int32(na), np.int32(L), np.int32(k), slots, st.top))
        active = active[keep.astype(cp.bool_)]
        na = int(active.size)
        e4 = E(); e4.record()
        ev.append((e0, e1, e2, e3, e4, nb))
    dist, ids, stats = st.finish(tree, queries, k, budget, active, ev)
    if mma is not None and mma.get("ev"):  # the tensor-core scan's phases (in ms_leaf_scan), rows re-ranked
        ms = np.sum([[cp.cuda.get_elapsed_time(e[j], e[j + 1]) for j in range(4)] for e in mma["ev"]], axis=0)
        stats.update({"ms_mma_bounds": round(float(ms[0]), 3), "ms_mma_emit": round(float(ms[1]), 3),
                      "ms_mma_sort": round(float(ms[2]), 3), "ms_mma_merge": round(float(ms[3]), 3),
                      "mma_rows_reranked": int(mma.get("entries", 0))})
    return dist, ids, stats
