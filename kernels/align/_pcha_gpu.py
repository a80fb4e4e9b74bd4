"""CUDA kernels of parametric chamfer alignment (PChA): objective, gradient and Hessian.

Kernels (one RawModule per configuration, compiled lazily and memoised):

``pcha_fused``
    The paper's *pipelined* form (Alg. 2/3): at the candidate parameters each thread transforms
    its points, looks up the nearest reference point ``mu`` in the distance-transform tables
    (cell -> id of the nearest occupied cell -> its centroid; ``CORNERS=1``: the closest of the
    entries of the 2^d cells around the point, ``CORNERS=0``: the paper's single cell found by
    rounding), forms the residual ``r = mu - x'`` with the continuous ``x'`` (the
    *nearest-vector residual*: Gauss-Newton friendly; no interpolation of a distance), applies the loss weight (Huber/IRLS) and accumulates, in
    registers, the per-point terms of ``f``, ``g`` and ``H``. Then one block reduction (warp
    shuffles, then shared memory across the warps) writes one partial row per block.

    ``HESS_REDUCED=1`` (additive models) accumulates the model-independent sufficient statistics
    ``S = sum w r q^T`` and ``Q = sum w q q^T`` (``q = [x; 1]``), from which the host gets
    ``g`` and ``H`` by contracting with the constant derivative stack ``D`` -- a generalisation
    of the paper's reduced per-point Hessians (Table 2). ``HESS_REDUCED=0`` computes the per-point
    Jacobian ``J = D q`` (or the compositional projective Jacobian of eq. 14) and accumulates
    ``J^T w r`` and the upper triangle of ``J^T w J`` directly.

    Deviation from the paper: threads loop over several points (grid-stride) before the block
    reduction, instead of one point per thread, so the reduction cost is amortised.

``pcha_resjac`` + ``pcha_reduce``
    The two-kernel form for comparison: the first writes per-point residuals, weights and
    Jacobians to global memory (structure of arrays), the second reads them back, forms
    ``J^T w r`` / ``J^T w J`` and block-reduces.

``pcha_final``
    Final reduction of the per-block partial rows in double precision, one block per
    (value, alignment).

Batching: ``blockIdx.y`` indexes the alignment; points of all alignments are concatenated with
offsets ``offs[b] .. offs[b+1]``; every alignment has its own parameter row (matrix ``M``,
derivative stack ``D``, Huber delta, and in its last float an int ``active`` flag: finished
alignments cost nothing). One pinned upload of the rows and one pinned download of the
``(B, NV)`` float64 sums per LM iteration. All alignments of one launch share one
distance-transform table.

Measured (``scanforest bench align --points 1140703``, NVIDIA H200, 3-D similarity): the fused
kernels take 0.13 ms per evaluation (corners lookup; 0.04 ms with the single-cell lookup), the
two-kernel form 0.19 ms; a whole alignment (54 LM iterations) 16 ms with the data resident and
32 ms including the upload of the points and the tables.
"""
from __future__ import annotations

import functools

import numpy as np

from ._pcha_common import PChAParams, resolve_params
from .transforms import Model, contract_gradient, contract_hessian, matrix_and_derivatives

PSTRIDE = 168          # floats per alignment: M (16) + D (<= 144) + huber delta + pad
_MOFF, _DOFF, _HOFF = 0, 16, 160
THREADS = 256

_SRC = r"""
#ifndef DIM
#define DIM 3
#endif
#define DP1 (DIM + 1)

// the last float of an alignment's parameter row holds its int "active" flag
__device__ __forceinline__ bool is_active(const float* __restrict__ params, int b) {
    return __float_as_int(params[(long long)b * PSTRIDE + PSTRIDE - 1]) != 0;
}

__device__ __forceinline__ int cell_index(float u, int s, bool &inside) {
    if (!(u >= 0.f)) { inside = false; return 0; }           // also catches NaN
    if (u > (float)(s - 1)) { inside = false; return s - 1; }
    return (int)u;
}

__device__ __forceinline__ int corner_lo(float u, int s) {
    if (!(u >= 0.f)) return 0;
    if (u > (float)(s - 2)) return s - 2;
    return (int)u;
}

// Transform point j, look the nearest reference point up; returns false if the point is dropped.
__device__ __forceinline__ bool point_residual(
    const float* __restrict__ pts, long long j, const int* __restrict__ index,
    const float* __restrict__ cent, const float* P,
    int s0, int s1, int s2, float o0, float o1, float o2, float inv_cell,
    float* x, float* xp, float* r, float &fj, float &w, float &ins)
{
#pragma unroll
    for (int c = 0; c < DIM; ++c) x[c] = pts[j * DIM + c];
#pragma unroll
    for (int a = 0; a < DIM; ++a) {
        float s = P[a * 4 + DIM];
#pragma unroll
        for (int c = 0; c < DIM; ++c) s = fmaf(P[a * 4 + c], x[c], s);
        xp[a] = s;
    }
#if PROJ
    {
        float ww = P[DIM * 4 + DIM];
#pragma unroll
        for (int c = 0; c < DIM; ++c) ww = fmaf(P[DIM * 4 + c], x[c], ww);
        float iw = 1.f / ww;
#pragma unroll
        for (int a = 0; a < DIM; ++a) xp[a] *= iw;
    }
#endif
    bool inside = true;
    int i0 = cell_index(floorf((xp[0] - o0) * inv_cell + 0.5f), s0, inside);
    int i1 = cell_index(floorf((xp[1] - o1) * inv_cell + 0.5f), s1, inside);
    long long flat = (long long)i0 * s1 + i1;
#if DIM == 3
    int i2 = cell_index(floorf((xp[2] - o2) * inv_cell + 0.5f), s2, inside);
    flat = flat * s2 + i2;
#endif
#if DROP
    if (!inside) return false;
#endif
    float e2 = 0.f;
#if CORNERS
    // nearest of the entries of the 2^DIM cells around x': the objective becomes continuous
    // (the minimum over candidate reference locations) instead of jumping at cell borders
    {
        const int l0 = corner_lo(floorf((xp[0] - o0) * inv_cell), s0);
        const int l1 = corner_lo(floorf((xp[1] - o1) * inv_cell), s1);
#if DIM == 3
        const int l2 = corner_lo(floorf((xp[2] - o2) * inv_cell), s2);
#endif
        e2 = 3.4e38f;
#pragma unroll
        for (int corner = 0; corner < (1 << DIM); ++corner) {
            long long fl = (long long)(l0 + (corner & 1)) * s1 + l1 + ((corner >> 1) & 1);
#if DIM == 3
            fl = fl * s2 + l2 + ((corner >> 2) & 1);
#endif
            const long long cid = __ldg(&index[fl]);
            float t[DIM], s = 0.f;
#pragma unroll
            for (int c = 0; c < DIM; ++c) {
                t[c] = __ldg(&cent[cid * DIM + c]) - xp[c];
                s = fmaf(t[c], t[c], s);
            }
            if (s < e2) {
                e2 = s;
#pragma unroll
                for (int c = 0; c < DIM; ++c) r[c] = t[c];
            }
        }
    }
#else
    {
        const long long cid = __ldg(&index[flat]);   // nearest occupied cell (4 B gather)
#pragma unroll
        for (int c = 0; c < DIM; ++c) {
            r[c] = __ldg(&cent[cid * DIM + c]) - xp[c];  // its centroid (small, L2-resident)
            e2 = fmaf(r[c], r[c], e2);
        }
    }
#endif
    w = 1.f; fj = e2;
#if HUBER
    {
        float delta = P[HOFF];
        float e = sqrtf(e2);
        if (e > delta) { w = delta / e; fj = 2.f * delta * e - delta * delta; }
    }
#endif
    ins = inside ? 1.f : 0.f;
    return true;
}

// Per-point Jacobian (full form): additive models J[c][k] = sum_m D[k][c][m] q[m];
// projective (compositional, eq. 14) from the warped point.
__device__ __forceinline__ void point_jacobian(const float* P, const float* x, const float* xp,
                                               float J[DIM][NPAR]) {
#if PROJ
    float X = xp[0], Y = xp[1];
    J[0][0] = X; J[0][1] = Y; J[0][2] = 1.f; J[0][3] = 0.f; J[0][4] = 0.f; J[0][5] = 0.f;
    J[0][6] = -X * X; J[0][7] = -X * Y;
    J[1][0] = 0.f; J[1][1] = 0.f; J[1][2] = 0.f; J[1][3] = X; J[1][4] = Y; J[1][5] = 1.f;
    J[1][6] = -X * Y; J[1][7] = -Y * Y;
#else
#pragma unroll
    for (int k = 0; k < NPAR; ++k)
#pragma unroll
        for (int c = 0; c < DIM; ++c) {
            const float* Dk = P + DOFF + (k * DIM + c) * DP1;
            float s = Dk[DIM];
#pragma unroll
            for (int m = 0; m < DIM; ++m) s = fmaf(Dk[m], x[m], s);
            J[c][k] = s;
        }
#endif
}

__device__ __forceinline__ void block_reduce_store(float* acc, float (*red)[NV], float* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
        float s = acc[v];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
        if (lane == 0) red[warp][v] = s;
    }
    __syncthreads();
    const int nw = blockDim.x >> 5;
    for (int v = threadIdx.x; v < NV; v += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < nw; ++k) s += red[k][v];
        out[v] = s;
    }
}

__device__ __forceinline__ void accumulate_full(float* acc, float w, const float* r,
                                                float J[DIM][NPAR]) {
    int k = 2;
#pragma unroll
    for (int l = 0; l < NPAR; ++l) {
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < DIM; ++c) s = fmaf(J[c][l], r[c], s);
        acc[k++] += w * s;
    }
#pragma unroll
    for (int l = 0; l < NPAR; ++l)
#pragma unroll
        for (int m = l; m < NPAR; ++m) {
            float s = 0.f;
#pragma unroll
            for (int c = 0; c < DIM; ++c) s = fmaf(J[c][l], J[c][m], s);
            acc[k++] += w * s;
        }
}

extern "C" __global__ void __launch_bounds__(256)
pcha_fused(const float* __restrict__ pts, const long long* __restrict__ offs,
           const int* __restrict__ index, const float* __restrict__ cent,
           const float* __restrict__ params,
           float* __restrict__ partial,
           const int s0, const int s1, const int s2,
           const float o0, const float o1, const float o2, const float inv_cell)
{
    __shared__ float P[PSTRIDE];
    __shared__ float red[8][NV];
    const int b = blockIdx.y;
    float* out = partial + ((long long)b * gridDim.x + blockIdx.x) * NV;
    if (!is_active(params, b)) {
        for (int v = threadIdx.x; v < NV; v += blockDim.x) out[v] = 0.f;
        return;
    }
    for (int i = threadIdx.x; i < PSTRIDE; i += blockDim.x) P[i] = params[(long long)b * PSTRIDE + i];
    __syncthreads();
    float acc[NV];
#pragma unroll
    for (int v = 0; v < NV; ++v) acc[v] = 0.f;
    const long long beg = offs[b], end = offs[b + 1];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long j = beg + (long long)blockIdx.x * blockDim.x + threadIdx.x; j < end; j += stride) {
        float x[DIM], xp[DIM], r[DIM], fj, w, ins;
        if (!point_residual(pts, j, index, cent, P, s0, s1, s2, o0, o1, o2, inv_cell, x, xp, r, fj, w, ins))
            continue;
        acc[0] += fj;
        acc[1] += ins;
#if NEED_GH
#if HESS_REDUCED
        {
            float q[DP1];
#pragma unroll
            for (int c = 0; c < DIM; ++c) q[c] = x[c];
            q[DIM] = 1.f;
            int k = 2;
#pragma unroll
            for (int c = 0; c < DIM; ++c) {
                float wr = w * r[c];
#pragma unroll
                for (int m = 0; m < DP1; ++m) acc[k++] += wr * q[m];
            }
#pragma unroll
            for (int m = 0; m < DP1; ++m) {
                float wq = w * q[m];
#pragma unroll
                for (int n = m; n < DP1; ++n) acc[k++] += wq * q[n];
            }
        }
#else
        {
            float J[DIM][NPAR];
            point_jacobian(P, x, xp, J);
            accumulate_full(acc, w, r, J);
        }
#endif
#endif
    }
    block_reduce_store(acc, red, out);
}

// ---- two-kernel form: 1) residuals + Jacobians to global memory (SoA), 2) reduction
#define NB (3 + DIM + DIM * NPAR)

extern "C" __global__ void __launch_bounds__(256)
pcha_resjac(const float* __restrict__ pts, const long long* __restrict__ offs,
            const int* __restrict__ index, const float* __restrict__ cent,
           const float* __restrict__ params,
            float* __restrict__ buf, const long long ntot,
            const int s0, const int s1, const int s2,
            const float o0, const float o1, const float o2, const float inv_cell)
{
    __shared__ float P[PSTRIDE];
    const int b = blockIdx.y;
    if (!is_active(params, b)) return;
    for (int i = threadIdx.x; i < PSTRIDE; i += blockDim.x) P[i] = params[(long long)b * PSTRIDE + i];
    __syncthreads();
    const long long beg = offs[b], end = offs[b + 1];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long j = beg + (long long)blockIdx.x * blockDim.x + threadIdx.x; j < end; j += stride) {
        float x[DIM], xp[DIM], r[DIM], fj = 0.f, w = 0.f, ins = 0.f;
        float J[DIM][NPAR];
        bool used = point_residual(pts, j, index, cent, P, s0, s1, s2, o0, o1, o2, inv_cell, x, xp, r, fj, w, ins);
        if (!used) {
            fj = 0.f; w = 0.f; ins = 0.f;
#pragma unroll
            for (int c = 0; c < DIM; ++c) r[c] = 0.f;
        }
        point_jacobian(P, x, xp, J);
        buf[0 * ntot + j] = fj;
        buf[1 * ntot + j] = w;
        buf[2 * ntot + j] = ins;
#pragma unroll
        for (int c = 0; c < DIM; ++c) buf[(3 + c) * ntot + j] = r[c];
#pragma unroll
        for (int c = 0; c < DIM; ++c)
#pragma unroll
            for (int k = 0; k < NPAR; ++k) buf[(3 + DIM + c * NPAR + k) * ntot + j] = J[c][k];
    }
}

extern "C" __global__ void __launch_bounds__(256)
pcha_reduce(const float* __restrict__ buf, const long long* __restrict__ offs,
            const float* __restrict__ params, float* __restrict__ partial, const long long ntot)
{
    __shared__ float red[8][NV];
    const int b = blockIdx.y;
    float* out = partial + ((long long)b * gridDim.x + blockIdx.x) * NV;
    if (!is_active(params, b)) {
        for (int v = threadIdx.x; v < NV; v += blockDim.x) out[v] = 0.f;
        return;
    }
    float acc[NV];
#pragma unroll
    for (int v = 0; v < NV; ++v) acc[v] = 0.f;
    const long long beg = offs[b], end = offs[b + 1];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long j = beg + (long long)blockIdx.x * blockDim.x + threadIdx.x; j < end; j += stride) {
        float r[DIM], J[DIM][NPAR];
        acc[0] += buf[j];
        float w = buf[ntot + j];
        acc[1] += buf[2 * ntot + j];
#pragma unroll
        for (int c = 0; c < DIM; ++c) r[c] = buf[(3 + c) * ntot + j];
#pragma unroll
        for (int c = 0; c < DIM; ++c)
#pragma unroll
            for (int k = 0; k < NPAR; ++k) J[c][k] = buf[(3 + DIM + c * NPAR + k) * ntot + j];
        accumulate_full(acc, w, r, J);
    }
    block_reduce_store(acc, red, out);
}

extern "C" __global__ void pcha_final(const float* __restrict__ partial, double* __restrict__ out,
                                      const int nblk)
{
    __shared__ double sh[32];
    const int v = blockIdx.x, b = blockIdx.y;
    double s = 0.0;
    for (int k = threadIdx.x; k < nblk; k += blockDim.x)
        s += (double)partial[((long long)b * nblk + k) * NV + v];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += sh[k];
        out[(long long)b * NV + v] = t;
    }
}
"""


def _pinned(shape, dtype):
    import cupy as cp

    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = cp.cuda.alloc_pinned_memory(n)
    return np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)


@functools.lru_cache(maxsize=None)
def _sm_count() -> int:
    import cupy as cp

    return int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"])


def n_values(model: Model, reduced: bool) -> int:
    """Accumulated values per alignment: f, count, then S and Q (reduced) or J^T r and the
    upper triangle of J^T J (full)."""
    d, L = model.dim, model.n_params
    if reduced:
        return 2 + d * (d + 1) + (d + 1) * (d + 2) // 2
    return 2 + L + L * (L + 1) // 2


@functools.lru_cache(maxsize=None)
def _module(dim: int, npar: int, proj: bool, reduced: bool, drop: bool, huber: bool,
            need_gh: bool, nv: int, corners: bool = True):
    import cupy as cp

    defs = (f"#define DIM {dim}\n#define NPAR {npar}\n#define PROJ {int(proj)}\n"
            f"#define CORNERS {int(corners)}\n"
            f"#define HESS_REDUCED {int(reduced)}\n#define DROP {int(drop)}\n"
            f"#define HUBER {int(huber)}\n#define NEED_GH {int(need_gh)}\n#define NV {nv}\n"
            f"#define PSTRIDE {PSTRIDE}\n#define DOFF {_DOFF}\n#define HOFF {_HOFF}\n")
    return cp.RawModule(code=defs + _SRC, options=())


def host_terms(model: Model, params: np.ndarray):
    """``(M, D)``: matrices ``(B, d+1, d+1)`` and derivative stacks (None for projective)."""
    return matrix_and_derivatives(model, params)


def pack_params(model: Model, M: np.ndarray, D, huber_delta: np.ndarray, out=None) -> np.ndarray:
    """Host parameter rows ``(B, PSTRIDE)`` float32: M (4x4 row-major, 3x3 block used in 2-D),
    D (additive models), Huber delta."""
    B = M.shape[0]
    d = model.dim
    if out is None:
        out = np.zeros((B, PSTRIDE), np.float32)
    M4 = np.zeros((B, 4, 4))
    M4[:, :d, :d] = M[:, :d, :d]
    M4[:, :d, d] = M[:, :d, d]
    M4[:, d, :d] = M[:, d, :d]
    M4[:, d, d] = M[:, d, d]
    out[:, _MOFF:_MOFF + 16] = M4.reshape(B, 16)
    if D is not None:
        Df = D.reshape(B, -1)
        out[:, _DOFF:_DOFF + Df.shape[1]] = Df
    out[:, _HOFF] = huber_delta
    return out


class GpuEvaluator:
    """Evaluate ``f``, ``g``, ``H`` for a batch of alignments against one grid on the GPU.

    Parameters
    ----------
    model : Model
    grid : DistanceGrid (table on the GPU)
    points : list of (N_b, d) arrays (normalised frame; numpy or CuPy)
    params : PChAParams, optional
        The alignment's parameters (default ``PChAParams()``), of which the evaluator reads:
        ``outside`` ("clamp" | "drop"), ``loss`` ("l2" | "huber"), ``form`` ("fused": one kernel
        + final reduction, or "two_kernel": residual/Jacobian kernel, reduction kernel, final
        reduction), ``hessian`` ("reduced": sufficient statistics, additive models only, or
        "full") and ``lookup`` ("corners": nearest entry of the 2^d surrounding cells, or
        "cell": the paper's single-cell lookup).
    **overrides
        Any of those fields by keyword (``form="two_kernel"``), overriding ``params``.
    """

    def __init__(self, model: Model, grid, points, params: PChAParams | None = None, **overrides):
        import cupy as cp

        params = resolve_params(params, overrides, "GpuEvaluator")
        outside, loss, form, hessian, lookup = (params.outside, params.loss, params.form, params.hessian,
                                                params.lookup)

        self.cp = cp
        self.model = model
        self.form = form
        self.reduced = (hessian == "reduced") and not model.compositional and form == "fused"
        self.drop = outside == "drop"
        self.huber = loss == "huber"
        d = model.dim
        self.B = len(points)
        sizes = [int(p.shape[0]) for p in points]
        self.sizes = np.asarray(sizes)
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.ntot = int(offs[-1])
        self.pts = cp.concatenate([cp.asarray(p, dtype=cp.float32).reshape(-1, d) for p in points])
        self.offs = cp.asarray(offs)
        self.index = cp.ascontiguousarray(cp.asarray(grid.index, dtype=cp.int32))
        self.cent = cp.ascontiguousarray(cp.asarray(grid.centroids, dtype=cp.float32))
        shp = list(grid.shape) + [1] * (3 - d)
        org = list(np.asarray(grid.origin, np.float64)) + [0.0] * (3 - d)
        self.gargs = (np.int32(shp[0]), np.int32(shp[1]), np.int32(shp[2]),
                      np.float32(org[0]), np.float32(org[1]), np.float32(org[2]),
                      np.float32(1.0 / grid.cell))
        self.nv = n_values(model, self.reduced)
        nsm = _sm_count()
        maxn = max(sizes) if sizes else 1
        target = max(1, (nsm * 8) // max(1, self.B))
        self.nblk = int(max(1, min(-(-maxn // THREADS), target)))
        kw = dict(dim=d, npar=model.n_params, proj=model.compositional, drop=self.drop,
                  huber=self.huber, nv=self.nv, corners=lookup == "corners")
        self.mod = _module(reduced=self.reduced, need_gh=True, **kw)
        self.partial = cp.zeros(self.B * self.nblk * self.nv, cp.float32)
        self.out = cp.zeros((self.B, self.nv), cp.float64)
        self.buf = None
        if form == "two_kernel":
            nb = 3 + d + d * model.n_params
            self.buf = cp.empty(nb * self.ntot, cp.float32)
        self.k_fused = self.mod.get_function("pcha_fused")
        self.k_resjac = self.mod.get_function("pcha_resjac")
        self.k_reduce = self.mod.get_function("pcha_reduce")
        self.k_final = self.mod.get_function("pcha_final")
        # one pinned upload per iteration (params + active flag in the last float of each row)
        # and one pinned download of the reduced values
        self.h_params = _pinned((self.B, PSTRIDE), np.float32)
        self.h_params[:] = 0
        self.d_params = cp.zeros((self.B, PSTRIDE), cp.float32)
        self.h_out = _pinned((self.B, self.nv), np.float64)

    def upload(self, M, D, active: np.ndarray, huber_delta: np.ndarray) -> None:
        """Pack the parameter rows into pinned memory and copy them (asynchronously) up."""
        pack_params(self.model, M, D, huber_delta, out=self.h_params)
        self.h_params[:, -1] = 0.0
        self.h_params.view(np.int32)[:, -1] = np.asarray(active, np.int32)
        self.d_params.set(self.h_params)

    def launch(self) -> None:
        """The kernels of one evaluation (no transfers)."""
        P = self.d_params
        grid = (self.nblk, self.B)
        if self.form == "fused":
            self.k_fused(grid, (THREADS,), (self.pts, self.offs, self.index, self.cent, P,
                                            self.partial) + self.gargs)
        else:
            self.k_resjac(grid, (THREADS,), (self.pts, self.offs, self.index, self.cent, P,
                                             self.buf, np.int64(self.ntot)) + self.gargs)
            self.k_reduce(grid, (THREADS,), (self.buf, self.offs, P, self.partial,
                                             np.int64(self.ntot)))
        self.k_final((self.nv, self.B), (128,), (self.partial, self.out, np.int32(self.nblk)))

    def raw(self, M, D, active: np.ndarray, huber_delta: np.ndarray) -> np.ndarray:
        """Upload, launch, download: the reduced values ``(B, NV)`` (float64, host)."""
        self.upload(M, D, active, huber_delta)
        self.launch()
        self.out.get(out=self.h_out)
        return self.h_out

    def kernel_ms(self, params, repeat: int = 50) -> float:
        """Median device time (CUDA events) of the kernels of one evaluation at ``params``."""
        cp = self.cp
        M, D = host_terms(self.model, params)
        self.upload(M, D, np.ones(self.B, bool), np.ones(self.B))
        for _ in range(3):
            self.launch()
        ts = []
        for _ in range(repeat):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            self.launch()
            e1.record()
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1))
        return float(np.median(ts))

    def __call__(self, params, active, huber_delta):
        M, D = host_terms(self.model, params)
        vals = self.raw(M, D, active, huber_delta)
        return unpack(self.model, D, vals, self.reduced)


def unpack(model: Model, D, vals: np.ndarray, reduced: bool):
    """``(f, g, H, n_inside)`` from reduced values ``(B, NV)`` (``D``: derivative stacks)."""
    d, L = model.dim, model.n_params
    B = vals.shape[0]
    f = vals[:, 0].copy()
    nin = vals[:, 1].copy()
    if reduced:
        S = vals[:, 2:2 + d * (d + 1)].reshape(B, d, d + 1)
        Q = vals[:, 2 + d * (d + 1):][:, _sym_index(d + 1)]
        return f, contract_gradient(D, S), contract_hessian(D, Q), nin
    g = -2.0 * vals[:, 2:2 + L]
    H = vals[:, 2 + L:][:, _sym_index(L)]
    return f, g, H, nin


@functools.lru_cache(maxsize=None)
def _sym_index(n: int) -> np.ndarray:
    """``(n, n)`` positions into a packed upper triangle (row-major), symmetric."""
    iu = np.triu_indices(n)
    pos = np.empty((n, n), np.intp)
    pos[iu] = np.arange(len(iu[0]))
    pos[iu[1], iu[0]] = np.arange(len(iu[0]))
    return pos
