"""Randomized KD-forests (n_trees > 1, one shared queue) and bounded search (global top-P sync)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from scanforest.kernels.errors import InputError
from scanforest.kernels.knn.bruteforce import knn_bruteforce, recall
from scanforest.kernels.knn.kdforest import KDForest, merge_topk_unique
from scanforest.kernels.knn.kdtree import build_kdforest, build_kdtree, query_kdtree


def _data(rng, kind, n, m, d):
    if kind == "random":
        return rng.standard_normal((n, d)).astype(np.float32), rng.standard_normal((m, d)).astype(np.float32)
    # many exact duplicates and distance ties
    return rng.integers(0, 3, (n, d)).astype(np.float32), rng.integers(0, 3, (m, d)).astype(np.float32)


def _above(x):
    """The float32 just above x: a bound that admits points at distance x."""
    return np.nextafter(np.asarray(x, np.float32), np.float32(np.inf))


def _assert_rows_unique(ids):
    for r in np.asarray(ids):
        r = r[r >= 0]
        assert len(np.unique(r)) == len(r), f"duplicate id in a row: {r}"


# ---------------------------------------------------------------------------------------- build
def test_forest_layout(rng):
    X = rng.standard_normal((1500, 6)).astype(np.float32)
    f = build_kdforest(X, n_trees=3, leaf_size=8, random_dims=4, seed=11, device="cpu")
    assert f.n_trees == 3 and f.n_points == 1500 and f.points.shape == (4500, 6)
    assert f.roots[0] == 0
    for t in range(3):
        ref = build_kdtree(X, leaf_size=8, random_dims=4, seed=11 + t, device="cpu")
        r0 = int(f.roots[t])
        nn = ref.n_nodes
        np.testing.assert_array_equal(f.split_dim[r0:r0 + nn], ref.split_dim)
        np.testing.assert_array_equal(f.perm[t * 1500:(t + 1) * 1500], ref.perm)
        np.testing.assert_array_equal(f.start[r0:r0 + nn], ref.start + t * 1500)
        np.testing.assert_array_equal(f.child[r0:r0 + nn], np.where(ref.child >= 0, ref.child + r0, -1))
        np.testing.assert_array_equal(f.lo[r0:r0 + nn], ref.lo)
    # the trees really differ (randomized splits, seeds seed + t)
    assert not np.array_equal(f.perm[:1500], f.perm[1500:3000])
    assert build_kdforest(X, n_trees=1, leaf_size=8, device="cpu").roots is None


# ---------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", ["random", "duplicates"])
@pytest.mark.parametrize("n_trees,k,d", [(2, 1, 5), (3, 4, 12), (4, 17, 3)])
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_forest_unlimited_budget_is_exact(rng, kind, n_trees, k, d, descent):
    X, Q = _data(rng, kind, 3000, 300, d)
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    for method in ("anns", "banns"):
        f = KDForest(n_trees=n_trees, leaf_size=16, method=method, device="cpu", descent=descent).fit(X)
        d2, ids = f.query(Q, k)
        np.testing.assert_array_equal(ids, bi, err_msg=method)
        np.testing.assert_array_equal(d2, bd, err_msg=method)


def test_single_tree_forest_is_the_tree(rng):
    X, Q = _data(rng, "random", 4000, 200, 8)
    t = build_kdtree(X, leaf_size=16, device="cpu")
    for b in (1, 4, None):
        d1, i1 = query_kdtree(t, Q, 5, backtracks=b)
        d2, i2 = KDForest(n_trees=1, leaf_size=16, backtracks=b, method="anns", device="cpu").fit(X).query(Q, 5)
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(d1, d2)


def test_forest_shared_budget_and_unique_ids(rng):
    # clustered data, query set = reference set (duplicated points reachable through every tree)
    X = (rng.standard_normal((40, 16)) * 4)[rng.integers(0, 40, 4000)] + rng.standard_normal((4000, 16))
    X = X.astype(np.float32)
    Q = X[:400]
    bd, _ = knn_bruteforce(X, Q, 8, device="cpu")
    rec = {}
    for T in (1, 3):
        f = KDForest(n_trees=T, leaf_size=16, backtracks=6, method="anns", device="cpu").fit(X)
        d2, ids = f.query(Q, 8)
        _assert_rows_unique(ids)
        lv = f.stats_["leaves_visited"]
        assert lv.shape == (400,) and int(lv.max()) <= 6 and int(lv.min()) >= 1
        assert np.all(np.diff(d2, axis=1) >= 0)
        rec[T] = recall(d2, bd)
    assert 0.3 < rec[1] < 1.0 and 0.3 < rec[3] < 1.0


def test_forest_validation(rng):
    X = rng.standard_normal((50, 4)).astype(np.float32)
    for params, msg in [({"n_trees": 0}, "n_trees"), ({"n_trees": 1.5}, "n_trees"), ({"n_trees": True}, "n_trees"),
                        ({"n_trees": 2, "random_dims": 1}, "random_dims >= 2"),
                        ({"random_dims": 5}, "1..d"), ({"n_trees": 2, "random_dims": 6}, "1..d")]:
        with pytest.raises(InputError, match=msg):
            KDForest(device="cpu", **params).fit(X)
    f = KDForest(n_trees=2, device="cpu").fit(X)
    assert f.random_dims_ == 4 and f.tree_.n_trees == 2  # default F = min(5, d)
    assert KDForest(n_trees=2, device="cpu").fit(rng.standard_normal((50, 9)).astype(np.float32)).random_dims_ == 5
    with pytest.raises(InputError, match="random_dims >= 2"):
        build_kdforest(X, n_trees=3, device="cpu")
    for bounds, msg in [(np.zeros(3, np.float32), r"shape \(2,\)"), (np.array([1, np.nan], np.float32), "NaN"),
                        (np.array([1, -1], np.float32), ">= 0"), (np.array(["a", "b"]), "float")]:
        with pytest.raises(InputError, match=msg):
            f.query(X[:2], 2, bounds=bounds)
    with pytest.raises(InputError, match="backtracks"):
        f.query(X[:2], 2, backtracks=0)
    f.query(X[:2], 2, backtracks=1)
    assert f.stats_["leaves_visited"].max() == 1 and f.backtracks is None


@pytest.mark.parametrize("kind", ["random", "duplicates"])
def test_banns_rounds_of_several_leaves(rng, kind):
    """P-BANNS's batched rounds (leaves_per_round L: L leaves chosen against the pruning distance
    of the round's start, then scanned) on the CPU: exact with an unlimited budget for any L, the
    same as P-ANNS for L = 1, and within the budget (each returned distance the canonical one of
    its id) for larger L."""
    from scanforest.kernels.knn.bruteforce import pair_distances

    X, Q = _data(rng, kind, 4000, 300, 10)
    k = 5
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    forest = build_kdforest(X, n_trees=3, leaf_size=16, random_dims=5, device="cpu")
    for per_round in (1, 3, 32):
        d2, ids, st = query_kdtree(forest, Q, k, method="banns", leaves_per_round=per_round, return_stats=True)
        np.testing.assert_array_equal(ids, bi, err_msg=f"L={per_round}")
        np.testing.assert_array_equal(d2, bd, err_msg=f"L={per_round}")
    for b in (1, 6, 40):
        ad, ai, ast = query_kdtree(forest, Q, k, backtracks=b, return_stats=True)
        d1, i1, s1 = query_kdtree(forest, Q, k, backtracks=b, method="banns", leaves_per_round=1, return_stats=True)
        np.testing.assert_array_equal(i1, ai)
        np.testing.assert_array_equal(d1, ad)
        np.testing.assert_array_equal(s1["leaves_visited"], ast["leaves_visited"])
        for per_round in (2, b):
            dl, il, sl = query_kdtree(forest, Q, k, backtracks=b, method="banns", leaves_per_round=per_round,
                                      return_stats=True)
            assert int(sl["leaves_visited"].max()) <= b
            _assert_rows_unique(il)
            np.testing.assert_array_equal(dl, pair_distances(X, Q, il, device="cpu"))
            # stale pruning within a round can only add scans: the list is at least as good as P-ANNS's
            # with the same leaves when the budget was not reached
            short = sl["leaves_visited"] < b
            np.testing.assert_array_equal(il[short], bi[short])
    # the CPU's batched rounds (leaves shared between the queries that take them) against the same
    # rounds run one query at a time: the same lists, ties included, and the same leaf counts
    from scanforest.kernels.knn import _kdtree_cpu as kc
    from scanforest.kernels.knn import kdtree as kd

    m = len(Q)
    for descent in ("box", "path", "incremental"):
        for b, per_round in ((None, 4), (None, 128), (7, 3), (40, 40), (5, 2)):
            d1, i1, s1 = query_kdtree(forest, Q, k, method="banns", backtracks=b, leaves_per_round=per_round,
                                      descent=descent, return_stats=True)
            od, oi = np.empty((m, k), np.float32), np.empty((m, k), np.int64)
            ov, vv = np.zeros(m, np.bool_), np.zeros(m, np.int32)
            budget = kd._check_budget(b)
            kc._anns_cpu(forest.points, forest.perm, forest.child, forest.split_dim, forest.split_val, forest.start,
                         forest.end, forest.lo, forest.hi, forest.roots, Q, np.full(m, np.inf, np.float32), k, budget,
                         kd.heap_capacity(budget), od, oi, ov, vv, kd.DESCENT_IDS[descent], min(per_round, b or 10**9))
            np.testing.assert_array_equal(i1, oi, err_msg=f"{descent} {b} {per_round}")
            np.testing.assert_array_equal(d1, od, err_msg=f"{descent} {b} {per_round}")
            np.testing.assert_array_equal(s1["leaves_visited"], vv)
    # the default: LEAVES_PER_ROUND, at most the budget; the same call on the other method is refused
    from scanforest.kernels.knn.kdtree import LEAVES_PER_ROUND, resolve_leaves_per_round

    assert resolve_leaves_per_round(None, "banns", 0, True, 352) == LEAVES_PER_ROUND
    assert resolve_leaves_per_round(None, "banns", 5, True, 352) == 5
    assert resolve_leaves_per_round(None, "banns", 0, False, 352) == 1
    assert resolve_leaves_per_round(None, "banns", 0, True, 3000) == 1
    assert resolve_leaves_per_round(None, "anns", 64, True, 352) == 1
    for bad, kw, msg in [(0, {}, "integer >= 1"), (2.5, {}, "integer >= 1"), (True, {}, "integer >= 1"),
                         (4, {"method": "anns"}, "method='banns'"),
                         (4, {"sliding_window": "rotate"}, "stream leaf kernel")]:
        with pytest.raises(InputError, match=msg):
            query_kdtree(forest, Q[:2], k, **{"method": "banns", **kw, "leaves_per_round": bad})
    with pytest.raises(InputError, match="integer >= 1"):
        KDForest(leaves_per_round=0, device="cpu").fit(X).query(Q[:2], 2)


# ---------------------------------------------------------------------------------------- bounds
@pytest.mark.parametrize("n_trees", [1, 2])
@pytest.mark.parametrize("kind", ["random", "duplicates"])
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_bounded_search_is_exact_and_visits_fewer_leaves(rng, n_trees, kind, descent):
    q = functools.partial(query_kdtree, descent=descent)
    X, Q = _data(rng, kind, 5000, 400, 10)
    k = 4
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    f = KDForest(n_trees=n_trees, leaf_size=16, method="anns", device="cpu", descent=descent).fit(X)
    f.query(Q, k)
    free = f.stats_["leaves_visited"].copy()
    d2, ids = f.query(Q, k, bounds=_above(bd[:, -1]))
    np.testing.assert_array_equal(ids, bi)
    np.testing.assert_array_equal(d2, bd)
    bounded = f.stats_["leaves_visited"]
    assert bounded.sum() < free.sum()
    # the tree-level entry point gives the same
    d3, i3, st = q(f.tree_, Q, k, bounds=_above(bd[:, -1]), return_stats=True)
    np.testing.assert_array_equal(i3, bi)
    np.testing.assert_array_equal(st["leaves_visited"], bounded)


def test_bound_is_strict_and_pads(rng):
    X, Q = _data(rng, "duplicates", 3000, 200, 6)
    k = 6
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    b = bd[:, 2].copy()  # only points strictly closer than the 3rd distance are admitted
    keep = bd < b[:, None]
    for method in ("anns", "exact"):
        f = KDForest(n_trees=2, leaf_size=8, method=method, device="cpu").fit(X)
        d2, ids = f.query(Q, k, bounds=b)
        np.testing.assert_array_equal(ids, np.where(keep, bi, -1), err_msg=method)
        np.testing.assert_array_equal(d2, np.where(keep, bd, np.inf).astype(np.float32), err_msg=method)
    f = KDForest(n_trees=2, leaf_size=8, method="anns", device="cpu").fit(X)
    d2, ids = f.query(Q, k, bounds=np.zeros(len(Q), np.float32))
    assert np.all(ids == -1) and np.all(np.isinf(d2)) and f.stats_["leaves_visited"].sum() == 0
    d1, i1 = f.query(Q, k)
    d2, i2 = f.query(Q, k, bounds=np.full(len(Q), np.inf, np.float32))
    np.testing.assert_array_equal(i1, i2)
    d2, i2 = f.query(Q, k, bounds=np.float32(np.inf))  # a scalar applies to every query
    np.testing.assert_array_equal(i1, i2)


def test_two_phase_global_sync_on_shards(rng):
    """The distributed pattern: phase 1 (small budget on every shard) -> merged global k-th
    distance per query -> phase 2 bounded on every shard -> unique merge == brute force."""
    X, Q = _data(rng, "random", 6000, 300, 8)
    k = 4
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    cuts = [(0, 2000), (2000, 4000), (4000, 6000)]
    shards = [(a, KDForest(n_trees=2, leaf_size=16, method="anns", seed=s, device="cpu").fit(X[a:b]))
              for s, (a, b) in enumerate(cuts)]

    def run(bounds, budget):
        parts, leaves = [], 0
        for a, f in shards:
            d2, ids = f.query(Q, k, bounds=bounds, backtracks=budget)
            parts.append((d2, np.where(ids >= 0, ids + a, -1)))
            leaves += int(f.stats_["leaves_visited"].sum())
        return parts, leaves

    p1, l1 = run(None, 2)
    g1 = merge_topk_unique(p1, k)
    p2, l2 = run(_above(g1[0][:, -1]), None)
    d2, ids = merge_topk_unique(p1 + p2, k)
    np.testing.assert_array_equal(ids, bi)
    np.testing.assert_array_equal(d2, bd)
    _, l_free = run(None, None)
    assert l1 + l2 < l_free


def test_merge_topk_unique():
    d1 = np.array([[1, 2, 3], [0, 5, np.inf]], np.float32)
    i1 = np.array([[7, 8, 9], [1, 2, -1]])
    d2 = np.array([[1, 2.5], [0, 0]], np.float32)
    i2 = np.array([[7, 4], [1, 3]])
    d, i = merge_topk_unique([(d1, i1), (d2, i2)], 4)
    np.testing.assert_array_equal(i, [[7, 8, 4, 9], [1, 3, 2, -1]])
    np.testing.assert_array_equal(d, np.array([[1, 2, 2.5, 3], [0, 0, 5, np.inf]], np.float32))
    d, i = merge_topk_unique([(d1[:, :1], i1[:, :1])], 2)
    np.testing.assert_array_equal(i, [[7, -1], [1, -1]])


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "duplicates"])
@pytest.mark.parametrize("n_trees,k,d,leaf", [(2, 1, 5, 32), (3, 4, 64, 32), (4, 33, 40, 200)])
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_gpu_forest_unlimited_budget_is_exact(rng, monkeypatch, kind, n_trees, k, d, leaf, descent):
    q = functools.partial(query_kdtree, descent=descent)
    import cupy as cp

    from scanforest.kernels.knn import _kdtree_gpu

    X, Q = _data(rng, kind, 6000, 700, d)
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    forest = build_kdforest(cp.asarray(X), n_trees=n_trees, leaf_size=leaf, random_dims=5, seed=3)
    cpu = build_kdforest(X, n_trees=n_trees, leaf_size=leaf, random_dims=5, seed=3, device="cpu")
    for name in ("perm", "child", "start", "end", "roots", "split_dim"):
        np.testing.assert_array_equal(getattr(forest, name).get(), getattr(cpu, name), err_msg=name)
    for method, sw, kern in (("anns", True, "rotate"), ("banns", True, "rotate"), ("banns", True, "tile"),
                             ("banns", False, "rotate")):
        monkeypatch.setattr(_kdtree_gpu, "WINDOW_KERNEL", kern)
        d2, ids = q(forest, cp.asarray(Q), k, method=method, sliding_window=sw)
        np.testing.assert_array_equal(ids.get(), bi, err_msg=f"{method} sw={sw} {kern}")
        np.testing.assert_array_equal(d2.get(), bd, err_msg=f"{method} sw={sw} {kern}")


@pytest.mark.gpu
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_gpu_forest_limited_budget_matches_cpu(rng, descent):
    q = functools.partial(query_kdtree, descent=descent)
    import cupy as cp

    X, Q = _data(rng, "random", 20000, 1000, 16)
    ct = build_kdforest(X, n_trees=3, leaf_size=32, random_dims=5, device="cpu")
    gt = build_kdforest(cp.asarray(X), n_trees=3, leaf_size=32, random_dims=5)
    for b in (1, 5, 20):
        cd, ci, cs = q(ct, Q, 4, backtracks=b, return_stats=True)
        ad, ai, gs = q(gt, cp.asarray(Q), 4, backtracks=b, method="anns", return_stats=True)
        np.testing.assert_array_equal(ai.get(), ci)
        np.testing.assert_array_equal(gs["leaves_visited"], cs["leaves_visited"])
        _assert_rows_unique(ci)
        for sw, per_round in ((True, None), (True, 1), (True, 4), (False, None)):
            kw = {"method": "banns", "sliding_window": sw, "leaves_per_round": per_round}
            cbd, cbi, cbs = q(ct, Q, 4, backtracks=b, return_stats=True, **kw)
            bd, bi, bs = q(gt, cp.asarray(Q), 4, backtracks=b, finish_below=0, return_stats=True, **kw)
            np.testing.assert_array_equal(bi.get(), cbi, err_msg=f"sw={sw} L={per_round}")
            np.testing.assert_array_equal(bd.get(), cbd, err_msg=f"sw={sw} L={per_round}")
            np.testing.assert_array_equal(bs["leaves_visited"], cbs["leaves_visited"])
            _assert_rows_unique(cbi)


@pytest.mark.gpu
@pytest.mark.parametrize("n_trees", [1, 3])
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_gpu_bounded_search(rng, n_trees, descent):
    q = functools.partial(query_kdtree, descent=descent)
    import cupy as cp

    X, Q = _data(rng, "random", 20000, 1000, 16)
    k = 4
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    ct = build_kdforest(X, n_trees=n_trees, leaf_size=32, random_dims=5, device="cpu")
    gt = build_kdforest(cp.asarray(X), n_trees=n_trees, leaf_size=32, random_dims=5)
    Qg = cp.asarray(Q)
    for b, budget in ((_above(bd[:, -1]), None), (bd[:, 1].copy(), None), (_above(bd[:, -1]), 3)):
        cd, ci, cs = q(ct, Q, k, backtracks=budget, bounds=b, return_stats=True)
        if budget is None:
            keep = bd < b[:, None]
            np.testing.assert_array_equal(ci, np.where(keep, bi, -1))
        _, _, free = q(gt, Qg, k, backtracks=budget, method="anns", return_stats=True)
        for method in ("anns", "banns"):
            kw = {"finish_below": 0} if method == "banns" else {}
            md, mi, ms = q(ct, Q, k, backtracks=budget, bounds=b, return_stats=True, method=method)
            if budget is None:
                np.testing.assert_array_equal(mi, np.where(keep, bi, -1), err_msg=method)
            gd, gi, gs = q(gt, Qg, k, backtracks=budget, method=method, bounds=cp.asarray(b),
                                      return_stats=True, **kw)
            np.testing.assert_array_equal(gi.get(), mi, err_msg=method)
            np.testing.assert_array_equal(gd.get(), md, err_msg=method)
            np.testing.assert_array_equal(gs["leaves_visited"], ms["leaves_visited"], err_msg=method)
        assert cs["leaves_visited"].sum() <= free["leaves_visited"].sum()
        if budget is None:
            assert cs["leaves_visited"].sum() < free["leaves_visited"].sum()
    # default finish (residual queries by brute force) stays exact with bounds
    gd, gi = q(gt, Qg, k, method="banns", bounds=cp.asarray(_above(bd[:, -1])))
    np.testing.assert_array_equal(gi.get(), bi)
    gd, gi = q(gt, Qg, k, method="banns", bounds=cp.zeros(len(Q), cp.float32))
    assert bool((gi == -1).all())


@pytest.mark.gpu
def test_gpu_kdforest_trees_and_bounds(rng):
    import cupy as cp

    X, Q = _data(rng, "random", 5000, 200, 12)
    bd, bi = knn_bruteforce(X, Q, 6, device="cpu")
    for method in ("banns", "anns", "exact"):
        f = KDForest(n_trees=2, method=method, leaf_size=16).fit(cp.asarray(X))
        d2, ids = f.query(Q, 6)
        np.testing.assert_array_equal(ids.get(), bi, err_msg=method)
        d2, ids = f.query(Q, 6, bounds=_above(bd[:, -1]))
        np.testing.assert_array_equal(ids.get(), bi, err_msg=method)
        d, i = merge_topk_unique([(d2, ids), (d2, ids)], 6)
        np.testing.assert_array_equal(i.get(), bi)
