"""Synthetic models and scenes: seeded, distinct, non-symmetric, ground truth that holds."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial import cKDTree

from scanforest.kernels.errors import InputError
from scanforest.kernels.synthetic import scenes as synthetic


@pytest.fixture(scope="module")
def lib():
    return synthetic.model_library(4, 4_000, seed=11)


def test_library_is_seeded_and_distinct(lib):
    again = synthetic.model_library(4, 4_000, seed=11)
    for a, b in zip(lib, again):
        np.testing.assert_array_equal(a.points, b.points)
    # distinct shapes: sorted principal extents differ between every pair of models
    ext = [np.sort(np.linalg.eigvalsh(np.cov(m.points.T))) for m in lib]
    for i in range(len(lib)):
        for j in range(i + 1, len(lib)):
            assert np.abs(ext[i] - ext[j]).max() > 1e-5
    for m in lib:
        assert m.points.dtype == np.float32 and np.allclose(np.linalg.norm(m.normals, axis=1), 1, atol=1e-5)
        assert 0 < m.resolution < 0.02


def test_models_are_not_symmetric(lib):
    """No principal-axis flip maps a model onto itself (a symmetric model would be ambiguous)."""
    for m in lib:
        P = m.points - m.points.mean(0)
        _, vecs = np.linalg.eigh(np.cov(P.T))
        Q = P @ vecs
        tree = cKDTree(Q)
        for flip in ([-1, -1, 1], [-1, 1, -1], [1, -1, -1]):
            d, _ = tree.query(Q * flip)
            assert np.mean(d) > 3 * m.resolution


def test_scene_ground_truth_poses_hold(lib):
    sc = synthetic.make_scene(lib, n_instances=3, n_points=40_000, noise=0.0, seed=5)
    assert len(sc.points) == 40_000 and len(sc.ground_truth) == 3
    for k, gt in enumerate(sc.ground_truth):
        pose = np.asarray(gt["pose"])
        R = pose[:3, :3]
        np.testing.assert_allclose(R @ R.T, np.eye(3), atol=1e-9)
        assert np.linalg.det(R) > 0
        inst = sc.points[sc.labels == k]
        assert len(inst) > 100  # visible
        model = synthetic.transform(lib[gt["model_id"]].points.astype(np.float64), pose)
        d, _ = cKDTree(model).query(inst)
        assert np.median(d) < 2 * lib[gt["model_id"]].resolution  # the instance lies on the posed model


def test_scene_noise_and_occlusion(lib):
    clean = synthetic.make_scene(lib, n_points=20_000, noise=0.0, seed=2)
    noisy = synthetic.make_scene(lib, n_points=20_000, noise=0.5, seed=2)
    diff = np.linalg.norm(noisy.points - clean.points, axis=1)
    assert np.isclose(np.sqrt(np.mean(diff ** 2) / 3), 0.5 * clean.resolution, rtol=0.1)
    # occlusion: nothing visible lies behind another point along the same ray within a pixel
    assert (clean.labels == -1).sum() < len(clean.points)


def test_scene_size_range(lib):
    assert len(synthetic.make_scene(lib, n_points=1_000, seed=1).points) == 1_000
    with pytest.raises(InputError, match="10\\^3..10\\^8"):
        synthetic.make_scene(lib, n_points=10)


def test_recognition_presets_follow_scene_density():
    lp, rp = synthetic.recognition_presets("gpu", 20_000)
    assert (lp, rp) == (synthetic.SYNTHETIC_LIBRARY_SPARSE, synthetic.SYNTHETIC_RECOGNIZE_SPARSE)
    assert synthetic.recognition_presets("cpu", 20_000) == (lp, rp)
    assert synthetic.recognition_presets("gpu", 300_000) == (synthetic.SYNTHETIC_LIBRARY_LIGHT, synthetic.SYNTHETIC_RECOGNIZE)
    assert synthetic.recognition_presets("gpu") == (synthetic.SYNTHETIC_LIBRARY_LIGHT, synthetic.SYNTHETIC_RECOGNIZE)
    assert synthetic.recognition_presets("cpu") == (synthetic.SYNTHETIC_LIBRARY_LIGHT,
                                                    synthetic.SYNTHETIC_RECOGNIZE_LIGHT)
    # a sparse scene covers less of each model: denser keypoints, a lower inlier fraction
    assert rp["scene_ss"] < synthetic.SYNTHETIC_RECOGNIZE_LIGHT["scene_ss"]
    assert rp["min_inlier_fraction"] < synthetic.SYNTHETIC_RECOGNIZE_LIGHT["min_inlier_fraction"]
