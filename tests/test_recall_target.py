"""KDForest's device defaults and its recall targets (``recall=``: a budget calibrated on its own rows)."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.errors import InputError
from scanforest.kernels.knn.bruteforce import knn_bruteforce
from scanforest.kernels.knn.kdforest import DEVICE_DEFAULTS, KDForest

# the held-out recall may fall short of the target by the calibration's sampling error: 2,000
# sampled rows x k slots, a standard error of ~0.005 near 0.9; three of them
TOLERANCE = 0.015


def _clusters(rng, n, d, centres):
    """Rows around shared Gaussian cluster centres (rows and held-out queries alike)."""
    return (centres[rng.integers(0, len(centres), n)] + rng.standard_normal((n, d))).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    d = 48
    centres = rng.standard_normal((300, d)) * 3
    return _clusters(rng, 30000, d, centres), _clusters(rng, 1500, d, centres)


def _recall64(X, Q, ids, k):
    """Recall@k of ``ids`` against the exact float64 answer (a returned row counts when its
    distance is at most the exact k-th, ties count): an independent reference."""
    X64, Q64 = X.astype(np.float64), Q.astype(np.float64)
    xn = (X64 ** 2).sum(1)
    kth = np.empty(len(Q64))
    for a in range(0, len(Q64), 256):  # (256, N) float64 blocks
        q = Q64[a:a + 256]
        d2 = (q ** 2).sum(1)[:, None] + xn[None, :] - 2 * q @ X64.T
        kth[a:a + 256] = np.partition(d2, k - 1, axis=1)[:, k - 1]
    got = ((Q64[:, None, :] - X64[ids]) ** 2).sum(-1)
    return float(((ids >= 0) & (got <= kth[:, None] + 1e-9 * (1 + kth[:, None]))).mean())


def test_cpu_defaults_resolved(data):
    X, _ = data
    f = KDForest(device="cpu")
    assert f.n_trees is None and f.leaf_size is None  # left to the device
    f.fit(X)
    assert (f.n_trees_, f.leaf_size_) == (DEVICE_DEFAULTS["cpu"]["n_trees"], DEVICE_DEFAULTS["cpu"]["leaf_size"])
    assert (f.n_trees_, f.leaf_size_) == (4, 32)  # the measured CPU default (docs/benchmarks.md)
    assert f.tree_.n_trees == 4 and f.tree_.leaf_size == 32
    assert DEVICE_DEFAULTS["gpu"] == {"n_trees": 1, "leaf_size": 64, "descent": "beam"}  # the GPU's
    # given values win; one-dimensional rows default to one tree (randomized trees need d >= 2)
    g = KDForest(n_trees=2, leaf_size=16, device="cpu").fit(X[:2000])
    assert (g.n_trees_, g.leaf_size_, g.tree_.n_trees) == (2, 16, 2)
    assert KDForest(device="cpu").fit(X[:500, :1]).n_trees_ == 1


@pytest.mark.parametrize("target", [0.85, 0.95])
def test_recall_target_on_held_out_queries(data, target):
    X, Q = data
    k = 4
    f = KDForest(device="cpu").fit(X, recall=target, recall_k=k)
    c = f.calibration_
    assert c["target"] == target and c["k"] == k and c["sample"] == 2000 and c["seconds"] > 0
    assert c["budget"] is not None and c["recall"] >= target
    # the smallest budget that met the target: the largest budget tried below it missed it
    below = [r for b, r in c["probes"] if b is not None and b < c["budget"]]
    assert below and all(r < target for r in below[-1:])
    d, ids = f.query(Q, k)
    assert f.stats_["backtracks"] == c["budget"]
    assert _recall64(X, Q, ids, k) >= target - TOLERANCE
    # the same target given per query: the cached calibration, the same answer
    d2, ids2 = KDForest(device="cpu").fit(X).query(Q, k, recall=target)
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(d2, d)


def test_recall_calibrated_per_k_and_cached(data):
    X, Q = data
    f = KDForest(device="cpu").fit(X)
    f.query(Q[:10], 1, recall=0.9)
    first = f.calibration_
    assert first["k"] == 1
    _, ids = f.query(Q, 8, recall=0.9)
    assert f.calibration_["k"] == 8 and f.calibration_ is not first
    assert _recall64(X, Q, ids, 8) >= 0.9 - TOLERANCE
    f.query(Q[:10], 1, recall=0.9)
    assert f.calibration_ is first  # cached per (k, recall)


def test_unlimited_budget_is_brute_force(data):
    X, Q = data
    f = KDForest(device="cpu").fit(X)  # the defaults: backtracks=None, exact
    bd, bi = knn_bruteforce(X, Q[:300], 5, device="cpu")
    d, i = f.query(Q[:300], 5)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(d, bd)
    # a per-call override of a fit(recall=) target by an unlimited budget is exact too
    g = KDForest(device="cpu").fit(X, recall=0.8)
    d, i = g.query(Q[:300], 5, backtracks=None)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(d, bd)


def test_recall_with_budget_is_an_input_error(data):
    X, Q = data
    with pytest.raises(InputError, match="not both"):
        KDForest(backtracks=32, device="cpu").fit(X[:2000], recall=0.9)
    f = KDForest(device="cpu").fit(X[:2000])
    with pytest.raises(InputError, match="not both"):
        f.query(Q[:5], 4, recall=0.9, backtracks=16)
    with pytest.raises(InputError, match="not both"):
        KDForest(backtracks=32, device="cpu").fit(X[:2000]).query(Q[:5], 4, recall=0.9)
    for bad in (0, 1, 1.5, -0.1, True, "0.9"):
        with pytest.raises(InputError, match="recall must be"):
            f.query(Q[:5], 4, recall=bad)


def test_recall_on_a_small_index():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((200, 8)).astype(np.float32)
    f = KDForest(leaf_size=8, device="cpu").fit(X, recall=0.99)
    assert f.calibration_["sample"] == 200 and f.calibration_["recall"] >= 0.99
    f.query(X[:3], 200, recall=0.9)  # k + 1 > N: scored on the N - 1 other rows
    assert f.calibration_["recall"] >= 0.9
    e = KDForest(method="exact", device="cpu").fit(X, recall=0.9)
    assert e.query(X[:3], 2)[1][:, 0].tolist() == [0, 1, 2]


@pytest.mark.gpu
def test_recall_target_gpu(data):
    import cupy as cp

    X, Q = data
    f = KDForest(device="gpu").fit(cp.asarray(X), recall=0.9)
    assert (f.n_trees_, f.leaf_size_) == (1, 64)
    _, ids = f.query(cp.asarray(Q), 4)
    assert _recall64(X, Q, cp.asnumpy(ids), 4) >= 0.9 - TOLERANCE


def test_bench_tools_recall_rows(tmp_path):
    """``bench tools --recall``: KDForest() (the device's defaults) at each target, its calibrated
    budget and estimate in the rows, its point on scanforest's curve."""
    from scanforest.deploy.bench import tools as bench_tools

    rep = bench_tools.run(3000, 200, 16, 4, device="cpu", trees=1, leaf_size=16, budgets=[2], nprobes=[],
                          ef_search=[], threads=2, clusters=30, repeat=1, targets=[0.9], recalls=[0.9],
                          out=tmp_path / "t.json")
    rows = {r.figure: r for r in rep.rows}
    q = next(r for f, r in rows.items() if f.startswith("scanforest KDForest() recall=0.9 queries/s (4 trees, "
                                                        "leaf size 32"))
    assert q.extra["target"] == 0.9 and q.extra["estimate"] >= 0.9 and q.extra["recall"] >= 0.9 - TOLERANCE
    assert any(f.startswith("scanforest KDForest() recall=0.9 calibration (") for f in rows)
    with pytest.raises(InputError, match="recall must be"):
        bench_tools.run(100, 10, 4, 2, device="cpu", recalls=[1.0], out=tmp_path / "b.json")


def test_stored_index_with_a_recall_target(tmp_path, data):
    """``index build --recall``: the target is a stored parameter (hashed); the stored layout stays
    one tree of 64-row leaves whatever the device's defaults; each loaded shard calibrates its
    own budget on its rows at its first search."""
    from scanforest.tasks import index as idx

    X, Q = data
    X = X[:8000]
    store = str(tmp_path / "s.zarr")
    res = idx.build_index(store, "r", X, params={"method": "banns", "recall": 0.9})
    assert res["status"] == "built"
    assert idx.build_index(store, "r", X, params={"method": "banns", "recall": 0.95})["content_hash"] \
        != res["content_hash"]
    shard = idx.load_shard(store, "r", 0, "cpu")
    f = shard.forest
    assert f.recall_target_ == 0.95 and f.tree_.n_trees == 1 and f.tree_.leaf_size == 64
    _, ids = shard.query(Q, 4)
    assert f.calibration_["target"] == 0.95 and f.calibration_["k"] == 4
    assert _recall64(X, Q, ids, 4) >= 0.95 - TOLERANCE
