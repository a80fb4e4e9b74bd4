"""The KD-forest with a neighbour graph (``KDForest(graph_degree=...)``): the forest's answer at a
budget, widened by the graph neighbours of its first entries, against the float32 brute force."""
from __future__ import annotations

import numpy as np
import pytest
from scanforest.kernels.errors import InputError
from scanforest.kernels.knn.bruteforce import knn_bruteforce, pair_distances
from scanforest.kernels.knn.kdforest import KDForest


def _clustered(rng, n, m, d, clusters=40, dup=False):
    """Points around cluster centres (queries from the same clusters); ``dup``: a third of the
    rows exact copies of others (SHOT's near-duplicates, distance ties)."""
    c = rng.standard_normal((clusters, d)).astype(np.float32) * 4
    X = (c[rng.integers(0, clusters, n)] + rng.standard_normal((n, d))).astype(np.float32)
    if dup:
        X[: n // 3] = X[rng.integers(n // 3, n, n // 3)]
    Q = (c[rng.integers(0, clusters, m)] + rng.standard_normal((m, d))).astype(np.float32)
    return X, Q


def _recall(d, ed, k):
    """Canonical recall@k: a returned distance counts when it is <= the exact k-th (ties count)."""
    return float((np.asarray(d)[:, :k] <= np.asarray(ed)[:, k - 1:k]).sum() / d.shape[0] / k)


def _rows_unique(ids):
    for r in np.asarray(ids):
        r = r[r >= 0]
        assert len(np.unique(r)) == len(r), f"duplicate id in a row: {r}"


@pytest.mark.parametrize("dup", [False, True])
def test_graph_search_is_canonical_and_finds_more(rng, dup):
    X, Q = _clustered(rng, 6000, 300, 24, dup=dup)
    k = 4
    ed, ei = knn_bruteforce(X, Q, k)
    plain = KDForest(n_trees=1, leaf_size=16, device="cpu").fit(X)
    g = KDForest(n_trees=1, leaf_size=16, device="cpu", graph_degree=16, graph_budget=32, graph_expand=8,
                 graph_rounds=1).fit(X)
    assert g.graph_.shape == (6000, 16) and g.graph_.dtype == np.int32
    assert g.graph_stats_["degree"] == 16 and g.graph_stats_["seconds"] > 0
    for b in (1, 4):
        pd, _ = plain.query(Q, k, backtracks=b)
        gd, gi = g.query(Q, k, backtracks=b)
        assert g.stats_["graph_rows_scored"] == 300 * 8 * 16
        _rows_unique(gi)
        # every distance is the brute force's own for that pair, bit for bit, and ascending
        np.testing.assert_array_equal(gd, pair_distances(X, Q, gi))
        assert (np.diff(gd, axis=1) >= 0).all()
        # the graph only adds candidates: never a worse k-th than the forest alone, and more found
        assert (gd[:, -1] <= pd[:, -1]).all()
        assert _recall(gd, ed, k) > _recall(pd, ed, k)
    # rounds 0: the graph is kept, the search is the forest's
    g.set_params(graph_rounds=0)
    np.testing.assert_array_equal(g.query(Q, k, backtracks=2)[1], plain.query(Q, k, backtracks=2)[1])
    # an unlimited budget is the brute force (ids and distances)
    g.set_params(graph_rounds=2)
    ud, ui = g.query(Q, k, backtracks=None)
    np.testing.assert_array_equal(ui, ei)
    np.testing.assert_array_equal(ud, ed)


def test_exact_graph_holds_each_rows_nearest_others(rng):
    X = rng.standard_normal((1500, 8)).astype(np.float32)
    g = KDForest(n_trees=1, leaf_size=16, device="cpu", graph_degree=6, graph_budget=None).fit(X)
    _, ei = knn_bruteforce(X, X, 7)
    for r in range(1500):
        want = [i for i in ei[r] if i != r][:6]
        assert g.graph_[r].tolist() == want


def test_graph_search_respects_bounds(rng):
    X, Q = _clustered(rng, 4000, 200, 16)
    g = KDForest(n_trees=1, leaf_size=16, device="cpu", graph_degree=8, graph_expand=4).fit(X)
    d0, _ = g.query(Q, 4, backtracks=2)
    bound = d0[:, 1].copy()  # only points strictly closer than the second one found may come back
    d, i = g.query(Q, 4, backtracks=2, bounds=bound)
    fin = np.isfinite(d)
    assert (d[fin] < np.repeat(bound[:, None], 4, axis=1)[fin]).all()
    assert (i[~fin] == -1).all()
    _rows_unique(i)


def test_graph_with_recall_target(rng):
    X, Q = _clustered(rng, 5000, 300, 16)
    g = KDForest(n_trees=1, leaf_size=16, device="cpu", graph_degree=12).fit(X, recall=0.9)
    d, _ = g.query(Q, 4)
    ed, _ = knn_bruteforce(X, Q, 4)
    assert g.calibration_["recall"] >= 0.9
    assert _recall(d, ed, 4) >= 0.85


@pytest.mark.parametrize("field,value", [("graph_degree", 0), ("graph_degree", 1.5), ("graph_expand", 0),
                                         ("graph_rounds", -1), ("graph_budget", 0), ("graph_degree", True)])
def test_graph_parameters_checked(rng, field, value):
    X = rng.standard_normal((100, 4)).astype(np.float32)
    with pytest.raises(InputError, match=field):
        KDForest(device="cpu", **{"graph_degree": 4, field: value}).fit(X)


def test_graph_on_tiny_and_exact_indexes(rng):
    X = rng.standard_normal((3, 4)).astype(np.float32)
    g = KDForest(device="cpu", graph_degree=8).fit(X)  # degree capped at N - 1
    assert g.graph_.shape == (3, 2)
    _, i = g.query(X, 3, backtracks=1)
    np.testing.assert_array_equal(np.sort(i, axis=1), np.tile(np.arange(3), (3, 1)))
    assert KDForest(device="cpu", method="exact", graph_degree=8).fit(X).graph_ is None
    with pytest.raises(InputError, match="keep_rows"):
        KDForest(device="cpu", graph_degree=2).fit(X, keep_rows=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dup", [False, True])
def test_gpu_graph_search(rng, dup):
    import cupy as cp

    X, Q = _clustered(rng, 20000, 1000, 64, dup=dup)
    k = 4
    ed, ei = knn_bruteforce(X, Q, k)
    plain = KDForest(n_trees=1, leaf_size=32, device="gpu").fit(cp.asarray(X))
    g = KDForest(n_trees=1, leaf_size=32, device="gpu", graph_degree=16, graph_budget=32).fit(cp.asarray(X))
    c = KDForest(n_trees=1, leaf_size=32, device="cpu", graph_degree=16, graph_budget=32).fit(X)
    for b in (1, 4):
        pd, _ = plain.query(cp.asarray(Q), k, backtracks=b)
        gd, gi = g.query(cp.asarray(Q), k, backtracks=b)
        gd, gi, pd = gd.get(), gi.get(), pd.get()
        _rows_unique(gi)
        np.testing.assert_array_equal(gd, pair_distances(X, Q, gi))
        assert (gd[:, -1] <= pd[:, -1]).all()
        assert _recall(gd, ed, k) > _recall(pd, ed, k)
        cd, _ = c.query(Q, k, backtracks=b)
        assert abs(_recall(gd, ed, k) - _recall(cd, ed, k)) < 0.03
    ud, ui = g.query(cp.asarray(Q), k, backtracks=None)
    np.testing.assert_array_equal(ui.get(), ei)
    np.testing.assert_array_equal(ud.get(), ed)


@pytest.mark.gpu
@pytest.mark.parametrize("kk,c", [(5, 40), (32, 100), (32, 1024), (64, 2048)])
def test_gpu_merge_is_the_sorted_merge(rng, kk, c):
    """The warp merge against the plain definition (the ``kk`` smallest distinct keys of the list
    and the candidates), also for candidate lists wider than one pass of the kernel (merged in
    slices), with keys repeated within and across slices and empty slots."""
    import cupy as cp

    from scanforest.kernels.knn import _graph_gpu

    m = 300
    old = np.stack([np.sort(rng.choice(50_000, size=kk, replace=False)) + 1 for _ in range(m)]).astype(np.uint64)
    old[::5, -2:] = _graph_gpu.NONE_KEY  # lists with empty slots (the largest key: still ascending)
    add = rng.integers(1, 60_000, size=(m, c)).astype(np.uint64)
    add[:, ::7] = old[:, :1]  # the list's own keys again
    add[:, 1::11] = _graph_gpu.NONE_KEY
    got = _graph_gpu.merge(cp.asarray(old), cp.asarray(add), kk).get()
    for r in range(m):
        want = np.unique(np.concatenate([old[r], add[r]]))
        want = want[want != _graph_gpu.NONE_KEY][:kk]
        want = np.pad(want, (0, kk - len(want)), constant_values=_graph_gpu.NONE_KEY)
        np.testing.assert_array_equal(got[r], want)


@pytest.mark.gpu
def test_gpu_wide_expansion_matches_the_generic_round(rng):
    """A round whose candidates (expand 32 x degree 32 = 1,024 a query) pass the merge's width:
    the kernels' answer equals the generic scoring and sorted merge's, bit for bit."""
    import cupy as cp

    from scanforest.kernels.knn.kdforest import merge_topk_unique

    X, Q = _clustered(rng, 20000, 500, 32, dup=True)
    g = KDForest(n_trees=1, leaf_size=32, device="gpu", graph_degree=32, graph_budget=16).fit(cp.asarray(X))
    Qd = cp.asarray(Q)
    e = kk = 32
    d, i = g._forest_search(Qd, kk, 4)[:2]
    got_d, got_i = g._expand(Qd, d, i, e, kk)
    cand = g.graph_[cp.maximum(i[:, :e], 0)].astype(cp.int64).reshape(len(Q), -1)
    cand = cp.where(cp.repeat(i[:, :e] < 0, 32, axis=1), -1, cand)
    want_d, want_i = merge_topk_unique([(d, i), (pair_distances(g._fit_X, Qd, cand, device="gpu"), cand)], kk)
    np.testing.assert_array_equal(got_i.get(), cp.asnumpy(want_i))
    np.testing.assert_array_equal(got_d.get(), cp.asnumpy(want_d))


@pytest.mark.parametrize("dup", [False, True])
def test_cpu_graph_round_is_the_sorted_merge(rng, dup):
    """The numba round (a row once, the list kept by insertion) against the plain definition: the
    ``kk`` smallest distinct (distance, id) pairs of the list and every candidate, by sorting."""
    from scanforest.kernels.knn.kdforest import merge_topk_unique

    X, Q = _clustered(rng, 3000, 200, 12, dup=dup)
    g = KDForest(n_trees=2, leaf_size=8, device="cpu", graph_degree=10, graph_budget=4).fit(X)
    for e, kk in ((3, 5), (6, 6), (4, 9)):
        d, i = g._forest_search(Q, kk, 2)[:2]
        got_d, got_i = g._expand(Q, d, i, e, kk)
        cand = g.graph_[np.maximum(i[:, :e], 0)].astype(np.int64).reshape(len(Q), -1)
        cand[np.repeat(i[:, :e] < 0, 10, axis=1)] = -1
        want_d, want_i = merge_topk_unique([(d, i), (pair_distances(X, Q, cand), cand)], kk)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_array_equal(got_d, want_d)


def test_bench_tools_graph_rows(tmp_path):
    """``bench tools --graph``: the graph forest's build (with the graph's own seconds and bytes),
    a curve per expansion width whose recall is measured like every tool's, and its points on
    scanforest's side of the matched-recall rows."""
    from scanforest.deploy.bench import tools as bench_tools

    rep = bench_tools.run(3000, 150, 16, 4, device="cpu", trees=1, leaf_size=16, budgets=[1], nprobes=[],
                          ef_search=[], threads=2, clusters=30, repeat=1, targets=[0.5], graph=8,
                          graph_expands=[2, 4], graph_rounds=[1, 2], graph_leaves=[1, 2], graph_budget=8,
                          out=tmp_path / "t.json")
    rows = {r.figure: r for r in rep.rows}
    build = next(r for f, r in rows.items() if f.startswith("scanforest KDForest + graph build"))
    assert build.extra["graph_bytes"] == 3000 * 8 * 4 and build.extra["graph_s"] > 0
    plain = rows["scanforest KDForest recall@4, 1 trees, 1 leaves"].value
    for e in (2, 4):
        r1 = rows[f"scanforest KDForest + graph (expand {e} x 1) recall@4, 1 trees, 1 leaves"].value
        q = rows[f"scanforest KDForest + graph (expand {e} x 1) banns queries/s, 1 trees, 1 leaves"]
        assert q.extra["recall"] == r1 and r1 > plain
        assert rows[f"scanforest KDForest + graph (expand {e} x 2) recall@4, 1 trees, 1 leaves"].value > r1
    assert rep.params["graph"] == {"degree": 8, "expand": [2, 4], "rounds": [1, 2], "budget": 8, "leaves": [1, 2],
                                   "scans": ["float32"]}
    # --graph-scan float32,float16: a half-scan curve beside each, its recall measured the same way
    rep = bench_tools.run(3000, 150, 16, 4, device="cpu", trees=1, leaf_size=16, budgets=[1], nprobes=[],
                          ef_search=[], threads=2, clusters=30, repeat=1, targets=[0.5], graph=8,
                          graph_expands=[4], graph_rounds=[2], graph_leaves=[1], graph_budget=8,
                          graph_scans=("float32", "float16"), out=tmp_path / "h.json")
    rows = {r.figure: r for r in rep.rows}
    full = rows["scanforest KDForest + graph (expand 4 x 2) recall@4, 1 trees, 1 leaves"].value
    half = rows["scanforest KDForest + graph (expand 4 x 2, half scan) recall@4, 1 trees, 1 leaves"].value
    assert abs(full - half) < 0.05 and half > plain
    with pytest.raises(InputError, match="--graph-scan takes"):
        bench_tools._scan_dtypes("float32,int8")
    for bad, match in ((dict(graph=300), "--graph must"), (dict(graph=8, graph_expands=[0]), "--graph-expand"),
                       (dict(graph=8, graph_rounds=[-1]), "--graph-rounds"), (dict(graph=8, graph_rounds=[]), "rounds"),
                       (dict(graph=8, graph_leaves=[0]), "--graph-leaves"),
                       (dict(cagra_degree=[32, 0]), "--cagra-degree"), (dict(cagra_degree=[]), "--cagra-degree"),
                       (dict(itopk=[32, -1]), "--itopk")):
        with pytest.raises(InputError, match=match):  # before anything is measured
            bench_tools.run(100, 10, 4, 2, device="cpu", out=tmp_path / "bad.json", **bad)


def _two_rounds_by_definition(X, Q, G, d, i, e, kk):
    """Two graph rounds by their definition: round 1 expands each list's first ``e`` entries,
    round 2 the first ``e`` entries of the merged list that round 1 did not expand; each merge
    the ``kk`` smallest distinct (distance, id) pairs, by sorting."""
    from scanforest.kernels.knn.kdforest import merge_topk_unique

    deg = G.shape[1]
    seen = [set() for _ in range(len(Q))]
    for _ in range(2):
        seeds = np.full((len(Q), e), -1, np.int64)
        for r in range(len(Q)):
            fresh = [s for s in i[r] if s >= 0 and s not in seen[r]][:e]
            seeds[r, :len(fresh)] = fresh
            seen[r].update(fresh)
        cand = G[np.maximum(seeds, 0)].astype(np.int64).reshape(len(Q), -1)
        cand[np.repeat(seeds < 0, deg, axis=1)] = -1
        d, i = merge_topk_unique([(d, i), (pair_distances(X, Q, cand), cand)], kk)
    return d, i


@pytest.mark.parametrize("dup", [False, True])
def test_later_rounds_expand_entries_not_expanded_before(rng, dup):
    """A second round walks on: it expands the list's first entries that the first round did
    not (the greedy walk of a graph search), never the same ones again; and it finds more."""
    X, Q = _clustered(rng, 4000, 200, 12, dup=dup)
    g = KDForest(n_trees=1, leaf_size=8, device="cpu", graph_degree=10, graph_budget=4, graph_expand=4,
                 graph_rounds=2).fit(X)
    e, kk = 4, 8  # the list holds graph_expand x graph_rounds entries
    d, i = g._forest_search(Q, kk, 2)[:2]
    want_d, want_i = _two_rounds_by_definition(X, Q, g.graph_, d, i, e, kk)
    got_d, got_i = g.query(Q, kk, backtracks=2)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_d, want_d)
    ed, _ = knn_bruteforce(X, Q, 4)
    one = g.set_params(graph_rounds=1).query(Q, 4, backtracks=2)[0]
    two = g.set_params(graph_rounds=2).query(Q, 4, backtracks=2)[0]
    assert _recall(two, ed, 4) > _recall(one, ed, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dup", [False, True])
def test_gpu_rounds_equal_the_definition(rng, dup):
    """The GPU rounds (kernels, the entries not yet expanded chosen on the device) from the same
    list and graph as the definition: the same ids and distances, bit for bit."""
    import cupy as cp

    X, Q = _clustered(rng, 20000, 500, 32, dup=dup)
    c = KDForest(n_trees=1, leaf_size=32, device="cpu", graph_degree=16, graph_budget=8).fit(X)
    g = KDForest(n_trees=1, leaf_size=32, device="gpu", graph_degree=16, graph_budget=8, graph_expand=8,
                 graph_rounds=2).fit(cp.asarray(X))
    g.graph_ = cp.asarray(c.graph_)
    e, kk = 8, 16
    d, i = c._forest_search(Q, kk, 2)[:2]
    want_d, want_i = _two_rounds_by_definition(X, Q, c.graph_, d, i, e, kk)
    Qd, dd, ii = cp.asarray(Q), cp.asarray(d), cp.asarray(i)
    got_d, got_i = g._rounds(Qd, dd, ii, e, 2, kk)  # the walk kernel
    np.testing.assert_array_equal(got_i.get(), want_i)
    np.testing.assert_array_equal(got_d.get(), want_d)
    done = cp.full((len(Q), 2 * e), -1, cp.int64)  # round by round (the bounds' path)
    for r in range(2):
        dd, ii = g._expand(Qd, dd, ii, e, kk, done=done, r=r)
    np.testing.assert_array_equal(ii.get(), want_i)
    np.testing.assert_array_equal(dd.get(), want_d)


@pytest.mark.gpu
def test_gpu_walk_leave_one_out_and_wide_lists(rng):
    """The walk kernel with an excluded row per query (a calibration's leave-one-out: never a
    seed) and with lists wider than a warp (kk 80, 3 rounds of 24 and a 40-neighbour graph),
    against the round-by-round path."""
    import cupy as cp

    X, Q = _clustered(rng, 8000, 300, 20, dup=True)
    g = KDForest(n_trees=1, leaf_size=16, device="gpu", graph_degree=40, graph_budget=8).fit(cp.asarray(X))
    Xd = cp.asarray(X)
    for e, rounds, kk, excl in ((8, 2, 17, True), (24, 3, 80, False)):
        Qd = Xd[:300] if excl else cp.asarray(Q)
        own = cp.arange(300, dtype=cp.int64) if excl else None
        d, i = g._forest_search(Qd, kk, 2)[:2]
        got_d, got_i = g._rounds(Qd, d, i, e, rounds, kk, exclude=own)
        done = cp.full((300, e * rounds), -1, cp.int64)
        for r in range(rounds):
            d, i = g._expand(Qd, d, i, e, kk, exclude=own, done=done, r=r)
        np.testing.assert_array_equal(got_i.get(), i.get())
        np.testing.assert_array_equal(got_d.get(), d.get())



@pytest.mark.gpu
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("d", [20, 37, 100, 352])
def test_gpu_walk_row_loads_of_every_width(rng, half, d):
    """The walk loading 1, 2 or 4 values of a row a lane (``vec``; float32 rows 1 or 2) gives the
    same lists bit for bit, every distance the pair's canonical one (the sums stay in dimension
    order); slices a width leaves partial (d 100, 352) and a length it does not divide (d 37:
    one value a lane) included."""
    import cupy as cp
    from scanforest.kernels.knn import _graph_gpu
    from scanforest.kernels.knn.topk import unpack

    X, Q = _clustered(rng, 6000, 400, d, dup=True)
    Xd = cp.asarray(X).astype(cp.float16) if half else cp.asarray(X)
    G = cp.asarray(rng.integers(-1, 6000, (6000, 24)), dtype=cp.int32)
    Qd = cp.asarray(Q)
    kk = 16
    seeds = cp.asarray(np.stack([rng.choice(6000, kk, replace=False) for _ in range(400)]), dtype=cp.int64)
    keys = cp.sort(_graph_gpu.pair_keys(Xd, Qd, seeds), axis=1)
    want = _graph_gpu.walk(Xd, Qd, G, keys, 4, 3, vec=1)
    assert not bool(cp.all(want == keys)), "the walk changed nothing: the test tests nothing"
    for vec in ((1, 2, 4) if half else (1, 2)):
        got = _graph_gpu.walk(Xd, Qd, G, keys, 4, 3, vec=vec)
        np.testing.assert_array_equal(got.get(), want.get(), err_msg=f"vec {vec}")
    # rows that start one value past an aligned address (a view into a larger buffer): one value a lane
    flat = cp.zeros(Xd.size + 1, Xd.dtype)
    flat[1:] = Xd.ravel()
    shifted = flat[1:].reshape(Xd.shape)
    np.testing.assert_array_equal(_graph_gpu.walk(shifted, Qd, G, keys, 4, 3, vec=2).get(), want.get())
    dist, ids = unpack(want)
    live = ids >= 0
    again = _graph_gpu.pair_keys(Xd, Qd, cp.where(live, ids, -1))
    np.testing.assert_array_equal(cp.where(live, again, want).get(), want.get())

def _stored_graph_check(tmp_path, rng, device, xp):
    """An index stored with a graph (``build_index(params={"graph_degree": ...})``, what ``index
    build --graph`` runs): each shard keeps its graph over its leaf-ordered rows, and a loaded
    shard walks it to the answer of the same forest and graph fitted in memory; without the graph
    the same budget finds less."""
    from scanforest.tasks import index as idx

    X, Q = _clustered(rng, 6000, 300, 24)
    k, store = 4, str(tmp_path / "g.zarr")
    params = {"leaf_size": 16, "graph_degree": 12, "graph_budget": 32, "graph_expand": 4, "graph_rounds": 2}
    res = idx.build_index(store, "g", X, shards=2, params=params, device=device)
    plain = idx.build_index(store, "p", X, shards=2, params={"leaf_size": 16}, device=device)
    assert res["status"] == plain["status"] == "built" and res["content_hash"] != plain["content_hash"]
    ed, _ = knn_bruteforce(X, Q, k)
    got, base = [], []
    for s, (a, b) in enumerate([(0, 3000), (3000, 6000)]):
        shard = idx.load_shard(store, "g", s, device)
        f = shard.forest
        assert f.graph_stats_["stored"] and f.graph_.shape == (b - a, 12) and f._fit_X is None
        mem = idx._fit_forest(xp.asarray(X[a:b]), dict(params, split="variance"), s, device)
        assert mem.graph_ is not None
        np.testing.assert_array_equal(_np(f.graph_), _np(mem.graph_in_leaf_order()))
        sd, si = f.query(xp.asarray(Q), k, backtracks=2)
        md, mi = mem.query(xp.asarray(Q), k, backtracks=2)
        np.testing.assert_array_equal(_np(si), _np(mi))  # random rows: no distance ties
        np.testing.assert_array_equal(_np(sd), _np(md))
        np.testing.assert_array_equal(_np(sd), pair_distances(X[a:b], Q, _np(si)))
        # a bounded search (a sharded search's second phase) walks the stored graph round by round
        bound = xp.asarray(np.quantile(_np(md)[:, -1], 0.5) * np.ones(len(Q), np.float32))
        bd_, bi_ = f.query(xp.asarray(Q), k, backtracks=2, bounds=bound)
        np.testing.assert_array_equal(_np(bi_), _np(mem.query(xp.asarray(Q), k, backtracks=2, bounds=bound)[1]))
        assert np.isinf(_np(bd_)).any() and (_np(bd_)[np.isfinite(_np(bd_))] < _np(bound)[0]).all()
        got.append((_np(sd), _np(si) + a))
        pd, pi = idx.load_shard(store, "p", s, device).forest.query(xp.asarray(Q), k, backtracks=2)
        base.append((_np(pd), _np(pi) + a))
        # a leave-one-out calibration maps its own rows out of the walk too
        cal = f.calibrate(k, 0.9)
        assert cal["budget"] is not None and cal["recall"] >= 0.9
    from scanforest.kernels.knn.topk import merge_topk

    gd, _ = merge_topk(got, k)
    bd, _ = merge_topk(base, k)
    assert _recall(gd, ed, k) > _recall(bd, ed, k)


def _np(a):
    from scanforest.kernels.backend import to_numpy

    return to_numpy(a)


def test_stored_index_keeps_its_graph(tmp_path, rng):
    _stored_graph_check(tmp_path, rng, "cpu", np)


@pytest.mark.gpu
def test_gpu_stored_index_keeps_its_graph(tmp_path, rng):
    import cupy as cp

    _stored_graph_check(tmp_path, rng, "gpu", cp)
