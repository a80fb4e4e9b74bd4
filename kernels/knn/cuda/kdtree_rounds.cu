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

// banns_merge_slots with a warp a query (k <= 32, L + 1 <= 32 * MERGE_STREAMS): the list and the
// L slots are ascending streams; k times the warp takes the smallest head of all (a shuffle
// minimum) and every stream whose head equals it moves on (a point reached through two trees
// counts once): the k smallest distinct keys, as banns_merge_slots leaves them, bit for bit.
#define MERGE_STREAMS 5
extern "C" __global__ void banns_merge_warp(const int* __restrict__ active, int na, int L, int k,
        const unsigned long long* __restrict__ slots, unsigned long long* __restrict__ top) {
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= na) return;  // the whole warp
    unsigned long long* mytop = top + (long long)active[w] * k;
    const unsigned long long* s = slots + w * (long long)L * k;
    const unsigned long long* base[MERGE_STREAMS];
    int ptr[MERGE_STREAMS];
    unsigned long long head[MERGE_STREAMS];
#pragma unroll
    for (int u = 0; u < MERGE_STREAMS; ++u) {
        const int t = lane + 32 * u;  // stream t: slot t, or the list (t == L)
        base[u] = t < L ? s + (long long)t * k : (t == L ? (const unsigned long long*)mytop : nullptr);
        ptr[u] = 0;
        head[u] = base[u] ? base[u][0] : KEY_NONE;
    }
    unsigned long long mine_out = KEY_NONE;
    for (int r = 0; r < k; ++r) {
        unsigned long long mn = KEY_NONE;
#pragma unroll
        for (int u = 0; u < MERGE_STREAMS; ++u) mn = head[u] < mn ? head[u] : mn;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long v = __shfl_xor_sync(0xFFFFFFFFu, mn, o);
            mn = v < mn ? v : mn;
        }
        if (mn == KEY_NONE) break;  // the same on every lane
        if (lane == r) mine_out = mn;
#pragma unroll
        for (int u = 0; u < MERGE_STREAMS; ++u) {
            if (head[u] == mn) {
                ++ptr[u];
                head[u] = ptr[u] < k ? base[u][ptr[u]] : KEY_NONE;
            }
        }
    }
    __syncwarp();
    if (lane < k) mytop[lane] = mine_out;
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

// ---------------------------------------------------------------------------- round buckets
// A batched round's (query, leaf) pairs bucketed by leaf with no host sync (a counting sort):
//   bucket_count:   pairs per leaf (cnt, zeroed before)
//   (host)          one inclusive scan of cnt | ceil(cnt / qb) << 32: each leaf's end in the
//                   sorted pairs and in the blocks
//   bucket_scatter: each pair at its leaf's next free position (the order inside a leaf is
//                   whichever thread came first: a pair's scan is its own, so the lists are not)
//   bucket_blocks:  each leaf's blocks of at most qb pairs (leaf, first position, count)
// The host launches the leaf kernels over a bound of the block count (pairs / qb + leaves);
// the blocks past the last keep leaf -1 and return at once.
extern "C" __global__ void bucket_count(const int* __restrict__ leaf_of, long long n, int* __restrict__ cnt) {
    long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (p >= n) return;
    int l = leaf_of[p];
    if (l >= 0) atomicAdd(cnt + l, 1);
}
extern "C" __global__ void bucket_pack(const int* __restrict__ cnt, int nnodes, int qb,
                                       long long* __restrict__ packed) {
    int l = blockIdx.x * blockDim.x + threadIdx.x;
    if (l >= nnodes) return;
    long long c = cnt[l];
    packed[l] = c | (((c + qb - 1) / qb) << 32);
}
extern "C" __global__ void bucket_scatter(const int* __restrict__ leaf_of, long long n,
                                          const long long* __restrict__ scan, const int* __restrict__ cnt,
                                          int* __restrict__ cursor, int* __restrict__ pair) {
    long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (p >= n) return;
    int l = leaf_of[p];
    if (l < 0) return;
    long long base = (scan[l] & 0xFFFFFFFFLL) - cnt[l];
    pair[base + atomicAdd(cursor + l, 1)] = (int)p;
}
extern "C" __global__ void bucket_blocks(const long long* __restrict__ scan, const int* __restrict__ cnt,
                                         int nnodes, int qb, int* __restrict__ bleaf, int* __restrict__ first,
                                         int* __restrict__ bcnt) {
    int l = blockIdx.x * blockDim.x + threadIdx.x;
    if (l >= nnodes) return;
    int c = cnt[l];
    if (c == 0) return;
    long long v = scan[l];
    int nb = (c + qb - 1) / qb;
    int p0 = (int)(v & 0xFFFFFFFFLL) - c, b0 = (int)(v >> 32) - nb;
    for (int j = 0; j < nb; ++j) {
        bleaf[b0 + j] = l;
        first[b0 + j] = p0 + j * qb;
        bcnt[b0 + j] = min(qb, c - j * qb);
    }
}

// ---------------------------------------------------------------------------- the beam
// descent="beam": a one-round budget's B leaves (B <= BEAM_MAX) chosen level by level, a warp a
// query (kdtree._kdtree_cpu._banns_beam_cpu, the same entries, bit for bit). The entries start as
// banns_init's roots (target, then the queue); at each step every entry that is not a leaf
// becomes its near child (its key, its box P) and its far child (path_bound from the key and P's
// interval on the split dimension; P the far child itself), a far child beyond the bound dropped,
// a near child whose box lies beyond a finite bound dropped; the B smallest (key, node) codes are
// kept (a bitonic sort of the warp's entries in shared memory), until every entry is a leaf.
#define BEAM_MAX 128
#define BEAM_WARPS 4
#define BEAM_NONE 0xFFFFFFFFFFFFFFFFULL
__device__ __forceinline__ unsigned long long beam_code(float key, int node) {
    unsigned int b = __float_as_uint(key);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)b << 32) | (unsigned int)node;
}
__device__ __forceinline__ float beam_key(unsigned long long c) {
    unsigned int b = (unsigned int)(c >> 32);
    b = (b & 0x80000000u) ? (b & 0x7FFFFFFFu) : ~b;
    return __uint_as_float(b);
}
// sort the warp's first n codes (and their P) ascending, padded to a power of two >= 32
__device__ __forceinline__ void beam_sort(unsigned long long* C, int* P, int n, int lane) {
    int p2 = 32;
    while (p2 < n) p2 <<= 1;
    for (int j = n + lane; j < p2; j += 32) C[j] = BEAM_NONE;
    __syncwarp();
    for (int size = 2; size <= p2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = lane; t < (p2 >> 1); t += 32) {
                int a = 2 * t - (t & (stride - 1));
                int b = a + stride;
                unsigned long long x = C[a], y = C[b];
                if ((x > y) == ((a & size) == 0)) {
                    C[a] = y; C[b] = x;
                    int u = P[a]; P[a] = P[b]; P[b] = u;
                }
            }
            __syncwarp();
        }
    }
}
extern "C" __global__ void banns_beam(const int* __restrict__ active, int na, int L, int B,
        const float* __restrict__ Q, int d, const int* __restrict__ child, const int* __restrict__ sdim,
        const float* __restrict__ sval, const float* __restrict__ lo, const float* __restrict__ hi,
        const float* __restrict__ lim, const int* __restrict__ target, const float* __restrict__ TK,
        const float* __restrict__ HD, const int* __restrict__ HN, int* __restrict__ HS, int* __restrict__ visits,
        int* __restrict__ leaf_of, unsigned char* __restrict__ keep) {
    __shared__ unsigned long long sc[BEAM_WARPS][2 * BEAM_MAX];
    __shared__ int sp[BEAM_WARPS][2 * BEAM_MAX];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.x * BEAM_WARPS + w;
    if (i >= na) return;  // the whole warp
    unsigned long long* C = sc[w];
    int* P = sp[w];
    const int qi = active[i];
    const float* q = Q + (long long)qi * d;
    const float bl = lim[qi];
    const bool check_near = bl < F_INF;
    int cnt = 1 + HS[qi];  // banns_init's first popped root, then its queue (at most BEAM_MAX roots)
    for (int j = lane; j < cnt; j += 32) {
        int nd = j == 0 ? target[qi] : HN[(long long)qi * HCAP + j - 1];
        float kk = j == 0 ? TK[qi] : HD[(long long)qi * HCAP + j - 1];
        C[j] = beam_code(__fadd_rn(kk, 0.0f), nd);
        P[j] = nd;
    }
    __syncwarp();
    if (cnt > B) {
        beam_sort(C, P, cnt, lane);
        cnt = B;
    }
    while (true) {
        unsigned long long e[BEAM_MAX / 32];
        int p[BEAM_MAX / 32], c[BEAM_MAX / 32];
        bool internal = false;
#pragma unroll
        for (int t = 0; t < BEAM_MAX / 32; ++t) {
            int j = lane + 32 * t;
            c[t] = -1;
            if (j < cnt) {
                e[t] = C[j]; p[t] = P[j];
                c[t] = child[(int)(unsigned int)e[t]];
                internal |= c[t] >= 0;
            }
        }
        if (!__any_sync(0xFFFFFFFFu, internal)) break;
        __syncwarp();
        int valid = 0;
#pragma unroll
        for (int t = 0; t < BEAM_MAX / 32; ++t) {
            int j = lane + 32 * t;
            if (j >= cnt) continue;
            if (c[t] < 0) {  // a leaf stays
                C[2 * j] = e[t]; P[2 * j] = p[t];
                C[2 * j + 1] = BEAM_NONE;
                ++valid;
                continue;
            }
            const int node = (int)(unsigned int)e[t];
            const float key = beam_key(e[t]);
            const int s = sdim[node];
            const float v = sval[node], qs = q[s];
            const bool left = qs <= v;
            const int near_ = left ? c[t] : c[t] + 1, far_ = left ? c[t] + 1 : c[t];
            const int pn = p[t];
            float bd = path_bound(key, qs, lo[(long long)pn * d + s], hi[(long long)pn * d + s], v, left);
            bool fok = bd <= bl;
            C[2 * j + 1] = fok ? beam_code(__fadd_rn(bd, 0.0f), far_) : BEAM_NONE;
            P[2 * j + 1] = far_;
            bool nok = !(check_near && box_dist(q, lo + (long long)near_ * d, hi + (long long)near_ * d, d) > bl);
            C[2 * j] = nok ? beam_code(key, near_) : BEAM_NONE;
            P[2 * j] = pn;
            valid += (int)fok + (int)nok;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) valid += __shfl_xor_sync(0xFFFFFFFFu, valid, o);
        beam_sort(C, P, 2 * cnt, lane);
        cnt = valid < B ? valid : B;
    }
    int* out = leaf_of + (long long)i * L;
    for (int j = lane; j < L; j += 32) out[j] = j < cnt ? (int)(unsigned int)C[j] : -1;
    if (lane == 0) {
        visits[qi] = cnt;
        keep[i] = 0;
        HS[qi] = 0;
    }
}
