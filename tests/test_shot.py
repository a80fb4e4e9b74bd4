"""SHOT352: PCL's unit test reproduced, a float64 numpy reference, PCL's indices/surface
equivalences, the approximate mode, and GPU against CPU."""
from __future__ import annotations

import math

import numpy as np
import pytest

from scanforest.kernels.descriptors.keypoints import keypoints
from scanforest.kernels.descriptors.normals import normals
from scanforest.kernels.descriptors.shot import shot
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

PCL_DESC_103 = {9: 0.0072018504, 10: 0.0023103887, 11: 0.0024724449, 19: 0.0031367359,
                20: 0.17439659, 21: 0.06542316, 42: 0.013304681, 53: 0.0073520984,
                54: 0.013584172, 55: 0.0050609680}


@pytest.fixture(scope="module")
def bun0(pcl_dir):
    pts = read_points(pcl_dir / "bun0.pcd")
    n, _ = normals(pts, radius=0.04, device="cpu")
    return pts, n


# ---------------------------------------------------------------------------------------------
# float64 reference, written from PCL's shot_lrf.hpp / shot.hpp with numpy (eigh, brute force)
# ---------------------------------------------------------------------------------------------
def ref_shot(kp, surf, snrm, R):
    d2all = ((kp[:, None, :].astype(np.float64) - surf[None].astype(np.float64)) ** 2).sum(-1)
    out = np.full((len(kp), 352), np.nan)
    frames = np.full((len(kp), 3, 3), np.nan)
    for k, c in enumerate(kp.astype(np.float64)):
        nb = np.nonzero(d2all[k] < R * R)[0]
        nb = nb[np.lexsort((nb, d2all[k, nb]))]
        v = surf[nb].astype(np.float64) - c
        dist = np.sqrt(d2all[k, nb])
        keep = np.any(surf[nb] != kp[k], axis=1)
        vv, ww = v[keep], R - dist[keep]
        if len(vv) < 5:
            continue
        cov = (vv * ww[:, None]).T @ vv / ww.sum()
        _, vec = np.linalg.eigh(cov)
        axes = []
        for a in (vec[:, 2], vec[:, 0]):
            dots = vv @ a
            plus = 2 * np.sum(dots >= 0) - len(vv)
            if plus == 0:
                med = len(vv) // 2
                plus = -1 if np.sum(dots[med - 2:med + 3] > 0) < 3 else 1
            axes.append(a if plus > 0 else -a)
        x, z = axes
        y = np.cross(z, x)
        frames[k] = [x, y, z]
        h = np.zeros(352)
        for j, p in enumerate(nb):
            n = snrm[p].astype(np.float64)
            d = dist[j]
            if not np.isfinite(n).all() or d < 1e-15:
                continue
            cosd = min(1.0, max(-1.0, n @ z))
            b = (1 + cosd) * 10 / 2
            xr, yr, zr = v[j] @ x, v[j] @ y, v[j] @ z
            az = math.atan2(yr, xr)
            # PCL's volume numbering (azimuth sector from the signs and magnitudes of x, y)
            bit4 = 1 if (yr > 0 or (yr == 0 and xr < 0)) else 0
            bit3 = (1 - bit4) if (xr > 0 or (xr == 0 and yr > 0)) else bit4
            di = ((bit4 << 3) + (bit3 << 2)) << 1
            if xr * yr > 0 or xr == 0:
                di += 0 if abs(xr) >= abs(yr) else 4
            else:
                di += 4 if abs(xr) > abs(yr) else 0
            di += (1 if zr > 0 else 0) + (2 if d > R / 2 else 0)
            step = math.floor(b + 0.5)
            vol = di * 11
            bd = b - step
            w = 1 - abs(bd)
            h[vol + ((step + 1) % 10 if bd > 0 else (step - 1 + 10) % 10)] += abs(bd)
            if d > R / 2:
                rd = (d - 3 * R / 4) / (R / 2)
                if d > 3 * R / 4:
                    w += 1 - rd
                else:
                    w += 1 + rd
                    h[(di - 2) * 11 + step] -= rd
            else:
                rd = (d - R / 4) / (R / 2)
                if d < R / 4:
                    w += 1 + rd
                else:
                    w += 1 - rd
                    h[(di + 2) * 11 + step] += rd
            inc = math.acos(min(1.0, max(-1.0, zr / d)))
            if inc > math.pi / 2:
                idist = (inc - 3 * math.pi / 4) / (math.pi / 2)
                if inc > 3 * math.pi / 4:
                    w += 1 - idist
                else:
                    w += 1 + idist
                    h[(di + 1) * 11 + step] -= idist
            else:
                idist = (inc - math.pi / 4) / (math.pi / 2)
                if inc < math.pi / 4:
                    w += 1 + idist
                else:
                    w += 1 - idist
                    h[(di - 1) * 11 + step] += idist
            if xr != 0 or yr != 0:
                ad = (az - (-7 * math.pi / 8 + (math.pi / 4) * (di >> 2))) / (math.pi / 4)
                ad = max(-0.5, min(ad, 0.5))
                if ad > 0:
                    w += 1 - ad
                    h[((di + 4) % 32) * 11 + step] += ad
                else:
                    w += 1 + ad
                    h[((di - 4 + 32) % 32) * 11 + step] -= ad
            h[vol + step] += w
        out[k] = h / np.linalg.norm(h)
    return out, frames


def test_pcl_unit_test_bun0(bun0):
    pts, n = bun0
    desc, frames = shot(pts, n, np.arange(len(pts)), 0.04, device="cpu")
    assert desc.shape == (397, 352) and desc.dtype == np.float32
    assert frames.shape == (397, 3, 3) and frames.dtype == np.float32
    for i, v in PCL_DESC_103.items():
        assert abs(desc[103, i] - v) < 1e-4, (i, desc[103, i], v)
    np.testing.assert_allclose(np.linalg.norm(desc, axis=1), 1, rtol=1e-5)
    # frames are orthonormal and right-handed
    f = frames.astype(np.float64)
    np.testing.assert_allclose(f @ f.transpose(0, 2, 1), np.broadcast_to(np.eye(3), f.shape), atol=1e-5)
    np.testing.assert_allclose(np.linalg.det(f), 1, atol=1e-5)


def test_matches_float64_reference(bun0):
    pts, n = bun0
    kp = np.arange(0, 397, 4)
    desc, frames = shot(pts, n, kp, 0.04, device="cpu")
    rd, rf = ref_shot(pts[kp], pts, n, 0.04)
    np.testing.assert_array_equal(np.isnan(desc), np.isnan(rd))
    assert np.nanmax(np.abs(desc - rd)) < 1e-4
    assert np.nanmax(np.abs(frames - rf)) < 1e-5


def test_indices_vs_search_surface_equivalence(bun0):
    # PCL's testSHOTIndicesAndSearchSurface: all three ways give identical descriptors
    pts, n = bun0
    idx = np.arange(0, 397, 3)
    full, ff = shot(pts, n, np.arange(397), 0.04, device="cpu")
    d1, f1 = shot(pts[idx], None, pts[idx], 0.04, surface=pts, surface_normals=n, device="cpu")
    d2, f2 = shot(pts, n, idx, 0.04, device="cpu")
    np.testing.assert_array_equal(d1, full[idx])
    np.testing.assert_array_equal(d2, full[idx])
    np.testing.assert_array_equal(f1, ff[idx])


def test_isolated_keypoint_is_nan_and_nan_normals_skipped(bun0):
    pts, n = bun0
    far = np.vstack([pts, [[10.0, 10.0, 10.0]]]).astype(np.float32)
    nn = np.vstack([n, [[0, 0, 1.0]]]).astype(np.float32)
    d, f = shot(far, nn, np.array([103, 397]), 0.04, device="cpu")
    assert np.isnan(d[1]).all() and np.isnan(f[1]).all()
    assert np.isfinite(d[0]).all()
    # a NaN normal on a neighbour removes its contribution (descriptor stays finite)
    n2 = n.copy()
    n2[104] = np.nan
    d2, _ = shot(pts, n2, np.array([103]), 0.04, device="cpu")
    assert np.isfinite(d2).all()
    # every normal NaN: the frame is valid (it uses positions only) but no neighbour votes;
    # PCL normalises 0/0 into a NaN descriptor, and so do we (not a ZeroDivisionError)
    d3, f3 = shot(pts, np.full_like(n, np.nan), np.array([103]), 0.04, device="cpu")
    assert np.isnan(d3).all() and np.isfinite(f3).all()


def test_rotation_invariance(bun0, rng):
    pts, n = bun0
    q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    q *= np.sign(np.linalg.det(q))
    kp = np.arange(0, 397, 10)
    d0, f0 = shot(pts, n, kp, 0.04, device="cpu")
    d1, f1 = shot((pts @ q.T).astype(np.float32), (n @ q.T).astype(np.float32), kp, 0.04, device="cpu")
    # frames rotate with the cloud; descriptors agree except where a bin boundary is hit
    err = np.abs(d0 - d1).max(axis=1)
    assert np.mean(err < 1e-3) > 0.9
    np.testing.assert_allclose(np.median(err), 0, atol=1e-4)


def test_approximate_mode(bun0):
    pts, n = bun0
    kp = np.arange(0, 397, 2)
    exact, _ = shot(pts, n, kp, 0.04, device="cpu")
    same, _ = shot(pts, n, kp, 0.04, approximate=True, max_neighbors=10_000, device="cpu")
    np.testing.assert_allclose(same, exact, atol=1e-6)  # same support, other summation order
    approx, _ = shot(pts, n, kp, 0.04, approximate=True, device="cpu")
    ok = np.isfinite(exact[:, 0])
    assert np.isfinite(approx[ok]).all()
    assert not np.allclose(approx[ok], exact[ok])
    # capping = running the exact mode on the capped support (largest kept distance)
    with pytest.raises(InputError):
        shot(pts, n, kp, 0.04, max_neighbors=5, device="cpu")


def test_bad_inputs(bun0):
    pts, n = bun0
    with pytest.raises(InputError, match="rows"):
        shot(pts, n[:10], np.arange(3), 0.04, device="cpu")
    with pytest.raises(InputError, match="indices"):
        shot(pts, n, np.array([400]), 0.04, device="cpu")
    with pytest.raises(InputError, match="radius"):
        shot(pts, n, np.arange(3), 0.0, device="cpu")
    with pytest.raises(InputError, match="surface_normals"):
        shot(pts, n, np.arange(3), 0.04, surface=pts, device="cpu")


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
def _compare(dc, fc, dg, fg, label=""):
    np.testing.assert_array_equal(np.isnan(dc), np.isnan(dg))
    np.testing.assert_array_equal(np.isnan(fc), np.isnan(fg))
    ok = np.isfinite(dc[:, 0])
    if ok.any():
        err = np.abs(dc[ok] - dg[ok]).max(axis=1)
        ferr = np.abs(fc[ok] - fg[ok]).max(axis=(1, 2))
        print(f"SHOT GPU-CPU {label}: {ok.sum()} valid keypoints, max desc diff {err.max():.3g}, "
              f"max frame diff {ferr.max():.3g}, keypoints > 1e-4: {(err > 1e-4).sum()}")
        assert (err > 1e-4).mean() <= 1e-3
        assert np.median(err) < 1e-6
        # the frames held as the descriptors are: a frame's sign is disambiguated by counts, so a
        # near-tie may flip on a few keypoints; every other frame agrees to float32 rounding
        assert (ferr > 1e-4).mean() <= 1e-3
        assert np.median(ferr) < 1e-6


@pytest.mark.gpu
def test_gpu_bun0_pcl_values_and_cpu_agreement(bun0):
    import cupy as cp

    pts, n = bun0
    ng, _ = normals(cp.asarray(pts), radius=0.04)
    assert np.abs(cp.asnumpy(ng) - n).max() < 1e-5
    dc, fc = shot(pts, n, np.arange(397), 0.04, device="cpu")
    from scanforest.kernels.descriptors import shot_gpu

    for lpk in shot_gpu.LPK_CHOICES:
        dg, fg = shot_gpu.shot_gpu(cp.asarray(pts), cp.asarray(pts), cp.asarray(n), 0.04, lpk=lpk)
        dg, fg = cp.asnumpy(dg), cp.asnumpy(fg)
        for i, v in PCL_DESC_103.items():
            assert abs(dg[103, i] - v) < 1e-4
        _compare(dc, fc, dg, fg, f"bun0 lpk={lpk}")
        assert np.abs(dc - dg).max() < 1e-4


@pytest.mark.gpu
def test_gpu_matches_cpu_on_kinect_scene(pcl_dir):
    import cupy as cp

    pts = read_points(pcl_dir / "milk_cartoon_all_small_clorox.pcd")
    n, _ = normals(pts, k=10, device="cpu")
    kp = keypoints(pts, radius=0.03, device="cpu")
    dc, fc = shot(pts, n, kp, 0.02, device="cpu")
    dg, fg = shot(cp.asarray(pts), cp.asarray(n), cp.asarray(kp), 0.02)
    _compare(dc, fc, cp.asnumpy(dg), cp.asnumpy(fg), "kinect exact")
    ac, afc = shot(pts, n, kp, 0.02, approximate=True, device="cpu")
    ag, afg = shot(cp.asarray(pts), cp.asarray(n), cp.asarray(kp), 0.02, approximate=True)
    _compare(ac, afc, cp.asnumpy(ag), cp.asnumpy(afg), "kinect approximate")
