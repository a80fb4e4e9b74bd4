"""Normals and keypoints: PCL's published values, float64 references, GPU against CPU."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.descriptors.keypoints import keypoints, voxel_grid
from scanforest.kernels.descriptors.normals import normals
from scanforest.kernels.errors import InputError


def read_points(path):
    """Finite xyz of a PCD (a same-named .npy copy is used where no PCD reader is installed)."""
    try:
        from scanforest.tasks.readers import read_cloud

        return np.ascontiguousarray(read_cloud(path).points, dtype=np.float32)
    except Exception:
        npy = path.with_suffix(".npy")
        if npy.exists():
            return np.ascontiguousarray(np.load(npy), dtype=np.float32)
        raise


PCL_NORMALS = {
    103: (0.36683175, -0.44696972, -0.81587529),
    200: (-0.71414840, -0.06002361, -0.69741613),
    140: (-0.45109111, -0.19499126, -0.87091631),
}


def test_bun0_matches_pcl_unit_test(pcl_dir):
    pts = read_points(pcl_dir / "bun0.pcd")
    assert pts.shape == (397, 3)
    n, c = normals(pts, radius=0.04, device="cpu")
    for i, ref in PCL_NORMALS.items():
        np.testing.assert_allclose(n[i], ref, atol=1e-4)
    assert np.isfinite(n).all() and np.isfinite(c).all()


def ref_normals(pts, surf, lists, vp):
    """float64 numpy reference: eigh of the centroid covariance."""
    out = np.full((len(pts), 3), np.nan)
    curv = np.full(len(pts), np.nan)
    for i, nb in enumerate(lists):
        if len(nb) < 3:
            continue
        q = surf[nb].astype(np.float64)
        cov = np.cov(q.T, bias=True)
        w, v = np.linalg.eigh(cov)
        n = v[:, 0]
        if np.dot(vp - pts[i], n) < 0:
            n = -n
        out[i] = n
        curv[i] = w[0] / w.sum()
    return out, curv


def test_normals_match_float64_reference(rng):
    # a wavy surface, viewpoint above it
    xy = rng.random((800, 2)).astype(np.float32)
    z = 0.1 * np.sin(4 * xy[:, 0]) * np.cos(3 * xy[:, 1])
    pts = np.column_stack([xy, z]).astype(np.float32)
    vp = np.array([0.3, 0.2, 5.0])
    for kw in ({"radius": 0.08}, {"k": 12}):
        n, c = normals(pts, viewpoint=vp, device="cpu", **kw)
        from scanforest.kernels.neighbors.search import knn, radius_search

        if "k" in kw:
            idx, _ = knn(pts, k=12, device="cpu")
            lists = list(idx)
        else:
            nb = radius_search(pts, radius=0.08, device="cpu")
            lists = [nb.indices[nb.offsets[i]:nb.offsets[i + 1]] for i in range(len(pts))]
        rn, rc = ref_normals(pts, pts, lists, vp)
        ok = np.isfinite(rn[:, 0])
        np.testing.assert_allclose(n[ok], rn[ok], atol=2e-5)
        np.testing.assert_allclose(c[ok], rc[ok], atol=2e-6)
        assert (n[:, 2] > 0).all()  # all face the viewpoint above


def test_plane_and_too_few_neighbours():
    g = np.stack(np.meshgrid(np.arange(10), np.arange(10)), -1).reshape(-1, 2) * 0.01
    pts = np.column_stack([g, np.full(len(g), 0.5)]).astype(np.float32)
    pts = np.vstack([pts, [[5.0, 5.0, 5.0]]]).astype(np.float32)  # isolated point
    n, c = normals(pts, radius=0.025, device="cpu")
    np.testing.assert_allclose(n[:-1], np.tile([0, 0, -1.0], (100, 1)), atol=1e-6)  # faces origin
    np.testing.assert_allclose(c[:-1], 0, atol=1e-7)
    assert np.isnan(n[-1]).all() and np.isnan(c[-1])


def test_normals_bad_inputs():
    pts = np.zeros((10, 3), np.float32)
    with pytest.raises(InputError, match="exactly one"):
        normals(pts, device="cpu")
    with pytest.raises(InputError, match="larger than"):
        normals(pts, k=11, device="cpu")
    with pytest.raises(InputError, match="viewpoint"):
        normals(pts, k=3, viewpoint=(0, 0), device="cpu")
    with pytest.raises(InputError, match="viewpoint"):
        normals(pts, k=3, viewpoint="origin", device="cpu")
    for k in (1, 2):  # fewer than 3 neighbours: every normal NaN, said instead
        with pytest.raises(InputError, match="k must be >= 3"):
            normals(pts, k=k, device="cpu")
    for k in (True, 2.5, "10"):
        with pytest.raises(InputError, match="k must be an integer"):
            normals(pts, k=k, device="cpu")


def test_far_float64_clouds_are_computed_about_their_box(pcl_dir):
    """PCL's milk carton moved 10^4 and 10^6 m away, in float64: its normals (the viewpoint moved
    with it) and its SHOT at the same keypoints are those of the cloud where it was, to float32
    noise (cast to float32 there first they were NaN: 0.06 m spacing at 10^6 m); keypoints are a
    uniform sampling of the same cloud (the voxel grid is anchored in the local frame)."""
    from scanforest.kernels.descriptors.shot import shot
    from scanforest.tasks.readers import read_cloud

    P = read_cloud(pcl_dir / "milk.pcd").points
    P = P[np.isfinite(P).all(1)][:4000].astype(np.float64)
    n0, _ = normals(P, radius=0.01, device="cpu")
    kp = keypoints(P, radius=0.01, device="cpu")
    d0, _ = shot(P, n0, kp, 0.02, device="cpu")
    for off in (1e4, 1e6):
        Q = P + off
        n1, _ = normals(Q, radius=0.01, viewpoint=(off, off, off), device="cpu")
        ok = np.isfinite(n0).all(1)
        assert np.isfinite(n1).all(1).tolist() == ok.tolist()
        assert np.abs(n1[ok] - n0[ok]).max() < 1e-4, off
        d1, _ = shot(Q, n1, kp, 0.02, device="cpu")
        assert np.abs(d1 - d0).max() < 1e-3, off
        k1 = keypoints(Q, radius=0.01, device="cpu")
        assert abs(len(k1) - len(kp)) <= 0.05 * len(kp), (len(k1), len(kp))
    with pytest.raises(InputError, match="too small for coordinates up to"):  # float32 far away: said
        keypoints((P + 1e6).astype(np.float32), radius=0.01, device="cpu")
    with pytest.raises(InputError, match="too small"):  # voxel indices past float32's integers
        keypoints(P, radius=1e-20, device="cpu")


def ref_uniform_sampling(pts, r):
    inv = np.float32(1) / np.float32(r)
    best = {}
    for i, p in enumerate(pts):
        ijk = tuple(np.floor(p * inv).astype(np.int64))
        c = (np.array(ijk, np.float32) + np.float32(0.5)) * np.float32(r)
        d = float(np.sum((p - c) ** 2))
        if ijk not in best or d < best[ijk][0]:
            best[ijk] = (d, i)
    return np.sort([v[1] for v in best.values()])


def test_uniform_sampling_matches_reference(rng):
    pts = (rng.random((3000, 3)) * 0.3 - 0.1).astype(np.float32)
    kp = keypoints(pts, radius=0.05, device="cpu")
    np.testing.assert_array_equal(kp, ref_uniform_sampling(pts, 0.05))
    assert kp.dtype == np.int64
    np.testing.assert_array_equal(keypoints(pts, device="cpu"), np.arange(3000))
    np.testing.assert_array_equal(keypoints(pts, indices=[5, 3, 5], device="cpu"), [3, 5])
    np.testing.assert_array_equal(keypoints(pts, coords=pts[[7, 2]] + 1e-6, device="cpu"), [2, 7])
    with pytest.raises(InputError):
        keypoints(pts, indices=[3000], device="cpu")


def ref_voxel_grid(pts, leaf):
    """PCL VoxelGrid in float64: voxel ijk = floor(p * float32(1/leaf)) (float32 product), the mean
    of each voxel's points, voxels in (i fastest, j, k) order."""
    inv = np.float32(np.float32(1) / np.float32(leaf))
    ijk = np.floor(pts.astype(np.float32) * inv).astype(np.int64)
    ijk -= ijk.min(axis=0)
    dims = ijk.max(axis=0) + 1
    key = ijk[:, 0] + dims[0] * (ijk[:, 1] + dims[1] * ijk[:, 2])
    u, inv_idx = np.unique(key, return_inverse=True)
    sums = np.zeros((len(u), 3))
    np.add.at(sums, inv_idx, pts.astype(np.float64))
    return (sums / np.bincount(inv_idx)[:, None]).astype(np.float32)


def test_voxel_grid_matches_float64_reference(rng, pcl_dir):
    # a scan in scan-line order (runs of points in one voxel), shuffled, and far from the origin
    scan = read_points(pcl_dir / "milk_cartoon_all_small_clorox.pcd")
    cases = [(scan, 0.015), (scan[rng.permutation(len(scan))], 0.005),
             ((rng.random((5000, 3)) * 2 - 1).astype(np.float32), 0.1),
             ((rng.random((3000, 3)) * 50 + 1000).astype(np.float32), 3.0),
             (np.zeros((7, 3), np.float32), 1.0)]
    for pts, leaf in cases:
        got = voxel_grid(pts, leaf, device="cpu")
        np.testing.assert_array_equal(got, ref_voxel_grid(pts, leaf))
        assert got.dtype == np.float32
    assert voxel_grid(np.zeros((0, 3), np.float32), 0.1, device="cpu").shape == (0, 3)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(InputError, match="leaf"):
            voxel_grid(scan, bad, device="cpu")
    with pytest.raises(InputError):
        voxel_grid(np.array([[0, 0, np.nan]], np.float32), 0.1, device="cpu")


@pytest.mark.gpu
def test_gpu_voxel_grid_matches_cpu(rng, pcl_dir):
    import cupy as cp

    scan = read_points(pcl_dir / "milk_cartoon_all_small_clorox.pcd")
    for pts, leaf in ((scan, 0.015), (scan, 0.003), ((rng.random((3000, 3)) * 50 + 1000).astype(np.float32), 3.0)):
        got = cp.asnumpy(voxel_grid(cp.asarray(pts), leaf))
        ref = ref_voxel_grid(pts, leaf)
        assert got.shape == ref.shape
        # float64 sums in another order (atomics): at most one float32 step apart
        assert (np.abs(got - ref) <= np.spacing(np.abs(ref))).all()


@pytest.mark.gpu
def test_gpu_normals_and_keypoints_match_cpu(pcl_dir):
    import cupy as cp

    pts = read_points(pcl_dir / "milk_cartoon_all_small_clorox.pcd")
    for kw in ({"radius": 0.01}, {"k": 10}):
        nc, cc = normals(pts, device="cpu", **kw)
        ng, cg = normals(cp.asarray(pts), **kw)
        ng, cg = cp.asnumpy(ng), cp.asnumpy(cg)
        np.testing.assert_array_equal(np.isnan(nc), np.isnan(ng))
        ok = np.isfinite(nc[:, 0])
        err = np.abs(nc[ok] - ng[ok]).max(axis=1)
        print(f"normals {kw}: GPU-CPU max {err.max():.3g}, >1e-5: {(err > 1e-5).sum()} of {ok.sum()}")
        # float64 sums in another order: only near-degenerate neighbourhoods may differ
        assert (err > 1e-5).mean() < 1e-3
        assert np.nanmax(np.abs(cc - cg)) < 1e-5
    kc = keypoints(pts, radius=0.03, device="cpu")
    kg = keypoints(cp.asarray(pts), radius=0.03)
    np.testing.assert_array_equal(cp.asnumpy(kg), kc)
