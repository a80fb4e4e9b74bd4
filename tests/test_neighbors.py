"""Radius search and k-NN against exact float32 brute force; GPU against CPU."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.errors import InputError
from scanforest.kernels.neighbors.search import knn, radius_search


def brute_d2(pts, qs):
    """float32 squared distances in FLANN's order (the library's inclusion rule)."""
    d = qs[:, None, :].astype(np.float32) - pts[None, :, :].astype(np.float32)
    return (d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1]) + d[..., 2] * d[..., 2]


def brute_lists(pts, qs, r, cap=None):
    d2 = brute_d2(pts, qs)
    r2 = np.float32(r * r)
    out = []
    for q in range(qs.shape[0]):
        idx = np.nonzero(d2[q] < r2)[0]
        idx = idx[np.lexsort((idx, d2[q, idx]))]
        out.append(idx[:cap] if cap else idx)
    return out


@pytest.fixture
def cloud(rng):
    return rng.random((600, 3)).astype(np.float32), rng.random((80, 3)).astype(np.float32)


def test_radius_search_matches_brute_force(cloud):
    pts, qs = cloud
    nb = radius_search(pts, qs, radius=0.15, device="cpu")
    ref = brute_lists(pts, qs, 0.15)
    assert nb.offsets.shape == (81,)
    for q in range(80):
        seg = slice(nb.offsets[q], nb.offsets[q + 1])
        np.testing.assert_array_equal(nb.indices[seg], ref[q])
        np.testing.assert_array_equal(nb.sq_distances[seg], brute_d2(pts, qs[q:q + 1])[0, ref[q]])
    assert np.all(np.diff(nb.sq_distances[nb.offsets[3]:nb.offsets[4]]) >= 0)


def test_radius_search_self_and_capped(cloud):
    pts, _ = cloud
    nb = radius_search(pts, radius=0.12, device="cpu")
    # each point is its own first neighbour at distance 0
    assert np.all(nb.indices[nb.offsets[:-1][nb.counts > 0]] == np.nonzero(nb.counts > 0)[0])
    capped = radius_search(pts, radius=0.12, max_neighbors=4, device="cpu")
    ref = brute_lists(pts, pts, 0.12, cap=4)
    for q in range(0, 600, 37):
        np.testing.assert_array_equal(capped.indices[capped.offsets[q]:capped.offsets[q + 1]], ref[q])
    assert capped.counts.max() <= 4
    unsorted = radius_search(pts, radius=0.12, max_neighbors=4, sort=False, device="cpu")
    np.testing.assert_array_equal(unsorted.offsets, capped.offsets)
    for q in range(0, 600, 7):
        seg = slice(capped.offsets[q], capped.offsets[q + 1])
        np.testing.assert_array_equal(np.sort(unsorted.indices[seg]), np.sort(capped.indices[seg]))


def test_knn_matches_brute_force(cloud):
    pts, qs = cloud
    idx, d2 = knn(pts, qs, k=7, device="cpu")
    full = brute_d2(pts, qs)
    for q in range(qs.shape[0]):
        ref = np.lexsort((np.arange(600), full[q]))[:7]
        np.testing.assert_array_equal(idx[q], ref)
        np.testing.assert_array_equal(d2[q], full[q, ref])


def _knn_cases(rng):
    g = rng.standard_normal((3000, 3)).astype(np.float32)
    lattice = np.round(rng.random((3000, 3)) * 8).astype(np.float32)  # many exact ties
    plane = (np.concatenate([rng.random((2000, 2)), np.zeros((2000, 1))], 1) + 1e5).astype(np.float32)
    speck = np.concatenate([rng.random((3000, 3)) * 0.01, [[50, 50, 50], [-40, 3, 2]]]).astype(np.float32)
    two = np.zeros((500, 3), np.float32)
    two[250:] = 1
    return [("gaussian", g, g[:400], 10), ("lattice ties", lattice, lattice[:400], 12),
            ("queries outside the cloud", g, (rng.standard_normal((200, 3)) * 10).astype(np.float32), 7),
            ("a plane far from the origin", plane, plane[:300], 10), ("k = N", g[:20], g[:20], 20),
            ("outliers", speck, speck[-5:], 10), ("two stacks of duplicates", two, two[::50], 10)]


@pytest.mark.parametrize("case", range(7))
def test_knn_grid_is_exact_where_it_is_hard(rng, case):
    """The CPU k-NN's cell list (shells of cells until the k-th distance lies inside the block
    searched) against the float32 brute force, ties by index: dense ties, queries far outside the
    cloud, coordinates far from the origin, outliers whose neighbours are many shells away, all
    points equal."""
    name, pts, qs, k = _knn_cases(rng)[case]
    idx, d2 = knn(pts, qs, k=k, device="cpu")
    full = brute_d2(pts, qs)
    ref = np.lexsort((np.broadcast_to(np.arange(pts.shape[0]), full.shape), full), axis=1)[:, :k]
    np.testing.assert_array_equal(idx, ref, err_msg=name)
    np.testing.assert_array_equal(d2, np.take_along_axis(full, ref, 1), err_msg=name)


def test_bad_inputs(cloud):
    pts, qs = cloud
    with pytest.raises(InputError, match="shape"):
        radius_search(pts[:, :2], radius=0.1, device="cpu")
    with pytest.raises(InputError, match="radius"):
        radius_search(pts, radius=-1, device="cpu")
    bad = pts.copy()
    bad[3, 1] = np.nan
    with pytest.raises(InputError, match="NaN"):
        radius_search(bad, radius=0.1, device="cpu")
    with pytest.raises(InputError, match="larger than"):
        knn(pts[:5], k=6, device="cpu")
    with pytest.raises(InputError, match="empty"):
        knn(np.zeros((0, 3), np.float32), k=1, device="cpu")


@pytest.mark.gpu
def test_gpu_matches_cpu(rng):
    import cupy as cp

    pts = (rng.random((20000, 3)) * [2.0, 1.0, 0.5]).astype(np.float32)
    qs = (rng.random((3000, 3)) * [2.2, 1.1, 0.6] - 0.05).astype(np.float32)
    for cap in (None, 9):
        c = radius_search(pts, qs, radius=0.04, max_neighbors=cap, device="cpu")
        g = radius_search(cp.asarray(pts), cp.asarray(qs), radius=0.04, max_neighbors=cap)
        np.testing.assert_array_equal(cp.asnumpy(g.offsets), c.offsets)
        np.testing.assert_array_equal(cp.asnumpy(g.indices), c.indices)
        np.testing.assert_array_equal(cp.asnumpy(g.sq_distances), c.sq_distances)
    ic, dc = knn(pts, qs, k=10, device="cpu")
    ig, dg = knn(cp.asarray(pts), cp.asarray(qs), k=10)
    np.testing.assert_array_equal(cp.asnumpy(ig), ic)
    np.testing.assert_array_equal(cp.asnumpy(dg), dc)


@pytest.mark.gpu
def test_gpu_grid_bounds_and_cell_starts_equal_numpy(rng):
    """The grid's bounding box (one launch) is numpy's min / max, and its cell starts are the
    bincount + scan of the cell ids, for clouds with large empty gaps, negative coordinates, a
    single point and one where every point shares a cell; the keypoints and the verification
    voxel ranks built on them equal the CPU's."""
    import cupy as cp

    from scanforest.kernels.descriptors.keypoints import keypoints
    from scanforest.kernels.neighbors.search_gpu import bounds, build_grid
    from scanforest.kernels.descriptors.keypoints import voxel_ranks as _voxel_ranks_cpu
    from scanforest.kernels.recognition._verification_gpu import voxel_ranks

    far = np.concatenate([rng.random((3000, 3)) * 0.2 - 5.0, rng.random((2000, 3)) * 0.2 + [3.0, -2.0, 7.5]])
    clouds = [far.astype(np.float32), (rng.random((4000, 3)) * [2.0, 1.0, 0.5] - 1.0).astype(np.float32),
              np.array([[0.25, -1.5, 3.0]], np.float32), np.full((50, 3), 0.125, np.float32)]
    for pts in clouds:
        lo, hi = bounds(cp.asarray(pts))
        np.testing.assert_array_equal(lo, pts.min(axis=0).astype(np.float64))
        np.testing.assert_array_equal(hi, pts.max(axis=0).astype(np.float64))
        for cell in (0.01, 0.05):
            g = build_grid(cp.asarray(pts), cell)
            gp = cp.asnumpy(g.points)
            ncell = int(np.prod(g.dims))
            cid = [np.clip(np.floor((gp[:, a] - np.float32(g.origin[a])) * np.float32(g.inv_h)).astype(np.int64),
                           0, g.dims[a] - 1) for a in range(3)]
            cid = (cid[2] * g.dims[1] + cid[1]) * g.dims[0] + cid[0]
            assert np.all(np.diff(cid) >= 0)  # sorted by cell
            want = np.concatenate([[0], np.cumsum(np.bincount(cid, minlength=ncell))])
            np.testing.assert_array_equal(cp.asnumpy(g.cell_start), want)
            np.testing.assert_array_equal(gp, pts[cp.asnumpy(g.order)])
            np.testing.assert_array_equal(cp.asnumpy(voxel_ranks(cp.asarray(pts), cell)),
                                          _voxel_ranks_cpu(pts, cell))
            np.testing.assert_array_equal(cp.asnumpy(keypoints(cp.asarray(pts), radius=cell)),
                                          keypoints(pts, radius=cell, device="cpu"))
    empty_lo, empty_hi = bounds(cp.zeros((0, 3), cp.float32))
    assert np.all(np.isinf(empty_lo)) and np.all(np.isinf(empty_hi))


def test_list_order_helpers_equal_numpy(rng):
    """The neighbour lists' order (by squared distance, ties by index) and the capped lists'
    thresholds, from the compiled helpers, equal numpy's lexsort and partition, ties included."""
    from scanforest.kernels.neighbors.search_cpu import argsort_key_index, kth_smallest

    for n in (0, 1, 2, 3, 17, 64, 1000):
        keys = rng.integers(0, max(1, n // 3), n).astype(np.float32)  # many equal distances
        ids = rng.permutation(n * 3)[:n].astype(np.int64)
        order = argsort_key_index(keys, ids)
        np.testing.assert_array_equal(order, np.lexsort((ids, keys)))
        for k in {0, n // 2, n - 1} if n else ():
            assert kth_smallest(keys, k) == np.partition(keys, k)[k]
            assert kth_smallest(ids, k) == np.sort(ids)[k]
    keys = np.array([2, 1, 2, 1], np.float32)
    np.testing.assert_array_equal(argsort_key_index(keys, np.array([5, 9, 3, 9])), [1, 3, 2, 0])  # stable on full ties
