"""Sparse tracking (Shi-Tomasi corners + pyramidal Lucas-Kanade + forward-backward check) against
OpenCV and against the exact motion of the synthetic sequences; the dense flow it feeds; CPU =
GPU (issue 25)."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.errors import InputError
from scanforest.kernels.motion import _tracking_cpu as C
from scanforest.kernels.motion.metrics import flow_errors
from scanforest.kernels.motion.optical_flow import dense_flow, klt_tracks
from scanforest.kernels.motion.tracking import (_levels, good_features, grey_u8, lk_track,
                                                sparse_tracks, track_grey)
from scanforest.kernels.synthetic.sequences import KINDS, sequence

H, W = 120, 160


def _cv2():
    return pytest.importorskip("cv2")


def _lk_cv(cv2, g0, g1, pts, win=21, levels=3):
    crit = (cv2.TERM_CRITERIA_EPS | cv2.TERM_CRITERIA_COUNT, 30, 0.01)
    p1, st, _ = cv2.calcOpticalFlowPyrLK(g0, g1, np.asarray(pts, np.float32).reshape(-1, 1, 2),
                                         None, winSize=(win, win), maxLevel=levels, criteria=crit)
    return p1.reshape(-1, 2), st.reshape(-1).astype(bool)


@pytest.fixture(scope="module")
def seqs():
    return {k: sequence(k, height=H, width=W, n_frames=3, seed=1) for k in KINDS}


# ---------------------------------------------------------------------------------------------
# building blocks against OpenCV
# ---------------------------------------------------------------------------------------------
def test_pyramid_and_scharr_derivatives_equal_opencv(seqs):
    cv2 = _cv2()
    g = grey_u8(seqs["layers"].frames)
    lv = _levels(H, W, 21, 3)
    assert [tuple(r[:2]) for r in lv] == [(120, 160), (60, 80), (30, 40)]   # 15 <= 21: stop
    pyr, der = C.build_pyramids(g, lv)
    _, ref = cv2.buildOpticalFlowPyramid(g[1], (21, 21), 3, withDerivatives=True)
    assert len(ref) == 2 * len(lv)
    for level, (h, w, off) in enumerate(lv):
        np.testing.assert_array_equal(pyr[1, off:off + h * w].reshape(h, w), ref[2 * level])
        np.testing.assert_array_equal(der[1, off:off + h * w].reshape(h, w, 2), ref[2 * level + 1])


@pytest.mark.parametrize("kind", ["layers", "rotation"])
@pytest.mark.parametrize("block,min_distance", [(3, 7.0), (7, 7.0), (5, 12.5)])
def test_good_features_agree_with_opencv(seqs, kind, block, min_distance):
    cv2 = _cv2()
    g = grey_u8(seqs[kind].frames[:1])[0]
    ours = good_features(g, 150, 0.01, min_distance, block, device="cpu")
    ref = cv2.goodFeaturesToTrack(g, 150, 0.01, min_distance, blockSize=block).reshape(-1, 2)
    assert ours.dtype == np.float32 and ours.shape[1] == 2
    assert abs(len(ours) - len(ref)) <= 0.05 * len(ref)
    d = np.hypot(*(ours[:, None, :] - ref[None, :, :]).transpose(2, 0, 1))
    assert (d.min(axis=1) <= 1.0).mean() >= 0.9                 # the brief's overlap criterion
    assert (d.min(axis=1) == 0).mean() >= 0.98                  # in fact (almost) the same pixels
    pd = np.hypot(*(ours[:, None, :] - ours[None, :, :]).transpose(2, 0, 1))
    np.fill_diagonal(pd, np.inf)
    assert pd.min() >= min_distance                             # the greedy rule holds
    batch = good_features(grey_u8(seqs[kind].frames), 150, 0.01, min_distance, block, device="cpu")
    assert len(batch) == 3
    np.testing.assert_array_equal(batch[0], ours)               # a batch = single images


@pytest.mark.parametrize("kind", KINDS)
def test_lk_matches_opencv_and_the_true_motion(seqs, kind):
    cv2 = _cv2()
    seq = seqs[kind]
    g = grey_u8(seq.frames)
    pts = cv2.goodFeaturesToTrack(g[0], 200, 0.01, 7.0, blockSize=7).reshape(-1, 2)
    ours, st = lk_track(g[0], g[1], pts, fb_threshold=None, device="cpu")
    ref, rst = _lk_cv(cv2, g[0], g[1], pts)
    assert ours.dtype == np.float32 and st.dtype == bool and ours.shape == pts.shape
    assert (st == rst).mean() >= 0.98
    both = st & rst
    diff = np.abs(ours[both] - ref[both]).max(axis=1)
    assert np.median(diff) <= 0.1                               # the brief's criterion
    assert np.quantile(diff, 0.95) <= 1e-3                      # same arithmetic as OpenCV
    u, v = seq.flow_at(0, pts[st, 0], pts[st, 1])
    err = np.hypot(ours[st, 0] - pts[st, 0] - u, ours[st, 1] - pts[st, 1] - v)
    assert np.median(err) < 0.1, np.median(err)                 # the exact synthetic motion
    assert np.quantile(err, 0.8) < 0.3


def test_sparse_tracks_equal_opencv_klt(seqs):
    _cv2()
    seq = seqs["zoom"]
    ours = sparse_tracks(seq.frames[0], seq.frames[1], device="cpu")[0]
    ref = klt_tracks(seq.frames[0], seq.frames[1])                 # same defaults
    assert abs(len(ours) - len(ref)) <= 3
    d = np.abs(ours[:, None, :2] - ref[None, :, :2]).max(-1)
    j = d.argmin(axis=1)
    same = d[np.arange(len(ours)), j] == 0
    assert same.mean() > 0.95
    assert np.quantile(np.abs(ours[same, 2:] - ref[j[same], 2:]), 0.95) < 1e-3


# ---------------------------------------------------------------------------------------------
# forward-backward check, lost points
# ---------------------------------------------------------------------------------------------
def test_forward_backward_check_rejects_changed_patches(seqs):
    cv2 = _cv2()
    seq = seqs["translation"]                       # shift (2.3, -1.4) px per frame
    g = grey_u8(seq.frames)
    g0, g1 = g[0], g[1].copy()
    pts = good_features(g0, 60, 0.01, 10.0, 7, device="cpu")
    inner = np.nonzero((pts[:, 0] > 25) & (pts[:, 0] < W - 25) & (pts[:, 1] > 25)
                       & (pts[:, 1] < H - 25))[0][:6]
    assert len(inner) == 6
    for x, y in pts[inner]:                         # the patch is gone in frame 1 (flat grey)
        x1, y1 = int(round(x + 2.3)), int(round(y - 1.4))
        g1[y1 - 20:y1 + 21, x1 - 20:x1 + 21] = 128
    p1, st = lk_track(g0, g1, pts, device="cpu")
    p1n, stn = lk_track(g0, g1, pts, fb_threshold=None, device="cpu")
    np.testing.assert_array_equal(p1, p1n)          # the check only changes the status
    assert stn[inner].all()                         # forward alone does not notice ...
    assert not st[inner].any()                      # ... the backward track does
    # the rule, recomputed from two one-way tracks, and OpenCV's decision on the same points
    pb, sb = lk_track(g1, g0, p1n, fb_threshold=None, device="cpu")
    rule = stn & sb & (np.hypot(*(pb - pts).T) <= 1.0)
    np.testing.assert_array_equal(st, rule)
    r1, rs1 = _lk_cv(cv2, g0, g1, pts)
    rb, rs2 = _lk_cv(cv2, g1, g0, r1)
    ref = rs1 & rs2 & (np.hypot(*(rb - pts).T) <= 1.0)
    assert (ref == st).mean() >= 0.95
    # most other points stay, and the kept tracks follow the true motion (to the check's 1 px)
    assert st.sum() >= 0.5 * len(pts)
    err = np.hypot(*(p1[st] - pts[st] - [2.3, -1.4]).T)
    assert err.max() < 1.0 and np.median(err) < 0.1


def test_points_leaving_the_frame_are_lost(seqs):
    g = grey_u8(seqs["translation"].frames)
    pts = np.array([[80.0, 60.0], [-40.0, 10.0], [W + 50.0, 30.0], [5.0, H + 60.0]], np.float32)
    p1, st = lk_track(g[0], g[1], pts, fb_threshold=None, device="cpu")
    np.testing.assert_array_equal(st, [True, False, False, False])
    assert np.isfinite(p1).all()
    e, es = lk_track(g[0], g[1], np.zeros((0, 2), np.float32), device="cpu")
    assert e.shape == (0, 2) and es.shape == (0,)


# ---------------------------------------------------------------------------------------------
# batching
# ---------------------------------------------------------------------------------------------
def test_sequence_batch_and_single_pairs_agree():
    seq = sequence("layers", height=96, width=128, n_frames=4, seed=4)
    s = sparse_tracks(seq.frames, device="cpu")                       # 3 consecutive pairs
    b = sparse_tracks(seq.frames[:3], seq.frames[1:], device="cpu")   # 3 pairs as a batch
    assert len(s) == len(b) == 3
    for t in range(3):
        one = sparse_tracks(seq.frames[t], seq.frames[t + 1], device="cpu")[0]
        assert one.shape[1] == 4 and one.dtype == np.float32 and len(one) > 50
        np.testing.assert_array_equal(s[t], one)
        np.testing.assert_array_equal(b[t], one)
    grey = sparse_tracks(grey_u8(seq.frames), device="cpu")           # (T, H, W) grey input
    for t in range(3):
        np.testing.assert_array_equal(grey[t], s[t])
    tr, keep = track_grey(grey_u8(seq.frames), np.array([[0, 1], [2, 3]]), "cpu")
    assert tr.shape == (2, 200, 4) and keep.shape == (2, 200)
    np.testing.assert_array_equal(tr[1][keep[1]], s[2])


# ---------------------------------------------------------------------------------------------
# dense flow with the new tracker
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_dense_flow_with_builtin_tracks_no_worse_than_opencv(seqs, kind):
    _cv2()
    seq = seqs[kind]
    for method in ("interpolation", "hypotheses"):
        ours = dense_flow(seq.frames[0], seq.frames[1], method=method, device="cpu")
        ref = dense_flow(seq.frames[0], seq.frames[1], method=method, device="cpu",
                         tracker="opencv")
        assert ours.params["tracks"] == "builtin" and ref.params["tracks"] == "opencv"
        eo = flow_errors(ours.flow, seq.flows[0], ours.valid)
        er = flow_errors(ref.flow, seq.flows[0], ref.valid)
        assert eo.epe <= er.epe + 0.02, (eo, er)
        assert eo.epe_all <= er.epe_all + 0.02, (eo, er)
        assert eo.coverage >= er.coverage - 0.02, (eo, er)
        assert abs(ours.n_features[0] - ref.n_features[0]) <= 5


def test_flow_tracks_some_pairs_given_others_tracked():
    seq = sequence("translation", height=96, width=128, n_frames=3, seed=2)
    from scanforest.kernels.synthetic.sequences import tracks_from_flow

    given = tracks_from_flow(seq, 0, n=60, seed=0)
    r = dense_flow(seq.frames, None, [given, None], method="interpolation", device="cpu")
    assert r.params["tracks"] == "given+builtin"
    assert r.n_features[0] == 60 and r.n_features[1] > 50
    both = dense_flow(seq.frames, None, None, method="interpolation", device="cpu")
    np.testing.assert_array_equal(r.flow[1], both.flow[1])


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def test_bad_input_raises_one_clear_line():
    seq = sequence("translation", height=48, width=64, n_frames=2, seed=0)
    g = grey_u8(seq.frames)
    pts = np.array([[10.0, 10.0]], np.float32)
    cases = [
        (lambda: good_features(np.zeros((2, 3, 4, 5, 6))), "must be"),
        (lambda: good_features(np.full((40, 40), np.nan, np.float32)), "NaN"),
        (lambda: good_features(np.zeros((40, 40), bool)), "dtype"),
        (lambda: good_features(g[0], max_features=0), "max_features"),
        (lambda: good_features(g[0], quality=0.0), "quality"),
        (lambda: good_features(g[0], block_size=40), "block_size"),
        (lambda: good_features(g[0], min_distance=-1), "min_distance"),
        (lambda: lk_track(g[0], g[1][:40], pts), "sizes differ"),
        (lambda: lk_track(g[0, :16, :16], g[1, :16, :16], pts), "too small"),
        (lambda: lk_track(g[0], g[1], np.zeros((3, 3), np.float32)), "(M, 2)"),
        (lambda: lk_track(g[0], g[1], pts * np.nan), "NaN"),
        (lambda: lk_track(g[0], g[1], pts, win_size=2), "win_size"),
        (lambda: lk_track(g[0], g[1], pts, fb_threshold=float("inf")), "fb_threshold"),
        (lambda: lk_track(g, g, pts), "one image pair"),
        (lambda: sparse_tracks(seq.frames[:1]), "at least 2 frames"),
        (lambda: sparse_tracks(g[0]), "must be a sequence"),
        (lambda: sparse_tracks(seq.frames[0], seq.frames[1][:, :30]), "frame sizes differ"),
        (lambda: sparse_tracks(seq.frames[:, :12, :12]), "too small"),
        (lambda: sparse_tracks(seq.frames, iters=0), "iters"),
        (lambda: dense_flow(seq.frames[0], seq.frames[1], tracker="lucas"), "tracker"),
        (lambda: dense_flow(seq.frames[0], seq.frames[1], klt={"corners": 5}), "unknown option"),
        (lambda: dense_flow(seq.frames[0, :16, :16], seq.frames[1, :16, :16], device="cpu"),
         "too small"),
    ]
    for fn, text in cases:
        with pytest.raises(InputError) as ei:
            fn()
        msg = str(ei.value)
        assert text in msg, msg
        assert "\n" not in msg, msg


# ---------------------------------------------------------------------------------------------
# GPU (the lead runs these on a GPU machine; the CUDA kernels translate the numba ones)
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_pyramids_and_corners_equal_cpu(seqs):
    import cupy as cp

    from scanforest.kernels.motion import _tracking_gpu as G

    g = grey_u8(seqs["layers"].frames)
    lv = _levels(H, W, 21, 3)
    pc, dc = C.build_pyramids(g, lv)
    pg, dg = G.build_pyramids(cp.asarray(g), lv)
    np.testing.assert_array_equal(cp.asnumpy(pg), pc)
    np.testing.assert_array_equal(cp.asnumpy(dg), dc)
    for kind in ("layers", "rotation"):
        for block, md in ((3, 7.0), (7, 10.0)):
            gg = grey_u8(seqs[kind].frames)
            c = good_features(gg, 200, 0.01, md, block, device="cpu")
            d = good_features(cp.asarray(gg), 200, 0.01, md, block)          # CuPy -> GPU
            assert isinstance(d[0], cp.ndarray)
            for a, b in zip(c, d):
                np.testing.assert_array_equal(cp.asnumpy(b), a)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_tracker_equals_cpu(seqs, kind):
    import cupy as cp

    seq = seqs[kind]
    c = sparse_tracks(seq.frames, device="cpu")
    d = sparse_tracks(cp.asarray(seq.frames))                        # frames on the device
    assert len(d) == 2 and isinstance(d[0], cp.ndarray)
    for a, b in zip(c, d):
        b = cp.asnumpy(b)
        assert a.shape == b.shape                                    # same kept tracks
        np.testing.assert_allclose(b, a, atol=1e-3, rtol=0)
    g = grey_u8(seq.frames)
    pts = good_features(g[0], 200, 0.01, 7.0, 7, device="cpu")
    pts = np.concatenate([pts, [[-30.0, 5.0], [W - 1.0, H - 1.0]]]).astype(np.float32)
    for fb in (None, 1.0):
        p1, st = lk_track(g[0], g[1], pts, fb_threshold=fb, device="cpu")
        q1, qs = lk_track(cp.asarray(g[0]), cp.asarray(g[1]), cp.asarray(pts), fb_threshold=fb)
        np.testing.assert_array_equal(cp.asnumpy(qs), st)
        np.testing.assert_allclose(cp.asnumpy(q1), p1, atol=1e-3, rtol=0)
    # the host-frames path of sparse_tracks on the GPU, host results
    h = sparse_tracks(seq.frames[0], seq.frames[1], device="gpu", host=True)[0]
    assert isinstance(h, np.ndarray)
    np.testing.assert_allclose(h, c[0], atol=1e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["translation", "layers"])
def test_gpu_flow_end_to_end_with_gpu_tracks(seqs, kind):
    import cupy as cp

    seq = seqs[kind]
    for method in ("interpolation", "hypotheses"):
        c = dense_flow(seq.frames, None, method=method, device="cpu")
        g = dense_flow(seq.frames, None, method=method, device="gpu")   # host frames, GPU tracks
        assert g.device == "gpu" and isinstance(g.flow, cp.ndarray)
        assert g.params["tracks"] == "builtin" and g.n_features == c.n_features
        gf, gv = cp.asnumpy(g.flow), cp.asnumpy(g.valid)
        assert (gv == c.valid).mean() > 0.999
        if method == "interpolation":
            np.testing.assert_allclose(gf, c.flow, atol=2e-3, rtol=1e-3)
        else:
            assert (cp.asnumpy(g.label) == c.label).mean() > 0.999
        e = flow_errors(gf, seq.flows, gv)
        ec = flow_errors(c.flow, seq.flows, c.valid)
        assert abs(e.epe - ec.epe) < 1e-3
        d = dense_flow(cp.asarray(seq.frames), None, method=method)      # device frames
        np.testing.assert_array_equal(cp.asnumpy(d.flow), gf)
