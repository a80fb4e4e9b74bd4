"""Array KD-tree: construction invariants, exact search == brute force, CPU/GPU parity, KDForest."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from scanforest.kernels.errors import InputError
from scanforest.kernels.knn.bruteforce import exact_scan_cpu, knn_bruteforce, recall
from scanforest.kernels.knn.kdforest import KDForest
from scanforest.kernels.knn.kdtree import build_kdtree, query_kdtree

LEAF = 8


def check_invariants(tree, X, leaf_size):
    """Every point in exactly one leaf, boxes tight around their points, consistent splits."""
    t = tree.to_numpy()
    n, d = X.shape
    assert sorted(t.perm.tolist()) == list(range(n))
    np.testing.assert_array_equal(t.points, X[t.perm])
    leaves = np.nonzero(t.child < 0)[0]
    cover = np.zeros(n, np.int64)
    for i in leaves:
        assert t.end[i] > t.start[i], "empty leaf"
        cover[t.start[i]:t.end[i]] += 1
    assert np.all(cover == 1), "leaf ranges must partition the points"
    for i in range(t.n_nodes):
        pts = t.points[t.start[i]:t.end[i]]
        np.testing.assert_array_equal(t.lo[i], pts.min(0))
        np.testing.assert_array_equal(t.hi[i], pts.max(0))
        c = t.child[i]
        if c >= 0:
            assert t.start[c] == t.start[i] and t.end[c] == t.start[c + 1] and t.end[c + 1] == t.end[i]
            assert t.end[c] > t.start[c] and t.end[c + 1] > t.start[c + 1]
            dm, v = t.split_dim[i], t.split_val[i]
            assert np.all(t.points[t.start[c]:t.end[c], dm] <= v)
            assert np.all(t.points[t.start[c + 1]:t.end[c + 1], dm] > v)
        elif t.end[i] - t.start[i] > leaf_size:
            assert np.all(t.hi[i] == t.lo[i]), "an oversized leaf must hold identical points"


@pytest.mark.parametrize("n", [1, 2, LEAF - 1, LEAF, LEAF + 1, 1000])
@pytest.mark.parametrize("random_dims", [None, 3])
@pytest.mark.parametrize("split", ["variance", "median", "midpoint"])
def test_invariants(rng, n, random_dims, split):
    X = rng.standard_normal((n, 5)).astype(np.float32)
    tree = build_kdtree(X, leaf_size=LEAF, random_dims=random_dims, seed=7, split=split, device="cpu")
    check_invariants(tree, X, LEAF)
    if n <= LEAF:
        assert tree.n_nodes == 1 and tree.depth == 0


def test_widest_dimension_midpoint_rule(rng):
    X = np.c_[rng.uniform(0, 1, 200), rng.uniform(0, 10, 200), rng.uniform(0, 3, 200)].astype(np.float32)
    tree = build_kdtree(X, leaf_size=4, split="midpoint", device="cpu")
    assert tree.split_dim[0] == 1
    assert tree.split_val[0] == np.float32(0.5) * X[:, 1].min() + np.float32(0.5) * X[:, 1].max()


def test_sample_median_rule(rng):
    X = np.c_[rng.uniform(0, 1, 1000), rng.uniform(0, 3, 1000), rng.uniform(0, 10, 1000)].astype(np.float32)
    X[7, 0] = 50.0  # a lone outlier makes dim 0 the widest box dimension, outside the sample
    tree = build_kdtree(X, leaf_size=4, split="median", device="cpu")
    sample = X[(np.arange(64) * 1000) // 64]
    assert 7 not in (np.arange(64) * 1000) // 64
    assert tree.split_dim[0] == 2 == int(np.argmax(sample.max(0) - sample.min(0)))
    assert tree.split_val[0] == np.sort(sample[:, 2])[32]
    assert build_kdtree(X, leaf_size=4, split="midpoint", device="cpu").split_dim[0] == 0


def test_sample_median_at_the_maximum_moves_down(rng):
    # 3/4 of the values at the maximum: the sample median is the node maximum, so the cut moves to
    # the largest smaller sample value and both children stay non-empty
    X = np.ones((400, 2), np.float32)
    X[:100, 0] = rng.uniform(0, 0.5, 100)
    X[:, 1] = 0.25
    tree = build_kdtree(X, leaf_size=8, split="median", device="cpu")
    sample = X[(np.arange(64) * 400) // 64, 0]
    assert tree.split_dim[0] == 0 and tree.split_val[0] == sample[sample < 1].max()
    check_invariants(tree, X, 8)


def _f32_mean_var(col):
    """The variance rule's float32 arithmetic, in sample order: (mean, sum of squares)."""
    acc = np.float32(0)
    for x in col:
        acc = np.float32(acc + x)
    mean = np.float32(acc / np.float32(len(col)))
    var = np.float32(0)
    for x in col:
        t = np.float32(x - mean)
        var = np.float32(var + np.float32(t * t))
    return mean, var


def test_sample_variance_rule(rng):
    """The default rule: the dimension of largest sample variance (not the widest: dim 2 has the
    largest extent from two far values, dim 1 the largest spread), cut at the sample mean, with
    the sums done in float32 in sample order (so the GPU can mirror them bit for bit)."""
    X = np.c_[rng.uniform(0, 1, 1000), rng.uniform(0, 6, 1000), np.full(1000, 2.0)].astype(np.float32)
    rows = (np.arange(64) * 1000) // 64
    X[rows[:2], 2] = [-5.0, 9.0]  # dim 2: widest sample extent, but most of it at one value
    tree = build_kdtree(X, leaf_size=4, device="cpu")
    sample = X[rows]
    mv = [_f32_mean_var(sample[:, j]) for j in range(3)]
    assert int(np.argmax(sample.max(0) - sample.min(0))) == 2
    assert tree.split_dim[0] == 1 == int(np.argmax([v for _, v in mv]))
    assert tree.split_val[0] == mv[1][0]
    assert build_kdtree(X, leaf_size=4, split="median", device="cpu").split_dim[0] == 2
    check_invariants(tree, X, 4)


def _two_value_column(base):
    """300 rows: column 0 alternates base and the next float up, column 1 a constant whose
    float32 sums leave a residue. With base 0.1 the float32 sample mean rounds below the sample
    minimum, with 0.7 onto the maximum (checked below)."""
    a = np.float32(base)
    X = np.full((300, 2), a, np.float32)
    X[::2, 0] = np.nextafter(a, np.float32(10))
    X[:, 1] = np.float32(1 / 3)
    return X


def test_variance_rule_keeps_both_children(rng):
    """A sample mean that rounds outside [sample min, node max) moves to the sample minimum, so
    no child is empty; columns with zero sample extent never count, even when their float sums
    leave a residue."""
    for base, below in ((0.1, True), (0.7, False)):
        X = _two_value_column(base)
        mean, _ = _f32_mean_var(X[(np.arange(64) * 300) // 64, 0])
        assert (mean < X[:, 0].min()) if below else (mean >= X[:, 0].max())
        tree = build_kdtree(X, leaf_size=8, device="cpu")
        assert tree.split_dim[0] == 0 and tree.split_val[0] == X[:, 0].min()
        check_invariants(tree, X, 8)
        for s in range(3):  # all the way down, under random dims too
            check_invariants(build_kdtree(X, leaf_size=2, random_dims=2, seed=s, device="cpu"), X, 2)


def test_variance_rule_finds_more_neighbours_per_leaf(rng):
    """The measured reason for the default (kdtree docstring): on clustered data a 4-tree forest
    with the variance rule finds more of the exact neighbours than the median rule for the same
    leaf budget."""
    from scanforest.deploy.bench._data import clustered
    from scanforest.kernels.knn.bruteforce import recall
    from scanforest.kernels.knn.kdforest import KDForest

    X = clustered(20_000, 64, clusters=100, seed=1)
    Q = clustered(500, 64, clusters=100, seed=2)
    ed, _ = knn_bruteforce(X, Q, 4, device="cpu")
    got = {}
    for split in ("variance", "median"):
        f = KDForest(n_trees=4, leaf_size=16, split=split, device="cpu").fit(X)
        got[split] = recall(f.query(Q, 4, backtracks=16)[0], ed, 4)
    assert got["variance"] > got["median"] + 0.02, got


def skewed(rng, n, d):
    """SHOT-like data: mostly zeros, a few large values per row."""
    return np.where(rng.random((n, d)) < 0.05, rng.lognormal(0, 2, (n, d)), 0).astype(np.float32)


def test_median_split_balances_skewed_data(rng):
    X = skewed(rng, 20_000, 32)
    med = build_kdtree(X, leaf_size=LEAF, split="median", device="cpu")
    mid = build_kdtree(X, leaf_size=LEAF, split="midpoint", device="cpu")
    check_invariants(med, X, LEAF)  # leaves over LEAF hold identical points (the all-zero rows)
    g = build_kdtree(X, leaf_size=64, split="median", device="cpu")
    assert g.n_nodes > 4 * (len(X) // 64) + 3  # the node arrays grew during the build ...
    assert np.all(g.split_val[g.child < 0] == 0)  # ... and the grown leaves hold no garbage
    # the midpoint peels off outliers a few at a time and stops at max_depth with a mixed leaf of
    # most of the points (measured: 19,709 of 20,000)
    leaves = np.flatnonzero(mid.child < 0)
    big = leaves[np.argmax(mid.end[leaves] - mid.start[leaves])]
    assert mid.depth == 64 > med.depth and mid.end[big] - mid.start[big] > 1000
    assert np.any(mid.hi[big] > mid.lo[big])
    Q = skewed(rng, 300, 32)
    ed, ei = knn_bruteforce(X, Q, 4, device="cpu")
    fd, fi = query_kdtree(med, Q, 4)
    np.testing.assert_array_equal(fi, ei)


def test_split_rule_is_validated(rng):
    with pytest.raises(InputError, match="split must be one of"):
        build_kdtree(rng.standard_normal((10, 3)).astype(np.float32), split="mean", device="cpu")


def test_random_dims_is_seeded(rng):
    X = rng.standard_normal((500, 6)).astype(np.float32)
    a = build_kdtree(X, leaf_size=4, random_dims=4, seed=1, device="cpu")
    b = build_kdtree(X, leaf_size=4, random_dims=4, seed=1, device="cpu")
    c = build_kdtree(X, leaf_size=4, random_dims=4, seed=2, device="cpu")
    np.testing.assert_array_equal(a.split_dim, b.split_dim)
    assert a.split_dim.shape != c.split_dim.shape or np.any(a.split_dim != c.split_dim)


def test_duplicates_never_loop(rng):
    X = np.ones((100, 3), np.float32)
    tree = build_kdtree(X, leaf_size=4, device="cpu")
    assert tree.n_nodes == 1  # zero extent: one (oversized) leaf
    X = np.r_[np.zeros((50, 2)), np.ones((50, 2)), [[np.float32(1) + np.float32(1.2e-7), 1]]].astype(np.float32)
    tree = build_kdtree(X, leaf_size=4, device="cpu")  # adjacent floats: cut moves to lo
    check_invariants(tree, X, 4)
    X = rng.integers(0, 4, (700, 3)).astype(np.float32)
    tree = build_kdtree(X, leaf_size=5, device="cpu")
    check_invariants(tree, X, 5)


def test_max_depth(rng):
    X = rng.standard_normal((300, 4)).astype(np.float32)
    tree = build_kdtree(X, leaf_size=1, max_depth=3, device="cpu")
    assert tree.depth == 3 and tree.n_leaves == 8


@pytest.mark.parametrize("kind", ["random", "duplicates"])
@pytest.mark.parametrize("k", [1, 7, 50])
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_unlimited_budget_is_exact(rng, kind, k, descent):
    q = functools.partial(query_kdtree, descent=descent)
    if kind == "random":
        X = rng.standard_normal((2000, 6)).astype(np.float32)
        Q = rng.standard_normal((80, 6)).astype(np.float32)
    else:
        X = rng.integers(0, 3, (1500, 4)).astype(np.float32)
        Q = rng.integers(0, 3, (60, 4)).astype(np.float32)
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    for method in ("anns", "banns"):
        tree = build_kdtree(X, leaf_size=16, device="cpu")
        d, i = q(tree, Q, k, method=method)
        np.testing.assert_array_equal(i, bi)
        np.testing.assert_array_equal(d, bd)


def test_limited_budget(rng):
    X = rng.standard_normal((4000, 8)).astype(np.float32)
    Q = rng.standard_normal((200, 8)).astype(np.float32)
    ed, ei = exact_scan_cpu(X, Q, 4)
    tree = build_kdtree(X, leaf_size=16, device="cpu")
    prev = -1.0
    for b in (1, 4, 16, 64):
        d, i = query_kdtree(tree, Q, 4, backtracks=b)
        assert np.all(d >= ed)  # never better than exact
        r = recall(d, ed)
        assert r >= prev - 1e-12
        prev = r
    assert prev > 0.9
    # returned distances are the true distances of the returned ids
    np.testing.assert_allclose(d, ((Q[:, None, :].astype(np.float64) - X[i]) ** 2).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_heap_overflow_falls_back_exactly(rng, descent):
    q = functools.partial(query_kdtree, descent=descent)
    # leaf_size 1, 8-D and a large k leave more pending boxes than the queue holds
    X = rng.standard_normal((3000, 8)).astype(np.float32)
    Q = rng.standard_normal((20, 8)).astype(np.float32)
    tree = build_kdtree(X, leaf_size=1, device="cpu")
    d, i, stats = q(tree, Q, 256, return_stats=True, heap_cap=256)
    assert stats["heap_overflow"] > 0
    bd, bi = knn_bruteforce(X, Q, 256, device="cpu")
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(d, bd)


def test_queue_grows_with_the_budget(rng):
    """A full queue drops its farthest box for good: with the fixed 256 boxes a larger budget
    stopped paying (queries ran out of boxes before their budget); the default capacity grows
    with the budget, and the search then uses the budget and finds more of the true neighbours."""
    from scanforest.kernels.knn.kdtree import HEAP_CAP, MAX_HEAP_CAP, heap_capacity

    assert heap_capacity(1) == heap_capacity(256) == HEAP_CAP and heap_capacity(300) == 512
    assert heap_capacity(2048) == heap_capacity(10 ** 6) == MAX_HEAP_CAP and heap_capacity(0) == 1024
    assert heap_capacity(300, 64) == 64
    for bad in (0, 7, 1.5, True, 1 << 17):
        with pytest.raises(InputError, match="heap_cap"):
            heap_capacity(10, bad)
    X = rng.standard_normal((20000, 24)).astype(np.float32)
    Q = rng.standard_normal((200, 24)).astype(np.float32)
    tree = build_kdtree(X, leaf_size=4, device="cpu")
    bd, _ = knn_bruteforce(X, Q, 8, device="cpu")
    # box: 0.76 -> 0.97 (1,490 leaves a query with the fixed queue); path: 0.87 -> 0.97 (1,530);
    # incremental: 0.90 -> 0.95 (1,970)
    for descent, gain, short in (("box", 0.1, 1900), ("path", 0.05, 1900), ("incremental", 0.03, 1995)):
        d0, _, s0 = query_kdtree(tree, Q, 8, backtracks=2000, heap_cap=256, return_stats=True, descent=descent)
        d1, _, s1 = query_kdtree(tree, Q, 8, backtracks=2000, return_stats=True, descent=descent)
        assert s0["leaves_visited"].mean() < short and s1["leaves_visited"].mean() == 2000
        assert s1["heap_overflow"] < s0["heap_overflow"]
        assert recall(d1, bd, 8) > recall(d0, bd, 8) + gain
    with pytest.raises(InputError, match="heap_cap"):
        KDForest(heap_cap=3).fit(X)


def test_kdforest_api(rng):
    X = rng.standard_normal((1000, 8)).astype(np.float32)
    Q = rng.standard_normal((30, 8)).astype(np.float32)
    bd, bi = knn_bruteforce(X, Q, 5, device="cpu")
    for method in ("banns", "anns", "exact"):
        f = KDForest(method=method, leaf_size=16, device="cpu").fit(X)
        assert f.n_samples_fit_ == 1000 and f.n_features_in_ == 8 and f.device_ == "cpu"
        d, i = f.query(Q, k=5)
        np.testing.assert_array_equal(i, bi)
        np.testing.assert_array_equal(d, bd)
    dist, ids = KDForest(device="cpu").fit(X).kneighbors(X[:3], 2)
    np.testing.assert_array_equal(ids[:, 0], [0, 1, 2])
    assert "n_trees=None, leaf_size=None" in repr(KDForest())  # the device's defaults, resolved by fit


@pytest.mark.parametrize("params,X,msg", [
    ({"n_trees": 2, "random_dims": 1}, None, "random_dims >= 2"),
    ({"n_trees": 0}, None, "n_trees"),
    ({"method": "fast"}, None, "method"),
    ({"leaf_size": 0}, None, "leaf_size"),
    ({"backtracks": 0}, None, "backtracks"),
    ({"random_dims": 99}, None, "random_dims"),
    ({"device": "tpu"}, None, "device"),
    ({}, np.zeros((0, 3), np.float32), "empty"),
    ({}, np.zeros(5, np.float32), "2-D"),
    ({}, np.array([[1, 2], [np.nan, 1]], np.float32), "NaN"),
])
def test_kdforest_validation(params, X, msg):
    X = np.zeros((10, 3), np.float32) if X is None else X
    with pytest.raises(InputError, match=msg):
        KDForest(**params).fit(X) if "device" in params else KDForest(device="cpu", **params).fit(X)


def test_kdforest_query_errors(rng):
    f = KDForest(device="cpu")
    with pytest.raises(InputError, match="not fitted"):
        f.query(np.zeros((1, 3), np.float32))
    f.fit(rng.standard_normal((10, 3)).astype(np.float32))
    with pytest.raises(InputError, match="dimensions"):
        f.query(np.zeros((1, 4), np.float32))
    with pytest.raises(InputError, match="larger than"):
        f.query(np.zeros((1, 3), np.float32), k=11)
    with pytest.raises(InputError, match="NaN"):
        f.query(np.array([[0, np.nan, 0]], np.float32))


# ---------------------------------------------------------------------------------------- GPU
def _same_tree(a, b):
    a, b = a.to_numpy(), b.to_numpy()
    for name in ("perm", "child", "split_dim", "split_val", "start", "end", "lo", "hi", "points"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.depth == b.depth


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["variance", "median", "midpoint"])
@pytest.mark.parametrize("n,d,random_dims", [(1, 3, None), (2, 3, None), (LEAF - 1, 4, None), (LEAF, 4, None),
                                             (LEAF + 1, 4, None), (5000, 7, None), (5000, 40, 5), (3000, 300, None)])
def test_gpu_build_equals_cpu(rng, n, d, random_dims, split):
    import cupy as cp

    X = rng.standard_normal((n, d)).astype(np.float32)
    c = build_kdtree(X, leaf_size=LEAF, random_dims=random_dims, seed=3, split=split, device="cpu")
    g = build_kdtree(cp.asarray(X), leaf_size=LEAF, random_dims=random_dims, seed=3, split=split)
    assert g.device == "gpu"
    _same_tree(c, g)
    check_invariants(g, X, LEAF)


@pytest.mark.gpu
def test_gpu_build_duplicates_equals_cpu(rng):
    import cupy as cp

    X = rng.integers(0, 3, (4000, 3)).astype(np.float32)
    for split in ("variance", "median", "midpoint"):
        _same_tree(build_kdtree(X, leaf_size=5, split=split, device="cpu"),
                   build_kdtree(cp.asarray(X), leaf_size=5, split=split))
    S = skewed(rng, 20_000, 48)
    S[::7] *= -1  # signed zeros and negatives
    for split in ("variance", "median"):
        for rd in (None, 5):
            _same_tree(build_kdtree(S, leaf_size=16, random_dims=rd, split=split, device="cpu"),
                       build_kdtree(cp.asarray(S), leaf_size=16, random_dims=rd, split=split))
    for base in (0.1, 0.7):  # sample means rounding outside the sample range
        T = _two_value_column(base)
        _same_tree(build_kdtree(T, leaf_size=2, random_dims=2, device="cpu"),
                   build_kdtree(cp.asarray(T), leaf_size=2, random_dims=2))


@pytest.mark.gpu
def test_gpu_build_large_invariants():
    import cupy as cp

    n, d, ls = 1_000_007, 3, 32
    X = cp.random.default_rng(5).standard_normal((n, d), dtype=cp.float32)
    t = build_kdtree(X, leaf_size=ls)
    assert bool((cp.sort(t.perm) == cp.arange(n)).all())
    leaves = cp.nonzero(t.child < 0)[0]
    cover = cp.zeros(n + 1, cp.int32)
    cp.add.at(cover, t.start[leaves], 1)
    cp.add.at(cover, t.end[leaves], -1)
    assert bool((cp.cumsum(cover)[:n] == 1).all())
    owner = cp.zeros(n + 1, cp.int64)
    cp.add.at(owner, t.start[leaves], leaves)
    cp.add.at(owner, t.end[leaves], -leaves)
    owner = cp.cumsum(owner)[:n]
    assert bool((t.points >= t.lo[owner]).all()) and bool((t.points <= t.hi[owner]).all())
    cnt = t.end[leaves] - t.start[leaves]
    assert int(cnt.min()) >= 1 and int(cnt.max()) <= ls


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "duplicates"])
@pytest.mark.parametrize("k,d,leaf", [(1, 5, 32), (4, 64, 32), (33, 130, 200), (256, 3, 32), (4, 40, 300)])
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_gpu_unlimited_budget_is_exact(rng, monkeypatch, kind, k, d, leaf, descent):
    q = functools.partial(query_kdtree, descent=descent)
    import cupy as cp

    from scanforest.kernels.knn import _kdtree_gpu

    if kind == "random":
        X = rng.standard_normal((6000, d)).astype(np.float32)
        Q = rng.standard_normal((700, d)).astype(np.float32)
    else:
        X = rng.integers(0, 3, (6000, d)).astype(np.float32)
        Q = rng.integers(0, 3, (700, d)).astype(np.float32)
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    tree = build_kdtree(cp.asarray(X), leaf_size=leaf)  # leaf 200/300: > 64 points, dense buckets
    for method, sw, kern in (("anns", True, "rotate"), ("banns", True, "stream"), ("banns", True, "rotate"),
                             ("banns", True, "tile"), ("banns", False, "rotate")):
        monkeypatch.setattr(_kdtree_gpu, "WINDOW_KERNEL", kern)
        d2, ids = q(tree, cp.asarray(Q), k, method=method, sliding_window=sw)
        np.testing.assert_array_equal(ids.get(), bi, err_msg=f"{method} sw={sw} {kern}")
        np.testing.assert_array_equal(d2.get(), bd, err_msg=f"{method} sw={sw} {kern}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 13])  # float4 and scalar paths of the box and leaf kernels
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_gpu_limited_budget_matches_cpu(rng, d, descent):
    q = functools.partial(query_kdtree, descent=descent)
    import cupy as cp

    X = rng.standard_normal((20000, d)).astype(np.float32)
    Q = rng.standard_normal((1000, d)).astype(np.float32)
    ct = build_kdtree(X, leaf_size=32, device="cpu")
    gt = build_kdtree(cp.asarray(X), leaf_size=32)
    for b in (1, 5, 20):
        cd, ci = q(ct, Q, 4, backtracks=b)
        ad, ai = q(gt, cp.asarray(Q), 4, backtracks=b, method="anns")
        np.testing.assert_array_equal(ai.get(), ci)
        for sw, per_round in ((True, None), (True, 1), (True, 3), (False, None)):
            # the CPU runs P-BANNS's rounds per query (leaves_per_round; 1 is P-ANNS's order)
            kw = {"method": "banns", "sliding_window": sw, "leaves_per_round": per_round}
            cbd, cbi, cbs = q(ct, Q, 4, backtracks=b, return_stats=True, **kw)
            bd, bi, bs = q(gt, cp.asarray(Q), 4, backtracks=b, finish_below=0, return_stats=True, **kw)
            np.testing.assert_array_equal(bi.get(), cbi, err_msg=f"sw={sw} L={per_round}")
            np.testing.assert_array_equal(bd.get(), cbd, err_msg=f"sw={sw} L={per_round}")
            np.testing.assert_array_equal(bs["leaves_visited"], cbs["leaves_visited"])
            if per_round == 1 or not sw:
                np.testing.assert_array_equal(cbi, ci)
    if d != 16:
        return
    # many boxes pending (k = 256, leaf 1): the bounded queue evicts identically on both devices
    ct = build_kdtree(X[:3000, :8], leaf_size=1, device="cpu")
    gt = build_kdtree(cp.asarray(X[:3000, :8]), leaf_size=1)
    cd, ci, cs = q(ct, Q[:200, :8], 256, backtracks=300, return_stats=True, heap_cap=256)
    ad, ai, gs = q(gt, cp.asarray(Q[:200, :8]), 256, backtracks=300, method="anns", return_stats=True,
                              heap_cap=256)
    assert cs["heap_overflow"] > 0 and cs["heap_overflow"] == gs["heap_overflow"]
    np.testing.assert_array_equal(ai.get(), ci)


@pytest.mark.gpu
def test_gpu_kdforest(rng):
    import cupy as cp

    X = rng.standard_normal((3000, 10)).astype(np.float32)
    Q = rng.standard_normal((100, 10)).astype(np.float32)
    bd, bi = knn_bruteforce(X, Q, 6, device="cpu")
    for method in ("banns", "anns", "exact"):
        f = KDForest(method=method, leaf_size=16).fit(cp.asarray(X))
        assert f.device_ == "gpu"
        d2, ids = f.query(Q, 6)
        np.testing.assert_array_equal(ids.get(), bi)


def test_pcl_shot_dataset_holds_out_queries(pcl_dir, tmp_path):
    """bench ann --real: every valid SHOT352 of the clouds, queries held out of the reference."""
    import shutil

    import scanforest as sf
    from scanforest.deploy.bench._data import pcl_shot_dataset
    from scanforest.kernels.neighbors.search import knn

    shutil.copy(pcl_dir / "bun0.pcd", tmp_path / "bun0.pcd")
    X, Q, rows = pcl_shot_dataset(tmp_path, device="cpu", max_queries=1000)
    assert rows[0][:3] == ("bun0.pcd", 397, 397)
    assert X.shape == (397 - 39, 352) and Q.shape == (39, 352) and X.dtype == np.float32
    assert np.isfinite(X).all() and np.isfinite(Q).all()
    # the split is a permutation of the descriptors computed directly
    pts = sf.read(pcl_dir / "bun0.pcd").points.astype(np.float32)
    _, d2 = knn(pts, k=2, device="cpu")
    nrm, _ = sf.normals(pts, k=10, device="cpu")
    ref, _ = sf.shot(pts, nrm, np.arange(len(pts)), 10 * float(np.sqrt(d2[:, 1].astype(np.float64)).mean()),
                     device="cpu")
    both = np.concatenate([X, Q])
    key = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731
    np.testing.assert_array_equal(key(both), key(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_gpu_heap_overflow_exact_on_a_one_copy_tree(rng, descent):
    """A tree without its input-order rows (a shard loaded with one copy) finishes overflowing
    queries by brute force on its leaf-ordered rows through ``perm``: the same exact answer."""
    q = functools.partial(query_kdtree, descent=descent)
    import dataclasses

    import cupy as cp

    X = rng.standard_normal((3000, 8)).astype(np.float32)
    Q = rng.standard_normal((20, 8)).astype(np.float32)
    gt = build_kdtree(cp.asarray(X), leaf_size=1)
    bd, bi = knn_bruteforce(X, Q, 256, device="cpu")
    for tree in (gt, dataclasses.replace(gt, data=None)):
        d, i, stats = q(tree, cp.asarray(Q), 256, return_stats=True, method="anns", heap_cap=256)
        assert stats["heap_overflow"] > 0
        np.testing.assert_array_equal(i.get(), bi)
        np.testing.assert_array_equal(d.get(), bd)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 13])
def test_gpu_half_rows_answer_as_their_float32_widening(rng, monkeypatch, d):
    """Leaf rows kept in float16 on the GPU (a float16 index) are widened exactly in the kernels:
    every search method, leaf kernel and budget returns what the float32 copy of the same rows
    returns, ids and distances bit for bit, on single trees and packed forests; the exact
    fallback widens a slice at a time and stays exact."""
    import dataclasses

    import cupy as cp

    from scanforest.kernels.knn import _kdtree_gpu
    from scanforest.kernels.knn.kdtree import build_kdforest

    X = rng.standard_normal((20000, d)).astype(np.float16).astype(np.float32)  # the stored (rounded) rows
    Q = cp.asarray(rng.standard_normal((600, d)).astype(np.float32))
    trees = (build_kdtree(cp.asarray(X), leaf_size=32),
             build_kdforest(cp.asarray(X), n_trees=2, random_dims=5, leaf_size=32))
    for full in trees:
        half = dataclasses.replace(full, points=full.points.astype(cp.float16), data=None)
        assert half.points.dtype == cp.float16 and half.points.nbytes * 2 == full.points.nbytes
        for b in (1, 7, 40):
            for method, sw, kern in [("anns", True, None), ("banns", False, None), ("banns", True, "stream"),
                                     ("banns", True, "rotate"), ("banns", True, "tile")]:
                if kern:
                    monkeypatch.setattr(_kdtree_gpu, "WINDOW_KERNEL", kern)
                kw = {} if method == "anns" else {"sliding_window": sw, "finish_below": 0}
                fd, fi = query_kdtree(full, Q, 4, backtracks=b, method=method, **kw)
                hd, hi = query_kdtree(half, Q, 4, backtracks=b, method=method, **kw)
                np.testing.assert_array_equal(hi.get(), fi.get(), err_msg=f"{method} {kern} budget {b}")
                np.testing.assert_array_equal(hd.get(), fd.get(), err_msg=f"{method} {kern} budget {b}")
    # unlimited budget, the residual queries finished by the exact fallback over 4,096-row slices
    monkeypatch.setattr(_kdtree_gpu, "HALF_REDO_ROWS", 4096)
    tree = build_kdtree(cp.asarray(X), leaf_size=32)
    half = dataclasses.replace(tree, points=tree.points.astype(cp.float16), data=None)
    bd, bi = knn_bruteforce(X, Q.get(), 5, device="cpu")
    d2, ids, stats = query_kdtree(half, Q, 5, method="banns", finish_below=10_000, return_stats=True)
    assert stats["finished_by_bruteforce"] == 600
    np.testing.assert_array_equal(ids.get(), bi)
    np.testing.assert_array_equal(d2.get(), bd)
    d2, ids = query_kdtree(half, Q, 5, method="anns")
    np.testing.assert_array_equal(ids.get(), bi)
    np.testing.assert_array_equal(d2.get(), bd)
    # the same tree on the host: its half rows are widened there too
    cd, ci = query_kdtree(half.to_numpy(), Q.get(), 5, backtracks=7)
    fd, fi = query_kdtree(tree.to_numpy(), Q.get(), 5, backtracks=7)
    np.testing.assert_array_equal(ci, fi)
    np.testing.assert_array_equal(cd, fd)


def _tensor_core_cases(rng):
    """(name, rows, queries): data on which the tensor-core estimate is tight (clusters, unit
    descriptors), loose (large offset, subnormal halves: every row re-ranked), exactly tied
    (integer rows), and queries or rows outside half's range."""
    n = 6000
    X = (0.35 * rng.standard_normal((n, 352)) + rng.standard_normal((30, 352))[rng.integers(0, 30, n)])
    U = np.abs(rng.standard_normal((n, 352)))
    U /= np.linalg.norm(U, axis=1, keepdims=True)
    Xi = rng.integers(0, 3, (n, 64)).astype(np.float64)
    Xo = 1000 + rng.standard_normal((n, 32))
    Xt = 1e-6 * rng.standard_normal((n, 32))
    big = X[:300].copy()
    big[::7, 3] = 1e6
    cases = [("clusters", X, X[:300] + 0.01 * rng.standard_normal((300, 352))), ("unit", U, U[:300] + 1e-4),
             ("ties", Xi, Xi[:300]), ("offset", Xo, Xo[:300] + 0.5), ("subnormal", Xt, 0.9 * Xt[:300]),
             ("big queries", X, big), ("rows beyond half", 1e5 * U, 1e5 * U[:300])]
    return [(name, A.astype(np.float32), Q.astype(np.float32)) for name, A, Q in cases]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["float32", "float16"])
def test_gpu_tensor_core_scan_equals_canonical_scan(rng, monkeypatch, rows):
    """The batched rounds score leaves on tensor cores (float rows rounded to half as they are
    read, half rows as they are) and re-rank only the rows that can enter a list (mma_eps): ids
    and distances equal the canonical stream kernel's and the CPU's, bit for bit, on trees and
    forests (a row reached through two trees), for k from 1 to 16, on data where the estimate is
    tight, loose, tied or out of half's range."""
    import dataclasses

    import cupy as cp

    from scanforest.kernels.knn import _kdtree_gpu
    from scanforest.kernels.knn.kdtree import build_kdforest

    for name, X, Q in _tensor_core_cases(rng):
        if rows == "float16":  # an index of half rows holds values half can
            if name == "rows beyond half":
                continue
            X = X.astype(np.float16).astype(np.float32)
        for full in (build_kdtree(cp.asarray(X), leaf_size=48),
                     build_kdforest(cp.asarray(X), n_trees=3, random_dims=5, leaf_size=48)):
            tree = full if rows == "float32" else dataclasses.replace(full, points=full.points.astype(cp.float16),
                                                                      data=None)
            monkeypatch.setattr(_kdtree_gpu, "MMA_FILTER", "half")  # the default: half rows only
            assert _kdtree_gpu.mma_fits(tree, X.shape[1], 4) == (rows == "float16")
            monkeypatch.setattr(_kdtree_gpu, "MMA_FILTER", True)
            assert _kdtree_gpu.mma_fits(tree, X.shape[1], 16)
            host = tree.to_numpy()
            for budget, per_round in ((8, 4), (64, 16), (None, None)):
                for k in (1, 4, 16):
                    kw = dict(method="banns", backtracks=budget, leaves_per_round=per_round, finish_below=0)
                    got = {}
                    for mma in (True, False):
                        monkeypatch.setattr(_kdtree_gpu, "MMA_FILTER", mma)
                        d2, ids, st = query_kdtree(tree, cp.asarray(Q), k, return_stats=True, **kw)
                        got[mma] = (d2.get(), ids.get())
                        assert ("mma_rows_reranked" in st) == mma
                    msg = f"{name}, {full.n_trees} tree(s), budget {budget}, k {k}"
                    np.testing.assert_array_equal(got[True][1], got[False][1], err_msg=msg)
                    np.testing.assert_array_equal(got[True][0], got[False][0], err_msg=msg)
                    if budget:
                        cd, ci = query_kdtree(host, Q, k, method="banns", backtracks=budget,
                                              leaves_per_round=per_round)
                        np.testing.assert_array_equal(got[True][1], ci, err_msg=msg + " (CPU)")
                        np.testing.assert_array_equal(got[True][0], cd, err_msg=msg + " (CPU)")


@pytest.mark.gpu
@pytest.mark.parametrize("descent", ["box", "path", "incremental"])
def test_gpu_budget_sized_queue_matches_cpu(rng, monkeypatch, descent):
    """The queue capacity that grows with the budget (512 and 2,048 boxes here) is the same on
    both devices: P-ANNS and every P-BANNS leaf kernel return the CPU answer bit for bit."""
    q = functools.partial(query_kdtree, descent=descent)
    import cupy as cp

    from scanforest.kernels.knn import _kdtree_gpu

    X = rng.standard_normal((20000, 24)).astype(np.float32)
    Q = rng.standard_normal((300, 24)).astype(np.float32)
    ct = build_kdtree(X, leaf_size=4, device="cpu")
    gt = build_kdtree(cp.asarray(X), leaf_size=4)
    for b in (300, 2000):
        cd, ci, cs = q(ct, Q, 8, backtracks=b, return_stats=True)
        ad, ai, gs = q(gt, cp.asarray(Q), 8, backtracks=b, method="anns", return_stats=True)
        np.testing.assert_array_equal(ai.get(), ci)
        np.testing.assert_array_equal(gs["leaves_visited"], cs["leaves_visited"])
        for kern in ("stream", "rotate"):
            monkeypatch.setattr(_kdtree_gpu, "WINDOW_KERNEL", kern)  # the CPU's rounds follow it too
            cd, ci = q(ct, Q, 8, backtracks=b, method="banns")
            bd, bi = q(gt, cp.asarray(Q), 8, backtracks=b, method="banns", finish_below=0)
            np.testing.assert_array_equal(bi.get(), ci, err_msg=kern)
            np.testing.assert_array_equal(bd.get(), cd, err_msg=kern)


def test_bounded_queue_keeps_the_closest_boxes():
    """The queue of pending boxes (a min-max heap) pops the closest box and, when full, replaces
    its farthest by a closer one, like a sorted list that keeps the ``cap`` smallest; checked on
    random push/pop sequences with many ties and every capacity from 1 to 40."""
    from numba import njit

    from scanforest.kernels.knn import _kdtree_cpu as K

    @njit
    def run(ops, vals, cap, pops, evs):
        hd = np.empty(cap, np.float32)
        hn = np.empty(cap, np.int32)
        size = n_pop = n_ev = 0
        for t in range(ops.shape[0]):
            if ops[t] == 0:
                size, ev = K._heap_push_bounded(hd, hn, size, cap, vals[t], t)
                evs[n_ev] = ev
                n_ev += 1
            elif size > 0:
                pops[n_pop] = hd[0]
                n_pop += 1
                size = K._heap_pop(hd, hn, size)
        return n_pop, n_ev

    rng = np.random.default_rng(1)
    for cap in range(1, 41):
        for _ in range(5):
            n = int(rng.integers(1, 400))
            ops = (rng.random(n) < rng.random() * 0.5).astype(np.int64)  # 1: pop the closest
            vals = rng.integers(0, 30, n).astype(np.float32)
            pops, evs = np.empty(n, np.float32), np.empty(n, np.float32)
            a, b = run(ops, vals, cap, pops, evs)
            kept, ref_pops, ref_evs = [], [], []
            for t in range(n):
                if ops[t] == 0:
                    if len(kept) < cap:
                        kept.append(vals[t])
                        ref_evs.append(-1.0)
                    elif vals[t] < max(kept):
                        ref_evs.append(max(kept))
                        kept.remove(max(kept))
                        kept.append(vals[t])
                    else:
                        ref_evs.append(vals[t])
                elif kept:
                    ref_pops.append(min(kept))
                    kept.remove(min(kept))
            assert list(pops[:a]) == ref_pops and list(evs[:b]) == ref_evs


def test_descent_is_checked_and_both_bounds_search_alike(rng):
    """``descent`` names one of the two bounds; an unknown one is an InputError (one line), and
    on the same tree and budget both bounds reach a similar recall (the looser O(1) bound only
    changes the order in which near-equal boxes are taken)."""
    X = rng.standard_normal((5000, 16)).astype(np.float32)
    Q = rng.standard_normal((200, 16)).astype(np.float32)
    tree = build_kdtree(X, leaf_size=8, device="cpu")
    with pytest.raises(InputError, match="descent must be one of auto, box, path, incremental"):
        query_kdtree(tree, Q, 4, descent="tight")
    with pytest.raises(InputError, match="descent"):
        KDForest(descent="fast").fit(X)
    ed, _ = knn_bruteforce(X, Q, 4, device="cpu")
    rb = recall(query_kdtree(tree, Q, 4, backtracks=64, descent="box")[0], ed)
    rp = recall(query_kdtree(tree, Q, 4, backtracks=64, descent="path")[0], ed)
    ri = recall(query_kdtree(tree, Q, 4, backtracks=64, descent="incremental")[0], ed)
    assert 0.5 < rb < 1 and abs(rp - rb) < 0.05 and abs(ri - rb) < 0.05
    np.testing.assert_array_equal(query_kdtree(tree, Q, 4, backtracks=64)[1],  # auto = incremental
                                  query_kdtree(tree, Q, 4, backtracks=64, descent="incremental")[1])


def test_pcl_shot_dataset_fixed_radius(pcl_dir, tmp_path):
    """bench tools --radius: the near-duplicate-heavy variant computes every cloud's SHOT at the
    given support radius (the same descriptors as sf.shot at that radius), and the bench says
    what share of the rows repeat another; --radius without --real is one InputError."""
    import shutil

    import scanforest as sf
    from scanforest.deploy.bench import tools as bench_tools
    from scanforest.deploy.bench._data import pcl_shot_dataset
    from scanforest.kernels.errors import InputError

    shutil.copy(pcl_dir / "bun0.pcd", tmp_path / "bun0.pcd")
    X, Q, _ = pcl_shot_dataset(tmp_path, device="cpu", max_queries=1000, radius=0.02)
    pts = sf.read(pcl_dir / "bun0.pcd").points.astype(np.float32)
    nrm, _ = sf.normals(pts, k=10, device="cpu")
    ref, _ = sf.shot(pts, nrm, np.arange(len(pts)), 0.02, device="cpu")
    ref = ref[np.isfinite(ref[:, 0])]
    key = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731
    np.testing.assert_array_equal(key(np.concatenate([X, Q])), key(ref))
    rows = np.array([[1, 2], [3, 4], [1, 2], [5, 6]], np.float32)
    assert bench_tools._duplicate_share(rows) == 0.5
    with pytest.raises(InputError, match="--radius"):
        bench_tools.run(100, 10, 4, 2, device="cpu", radius=0.02, out=tmp_path / "t.json")
    rep = bench_tools.run(0, 20, 352, 4, device="cpu", real=str(tmp_path), radius=0.02, trees=1, leaf_size=16,
                          budgets=[1], nprobes=[], ef_search=[], threads=2, repeat=1, targets=[0.5],
                          out=tmp_path / "r.json")
    assert rep.params["radius"] == 0.02
    assert any("support 2 cm on every cloud" in n for n in rep.notes)
    assert any("of the indexed rows repeat another bit for bit" in n for n in rep.notes)
