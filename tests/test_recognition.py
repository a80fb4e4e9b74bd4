"""Recognition: rigid fits, RANSAC, Hough / GC grouping, verification, ICP, end to end."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from scanforest.kernels.errors import InputError
from scanforest.kernels.recognition.icp import icp_point_to_plane
from scanforest.kernels.recognition import (Correspondences, Hypotheses, ModelLibrary, RecognizeParams, evaluate,
                                            group_gc, match, pose_errors, ransac_rigid, recognize, rigid_transform,
                                            verify)
from scanforest.kernels.recognition.grouping import hough_maxima
from scanforest.kernels.synthetic import scenes as S


def _pose(rng, t_scale=0.5):
    return S.pose_matrix(S.random_rotation(rng), rng.normal(size=3) * t_scale)


# --------------------------------------------------------------------------- rigid fits
def test_rigid_transform_recovers_known_pose(rng):
    T = _pose(rng)
    src = rng.normal(size=(50, 3))
    dst = src @ T[:3, :3].T + T[:3, 3]
    est = rigid_transform(src, dst)
    np.testing.assert_allclose(est, T, atol=1e-10)
    # a reflection-inducing configuration (planar points) still gives a proper rotation
    flat = src.copy()
    flat[:, 2] = 0
    est = rigid_transform(flat, flat @ T[:3, :3].T + T[:3, 3])
    assert np.linalg.det(est[:3, :3]) == pytest.approx(1.0)
    np.testing.assert_allclose(est, T, atol=1e-9)


def test_rigid_transform_rejects_bad_input():
    with pytest.raises(InputError):
        rigid_transform(np.zeros((2, 3)), np.zeros((2, 3)))
    with pytest.raises(InputError):
        rigid_transform(np.zeros((4, 3)), np.zeros((5, 3)))


def test_ransac_rejects_outliers(rng):
    T = _pose(rng)
    src = rng.uniform(-0.1, 0.1, size=(60, 3))
    dst = src @ T[:3, :3].T + T[:3, 3] + rng.normal(scale=1e-4, size=src.shape)
    out = rng.choice(60, 25, replace=False)
    dst[out] += rng.uniform(0.05, 0.2, size=(25, 3))
    est, inl = ransac_rigid(src, dst, threshold=0.005, seed=1)
    truth = np.ones(60, bool)
    truth[out] = False
    assert (inl == truth).all()
    r, t = pose_errors(est, T)
    assert r < 0.1 and t < 1e-3
    assert ransac_rigid(src[:2], dst[:2], threshold=0.01) == (None, None)


@pytest.mark.parametrize("chunk", [1, 7, 256, "seq"])
def test_parallel_gc_sweep_equals_sequential(rng, chunk):
    """The speculative parallel consensus sweep, and the sequential one that tests each seed's
    candidates against the seed first, label exactly like PCL's plain sequential sweep."""
    from scanforest.kernels.recognition.grouping import _gc_sets, _gc_sets_nb

    for trial in range(4):
        n = 600
        M = rng.uniform(-0.1, 0.1, size=(n, 3))
        S = rng.uniform(-0.5, 0.5, size=(n, 3))
        for _ in range(8):  # planted consistent sets of various sizes, interleaved with noise
            T = _pose(rng, 0.3)
            sel = rng.choice(n, int(rng.integers(4, 40)), replace=False)
            S[sel] = M[sel] @ T[:3, :3].T + T[:3, 3] + rng.normal(scale=0.002, size=(len(sel), 3))
        S, M = S.astype(np.float32), M.astype(np.float32)
        ref = _gc_sets_nb(S, M, np.float64(0.01), 5)
        if chunk == "seq":
            got = _gc_sets(S, M, np.float64(0.01), 5, sequential=True)
        else:
            got = _gc_sets(S, M, np.float64(0.01), 5, chunk=chunk, sequential=False)
        assert (ref >= 0).sum() > 20
        np.testing.assert_array_equal(got, ref)


def test_quaternion_kabsch_equals_the_svd_fit(rng):
    """RANSAC's batched 3-point fits (Horn's quaternion form, in numba) give the rotation and
    translation of the SVD (Kabsch) fit, proper rotations also where the best orthogonal map is a
    reflection."""
    from scanforest.kernels.recognition.rigid import _kabsch_batch, _kabsch_svd

    B = 2000
    S = rng.normal(size=(B, 3, 3))
    T = np.stack([_pose(rng, 1.0) for _ in range(B)])
    D = np.einsum("bij,bnj->bni", T[:, :3, :3], S) + T[:, None, :3, 3] + rng.normal(scale=0.05, size=(B, 3, 3))
    D[:200] = rng.normal(size=(200, 3, 3))  # unrelated pairs: half of them best fitted by a reflection
    D[200:210] = D[200:210, :, ::-1]  # mirrored copies
    R1, t1 = _kabsch_batch(S, D)
    R2, t2 = _kabsch_svd(S, D)
    np.testing.assert_allclose(R1, R2, atol=1e-9)
    np.testing.assert_allclose(t1, t2, atol=1e-9)
    np.testing.assert_allclose(np.linalg.det(R1), 1.0, atol=1e-12)
    R3, t3 = _kabsch_batch(S[:5, :2].repeat(2, axis=1), D[:5, :2].repeat(2, axis=1))  # degenerate: a line
    np.testing.assert_allclose(np.linalg.det(R3), 1.0, atol=1e-12)
    line = np.einsum("bij,bnj->bni", R3, S[:5, :2]) + t3[:, None]
    np.testing.assert_allclose(line.mean(axis=1), D[:5, :2].mean(axis=1), atol=1e-9)


def test_batched_ransac_matches_known_poses_per_group(rng):
    """Many groups of different sizes and outlier ratios fitted at once: each group's pose and
    inlier mask as the single-group RANSAC finds them."""
    from scanforest.kernels.recognition.rigid import ransac_rigid_groups

    srcs, dsts, truths, poses = [], [], [], []
    for n, n_out in [(3, 0), (5, 1), (12, 4), (40, 18), (64, 10), (2, 0), (25, 0)]:
        T = _pose(rng)
        src = rng.uniform(-0.1, 0.1, size=(n, 3))
        dst = src @ T[:3, :3].T + T[:3, 3] + rng.normal(scale=1e-4, size=src.shape)
        out = rng.choice(n, n_out, replace=False)
        dst[out] += rng.uniform(0.05, 0.2, size=(n_out, 3))
        truth = np.ones(n, bool)
        truth[out] = False
        srcs.append(src), dsts.append(dst), truths.append(truth), poses.append(T)
    res = ransac_rigid_groups(srcs, dsts, threshold=0.005, seed=3)
    assert res[5] == (None, None)  # 2 pairs: no fit
    for g, (est, inl) in enumerate(res):
        if g == 5:
            continue
        assert (inl == truths[g]).all(), g
        if truths[g].sum() >= 3 and len(srcs[g]) > 3:
            r, t = pose_errors(est, poses[g])
            assert r < 0.2 and t < 1e-3, (g, r, t)
        single, sinl = ransac_rigid(srcs[g], dsts[g], threshold=0.005, seed=1)
        assert (sinl == inl).all()


# --------------------------------------------------------------------------- Hough voting
def _hough_reference(votes, b, thr):
    """Dense transcription of PCL HoughSpace3D::voteInt + findMaxima (independent reference)."""
    dmin, dmax = votes.min(0), votes.max(0)
    cnt = np.ceil((dmax - dmin) / b).astype(int)
    pp = [1, cnt[0], cnt[0] * cnt[1], cnt[0] * cnt[1] * cnt[2]]
    H = np.zeros(pp[3])
    ids = {}
    for vid, v in enumerate(votes):
        c = np.floor((v - dmin) / b).astype(int)
        if ((c < 0) | (c >= cnt)).any():
            continue
        cen = np.float32((2 * c * b + b) / 2.0)
        cw = np.float32(1 - np.abs(v - dmin - cen) / b)
        ib = [c[d] - 1 if v[d] - dmin[d] < cen[d] else (c[d] + 1 if v[d] - dmin[d] > cen[d] else c[d])
              for d in range(3)]
        for n in range(27):
            w, idx, e, ok = np.float32(1), 0, 1, True
            for d in range(3):
                cur = c[d] + (n % (e * 3)) // e - 1
                if not (0 <= cur <= cnt[d] - 1):
                    ok = False
                    break
                if cur == ib[d]:
                    w = np.float32(w * (1 - cw[d]))
                elif cur == c[d]:
                    w = np.float32(w * cw[d])
                else:
                    ok = False
                    break
                idx += cur * pp[d]
                e *= 3
            if ok:
                H[idx] += float(w)
                ids.setdefault(idx, []).append(vid)
    if thr < 0:  # PCL: a negative threshold in [-1, 0) is a fraction of the maximum
        thr = -thr * H.max() if thr >= -1 else H.max()
    vals, voters = [], []
    for i in range(pp[3]):
        if H[i] < thr:
            continue
        m, ismax = i, True
        for k in (2, 1, 0):
            m %= pp[k + 1]
            ik = m // pp[k]
            if ik > 0 and H[i] < H[i - pp[k]]:
                ismax = False
                break
            if ik < cnt[k] - 1 and H[i] < H[i + pp[k]]:
                ismax = False
                break
        if ismax:
            vals.append(H[i])
            voters.append(sorted(ids[i]))
    return vals, voters


def test_hough_maxima_matches_pcl_reference(rng):
    centres = np.array([[0.0, 0.0, 0.0], [0.1, 0.05, -0.02], [0.03, 0.12, 0.07]])
    votes = np.concatenate([c + rng.normal(scale=0.004, size=(n, 3))
                            for c, n in zip(centres, (30, 12, 4))] + [rng.uniform(-0.05, 0.15, (40, 3))])
    for thr in (3.0, 5.0, -0.5):
        vals, voters = hough_maxima(votes, bin_size=0.01, threshold=thr)
        rv, rvo = _hough_reference(votes, 0.01, thr)
        assert len(rv) >= 1
        np.testing.assert_allclose(vals, rv, rtol=1e-9)
        assert [list(v) for v in voters] == rvo
    vals, voters = hough_maxima(votes, bin_size=0.01, threshold=5.0)
    assert any(set(range(30)) & set(v) for v in voters)


def test_hough_without_interpolation_counts_votes(rng):
    votes = np.concatenate([np.full((7, 3), 0.0155), rng.uniform(0.2, 0.9, (20, 3))])
    vals, voters = hough_maxima(votes, bin_size=0.01, threshold=5, use_interpolation=False)
    assert vals == [7.0]
    assert list(voters[0]) == list(range(7))


# --------------------------------------------------------------------------- GC grouping
def _toy_library(model_kp):
    k = len(model_kp)
    z = np.zeros
    return ModelLibrary(names=["toy"], point_offsets=np.array([0, k]), points=model_kp,
                        normals=z((k, 3), np.float32), kp_offsets=np.array([0, k]),
                        kp_index=np.arange(k), kp_coords=model_kp.astype(np.float32),
                        descriptors=z((k, 352), np.float32), frames=z((k, 3, 3), np.float32),
                        rf=z((k, 3, 3), np.float32), model_id=z(k, np.int32),
                        kp_id=np.arange(k, dtype=np.int32), centroids=z((1, 3)),
                        votes=z((k, 3), np.float32), verify_offsets=np.array([0, k]),
                        verify_points=model_kp.astype(np.float32), verify_normals=z((k, 3), np.float32),
                        resolutions=np.array([0.01]))


def test_group_gc_finds_consistent_set(rng):
    T = _pose(rng, 0.2)
    mk = rng.uniform(-0.1, 0.1, size=(40, 3)).astype(np.float32)
    lib = _toy_library(mk)
    good = np.arange(25)
    sk = (mk[good] @ T[:3, :3].T + T[:3, 3]).astype(np.float32)
    wrong = rng.uniform(-0.3, 0.3, size=(15, 3)).astype(np.float32)      # random scene points
    scene_kp = np.concatenate([sk, wrong])
    corr = Correspondences(np.arange(40), np.concatenate([good, rng.integers(0, 40, 15)]),
                           np.zeros(40, np.int32), np.zeros(40, np.int32),
                           rng.uniform(0, 0.2, 40).astype(np.float32))
    h = group_gc(corr, lib, scene_kp, gc_size=0.005, gc_threshold=5)
    assert len(h) >= 1
    best = int(np.argmax(h.n_corr))
    assert set(h.groups[best].tolist()) == set(range(25))
    r, t = pose_errors(h.poses[best], T)
    assert r < 1e-3 and t < 1e-5


# --------------------------------------------------------------------------- matching
def test_match_threshold_and_ratio(rng):
    mk = rng.uniform(-0.1, 0.1, size=(30, 3)).astype(np.float32)
    lib = _toy_library(mk)
    d = rng.random((30, 352)).astype(np.float32)
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    lib.descriptors = d
    lib.descriptors[3] = np.nan                      # invalid reference row: never matched
    q = d[[0, 1, 2, 3]] + rng.normal(scale=0.01, size=(4, 352)).astype(np.float32)
    q = np.concatenate([q, np.full((1, 352), np.nan, np.float32)])   # invalid scene row
    c = match(q, lib, device="cpu")
    valid = np.flatnonzero(np.isfinite(lib.descriptors).all(1))
    d2 = ((q[:4, None, :] - lib.descriptors[None, valid]) ** 2).sum(-1)
    exp_ref = valid[d2.argmin(1)]
    keep = d2.min(1) < 0.25
    assert c.scene_kp.tolist() == np.flatnonzero(keep).tolist()
    assert c.ref_row.tolist() == exp_ref[keep].tolist()
    assert 3 not in c.ref_row.tolist() and 4 not in c.scene_kp.tolist()
    cr = match(q, lib, ratio=0.8, device="cpu")
    srt = np.sort(d2, axis=1)
    exp = np.flatnonzero(keep & (np.sqrt(srt[:, 0] / srt[:, 1]) < 0.8))
    assert cr.scene_kp.tolist() == exp.tolist()
    with pytest.raises(InputError):
        match(q[:, :10], lib, device="cpu")


# --------------------------------------------------------------------------- library
@pytest.fixture(scope="module")
def small_world():
    models = S.model_library(2, 6000, seed=3)
    lib = ModelLibrary.build([m.points for m in models], [m.name for m in models],
                             models_normals=[m.normals for m in models], model_ss=0.01,
                             descr_rad=0.04, rf_rad=0.03, normal_radius=0.015, views=16,
                             device="cpu")
    scene = S.make_scene(models, n_instances=2, n_points=40_000, noise=0.2, clutter=1, seed=5)
    return models, lib, scene


def test_library_roundtrip(small_world):
    _, lib, _ = small_world
    arrays, attrs = lib.to_arrays()
    assert all(isinstance(v, np.ndarray) for v in arrays.values())
    lib2 = ModelLibrary.from_arrays(arrays, attrs)
    assert lib2.names == lib.names and lib2.params == lib.params
    for k in arrays:
        np.testing.assert_array_equal(getattr(lib2, k), getattr(lib, k))
    assert (lib.model_id[lib.kp_offsets[1]:] == 1).all()
    assert len(lib.valid_rows) > 0.9 * len(lib.kp_id)
    with pytest.raises(InputError):
        ModelLibrary.from_arrays({}, attrs)


def test_library_match_search_is_prepared_once_and_not_pickled(small_world):
    """The library's exact search is built on the first match and reused; a pickled library (a
    Dask worker's copy) carries its arrays without it, and matches the same."""
    import pickle

    from scanforest.kernels.recognition.correspondences import match

    _, lib, scene = small_world
    desc = lib.descriptors[lib.valid_rows][::7] + np.float32(0.01)
    a = match(desc, lib, k=2)
    es = lib._exact_search("cpu")
    assert lib._exact_search("cpu") is es
    b = match(desc, lib, k=2)
    lib2 = pickle.loads(pickle.dumps(lib))
    assert "_search_cache" not in lib2.__dict__
    c = match(desc, lib2, k=2)
    for x, y in ((a, b), (a, c)):
        for f in ("scene_kp", "ref_row", "model_id", "dist2"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))


def test_library_rejects_bad_models():
    with pytest.raises(InputError):
        ModelLibrary.build([], device="cpu")
    with pytest.raises(InputError):
        ModelLibrary.build([np.zeros((5, 2))], device="cpu")


# --------------------------------------------------------------------------- verification
def _hyps(small_world, jitter_deg=0.0):
    _, lib, scene = small_world
    rng = np.random.default_rng(7)
    poses, mids = [], []
    for g in scene.ground_truth:
        T = np.array(g["pose"])
        for _ in range(3):   # the true pose and two near-duplicates of it
            poses.append(T.copy())
            mids.append(g["model_id"])
        poses[-1][:3, 3] += 0.002
    for _ in range(4):       # wrong poses of both models
        P = _pose(rng, 0.0)
        P[:3, 3] = scene.points[rng.integers(len(scene.points))]
        poses.append(P)
        mids.append(int(rng.integers(2)))
    return Hypotheses(np.array(mids, np.int32), np.array(poses), np.full(len(mids), 10, np.int32))


def test_verify_accepts_true_instances_once(small_world):
    _, lib, scene = small_world
    h = _hyps(small_world)
    r = verify(h, lib, scene.points, inlier_dist=0.008, min_inlier_fraction=0.6, device="cpu")
    picked = sorted(int(h.model_id[i]) for i in r.accepted)
    assert picked == sorted(g["model_id"] for g in scene.ground_truth)
    assert all(i < 6 for i in r.accepted)          # only true poses / duplicates
    assert (r.first_scores[6:] < 0.5).all()
    assert (r.scores > 0.8).all()


def test_verify_lookup_matches_a_float64_kdtree(small_world):
    """The CPU verification pass (numba, float32, cell list) against an independent float64
    reference: transform, visibility, nearest scene point by cKDTree, its voxel rank."""
    from scipy.spatial import cKDTree

    from scanforest.kernels.recognition._scene_index import _SceneIndex
    from scanforest.kernels.recognition.verification import _hyp_points, _verify_nearest_cpu

    _, lib, scene = small_world
    h = _hyps(small_world)
    r = 0.008
    idx = _SceneIndex(scene.points, None, r, "cpu")
    hyp, src, _ = _hyp_points(lib, np.asarray(h.model_id, np.int64), h.poses, np)
    got = _verify_nearest_cpu(idx, lib, hyp, src, h.poses, r, (0.0, 0.0, 0.0))
    R, t = h.poses[hyp, :3, :3], h.poses[hyp, :3, 3]
    P = np.einsum("nij,nj->ni", R, lib.verify_points[src].astype(np.float64)) + t
    N = np.einsum("nij,nj->ni", R, lib.verify_normals[src].astype(np.float64))
    visible = np.einsum("ni,ni->n", N, P) < 0
    d, ni = cKDTree(scene.points.astype(np.float64)).query(P, k=1)
    want = np.where(~visible, -2, np.where(d < r, idx.vox[np.minimum(ni, len(idx.vox) - 1)], -1))
    # float32 vs float64 can flip only points within a hair of the radius or of the view plane
    edge = np.abs(d - r) < 1e-6 * max(1.0, r)
    assert (got == -2).sum() > 100 and (got >= 0).sum() > 100 and (got == -1).sum() > 100
    np.testing.assert_array_equal(got[~edge], want[~edge])


def test_scene_voxel_ranks_match_the_sorted_reference(rng, pcl_dir):
    """Verification's voxel ranks (a hash of the occupied voxels) equal np.unique's inverse of the
    voxel keys (float32 (p - min) * (1 / cell), floor), on a scan in scan-line order, shuffled,
    and far from the origin."""
    from scanforest.kernels.descriptors.keypoints import voxel_ranks as _voxel_ranks_cpu

    def ref(p, cell):
        ijk = np.floor((p - p.min(axis=0)) * np.float32(1.0 / cell)).astype(np.int64)
        dims = ijk.max(axis=0) + 1
        return np.unique(ijk[:, 0] + dims[0] * (ijk[:, 1] + dims[1] * ijk[:, 2]), return_inverse=True)[1]

    _, s = _milk(pcl_dir)
    for p, cell in ((s, 0.005), (s[rng.permutation(len(s))], 0.0137),
                    ((rng.random((4000, 3)) * 50 + 1000).astype(np.float32), 0.7)):
        np.testing.assert_array_equal(_voxel_ranks_cpu(p, cell), ref(p, cell))


@pytest.mark.gpu
def test_verify_gpu_matches_cpu(small_world):
    import cupy as cp

    _, lib, scene = small_world
    h = _hyps(small_world)
    rc = verify(h, lib, scene.points, inlier_dist=0.008, min_inlier_fraction=0.6, device="cpu")
    rg = verify(h, lib, cp.asarray(scene.points), inlier_dist=0.008, min_inlier_fraction=0.6,
                device="gpu")
    assert rg.accepted.tolist() == rc.accepted.tolist()
    np.testing.assert_allclose(rg.first_scores, rc.first_scores, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("limit", [0, 2, None])
def test_acceptance_rounds_on_the_device_equal_the_host_rounds(limit):
    """The device's acceptance rounds (every round in one launch, a batch of scenes one block
    each) against the host's, bit for bit: random voxel lookups with many shared voxels, tied
    fractions, hypotheses with no visible point, thresholds that reject some, empty scenes."""
    import cupy as cp

    from scanforest.kernels.recognition import _verification_gpu as g
    from scanforest.kernels.recognition.verification import _accept_rounds

    rng = np.random.default_rng(3)
    sizes, voxes, n_vox, want = [], [], [], []
    for h in (0, 1, 40, 300, 2500, 7):
        nv = int(rng.integers(5, 300))
        z = rng.integers(0, 60, h)
        z[: h // 10] = 0  # no points at all
        hyp = np.repeat(np.arange(h), z)
        vox = rng.integers(-2, nv, len(hyp)).astype(np.int32)
        sizes.append(z)
        voxes.append(vox)
        n_vox.append(nv)
        want.append(_accept_rounds(vox, hyp, h, nv, 0.3, 3, h if limit is None else limit))
    got = g.accept_greedy(cp.asarray(np.concatenate(voxes)), sizes, n_vox, min_fraction=0.3, min_inliers=3,
                          limit=10**9 if limit is None else limit)
    n_acc = sum(len(w.accepted) for w in want)
    assert n_acc == 0 if limit == 0 else n_acc > 5
    for (acc, sc, inl, vis, first), w in zip(got, want):
        np.testing.assert_array_equal(acc, w.accepted)
        np.testing.assert_array_equal(sc, w.scores)
        np.testing.assert_array_equal(inl, w.inliers)
        np.testing.assert_array_equal(vis, w.visible)
        np.testing.assert_array_equal(first, w.first_scores)


# --------------------------------------------------------------------------- ICP
@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_icp_recovers_perturbation(small_world, device):
    models, lib, _ = small_world
    m = models[0]
    rng = np.random.default_rng(2)
    T = _pose(rng, 0.3)
    tgt = S.transform(m.points, T).astype(np.float32)
    tn = (m.normals @ T[:3, :3].T).astype(np.float32)
    ang = np.radians(3.0)
    D = np.eye(4)
    # a 3-degree rotation about a fixed axis and a few millimetres of translation
    ax = np.array([0.3, -0.5, 0.8]) / np.linalg.norm([0.3, -0.5, 0.8])
    K = np.array([[0, -ax[2], ax[1]], [ax[2], 0, -ax[0]], [-ax[1], ax[0], 0]])
    D[:3, :3] = np.eye(3) + np.sin(ang) * K + (1 - np.cos(ang)) * K @ K
    D[:3, 3] = [0.004, -0.003, 0.002]
    init = T @ D
    src = lib.verify_points[lib.verify_offsets[0]:lib.verify_offsets[1]]
    sn = lib.verify_normals[lib.verify_offsets[0]:lib.verify_offsets[1]]
    if device == "gpu":
        import cupy as cp

        tgt, tn = cp.asarray(tgt), cp.asarray(tn)
    res = icp_point_to_plane(src, tgt, tn, init=init, source_normals=sn,
                             max_correspondence_distance=0.02, max_iterations=40, device=device)
    r, t = pose_errors(res.pose, T)
    assert r < 0.2 and t < 1e-3
    assert res.fitness > 0.9


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_icp_batch_equals_one_by_one(small_world, device):
    """Lockstep ICP of several sources (both models, several starts) = the single-source ICP."""
    from scanforest.kernels.recognition.icp import icp_point_to_plane_batch
    from scanforest.kernels.recognition._scene_index import _SceneIndex

    _, lib, scene = small_world
    rng = np.random.default_rng(5)
    pts, nrm = scene.points, scene.normals
    if device == "gpu":
        import cupy as cp

        pts, nrm = cp.asarray(pts), cp.asarray(nrm)
    idx = _SceneIndex(pts, nrm, 0.01, device)
    srcs, sns, inits = [], [], []
    vo = lib.verify_offsets
    for g in scene.ground_truth:
        m = g["model_id"]
        for k in range(3):  # the true pose, then 2 and 4 degrees / millimetres off
            ax = rng.normal(size=3)
            ax /= np.linalg.norm(ax)
            K = np.array([[0, -ax[2], ax[1]], [ax[2], 0, -ax[0]], [-ax[1], ax[0], 0]])
            a = np.radians(2.0 * k)
            D = np.eye(4)
            D[:3, :3] = np.eye(3) + np.sin(a) * K + (1 - np.cos(a)) * K @ K
            D[:3, 3] = 0.002 * k * ax
            srcs.append(lib.verify_points[vo[m]:vo[m + 1]])
            sns.append(lib.verify_normals[vo[m]:vo[m + 1]])
            inits.append(np.array(g["pose"]) @ D)
    batch = icp_point_to_plane_batch(srcs, idx, inits=inits, source_normals=sns,
                                     max_correspondence_distance=0.01, max_iterations=20)
    for s, sn, T0, rb in zip(srcs, sns, inits, batch):
        r1 = icp_point_to_plane(s, None, None, init=T0, source_normals=sn, max_correspondence_distance=0.01,
                                max_iterations=20, _target_index=idx)
        assert rb.iterations == r1.iterations and rb.converged == r1.converged
        np.testing.assert_allclose(rb.pose, r1.pose, atol=1e-6)
        assert abs(rb.rmse - r1.rmse) <= 1e-6 * max(1.0, r1.rmse) or (np.isnan(rb.rmse) and np.isnan(r1.rmse))
    assert icp_point_to_plane_batch([], idx, inits=[], max_correspondence_distance=0.01) == []


@pytest.mark.parametrize("normals", [True, False])
def test_cpu_icp_batch_is_bit_equal_to_one_by_one(small_world, normals):
    """The CPU's lockstep batch (the active problems paired in parallel each iteration) gives
    each problem exactly the single-source ICP: poses, RMSE, fitness, iterations, convergence,
    for sources that converge, stop on the iteration cap or find too few pairs."""
    from scanforest.kernels.recognition.icp import icp_point_to_plane_batch
    from scanforest.kernels.recognition._scene_index import _SceneIndex

    _, lib, scene = small_world
    idx = _SceneIndex(scene.points, scene.normals, 0.01, "cpu")
    vo = lib.verify_offsets
    srcs, sns, inits = [], [], []
    rng = np.random.default_rng(11)
    for g in scene.ground_truth:
        m = g["model_id"]
        for off in (0.0, 0.003, 0.5):  # at the pose, 3 mm off, half a metre off (no pairs)
            D = np.eye(4)
            D[:3, 3] = off * rng.normal(size=3) / np.sqrt(3)
            srcs.append(lib.verify_points[vo[m]:vo[m + 1]])
            sns.append(lib.verify_normals[vo[m]:vo[m + 1]])
            inits.append(np.array(g["pose"]) @ D)
    for iters in (3, 30):
        batch = icp_point_to_plane_batch(srcs, idx, inits=inits, source_normals=sns if normals else None,
                                         max_correspondence_distance=0.01, max_iterations=iters)
        for s, sn, T0, rb in zip(srcs, sns, inits, batch):
            r1 = icp_point_to_plane(s, None, None, init=T0, source_normals=sn if normals else None,
                                    max_correspondence_distance=0.01, max_iterations=iters, _target_index=idx)
            assert (rb.iterations, rb.converged) == (r1.iterations, r1.converged)
            np.testing.assert_array_equal(rb.pose, r1.pose)
            np.testing.assert_array_equal([rb.rmse, rb.fitness], [r1.rmse, r1.fitness])
    assert {r.converged for r in batch} == {True, False}


def test_cpu_icp_pass_equals_the_array_reference(small_world):
    """The CPU's compiled ICP iteration (pairing and the 6x6 sums in one loop) against the numpy
    reference on gathered pairs (``_step``): the same pairs, the same sums up to float64 order,
    and the same ICP, with and without source normals."""
    from scanforest.kernels.recognition import icp as I
    from scanforest.kernels.recognition._icp_cpu import icp_normal_equations
    from scanforest.kernels.recognition._scene_index import _SceneIndex

    _, lib, scene = small_world
    r = 0.01
    idx = _SceneIndex(scene.points, scene.normals, r, "cpu")
    vo = lib.verify_offsets
    g = scene.ground_truth[0]
    m = g["model_id"]
    src = np.asarray(lib.verify_points[vo[m]:vo[m + 1]], np.float64)
    sn = np.asarray(lib.verify_normals[vo[m]:vo[m + 1]], np.float64)
    ax = np.array([0.6, -0.2, 0.77]) / np.linalg.norm([0.6, -0.2, 0.77])
    K = np.array([[0, -ax[2], ax[1]], [ax[2], 0, -ax[0]], [-ax[1], ax[0], 0]])
    D = np.eye(4)
    D[:3, :3] = np.eye(3) + np.sin(0.05) * K + (1 - np.cos(0.05)) * K @ K
    D[:3, 3] = [0.003, 0.002, -0.002]
    T0 = np.array(g["pose"]) @ D
    P = src @ T0[:3, :3].T + T0[:3, 3]
    ni, _ = idx.nearest(P, r)
    ok = ni >= 0
    j = np.maximum(ni, 0)
    Nq = idx.normals[j].astype(np.float64)
    ok &= np.isfinite(Nq).all(axis=1)
    ok &= np.einsum("ij,ij->i", sn @ T0[:3, :3].T, np.nan_to_num(Nq)) >= 0.5
    A_ref, b_ref, e = I._step(P[ok], idx.points[j[ok]].astype(np.float64), Nq[ok], np)
    A, b = np.empty((6, 6)), np.empty(6)
    kept, se = icp_normal_equations(src, sn, True, T0, *idx.cells(), np.float32(r * r), idx.points, idx.normals,
                                    0.5, A, b)
    assert kept == int(ok.sum()) > 100
    np.testing.assert_allclose(A, A_ref, rtol=1e-9, atol=1e-12 * np.abs(A_ref).max())
    np.testing.assert_allclose(b, b_ref, rtol=1e-9, atol=1e-12 * np.abs(b_ref).max())
    assert se == pytest.approx(float(e @ e), rel=1e-9)
    for normals in (sn, None):
        new = I._icp_cpu(src, normals, T0, idx, r, 20, 1e-7, 0.5)
        ref = I._icp_cpu_arrays(src, normals, T0, idx, r, 20, 1e-7, 0.5)
        assert new.iterations == ref.iterations > 1 and new.converged == ref.converged
        np.testing.assert_allclose(new.pose, ref.pose, atol=1e-9)
        assert new.rmse == pytest.approx(ref.rmse, rel=1e-6) and new.fitness == ref.fitness


@pytest.mark.gpu
def test_device_icp_equals_the_cpu_loop(small_world):
    """The device ICP loop (pairing, sums, 6x6 solves and pose updates on the GPU) against the CPU
    loop (float64, scipy KD-tree), including problems that stop early (too few pairs) and a
    planar source whose normal equations are exactly singular (minimum-norm least squares)."""
    import cupy as cp

    from scanforest.kernels.recognition.icp import icp_point_to_plane_batch
    from scanforest.kernels.recognition._scene_index import _SceneIndex

    _, lib, scene = small_world
    rng = np.random.default_rng(7)
    ic = _SceneIndex(scene.points, scene.normals, 0.01, "cpu")
    ig = _SceneIndex(cp.asarray(scene.points), cp.asarray(scene.normals), 0.01, "gpu")
    vo = lib.verify_offsets
    srcs, sns, inits = [], [], []
    for g in scene.ground_truth:
        m = g["model_id"]
        for k in range(4):
            D = np.eye(4)
            ax = rng.normal(size=3)
            ax /= np.linalg.norm(ax)
            K = np.array([[0, -ax[2], ax[1]], [ax[2], 0, -ax[0]], [-ax[1], ax[0], 0]])
            a = np.radians(1.5 * k)
            D[:3, :3] = np.eye(3) + np.sin(a) * K + (1 - np.cos(a)) * K @ K
            D[:3, 3] = 0.0015 * k * ax
            srcs.append(lib.verify_points[vo[m]:vo[m + 1]])
            sns.append(lib.verify_normals[vo[m]:vo[m + 1]])
            inits.append(np.array(g["pose"]) @ D)
    far = np.eye(4)
    far[:3, 3] = 100.0                       # nothing within reach: stops at iteration 1
    srcs.append(srcs[0]); sns.append(sns[0]); inits.append(far)
    # a flat patch (all normals equal: singular normal equations, checked below)
    flat = np.c_[rng.uniform(-0.02, 0.02, (400, 2)), np.zeros(400)]
    res_c = icp_point_to_plane_batch(srcs, ic, inits=inits, source_normals=sns,
                                     max_correspondence_distance=0.01, max_iterations=25)
    res_g = icp_point_to_plane_batch(srcs, ig, inits=inits, source_normals=sns,
                                     max_correspondence_distance=0.01, max_iterations=25)
    for rc, rg in zip(res_c, res_g):
        assert rg.converged == rc.converged
        assert abs(rg.iterations - rc.iterations) <= 1
        np.testing.assert_allclose(rg.pose, rc.pose, atol=2e-5)
        assert rg.fitness == pytest.approx(rc.fitness, abs=2e-3)
        assert (np.isnan(rg.rmse) and np.isnan(rc.rmse)) or rg.rmse == pytest.approx(rc.rmse, rel=1e-3)
    assert res_g[-1].iterations == 1 and res_g[-1].fitness == 0.0
    # singular normal equations: a plane against a plane leaves 3 degrees of freedom free
    tn = np.tile([0.0, 0.0, 1.0], (len(flat), 1))
    tgt = flat + [0.0, 0.0, 0.001]
    init = np.eye(4)
    out = []
    for dev, xp in (("cpu", np), ("gpu", cp)):
        out.append(icp_point_to_plane(flat, xp.asarray(tgt), xp.asarray(tn), init=init,
                                      max_correspondence_distance=0.01, max_iterations=5, device=dev))
    np.testing.assert_allclose(out[1].pose, out[0].pose, atol=1e-9)
    assert out[1].pose[2, 3] == pytest.approx(0.001, abs=1e-9)   # the free directions are not moved


def test_icp_rejects_bad_input():
    with pytest.raises(InputError):
        icp_point_to_plane(np.zeros((10, 3)), np.zeros((10, 3)), np.zeros((10, 3)),
                           max_correspondence_distance=0.0)
    with pytest.raises(InputError):
        icp_point_to_plane(np.zeros((10, 3)), np.zeros((10, 3)), np.zeros((10, 3)),
                           init=np.eye(3), max_correspondence_distance=0.1)


# --------------------------------------------------------------------------- end to end
SMALL_REC = dict(scene_ss=0.015, method="gc", cg_size=0.02, cg_thresh=5, normal_radius=0.015,
                 inlier_dist=0.008, min_inlier_fraction=0.7)


def test_recognize_small_synthetic_scene(small_world):
    _, lib, scene = small_world
    dets = recognize(scene.points, lib, device="cpu", **SMALL_REC)
    ev = evaluate(dets, scene.ground_truth, max_translation=10 * scene.resolution)
    assert ev["tp"] == len(scene.ground_truth) and ev["fp"] == 0
    assert max(ev["rotation_errors"]) < 2.0
    assert max(ev["translation_errors"]) < 2 * scene.resolution
    assert set(dets.timings) >= {"normals", "keypoints", "shot", "matching", "grouping",
                                 "verification", "icp", "total"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_forest_matching_at_a_recall_finds_what_exact_matching_finds(small_world, device):
    """``match_recall``: the library's KD-forest, calibrated for that recall on its own rows, in
    place of the brute force: the same instances at the ground-truth poses, and its calibration
    kept on the library (one per recall) for the next scene."""
    _, lib, scene = small_world
    pts = scene.points
    if device == "gpu":
        import cupy as cp

        pts = cp.asarray(pts)
    dets = recognize(pts, lib, device=device, match_recall=0.95, **SMALL_REC)
    ev = evaluate(dets, scene.ground_truth, max_translation=10 * scene.resolution)
    assert ev["tp"] == len(scene.ground_truth) and ev["fp"] == 0
    assert max(ev["translation_errors"]) < 2 * scene.resolution and max(ev["rotation_errors"]) < 2.0
    forest = lib.forest_search(device)
    assert forest.calibration_["target"] == 0.95 and forest.calibration_["recall"] >= 0.95
    assert forest is lib.forest_search(device)  # built once per device


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_recognize_with_pcha_refinement(small_world, device):
    """Parametric chamfer alignment as the refinement: same detections, poses within 2 degrees."""
    _, lib, scene = small_world
    pts = scene.points
    if device == "gpu":
        import cupy as cp

        pts = cp.asarray(pts)
    dets = recognize(pts, lib, device=device, refine="pcha", backend="gpu", **SMALL_REC)  # PChA on the device
    ev = evaluate(dets, scene.ground_truth, max_translation=10 * scene.resolution)
    assert ev["tp"] == len(scene.ground_truth) and ev["fp"] == 0
    assert max(ev["rotation_errors"]) < 2.0
    assert max(ev["translation_errors"]) < 2 * scene.resolution
    assert all(d.icp_rmse is not None and d.icp_rmse < SMALL_REC["inlier_dist"] for d in dets)
    with pytest.raises(InputError):
        recognize(scene.points, lib, device="cpu", refine="lm", **SMALL_REC)


@pytest.mark.gpu
def test_recognize_gpu_agrees_with_cpu(small_world):
    import cupy as cp

    _, lib, scene = small_world
    dc = recognize(scene.points, lib, device="cpu", **SMALL_REC)
    dg = recognize(cp.asarray(scene.points), lib, device="gpu", backend="gpu", **SMALL_REC)
    eg = evaluate(dg, scene.ground_truth, max_translation=10 * scene.resolution)
    assert eg["tp"] == len(scene.ground_truth) and eg["fp"] == 0
    assert sorted(d.model_id for d in dg) == sorted(d.model_id for d in dc)


def _milk(pcl_dir):
    from scanforest.deploy.bench.recognize import load_milk

    return load_milk(pcl_dir)


MILK = dict(scene_ss=0.03, method="hough", cg_size=0.01, cg_thresh=5, inlier_dist=0.005)


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_milk_carton_found_once_at_identity(pcl_dir, device):
    m, s = _milk(pcl_dir)
    # milk.pcd was cut out of the scene: every model point is a scene point (true pose = I)
    from scipy.spatial import cKDTree

    assert cKDTree(s).query(m)[0].max() == 0.0
    lib = ModelLibrary.build([m], ["milk"], model_ss=0.01, descr_rad=0.02, rf_rad=0.015,
                             normal_k=10, device=device)
    if device == "gpu":
        import cupy as cp

        s = cp.asarray(s)
    dets = recognize(s, lib, device=device, **MILK)
    assert len(dets) == 1
    r, t = pose_errors(dets[0].pose, np.eye(4))
    assert r < 0.5 and t < 0.002
    assert dets[0].score > 0.9 and dets[0].correspondences >= 5


#: the thinned pipeline's settings on PCL's scene: a 15 mm voxel, radii scaled to it
MILK_VOXEL = dict(voxel=0.015, model_ss=0.03, descr_rad=0.06, rf_rad=0.045)


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_milk_carton_found_in_the_thinned_scene(pcl_dir, device):
    """scene_voxel + a library built at the same voxel: the carton found once, at the true pose
    (the identity), from a scene of 1/18 of the points; moved by a known rigid motion, and at UTM
    offsets (the pose in the scene's own coordinates), the same."""
    m, s = _milk(pcl_dir)
    lib = ModelLibrary.build([m], ["milk"], normal_k=10, device=device, **MILK_VOXEL)
    assert lib.params["voxel"] == 0.015 and len(lib.points) < len(m) / 5
    T = np.eye(4)
    T[:3, :3] = Rotation.from_rotvec(np.radians(30) * np.array([0.3, 1.0, 0.2]) / np.linalg.norm([0.3, 1.0, 0.2])
                                     ).as_matrix()
    T[:3, 3] = (0.1, -0.12, 0.15)
    moved = (s.astype(np.float64) @ T[:3, :3].T + T[:3, 3]).astype(np.float32)
    off = np.array([512345.0, 4123456.0, 87.0])  # UTM-sized: the scene's own coordinates in float64
    G = np.eye(4)
    G[:3, 3] = off
    for scene, pose, origin in ((s, np.eye(4), None), (moved, T, None), (s.astype(np.float64) + off, G, off)):
        if device == "gpu":
            import cupy as cp

            scene = cp.asarray(scene)
        vp = tuple(pose[:3, 3] - (0 if origin is None else origin))  # relative to the origin
        dets = recognize(scene, lib, device=device, scene_voxel=0.015, scene_ss=0.045, method="gc", cg_size=0.03,
                         inlier_dist=0.015, viewpoint=vp, origin=origin)
        assert dets.info["scene_points"] < len(s) / 10
        assert len(dets) == 1
        # found on 15 mm centroids (1.5-5 mm off), then polished on the scene's own points, which
        # hold the model's (it was cut from the scene)
        r, t = pose_errors(dets[0].pose, pose)
        assert r < 0.01 and t < 1e-4, (r, t)
    # the polish on the scene's points averaged into 3 mm voxels: near the pose, no longer exact
    scene = s if device == "cpu" else cp.asarray(s)
    dets = recognize(scene, lib, device=device, scene_voxel=0.015, scene_ss=0.045, method="gc", cg_size=0.03,
                     inlier_dist=0.015, polish_voxel=0.003)
    r, t = pose_errors(dets[0].pose, np.eye(4))
    assert len(dets) == 1 and r < 0.2 and 1e-6 < t < 0.002, (r, t)


def test_voxel_settings_are_checked(pcl_dir):
    m, s = _milk(pcl_dir)
    with pytest.raises(InputError, match="voxel"):
        ModelLibrary.build([m], ["milk"], voxel=-1.0, device="cpu")
    with pytest.raises(InputError, match="voxel.*views|views.*voxel"):
        ModelLibrary.build([m], ["milk"], voxel=0.01, views=4, models_normals=[m], device="cpu")
    with pytest.raises(InputError, match="after thinning to 0.5 m voxels"):
        ModelLibrary.build([m], ["milk"], voxel=0.5, device="cpu")
    lib = ModelLibrary.build([m], ["milk"], device="cpu", **MILK_VOXEL)
    with pytest.raises(InputError, match="scene_normals"):
        recognize(s, lib, device="cpu", scene_voxel=0.015, scene_normals=np.zeros_like(s))
    with pytest.raises(InputError, match="scene_voxel 5 leaves 4 of the scene's"):
        recognize(s, lib, device="cpu", scene_voxel=5.0)


def test_recognize_rejects_bad_input(small_world):
    _, lib, scene = small_world
    with pytest.raises(InputError, match="method"):
        recognize(scene.points, lib, method="ransac", device="cpu")
    with pytest.raises(InputError, match="ModelLibrary"):
        recognize(scene.points, {"not": "a library"}, device="cpu")
    with pytest.raises(InputError, match="empty"):
        recognize(np.zeros((0, 3), np.float32), lib, device="cpu")
    with pytest.raises(InputError, match="shape"):
        recognize(np.zeros((10, 2), np.float32), lib, device="cpu")
    with pytest.raises(InputError, match="inlier_dist"):
        verify(_hyps(small_world), lib, scene.points, inlier_dist=0.0, device="cpu")


def test_recognize_without_verification_returns_every_hypothesis(small_world):
    _, lib, scene = small_world
    dets = recognize(scene.points, lib, device="cpu", verify=False, **SMALL_REC)
    assert len(dets) == dets.info["hypotheses"] >= len(scene.ground_truth)
    assert all(np.isnan(d.score) for d in dets)


# --------------------------------------------------------------------------- parameters
#: recognize()'s keyword defaults before they moved onto RecognizeParams
_DEFAULTS = dict(scene_ss=0.03, scene_voxel=None, polish_voxel=None, polish_stages=3, descr_rad=None, rf_rad=None, normal_k=10, normal_radius=None, method="hough",
                 cg_size=0.01, cg_thresh=5, use_interpolation=True, match_k=1, max_dist2=0.25, ratio=None,
                 match_recall=None, ransac=True, verify=True, inlier_dist=None, min_inlier_fraction=0.5, min_inliers=10,
                 viewpoint=(0.0, 0.0, 0.0), icp=True, icp_iterations=30, refine_min_fraction=0.3, max_refine=32,
                 refine="icp", max_detections=None, seed=0, backend="auto")


def test_recognize_params_defaults_and_frozen():
    import dataclasses

    import scanforest as sf

    p = RecognizeParams()
    assert dataclasses.asdict(p) == _DEFAULTS
    assert RecognizeParams.names() == tuple(_DEFAULTS)
    assert sf.RecognizeParams is RecognizeParams
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.method = "gc"
    q = p.replace(method="gc", viewpoint=np.array([0, 0, 1]))
    assert (q.method, q.viewpoint, p.method) == ("gc", (0.0, 0.0, 1.0), "hough")
    assert q == RecognizeParams(method="gc", viewpoint=[0.0, 0.0, 1.0]) and hash(q) == hash(RecognizeParams(
        method="gc", viewpoint=(0, 0, 1)))


@pytest.mark.parametrize("bad, word", [
    (dict(method="ransac"), "method"), (dict(refine="lm"), "refine"), (dict(scene_ss=0.0), "scene_ss"),
    (dict(cg_size=-0.01), "cg_size"), (dict(descr_rad=float("nan")), "descr_rad"), (dict(match_k=0), "match_k"),
    (dict(max_refine=0), "max_refine"), (dict(icp_iterations=2.5), "icp_iterations"),
    (dict(ratio=1.5), "ratio"), (dict(min_inlier_fraction=2.0), "min_inlier_fraction"),
    (dict(min_inliers=-1), "min_inliers"), (dict(verify="yes"), "verify"), (dict(viewpoint=(0, 0)), "viewpoint"),
    (dict(method="gc", cg_thresh=-1), "cg_thresh"), (dict(max_detections=0), "max_detections"),
    (dict(seed=1.5), "seed"), (dict(match_recall=1.0), "match_recall"), (dict(match_recall="0.9"), "match_recall"),
    (dict(scene_voxel=0.0), "scene_voxel"), (dict(scene_voxel=float("inf")), "scene_voxel"),
    (dict(polish_voxel=-1.0), "polish_voxel"), (dict(polish_stages=0), "polish_stages"), (dict(polish_stages=2.0), "polish_stages"), (dict(normal_k=2), "normal_k must be >= 3"),
    (dict(match_k=1000), "match_k must be at most 256"), (dict(method="gc", cg_thresh=2), "cg_thresh"),
])
def test_recognize_params_refuse_bad_values(bad, word):
    with pytest.raises(InputError, match=word) as err:
        RecognizeParams(**bad)
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match=word):  # also as recognize()'s keywords, before any work
        recognize(np.zeros((10, 3), np.float32), None, device="cpu", **bad)
    RecognizeParams(method="hough", cg_thresh=-0.5)  # Hough: a fraction of the maximum


def test_recognize_refuses_unknown_parameters():
    with pytest.raises(InputError, match="unknown parameter 'cg_sise'; RecognizeParams has: scene_ss, "):
        recognize(np.zeros((10, 3), np.float32), None, device="cpu", cg_sise=0.02)
    with pytest.raises(InputError, match="unknown parameter 'scene_normal'"):
        RecognizeParams().replace(scene_normal=None)
    with pytest.raises(InputError, match="params must be a RecognizeParams"):
        recognize(np.zeros((10, 3), np.float32), None, {"method": "gc"}, device="cpu")


def test_recognize_with_params_equals_keywords(small_world):
    _, lib, scene = small_world
    by_kw = recognize(scene.points, lib, device="cpu", **SMALL_REC)
    by_params = recognize(scene.points, lib, RecognizeParams(**SMALL_REC), device="cpu")
    overridden = recognize(scene.points, lib, RecognizeParams(**dict(SMALL_REC, method="hough", cg_size=0.05)),
                           device="cpu", method="gc", cg_size=SMALL_REC["cg_size"])
    assert len(by_kw) == len(scene.ground_truth)
    for dets in (by_params, overridden):
        assert [d.as_dict() for d in dets] == [d.as_dict() for d in by_kw]
        assert dets.info == by_kw.info


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_recognition_from_a_stored_description_and_matches_equals_recognize(small_world, device):
    """The archive's path (a description and a top-P search done elsewhere, then grouping,
    verification and refinement) gives the detections of the one-scene API, on both devices."""
    from scanforest.kernels.backend import to_numpy
    from scanforest.kernels.knn.bruteforce import knn_bruteforce
    from scanforest.kernels.recognition import describe, from_neighbours, recognize_described

    _, lib, scene = small_world
    want = recognize(scene.points, lib, device=device, **SMALL_REC)
    assert len(want) == len(scene.ground_truth)
    p = RecognizeParams(**SMALL_REC)
    d = describe(scene.points.astype(np.float32), normal_k=p.normal_k, normal_radius=p.normal_radius,
                 keypoint_radius=p.scene_ss, descr_rad=lib.params["descr_rad"], device=device)
    nrm, kp, desc = (to_numpy(d[k]) for k in ("normals", "keypoints", "descriptors"))
    pts = scene.points
    if device == "gpu":
        import cupy as cp

        pts = cp.asarray(pts)
    # 1. the stored description, matched here
    got = recognize_described(pts, lib, p, normals=nrm, keypoints=kp, descriptors=desc, device=device)
    # 2. the stored description and a stored top-4 over the library's reference rows (the index)
    ok = np.flatnonzero(np.isfinite(desc).all(axis=1))
    d2, ids = knn_bruteforce(lib.reference(), desc[ok], 4, device="cpu")
    corr = from_neighbours(ok, d2, ids, lib, k=p.match_k, max_dist2=p.max_dist2)
    got2 = recognize_described(pts, lib, p, normals=nrm, keypoints=kp, correspondences=corr, device=device)
    for dets in (got, got2):
        assert [x.model_id for x in dets] == [x.model_id for x in want]
        for a, b in zip(dets, want):
            np.testing.assert_allclose(a.pose, b.pose, atol=1e-6)
            assert a.inliers == b.inliers and a.score == pytest.approx(b.score)
        assert dets.info["correspondences"] == want.info["correspondences"]


def test_recognize_described_refuses_bad_input(small_world):
    from scanforest.kernels.recognition import recognize_described

    _, lib, scene = small_world
    n = len(scene.points)
    with pytest.raises(InputError, match="descriptors or their correspondences"):
        recognize_described(scene.points, lib, normals=np.zeros((n, 3)), keypoints=np.arange(5))
    with pytest.raises(InputError, match="rows"):
        recognize_described(scene.points, lib, normals=np.zeros((n - 1, 3)), keypoints=np.arange(5),
                            descriptors=np.zeros((5, 352)))
    with pytest.raises(InputError, match="index"):
        recognize_described(scene.points, lib, normals=np.zeros((n, 3)), keypoints=np.array([n]),
                            descriptors=np.zeros((1, 352)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_recognize_many_equals_recognize_one_scene_at_a_time(device):
    """Raw scenes recognised together (each described and matched alone, grouped as a batch):
    the detections of ``recognize`` on each scene."""
    from scanforest.kernels.backend import xp_for
    from scanforest.kernels.recognition import ModelLibrary, recognize, recognize_many

    xp = xp_for(device)
    models = S.model_library(3, 3_000, seed=3)
    lp, rp = S.recognition_presets(device, 10_000)
    lib = ModelLibrary.build([m.points for m in models], [m.name for m in models],
                             models_normals=[m.normals for m in models], device=device, **lp)
    scenes = [xp.asarray(S.make_scene(models, n_instances=2, n_points=10_000, noise=0.2, clutter=2,
                                      seed=910 + seed).points) for seed in range(3)]
    many = recognize_many(scenes, lib, device=device, **rp)
    assert len(many) == 3 and sum(len(x) for x in many) >= 2
    for pts, got in zip(scenes, many):
        want = recognize(pts, lib, device=device, backend="gpu", **rp)  # alone on the device, as the batch
        assert [d.model_id for d in got] == [d.model_id for d in want]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.pose, b.pose, atol=1e-9)
            assert (a.score, a.inliers) == (b.score, b.inliers)
        assert got.timings["total"] == pytest.approx(sum(v for k, v in got.timings.items() if k != "total"))
    assert recognize_many([], lib, device=device) == []


def test_group_list_reads_as_a_list_of_groups():
    """GroupList (the GPU grouping's flat groups) reads, takes and concatenates as the list of
    arrays it stands for."""
    from scanforest.kernels.recognition._groups import take_groups
    from scanforest.kernels.recognition.grouping import GroupList, Hypotheses

    lists = [np.array([4, 1, 7]), np.array([], np.int64), np.array([2]), np.array([9, 3])]
    gl = GroupList(np.concatenate(lists), np.array([0, 3, 3, 4, 6]))
    assert len(gl) == 4 and bool(gl) and not GroupList(np.zeros(0, np.int64), np.zeros(1, np.int64))
    for a, b in zip(gl, lists):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(gl[-1], lists[-1])
    assert [x.tolist() for x in gl[1:3]] == [[], [2]]
    with pytest.raises(IndexError):
        gl[4]
    keep = np.array([True, False, True, True])
    for got in (take_groups(gl, keep), take_groups(lists, keep)):
        assert [x.tolist() for x in got] == [[4, 1, 7], [2], [9, 3]]
    h = Hypotheses(np.zeros(4, np.int32), np.zeros((4, 4, 4)), np.zeros(4, np.int32), gl)
    both = Hypotheses.concat([h, Hypotheses(np.ones(1, np.int32), np.zeros((1, 4, 4)), np.ones(1, np.int32),
                                            [np.array([5])])])
    assert [x.tolist() for x in both.groups] == [[4, 1, 7], [], [2], [9, 3], [5]]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_gpu_scene_grouped_verified_and_refined_on_the_host(small_world, backend):
    """``backend="cpu"`` (and ``"auto"``, the default, where its rule sends the scene: at most
    HOST_BACKEND_POINTS described points and HOST_BACKEND_CORRESPONDENCES correspondences): a scene
    described on the GPU is grouped, verified and refined on the host, with the detections of the
    GPU's own phases; in a batch (``recognize_many``) too, where ``"auto"`` keeps it on the device."""
    import cupy as cp
    from scanforest import recognize_many
    from scanforest.kernels.recognition import pipeline as P

    _, lib, scene = small_world
    pts = cp.asarray(scene.points)
    dg = recognize(pts, lib, device="gpu", backend="gpu", **SMALL_REC)
    dh = recognize(pts, lib, device="gpu", backend=backend, **SMALL_REC)
    host = backend == "cpu" or (dh.info["scene_points"] <= P.HOST_BACKEND_POINTS
                                and dh.info["correspondences"] <= P.HOST_BACKEND_CORRESPONDENCES)
    assert dg.info["backend"] == "gpu" and dh.info["backend"] == ("cpu" if host else "gpu")
    assert dh.info["device"] == "gpu"
    assert sorted(d.model_id for d in dh) == sorted(d.model_id for d in dg)
    for a, b in zip(sorted(dg, key=lambda d: d.model_id), sorted(dh, key=lambda d: d.model_id)):
        r, t = pose_errors(a.pose, b.pose)
        assert r < 0.1 and t < 0.1 * scene.resolution
    many = recognize_many([pts, pts], lib, device="gpu", backend=backend, **SMALL_REC)
    assert [sorted(d.model_id for d in x) for x in many] == [sorted(d.model_id for d in dh)] * 2
    # "auto" leaves a batch's scenes on the device (their grouping is one launch for all)
    assert all(x.info["backend"] == {"cpu": "cpu", "auto": "gpu"}[backend] for x in many)


def test_backend_is_checked():
    with pytest.raises(InputError, match="backend must be"):
        RecognizeParams(backend="tpu")


def test_where_a_gpu_scenes_last_phases_run():
    """``backend``'s rule (the GPU itself is not needed to check where a scene would go): "auto"
    sends a scene recognised alone with at most HOST_BACKEND_POINTS described points and
    HOST_BACKEND_CORRESPONDENCES correspondences to the host, keeps a larger one (in either) and
    every scene of a batch on the device; "gpu" and "cpu" force either; a scene described on the
    CPU stays there."""
    from scanforest.kernels.backend import Timer
    from scanforest.kernels.recognition import pipeline as P
    from scanforest.kernels.recognition.correspondences import Correspondences

    def matched(n, backend, dev="gpu", nc=P.HOST_BACKEND_CORRESPONDENCES):
        pts = np.zeros((n, 3), np.float32)
        corr = Correspondences(*(np.zeros(nc, t) for t in (np.int64, np.int64, np.int32, np.int64, np.float32)))
        return P._Matched(pts, {"kp_coords": pts[:5]}, corr, RecognizeParams(backend=backend), dev, Timer(False),
                          None, 0.01, np.zeros(3), np.zeros(3))

    small, large = P.HOST_BACKEND_POINTS, P.HOST_BACKEND_POINTS + 1
    many = P.HOST_BACKEND_CORRESPONDENCES + 1
    assert RecognizeParams().backend == "auto"
    for n, nc, backend, alone, want in ((small, 0, "auto", True, "cpu"), (large, 0, "auto", True, "gpu"),
                                        (small, many - 1, "auto", True, "cpu"), (small, many, "auto", True, "gpu"),
                                        (small, 0, "auto", False, "gpu"), (large, many, "cpu", False, "cpu"),
                                        (small, 0, "gpu", True, "gpu")):
        got = P._backend(matched(n, backend, nc=nc), alone=alone)
        assert got.dev == want, (n, nc, backend, alone)
        assert got.described_on == ("gpu" if want == "cpu" else None)
    assert P._backend(matched(small, "cpu", dev="cpu")).dev == "cpu"


def test_polish_fit_is_the_numpy_loop_and_finds_the_pose():
    """The polish's numba loop (_polish_cpu.polish_fit) against its reference written with numpy
    here: the same pairs (float32 nearest strictly within the radius, by brute force), the same
    Umeyama steps (rigid_transform), the same stop; and the pose a model was moved by."""
    from scanforest.kernels.neighbors.search import cpu_grid
    from scanforest.kernels.recognition._polish_cpu import polish_fit
    from scanforest.kernels.recognition.rigid import rigid_transform

    rng = np.random.default_rng(7)
    u, v = rng.random((2, 4000))
    crop = np.stack([u * 0.2, v * 0.2, 0.03 * np.sin(9 * u) * np.cos(7 * v)], 1).astype(np.float32)
    truth = np.eye(4)
    truth[:3, :3] = Rotation.from_euler("xyz", [0.6, -0.4, 0.9], degrees=True).as_matrix()
    truth[:3, 3] = [0.002, -0.001, 0.0015]
    model = crop[::7].astype(np.float64)  # the model in its own frame: truth maps it onto the crop
    V = (model - truth[:3, 3]) @ truth[:3, :3]
    r = 0.01
    r2 = np.float32(r * r)

    def reference(T):
        for _ in range(30):
            W = V @ T[:3, :3].T + T[:3, 3]
            q = W.astype(np.float32)
            d = q[:, None, :] - crop[None, :, :]
            d2 = (d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1]) + d[..., 2] * d[..., 2]
            j = d2.argmin(axis=1)
            ok = d2[np.arange(len(q)), j] < r2
            if ok.sum() < 3:
                break
            step = rigid_transform(W[ok], crop[j[ok]].astype(np.float64))
            T = step @ T
            if np.abs(step[:3, 3]).max() < 1e-9 and np.abs(step[:3, :3] - np.eye(3)).max() < 1e-9:
                break
        return T

    P, order, cs, origin, inv_h, dims = cpu_grid(crop, r, slot="test-polish")
    T0 = np.eye(4)
    got = polish_fit(np.ascontiguousarray(V), T0, P, order, cs, origin, inv_h, dims, crop.astype(np.float64), r2, 30)
    want = reference(T0.copy())
    np.testing.assert_allclose(got, want, atol=1e-12)
    np.testing.assert_allclose(got, truth, atol=1e-9)
    assert not np.allclose(T0, truth, atol=1e-4)  # the fit had somewhere to go


def _polish_world():
    """A synthetic scene, its library and each instance's pose moved a few mm and about 1 degree."""
    models = S.model_library(3, 8000, seed=5)
    lib = ModelLibrary.build([m.points for m in models], [m.name for m in models],
                             models_normals=[m.normals for m in models], model_ss=0.01, device="cpu")
    sc = S.make_scene(models, n_instances=3, n_points=120_000, noise=0.2, clutter=3, seed=8)
    rng = np.random.default_rng(2)
    truth = [np.asarray(g["pose"], np.float64) for g in sc.ground_truth]
    mids = [int(g["model_id"]) for g in sc.ground_truth]
    starts = []
    for T in truth:
        D = np.eye(4)  # a turn about the model's own origin, then a shift
        D[:3, :3] = Rotation.from_rotvec(np.radians(1.0) * rng.normal(size=3) / np.sqrt(3)).as_matrix()
        T0 = T @ D
        T0[:3, 3] += rng.uniform(-0.002, 0.002, 3)
        starts.append(T0)
    return lib, np.ascontiguousarray(sc.points, np.float32), starts, mids, truth


def test_polish_stages_halve_the_pairs_distance():
    """polish_poses with stages=3 goes on from the one-stage fit with pairs within dist / 2, then
    dist / 4 (the same crops and model points): near the chained one-stage polishes (which cut
    their crops again about the moved poses) and nearer the true poses than one stage on these
    noisy scenes."""
    from scanforest.kernels.recognition.refinement import polish_poses

    lib, scene, starts, mids, truth = _polish_world()
    kw = dict(iterations=30, viewpoint=np.zeros(3), voxel=0.003)
    three = polish_poses(starts, mids, lib, scene, dist=0.005, stages=3, **kw)
    one = polish_poses(starts, mids, lib, scene, dist=0.005, **kw)
    chain = polish_poses(polish_poses(one, mids, lib, scene, dist=0.0025, **kw), mids, lib, scene, dist=0.00125, **kw)
    for a, b, c in zip(three, chain, one):
        assert pose_errors(a, b)[1] < 5e-5 < pose_errors(a, c)[1]
    err = lambda poses: np.median([pose_errors(P, t)[1] for P, t in zip(poses, truth)])  # noqa: E731
    assert err(three) < err(one) < err(starts), (err(three), err(one), err(starts))
    with pytest.raises(InputError, match="stages"):
        polish_poses(starts, mids, lib, scene, dist=0.005, stages=0)


@pytest.mark.gpu
@pytest.mark.parametrize("voxel, stages", [(None, 1), (0.003, 1), (0.003, 3)])
def test_polish_on_the_device_is_the_host_polish(voxel, stages):
    """polish_poses on a CuPy scene (every pose at once: one cut of the crops, one launch an
    iteration) gives the host loop's poses (a numpy scene, one crop and one fit a pose), with and
    without the voxel averaging, in stages, from poses a few mm and about 1 degree off: the same
    fit to 10 um."""
    import cupy as cp

    from scanforest.kernels.recognition.refinement import polish_poses

    lib, scene, starts, mids, truth = _polish_world()
    kw = dict(dist=0.005, iterations=30, viewpoint=np.zeros(3), voxel=voxel, stages=stages)
    host = polish_poses(starts, mids, lib, scene, **kw)
    dev = polish_poses(starts, mids, lib, cp.asarray(scene), **kw)
    moved = 0
    for h, d, s0, t in zip(host, dev, starts, truth):
        r, tr = pose_errors(d, h)
        assert r < 1e-3 and tr < 1e-5, (r, tr)
        moved += pose_errors(h, s0)[1] > 1e-4  # the fit went somewhere
    assert moved == len(truth)
