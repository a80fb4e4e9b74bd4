"""Exact EDT with nearest-reference table: brute-force references, grid rule, memory, errors."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.align.edt import distance_transform, estimate_bytes, exact_edt
from scanforest.kernels.errors import InputError, OutOfMemory


def _brute_edt(mask):
    """Distance from every cell to the nearest True cell, brute force (float64)."""
    cells = np.stack(np.meshgrid(*[np.arange(s) for s in mask.shape], indexing="ij"), -1)
    cells = cells.reshape(-1, mask.ndim).astype(float)
    feats = cells[mask.ravel()]
    dd = np.sqrt(((cells[:, None, :] - feats[None]) ** 2).sum(-1))
    return dd.min(1).reshape(mask.shape)


@pytest.mark.parametrize("shape", [(23, 17), (9, 11, 7)])
def test_exact_edt_matches_brute_force(rng, shape):
    mask = rng.random(shape) < 0.03
    mask[(0,) * len(shape)] = True
    dist, idx = exact_edt(mask, device="cpu")
    np.testing.assert_allclose(dist, _brute_edt(mask), atol=1e-12)
    # the feature index points at a True cell at exactly that distance
    assert mask[tuple(idx)].all()
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"))
    np.testing.assert_allclose(np.sqrt(((idx - grid) ** 2).sum(0)), dist, atol=1e-12)


@pytest.mark.parametrize("dim", [2, 3])
def test_table_holds_nearest_occupied_cell(rng, dim):
    ref = rng.normal(size=(300, dim)) * np.arange(1, dim + 1)
    g = distance_transform(ref, resolution=40 if dim == 2 else 24, device="cpu")
    assert g.nearest.shape == tuple(g.shape) + (dim,) and g.nearest.dtype == np.float32
    refn = g.normalize(ref)
    # grid covers the reference with >= 4 cells of padding on every side
    lo = g.origin
    hi = g.origin + (np.asarray(g.shape) - 1) * g.cell
    assert np.all(refn.min(0) - lo >= 4 * g.cell - 1e-9)
    assert np.all(hi - refn.max(0) >= 4 * g.cell - 1e-9)
    # brute force: occupied cells, their centroids; each cell's entry is the centroid of an
    # occupied cell at minimal grid distance (ties allowed)
    u = np.floor((refn - g.origin) / g.cell + 0.5).astype(int)
    occ, inv = np.unique(u, axis=0, return_inverse=True)
    cent = np.stack([np.bincount(inv.ravel(), weights=refn[:, k]) for k in range(dim)], 1)
    cent /= np.bincount(inv.ravel())[:, None]
    q = rng.integers(0, np.asarray(g.shape), size=(400, dim))
    d2 = ((q[:, None, :] - occ[None]) ** 2).sum(-1)
    best = d2.min(1)
    entry = g.nearest[tuple(q.T)]
    # which occupied cell is the entry? it must be at the minimal distance
    match = np.argmin(((entry[:, None, :] - cent[None]) ** 2).sum(-1), 1)
    np.testing.assert_allclose(entry, cent[match], atol=1e-5)
    assert np.array_equal(d2[np.arange(len(q)), match], best)


def test_lookup_is_close_to_true_nearest_point(rng):
    ref = rng.random((2000, 2))
    g = distance_transform(ref, resolution=400, device="cpu")
    x = g.normalize(rng.random((500, 2)))
    mu, inside = g.lookup(x)
    assert inside.all()
    refn = g.normalize(ref)
    true = np.sqrt(((x[:, None] - refn[None]) ** 2).sum(-1)).min(1)
    got = np.linalg.norm(mu - x, axis=1)
    assert np.all(got <= true + 1.5 * g.cell)


def test_default_resolution_rule_and_memory_estimate(rng):
    ref = rng.random((10000, 3))
    g = distance_transform(ref, device="cpu")
    assert max(g.shape) == pytest.approx(int(np.clip(4 * np.cbrt(10000), 32, 256)), abs=2)
    assert estimate_bytes(g.shape) >= g.nbytes


def test_out_of_memory_names_bytes(rng):
    ref = rng.random((100, 3))
    with pytest.raises(OutOfMemory, match="needs .* bytes but only .* bytes are available"):
        distance_transform(ref, resolution=100000, device="cpu")
    with pytest.raises(OutOfMemory):
        distance_transform(ref, resolution=200, max_bytes=1000, device="cpu")


@pytest.mark.parametrize("bad, msg", [
    (np.zeros((0, 3)), "empty"),
    (np.zeros((5, 4)), "shape"),
    (np.zeros(5), "shape"),
    (np.array([[0.0, np.nan, 1.0]]), "NaN"),
])
def test_bad_reference(bad, msg):
    with pytest.raises(InputError, match=msg):
        distance_transform(bad, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [2, 3])
def test_gpu_edt_and_table_match_cpu(rng, dim):
    import cupy as cp

    mask = rng.random((40, 33, 21)[:dim]) < 0.02
    mask.flat[0] = True
    dc, _ = exact_edt(mask, device="cpu")
    dg, ig = exact_edt(cp.asarray(mask), device="gpu")
    np.testing.assert_allclose(cp.asnumpy(dg), dc, atol=1e-5)
    ref = rng.normal(size=(3000, dim))
    gc = distance_transform(ref, resolution=64, device="cpu")
    gg = distance_transform(ref, resolution=64, device="gpu")
    assert gc.shape == gg.shape
    np.testing.assert_allclose(gc.origin, gg.origin)
    # the occupied cell each entry comes from is at the exact EDT distance (ties may differ)
    def entry_dist(g, table):
        cells = np.stack(np.meshgrid(*[np.arange(s) for s in g.shape], indexing="ij"), -1)
        src = np.floor((table.astype(np.float64) - g.origin) / g.cell + 0.5)
        return np.sqrt(((src - cells) ** 2).sum(-1))

    a = entry_dist(gc, gc.nearest)
    b = entry_dist(gg, cp.asnumpy(gg.nearest))
    # (rare cells may differ: float32 centroids that round across a cell border)
    assert np.mean(np.abs(a - b) < 1e-6) > 0.99
