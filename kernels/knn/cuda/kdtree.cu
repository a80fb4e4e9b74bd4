
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
// @@HALF_ROWS@@ (bruteforce._half_rows("PT_HALF", "PT", "ldp") goes here: float or half rows)
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

// one step of a canonical distance over 4 dimensions, in dimension order (canon_dist's rounding)
__device__ __forceinline__ float acc4(float a, float4 q, float4 v) {
    float e;
    e = __fsub_rn(q.x, v.x); a = __fadd_rn(a, __fmul_rn(e, e));
    e = __fsub_rn(q.y, v.y); a = __fadd_rn(a, __fmul_rn(e, e));
    e = __fsub_rn(q.z, v.z); a = __fadd_rn(a, __fmul_rn(e, e));
    e = __fsub_rn(q.w, v.w); a = __fadd_rn(a, __fmul_rn(e, e));
    return a;
}
#ifdef PT_HALF
// four halves held in two 32-bit words (the first in the low bits), widened exactly
__device__ __forceinline__ float4 half4(unsigned int a, unsigned int b) {
    return make_float4(ldp((unsigned short)(a & 0xffffu)), ldp((unsigned short)(a >> 16)),
                       ldp((unsigned short)(b & 0xffffu)), ldp((unsigned short)(b >> 16)));
}
#endif

// Streaming leaf scan for the few queries a leaf gets per round (the common case: 1-2 at 65k
// buffered queries over 10^5 leaves, where the tiled kernels above are bound on their own
// per-block overhead, not on memory). One block of SP threads per (leaf, chunk of <= SQ
// queries); the chunk's queries are staged whole in shared memory, thread t streams leaf point t
// straight from global memory (float4 when d % 4 == 0; float16 rows 8 halves a load where d % 8
// == 0 under STREAM_HALF16) and keeps one running sum per query, in
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
#if defined(PT_HALF) && defined(STREAM_HALF16)
    // 8 halves (16 bytes) a load: a warp's 32 rows 704 bytes apart are 32 lines a load either way,
    // and the wider load asks L1 for each line's sectors half as often (the kernel is bound on L1)
    const bool vec8 = ((d & 7) | ((unsigned long long)points & 15)) == 0;
#endif
    long long p_beg = start[leaf], p_end = end[leaf];
    for (long long p0 = p_beg; p0 < p_end; p0 += SP) {
        long long p = p0 + t;
        if (p < p_end) {
            float acc[SQ];
#pragma unroll
            for (int s = 0; s < SQ; ++s) acc[s] = 0.0f;
#if defined(PT_HALF) && defined(STREAM_HALF16)
            if (vec8) {
                const uint4* x8 = (const uint4*)(points + p * d);
                const int d8 = d >> 3, d4 = d >> 2;
#pragma unroll 2
                for (int j = 0; j < d8; ++j) {
                    const uint4 h = __ldg(x8 + j);
                    const float4 v0 = half4(h.x, h.y), v1 = half4(h.z, h.w);
#pragma unroll
                    for (int s = 0; s < SQ; ++s) {
                        if (s < qc) {
                            const float4 qa = qs4[s * d4 + 2 * j], qb = qs4[s * d4 + 2 * j + 1];
                            acc[s] = acc4(acc4(acc[s], qa, v0), qb, v1);
                        }
                    }
                }
            } else
#endif
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
                    float4 v = half4(h.x, h.y);
#else
                    float4 v = __ldg(x4 + j);
#endif
#pragma unroll
                    for (int s = 0; s < SQ; ++s) {
                        if (s < qc) acc[s] = acc4(acc[s], qs4[s * d4 + j], v);
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

