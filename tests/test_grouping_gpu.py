"""Geometric-consistency grouping and RANSAC on the GPU against the sequential CPU sweep."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.synthetic import scenes as S

pytestmark = pytest.mark.gpu


def _groups(rng, sizes, quantise):
    """Groups of (scene, model) keypoint pairs: a third from one rigid instance (small noise),
    the rest random; quantised coordinates make exact ties and pairs on the threshold."""
    Ss, Ms, offs = [], [], [0]
    for n in sizes:
        Sx = rng.random((n, 3)) * 0.3
        Mx = rng.random((n, 3)) * 0.3
        k = n // 3
        if k:
            A = rng.random((k, 3)) * 0.2
            Sx[:k] = A @ S.random_rotation(rng).T + 0.05
            Mx[:k] = A + rng.normal(0, 0.004, (k, 3))
            perm = rng.permutation(n)
            Sx, Mx = Sx[perm], Mx[perm]
        if quantise:
            Sx, Mx = np.round(Sx * 200) / 200, np.round(Mx * 200) / 200
        Ss.append(Sx.astype(np.float32))
        Ms.append(Mx.astype(np.float32))
        offs.append(offs[-1] + n)
    return np.concatenate(Ss), np.concatenate(Ms), np.asarray(offs)


@pytest.mark.parametrize("quantise", [False, True])
@pytest.mark.parametrize("gc_size,thr", [(0.005, 2), (0.01, 3), (0.02, 5)])
def test_gpu_gc_labels_equal_the_sequential_cpu_sweep(rng, quantise, gc_size, thr):
    """Label for label, PCL's acceptance order: many groups of 0 to 2,500 pairs in one launch."""
    import cupy as cp

    from scanforest.kernels.recognition._grouping_gpu import gc_sets_batch
    from scanforest.kernels.recognition.grouping import _gc_sets_nb

    sizes = [0, 1, 5, 37, 400, 2500, 129, 64]
    Sx, Mx, offs = _groups(rng, sizes, quantise)
    labels, nsets = gc_sets_batch(cp.asarray(Sx), cp.asarray(Mx), offs, gc_size, thr)
    labels, nsets = labels.get(), nsets.get()
    for g in range(len(sizes)):
        a, b = offs[g], offs[g + 1]
        want = _gc_sets_nb(Sx[a:b], Mx[a:b], np.float64(gc_size), thr)
        np.testing.assert_array_equal(labels[a:b], want, err_msg=f"group {g} ({b - a} pairs)")
        assert nsets[g] == (want.max() + 1 if (want >= 0).any() else 0)


def test_gpu_ransac_recovers_known_poses_and_inliers(rng):
    import cupy as cp

    from scanforest.kernels.recognition._grouping_gpu import ransac_groups

    truths, srcs, dsts, outs = [], [], [], []
    for n in (3, 8, 40, 300):
        T = S.pose_matrix(S.random_rotation(rng), rng.normal(size=3) * 0.3)
        src = rng.uniform(-0.1, 0.1, (n, 3))
        dst = src @ T[:3, :3].T + T[:3, 3]
        bad = np.zeros(n, bool)
        if n > 8:
            bad[rng.choice(n, n // 4, replace=False)] = True
            dst[bad] += rng.uniform(0.05, 0.2, (int(bad.sum()), 3))
        truths.append(T), srcs.append(src), dsts.append(dst), outs.append(bad)
    offs = np.concatenate([[0], np.cumsum([len(s) for s in srcs])])
    poses, inl, cnt = ransac_groups(cp.asarray(np.concatenate(srcs)), cp.asarray(np.concatenate(dsts)), offs,
                                    threshold=0.005, seed=3)
    poses, inl, cnt = poses.get(), inl.get(), cnt.get()
    for g, T in enumerate(truths):
        np.testing.assert_allclose(poses[g], T, atol=1e-9)
        np.testing.assert_array_equal(inl[offs[g]:offs[g + 1]], ~outs[g])
        assert cnt[g] == (~outs[g]).sum()


def test_gpu_group_gc_equals_cpu_on_unambiguous_groups(rng):
    """Two clean instances of one model and clutter: the same consensus sets, inliers and poses
    (to 1e-9) on both devices."""
    import cupy as cp

    from scanforest.kernels.recognition import Correspondences, group_gc

    class Lib:  # group_gc reads the model keypoints only
        pass

    n_kp = 60
    lib = Lib()
    lib.kp_coords = rng.uniform(-0.1, 0.1, (2 * n_kp, 3))
    skp, rows = [], []
    for inst in range(2):
        T = S.pose_matrix(S.random_rotation(rng), np.array([inst * 1.0, 0, 0]))
        m = np.arange(n_kp)  # model 0's keypoints, both instances
        skp.append(lib.kp_coords[m] @ T[:3, :3].T + T[:3, 3])
        rows.append(m)
    clutter = rng.uniform(-1, 2, (50, 3))
    skp.append(clutter)
    rows.append(rng.integers(0, n_kp, 50))
    skp = np.concatenate(skp)
    ref_row = np.concatenate(rows).astype(np.int64)
    corr = Correspondences(np.arange(len(skp), dtype=np.int64), ref_row, np.zeros(len(skp), np.int32),
                           ref_row.astype(np.int32), rng.random(len(skp)).astype(np.float32))
    h_cpu = group_gc(corr, lib, skp, gc_size=0.005, gc_threshold=5, device="cpu")
    h_gpu = group_gc(corr, lib, cp.asarray(skp), gc_size=0.005, gc_threshold=5, device="gpu")
    assert len(h_cpu) == len(h_gpu) == 2
    np.testing.assert_array_equal(h_cpu.model_id, h_gpu.model_id)
    np.testing.assert_array_equal(h_cpu.n_corr, h_gpu.n_corr)
    for a, b in zip(h_cpu.groups, h_gpu.groups):
        np.testing.assert_array_equal(np.sort(a), np.sort(b))
    np.testing.assert_allclose(h_cpu.poses, h_gpu.poses, atol=1e-9)


def test_gpu_batched_grouping_equals_one_scene_at_a_time(rng):
    """group_gc_many over scenes of many models (one of them without correspondences): the
    hypotheses of each scene grouped alone - sets, RANSAC inliers and poses bit for bit (every
    set draws its scene-alone samples)."""
    import cupy as cp

    from scanforest.kernels.recognition import Correspondences, group_gc
    from scanforest.kernels.recognition.grouping import group_gc_many

    class Lib:
        pass

    lib = Lib()
    lib.kp_coords = rng.uniform(-0.1, 0.1, (400, 3))
    corrs, kps = [], []
    for n, models in ((900, 4), (0, 1), (1500, 5), (300, 2)):
        skp = rng.uniform(-0.3, 0.3, (max(n, 1), 3))
        ref_row = rng.integers(0, 400, n)
        k = n // 3  # a rigid instance among random pairs: kept sets and RANSAC inliers
        T = S.pose_matrix(S.random_rotation(rng), np.array([0.1, 0, 0]))
        skp[:k] = lib.kp_coords[ref_row[:k]] @ T[:3, :3].T + T[:3, 3]
        corrs.append(Correspondences(np.arange(n, dtype=np.int64), ref_row.astype(np.int64),
                                     rng.integers(0, models, n).astype(np.int32), ref_row.astype(np.int32),
                                     rng.random(n).astype(np.float32)))
        kps.append(cp.asarray(skp))
    many = group_gc_many(corrs, lib, kps, gc_size=0.01, gc_threshold=3, seed=7, device="gpu")
    assert len(many) == 4 and len(many[1]) == 0 and sum(len(h) for h in many) > 3
    for c, k, h in zip(corrs, kps, many):
        one = group_gc(c, lib, k, gc_size=0.01, gc_threshold=3, seed=7, device="gpu")
        assert len(one) == len(h)
        np.testing.assert_array_equal(one.model_id, h.model_id)
        np.testing.assert_array_equal(one.n_corr, h.n_corr)
        np.testing.assert_array_equal(one.poses, h.poses)
        for a, b in zip(one.groups, h.groups):
            np.testing.assert_array_equal(a, b)


def test_gpu_recognize_described_many_equals_one_scene_at_a_time():
    """A batch of described and matched synthetic scenes: the detections of each recognised alone."""
    import cupy as cp

    from scanforest.kernels.recognition import (ModelLibrary, describe, match, recognize_described,
                                                recognize_described_many)

    models = S.model_library(3, 4_000, seed=3)
    lp, rp = S.recognition_presets("gpu", 20_000)
    lib = ModelLibrary.build([m.points for m in models], [m.name for m in models],
                             models_normals=[m.normals for m in models], device="gpu", **lp)
    scenes = []
    for seed in range(4):
        sc = S.make_scene(models, n_instances=2, n_points=20_000, noise=0.2, clutter=2, seed=900 + seed)
        pts = cp.asarray(sc.points)
        d = describe(pts, normal_radius=rp["normal_radius"], keypoint_radius=rp["scene_ss"],
                     descr_rad=lp["descr_rad"], device="gpu")
        corr = match(d["descriptors"], lib, k=rp["match_k"], device="gpu")
        scenes.append(dict(scene_points=pts, normals=d["normals"], keypoints=d["keypoints"], correspondences=corr))
    many = recognize_described_many(scenes, lib, device="gpu", **rp)
    assert sum(len(x) for x in many) >= 4
    for s, got in zip(scenes, many):
        s = dict(s)
        want = recognize_described(s.pop("scene_points"), lib, device="gpu", **s, **rp)
        assert [d.model_id for d in got] == [d.model_id for d in want]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.pose, b.pose, atol=1e-9)
            assert (a.score, a.inliers) == (b.score, b.inliers)
        assert got.timings["total"] == pytest.approx(sum(v for k, v in got.timings.items() if k != "total"))
