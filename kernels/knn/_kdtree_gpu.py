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

The CUDA source is ``cuda/kdtree.cu`` and ``cuda/kdtree_rounds.cu`` beside this module (package
data, read once with :mod:`importlib.resources` by :func:`_source`); its comments name the numba
twins of its functions as ``kdtree._name``: they live in :mod:`._kdtree_cpu`.
"""
from __future__ import annotations

import functools

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
MERGE_STREAMS = 5  # streams (slots and the list) a lane of banns_merge_warp takes (cuda/kdtree_rounds.cu)
BEAM_WARPS = 4  # queries (a warp each) per block of the beam (cuda/kdtree_rounds.cu's BEAM_WARPS)
# batched rounds: score leaves on tensor cores first, canonical distances only where needed.
# "half": over float16 rows (10M x 352 float16, one H200: 199k -> 513k queries/s at recall
# 0.956); float32 rows keep the canonical stream kernel, which was as fast or faster on PCL SHOT
# (1.15M rows, 20k queries: 0.73-0.87x at 64-128 leaves, 1.01-1.14x at 256-512). True: every
# row type; False: never. Over float16 rows only where k <= MMA_HALF_K: on PCL SHOT (1.15M rows,
# 10k queries, 64 leaves, the k = 16 list a graph walk starts from, one H100) the stream kernel
# scanned the half rows in 3.9 ms against the tensor cores' 7.9 (near-duplicates pass the bound).
MMA_FILTER = "half"
MMA_HALF_K = 8

#: the search and build kernels (CUDA source in ``cuda/kdtree.cu``, then the tensor-core and
#: batched rounds in ``cuda/kdtree_rounds.cu``, package data, read in this order as one source):
#: the marker line is replaced by the row type of :func:`bruteforce._half_rows`, and
#: :data:`bruteforce._CUDA_COMMON` (keys, canonical distance) goes first
_CU_FILES = (("cuda", "kdtree.cu"), ("cuda", "kdtree_rounds.cu"))
_HALF_ROWS_MARK = '// @@HALF_ROWS@@ (bruteforce._half_rows("PT_HALF", "PT", "ldp") goes here: float or half rows)'


@functools.lru_cache(maxsize=None)
def _source() -> str:
    """The kernels' CUDA source, read once from the package's ``cuda/*.cu`` (:data:`_CU_FILES`)."""
    from importlib.resources import files

    text = "".join(files(__package__).joinpath(*f).read_text(encoding="utf-8") for f in _CU_FILES)
    head, tail = text.split(_HALF_ROWS_MARK)
    return _CUDA_COMMON + head + _half_rows("PT_HALF", "PT", "ldp") + tail


@functools.lru_cache(maxsize=None)
def stream_fits(d: int) -> bool:
    """Whether the stream leaf kernel's queries (SQ rows of d floats) fit its shared memory."""
    return SQ * int(d) * 4 <= 40 * 1024


def mma_fits(tree, d: int, k: int) -> bool:
    """Whether P-BANNS's batched rounds score ``tree``'s leaves on tensor cores (the
    ``mma_*`` kernels): ``d`` a multiple of 16 whose half queries fit the shared memory,
    ``k <= 16``, at least one tile of rows, and :data:`MMA_FILTER` on for these rows (with
    ``"half"``: float16 rows and ``k <= MMA_HALF_K``)."""
    rows = MMA_FILTER is True or (MMA_FILTER == "half" and _is_half(tree) and int(k) <= MMA_HALF_K)
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


#: bytes a thread of the leaf stream kernel loads of a float16 row at once (8 or 16; 16 where the
#: row length divides by 8): its warp reads 32 rows a row apart, bound on L1's sector requests
STREAM_HALF_LOAD = 16


def _module(kp: int, half: bool = False, hcap: int = HCAP):
    """The search kernels for top-``kp`` lists over float32 rows, or float16 ones (``half``),
    with queues of ``hcap`` pending boxes: made once per process and device (a search's
    kernels are looked up, not their 60 kB source hashed again, at every call)."""
    import cupy as cp

    return _module_on(int(kp), bool(half), int(hcap), cp.cuda.runtime.getDevice(), int(STREAM_HALF_LOAD))


@functools.lru_cache(maxsize=None)
def _module_on(kp: int, half: bool, hcap: int, device: int, half_load: int):
    import cupy as cp

    opts = ("--std=c++14",) + (("-DPT_HALF",) if half else ()) + (("-DSTREAM_HALF16",) if half_load == 16 else ())
    src = _source().replace("__KP__", str(kp)).replace("#define HCAP 256", f"#define HCAP {int(hcap)}")
    return _Kernels(cp.RawModule(code=src, options=opts))


class _Kernels:
    """A compiled module whose functions are looked up once each (``get_function``)."""

    def __init__(self, module):
        self.module, self._fns = module, {}

    def get_function(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self.module.get_function(name)
        return fn


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
          descent="path", leaves_per_round=1, beam=False):
    """P-BANNS: rounds of descend -> bucket by leaf -> one block per leaf chunk -> advance.

    ``roots``: (T,) int32 roots of a packed forest (one queue per query over all trees);
    ``lim``: (M,) float32 per-query pruning limit (default +inf); ``descent``: kdtree.DESCENTS;
    ``leaves_per_round``: leaves a query takes per round (> 1: :func:`_banns_batched`, with the
    stream leaf kernel; the other kernels take one); ``beam``: the one round's leaves chosen by
    ``banns_beam`` (kdtree._uses_beam says when).
    """
    import cupy as cp

    m, d = queries.shape
    if roots is None:
        roots = cp.zeros(1, cp.int32)
    bounded = lim is not None  # without bounds every query has a root to search (no host sync to find them)
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
                              descent, hcap, bounded, beam)
    f_adv = mod.get_function("banns_advance")
    st = _BannsState(mod, tree, queries, k, roots, lim, hcap, bounded)
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
        pair, bleaf, first, cnt = _leaf_blocks(leaf_of, qb)
        e2 = E(); e2.record()
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

    def __init__(self, mod, tree, queries, k, roots, lim, hcap, bounded=True):
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
        # without bounds (lim +inf) every root is pushed: all queries stay, known without a host sync
        self.active = cp.nonzero(keep0)[0].astype(cp.int32) if bounded else cp.arange(m, dtype=cp.int32)

    def finish(self, tree, queries, k, budget, active, ev):
        """Decode the lists, redo exactly the still ``active`` queries (and, with an unlimited
        budget, those whose queue overflowed); (dist2, ids, stats), with the phase times of the
        rounds' events ``ev`` ((e0, .., e4, leaf blocks) per round; leaf blocks an int, or a
        device scalar read here). One host sync, at the end, where the budget is limited."""
        import cupy as cp

        E = cp.cuda.Event
        f0 = E(); f0.record()
        out_d, out_i = decode_keys(self.top)
        redo, n_ovf = active, None
        if budget == 0:  # an unlimited search redoes the queries whose queue overflowed: count them now
            n_ovf = int(self.OVF.sum())
            if n_ovf:
                redo = cp.unique(cp.concatenate([active, cp.nonzero(self.OVF)[0].astype(cp.int32)]))
        if int(redo.size):
            _exact_redo(tree, queries, redo, k, out_d, out_i)
        f1 = E(); f1.record()
        ovf = self.OVF.sum() if n_ovf is None else None
        blk = [nb for *_, nb in ev if not isinstance(nb, int)]
        blk = cp.stack(blk).sum() if blk else None
        cp.cuda.get_current_stream().synchronize()  # this search's stream: others may run beside it
        phase = np.zeros(4)
        leaf_blocks = sum(nb for *_, nb in ev if isinstance(nb, int)) + (0 if blk is None else int(blk))
        for e0, e1, e2, e3, e4, _ in ev:
            phase += [cp.cuda.get_elapsed_time(a, b) for a, b in ((e0, e1), (e1, e2), (e2, e3), (e3, e4))]
        return out_d, out_i, {"rounds": len(ev), "finished_by_bruteforce": int(active.size),
                              "heap_overflow": int(ovf) if n_ovf is None else n_ovf,
                              "leaf_blocks": leaf_blocks, "leaves_visited": cp.asnumpy(self.visits),
                              "ms_descend": round(float(phase[0]), 3), "ms_bucket": round(float(phase[1]), 3),
                              "ms_leaf_scan": round(float(phase[2]), 3), "ms_advance": round(float(phase[3]), 3),
                              "ms_finish": round(cp.cuda.get_elapsed_time(f0, f1), 3)}


SLOT_KEYS = 1 << 26  # slot keys of a batched round (512 MB): queries are taken L * k slot keys each


def _leaf_blocks(leaf_of, qb):
    """Bucket the pairs of ``leaf_of`` by leaf into blocks of at most ``qb``: (pair of each
    sorted position, block leaf, block first position, block count). Pairs without a leaf (-1)
    make blocks of leaf -1, which the leaf kernels skip (one leaf per query and round: no host
    sync to count them). The batched rounds bucket theirs on the device (:func:`_round_blocks`)."""
    import cupy as cp

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


def _leaf_count(tree) -> int:
    """Leaves of ``tree`` (over every tree of a forest), counted once and kept on it."""
    got = tree.__dict__.get("_n_leaves")
    if got is None or got[0] != tree.child.data.ptr:
        got = tree.__dict__["_n_leaves"] = (tree.child.data.ptr, int((tree.child == -1).sum()))
    return got[1]


def _round_blocks(mod, tree, leaf_of, qb):
    """A batched round's pairs bucketed by leaf, as :func:`_leaf_blocks` but with the pairs
    without a leaf left out and no host sync: a counting sort on the device (``bucket_*`` kernels), the
    blocks laid out over a bound of their count (pairs / ``qb`` + leaves; those past the last
    have leaf -1, which the leaf kernels skip). Returns (pair of each sorted position, block
    leaf, block first position, block count, the block count as a device scalar)."""
    import cupy as cp

    n = int(leaf_of.size)
    nnodes = int(tree.child.size)
    nb_max = min(_leaf_count(tree), n) + (n + qb - 1) // qb
    cnt = cp.zeros(nnodes, cp.int32)
    cursor = cp.zeros(nnodes, cp.int32)
    pair = cp.zeros(n, cp.int32)  # positions past the pairs that have a leaf stay 0: gathers through them stay in range
    scan = cp.empty(nnodes, cp.int64)
    bleaf = cp.full(nb_max, -1, cp.int32)
    first, bcnt = cp.empty(nb_max, cp.int32), cp.empty(nb_max, cp.int32)
    mod.get_function("bucket_count")(_grid(n), (256,), (leaf_of, np.int64(n), cnt))
    mod.get_function("bucket_pack")(_grid(nnodes), (256,), (cnt, np.int32(nnodes), np.int32(qb), scan))
    scan = cp.cumsum(scan)
    mod.get_function("bucket_scatter")(_grid(n), (256,), (leaf_of, np.int64(n), scan, cnt, cursor, pair))
    mod.get_function("bucket_blocks")(_grid(nnodes), (256,), (scan, cnt, np.int32(nnodes), np.int32(qb), bleaf,
                                                             first, bcnt))
    return pair, bleaf, first, bcnt, scan[-1] >> 32


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


def _banns_batched(tree, queries, k, budget, finish_below, roots, lim, mod, L, descent, hcap, bounded=True,
                   beam=False):
    """P-BANNS in batched rounds: each active query takes up to ``L`` leaves a round (pop ->
    descend, against the round's pruning distance: ``banns_collect``), every (query, leaf) pair
    is bucketed by leaf and a leaf is read once for all the queries of its bucket
    (``banns_leaf_stream_slots``: a pair's candidates go to its own slot), then each query's
    slots are merged into its list (``banns_merge_slots``). A budget of B leaves takes
    ceil(B / L) rounds instead of B, and a leaf gathers the queries of L rounds at once.
    Queries are taken ``SLOT_KEYS // (L * k)`` at a time (a query's answer does not depend on
    the others). ``beam``: the budget's leaves (one round) chosen by ``banns_beam``, a warp a
    query, instead of ``banns_collect``'s queue, a thread a query."""
    import cupy as cp

    m, d = queries.shape
    f_col = mod.get_function("banns_beam" if beam else "banns_collect")
    f_scan = mod.get_function("banns_leaf_stream_slots")
    warp_merge = k <= 32 and L + 1 <= 32 * MERGE_STREAMS  # a warp a query merges the slots
    f_merge = mod.get_function("banns_merge_warp" if warp_merge else "banns_merge_slots")
    mma = {} if mma_fits(tree, d, k) else None  # the same answer, rows scored on tensor cores first
    qb = MQ if mma is not None else SQ
    chunk = max(1, SLOT_KEYS // (L * k))
    if m > chunk:  # at most SLOT_KEYS slot keys at a time
        parts = [_banns_batched(tree, queries[a:a + chunk], k, budget, finish_below, roots, lim[a:a + chunk], mod,
                                L, descent, hcap, bounded, beam) for a in range(0, m, chunk)]
        stats = {key: sum(p[2][key] for p in parts) for key in parts[0][2] if key != "leaves_visited"}
        stats["rounds"] = max(p[2]["rounds"] for p in parts)
        stats["leaves_visited"] = np.concatenate([p[2]["leaves_visited"] for p in parts])
        return cp.concatenate([p[0] for p in parts]), cp.concatenate([p[1] for p in parts]), stats
    st = _BannsState(mod, tree, queries, k, roots, lim, hcap, bounded)
    active, na = st.active, int(st.active.size)
    ev = []
    E = cp.cuda.Event
    rounds = 0
    while na > finish_below:
        e0 = E(); e0.record()
        leaf_of = cp.empty(na * L, cp.int32)
        keep = cp.empty(na, cp.uint8)
        if beam:
            f_col(((na + BEAM_WARPS - 1) // BEAM_WARPS,), (32 * BEAM_WARPS,), (
                active, np.int32(na), np.int32(L), np.int32(budget), queries, np.int32(d), tree.child, tree.split_dim,
                tree.split_val, tree.lo, tree.hi, lim, st.target, st.TK, st.HD, st.HN, st.HS, st.visits, leaf_of,
                keep))
        else:
            f_col(_grid(na, 64), (64,), (active, np.int32(na), np.int32(L), queries, np.int32(d), tree.child,
                                         tree.split_dim, tree.split_val, tree.lo, tree.hi, np.int32(k), st.top,
                                         st.target, st.TK, lim, st.HD, st.HN, st.HS, st.OVF, st.visits,
                                         np.int32(budget), leaf_of, keep, np.int32(DESCENT_IDS[descent])))
        e1 = E(); e1.record()
        blocks = _round_blocks(mod, tree, leaf_of, qb)
        e2 = E(); e2.record()
        pair, bleaf, first, cnt, nb = blocks
        if mma is not None:
            _mma_round(mod, tree, queries, k, active, na, L, blocks[:4], st.top, mma)
        else:
            slots = cp.full((na * L, k), np.uint64(0xFFFFFFFFFFFFFFFF), cp.uint64)
            f_scan((int(bleaf.size),), (SP,), (bleaf, first, cnt, active[pair // L], queries, tree.points, tree.perm,
                                               tree.start, tree.end, np.int32(d), np.int32(k), slots, pair, st.top),
                   shared_mem=SQ * d * 4)
        e3 = E(); e3.record()
        if mma is None:  # a warp or a thread a query
            f_merge(_grid(32 * na if warp_merge else na, 128), (128,),
                    (active, np.int32(na), np.int32(L), np.int32(k), slots, st.top))
        rounds += 1
        if budget > 0 and rounds * L >= budget:  # every query has spent its budget (keep is all 0): no sync
            active, na = active[:0], 0
        else:
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
