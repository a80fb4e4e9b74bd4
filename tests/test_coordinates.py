"""Georeferenced coordinates: a scan in UTM-sized coordinates is computed in a local frame (its
origin, chosen in float64 at ingest or by :func:`scanforest.recognize`) and gives the detections
of the same scene in small coordinates, its poses back in the file's own coordinates.

The reference is independent of the code under test: PCL's real scene, quantised to the LAS
grid (scale 1e-4 m) by laspy's own integer records, recognised in its small coordinates as
before; the georeferenced copy is that scene plus a UTM-sized offset, written by laspy (offset in
the header) and as a float64 array.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from _userpath import fresh_env, ok, one_line_error, sf

OFFSET = np.array([512345.0, 4123456.0, 87.0])
SCALE = 1e-4
SCENE = "milk_cartoon_all_small_clorox.pcd"
#: measured on PCL's scene (API and CLI alike): the georeferenced copy's pose differs from the
#: reference's by 2.0e-7 (rotation entries) and 1.9e-7 m (translation, less the offset); the
#: bounds are 25x that, for other CPUs' float32 rounding, and well inside the 1e-4 asked for
ROT_TOL, TRA_TOL = 5e-6, 5e-6


@pytest.fixture(scope="module")
def geo(pcl_dir, tmp_path_factory):
    """The georeferenced scene as a LAS file and a float64 NPY, the reference scene (the same
    points in small coordinates, float64 NPY), the library of PCL's milk model and the
    reference detections."""
    import laspy
    import scanforest as sf

    folder = tmp_path_factory.mktemp("geo")
    P = sf.read(pcl_dir / SCENE).points.astype(np.float64)
    header = laspy.LasHeader(point_format=0, version="1.2")
    header.offsets, header.scales = OFFSET, np.full(3, SCALE)
    las = laspy.LasData(header)
    las.x, las.y, las.z = (P[:, i] + OFFSET[i] for i in range(3))
    las.write(folder / "scene_utm.las")
    back = laspy.read(folder / "scene_utm.las")
    ints = np.stack([np.asarray(back.X), np.asarray(back.Y), np.asarray(back.Z)], axis=1).astype(np.float64)
    ref = ints * SCALE  # the scene on the LAS grid, in small coordinates
    geo64 = np.stack([np.asarray(back.x), np.asarray(back.y), np.asarray(back.z)], axis=1)
    assert np.abs(geo64 - OFFSET - ref).max() < 1e-8  # laspy: x = X * scale + offset
    np.save(folder / "scene_ref.npy", ref)
    np.save(folder / "scene_utm.npy", ref + OFFSET)
    model = sf.read(pcl_dir / "milk.pcd").points
    lib = sf.ModelLibrary.build([model], names=["milk"], device="cpu")
    want = sf.recognize(ref, lib, device="cpu")
    assert len(want) == 1 and want[0].model == "milk"  # the tutorial's detection, as in small coordinates
    return {"folder": folder, "las": folder / "scene_utm.las", "geo64": geo64, "ref": ref, "lib": lib,
            "want": want}


def _same(got, want, offset=OFFSET):
    name = lambda d: (d.model if hasattr(d, "model") else d["model"]).split(".")[0]  # noqa: E731 - "milk.pcd": the scan
    assert [name(d) for d in got] == [name(d) for d in want]
    for g, w in zip(got, want):
        pose, ref = np.asarray(g.pose if hasattr(g, "pose") else g["pose"], np.float64), np.asarray(w.pose)
        assert pose.dtype == np.float64
        assert np.abs(pose[:3, :3] - ref[:3, :3]).max() < ROT_TOL, (pose, ref)
        assert np.abs(pose[:3, 3] - (ref[:3, 3] + offset)).max() < TRA_TOL, (pose, ref)


def test_api_recognises_georeferenced_float64_points(geo):
    """``sf.recognize`` on float64 UTM points (from the LAS reader and from an array), with the
    file's offset as the origin: the reference detection, its pose in the caller's coordinates.
    Without the local frame the same call finds nothing (float32 spacing ~0.5 m at 4e6 m)."""
    import scanforest as sf
    from scanforest.tasks.readers import read_cloud

    cloud = read_cloud(geo["las"])
    assert cloud.points.dtype == np.float64 and np.array_equal(cloud.points, geo["geo64"])
    got = sf.recognize(cloud.points, geo["lib"], origin=cloud.meta["offsets"], device="cpu")
    _same(got, geo["want"])
    assert got.info["origin"] == OFFSET.tolist()
    got = sf.recognize(geo["ref"] + OFFSET, geo["lib"], origin=OFFSET, device="cpu")
    _same(got, geo["want"])
    # the origin chosen when none is given: the bounding box's centre, rounded to 1 m
    pts = geo["ref"] + OFFSET
    with pytest.warns(UserWarning, match="viewpoint. is relative to it"):
        auto = sf.recognize(pts, geo["lib"], device="cpu", verify=False)
    assert auto.info["origin"] == np.round((pts.min(0) + pts.max(0)) / 2).tolist()


def test_ingest_describe_in_the_local_frame(geo, tmp_path):
    """Ingest keeps the file's coordinates bit-exact and records the origin (the LAS offset; 0
    for small coordinates); the describe stage of the georeferenced scan has the reference's
    keypoints and its descriptors within float32 noise (measured against the reference's own)."""
    from scanforest.tasks.describe import DescribeParams, describe_cloud, describe_scan
    from scanforest.tasks.ingest import Source, ingest_file
    from scanforest.tasks.store import ScanStore

    store = str(tmp_path / "s.zarr")
    ScanStore(store, create=True)
    for name in ("scene_utm.las", "scene_ref.npy"):
        assert ingest_file(store, Source(str(geo["folder"] / name), name))["status"] == "ingested"
    st = ScanStore(store)
    assert st.attrs("scene_utm.las")["origin"] == OFFSET.tolist()
    assert st.attrs("scene_ref.npy")["origin"] == [0.0, 0.0, 0.0]
    assert np.array_equal(st.read("scene_utm.las"), geo["geo64"])  # the file's own coordinates
    params = DescribeParams()
    for sid in ("scene_utm.las", "scene_ref.npy"):
        describe_scan(store, sid, params, device="cpu")
    a, b = (st.read_many(s, ["kp_index", "kp_shot"]) for s in ("scene_utm.las", "scene_ref.npy"))
    assert len(a["kp_index"]) > 100 and np.array_equal(a["kp_index"], b["kp_index"])
    # float32 noise: the georeferenced points come back from float64 one float32 ulp off the
    # reference in ~1% of their coordinates, and normals and SHOT move where a neighbourhood is
    # near-degenerate. The yardstick is the reference itself with as many coordinates moved by
    # one ulp: the shifted description may differ from the reference about as much as that does.
    ref32 = geo["ref"].astype(np.float32)
    moved = int((_local(geo["geo64"]) != ref32).sum())
    assert 0 < moved < 0.05 * ref32.size
    noisy = ref32.copy().reshape(-1)
    idx = np.random.default_rng(1).choice(noisy.size, moved, replace=False)
    noisy[idx] = np.nextafter(noisy[idx], np.float32(np.inf))
    c = describe_cloud(noisy.reshape(-1, 3), params, device="cpu")["arrays"]
    ok_rows = np.isfinite(b["kp_shot"]).all(1)
    assert np.array_equal(ok_rows, np.isfinite(a["kp_shot"]).all(1))

    def rows_off(x):  # per keypoint, the largest descriptor difference from the reference
        return np.abs(np.nan_to_num(x["kp_shot"][ok_rows]) - b["kp_shot"][ok_rows]).max(1)

    # a scan written before origins existed (no attribute) reads as origin 0: described as before
    del st.root["scans"]["scene_ref.npy"].attrs["origin"]
    describe_scan(store, "scene_ref.npy", params, device="cpu", force=True)
    again = st.read_many("scene_ref.npy", ["kp_index", "kp_shot"])
    assert np.array_equal(again["kp_index"], b["kp_index"])
    assert np.array_equal(again["kp_shot"], b["kp_shot"], equal_nan=True)
    shift, noise = rows_off(a), rows_off(c)
    assert np.median(shift) == 0.0
    assert (shift > 1e-5).mean() <= 2 * (noise > 1e-5).mean() + 0.01, ((shift > 1e-5).mean(), (noise > 1e-5).mean())
    assert np.percentile(shift, 99) <= 2 * np.percentile(noise, 99) + 1e-3


def _local(points):
    from scanforest.kernels.coordinates import to_local

    return to_local(points, OFFSET)


def test_archive_command_on_a_georeferenced_laz_folder(prefect_api, geo, pcl_dir, tmp_path, tmp_path_factory):
    """The README's survey archive as a user runs it: ``scanforest archive`` on a folder of the
    model and the scene as a LAZ file in UTM-sized coordinates (its origin the header's offset),
    with a truncated LAZ beside them, and the scene again as a float64 NPY (no offset: the summary
    warns). The truncated file is quarantined with its reason, the
    archive flow (ingest, library, index, one pass) gives the reference detection, stored and
    exported in the file's coordinates. (One command: CI's time; the recognize stage's own path
    on a georeferenced scene is the API tests' above.)"""
    import laspy

    from scanforest.tasks.recognize import detections_table
    from scanforest.tasks.store import ScanStore

    env = fresh_env(tmp_path_factory, cold=False, api=prefect_api)
    src = tmp_path / "survey"
    (src / "models").mkdir(parents=True)
    (src / "scenes").mkdir()
    (src / "models" / "milk.pcd").write_bytes((pcl_dir / "milk.pcd").read_bytes())
    las = laspy.read(geo["las"])
    las.write(src / "scenes" / "tile_utm.laz")  # the same records, LAZ-compressed
    (src / "scenes" / "cut.laz").write_bytes((src / "scenes" / "tile_utm.laz").read_bytes()[:5000])
    (src / "scenes" / "scene_utm.npy").write_bytes(geo["folder"].joinpath("scene_utm.npy").read_bytes())
    store = str(tmp_path / "survey.zarr")
    out = ok(sf("archive", str(src), store, "-w", "1", "--export", str(tmp_path / "out"), env=env, cwd=tmp_path))
    assert "quarantined: " in out and "cut.laz" in out, out
    # the NPY holds no offset: its origin is its box's centre, and the summary says so (the LAZ is not named)
    warned = [ln for ln in out.splitlines() if ln.startswith("warning: ")]
    assert len(warned) == 1 and "1 scene " in warned[0] and "scenes__scene_utm.npy" in warned[0], out
    st = ScanStore(store, mode="r")
    assert st.attrs("scenes__tile_utm.laz")["origin"] == OFFSET.tolist()
    det = st.attrs("scenes__tile_utm.laz")["stages"]["recognize"]["detections"]
    assert [d["model"] for d in det] == ["models__milk.pcd"]  # the model's scan id under models/
    _same([{**d, "model": "milk"} for d in det], geo["want"])
    df = detections_table(store, ["scenes__tile_utm.laz"])  # what the CSV / Parquet exports hold
    assert np.abs(df[["pose_03", "pose_13", "pose_23"]].to_numpy()[0]
                  - (geo["want"][0].pose[:3, 3] + OFFSET)).max() < TRA_TOL
    csv = [ln for ln in (tmp_path / "out" / "detections.csv").read_text().splitlines() if "tile_utm" in ln]
    assert len(csv) == 1 and f"{OFFSET[1]:.0f}"[:4] in csv[0], csv  # the export's translation: file coordinates


def test_coordinates_too_coarse_for_the_radii(prefect_api, tmp_path, tmp_path_factory):
    """A scan 200 km across: float32 spacing in its local frame (~8 mm) is more than 1/100 of
    the radii; the API raises InputError, the CLI says so in one line and exits 2."""
    import scanforest
    from scanforest.kernels.coordinates import check_spacing, choose_origin

    rng = np.random.default_rng(0)
    pts = np.concatenate([rng.uniform(-1, 1, (400, 3)), [[1e5, 0, 0], [-1e5, 0, 0]]]) + OFFSET
    model = rng.uniform(-0.1, 0.1, (300, 3)).astype(np.float32)
    lib = scanforest.ModelLibrary.build([model], names=["m"], device="cpu")
    with pytest.raises(scanforest.InputError, match="float32 spacing"):
        scanforest.recognize(pts, lib, device="cpu")
    assert choose_origin(pts.min(0), pts.max(0)).tolist() == OFFSET.tolist()
    check_spacing(100.0, {"shot_radius": 0.02}, "x")  # 100 m from the origin: fine
    scans = tmp_path / "scans"
    scans.mkdir()
    np.save(scans / "wide.npy", pts)
    env = fresh_env(tmp_path_factory, cold=False, api=prefect_api)
    store = str(tmp_path / "wide.zarr")
    from scanforest.tasks.ingest import Source, ingest_file
    from scanforest.tasks.store import ScanStore

    ScanStore(store, create=True)
    assert ingest_file(store, Source(str(scans / "wide.npy"), "wide.npy"))["status"] == "ingested"
    one_line_error(sf("describe", store, env=env, cwd=tmp_path), "wide.npy", "float32 spacing")
    # beside scans that are fine, it fails alone (a stray point stopped a whole archive, unrecorded)
    np.save(scans / "fine.npy", rng.uniform(-1, 1, (400, 3)))
    assert ingest_file(store, Source(str(scans / "fine.npy"), "fine.npy"))["status"] == "ingested"
    out = ok(sf("describe", store, env=env, cwd=tmp_path), code=1)
    assert re.search(r"failed: wide\.npy: .*float32 spacing", out) and re.search(r"described\s*│\s*1", out), out
    assert ScanStore(store, mode="r").has_stage("fine.npy", "describe")


def test_a_las_grid_as_coarse_as_the_radii_is_refused(geo, tmp_path, capsys):
    """A LAS file written with a 1 cm scale holds PCL's scene on a 1 cm grid: with 2 cm radii it
    gave zero detections and no word. Ingest keeps the grid in the scan's attributes; the run's
    check, the scan's own (describe), the library's and ``shot`` refuse it in one line naming the
    grid and the radius; sampling leaves (keypoint radius) are not measured against it; the
    scene's own 1e-4 m grid passes."""
    import laspy
    from typer.testing import CliRunner

    from scanforest.deploy.cli import app
    from scanforest.kernels.coordinates import check_spacing
    from scanforest.kernels.errors import InputError
    from scanforest.tasks.describe import DescribeParams, describe_scan
    from scanforest.tasks.ingest import Source, ingest_file
    from scanforest.tasks.recognize import build_library
    from scanforest.tasks.store import ScanStore

    header = laspy.LasHeader(point_format=0, version="1.2")
    header.offsets, header.scales = OFFSET, np.full(3, 0.01)
    las = laspy.LasData(header)
    las.x, las.y, las.z = (geo["geo64"][:, i] for i in range(3))
    las.write(tmp_path / "cm.las")
    store = str(tmp_path / "g.zarr")
    st = ScanStore(store, create=True)
    for name in ("cm.las", "scene_utm.las"):
        path = tmp_path / "cm.las" if name == "cm.las" else geo["las"]
        assert ingest_file(store, Source(str(path), name))["status"] == "ingested"
    assert st.attrs("cm.las")["coordinate_grid"] == 0.01 and st.attrs("scene_utm.las")["coordinate_grid"] == 1e-4
    radii = {"keypoint_radius": 0.03, "shot_radius": 0.02, "normal_radius": None}
    with pytest.raises(InputError, match=r"scan cm\.las: its coordinates are stored on a 0\.01 m grid .*shot_radius 0\.02"):
        st.check_coordinates(["cm.las"], radii)
    assert st.check_coordinates(None, radii) == ["cm.las"]  # beside a fine scan: it fails alone
    with pytest.raises(InputError, match="0.01 m grid"):  # the scan's own check: the flow records it as failed
        describe_scan(store, "cm.las", DescribeParams(), device="cpu")
    with pytest.raises(InputError, match="0.01 m grid"):
        build_library(store, ["cm.las"], name="cm")
    check_spacing(1.0, {"keypoint_radius": 0.05, "shot_radius": 0.2}, "x", grid=0.01)  # 1/20 of 0.2: fine
    res = CliRunner().invoke(app, ["shot", str(tmp_path / "cm.las"), "-o", str(tmp_path / "d"), "--device", "cpu"])
    assert res.exit_code != 0 and "0.01 m grid" in str(res.exception or res.output)
    # a grid under the refusal but as coarse as the points' spacing (PCL's scene lost its detection on a
    # 1.2 mm grid, kept it on 1 mm) is named where recognition found nothing
    from scanforest.deploy.cli.core import note_no_detections
    from scanforest.kernels.coordinates import grid_hint

    radii = {"descr_rad": 0.02, "rf_rad": 0.015, "scene_ss": 0.03}
    assert grid_hint(0.0012, radii).startswith("their coordinates lie on a 0.0012 m grid (the file's scale), 1/12 ")
    assert grid_hint(0.0005, radii) is None and grid_hint(None, radii) is None
    assert st.coordinate_grids() == {"cm.las": 0.01, "scene_utm.las": 1e-4}
    nothing = {"recognized": 1, "detections": 0, "funnel": {"keypoints": 900, "correspondences": 0}}
    note_no_detections(nothing, {}, store, ["cm.las"])
    note_no_detections(nothing, {}, store, ["scene_utm.las"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "0.01 m grid" in lines[0] and "grid" not in lines[1], lines


def test_recognize_says_when_a_georeferenced_scene_has_no_file_offset(prefect_api, geo, pcl_dir, tmp_path,
                                                                      tmp_path_factory):
    """A float64 NPY in UTM-sized coordinates holds no offset: ingest centres it on its bounding
    box (rounded to 1 m), where its normals then face, not the scanner. ``scanforest ingest`` and
    ``scanforest recognize`` say so in one line naming the scan; the LAS scene beside it (origin
    at its header's offset) is not named. The same NPY with the scanner's position as ``origin``
    in its sidecar, written after a first ingest, is ingested again about it, not named, and
    gives the LAS scene's detection; a sidecar origin that is not 3 numbers quarantines its scan
    with the reason."""
    from scanforest.tasks.store import ScanStore

    scans = tmp_path / "scans"
    scans.mkdir()
    for name in ("scene_utm.npy", "station.npy", "bad.npy"):
        (scans / name).write_bytes((geo["folder"] / "scene_utm.npy").read_bytes())
    (scans / "scene_utm.las").write_bytes(geo["las"].read_bytes())
    (scans / "milk.pcd").write_bytes((pcl_dir / "milk.pcd").read_bytes())
    store = str(tmp_path / "geo.zarr")
    env = fresh_env(tmp_path_factory, cold=False, api=prefect_api)
    out = ok(sf("ingest", str(scans), store, "-w", "1", env=env, cwd=tmp_path))
    warned = [ln for ln in out.splitlines() if ln.startswith("warning: ")]
    assert len(warned) == 1 and "3 scans " in warned[0] and "(first: bad.npy)" in warned[0], out
    st = ScanStore(store, mode="r")
    assert [st.attrs(s).get("origin_from") for s in ("scene_utm.npy", "station.npy")] == ["box", "box"]
    assert "origin_from" not in st.attrs("scene_utm.las") and "origin_from" not in st.attrs("milk.pcd")
    # the scanner's position given afterwards: the unchanged file is ingested again about it
    (scans / "station.gt.json").write_text(json.dumps({"origin": OFFSET.tolist()}))
    (scans / "bad.gt.json").write_text(json.dumps({"origin": [1.0, "x"]}))
    out = ok(sf("ingest", str(scans), store, "-w", "1", "--json", env=env, cwd=tmp_path))
    summary = json.loads(out[out.index("{"):])
    assert (summary["ingested"], summary["skipped"], summary["quarantined"]) == (1, 3, 1), summary
    assert "box_origin" not in summary, summary
    reason = summary["quarantine_reasons"][0]["reason"]
    assert "bad.gt.json" in reason and "origin must be 3 finite numbers" in reason, reason
    st = ScanStore(store, mode="r")
    assert st.attrs("station.npy")["origin_from"] == "sidecar" and st.attrs("station.npy")["origin"] == OFFSET.tolist()
    out = ok(sf("recognize", store, "--models", "milk.pcd", "--scenes", "scene_utm.npy", "--scenes",
                "scene_utm.las", "--scenes", "station.npy", "-w", "1", env=env, cwd=tmp_path))
    warned = [ln for ln in out.splitlines() if ln.startswith("warning: ")]
    assert len(warned) == 1 and "1 scene " in warned[0] and "scene_utm.npy" in warned[0], out
    st = ScanStore(store, mode="r")
    _same(st.attrs("station.npy")["stages"]["recognize"]["detections"], geo["want"])


def test_which_scans_are_said_to_have_a_box_origin():
    """The warning's rule on a scan's attributes: marked by ingest ("box" yes, "sidecar" no); a
    scan of a store ingested before the mark, by its format (only LAS-family files hold an
    offset) and its origin; never when a viewpoint is given."""
    from scanforest.tasks.recognize import box_origin

    utm = OFFSET.tolist()
    assert box_origin({"format": "npy", "origin": utm, "origin_from": "box"}, {})
    assert not box_origin({"format": "npy", "origin": utm, "origin_from": "sidecar"}, {})
    assert not box_origin({"format": "npy", "origin": utm, "origin_from": "box"}, {"viewpoint": [0.0, 0.0, 1.0]})
    assert box_origin({"format": "xyz", "origin": utm}, {})  # before the mark: no offset in an XYZ file
    assert not box_origin({"format": "laz", "origin": utm}, {})  # its header's offset, most likely
    assert not box_origin({"format": "pcd", "origin": [0.0, 0.0, 0.0]}, {})
    assert not box_origin({"format": "pcd"}, {})  # before origins existed


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_shot_of_a_georeferenced_file_is_computed_in_its_local_frame(geo, tmp_path, device):
    """``scanforest shot`` on the LAS file gives the keypoints and descriptors of the same scene in
    small coordinates (its header offset is the local origin, as ingest takes it): it cast the
    UTM coordinates to float32 (a 0.25-0.5 m grid) and its neighbour search ran for good. A float32
    file of such coordinates is one line naming it."""
    from typer.testing import CliRunner

    from scanforest.deploy.cli import app

    out = {}
    np.save(tmp_path / "local.npy", _local(geo["geo64"]))  # the LAS's points less its offset, as ingest stores them
    for name, path in (("utm", geo["las"]), ("local", tmp_path / "local.npy"), ("ref", geo["folder"] / "scene_ref.npy")):
        res = CliRunner().invoke(app, ["shot", str(path), "-o", str(tmp_path / name), "--radius", "0.02",
                                       "--keypoint-radius", "0.03", "--device", device])
        assert res.exit_code == 0, res.output
        out[name] = [np.load(tmp_path / f"{name}{s}.npy") for s in ("", ".keypoints")]
    (d_utm, k_utm), (d_loc, k_loc), (d_ref, k_ref) = out["utm"], out["local"], out["ref"]
    assert np.array_equal(k_utm, k_loc) and np.array_equal(d_utm, d_loc, equal_nan=True)  # the same frame, exactly
    assert len(k_ref) > 100 and np.array_equal(k_utm, k_ref)
    ok_rows = np.isfinite(d_ref[:, 0])
    assert np.array_equal(np.isfinite(d_utm[:, 0]), ok_rows) and ok_rows.mean() > 0.9
    # and the small-coordinates scene's within float32 noise (a ulp off moves a few near-degenerate ones)
    assert (np.abs(d_utm[ok_rows] - d_ref[ok_rows]).max(axis=1) > 1e-3).mean() < 0.05
    np.save(tmp_path / "coarse.npy", (geo["ref"] + OFFSET).astype(np.float32))
    res = CliRunner().invoke(app, ["shot", str(tmp_path / "coarse.npy"), "-o", str(tmp_path / "c"), "--device", device])
    assert res.exit_code != 0 and "float32 spacing" in str(res.exception or res.output)
