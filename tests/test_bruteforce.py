"""Exact brute-force kNN: float64 oracle, ties by id, blocking, validation, recall, GPU parity."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.errors import InputError
from scanforest.kernels.knn.bruteforce import ExactSearch, exact_scan_cpu, knn_bruteforce, recall


def oracle(base, queries, k):
    """float64 reference, sorted by (distance, id)."""
    b = base.astype(np.float64)
    q = queries.astype(np.float64)
    D = ((q[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    ids = np.empty((q.shape[0], k), np.int64)
    for r in range(q.shape[0]):
        ids[r] = np.lexsort((np.arange(b.shape[0]), D[r]))[:k]
    return np.take_along_axis(D, ids, 1), ids, D


@pytest.mark.parametrize("n,m,d,k", [(700, 31, 5, 1), (900, 17, 64, 10), (300, 9, 2, 40), (64, 5, 130, 64)])
def test_matches_float64_oracle(rng, n, m, d, k):
    base = rng.standard_normal((n, d)).astype(np.float32)
    queries = rng.standard_normal((m, d)).astype(np.float32)
    dist, ids = knn_bruteforce(base, queries, k, device="cpu")
    od, oi, D = oracle(base, queries, k)
    assert dist.dtype == np.float32 and ids.dtype == np.int64 and dist.shape == (m, k)
    np.testing.assert_allclose(dist, od, rtol=2e-5, atol=1e-6)
    # ids agree except where float32 rounding reorders near-ties: those must be true near-ties
    mism = ids != oi
    if mism.any():
        alt = np.take_along_axis(D, ids, 1)
        np.testing.assert_allclose(alt[mism], od[mism], rtol=1e-5)
    assert np.all(np.diff(dist, axis=1) >= 0)
    # identical to the canonical float32 scan, bit for bit
    cd, ci = exact_scan_cpu(base, queries, k)
    np.testing.assert_array_equal(ids, ci)
    np.testing.assert_array_equal(dist, cd)


def test_duplicates_ties_broken_by_id(rng):
    base = rng.integers(0, 3, (400, 3)).astype(np.float32)  # 27 distinct points, ~15 copies each
    queries = rng.integers(0, 3, (25, 3)).astype(np.float32)
    k = 40
    dist, ids = knn_bruteforce(base, queries, k, device="cpu", block=(7, 50))
    od, oi, _ = oracle(base, queries, k)
    np.testing.assert_array_equal(ids, oi)
    np.testing.assert_array_equal(dist, od.astype(np.float32))


def test_blocking_does_not_change_result(rng):
    base = (rng.standard_normal((1500, 12)) * 3 + 50).astype(np.float32)  # far from the origin
    queries = (rng.standard_normal((60, 12)) * 3 + 50).astype(np.float32)
    a = knn_bruteforce(base, queries, 9, device="cpu")
    b = knn_bruteforce(base, queries, 9, device="cpu", block=(8, 100))
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[0], b[0])
    cd, ci = exact_scan_cpu(base, queries, 9)
    np.testing.assert_array_equal(a[1], ci)


def test_coarse_cancellation_falls_back_to_exact(rng):
    """Two far clusters of tightly packed points: the float32 GEMM form ||q||^2 + ||b||^2 - 2 q.b
    cannot rank within a cluster, so the error-bound fallback must re-rank; the answer is still
    the canonical scan's, bit for bit, blocked or not."""
    c = np.where(rng.random((600, 1)) < 0.5, -1000.0, 1000.0)
    base = (c + rng.standard_normal((600, 8)) * 1e-3).astype(np.float32)
    queries = (np.array([[1000.0], [-1000.0]] * 10) + rng.standard_normal((20, 8)) * 1e-3).astype(np.float32)
    cd, ci = exact_scan_cpu(base, queries, 5)
    for block in (None, (3, 64)):
        dist, ids = knn_bruteforce(base, queries, 5, device="cpu", block=block)
        np.testing.assert_array_equal(ids, ci)
        np.testing.assert_array_equal(dist, cd)


def test_self_query_distance_zero(rng):
    base = rng.standard_normal((200, 7)).astype(np.float32)
    dist, ids = knn_bruteforce(base, base, 1, device="cpu")
    np.testing.assert_array_equal(ids[:, 0], np.arange(200))
    assert np.all(dist[:, 0] == 0)


@pytest.mark.parametrize("base,queries,k,msg", [
    (np.zeros((5,), np.float32), np.zeros((1, 5), np.float32), 1, "2-D"),
    (np.zeros((0, 3), np.float32), np.zeros((1, 3), np.float32), 1, "empty"),
    (np.zeros((5, 3), np.float32), np.zeros((1, 4), np.float32), 1, "dimensions"),
    (np.zeros((5, 3), np.float32), np.zeros((1, 3), np.float32), 6, "larger than"),
    (np.zeros((5, 3), np.float32), np.zeros((1, 3), np.float32), 0, ">= 1"),
    (np.zeros((300, 3), np.float32), np.zeros((1, 3), np.float32), 257, "maximum"),
    (np.array([[0, 1.0], [np.nan, 0]], np.float32), np.zeros((1, 2), np.float32), 1, "NaN"),
    (np.zeros((5, 3), np.float32), np.array([[0, 0, np.inf]], np.float32), 1, "NaN or inf"),
])
def test_validation(base, queries, k, msg):
    with pytest.raises(InputError, match=msg):
        knn_bruteforce(base, queries, k, device="cpu")


def test_recall_counts_ties():
    exact = np.array([[0.0, 1.0, 1.0], [0.0, 2.0, 3.0]], np.float32)
    found = np.array([[0.0, 1.0, 1.0], [0.0, 3.0, 5.0]], np.float32)
    assert recall(found, exact) == pytest.approx(5 / 6)
    assert recall(found, exact, k=1) == 1.0
    assert recall(np.full((2, 3), np.inf), exact) == 0.0
    with pytest.raises(InputError):
        recall(found, exact, k=4)
    with pytest.raises(InputError, match="no rows"):  # not a NaN recall
        recall(np.zeros((0, 3)), np.zeros((0, 3)))


@pytest.mark.gpu
@pytest.mark.parametrize("n,m,d,k", [(5000, 300, 3, 4), (20000, 513, 352, 16), (3000, 100, 1024, 256),
                                     (7, 4, 2, 7)])
def test_gpu_equals_cpu(rng, n, m, d, k):
    import cupy as cp

    base = rng.standard_normal((n, d)).astype(np.float32)
    queries = rng.standard_normal((m, d)).astype(np.float32)
    cd, ci = knn_bruteforce(base, queries, k, device="cpu")
    gd, gi = knn_bruteforce(cp.asarray(base), cp.asarray(queries), k)
    assert isinstance(gd, cp.ndarray)
    np.testing.assert_array_equal(gi.get(), ci)
    np.testing.assert_array_equal(gd.get(), cd)


@pytest.mark.gpu
def test_gpu_duplicates_and_blocks(rng):
    import cupy as cp

    base = rng.integers(0, 3, (3000, 4)).astype(np.float32)
    queries = rng.integers(0, 3, (50, 4)).astype(np.float32)
    od, oi, _ = oracle(base, queries, 100)
    gd, gi = knn_bruteforce(cp.asarray(base), cp.asarray(queries), 100, block=(16, 1000))
    np.testing.assert_array_equal(gi.get(), oi)
    np.testing.assert_array_equal(gd.get(), od.astype(np.float32))


def _permuted_case(rng, n=4000, m=60, d=6):
    """Rows with many exact duplicates (ties), a random permutation of them, queries."""
    base = rng.integers(0, 3, (n, d)).astype(np.float32)
    base[::7] += rng.standard_normal((len(base[::7]), d)).astype(np.float32)
    perm = rng.permutation(n).astype(np.int64)
    return base, perm, rng.integers(0, 3, (m, d)).astype(np.float32)


@pytest.mark.parametrize("share", [None, 0.0])
def test_ids_map_permuted_rows_to_the_input_order_answer(rng, monkeypatch, share):
    """``ids=perm`` on ``base[perm]`` (a KD-tree's leaf-ordered rows) gives exactly the answer on
    ``base`` itself, ties included; the same whether the base is centred in one copy or tile by
    tile (``share=0``: no copy, as for a shard that fills the memory)."""
    import scanforest.kernels.knn.bruteforce as bf

    if share is not None:
        monkeypatch.setitem(bf._COPY_SHARE, "cpu", share)
    base, perm, queries = _permuted_case(rng)
    rd, ri = knn_bruteforce(base, queries, 40, device="cpu")  # rows in input order (oracle-tested above)
    for block in (None, (16, 500)):
        dist, ids = knn_bruteforce(base[perm], queries, 40, device="cpu", block=block, ids=perm)
        np.testing.assert_array_equal(ids, ri)
        np.testing.assert_array_equal(dist, rd)
    with pytest.raises(InputError, match="ids must be"):
        knn_bruteforce(base, queries, 4, device="cpu", ids=perm[:10])
    with pytest.raises(InputError, match="2\\*\\*32"):
        knn_bruteforce(base, queries, 4, device="cpu", ids=perm - 1)


def _search_cases(rng):
    """(base, queries, k, ids) of several query batches over one base: duplicates and ties."""
    base, perm, queries = _permuted_case(rng)
    return base, [(queries, 40, None), (queries[:7], 3, None), (rng.standard_normal((33, 6)).astype(np.float32), 12,
                                                                 None), (queries, 9, perm)]


@pytest.mark.parametrize("keep", [None, 0.0])
def test_exact_search_answers_as_knn_bruteforce(rng, monkeypatch, keep):
    """An ExactSearch prepared once answers every batch as knn_bruteforce does, bit for bit,
    with its centred copy kept or centred tile by tile (``keep=0``), blocks and ids too; bad
    queries are refused as knn_bruteforce refuses them."""
    import scanforest.kernels.knn.bruteforce as bf

    if keep is not None:
        monkeypatch.setitem(bf._KEEP_SHARE, "cpu", keep)
    base, batches = _search_cases(rng)
    es = ExactSearch(base, device="cpu")
    assert (es._stats.tiles.bc is None) == (keep == 0.0)
    for q, k, ids in batches:
        for block in (None, (5, 700)):
            want = knn_bruteforce(base, q, k, device="cpu", block=block, ids=ids)
            got = es.search(q, k, block=block, ids=ids)
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[0], want[0])
    with pytest.raises(InputError, match="queries"):
        es.search(np.zeros((3, 5), np.float32), 2)
    with pytest.raises(InputError, match="k"):
        es.search(batches[0][0], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [None, 0.0])
def test_gpu_exact_search_equals_cpu(rng, monkeypatch, keep):
    import cupy as cp

    import scanforest.kernels.knn.bruteforce as bf

    if keep is not None:
        monkeypatch.setitem(bf._KEEP_SHARE, "gpu", keep)
    base, batches = _search_cases(rng)
    es = ExactSearch(cp.asarray(base))
    assert es.device == "gpu"
    for q, k, ids in batches:
        cd, ci = knn_bruteforce(base, q, k, device="cpu", ids=ids)
        gd, gi = es.search(cp.asarray(q), k, ids=None if ids is None else cp.asarray(ids))
        np.testing.assert_array_equal(gi.get(), ci)
        np.testing.assert_array_equal(gd.get(), cd)


@pytest.mark.gpu
def test_gpu_exact_search_reuses_its_coarse_buffers_across_batches_and_threads(rng):
    """Batches of every size, in this thread and then in a new one (a Dask task of the one pass
    ends on a thread of its own), search in one kept coarse-tile buffer: no fresh tile a batch
    for the memory pool to cache. Four threads searching at once on their own streams borrow
    buffers of their own, answer as the CPU does, and leave at most two kept."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import cupy as cp

    import scanforest.kernels.knn.bruteforce as bf

    base = rng.standard_normal((30000, 64)).astype(np.float32)
    es = ExactSearch(cp.asarray(base))
    qs = [rng.standard_normal((m, 64)).astype(np.float32) for m in (1000, 300, 999, 7, 640)]
    refs = [knn_bruteforce(base, q, 4, device="cpu") for q in qs]
    kept = es._stats._ws._free

    def check(q, ref):
        gd, gi = es.search(cp.asarray(q), 4)
        np.testing.assert_array_equal(gi.get(), ref[1])
        np.testing.assert_array_equal(gd.get(), ref[0])

    check(qs[0], refs[0])
    assert len(kept) == 1
    buf = kept[0][0]
    for q, ref in zip(qs[1:], refs[1:]):  # smaller batches: the largest one's buffer serves them
        check(q, ref)
        assert [id(b) for b, _ in kept] == [id(buf)]
    t = threading.Thread(target=lambda: [check(q, ref) for q, ref in zip(qs, refs)])
    t.start()
    t.join()
    assert [id(b) for b, _ in kept] == [id(buf)]  # a new thread borrowed the same buffer

    start = threading.Barrier(4)

    def run(j):
        start.wait(timeout=60)
        with cp.cuda.Stream(non_blocking=True) as st:
            out = [es.search(cp.asarray(q), 4) for q in qs[j % 2::2] * 3]
            st.synchronize()
            return [(d.get(), i.get()) for d, i in out]

    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(run, range(4)))
    for j, res in enumerate(got):
        for (gd, gi), (cd, ci) in zip(res, [refs[x] for x in range(j % 2, len(qs), 2)] * 3):
            np.testing.assert_array_equal(gi, ci)
            np.testing.assert_array_equal(gd, cd)
    assert 1 <= len(kept) <= bf._WS_KEEP


@pytest.mark.gpu
@pytest.mark.parametrize("share", [None, 0.0])
def test_gpu_ids_map_and_tile_centring(rng, monkeypatch, share):
    import cupy as cp

    import scanforest.kernels.knn.bruteforce as bf

    if share is not None:
        monkeypatch.setitem(bf._COPY_SHARE, "gpu", share)
    base, perm, queries = _permuted_case(rng)
    rd, ri = knn_bruteforce(base, queries, 40, device="cpu")
    for block in (None, (16, 500)):
        gd, gi = knn_bruteforce(cp.asarray(base[perm]), cp.asarray(queries), 40, block=block,
                                ids=cp.asarray(perm))
        np.testing.assert_array_equal(gi.get(), ri)
        np.testing.assert_array_equal(gd.get(), rd)
    big = rng.standard_normal((20000, 352)).astype(np.float32)  # SHOT-sized rows, tile-centred vs CPU
    q = rng.standard_normal((300, 352)).astype(np.float32)
    cd, ci = knn_bruteforce(big, q, 8, device="cpu")
    gd, gi = knn_bruteforce(cp.asarray(big), cp.asarray(q), 8)
    np.testing.assert_array_equal(gi.get(), ci)
    np.testing.assert_array_equal(gd.get(), cd)


@pytest.mark.gpu
@pytest.mark.parametrize("share", [None, 0.0])
def test_gpu_half_base_answers_as_its_float32_widening(rng, monkeypatch, share):
    """A float16 base stays float16 on the GPU (centred copy or tile by tile) and its answer is
    the float32 widening's, bit for bit, ties and the exact re-check included; its NaN rows
    are refused like float32 ones."""
    import cupy as cp

    import scanforest.kernels.knn.bruteforce as bf

    if share is not None:
        monkeypatch.setitem(bf._COPY_SHARE, "gpu", share)
    base = rng.standard_normal((6000, 352)).astype(np.float16)
    base[3000:3100] = base[:100]  # duplicates: ties broken by id
    q = rng.standard_normal((257, 352)).astype(np.float32)
    q[:20] = base[:20].astype(np.float32)
    wide = base.astype(np.float32)
    cd, ci = knn_bruteforce(wide, q, 16, device="cpu")
    for block in (None, (64, 1000)):
        gd, gi = knn_bruteforce(cp.asarray(base), cp.asarray(q), 16, block=block)
        np.testing.assert_array_equal(gi.get(), ci)
        np.testing.assert_array_equal(gd.get(), cd)
    bad = cp.asarray(base)
    bad[77, 5] = cp.float16(np.nan)
    with pytest.raises(InputError, match="first: \\[77\\]"):
        knn_bruteforce(bad, cp.asarray(q), 4)


def test_nonfinite_rows_are_found_block_by_block(rng):
    """The NaN/inf row check runs in blocks (no temporary the size of a large base) and finds
    the same rows, float32 and float16."""
    from scanforest.kernels.validation import nonfinite_rows

    for dtype in (np.float32, np.float16):
        a = rng.standard_normal((1000, 7)).astype(dtype)
        a[[3, 400, 999], [0, 6, 2]] = [np.nan, np.inf, -np.inf]
        want = np.zeros(1000, bool)
        want[[3, 400, 999]] = True
        for nbytes in (1 << 28, 7 * a.itemsize * 33):
            np.testing.assert_array_equal(nonfinite_rows(a, np, nbytes), want)


def _pair_case(rng, d=352):
    base = rng.standard_normal((3000, d)).astype(np.float32)
    base[2000:2050] = base[:50]  # duplicates: equal distances under other ids
    queries = rng.standard_normal((129, d)).astype(np.float32)
    bd, bi = knn_bruteforce(base, queries, 8, device="cpu")
    ids = bi[:, ::-1].copy()  # any order: each slot keeps its own pair's distance
    ids[::5, 0] = np.where(ids[::5, 0] < 50, ids[::5, 0] + 2000, ids[::5, 0])
    ids[3, 1], ids[4, 2] = -1, 3000  # a library's pads and out-of-range ids give inf
    return base, queries, bd[:, ::-1], ids


def test_pair_distances_are_the_brute_force_distances(rng):
    """Distances of answers found elsewhere are the brute force's own, bit for bit (so recall
    compares them with the exact answer without rounding noise); pads give inf."""
    from scanforest.kernels.knn.bruteforce import pair_distances

    base, queries, want, ids = _pair_case(rng)
    got = pair_distances(base, queries, ids, device="cpu")
    assert got.dtype == np.float32 and got.shape == ids.shape
    assert np.isinf(got[3, 1]) and np.isinf(got[4, 2])
    keep = np.ones(ids.shape, bool)
    keep[3, 1] = keep[4, 2] = False
    np.testing.assert_array_equal(got[keep], want[keep])
    f64 = ((queries[:, None, :].astype(np.float64) - base[np.clip(ids, 0, 2999)].astype(np.float64)) ** 2).sum(-1)
    np.testing.assert_allclose(got[keep], f64[keep], rtol=1e-5)
    with pytest.raises(InputError, match="ids must be an \\(M, k\\) integer array"):
        pair_distances(base, queries, ids[:10], device="cpu")
    with pytest.raises(InputError, match="ids must be"):
        pair_distances(base, queries, ids.astype(np.float32), device="cpu")


@pytest.mark.gpu
def test_gpu_pair_distances_equal_the_cpu_ones(rng):
    import cupy as cp

    from scanforest.kernels.knn.bruteforce import pair_distances

    base, queries, _, ids = _pair_case(rng)
    cpu = pair_distances(base, queries, ids, device="cpu")
    gpu = pair_distances(cp.asarray(base), cp.asarray(queries), cp.asarray(ids))
    assert isinstance(gpu, cp.ndarray)
    np.testing.assert_array_equal(gpu.get(), cpu)
    half = pair_distances(cp.asarray(base.astype(np.float16)), cp.asarray(queries), cp.asarray(ids))
    np.testing.assert_array_equal(half.get(), pair_distances(base.astype(np.float16).astype(np.float32), queries,
                                                             ids, device="cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("kp", [1, 5, 20, 64])
def test_gpu_select_keeps_each_rows_smallest_keys(rng, kp):
    """The coarse warp select returns each row's kp smallest (value, column) keys, ascending,
    for rows shorter and longer than its merge period, with many equal values (ties broken by
    the column), and merged with the keys of an earlier column block (``prev``)."""
    import cupy as cp

    from scanforest.kernels.knn.bruteforce import _select_gpu, decode_keys

    for ncols in (3, 300, 5000):
        D = rng.integers(0, 40, (37, ncols)).astype(np.float32)  # dense ties
        D[5] = np.arange(ncols)[::-1]  # the best keys arrive last
        keys = _select_gpu(cp.asarray(D), min(kp, ncols))
        d, i = (cp.asnumpy(a) for a in decode_keys(keys))
        want = np.lexsort((np.broadcast_to(np.arange(ncols), D.shape), D), axis=1)[:, :min(kp, ncols)]
        np.testing.assert_array_equal(i, want)
        np.testing.assert_array_equal(d, np.take_along_axis(D, want, 1))
        if ncols >= kp:  # a second block of columns, merged through prev
            E = rng.integers(0, 40, (37, 700)).astype(np.float32)
            both = np.concatenate([D, E], axis=1)
            d2, i2 = (cp.asnumpy(a) for a in decode_keys(_select_gpu(cp.asarray(E), kp, col_offset=ncols,
                                                                         prev=keys)))
            want = np.lexsort((np.broadcast_to(np.arange(both.shape[1]), both.shape), both), axis=1)[:, :kp]
            np.testing.assert_array_equal(i2, want)
            np.testing.assert_array_equal(d2, np.take_along_axis(both, want, 1))
