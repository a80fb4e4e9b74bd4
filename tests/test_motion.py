"""Dense motion from sparse tracks (Kim, Hwangbo & Kanade): formulas against a literal float64
reference, accuracy on synthetic sequences with known flow, CPU = GPU, store task, flow, CLI."""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from scanforest.kernels.errors import InputError
from scanforest.kernels.hypotheses import masked_argmax
from scanforest.kernels.motion.metrics import (angular_error, endpoint_error, flow_errors,
                                               flow_to_rgb, png_bytes)
from scanforest.kernels.motion.optical_flow import (MissingDependency, dense_flow, flow_labels, hypothesis_flow,
                                                    interpolate_flow)
from scanforest.kernels.synthetic.sequences import sequence, tracks_from_flow

H, W = 96, 128          # accuracy tests: small enough for a 2-core CI machine


# ---------------------------------------------------------------------------------------------
# literal float64 reference of the paper's formulas (independent of the implementation)
# ---------------------------------------------------------------------------------------------
def _n1(z):
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _bilinear64(img, X, Y):
    h, w = img.shape[:2]
    x0 = np.floor(X).astype(int)
    y0 = np.floor(Y).astype(int)
    fx, fy = (X - x0)[..., None], (Y - y0)[..., None]
    x1, y1 = np.minimum(x0 + 1, w - 1), np.minimum(y0 + 1, h - 1)
    top = img[y0, x0] * (1 - fx) + img[y0, x1] * fx
    bot = img[y1, x0] * (1 - fx) + img[y1, x1] * fx
    return top * (1 - fy) + bot * fy


def _likelihood5(I0, tracks, sc, sx):
    """L(p, f_i) for every pixel and feature (eq. 3, product of five N1), (H, W, M)."""
    I0 = I0.astype(np.float64)
    h, w = I0.shape[:2]
    x0, y0 = tracks[:, 0].astype(np.float64), tracks[:, 1].astype(np.float64)
    ci = _bilinear64(I0, x0, y0)                                  # (M, 3)
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    L = _n1((xs[..., None] - x0) / sx) * _n1((ys[..., None] - y0) / sx)
    for c in range(3):
        L = L * _n1((I0[..., c][..., None] - ci[:, c]) / sc)
    return L


def ref_interpolation(I0, I1, tracks, sc, sx, tau):
    L = _likelihood5(I0, tracks, sc, sx)
    u_i = tracks[:, 2].astype(np.float64) - tracks[:, 0]
    v_i = tracks[:, 3].astype(np.float64) - tracks[:, 1]
    u = (L * u_i).sum(-1) / L.sum(-1)                             # eq. 4
    v = (L * v_i).sum(-1) / L.sum(-1)
    h, w = I0.shape[:2]
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    X, Y = xs + u, ys + v
    inside = (X >= 0) & (X <= w - 1) & (Y >= 0) & (Y <= h - 1)
    c1 = _bilinear64(I1.astype(np.float64), np.clip(X, 0, w - 1), np.clip(Y, 0, h - 1))
    diff = np.abs(c1 - I0.astype(np.float64)).max(-1)
    return np.stack([u, v], -1), inside & (diff <= tau), np.where(inside, diff, np.inf)


def ref_hypotheses(I0, I1, tracks, sc, sx, sf, tau):
    """Algorithm 3 with the 7-D likelihood, plus Algorithm 2 (sort, test in order) with n = all."""
    L = _likelihood5(I0, tracks, sc, sx)
    u_i = tracks[:, 2].astype(np.float64) - tracks[:, 0]
    v_i = tracks[:, 3].astype(np.float64) - tracks[:, 1]
    ru, rv = np.floor(u_i + 0.5), np.floor(v_i + 0.5)
    labs = [(u, v) for v in range(int(rv.min()), int(rv.max()) + 1)
            for u in range(int(ru.min()), int(ru.max()) + 1)]
    h, w = I0.shape[:2]
    ys, xs = np.mgrid[0:h, 0:w]
    scores = np.stack([(L * _n1((hu - u_i) / sf) * _n1((hv - v_i) / sf)).sum(-1)
                       for hu, hv in labs], -1)                   # (H, W, labels)
    ok = np.zeros(scores.shape, bool)
    for l, (hu, hv) in enumerate(labs):
        xx, yy = xs + hu, ys + hv
        inside = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
        c1 = I1[np.clip(yy, 0, h - 1), np.clip(xx, 0, w - 1)].astype(np.float64)
        ok[..., l] = inside & (np.abs(c1 - I0).max(-1) <= tau)
    alg3 = np.where(ok.any(-1), np.argmax(np.where(ok, scores, -np.inf), -1), -1)
    alg2 = np.full((h, w), -1)
    for y in range(h):                                            # sort, test from the best
        for x in range(w):
            for l in np.argsort(-scores[y, x], kind="stable"):
                if ok[y, x, l]:
                    alg2[y, x] = l
                    break
    return np.array(labs), scores, ok, alg3, alg2


def _tiny(seed=0):
    seq = sequence("layers", height=12, width=16, seed=seed, background=(-0.6, 0.4),
                   foreground=(1.3, -0.7), radius=0.4)
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 15, 9)
    y = rng.uniform(0, 11, 9)
    u, v = seq.flow_at(0, x, y)
    tr = np.stack([x, y, x + u + rng.normal(0, 0.2, 9), y + v + rng.normal(0, 0.2, 9)], 1)
    return seq.frames[0], seq.frames[1], tr.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# formulas
# ---------------------------------------------------------------------------------------------
def test_interpolation_matches_literal_float64_formula():
    I0, I1, tr = _tiny()
    sc, sx, tau = 30.0, 120.0, 20.0      # colour spread small enough for float64 underflow-free N1
    r = interpolate_flow(I0, I1, tr, sigma_c=sc, sigma_x=sx, tau=tau, device="cpu")
    flow, valid, diff = ref_interpolation(I0, I1, tr, sc, sx, tau)
    assert r.flow.shape == (12, 16, 2) and r.flow.dtype == np.float32 and r.valid.dtype == bool
    np.testing.assert_allclose(r.flow, flow, atol=2e-4)
    clear = np.abs(diff - tau) > 0.05   # float32 vs float64 may flip a test right at the threshold
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(r.valid[clear], valid[clear])
    assert 0.1 < valid.mean() < 1.0      # the test really rejects some pixels


def test_hypotheses_match_literal_float64_algorithm3_and_algorithm2():
    I0, I1, tr = _tiny(1)
    sc, sx, sf, tau = 30.0, 120.0, 1.0, 20.0
    r = hypothesis_flow(I0, I1, tr, sigma_c=sc, sigma_x=sx, sigma_f=sf, tau=tau, device="cpu")
    labs, scores, ok, alg3, alg2 = ref_hypotheses(I0, I1, tr, sc, sx, sf, tau)
    np.testing.assert_array_equal(r.labels[0], labs)
    np.testing.assert_array_equal(alg3, alg2)          # Alg. 3 == Alg. 2 when all labels are tested
    # compare where the winner is not a near tie
    s = np.where(ok, scores, -np.inf)
    top2 = np.sort(s, -1)[..., -2:]
    with np.errstate(invalid="ignore"):             # -inf - -inf where fewer than 2 pass
        clear = (top2[..., 1] - top2[..., 0]) > 1e-4 * np.abs(top2[..., 1])
    has = alg3 >= 0
    m = clear & has
    assert m.mean() > 0.5
    np.testing.assert_array_equal(r.label[m], alg3[m])
    np.testing.assert_array_equal(r.valid, has)
    np.testing.assert_array_equal(r.flow, labs[r.label].astype(np.float32))
    # everywhere (near ties included): the chosen label passes iff one passes, and its score is
    # the best among the passing ones (or among all when none passes) up to float32 rounding
    lab = r.label[..., None]
    np.testing.assert_array_equal(np.take_along_axis(ok, lab, -1)[..., 0], has)
    got = np.take_along_axis(scores, lab, -1)[..., 0]
    best = np.where(has, np.take_along_axis(scores, np.maximum(alg3, 0)[..., None], -1)[..., 0],
                    scores.max(-1))
    assert np.all(got >= best * (1 - 1e-4))


def test_far_colour_gets_nearest_feature_flow_not_nan():
    # two features, a pixel colour 200 levels from both: exp underflows, eq. 4's limit is the
    # flow of the 5-D nearest feature
    I0 = np.zeros((8, 8, 3), np.uint8)
    I0[:, :4] = (10, 10, 10)
    I0[:, 4:] = (60, 60, 60)
    I0[3, 3] = (250, 250, 250)
    tr = np.array([[1, 1, 2, 1], [6, 6, 6, 4]], np.float32)
    r = interpolate_flow(I0, I0, tr, sigma_c=2.0, sigma_x=2.0, tau=None, device="cpu")
    assert np.isfinite(r.flow).all()
    # pixel (3, 3): colour 240 / 190 levels away; feature 1 (60 grey) is nearer in colour
    np.testing.assert_allclose(r.flow[3, 3], [0.0, -2.0], atol=1e-5)
    assert r.valid.all()                 # tau=None: no change test


def test_dfs_is_the_papers_integer_grid():
    tr = np.array([[10, 10, 6, 9], [10, 10, 14, 12], [20, 20, 21.4, 19.6]], np.float32)
    lab = flow_labels(tr)              # u in [-4, 4], v in [-1, 2] -> 9 x 4 labels
    assert lab.shape == (36, 2)
    assert lab[:, 0].min() == -4 and lab[:, 0].max() == 4
    assert lab[:, 1].min() == -1 and lab[:, 1].max() == 2
    np.testing.assert_array_equal(lab[:3], [[-4, -1], [-3, -1], [-2, -1]])   # u fastest
    paper = np.array([[50, 50, 46, 48], [50, 50, 54, 52]], np.float32)      # paper's example
    assert len(flow_labels(paper)) == 45


def test_masked_argmax_rule():
    s = np.array([[0.5, 0.9, 0.9, 0.1], [0.3, 0.2, np.nan, 0.8], [1.0, 2.0, 3.0, 4.0]])
    ok = np.array([[1, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], bool)
    idx, best = masked_argmax(s, ok, axis=1)
    np.testing.assert_array_equal(idx, [1, 1, -1])     # tie -> lower index; NaN never wins
    assert best[0] == 0.9 and best[1] == 0.2 and best[2] == -np.inf
    assert masked_argmax(np.array([0.1, 0.4]), np.array([True, False])) == (0, 0.1)


# ---------------------------------------------------------------------------------------------
# accuracy on synthetic sequences with known dense flow
# ---------------------------------------------------------------------------------------------
# EPE (px) and AE (degrees) over the classified pixels and coverage, at 128x96 with 156 exact
# tracks and the default parameters. Measured: translation 0.000/0.00/0.95 and 0.500/5.8/0.78,
# rotation (2 deg) 0.815/24.9/0.57 and 0.862/26.3/0.99, zoom (3 %) 0.717/24.1/0.63 and
# 0.780/26.6/0.99, two layers + pole 0.000/0.00/0.90 and 0.454/15.1/0.97 (interpolation and
# hypotheses); limits ~20 % beyond. Hypotheses are integer labels: the translation (2.3, -1.4)
# becomes (2, -1), EPE 0.5 exactly.
ACCURACY = {
    ("translation", "interpolation"): dict(epe=0.01, ae=1.0, coverage=0.9),
    ("translation", "hypotheses"): dict(epe=0.501, ae=6.0, coverage=0.7),
    ("rotation", "interpolation"): dict(epe=1.0, ae=30.0, coverage=0.5),
    ("rotation", "hypotheses"): dict(epe=1.05, ae=32.0, coverage=0.95),
    ("zoom", "interpolation"): dict(epe=0.9, ae=30.0, coverage=0.55),
    ("zoom", "hypotheses"): dict(epe=0.95, ae=32.0, coverage=0.95),
    ("layers", "interpolation"): dict(epe=0.01, ae=1.0, coverage=0.85),
    ("layers", "hypotheses"): dict(epe=0.55, ae=18.0, coverage=0.9),
}


@pytest.fixture(scope="module")
def sequences_small():
    return {k: sequence(k, height=H, width=W, seed=1, pole=(k == "layers"))
            for k in ("translation", "rotation", "zoom", "layers")}


@pytest.mark.parametrize("kind,method", sorted(ACCURACY))
def test_accuracy_on_synthetic_sequences(sequences_small, kind, method):
    seq = sequences_small[kind]
    tr = tracks_from_flow(seq, 0, n=156, seed=1)
    r = dense_flow(seq.frames[0], seq.frames[1], tr, method=method, device="cpu")
    e = flow_errors(r.flow, seq.flows[0], r.valid)
    lim = ACCURACY[(kind, method)]
    assert e.epe <= lim["epe"], e
    assert e.coverage >= lim["coverage"], e
    assert e.ae <= lim["ae"], e


def test_hypotheses_recover_the_featureless_pole_better(sequences_small):
    # the paper's Fig. 4/5 claim, quantified: no track lies on the pole
    seq = sequences_small["layers"]
    tr = tracks_from_flow(seq, 0, n=156, seed=1)
    pole = seq.layers[0] == 2
    assert pole.sum() > 200
    gt = seq.flows[0][pole]
    r1 = interpolate_flow(seq.frames[0], seq.frames[1], tr, device="cpu")
    r2 = hypothesis_flow(seq.frames[0], seq.frames[1], tr, device="cpu")
    e1 = np.linalg.norm(r1.flow[pole] - gt, axis=1).mean()
    e2 = np.linalg.norm(r2.flow[pole] - gt, axis=1).mean()
    assert e1 > 2.5                      # interpolation gives the pole the background's flow ...
    assert r1.valid[pole].mean() < 0.4   # ... and the change test marks most of it unclassified
    assert e2 < 0.8 * e1                 # the hypotheses put part of it on the pole's label
    right = np.all(r2.flow[pole] == np.floor(gt + 0.5), axis=1)
    assert right.mean() > 0.15


def test_noisy_tracks_still_give_the_layers(sequences_small):
    seq = sequences_small["layers"]
    tr = tracks_from_flow(seq, 0, n=156, seed=2, noise=0.3)
    r = interpolate_flow(seq.frames[0], seq.frames[1], tr, device="cpu")
    e = flow_errors(r.flow, seq.flows[0], r.valid)
    assert e.epe < 0.35 and e.coverage > 0.5


# ---------------------------------------------------------------------------------------------
# batching, API forms, bad input
# ---------------------------------------------------------------------------------------------
def test_sequence_and_batch_forms_equal_single_pairs():
    seq = sequence("layers", height=40, width=48, n_frames=3, seed=4)
    tr = [tracks_from_flow(seq, t, n=30, seed=t) for t in range(2)]
    for fn in (interpolate_flow, hypothesis_flow):
        s = fn(seq.frames, None, tr, device="cpu")                       # sequence of 3 frames
        b = fn(seq.frames[:2], seq.frames[1:], tr, device="cpu")         # batch of 2 pairs
        assert s.flow.shape == (2, 40, 48, 2) and s.valid.shape == (2, 40, 48)
        for t in range(2):
            one = fn(seq.frames[t], seq.frames[t + 1], tr[t], device="cpu")
            np.testing.assert_array_equal(s.flow[t], one.flow)
            np.testing.assert_array_equal(b.flow[t], one.flow)
            np.testing.assert_array_equal(s.valid[t], one.valid)
    p = hypothesis_flow(seq.frames[0], seq.frames[1], (tr[0][:, :2], tr[0][:, 2:]), device="cpu")
    q = hypothesis_flow(seq.frames[0], seq.frames[1], tr[0], device="cpu")
    np.testing.assert_array_equal(p.flow, q.flow)                        # (points0, points1) form
    g = interpolate_flow(seq.frames[0, ..., 0], seq.frames[1, ..., 0], tr[0], device="cpu")
    assert g.flow.shape == (40, 48, 2)                                   # grey frames
    m = g.masked()
    assert np.isnan(m[~g.valid]).all() and np.isfinite(m[g.valid]).all()


def test_bad_input_raises_clear_errors():
    seq = sequence("translation", height=20, width=24, n_frames=2, seed=0)
    a, b = seq.frames
    tr = tracks_from_flow(seq, 0, n=10)
    cases = [
        (lambda: interpolate_flow(a, b[:10], tr), "frame sizes differ"),
        (lambda: interpolate_flow(a[..., :2], b[..., :2], tr), None),    # 2 channels: (N,H,W) grey?
        (lambda: interpolate_flow(np.zeros((2, 3, 4, 5, 6)), None, tr), "must be"),
        (lambda: interpolate_flow(a.astype(np.float32) * np.nan, b, tr), "NaN"),
        (lambda: interpolate_flow(a, b, np.zeros((0, 4), np.float32)), "empty track list"),
        (lambda: interpolate_flow(a, b, np.zeros((5, 3), np.float32)), "(M, 4)"),
        (lambda: interpolate_flow(a, b, np.where(np.arange(4) == 0, np.nan, tr)), "NaN"),
        (lambda: interpolate_flow(a, b, tr + np.float32([100, 0, 100, 0])), "outside"),
        (lambda: interpolate_flow(a, b, tr, sigma_c=0), "sigma_c"),
        (lambda: interpolate_flow(a, b, tr, tau=-1), "tau"),
        (lambda: interpolate_flow(a, None, tr), "sequence"),
        (lambda: interpolate_flow(seq.frames, None, [tr, tr]), "1 frame pairs"),
        (lambda: hypothesis_flow(a, b, tr, sigma_f=float("nan")), "sigma_f"),
        (lambda: hypothesis_flow(a, b, np.concatenate([tr, [[1, 1, 900, 1]]]).astype(np.float32),
                                 max_labels=64), "max_labels"),
        (lambda: dense_flow(a, b, tr, method="bp"), "method"),
        (lambda: interpolate_flow(np.zeros((4, 4, 4), np.uint8), np.zeros((4, 4, 4), np.uint8), tr),
         None),
    ]
    for fn, text in cases:
        with pytest.raises(InputError) as ei:
            fn()
        if text:
            assert text in str(ei.value), str(ei.value)


# ---------------------------------------------------------------------------------------------
# metrics, visualisation
# ---------------------------------------------------------------------------------------------
def test_endpoint_and_angular_error_definitions():
    f = np.array([[1.0, 0.0], [0.0, 0.0], [3.0, 4.0]])
    g = np.array([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(endpoint_error(f, g), [1.0, 0.0, 5.0])
    # Baker et al.: angle between (u, v, 1) and (u_gt, v_gt, 1)
    np.testing.assert_allclose(angular_error(f, g), [45.0, 0.0, math.degrees(math.acos(1 / math.sqrt(26)))])
    e = flow_errors(f[None], g[None], valid=np.array([[True, True, False]]))
    assert e.epe == pytest.approx(0.5) and e.epe_all == pytest.approx(2.0)
    assert e.coverage == pytest.approx(2 / 3) and e.n == 2


def test_colour_wheel_image_and_png(tmp_path):
    flow = np.zeros((4, 6, 2), np.float32)
    flow[0, 0] = (1, 0)
    flow[0, 1] = (-1, 0)
    flow[0, 2] = (0, 1)
    valid = np.ones((4, 6), bool)
    valid[3, 5] = False
    img = flow_to_rgb(flow, valid)
    assert img.shape == (4, 6, 3) and img.dtype == np.uint8
    assert (img[1, 1] == 255).all()                       # zero flow: white
    assert (img[3, 5] == 0).all()                         # unclassified: black
    assert img[0, 0, 0] == 255 and img[0, 0, 1] < 50      # +u: red (Middlebury wheel)
    assert img[0, 1, 2] > 200 and img[0, 1, 0] < 50       # -u: cyan/blue side
    assert len({tuple(img[0, i]) for i in range(3)}) == 3
    data = png_bytes(img)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    PIL = pytest.importorskip("PIL.Image")
    p = tmp_path / "w.png"
    p.write_bytes(data)
    np.testing.assert_array_equal(np.asarray(PIL.open(p)), img)


# ---------------------------------------------------------------------------------------------
# KLT (OpenCV)
# ---------------------------------------------------------------------------------------------
def test_klt_tracks_and_flow_without_given_tracks(sequences_small):
    pytest.importorskip("cv2")
    from scanforest.kernels.motion.optical_flow import klt_tracks

    seq = sequences_small["translation"]
    tr = klt_tracks(seq.frames[0], seq.frames[1], max_features=150)
    assert tr.shape[1] == 4 and len(tr) > 50
    u, v = seq.flow_at(0, tr[:, 0], tr[:, 1])
    err = np.hypot(tr[:, 2] - tr[:, 0] - u, tr[:, 3] - tr[:, 1] - v)
    assert np.median(err) < 0.05 and err.max() < 1.0
    r = interpolate_flow(seq.frames[0], seq.frames[1], device="cpu")          # KLT inside
    e = flow_errors(r.flow, seq.flows[0], r.valid)
    assert e.epe < 0.1 and r.n_features[0] > 50


def test_without_opencv_klt_is_a_clear_error_and_given_tracks_work(monkeypatch):
    monkeypatch.setitem(sys.modules, "cv2", None)        # import cv2 -> ImportError
    seq = sequence("translation", height=24, width=32, seed=0)
    with pytest.raises(MissingDependency, match="opencv-python-headless"):
        interpolate_flow(seq.frames[0], seq.frames[1], tracker="opencv", device="cpu")
    r = interpolate_flow(seq.frames[0], seq.frames[1], tracks_from_flow(seq, 0, 20), device="cpu")
    assert r.valid.mean() > 0.5
    # the built-in tracker (the default) needs no OpenCV
    seq = sequence("translation", height=64, width=80, seed=0)
    r = interpolate_flow(seq.frames[0], seq.frames[1], device="cpu")
    assert r.params["tracks"] == "builtin" and r.n_features[0] > 20
    assert flow_errors(r.flow, seq.flows[0], r.valid).epe < 0.1


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rotation", "layers"])
def test_gpu_equals_cpu(kind):
    import cupy as cp

    seq = sequence(kind, height=120, width=160, n_frames=3, seed=3, pole=(kind == "layers"))
    tr = [tracks_from_flow(seq, t, n=156, seed=t) for t in range(2)]
    d = cp.asarray(seq.frames)
    for fn in (interpolate_flow, hypothesis_flow):
        c = fn(seq.frames, None, tr, device="cpu")
        g = fn(d, None, tr)                                   # auto: CuPy input -> GPU
        assert g.device == "gpu" and isinstance(g.flow, cp.ndarray)
        gf, gv = cp.asnumpy(g.flow), cp.asnumpy(g.valid)
        assert (gv == c.valid).mean() > 0.999
        both = gv & c.valid
        if fn is interpolate_flow:
            np.testing.assert_allclose(gf, c.flow, atol=2e-3, rtol=1e-3)
        else:
            assert (cp.asnumpy(g.label) == c.label).mean() > 0.999
            assert (np.abs(gf[both] - c.flow[both]) < 1e-6).all(axis=1).mean() > 0.999
        # one pair at a time gives the batched result
        one = fn(d[1], d[2], tr[1], device="gpu")
        np.testing.assert_array_equal(cp.asnumpy(one.flow), gf[1])


@pytest.mark.gpu
def test_gpu_matches_literal_reference_and_many_labels():
    import cupy as cp

    I0, I1, tr = _tiny(1)
    r = hypothesis_flow(cp.asarray(I0), cp.asarray(I1), tr, sigma_c=30.0, sigma_x=120.0, tau=20.0)
    labs, scores, ok, alg3, _ = ref_hypotheses(I0, I1, tr, 30.0, 120.0, 1.0, 20.0)
    s = np.where(ok, scores, -np.inf)
    top2 = np.sort(s, -1)[..., -2:]
    with np.errstate(invalid="ignore"):
        m = ((top2[..., 1] - top2[..., 0]) > 1e-4 * np.abs(top2[..., 1])) & (alg3 >= 0)
    np.testing.assert_array_equal(cp.asnumpy(r.label)[m], alg3[m])
    f1 = interpolate_flow(cp.asarray(I0), cp.asarray(I1), tr, sigma_c=30.0, sigma_x=120.0)
    flow, _, _ = ref_interpolation(I0, I1, tr, 30.0, 120.0, 20.0)
    np.testing.assert_allclose(cp.asnumpy(f1.flow), flow, atol=1e-3)
    # > 32 labels: several register chunks per pixel
    seq = sequence("layers", height=48, width=64, seed=2, background=(0, 0), foreground=(7, 5))
    trs = tracks_from_flow(seq, 0, 60)
    c = hypothesis_flow(seq.frames[0], seq.frames[1], trs, device="cpu")
    g = hypothesis_flow(cp.asarray(seq.frames[0]), cp.asarray(seq.frames[1]), trs)
    assert len(c.labels[0]) == 48
    assert (cp.asnumpy(g.label) == c.label).mean() > 0.999


@pytest.mark.gpu
def test_masked_argmax_gpu_same_rule():
    import cupy as cp

    rng = np.random.default_rng(0)
    s = rng.integers(0, 4, (50, 7)).astype(np.float32)
    ok = rng.random((50, 7)) < 0.5
    i_c, b_c = masked_argmax(s, ok, axis=1)
    i_g, b_g = masked_argmax(cp.asarray(s), cp.asarray(ok), axis=1)
    np.testing.assert_array_equal(cp.asnumpy(i_g), i_c)


# ---------------------------------------------------------------------------------------------
# store task, Prefect flow, CLI
# ---------------------------------------------------------------------------------------------
def test_motion_task_writes_pairs_idempotently(tmp_path):
    from scanforest.tasks.motion import motion_pairs, read_flow, sequences, write_sequence

    seq = sequence("layers", height=32, width=40, n_frames=3, seed=5)
    tr = [tracks_from_flow(seq, t, n=40, seed=t) for t in range(2)]
    store = str(tmp_path / "s.zarr")
    write_sequence(store, "seq", seq.frames, tracks=tr)
    assert sequences(store) == ["seq"]
    png = tmp_path / "png"
    recs = motion_pairs(store, "seq", [0, 1], method="interpolation", device="cpu", png_dir=str(png))
    assert [r["status"] for r in recs] == ["written", "written"]
    flow, valid = read_flow(store, "seq", 1, "interpolation")
    want = interpolate_flow(seq.frames[1], seq.frames[2], tr[1], device="cpu")
    np.testing.assert_array_equal(flow, want.flow)
    np.testing.assert_array_equal(valid, want.valid)
    assert flow.dtype == np.float32 and flow.shape == (32, 40, 2)
    assert (png / "seq" / "interpolation" / "000001.png").read_bytes()[:4] == b"\x89PNG"
    again = motion_pairs(store, "seq", [0, 1], method="interpolation", device="cpu")
    assert [r["status"] for r in again] == ["skipped", "skipped"]
    changed = motion_pairs(store, "seq", [1], method="interpolation", device="cpu",
                         params={"tau": 5.0})
    assert changed[0]["status"] == "written"          # other parameters: recomputed
    with pytest.raises(InputError, match="pairs 0..1"):
        motion_pairs(store, "seq", [2], device="cpu")


def test_ingest_frames_folder(tmp_path):
    from PIL import Image

    from scanforest.kernels.errors import ScanReadError
    from scanforest.tasks.motion import ingest_sequence, read_frames

    seq = sequence("translation", height=16, width=20, n_frames=3, seed=0)
    d = tmp_path / "frames"
    d.mkdir()
    for i, f in enumerate(seq.frames):   # natural order: f2 before f10
        Image.fromarray(f).save(d / f"f{[2, 10, 11][i]}.png")
    store = str(tmp_path / "s.zarr")
    r = ingest_sequence(store, str(d))
    assert r["status"] == "ingested" and r["frames"] == 3
    np.testing.assert_array_equal(read_frames(store, r["seq_id"]), seq.frames)
    assert ingest_sequence(store, str(d))["status"] == "skipped"
    np.save(d / "f12.npy", np.zeros((5, 5, 3), np.uint8))
    with pytest.raises(InputError, match="differ in size"):
        ingest_sequence(store, str(d))
    (d / "f12.npy").write_bytes(b"junk")
    with pytest.raises(ScanReadError):
        ingest_sequence(store, str(d))


def test_motion_cli_pair_and_run(tmp_path):
    from typer.testing import CliRunner

    from scanforest.deploy.cli import app
    from scanforest.tasks.motion import read_flow
    from scanforest.tasks.store import ScanStore

    seq = sequence("layers", height=32, width=40, n_frames=3, seed=6)
    fr, td = tmp_path / "frames", tmp_path / "tracks"
    fr.mkdir()
    td.mkdir()
    for i, f in enumerate(seq.frames):
        np.save(fr / f"{i:03d}.npy", f)
    for t in range(2):
        np.save(td / f"{t:03d}.npy", tracks_from_flow(seq, t, n=40, seed=t))
    runner = CliRunner()
    res = runner.invoke(app, ["motion", "pair", str(fr / "000.npy"), str(fr / "001.npy"),
                              "--tracks", str(td / "000.npy"), "-o", str(tmp_path / "f.npy"),
                              "--png", str(tmp_path / "f.png"), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert np.load(tmp_path / "f.npy").shape == (32, 40, 2)
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    store = str(tmp_path / "s.zarr")
    res = runner.invoke(app, ["motion", "run", store, "--frames", str(fr), "--seq", "cam",
                              "--tracks", str(td), "--device", "cpu", "--workers", "1",
                              "--png-dir", str(tmp_path / "png")])
    assert res.exit_code == 0, res.output
    assert "4 pair flows written" in res.output
    flow, valid = read_flow(store, "cam", 1, "hypotheses")
    want = hypothesis_flow(seq.frames[1], seq.frames[2], np.load(td / "001.npy"), device="cpu")
    np.testing.assert_array_equal(flow, want.flow)
    assert (tmp_path / "png" / "cam" / "hypotheses" / "000001.png").exists()
    # a run record of the version before the rename (kind "flow") stays in the store as it is
    ScanStore(store).write_run("flow-20261101T000000-0a1b2c", {"flow": "flow", "status": "completed"})
    res = runner.invoke(app, ["motion", "run", store, "--seq", "cam", "--device", "cpu",
                              "--workers", "1", "--no-png"])
    assert res.exit_code == 0 and "0 pair flows written, 4 already done" in res.output
    assert [r["flow"] for r in ScanStore(store, mode="r").runs()] == ["flow", "motion", "motion"]


def test_flow_is_a_deprecated_alias_of_motion(prefect_api, tmp_path_factory, tmp_path):
    """``scanforest flow pair`` as a user runs it (issue 40): the same result as ``scanforest
    motion pair`` and one line on stderr naming the new command; ``scanforest motion --help``
    lists run and pair without that line; ``bench flow`` is ``bench motion`` the same way."""
    from _userpath import fresh_env, ok, sf

    from scanforest.deploy.bench.motion import RENAMED as BENCH_RENAMED
    from scanforest.deploy.cli.motion import RENAMED

    env = fresh_env(tmp_path_factory, cold=False, api=prefect_api)
    seq = sequence("layers", height=32, width=40, n_frames=2, seed=6)
    for i, f in enumerate(seq.frames):
        np.save(tmp_path / f"{i}.npy", f)
    np.save(tmp_path / "t.npy", tracks_from_flow(seq, 0, n=40, seed=0))
    pair = (str(tmp_path / "0.npy"), str(tmp_path / "1.npy"), "--tracks", str(tmp_path / "t.npy"),
            "--device", "cpu", "--method", "interpolation")
    old = sf("flow", "pair", *pair, "-o", str(tmp_path / "old.npy"), env=env, cwd=tmp_path)
    ok(old)
    assert old.stderr.splitlines().count(RENAMED) == 1, old.stderr
    assert RENAMED == "`scanforest flow` is renamed `scanforest motion`; the old name goes in the next release"
    new = sf("motion", "pair", *pair, "-o", str(tmp_path / "new.npy"), env=env, cwd=tmp_path)
    ok(new)
    assert RENAMED not in new.stderr
    want = interpolate_flow(seq.frames[0], seq.frames[1], np.load(tmp_path / "t.npy"), device="cpu")
    for name in ("old", "new"):
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), want.flow)
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.valid.npy"), want.valid)

    helped = sf("motion", "--help", env=env, cwd=tmp_path)
    text = ok(helped)
    assert "run" in text.split() and "pair" in text.split() and RENAMED not in helped.stderr
    old_help = sf("flow", "--help", env=env, cwd=tmp_path)
    assert "pair" in ok(old_help).split() and old_help.stderr.splitlines().count(RENAMED) == 1
    bench_old = sf("bench", "flow", "--help", env=env, cwd=tmp_path)
    assert "--sizes" in ok(bench_old) and bench_old.stderr.splitlines().count(BENCH_RENAMED) == 1


def test_motion_run_bad_frames_fail_in_one_line_without_retries(prefect_api, tmp_path_factory, tmp_path):
    """``scanforest motion run`` as a user runs it: a folder with one frame, a non-image among the
    frames and frames smaller than the built-in tracker's window each end in exit 2 and one
    ``error:`` line (no worker traceback, no retries), and a bad ``--tracker`` before anything
    starts."""
    from PIL import Image

    from _userpath import fresh_env, one_line_error, sf

    env = fresh_env(tmp_path_factory, cold=False, api=prefect_api)
    rng = np.random.default_rng(0)
    one, bad, tiny = (tmp_path / n for n in ("one", "bad", "tiny"))
    for d in (one, bad, tiny):
        d.mkdir()
    Image.fromarray((rng.random((40, 48, 3)) * 255).astype(np.uint8)).save(one / "0.png")
    for i in range(2):
        Image.fromarray((rng.random((40, 48, 3)) * 255).astype(np.uint8)).save(bad / f"{i}.png")
    (bad / "2.png").write_text("not an image")
    for i in range(3):
        Image.fromarray((rng.random((16, 20)) * 255).astype(np.uint8)).save(tiny / f"{i}.png")
    store = str(tmp_path / "s.zarr")
    run = ("motion", "run", store, "--device", "cpu", "--workers", "1", "--no-png")
    one_line_error(sf(*run, "--frames", str(one), env=env, cwd=tmp_path), "at least 2 frames, found 1")
    one_line_error(sf(*run, "--frames", str(one), "--tracker", "klt", env=env, cwd=tmp_path),
                   "tracker must be one of")
    res = sf(*run, "--frames", str(bad), env=env, cwd=tmp_path)
    one_line_error(res, "2.png: not a readable image")
    assert "Compute Failed" not in res.stderr, res.stderr
    res = sf(*run, "--frames", str(tiny), env=env, cwd=tmp_path)
    one_line_error(res, "sequence 'tiny'", "too small to track")
    assert "Crash" not in res.stderr, res.stderr


def test_motion_task_klt_options_are_part_of_the_key(tmp_path):
    """Pairs tracked with other tracker options are recomputed, not skipped; the default
    options keep the key they had; a user error on a worker comes back whole (ScanReadError)."""
    import pickle

    from scanforest.kernels.errors import ScanReadError
    from scanforest.tasks.motion import UserError, catching_user_errors, motion_pairs, write_sequence

    seq = sequence("layers", height=64, width=80, n_frames=2, seed=5)
    store = str(tmp_path / "s.zarr")
    write_sequence(store, "seq", seq.frames)
    kw = dict(method="interpolation", device="cpu")
    assert motion_pairs(store, "seq", [0], **kw)[0]["status"] == "written"
    assert motion_pairs(store, "seq", [0], klt=None, **kw)[0]["status"] == "skipped"
    r = motion_pairs(store, "seq", [0], klt={"max_features": 30}, **kw)[0]
    assert r["status"] == "written" and r["n_features"] <= 30
    assert motion_pairs(store, "seq", [0], klt={"max_features": 30}, **kw)[0]["status"] == "skipped"

    def fail():
        raise ScanReadError("/x/f.png", "not a readable image")

    u = pickle.loads(pickle.dumps(catching_user_errors(fail)))
    assert isinstance(u, UserError)
    with pytest.raises(ScanReadError, match="/x/f.png: not a readable image") as ei:
        u.reraise()
    assert ei.value.path == "/x/f.png"
    assert catching_user_errors(lambda a, b=0: a + b, 1, b=2) == 3
