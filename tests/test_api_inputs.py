"""The public API's answers to inputs users give it (a sweep of the API on 2026-12-07 found each of
these silent, wrong or an obscure error): an :class:`InputError` naming the argument, or the right
answer where the input is fine but unusual (float16, a scene a few hundred metres out, a list)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import scanforest as sf
from scanforest.kernels import synthetic
from scanforest.kernels.coordinates import check_spacing
from scanforest.kernels.errors import InputError


@pytest.fixture(scope="module")
def milk(pcl_dir):
    """PCL's milk carton and its tutorial scene (float64), and a library of the carton."""
    model = sf.read(pcl_dir / "milk.pcd").points
    scene = sf.read(pcl_dir / "milk_cartoon_all_small_clorox.pcd").points.astype(np.float64)
    return model, scene, sf.ModelLibrary.build([model], ["milk"])


def test_match_forwards_the_search_options_and_names_a_wrong_index():
    """``sf.match(Q, forest, k, recall=...)`` searched exactly whatever was asked: the options now
    reach the index's query (a budget: fewer leaves than the exact search), unknown ones and
    things that are not an index are said."""
    rng = np.random.default_rng(0)
    X = rng.random((4000, 16), dtype=np.float32)
    Q = X[:200] + np.float32(0.01)
    forest = sf.KDForest(n_trees=2, leaf_size=16).fit(X)
    exact = sf.match(Q, forest, k=4)
    budget = sf.match(Q, forest, k=4, backtracks=2)
    np.testing.assert_array_equal(exact[1], forest.query(Q, 4)[1])
    np.testing.assert_array_equal(budget[1], forest.query(Q, 4, backtracks=2)[1])
    assert not np.array_equal(budget[1], exact[1])  # the option took effect
    with pytest.raises(InputError, match="takes no foo"):
        sf.match(Q, forest, k=4, foo=3)
    for bad in (X, None, "archive.zarr"):
        with pytest.raises(InputError, match="index must be a fitted KDForest"):
            sf.match(Q, bad, k=4)
    with pytest.raises(InputError, match=r"\(store_path, index_name\)"):
        sf.match(Q, ("archive.zarr",), k=4)
    with pytest.raises(InputError, match="takes device=, method=, replicas="):
        sf.match(Q, ("archive.zarr", "models"), k=4, recall=0.9)


def test_recognize_described_checks_its_arrays_against_the_keypoints(milk):
    """Fewer descriptors than keypoints gave no detection, more an IndexError, frames of the wrong
    shape an AxisError; a bad origin a reshape error."""
    from scanforest.kernels.recognition import recognize_described

    model, scene, lib = milk
    pts = scene[np.isfinite(scene).all(1)][::4]
    n, _ = sf.normals(pts, k=10)
    kp = sf.keypoints(pts, radius=0.03)
    D, F = sf.shot(pts, n, kp, 0.02)
    kw = dict(normals=n, keypoints=kp, device="cpu")
    for descriptors, words in ((D[:100], "descriptors has 100 rows"), (np.vstack([D, D[:3]]), "rows, expected"),
                               (D[:, :351], r"shape \(N, 352\)")):
        with pytest.raises(InputError, match=words):
            recognize_described(pts, lib, descriptors=descriptors, **kw)
    with pytest.raises(InputError, match=r"rf must be the keypoints' frames"):
        recognize_described(pts, lib, descriptors=D, rf=np.zeros((len(kp), 3)), method="hough", **kw)
    with pytest.raises(InputError, match="keypoints must be a 1-D array of point indices"):
        recognize_described(pts, lib, descriptors=D, normals=n, keypoints=kp.astype(np.float64), device="cpu")
    with pytest.raises(InputError, match="origin must be 3 finite numbers"):
        sf.recognize(pts, lib, origin=(0, 0), device="cpu")


def test_a_scene_a_few_hundred_metres_out_and_a_float16_scene(milk):
    """PCL's scene 500 m out in float64 (float32 spacing there too coarse for its 3 mm radii, below
    the 1024 m where an origin is chosen): it was refused with 'split it into tiles'; it is now
    computed about its box (said, as for georeferenced scenes), and with its origin given the milk is
    found where it is. A float16 scene is read as float32 (it was a numba error)."""
    model, scene, lib = milk
    base = sf.recognize(scene, lib, device="cpu")
    assert len(base) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sf.recognize(scene + 500.0, lib, device="cpu")
    assert any("far from 0" in str(w.message) for w in caught)
    moved = sf.recognize(scene + 500.0, lib, origin=(500.0, 500.0, 500.0), device="cpu")
    assert len(moved) == 1
    np.testing.assert_allclose(moved[0].pose[:3, 3], base[0].pose[:3, 3] + 500.0, atol=1e-4)
    half = sf.recognize(scene.astype(np.float16), lib, device="cpu")
    assert isinstance(half, list)


def test_the_spacing_check_says_which_remedy_applies():
    """Coordinates too coarse for the radii: 'far from the origin' when the points' own box would
    be fine about its centre, 'split it into tiles' when the box itself is too large."""
    with pytest.raises(InputError, match="far from the origin they are computed about"):
        check_spacing(600.0, {"r": 0.003}, "scene", span=1.0)
    with pytest.raises(InputError, match="split it into tiles"):
        check_spacing(600.0, {"r": 0.003}, "scene", span=500.0)
    with pytest.raises(InputError, match="split it into tiles"):
        check_spacing(600.0, {"r": 0.003}, "scene")
    check_spacing(10.0, {"r": 0.003}, "scene", span=lambda: pytest.fail("asked only on failure"))


def test_library_models_and_their_normals_must_agree():
    models = synthetic.model_library(2, 2000, seed=0)
    pts = [m.points for m in models]
    with pytest.raises(InputError, match="its normals have shape"):
        sf.ModelLibrary.build(pts, models_normals=[models[0].normals, models[1].normals[:10]])
    with pytest.raises(InputError, match="model names must differ"):
        sf.ModelLibrary.build(pts, ["a", "a"])
    with pytest.raises(InputError, match="no keypoint of any model has a descriptor"):
        sf.ModelLibrary.build(pts, descr_rad=1e-6)  # it built a library that matched nothing


def test_align_refuses_solver_settings_that_cannot_work():
    """A negative damping ran and reported 'converged' at twice the error; a singular init was a
    LinAlgError; ``params`` as a dict was a TypeError (it is taken as keywords now)."""
    m = synthetic.model_library(1, 2000, seed=0)[0]
    R = m.points
    O = R + np.float32(0.003)
    assert sf.align(O, R, params={"max_iter": 5}).iterations <= 5
    for kw, words in ((dict(lambda0=-1), "lambda0 must be a positive"), (dict(lambda0=float("nan")), "lambda0"),
                      (dict(xtol=-1), "xtol must be a non-negative"), (dict(ftol=float("nan")), "ftol"),
                      (dict(max_iter=2.5), "max_iter must be an integer"), (dict(max_iter=True), "max_iter"),
                      (dict(resolution=1), "resolution must be >= 2"),
                      (dict(init=np.zeros((4, 4))), "singular")):
        with pytest.raises(InputError, match=words):
            sf.align(O, R, **kw)


def test_small_inputs_said_not_crashed(rng):
    X = rng.random((5, 8), dtype=np.float32)
    with pytest.raises(InputError, match="ids must be distinct"):
        sf.knn_bruteforce(X, X[:2], 3, ids=[1, 1, 2, 3, 4])
    with pytest.raises(InputError, match="path must be a file path"):
        sf.read(None)
    with pytest.raises(InputError, match="models is empty"):
        synthetic.make_scene([], n_instances=1, n_points=5000)
    with pytest.raises(InputError, match="n_instances must be an integer >= 0"):
        synthetic.make_scene(synthetic.model_library(1, 2000, seed=0), n_instances=-1, n_points=5000)
    with pytest.raises(InputError, match="padding must be a finite number"):
        sf.distance_transform(X[:, :3], padding=float("nan"))
    P = rng.random((3000, 3)).astype(np.float32)
    n, _ = sf.normals(P, k=10)
    d, _ = sf.shot(P, n, np.arange(10), 1e-9)  # no neighbour within 1 nm: NaN rows (PCL's), not a crash
    assert d.shape == (10, 352) and np.isnan(d).all()
    # a scan whose points are all at one place (a sensor's zero rows): said so, not "points is empty"
    # after the points without a normal were left out (the archive's failed-scan line said that)
    lib = sf.ModelLibrary.build([P], ["m"], model_ss=0.05, descr_rad=0.1)
    with pytest.raises(InputError, match="none of the 500 points has a normal .normal_k=10: their neighbours"):
        sf.recognize(np.zeros((500, 3), np.float32), lib, scene_ss=0.05, device="cpu")


def test_a_point_cloud_holds_one_row_a_point():
    """PointCloud took (N, 2) points and normals of another length, and the store kept them."""
    from scanforest.tasks.readers import PointCloud

    P = np.zeros((10, 3), np.float32)
    with pytest.raises(InputError, match=r"points must be an \(N, 3\) array"):
        PointCloud(P[:, :2])
    with pytest.raises(InputError, match="normals has 5 rows for 10 points"):
        PointCloud(P, normals=P[:5])
    assert len(PointCloud(P, intensity=np.ones(10, np.float32))) == 10


def test_batches_and_indexes_name_what_is_wrong(milk):
    """recognize_many of one array took each point for a scene ('got shape (3,)'); a bad scene of a
    batch is named by its place; ShardedIndex and KDForest say a bad parameter when they are made
    or fitted, not at the first query."""
    model, scene, lib = milk
    with pytest.raises(InputError, match=r"normal_k=10 is larger than the number of points \(5\)"):
        sf.recognize(scene[:5], lib, device="cpu")  # it said k=10, a name the user never gave
    with pytest.raises(InputError, match="scenes is one array"):
        sf.recognize_many(scene, lib, device="cpu")
    with pytest.raises(InputError, match=r"^scenes\[1\]: "):
        sf.recognize_many([scene, np.zeros((0, 3))], lib, device="cpu")
    with pytest.raises(InputError, match="unknown parameter 'foo'"):
        sf.ShardedIndex(shards=2, foo=1)
    with pytest.raises(InputError, match="shards must be an integer"):
        sf.ShardedIndex(shards=2.5)
    with pytest.raises(InputError, match="leaves_per_round"):
        sf.KDForest(leaves_per_round=0).fit(np.random.default_rng(0).random((100, 8), dtype=np.float32))


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_shot_reads_unit_normals_and_refuses_others(milk, device):
    """Normals of another length changed SHOT's histograms silently (3x-long normals: descriptors
    0.47 apart): they are refused, naming the row; NaN rows (no normal) still pass; a scene's
    normals given to recognize are read the same way (a library's given normals only orient the
    ones it estimates)."""
    model = np.ascontiguousarray(milk[0], np.float32)
    xp = np
    if device == "gpu":
        import cupy as xp

    P = xp.asarray(model)
    n, _ = sf.normals(P, k=10, device=device)
    kp = xp.arange(0, len(model), 200)
    want, _ = sf.shot(P, n, kp, 0.02, device=device)
    n_nan = n.copy()
    n_nan[5] = np.nan
    sf.shot(P, n_nan, kp, 0.02, device=device)  # a point without a normal: skipped, not refused
    long = n.copy()
    long[7] *= 3.0
    with pytest.raises(InputError, match="normals must be unit vectors: row 7 has length 3"):
        sf.shot(P, long, kp, 0.02, device=device)
    with pytest.raises(InputError, match="unit vectors: row 0 has length 0"):
        sf.shot(P, xp.zeros_like(n), kp, 0.02, device=device)
    with pytest.raises(InputError, match="unit vectors"):
        sf.recognize(P, milk[2], scene_normals=n * 2, device=device)
    got, _ = sf.shot(P, n / xp.linalg.norm(n, axis=1, keepdims=True), kp, 0.02, device=device)
    host = (lambda a: a.get()) if device == "gpu" else np.asarray  # noqa: E731
    np.testing.assert_allclose(host(got), host(want), atol=1e-5)
