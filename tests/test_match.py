"""Sharded and distributed matching equals the single-device brute force exactly."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.flows.distributed import DistributedIndex, match
from scanforest.kernels.errors import InputError
from scanforest.kernels.knn.bruteforce import knn_bruteforce
from scanforest.kernels.knn.sharded import Shard, ShardedIndex, shard_ranges
from scanforest.kernels.knn.topk import merge_topk
from scanforest.tasks import index as idx


def _data(rng, n=3000, m=400, d=24, dup=True):
    X = rng.normal(size=(n, d)).astype(np.float32)
    if dup:  # duplicates across shard borders make the tie rule matter
        X[n // 2: n // 2 + 50] = X[:50]
        X[-20:] = X[100:120]
    Q = rng.normal(size=(m, d)).astype(np.float32)
    Q[:30] = X[:30]
    return X, Q


def test_merge_topk_orders_by_distance_then_id():
    d1 = np.array([[1.0, 2.0]], np.float32)
    i1 = np.array([[7, 3]])
    d2 = np.array([[1.0, 0.5]], np.float32)
    i2 = np.array([[2, 9]])
    d, i = merge_topk([(d1, i1), (d2, i2)], 3)
    np.testing.assert_array_equal(i, [[9, 2, 7]])
    np.testing.assert_array_equal(d, [[0.5, 1.0, 1.0]])


def test_shard_ranges():
    assert shard_ranges(10, 3) == [(0, 3), (3, 7), (7, 10)]
    with pytest.raises(InputError):
        shard_ranges(2, 3)


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("method", ["exact", "anns"])
def test_sharded_equals_bruteforce(rng, shards, method):
    X, Q = _data(rng)
    bd, bi = knn_bruteforce(X, Q, 8, device="cpu")
    index = ShardedIndex(shards=shards, method=method, leaf_size=32, backtracks=None, device="cpu").fit(X)
    d, i = index.query(Q, 8)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(d, bd)


@pytest.fixture(scope="module")
def local_client():
    from scanforest.flows.cluster import dask_client

    with dask_client(None, n_workers=2, device="cpu") as c:
        yield c


@pytest.mark.parametrize("method", ["exact", "banns"])
def test_a_searched_shard_moves_to_another_worker(rng, local_client, method):
    """A shard resident on one worker and searched there (its exact search then cached in it)
    is handed to another worker as a search's input, as Dask does when it runs a loose search
    elsewhere: it pickles (the cache stays behind and is made again) and answers the same. It
    once held module references: the hand-over failed and the match flow waited forever."""
    import operator

    from scanforest.kernels.knn.kdforest import KDForest

    X, Q = _data(rng)
    a, b = sorted(local_client.scheduler_info()["workers"])
    shard = local_client.submit(KDForest(method=method, leaf_size=32, device="cpu").fit, X, workers=[a], pure=False)
    search = operator.methodcaller("query", Q, 4)
    here = local_client.submit(search, shard, workers=[a], pure=False).result(timeout=60)
    there = local_client.submit(search, shard, workers=[b], allow_other_workers=False, pure=False).result(timeout=60)
    np.testing.assert_array_equal(here[1], there[1])
    np.testing.assert_array_equal(here[0], there[0])
    if method == "exact":
        bd, bi = knn_bruteforce(X, Q, 4, device="cpu")
        np.testing.assert_array_equal(there[1], bi)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_distributed_equals_bruteforce(tmp_path, rng, local_client, shards):
    X, Q = _data(rng)
    bd, bi = knn_bruteforce(X, Q, 4, device="cpu")
    store = str(tmp_path / "s.zarr")
    res = idx.build_index(store, "t", X, shards=shards, params={"method": "anns", "leaf_size": 32})
    assert res["status"] == "built"
    assert idx.build_index(store, "t", X, shards=shards, params={"method": "anns", "leaf_size": 32})["status"] == "unchanged"
    d, i = match(Q, (store, "t"), 4, client=local_client)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(d, bd)
    # small blocks: many reductions in flight
    di = DistributedIndex(local_client, store, "t")
    d2, i2 = di.query(Q, 4, block=97)
    np.testing.assert_array_equal(i2, bi)
    # the queries read by the workers from a file: the same answer, blocks and all
    d3, i3 = di.query(idx.QueryFile.write(tmp_path / "q.npy", Q), 4, block=97)
    np.testing.assert_array_equal(i3, bi)
    np.testing.assert_array_equal(d3, bd)
    with pytest.raises(InputError, match="must be"):
        di.query(idx.QueryFile.write(tmp_path / "q2.npy", Q[:, :5]), 4)
    if shards != 2:  # the path below is the same for every shard count (CI's time)
        di.close()
        return
    # the queries read by the workers from described scans in the store, keypoints without a
    # descriptor (NaN rows) among them: those answer (inf, -1), the others the brute force's
    from scanforest.tasks.store import ScanStore

    st = ScanStore(store)
    Qn = Q.copy()
    Qn[[0, 5, 6, len(Q) - 1]] = np.nan
    cuts = [0, 7, 7, 150, len(Q)]  # an empty scan among them, blocks that span scans
    for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
        sid = f"q{j}"
        st.write_scan(sid, {"points": np.zeros((1, 3), np.float32)}, {"source": sid, "sha256": sid})
        st.write_stage(sid, "describe", {"kp_shot": Qn[a:b].astype(np.float32)}, {"radius": 0.02})
    src = idx.StoredQueries.of(st, [f"q{j}" for j in range(len(cuts) - 1)])
    assert src.shape == Q.shape and src.rows == (7, 0, 143, len(Q) - 150)
    np.testing.assert_array_equal(src.read(3, 160), Qn[3:160].astype(np.float32))
    d4, i4 = di.query(src, 4, block=61)
    bad = ~np.isfinite(Qn).all(axis=1)
    assert (i4[bad] == -1).all() and np.isinf(d4[bad]).all()
    np.testing.assert_array_equal(i4[~bad], bi[~bad])
    np.testing.assert_array_equal(d4[~bad], bd[~bad])
    # with the bound synchronisation (per-query bounds masked with the rows) and no budget limit
    d5, i5 = di.query(src, 4, block=61, sync_after=1, backtracks=10 ** 6)
    assert (i5[bad] == -1).all()
    np.testing.assert_array_equal(i5[~bad], bi[~bad])
    di.close()


def test_index_rebuilds_when_reference_changes(tmp_path, rng):
    X, _ = _data(rng, n=500)
    store = str(tmp_path / "s.zarr")
    h1 = idx.build_index(store, "t", X, shards=2, params={"method": "anns"})["content_hash"]
    X[0, 0] += 1
    r = idx.build_index(store, "t", X, shards=2, params={"method": "anns"})
    assert r["status"] == "built" and r["content_hash"] != h1
    with pytest.raises(InputError, match="NaN"):
        X[3, 3] = np.nan
        idx.build_index(store, "u", X)


def test_index_records_its_split_rule_and_rebuilds_when_it_changes(tmp_path, rng):
    """The trees' split rule is part of the index even when left to the default: an index built
    with another rule is rebuilt by a call that takes the default, and the stored trees are the
    default rule's."""
    from scanforest.kernels.knn.kdforest import KDForest
    from scanforest.tasks.store import ScanStore

    X, _ = _data(rng, n=600)
    store = str(tmp_path / "s.zarr")
    old = idx.build_index(store, "t", X, params={"method": "anns", "leaf_size": 16, "split": "median"})
    new = idx.build_index(store, "t", X, params={"method": "anns", "leaf_size": 16})
    assert new["status"] == "built" and new["content_hash"] != old["content_hash"]
    assert ScanStore(store, mode="r").catalog.index_attrs("t")["params"]["split"] == KDForest().split == "variance"
    again = idx.build_index(store, "t", X, params={"method": "anns", "leaf_size": 16, "split": "variance"})
    assert again["status"] == "unchanged"
    tree = idx.load_shard(store, "t", 0, "cpu").forest.tree_
    fit = KDForest(method="anns", n_trees=1, leaf_size=16, device="cpu").fit(X).tree_  # a stored index: one tree
    np.testing.assert_array_equal(tree.split_dim, fit.split_dim)
    np.testing.assert_array_equal(tree.split_val, fit.split_val)
    exact = idx.build_index(store, "e", X, params={"method": "exact"})  # no trees: no split rule
    assert exact["status"] == "built" and "split" not in ScanStore(store, mode="r").catalog.index_attrs("e")["params"]


def test_persisted_forest_shard_answers_like_the_fitted_one(tmp_path, rng):
    """A randomized forest (several trees) round-trips through the store: same roots, same answer."""
    X, Q = _data(rng, n=1200, m=150)
    store = str(tmp_path / "s.zarr")
    params = {"method": "anns", "n_trees": 3, "leaf_size": 16, "backtracks": 8, "random_dims": 4}
    idx.build_index(store, "f", X, shards=2, params=params)
    for s in range(2):
        sh = idx.load_shard(store, "f", s, device="cpu")
        assert sh.forest.tree_.n_trees == 3
        fresh = idx._fit_forest(X[sh.start:sh.stop], params, s, "cpu")
        d0, i0 = sh.query(Q, 4)
        d1, i1 = fresh.query(Q, 4)
        np.testing.assert_array_equal(i0, np.where(i1 >= 0, i1 + sh.start, -1))
        np.testing.assert_array_equal(d0, d1)


@pytest.mark.parametrize("shards", [2, 3])
def test_bound_synchronisation_is_exact_and_prunes(tmp_path, rng, local_client, shards):
    """Two-phase global bound synchronisation: with an unlimited budget the answer is still the
    brute force (ties included); with a budget, recall does not drop and the leaf count is the
    sum of both phases."""
    X, Q = _data(rng)
    k = 4
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, shards=shards, params={"method": "anns", "leaf_size": 16})
    di = DistributedIndex(local_client, store, "t")
    d0, i0 = di.query(Q, k, block=150)
    plain = di.stats_["leaves"]
    d1, i1 = di.query(Q, k, block=150, sync_after=2)
    synced = di.stats_["leaves"]
    di.close()
    np.testing.assert_array_equal(i0, bi)
    np.testing.assert_array_equal(i1, bi)
    np.testing.assert_array_equal(d1, bd)
    # phase 2 of an exact search prunes with the global bound, never scans more than the plain search
    assert 0 < synced <= plain + 2 * len(Q) * shards
    # with a budget: the second phase only adds candidates to the first phase's global top-k
    store2 = str(tmp_path / "b.zarr")
    idx.build_index(store2, "t", X, shards=shards, params={"method": "anns", "leaf_size": 16, "backtracks": 8})
    di = DistributedIndex(local_client, store2, "t")
    da, _ = di.query(Q, k, block=150)
    db, _ = di.query(Q, k, block=150, sync_after=4)
    with pytest.raises(InputError):
        di.query(Q, k, sync_after=0)
    # a budget set per query: the index's own (8) gives the same answer; 2 scans at most 2 per shard
    dc, _ = di.query(Q, k, block=150, backtracks=8)
    np.testing.assert_array_equal(dc, da)
    di.query(Q, k, block=150, backtracks=2)
    assert 0 < di.stats_["leaves"] <= 2 * len(Q) * shards and di.stats_["backtracks"] == 2
    with pytest.raises(InputError, match="backtracks"):
        di.query(Q, k, backtracks=0)
    di.close()
    from scanforest.kernels.knn.bruteforce import recall

    assert recall(db, bd, k) >= recall(da, bd, k) - 0.02
    assert np.all(np.diff(db, axis=1) >= 0)


def test_shards_stay_on_their_workers(tmp_path, rng, local_client):
    """Query blocks travel to the shards, never the shards to the queries: after many blocks
    every shard is held only by the worker it was loaded on."""
    X, Q = _data(rng, n=20000, m=2000, d=64)
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, shards=2, params={"method": "anns", "leaf_size": 32, "backtracks": 8})
    di = DistributedIndex(local_client, store, "t")
    local_client.gather(di.shards)
    for sync in (None, 2):
        di.query(Q, 4, block=200, sync_after=sync)
    held = local_client.who_has(di.shards)
    for i, f in enumerate(di.shards):
        assert set(held[f.key]) == {di.placement[i]}, (i, held[f.key], di.placement[i])
    di.close()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_loaded_shard_holds_one_copy_of_its_rows(tmp_path, rng, device, dtype):
    """A loaded forest shard keeps only the leaf-ordered rows (no input-order copy, no second
    copy for the exact fallbacks) and still answers an unlimited search exactly."""
    from scanforest.kernels.backend import to_numpy
    from scanforest.kernels.knn.sharded import gather_rows

    X, Q = _data(rng, n=3000, m=40, d=8)
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, shards=2, params={"method": "anns", "leaf_size": 1, "backtracks": None},
                    dtype=dtype)
    X = X.astype(dtype).astype(np.float32)  # the stored rows
    bd, bi = knn_bruteforce(X, Q, 200, device="cpu")
    parts = []
    for s in range(2):
        sh = idx.load_shard(store, "t", s, device)
        tree = sh.forest.tree_
        assert tree.data is None and sh.forest._fit_X is None
        # a float16 index keeps half rows on a GPU (widened exactly by the kernels)
        assert tree.points.dtype == (np.float16 if (device, dtype) == ("gpu", "float16") else np.float32)
        perm = to_numpy(tree.perm)
        np.testing.assert_array_equal(to_numpy(tree.points), gather_rows(X[sh.start:sh.stop], perm))
        sh.forest.heap_cap = 256  # a queue that overflows (the default grows with the budget)
        d, i = idx.search_shard(sh, Q, 200)
        assert sh.forest.stats_["heap_overflow"] > 0  # the exact fallback ran
        parts.append((d, i))
    d, i = merge_topk(parts, 200)
    np.testing.assert_array_equal(to_numpy(i), bi)
    np.testing.assert_array_equal(to_numpy(d), bd)


def test_plan_counts_half_rows_of_a_float16_index_on_gpus():
    """A float16 index holds its forest rows in half precision on GPUs: the plan (and the
    refusal of an index that does not fit) counts 2 bytes a value there, 4 on the host."""
    from scanforest.kernels.knn.sharded import plan_shards, shard_resident_bytes

    full = shard_resident_bytes(50_000_000, 352)
    half = shard_resident_bytes(50_000_000, 352, row_bytes=2)
    assert full - half == 50_000_000 * (352 * 2 - 4)  # half rows, plus their float32 norms (tensor-core scan)
    assert idx.resident_row_bytes("float16", "gpu") == 2
    assert idx.resident_row_bytes("float16", "cpu") == 4 and idx.resident_row_bytes("float32", "gpu") == 4
    gib = 2 ** 30
    # 50M x 352 on one 80 GiB GPU: float32 rows do not fit, half rows do
    assert not plan_shards(50_000_000, 352, 80 * gib).fits
    assert plan_shards(50_000_000, 352, 80 * gib, row_bytes=2).fits
    for dtype in ("float32", "float16"):  # the host widens a float16 index to float32 rows
        with pytest.raises(InputError, match="does not fit"):
            idx.plan_for(50_000_000, 352, {}, "cpu", memory=[80 * gib], dtype=dtype)


def test_row_blocks_cover_a_range_on_chunk_boundaries(tmp_path):
    """A shard streams from the store in chunk-aligned blocks that cover its rows exactly once,
    whatever its first row and the block size."""
    import zarr

    z = zarr.create_array(str(tmp_path / "z.zarr"), shape=(1000, 6), chunks=(64, 6), dtype="float16")
    for a, b, nbytes in [(0, 1000, 1), (37, 1000, 64 * 12 * 3), (130, 131, 1 << 20), (64, 640, 64 * 12 * 2)]:
        blocks = list(idx._row_blocks(z, a, b, nbytes))
        assert blocks[0][0] == a and blocks[-1][1] == b
        assert all(j == i2 for (_, j), (i2, _) in zip(blocks, blocks[1:]))
        assert all(i < j for i, j in blocks)
        assert all(j % 64 == 0 for _, j in blocks[:-1])  # each block ends on a chunk boundary
        assert max(j - i for i, j in blocks) <= max(64, (nbytes // (64 * 12)) * 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("where", ["device", "host", "auto"])
def test_gpu_shard_rows_stream_to_the_device(tmp_path, rng, dtype, where):
    """A shard's rows reach the GPU in small blocks, gathered into leaf order on the device or
    on the host, and equal the host gather of the stored rows bit for bit (replicated forests:
    one leaf-ordered copy per tree)."""
    import cupy as cp

    from scanforest.kernels.knn.sharded import gather_rows
    from scanforest.tasks.store import ScanStore

    X, _ = _data(rng, n=5000, m=40, d=12)
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, shards=2, params={"method": "anns", "leaf_size": 8}, dtype=dtype,
                    build_trees=False)
    z = ScanStore(store, mode="r").root["indexes"]["t"]["reference"]
    a, b = 2500, 5000
    host = X[a:b].astype(dtype).astype(np.float32)
    perm = np.concatenate([rng.permutation(b - a), rng.permutation(b - a)])  # two trees' orders
    small = 12 * 4 * 300  # about 300 rows per block: several blocks and a partial last one
    got = idx._leaf_rows(z, a, b, perm, "gpu", where=where, nbytes=small)
    assert isinstance(got, cp.ndarray) and got.dtype == cp.float32 and got.shape == (2 * (b - a), 12)
    np.testing.assert_array_equal(cp.asnumpy(got), gather_rows(host, perm))
    rows = idx._stored_rows(z, a, b, "gpu", nbytes=small)
    np.testing.assert_array_equal(cp.asnumpy(rows), host)
    if dtype == "float16":  # kept in half precision (what a float16 index holds on a GPU)
        half = idx._leaf_rows(z, a, b, perm, "gpu", where=where, nbytes=small, dtype=np.float16)
        assert half.dtype == cp.float16
        np.testing.assert_array_equal(cp.asnumpy(half).astype(np.float32), gather_rows(host, perm))
    else:
        with pytest.raises(InputError, match="float16 store"):
            idx._leaf_rows(z, a, b, perm, "gpu", dtype=np.float16)


def test_float16_index_is_exact_for_its_rounded_rows(tmp_path, rng, local_client):
    """``dtype="float16"`` stores half the bytes; trees and searches use the stored (rounded)
    rows, so an unlimited search equals the brute force over them, ids and distances."""
    from scanforest.tasks.store import ScanStore

    X, Q = _data(rng, n=3000, m=50, d=16)
    store = str(tmp_path / "h.zarr")
    params = {"method": "banns", "leaf_size": 16, "backtracks": None}
    res = idx.build_index(store, "h", X, shards=2, params=params, dtype="float16")
    assert res["status"] == "built"
    g = ScanStore(store, mode="r").root["indexes"]["h"]
    assert str(g["reference"].dtype) == "float16" and g.attrs["dtype"] == "float16"
    X16 = X.astype(np.float16).astype(np.float32)
    bd, bi = knn_bruteforce(X16, Q, 8, device="cpu")
    di = DistributedIndex(local_client, store, "h")
    d, i = di.query(Q, 8, block=20)
    di.close()
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(d, bd)
    assert idx.build_index(store, "h", X, shards=2, params=params, dtype="float16")["status"] == "unchanged"
    assert idx.build_index(store, "h", X, shards=2, params=params)["status"] == "built"  # float32: a new index
    with pytest.raises(InputError, match="float16's range"):
        idx.build_index(store, "big", X * 1e5, params=params, dtype="float16")
    with pytest.raises(InputError, match="dtype must be"):
        idx.build_index(store, "x", X, params=params, dtype="int8")


def _generated(n, d, dtype, shards, n_trees=1, piece=700):
    from scanforest.deploy.bench.match import GeneratedShards

    params = {"method": "banns", "leaf_size": 16, "backtracks": None, "n_trees": n_trees}
    return GeneratedShards(n, d, 20, dtype, tuple(sorted(params.items())), shards, piece=piece)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_generated_shards_are_the_bench_reference(dtype):
    """The bench's reference drawn shard by shard on the workers has the rows of the one drawn
    whole in pieces for a store (every shard border, piece border and both dtypes)."""
    from scanforest.deploy.bench.match import _reference

    g = _generated(5000, 16, dtype, 3)
    X = _reference(5000, 16, 20, "cpu", dtype, piece=700, whole_max=0)
    assert X.dtype == np.dtype(dtype)
    for a, b in [(0, 5000), (650, 1450), (699, 701), (4200, 5000)]:
        np.testing.assert_array_equal(g.rows(a, b, np, np.float32), X[a:b].astype(np.float32))
    assert g.attrs["shards"] == [[0, 1667], [1667, 3333], [3333, 5000]]
    assert g.attrs["content_hash"] != _generated(5000, 16, dtype, 2).attrs["content_hash"]


@pytest.mark.parametrize("shards,n_trees", [(1, 1), (2, 2), (3, 1)])
def test_generated_shards_answer_as_the_brute_force(rng, local_client, shards, n_trees):
    """Shards drawn and indexed on the workers (no store): an unlimited search over 1, 2 and 3
    of them equals the brute force over the drawn rows, and so does their exact method."""
    from scanforest.kernels.backend import to_numpy
    from scanforest.kernels.knn.sharded import gather_rows

    g = _generated(4000, 12, "float16", shards, n_trees=n_trees)
    X = g.rows(0, 4000, np, np.float32)
    Q = X[rng.choice(4000, 60, replace=False)] + rng.normal(scale=0.05, size=(60, 12)).astype(np.float32)
    bd, bi = knn_bruteforce(X, Q, 6, device="cpu")
    sh = g.load(shards - 1, "cpu")  # the leaf-ordered rows of every tree, drawn again and scattered
    perm = to_numpy(sh.forest.tree_.perm)
    assert perm.size == n_trees * (sh.stop - sh.start)
    np.testing.assert_array_equal(to_numpy(sh.forest.tree_.points), gather_rows(X[sh.start:sh.stop], perm))
    for method in (None, "exact"):
        di = DistributedIndex(local_client, source=g, device="cpu", method=method)
        d, i = di.query(Q, 6, block=25)
        di.close()
        np.testing.assert_array_equal(i, bi)
        np.testing.assert_array_equal(d, bd)


def test_distributed_index_needs_a_store_or_a_source(local_client):
    with pytest.raises(InputError, match="store path and an index name"):
        DistributedIndex(local_client)


@pytest.mark.gpu
def test_gpu_generated_shards_keep_half_rows(rng):
    """On a GPU a float16 generated shard holds half rows (forest and exact alike) and answers
    as the brute force over the drawn rows."""
    import cupy as cp

    from scanforest.kernels.knn.sharded import gather_rows

    g = _generated(6000, 20, "float16", 2, n_trees=2)
    X = cp.asnumpy(g.rows(0, 6000, cp, cp.float32))
    Q = X[rng.choice(6000, 50, replace=False)] + rng.normal(scale=0.05, size=(50, 20)).astype(np.float32)
    bd, bi = knn_bruteforce(X, Q, 5, device="cpu")
    for method in (None, "exact"):
        parts = []
        for s in range(2):
            sh = g.load(s, "gpu", method)
            rows = sh.forest._fit_X if method == "exact" else sh.forest.tree_.points
            assert rows.dtype == cp.float16
            if method is None:
                perm = cp.asnumpy(sh.forest.tree_.perm)
                np.testing.assert_array_equal(cp.asnumpy(rows).astype(np.float32),
                                              gather_rows(X[sh.start:sh.stop], perm))
            d, i = sh.query(Q, 5)
            parts.append((cp.asnumpy(d), cp.asnumpy(i)))
        d, i = merge_topk(parts, 5)
        np.testing.assert_array_equal(i, bi)
        np.testing.assert_array_equal(d, bd)


@pytest.mark.gpu
def test_gpu_exact_float16_shard_holds_half_rows(tmp_path, rng):
    """The exact method over a float16 index keeps the rows in half precision on a GPU (half
    the memory of the brute-force baseline) and answers as the brute force over the stored rows."""
    import cupy as cp

    X, Q = _data(rng, n=3000, m=50, d=16)
    store = str(tmp_path / "e.zarr")
    idx.build_index(store, "e", X, shards=2, params={"method": "exact"}, dtype="float16")
    X16 = X.astype(np.float16).astype(np.float32)
    bd, bi = knn_bruteforce(X16, Q, 8, device="cpu")
    parts = []
    for s in range(2):
        sh = idx.load_shard(store, "e", s, "gpu")
        assert sh.forest._fit_X.dtype == cp.float16
        d, i = sh.query(Q, 8)
        parts.append((cp.asnumpy(d), cp.asnumpy(i)))
    d, i = merge_topk(parts, 8)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(d, bd)


def test_trees_only_fit_keeps_no_rows(rng):
    """``fit(keep_rows=False)``: the same tree arrays, no copy of the rows, and no queries."""
    from scanforest.kernels.knn.kdforest import KDForest

    X, Q = _data(rng, n=2000, m=40, d=8)
    full = KDForest(n_trees=2, leaf_size=16, device="cpu").fit(X)
    bare = KDForest(n_trees=2, leaf_size=16, device="cpu").fit(X, keep_rows=False)
    assert bare.tree_.points is None and bare.tree_.data is None and bare._fit_X is None
    for name in idx.TREE_ARRAYS:
        np.testing.assert_array_equal(getattr(bare.tree_, name), getattr(full.tree_, name))
    with pytest.raises(InputError, match="keep_rows=False"):
        bare.query(Q, 2)


class OutOfMemoryError(Exception):
    """Named like CuPy's ``cupy.cuda.memory.OutOfMemoryError``, which is no MemoryError."""


class _TightShard:
    """A shard whose device runs out of memory on blocks of more than ``fits`` queries."""

    def __init__(self, shard, fits, error=OutOfMemoryError):
        self.shard, self.fits, self.error, self.sizes = shard, fits, error, []
        self.start, self.stop, self.forest = shard.start, shard.stop, shard.forest

    def query(self, Q, k, **search):
        self.sizes.append(len(Q))
        if len(Q) > self.fits:
            raise self.error(f"out of memory allocating a block of {len(Q)} queries")
        return self.shard.query(Q, k, **search)


@pytest.mark.parametrize("error", [OutOfMemoryError, MemoryError])
def test_out_of_memory_splits_the_block_and_keeps_the_answer(rng, error):
    """A block that does not fit is searched in halves, recursively, with its per-query bounds
    split alike: the same ids, distances and leaf count as one search; only memory errors."""
    from scanforest.kernels.errors import OutOfMemory
    from scanforest.kernels.knn.kdforest import KDForest

    X, Q = _data(rng, n=2000, m=400, d=8)
    shard = Shard(1000, 3000, KDForest(leaf_size=16, device="cpu").fit(X))
    bd, _ = knn_bruteforce(X, Q, 4, device="cpu")
    bounds = (bd[:, -1] * 1.5).astype(np.float32)
    bounds[::7] = np.inf
    ref = idx.search_shard(shard, Q, 4, stats=True, bounds=bounds)
    tight = _TightShard(shard, fits=100, error=error)
    got = idx.search_shard(tight, Q, 4, stats=True, bounds=bounds, min_block=64)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])
    assert got[1].min() >= 1000  # global ids
    assert got[2]["leaves"] == ref[2]["leaves"] > 0
    assert tight.sizes == [400, 200, 100, 100, 200, 100, 100]
    with pytest.raises(OutOfMemory, match=r"shard \[1000, 3000\) cannot search even 100 queries"):
        idx.search_shard(_TightShard(shard, fits=50, error=error), Q, 4, min_block=100)
    other = _TightShard(shard, fits=100, error=ValueError)  # not a memory error: no retry
    with pytest.raises(ValueError):
        idx.search_shard(other, Q, 4)
    assert other.sizes == [400]


def test_wait_keeps_shards_resident_and_reports_stats(tmp_path, rng, local_client):
    X, Q = _data(rng)
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, shards=2, params={"method": "anns", "leaf_size": 32})
    di = DistributedIndex(local_client, store, "t").wait()
    assert all(f.status == "finished" for f in di.shards)
    who = local_client.who_has(di.shards)
    assert all(len(w) == 1 for w in who.values())  # resident on one worker each, nothing copied
    d, i, stats = di.query(Q, 4, block=150, return_stats=True)
    bd, bi = knn_bruteforce(X, Q, 4, device="cpu")
    np.testing.assert_array_equal(i, bi)
    assert stats["queries"] == len(Q) and stats["leaves"] > 0
    assert stats["compute_seconds"] > 0 and stats == di.stats_
    di.close()


def test_wait_raises_the_shard_load_error(tmp_path, rng, local_client):
    import shutil

    X, _ = _data(rng, n=500)
    store = tmp_path / "s.zarr"
    idx.build_index(str(store), "t", X, shards=2, params={"method": "anns", "leaf_size": 32})
    di = DistributedIndex(local_client, str(store), "t")  # attrs read; the shards load on the workers
    shutil.rmtree(store / "indexes" / "t" / "reference")
    with pytest.raises(Exception):
        di.wait()
    di.close()


def test_match_flow_batches_give_the_per_scan_answer(tmp_path, rng):
    """The match flow stacks a batch's scans into one distributed query; every scan's stored
    top-k equals its own brute force, whatever the batch size, and a rerun skips every scan."""
    from scanforest.flows.match import run_index_build, run_match
    from scanforest.tasks.store import ScanStore

    store = str(tmp_path / "s.zarr")
    st = ScanStore(store, create=True)
    X = rng.normal(size=(2000, 352)).astype(np.float32)
    scans = {}
    for j, n in enumerate([0, 37, 120, 5, 64]):  # an empty scan and one with a NaN row
        Q = rng.normal(size=(n, 352)).astype(np.float32)
        if n == 37:
            Q[3] = np.nan
        scans[f"q{j}"] = Q
    for sid, a in [("ref", X)] + list(scans.items()):
        st.write_scan(sid, {"points": np.zeros((max(1, len(a)), 3), np.float32)}, {"sha256": sid})
        st.write_stage(sid, "describe", {"kp_shot": a}, {})
    run_index_build(store, ["ref"], name="m", shards=2, params={"method": "exact"})
    first = None
    for batch in (1, 3):
        res = run_match(store, k=4, name="m", device="cpu", workers=2, batch=batch, progress=False,
                        queries=list(scans))
        assert res["matched"] == len(scans) and res["batch"] == batch and res["task_seconds"] > 0
        got = {s: (st.read(s, "match_ids").copy(), st.read(s, "match_dist").copy()) for s in scans}
        for sid, Q in scans.items():
            ids, dist = got[sid]
            assert ids.shape == (len(Q), 4)
            ok = np.isfinite(Q).all(axis=1)
            if ok.any():
                bd, bi = knn_bruteforce(X, Q[ok], 4, device="cpu")
                np.testing.assert_array_equal(ids[ok], bi)
                np.testing.assert_array_equal(dist[ok], bd)
            assert (ids[~ok] == -1).all() and np.isinf(dist[~ok]).all()
        if first is None:
            first = got
            for sid in scans:  # drop the results so the second batch size recomputes them
                st.write_stage(sid, "match", {"match_ids": np.zeros((0, 4), np.int64)}, {"index": "gone"})
    again = run_match(store, k=4, name="m", device="cpu", workers=2, batch=2, progress=False, queries=list(scans))
    assert again["matched"] == 0


def test_local_workers_share_the_cores_for_numba(monkeypatch):
    import os

    from scanforest.flows.cluster import thread_env

    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert thread_env(2, 1) == {"NUMBA_NUM_THREADS": str(max(1, cores // 2))}
    assert thread_env(4 * cores, 1) == {"NUMBA_NUM_THREADS": "1"}
    monkeypatch.setenv("NUMBA_NUM_THREADS", "3")
    assert thread_env(2, 1) == {"NUMBA_NUM_THREADS": "3"}  # the user's choice wins


_THREADS_MAIN = """
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numba  # the program's __main__ imports numba, as the scanforest CLI does
import numpy as np


def cached_then_compile():
    import numba
    import pkernel
    pkernel.psum(np.ones(1000))       # loaded from the cache: starts numba's threads
    f = numba.njit(lambda x: x + 1)     # a fresh compilation reads NUMBA_NUM_THREADS again
    return int(f(1)), numba.config.NUMBA_NUM_THREADS, os.environ.get("NUMBA_NUM_THREADS")


if __name__ == "__main__":
    import pkernel
    pkernel.psum(np.ones(1000))  # warm the cache
    from scanforest.flows.cluster import dask_client
    with dask_client(n_workers=2, device="cpu") as client:
        print(client.gather([client.submit(cached_then_compile, pure=False) for _ in range(4)]))
"""


def test_workers_compile_after_cached_parallel_kernels(tmp_path):
    """The demo's crash on a fresh machine: a spawned worker imports numba with the host's thread
    count (its ``__main__`` imports numba), receives ``NUMBA_NUM_THREADS`` = its share afterwards,
    starts threads in a cached parallel kernel, and its next compilation failed ("Cannot set
    NUMBA_NUM_THREADS to a different value once the threads have been launched")."""
    import os
    import subprocess
    import sys

    (tmp_path / "pkernel.py").write_text(
        "from numba import njit, prange\n\n\n@njit(parallel=True, cache=True)\ndef psum(x):\n"
        "    s = 0.0\n    for i in prange(x.shape[0]):\n        s += x[i]\n    return s\n")
    (tmp_path / "main.py").write_text(_THREADS_MAIN)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    env.pop("NUMBA_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, str(tmp_path / "main.py")], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = eval(proc.stdout.strip().splitlines()[-1])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, cores // 2)
    assert got == [(2, share, str(share))] * 4  # every worker compiled, with its share of the cores


def test_local_cpu_workers_get_their_share(local_client):
    import os

    got = local_client.run(lambda: os.environ.get("NUMBA_NUM_THREADS"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    expect = os.environ.get("NUMBA_NUM_THREADS") or str(max(1, cores // 2))
    assert set(got.values()) == {expect}


# ------------------------------------------------------------------ memory planning
def test_shard_plan_fits_the_block_beside_the_resident_rows():
    from scanforest.kernels.knn.sharded import plan_shards, search_working_bytes, shard_resident_bytes

    G = 2 ** 30
    # residency: the rows once (exact), or each tree's leaf-ordered rows, permutation and nodes
    assert shard_resident_bytes(1000, 8, method="exact") == 1000 * 8 * 4
    forest = shard_resident_bytes(1000, 8, n_trees=2, leaf_size=10)
    assert forest == 2 * (1000 * 32 + 1000 * 8 + 400 * (28 + 64))
    assert search_working_bytes(10, 8, 2000, 4) > search_working_bytes(10, 8, 1000, 4)
    p = plan_shards(10_000_000, 352, [139 * G], block=65_536)  # one H200: all of it resident, full blocks
    assert p.fits and p.shards == 1 and p.block == 65_536 and p.rows_per_shard == 10_000_000
    assert p.resident_bytes + p.working_bytes <= 0.85 * 139 * G
    res = shard_resident_bytes(10_000_000, 352)
    lo, hi = (search_working_bytes(10_000_000, 352, b, 4) for b in (256, 65_536))
    mem = int((res + (lo + hi) / 2) / 0.85)  # room beside the rows for about half the largest block
    tight = plan_shards(10_000_000, 352, [mem], block=65_536)
    assert tight.fits and 256 < tight.block < 65_536
    assert tight.resident_bytes + tight.working_bytes <= 0.85 * mem
    one = plan_shards(100_000_000, 352, [139 * G])  # 100M x 352 fp32 (131 GiB) on one H200: no
    assert not one.fits and one.min_workers == 2
    two = plan_shards(100_000_000, 352, [139 * G, 139 * G])  # on two: one copy of 50M rows each, full blocks
    assert two.fits and two.shards == 2 and two.block == 262_144 and two.resident_bytes < 80 * G
    # the default block: 262,144 queries on GPUs, 65,536 on CPUs, when they fit
    assert plan_shards(10_000_000, 352, [139 * G]).block == 262_144
    assert plan_shards(1_000_000, 352, [64 * G], device="cpu").block == 65_536
    small = plan_shards(1000, 8, [64 * G, 96 * G, 64 * G])  # fits one worker: every worker holds it
    assert small.fits and (small.shards, small.replicas, small.mode) == (1, 3, "replicate")
    with pytest.raises(InputError, match="memory_bytes must be positive"):
        plan_shards(1000, 8, [])


def test_index_build_auto_shards_and_refusal(tmp_path, rng):
    from scanforest.flows.match import run_index_build
    from scanforest.tasks.store import ScanStore

    with pytest.raises(InputError, match=r"needs at least \d+ such devices"):
        idx.plan_for(100_000_000, 352, {"method": "banns"}, "cpu", memory=[64 * 2 ** 30])
    store = str(tmp_path / "s.zarr")
    st = ScanStore(store, create=True)
    st.write_scan("ref", {"points": np.zeros((1, 3), np.float32)}, {"sha256": "ref"})
    st.write_stage("ref", "describe", {"kp_shot": rng.normal(size=(500, 352)).astype(np.float32)}, {})
    res = run_index_build(store, ["ref"], name="a", shards="auto", params={"method": "anns"}, device="cpu")
    assert res["status"] == "built" and res["shards"] == 1 and "1 shard(s) of 500 rows" in res["plan"]


def test_distributed_block_is_planned_from_free_memory(tmp_path, rng, local_client):
    X, Q = _data(rng)
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, shards=2, params={"method": "exact"})
    di = DistributedIndex(local_client, store, "t", device="cpu")
    assert di.plan_block(4) == 65_536  # small shards: the largest block
    assert di.plan_block(3, headroom=1e-12) == 256  # no room at all: down to the smallest block
    assert di.plan_block(4, headroom=1e-12) == 65_536  # planned once per k
    d, i = di.query(Q, 3)
    bd, bi = knn_bruteforce(X, Q, 3, device="cpu")
    np.testing.assert_array_equal(i, bi)
    with pytest.raises(InputError, match="block must be >= 1"):
        di.query(Q, 3, block=0)
    di.close()


@pytest.mark.gpu
def test_dask_cuda_keeps_resident_shards_out_of_its_spilling(tmp_path, rng):
    """A dask-cuda worker's DeviceHostFile puts a Shard among the objects it never spills."""
    pytest.importorskip("dask_cuda")
    from dask_cuda.device_host_file import DeviceHostFile

    X, _ = _data(rng, n=500, m=40, d=8)
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, params={"method": "anns", "leaf_size": 16})
    sh = idx.load_shard(store, "t", 0, "gpu")
    assert idx._pin_on_dask_cuda()
    f = DeviceHostFile(device_memory_limit=1, memory_limit=1, worker_local_directory=str(tmp_path / "spill"))
    f["shard"] = sh  # over both limits: spilled at once unless kept apart
    assert "shard" in f.others and f["shard"] is sh


# ------------------------------------------------------------------ replicas and shards of replicas
def test_planner_replicates_what_fits_one_device_and_shards_the_rest():
    """The plan takes the most copies whose shards fit: the whole index on every GPU when it fits
    one (replicate), FAISS's shards of replicas when it fits two, one shard per GPU otherwise;
    trees built on the GPU count their float32 rows; a fixed shard count plans only copies."""
    from scanforest.kernels.knn.sharded import build_bytes, plan_shards, shard_resident_bytes

    G = 2 ** 30
    h100 = [80 * G] * 4
    ten = plan_shards(10_000_000, 352, h100)  # 10M x 352 float32: 14.8 GiB resident
    assert (ten.mode, ten.shards, ten.replicas, ten.workers) == ("replicate", 1, 4, 4) and ten.fits
    assert "fit one worker" in ten.describe() and "4 replica(s)" in ten.describe()
    # 100M x 352 float16 (half rows on the GPU): 76 GiB does not fit one H100, 50M rows do
    half = plan_shards(100_000_000, 352, h100, row_bytes=2, leaf_size=256)
    assert (half.mode, half.shards, half.replicas) == ("shard+replicate", 2, 2)
    assert half.resident_bytes == shard_resident_bytes(50_000_000, 352, leaf_size=256, row_bytes=2)
    # ... but building a 50M-row tree on the GPU takes 70 GB of float32 rows: one shard per GPU
    built = plan_shards(100_000_000, 352, h100, row_bytes=2, leaf_size=256, build_row_bytes=4)
    assert (built.mode, built.shards, built.replicas) == ("shard", 4, 1) and built.fits
    assert built.build_bytes == build_bytes(25_000_000, 352, leaf_size=256) < 0.85 * 80 * G
    # three GPUs for a 2-GPU index: two shards, one copy (the third GPU would hold half a copy)
    three = plan_shards(100_000_000, 352, [80 * G] * 3, row_bytes=2, leaf_size=256)
    assert (three.shards, three.replicas) == (3, 1)
    # a stored index's shard count is kept: copies only
    fixed = plan_shards(10_000_000, 352, h100, shards=2)
    assert (fixed.mode, fixed.shards, fixed.replicas) == ("shard+replicate", 2, 2)
    # more shards than workers: a worker holds several, and the plan counts them all
    crowded = plan_shards(10_000_000, 352, [80 * G], shards=4)
    assert crowded.resident_bytes == 4 * shard_resident_bytes(2_500_000, 352)
    assert not plan_shards(400_000_000, 352, h100).fits


@pytest.mark.parametrize("shards", [1, 2])
def test_one_two_four_workers_give_the_same_answer(tmp_path, rng, shards):
    """1, 2 and 4 local workers (each its own device: 1, 2 or 4 copies of a 1-shard index, 1 or 2
    of a 2-shard one) give the same lists bit for bit, every copy being the same forest; an
    unlimited budget equals the brute force; each block goes to one copy, so a copy searches a
    share of the queries, not all of them."""
    from distributed import Client, LocalCluster

    X, Q = _data(rng, n=4000, m=600)
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, shards=shards, params={"method": "banns", "leaf_size": 16, "backtracks": 6})
    bd, bi = knn_bruteforce(X, Q, 4, device="cpu")
    answers = []
    for workers in (1, 2, 4):
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=False, dashboard_address=None,
                          scheduler_kwargs={"dashboard_address": ":0"}) as cl, \
                Client(cl) as client:
            di = DistributedIndex(client, store, "t", device="cpu")
            expect = max(1, workers // shards)
            assert di.replicas == expect and di.describe()["shards"] == shards
            held = {di.placement[j] for j in range(expect * shards)}
            assert len(held) == min(workers, expect * shards)  # copies of a shard on different workers
            d, i, st = di.query(Q, 4, block=64, return_stats=True)
            assert st["blocks"] >= expect and st["leaves"] <= 6 * len(Q) * shards  # one copy per block
            answers.append((d, i))
            du, iu = di.query(Q, 4, block=64, backtracks=10 ** 6)  # unlimited: the brute force
            np.testing.assert_array_equal(iu, bi)
            np.testing.assert_array_equal(du, bd)
            if workers == 4:  # a copy count asked for: the same lists again
                two = DistributedIndex(client, store, "t", device="cpu", replicas=2)
                np.testing.assert_array_equal(two.query(Q, 4, block=64)[1], i)
                two.close()
            di.close()
    for d, i in answers[1:]:
        np.testing.assert_array_equal(i, answers[0][1])
        np.testing.assert_array_equal(d, answers[0][0])


def test_query_blocks_ramp_up_wave_by_wave():
    """A query's blocks cover it once, at most ``block`` each, one per replica group a wave, the
    first ones small (a device starts on its first block while the next travels)."""
    di = DistributedIndex.__new__(DistributedIndex)
    for r, m, block, dev in [(1, 1_000_000, 262_144, "gpu"), (4, 1_000_000, 262_144, "gpu"),
                             (2, 3000, 150, "cpu"), (3, 7, 2, "cpu"), (4, 3, 100, "cpu"), (4, 20_000, 262_144, "gpu")]:
        di.replicas, di._dev = r, dev
        spans = di.split(m, block)
        assert spans[0][0] == 0 and spans[-1][1] == m and all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))
        sizes = [b - a for a, b in spans]
        assert max(sizes) <= block and min(sizes) >= 1
        assert len(spans) >= min(r, m)  # every group gets a block
    di.replicas, di._dev = 4, "gpu"
    sizes = [b - a for a, b in di.split(1_000_000, 262_144)]
    assert sizes[:4] == [32_768] * 4 and sizes[4:8] == [65_536] * 4  # doubling waves of four


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_two_threads_search_one_gpu_shard_at_once(tmp_path, rng, dtype):
    """Two threads of a worker search one GPU shard side by side, each on its own stream, from
    its first search on (the lazily kept row norms and exact search made by one while the other
    reads them), with queries a kernel just wrote on the default stream: the same lists and leaf
    counts as one search at a time."""
    from concurrent.futures import ThreadPoolExecutor

    import cupy as cp

    X, Q = _data(rng, n=20000, m=3000, d=32)
    store = str(tmp_path / "s.zarr")
    idx.build_index(store, "t", X, params={"method": "banns", "leaf_size": 16, "backtracks": 32}, dtype=dtype)
    ref = idx.search_shard(idx.load_shard(store, "t", 0, "gpu"), Q, 4, stats=True)
    sh = idx.load_shard(store, "t", 0, "gpu")  # fresh: its first searches run at once
    Qg = cp.asarray(Q) * cp.float32(1)  # written on the default stream just before the searches
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda q: idx.search_shard(sh, q, 4, stats=True), [Qg, Q, Qg, Q]))
    for d, i, st in outs:
        np.testing.assert_array_equal(i, ref[1])
        np.testing.assert_array_equal(d, ref[0])
        assert st["leaves"] == ref[2]["leaves"]
