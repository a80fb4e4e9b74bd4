"""Parametric chamfer alignment: transform models, f/g/H against a float64 reference,
LM convergence on known transforms, monotone objective, errors, CPU vs GPU."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.align import transforms as T
from scanforest.kernels.align.edt import distance_transform
from scanforest.kernels.align.pcha import (align, align_batch, cpu_evaluate, point_error,
                                           reference_evaluate, synthetic_problem)
from scanforest.kernels.errors import InputError

ALL = [(d, n) for d, names in T.MODEL_NAMES.items() for n in names]


def _random_params(m, rng, scale=0.2):
    return T.from_matrix(m, T.to_matrix(m, T.identity(m))) + scale * rng.uniform(-1, 1, m.n_params) \
        * (np.array([0.01 if m.compositional and k >= 6 else 1 for k in range(m.n_params)]))


# ----------------------------------------------------------------------------- transforms
@pytest.mark.parametrize("dim, name", ALL)
def test_matrix_round_trip_and_identity(rng, dim, name):
    m = T.get_model(name, dim)
    np.testing.assert_allclose(T.to_matrix(m, T.identity(m)), np.eye(dim + 1), atol=1e-15)
    p = _random_params(m, rng)
    np.testing.assert_allclose(T.from_matrix(m, T.to_matrix(m, p)), p, atol=1e-12)
    # batched
    P = np.stack([p, _random_params(m, rng)])
    np.testing.assert_allclose(T.to_matrix(m, P)[1], T.to_matrix(m, P[1]))


@pytest.mark.parametrize("dim, name", ALL)
def test_jacobians_match_finite_differences(rng, dim, name):
    m = T.get_model(name, dim)
    p = _random_params(m, rng)
    X = rng.normal(size=(7, dim))
    J = T.jacobian(m, p, X)
    Ji = T.increment_jacobian(m, p, X)
    h = 1e-6
    for k in range(m.n_params):
        e = np.zeros(m.n_params)
        e[k] = h
        num = (T.apply(T.to_matrix(m, p + e), X) - T.apply(T.to_matrix(m, p - e), X)) / (2 * h)
        np.testing.assert_allclose(J[:, :, k], num, atol=1e-6)
        # increment Jacobian: derivative of the update rule at delta = 0
        num_i = (T.apply(T.to_matrix(m, T.update(m, p, e)), X)
                 - T.apply(T.to_matrix(m, T.update(m, p, -e)), X)) / (2 * h)
        np.testing.assert_allclose(Ji[:, :, k], num_i, atol=1e-6)


def test_projective_update_composes_increment_after_current(rng):
    m = T.get_model("projective", 2)
    p = _random_params(m, rng)
    dl = 0.05 * rng.normal(size=8)
    M_new = T.to_matrix(m, T.update(m, p, dl))
    expect = T.to_matrix(m, T.identity(m) + dl) @ T.to_matrix(m, p)
    np.testing.assert_allclose(M_new, expect / expect[2, 2], atol=1e-12)


@pytest.mark.parametrize("dim", [2, 3])
def test_chain_and_promote_are_exact(rng, dim):
    ms = T.chain("affine", dim)
    assert [x.name for x in ms] == (["euclidean", "similarity", "affine"] if dim == 2
                                    else ["rigid", "similarity", "affine"])
    p = _random_params(ms[0], rng)
    for a, b in zip(ms[:-1], ms[1:]):
        q = T.promote(p, a, b)
        np.testing.assert_allclose(T.to_matrix(b, q), T.to_matrix(a, p), atol=1e-12)
        p = q


def test_unknown_model_and_bad_params():
    with pytest.raises(InputError, match="unknown model"):
        T.get_model("banana", 3)
    with pytest.raises(InputError, match="unknown model"):
        T.get_model("projective", 3)
    m = T.get_model("rigid", 3)
    assert T.get_model("euclidean", 3) is m
    with pytest.raises(InputError, match="6 parameters"):
        T.to_matrix(m, np.zeros(5))


# ----------------------------------------------------------------------------- f, g, H
@pytest.fixture(scope="module")
def grids():
    out = {}
    for dim in (2, 3):
        obs, ref, _ = synthetic_problem("rigid", dim, 3000, n_reference=4000, seed=3)
        out[dim] = (distance_transform(ref, resolution=120 if dim == 2 else 48, device="cpu"), obs)
    return out


@pytest.mark.parametrize("dim, name", ALL)
@pytest.mark.parametrize("loss, outside, lookup", [("l2", "clamp", "corners"),
                                                   ("huber", "drop", "corners"),
                                                   ("l2", "drop", "cell"), ("huber", "clamp", "cell")])
def test_cpu_fgh_matches_float64_reference(grids, rng, dim, name, loss, outside, lookup):
    g, obs = grids[dim]
    m = T.get_model(name, dim)
    X = g.normalize(obs) * 2.0  # push some points outside the grid
    p = _random_params(m, rng, 0.05)
    kw = dict(outside=outside, loss=loss, huber_delta=0.05, lookup=lookup)
    a = reference_evaluate(m, g, X, p, **kw)
    b = cpu_evaluate(m, g, X, p, **kw)
    assert a[3] < len(X)  # some points really are outside
    np.testing.assert_allclose(b[0], a[0], rtol=1e-9)
    np.testing.assert_allclose(b[1], a[1], rtol=1e-7, atol=1e-9 * np.abs(a[1]).max())
    np.testing.assert_allclose(b[2], a[2], rtol=1e-7, atol=1e-9 * np.abs(a[2]).max())
    assert b[3] == a[3]


# ----------------------------------------------------------------------------- LM
# final error bound (RMS point displacement relative to the shape's size), per dimension:
# limited by the nearest-cell lookup of the distance transform (grid cell ~1-2 % of the size)
_TOL = {2: 5e-3, 3: 3e-2}


@pytest.fixture(scope="module")
def problems():
    cache = {}

    def get(dim, nq=6000):
        if (dim, nq) not in cache:
            _, ref, _ = synthetic_problem("rigid", dim, 100, n_reference=nq, seed=0)
            cache[(dim, nq)] = distance_transform(ref, resolution=200 if dim == 2 else 96,
                                                  device="cpu")
        return cache[(dim, nq)]
    return get


@pytest.mark.parametrize("dim, name", ALL)
@pytest.mark.parametrize("level", [0.2, 0.6])
def test_align_recovers_known_transform(problems, dim, name, level):
    g = problems(dim)
    obs, _, M = synthetic_problem(name, dim, 3000, level=level, seed=11)
    r = align(obs, None, name, grid=g, device="cpu", chain=name in ("projective", "affine"))
    assert r.status == "converged", r.status
    assert point_error(r.transform, M, obs) < _TOL[dim]
    # LM accepts only decreases: the objective history never goes up (between chained stages
    # the same transform is re-evaluated in the richer model: equal up to rounding)
    assert np.all(np.diff(r.history) <= 1e-12 * r.history[0])
    assert r.history[-1] < 0.5 * r.history[0]
    assert r.n_dropped == 0 and r.n_points == 3000


@pytest.mark.parametrize("scaling, lookup", [("paper", "corners"), ("consistent", "corners"),
                                             ("paper", "cell")])
def test_lm_variants_converge_monotonically(problems, scaling, lookup):
    g = problems(2)
    obs, _, M = synthetic_problem("similarity", 2, 2000, level=0.5, seed=5)
    r = align(obs, None, "similarity", grid=g, device="cpu", scaling=scaling, lookup=lookup)
    assert np.all(np.diff(r.history) <= 0)
    assert point_error(r.transform, M, obs) < _TOL[2]
    assert r.iterations == len(r.history) - 1


def test_huber_is_robust_to_outliers(problems, rng):
    g = problems(2)
    obs, _, M = synthetic_problem("euclidean", 2, 2000, level=0.5, seed=6)
    noisy = np.concatenate([obs, rng.uniform(-3, 3, size=(600, 2))])
    r_h = align(noisy, None, "euclidean", grid=g, device="cpu", loss="huber")
    assert np.all(np.diff(r_h.history) <= 0)
    r_l = align(noisy, None, "euclidean", grid=g, device="cpu")
    assert point_error(r_h.transform, M, obs) < point_error(r_l.transform, M, obs)
    assert point_error(r_h.transform, M, obs) < _TOL[2]
    assert r_h.huber_delta > 0


def test_outside_drop_reports_dropped_points(problems):
    g = problems(2)
    obs, _, _ = synthetic_problem("euclidean", 2, 1000, level=0.2, seed=7)
    far = np.concatenate([obs, obs[:100] + 50.0])
    r = align(far, None, "euclidean", grid=g, device="cpu", outside="drop")
    assert r.n_dropped >= 100 and r.n_inliers == 1100 - r.n_dropped
    r2 = align(far, None, "euclidean", grid=g, device="cpu", outside="clamp")
    assert r2.n_dropped == 0
    # clamped outside points add their distance to the objective
    assert r2.objective > r.objective


def test_align_batch_equals_single_and_init(problems):
    g = problems(3)
    obs = []
    for s in range(3):
        o, _, _ = synthetic_problem("rigid", 3, 800 + 100 * s, level=0.3, seed=20 + s)
        obs.append(o)
    init = [np.eye(4), None, T.identity(T.get_model("rigid", 3))]
    batch = align_batch(obs, None, "rigid", grid=g, device="cpu", init=init)
    for o, rb in zip(obs, batch):
        rs = align(o, None, "rigid", grid=g, device="cpu")
        np.testing.assert_allclose(rb.transform, rs.transform, atol=1e-12)
        assert rb.iterations == rs.iterations


def test_align_builds_grid_from_reference_and_init_near_truth():
    obs, ref, M = synthetic_problem("rigid", 3, 1500, n_reference=3000, level=0.5, seed=9)
    r = align(obs, ref, "rigid", device="cpu", init=M)
    assert point_error(r.transform, M, obs) < _TOL[3]


def test_params_object_and_keywords_are_one_thing(problems):
    """PChAParams holds align's tuning parameters with the keyword defaults align had (issue 40);
    a params object and the same values as keywords give the same alignment bit for bit, and a
    keyword overrides the object's field."""
    import dataclasses

    from scanforest.kernels.align.pcha import PChAParams

    assert PChAParams() == PChAParams(chain=False, max_iter=100, xtol=1e-6, ftol=1e-5, lambda0=1e-3, loss="l2",
                                      huber_delta=None, outside="clamp", scaling="paper", resolution=None,
                                      form="fused", hessian="reduced", lookup="corners")
    with pytest.raises(dataclasses.FrozenInstanceError):
        PChAParams().max_iter = 3
    g = problems(2)
    obs, _, _ = synthetic_problem("similarity", 2, 1500, level=0.5, seed=11)
    kw = dict(loss="huber", scaling="consistent", max_iter=3, lookup="cell")
    r_kw = align(obs, None, "similarity", grid=g, device="cpu", **kw)
    assert r_kw.iterations == 3 and r_kw.status == "max_iter"  # the cap bites: overriding it shows
    r_obj = align(obs, None, "similarity", grid=g, device="cpu", params=PChAParams(**kw))
    r_mix = align(obs, None, "similarity", grid=g, device="cpu", params=PChAParams(**dict(kw, max_iter=50)),
                  max_iter=3)
    r_bat = align_batch([obs], None, "similarity", grid=g, device="cpu", params=PChAParams(**kw))[0]
    for r in (r_obj, r_mix, r_bat):
        assert r.transform.tobytes() == r_kw.transform.tobytes()
        np.testing.assert_array_equal(r.history, r_kw.history)
        assert (r.iterations, r.status, r.huber_delta) == (r_kw.iterations, r_kw.status, r_kw.huber_delta)
    with pytest.raises(TypeError, match="max_iters"):
        align(obs, None, "similarity", grid=g, device="cpu", max_iters=3)
    with pytest.raises(InputError, match="max_iter"):
        align(obs, None, "similarity", grid=g, device="cpu", params=PChAParams(max_iter=0))
    assert r.history[-1] <= r.history[0]


@pytest.mark.parametrize("kwargs, msg", [
    (dict(observed=np.zeros((0, 3))), "empty"),
    (dict(observed=np.full((5, 3), np.nan)), "NaN"),
    (dict(observed=np.zeros((5, 4))), "shape"),
    (dict(observed=np.zeros((5, 2))), "2-D but reference points are 3-D"),
    (dict(model="banana"), "unknown model"),
    (dict(model="projective"), "unknown model"),
    (dict(loss="l1"), "loss"),
    (dict(outside="wrap"), "outside"),
    (dict(init=np.eye(3)), "init must be"),
    (dict(max_iter=0), "max_iter"),
    (dict(huber_delta=-1.0, loss="huber"), "huber_delta"),
    (dict(device="tpu"), "device"),
    (dict(lookup="bilinear"), "lookup"),
])
def test_bad_input_is_a_clear_error(rng, kwargs, msg):
    args = dict(observed=rng.normal(size=(50, 3)), reference=rng.normal(size=(60, 3)), model="rigid")
    args.update(kwargs)
    obs, ref, model = args.pop("observed"), args.pop("reference"), args.pop("model")
    with pytest.raises(InputError, match=msg):
        align(obs, ref, model, **args)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dim, name", ALL)
@pytest.mark.parametrize("loss, outside, lookup", [("l2", "clamp", "corners"),
                                                   ("huber", "drop", "corners"),
                                                   ("l2", "drop", "cell")])
def test_gpu_fgh_forms_match_cpu(grids, rng, dim, name, loss, outside, lookup):
    from scanforest.kernels.align._pcha_gpu import GpuEvaluator

    g, obs = grids[dim]
    m = T.get_model(name, dim)
    X = g.normalize(obs) * 2.0
    P = np.stack([_random_params(m, rng, 0.05), _random_params(m, rng, 0.05)])
    kw = dict(outside=outside, loss=loss, lookup=lookup)
    ref = [reference_evaluate(m, g, X, p, huber_delta=0.05, **kw) for p in P]
    gg = g.to("gpu")
    for form, hess in [("fused", "reduced"), ("fused", "full"), ("two_kernel", "full")]:
        ev = GpuEvaluator(m, gg, [X, X], form=form, hessian=hess, **kw)
        f, gr, H, nin = ev(P, np.ones(2, bool), np.full(2, 0.05))
        for b in range(2):
            a = ref[b]
            np.testing.assert_allclose(f[b], a[0], rtol=2e-4, err_msg=form + hess)
            np.testing.assert_allclose(gr[b], a[1], rtol=2e-3, atol=2e-4 * np.abs(a[1]).max() + 1e-3,
                                       err_msg=form + hess)
            np.testing.assert_allclose(H[b], a[2], rtol=2e-4, atol=1e-4 * np.abs(a[2]).max(),
                                       err_msg=form + hess)
            assert abs(nin[b] - a[3]) <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("dim, name", ALL)
def test_gpu_align_matches_cpu(problems, dim, name):
    g = problems(dim)
    obs, _, M = synthetic_problem(name, dim, 3000, level=0.3, seed=13)
    chain = name in ("projective", "affine")
    rc = align(obs, None, name, grid=g, device="cpu", chain=chain)
    rg = align(obs, None, name, grid=g.to("gpu"), device="gpu", chain=chain)
    assert rg.device == "gpu"
    assert np.all(np.diff(rg.history) <= 0)
    assert point_error(rg.transform, M, obs) < _TOL[dim]
    # same final transform up to float32 rounding of the GPU objective
    assert point_error(rg.transform, rc.transform, obs) < 0.25 * _TOL[dim]


@pytest.mark.gpu
def test_gpu_batch_matches_single_and_two_kernel(problems):
    import cupy as cp

    g = problems(3).to("gpu")
    obs = [synthetic_problem("rigid", 3, 1000 + 50 * s, level=0.4, seed=30 + s)[0] for s in range(5)]
    batch = align_batch(obs, None, "rigid", grid=g, device="gpu")
    for o, rb in zip(obs, batch):
        rs = align(cp.asarray(o), None, "rigid", grid=g)
        rt = align(o, None, "rigid", grid=g, device="gpu", form="two_kernel")
        np.testing.assert_allclose(rb.transform, rs.transform, atol=1e-9)
        assert point_error(rt.transform, rs.transform, o) < 1e-2


@pytest.mark.parametrize("dim, name", ALL)
def test_fast_host_terms_match_vectorised(rng, dim, name):
    m = T.get_model(name, dim)
    for B in (1, 3, 7):
        P = np.stack([_random_params(m, rng) for _ in range(B)])
        M, D = T.matrix_and_derivatives(m, P)
        np.testing.assert_allclose(M, T.to_matrix(m, P), atol=1e-14)
        if not m.compositional:
            np.testing.assert_allclose(D, T.derivatives(m, P), atol=1e-14)
            # reduced statistics contracted with D == explicit J^T J / J^T r
            X = rng.normal(size=(20, dim))
            q = np.concatenate([X, np.ones((20, 1))], 1)
            r = rng.normal(size=(20, dim))
            J = T.jacobian(m, P[0], X)
            H = T.contract_hessian(D[:1], (q.T @ q)[None])[0]
            g = T.contract_gradient(D[:1], (r.T @ q)[None])[0]
            np.testing.assert_allclose(H, np.einsum("nck,ncl->kl", J, J), atol=1e-10)
            np.testing.assert_allclose(g, -2 * np.einsum("nck,nc->k", J, r), atol=1e-10)


def test_conjugation_round_trip_keeps_model_class(rng):
    m = T.get_model("rigid", 3)
    M = T.to_matrix(m, _random_params(m, rng))
    c, s = rng.normal(size=3), 2.5
    Mn = T.conjugate(M, c, s)
    np.testing.assert_allclose(T.unconjugate(Mn, c, s), M, atol=1e-12)
    np.testing.assert_allclose(T.to_matrix(m, T.from_matrix(m, Mn)), Mn, atol=1e-12)
    X = rng.normal(size=(5, 3))
    np.testing.assert_allclose(T.apply(Mn, (X - c) / s), (T.apply(M, X) - c) / s, atol=1e-12)
