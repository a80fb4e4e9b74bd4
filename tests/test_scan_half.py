"""``KDForest(scan_dtype="float16")``: leaves and graph rounds scored on the rows rounded to half,
each list re-ranked by its float32 distances. Checked against a reference built from its
definition (a float32 forest over the rounded rows, its wider list re-ranked in float32), the
float32 brute force, and across devices."""
from __future__ import annotations

import numpy as np
import pytest
from scanforest.kernels.errors import InputError
from scanforest.kernels.knn.bruteforce import knn_bruteforce, pair_distances
from scanforest.kernels.knn.kdforest import KDForest


def _clustered(rng, n, m, d, clusters=30, dup=False):
    c = rng.standard_normal((clusters, d)).astype(np.float32) * 3
    X = (c[rng.integers(0, clusters, n)] + rng.standard_normal((n, d))).astype(np.float32)
    if dup:  # exact copies: distance ties, broken by id
        X[: n // 4] = X[rng.integers(n // 4, n, n // 4)]
    Q = (c[rng.integers(0, clusters, m)] + rng.standard_normal((m, d))).astype(np.float32)
    return X, Q


def _reranked(X, Q, cand, k):
    """The definition: the candidates' float32 canonical distances, (distance, id) order, top k."""
    d = pair_distances(X, Q, cand)
    d = np.where(cand < 0, np.inf, d).astype(np.float32)
    out_d, out_i = np.empty((len(Q), k), np.float32), np.empty((len(Q), k), np.int64)
    for r in range(len(Q)):
        o = np.lexsort((cand[r], d[r]))[:k]
        out_d[r], out_i[r] = d[r, o], cand[r, o]
    return out_d, out_i


def _recall(d, ed, k):
    return float((np.asarray(d)[:, :k] <= np.asarray(ed)[:, k - 1:k]).sum() / d.shape[0] / k)


@pytest.mark.parametrize("dup", [False, True])
@pytest.mark.parametrize("trees", [1, 3])
def test_half_scan_is_the_rounded_search_reranked(rng, dup, trees):
    X, Q = _clustered(rng, 5000, 250, 24, dup=dup)
    k = 4
    f = KDForest(n_trees=trees, leaf_size=16, device="cpu", scan_dtype="float16").fit(X)
    ref = KDForest(n_trees=trees, leaf_size=16, device="cpu").fit(X)
    ref.tree_.points = ref.tree_.points.astype(np.float16).astype(np.float32)  # the same trees, rounded rows
    for b in (1, 3, 8):
        d, i = f.query(Q, k, backtracks=b)
        _, cand = ref.query(Q, 2 * k, backtracks=b)
        rd, ri = _reranked(X, Q, cand, k)
        np.testing.assert_array_equal(i, ri)
        np.testing.assert_array_equal(d, rd)
        assert f.stats_["scan_dtype"] == "float16"
    # unlimited: the float32 brute force, ids and distances
    ed, ei = knn_bruteforce(X, Q, k)
    ud, ui = f.query(Q, k, backtracks=None)
    np.testing.assert_array_equal(ui, ei)
    np.testing.assert_array_equal(ud, ed)


@pytest.mark.parametrize("dup", [False, True])
def test_half_scan_with_graph(rng, dup):
    X, Q = _clustered(rng, 6000, 300, 32, dup=dup)
    k = 4
    ed, ei = knn_bruteforce(X, Q, k)
    f = KDForest(n_trees=1, leaf_size=16, device="cpu", graph_degree=12, graph_budget=16, graph_expand=3,
                 graph_rounds=3, scan_dtype="float16").fit(X)
    full = KDForest(n_trees=1, leaf_size=16, device="cpu", graph_degree=12, graph_budget=16, graph_expand=3,
                    graph_rounds=3).fit(X)
    # the graph is built over the float32 rows: the same graph as the float32 forest's
    np.testing.assert_array_equal(f.graph_, full.graph_)
    # reference: the float32 forest with its leaf rows and graph rows rounded, its 9-entry list re-ranked
    full.tree_.points = full.tree_.points.astype(np.float16).astype(np.float32)
    full._fit_X = X.astype(np.float16).astype(np.float32)
    for b in (1, 4):
        d, i = f.query(Q, k, backtracks=b)
        _, cand = full.query(Q, 9, backtracks=b)
        rd, ri = _reranked(X, Q, cand, k)
        np.testing.assert_array_equal(i, ri)
        np.testing.assert_array_equal(d, rd)
        np.testing.assert_array_equal(d, pair_distances(X, Q, i))  # float32 canonical distances
    ud, ui = f.query(Q, k, backtracks=None)
    np.testing.assert_array_equal(ui, ei)
    np.testing.assert_array_equal(ud, ed)
    # recall= calibrates through the half scan and its re-rank
    d, _ = f.query(Q, k, recall=0.9)
    assert f.calibration_["recall"] >= 0.9
    assert _recall(d, ed, k) > 0.75  # held-out queries: below the leave-one-out estimate on duplicates


def test_half_scan_bounds_apply_after_the_rerank(rng):
    X, Q = _clustered(rng, 4000, 200, 16)
    k = 4
    f = KDForest(n_trees=2, leaf_size=16, device="cpu", scan_dtype="float16").fit(X)
    d0, i0 = f.query(Q, k, backtracks=4)
    bound = d0[:, 1].copy()  # strictly closer than each query's second: one row left (ties aside)
    d, i = f.query(Q, k, backtracks=4, bounds=bound)
    keep = d0 < bound[:, None]
    np.testing.assert_array_equal(np.where(keep, i0, -1), i)
    np.testing.assert_array_equal(np.where(keep, d0, np.inf), d)


def test_half_scan_refusals(rng):
    X, Q = _clustered(rng, 500, 10, 8)
    with pytest.raises(InputError, match="scan_dtype must be one of"):
        KDForest(scan_dtype="int8", device="cpu").fit(X)
    big = X.copy()
    big[7, 3] = 1e5
    with pytest.raises(InputError, match="half's range"):
        KDForest(scan_dtype="float16", device="cpu").fit(big)
    with pytest.raises(InputError, match="keep_rows=True"):
        KDForest(scan_dtype="float16", device="cpu").fit(X, keep_rows=False)
    f = KDForest(scan_dtype="float16", device="cpu").fit(X)
    with pytest.raises(InputError, match="leaf-order-only"):
        f.to_leaf_order()
    # the exact method has nothing to scan: the parameter is accepted and changes nothing
    e = KDForest(method="exact", scan_dtype="float16", device="cpu").fit(X)
    np.testing.assert_array_equal(e.query(Q, 3)[1], knn_bruteforce(X, Q, 3)[1])
    assert KDForest(scan_dtype="float16").get_params()["scan_dtype"] == "float16"


@pytest.mark.gpu
@pytest.mark.parametrize("dup", [False, True])
def test_gpu_half_scan_equals_the_cpu(rng, dup):
    """GPU and CPU build the same trees; the GPU keeps the leaf rows in half and widens them
    exactly (the stream and tensor-core scans, the graph walk), the CPU keeps the same values
    in float32: the answers are equal bit for bit, with the same graph."""
    import cupy as cp

    X, Q = _clustered(rng, 20000, 1000, 64, dup=dup)
    k = 4
    kw = dict(n_trees=1, leaf_size=32, scan_dtype="float16", descent="beam")  # "auto" differs per device
    g = KDForest(device="gpu", **kw).fit(cp.asarray(X))
    c = KDForest(device="cpu", **kw).fit(X)
    assert g.tree_.points.dtype == cp.float16
    for b, kq in ((1, k), (4, k), (16, k), (4, 12)):  # k 12: the stream kernel (k <= 8: tensor cores)
        gd, gi = g.query(cp.asarray(Q), kq, backtracks=b)
        cd, ci = c.query(Q, kq, backtracks=b)
        np.testing.assert_array_equal(gi.get(), ci)
        np.testing.assert_array_equal(gd.get(), cd)
    gg = KDForest(device="gpu", graph_degree=16, graph_budget=32, graph_expand=4, graph_rounds=3, **kw).fit(
        cp.asarray(X))
    cg = KDForest(device="cpu", graph_degree=16, graph_budget=32, graph_expand=4, graph_rounds=3, **kw).fit(X)
    cg.graph_ = gg.graph_.get()  # the GPU's graph on both (each device builds its own)
    for b in (1, 4):
        gd, gi = gg.query(cp.asarray(Q), k, backtracks=b)
        cd, ci = cg.query(Q, k, backtracks=b)
        np.testing.assert_array_equal(gi.get(), ci)
        np.testing.assert_array_equal(gd.get(), cd)
        np.testing.assert_array_equal(gd.get(), pair_distances(X, Q, ci))
    ed, ei = knn_bruteforce(X, Q, k)
    ud, ui = gg.query(cp.asarray(Q), k, backtracks=None)
    np.testing.assert_array_equal(ui.get(), ei)
    np.testing.assert_array_equal(ud.get(), ed)


@pytest.mark.gpu
def test_gpu_half_rows_kernels_equal_the_widened_float32_rows(rng):
    """The graph kernels over float16 rows score exactly what they score over the same values
    in float32."""
    import cupy as cp
    from scanforest.kernels.knn import _graph_gpu
    from scanforest.kernels.knn.topk import pack

    X, Q = _clustered(rng, 3000, 200, 40, dup=True)
    Xh = cp.asarray(X.astype(np.float16))
    Xw = Xh.astype(cp.float32)
    Qd = cp.asarray(Q)
    cand = cp.asarray(rng.integers(-1, 3000, (200, 37)))
    np.testing.assert_array_equal(_graph_gpu.pair_keys(Xh, Qd, cand).get(), _graph_gpu.pair_keys(Xw, Qd, cand).get())
    G = cp.asarray(rng.integers(-1, 3000, (3000, 24)).astype(np.int32))
    ids = cp.asarray(np.stack([rng.choice(3000, 12, replace=False) for _ in range(200)]))
    d = pair_distances(X.astype(np.float16).astype(np.float32), Q, ids.get())
    o = np.lexsort((ids.get(), d), axis=1)
    keys = pack(cp.asarray(np.take_along_axis(d, o, 1)), cp.asarray(np.take_along_axis(ids.get(), o, 1)))
    np.testing.assert_array_equal(_graph_gpu.walk(Xh, Qd, G, keys, 3, 4).get(),
                                  _graph_gpu.walk(Xw, Qd, G, keys, 3, 4).get())


def test_scan_dtype_changes_after_fit(rng):
    """``set_params(scan_dtype=...)`` after ``fit``: the same answers as a forest fitted with it,
    and back to float32 the float32 forest's answers."""
    X, Q = _clustered(rng, 3000, 100, 16)
    f = KDForest(n_trees=2, leaf_size=16, device="cpu", graph_degree=8, graph_budget=8).fit(X)
    h = KDForest(n_trees=2, leaf_size=16, device="cpu", graph_degree=8, graph_budget=8, scan_dtype="float16").fit(X)
    d32, i32 = f.query(Q, 3, backtracks=3)
    f.set_params(scan_dtype="float16")
    d, i = f.query(Q, 3, backtracks=3)
    np.testing.assert_array_equal(i, h.query(Q, 3, backtracks=3)[1])
    assert f.stats_["scan_dtype"] == "float16"
    f.set_params(scan_dtype="float32")
    np.testing.assert_array_equal(f.query(Q, 3, backtracks=3)[1], i32)
    np.testing.assert_array_equal(f.query(Q, 3, backtracks=3)[0], d32)


@pytest.mark.gpu
@pytest.mark.parametrize("half", [False, True])
def test_gpu_walk_scores_a_repeated_graph_id_once(rng, half):
    """A graph row holding an id twice (a graph not built by the forest) walks as the row with
    the repeats removed: the same lists bit for bit, ascending and distinct (two lanes entering
    the same key used to leave a slot of the next list unwritten)."""
    import cupy as cp
    from scanforest.kernels.knn import _graph_gpu
    from scanforest.kernels.knn.topk import pack

    X, Q = _clustered(rng, 4000, 300, 40, dup=True)
    G = rng.integers(0, 4000, (4000, 40)).astype(np.int32)
    G[:, 20:30] = G[:, 5:15]  # repeats within a 32-wide slice and across slices
    G[:, 35:40] = G[:, 0:5]
    dedup = G.copy()
    for r in dedup:
        _, first = np.unique(r, return_index=True)
        keep = np.zeros(len(r), bool)
        keep[first] = True
        r[~keep] = -1
    ids = np.stack([rng.choice(4000, 16, replace=False) for _ in range(300)])
    rows = X.astype(np.float16) if half else X
    dd = pair_distances(rows.astype(np.float32), Q, ids)
    o = np.lexsort((ids, dd), axis=1)
    keys = pack(cp.asarray(np.take_along_axis(dd, o, 1)), cp.asarray(np.take_along_axis(ids, o, 1)))
    a = _graph_gpu.walk(cp.asarray(rows), cp.asarray(Q), cp.asarray(G), keys, 4, 4).get()
    b = _graph_gpu.walk(cp.asarray(rows), cp.asarray(Q), cp.asarray(dedup), keys, 4, 4).get()
    np.testing.assert_array_equal(a, b)
    for r in a:  # ascending and distinct, the empty slots last
        v = r[r != _graph_gpu.NONE_KEY]
        assert (v[1:] > v[:-1]).all() and (r[len(v):] == _graph_gpu.NONE_KEY).all()
