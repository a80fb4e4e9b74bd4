"""E57 scans (issue 41, item 2): every scan of an E57 file is a store scan of its own, its points in
its own frame as the file stores them (bit-exact), its pose (4x4) mapping them into the file's
common frame, intensity, colour and the scanner grid (``pixel_index``) kept, invalid points
dropped; a truncated file is quarantined with one line and the batch goes on. The files are
written here with pye57; poses are checked against scipy's quaternion conversion."""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from _userpath import ok, sf
from scipy.spatial.transform import Rotation

from scanforest.tasks.ingest import Source, discover, ingest_files, part_scan_id
from scanforest.tasks.readers import E57_NEEDS_PYE57, read_cloud, scan_parts
from scanforest.tasks.store import MAX_ID_BYTES, ScanStore

pye57 = pytest.importorskip("pye57")

ROWS, COLS = 6, 9  # a small scanner grid: 54 points per scan
#: (w, x, y, z) rotation and translation of each scan of the three-scan file
POSES = [(Rotation.from_euler("zyx", [30, -10, 5], degrees=True), np.array([12.5, -3.25, 1.75])),
         (Rotation.from_euler("zyx", [-75, 20, 0], degrees=True), np.array([-4.0, 8.5, 0.5])),
         (Rotation.from_euler("x", 90, degrees=True), np.array([0.0, 0.0, 100.0]))]


@pytest.fixture(scope="module")
def env(prefect_api) -> dict[str, str]:
    """This test process's environment, its Prefect API included (conftest's ``prefect_api``: a
    user with a server)."""
    return {**os.environ, "PREFECT_API_URL": prefect_api}


def _wxyz(rot: Rotation) -> np.ndarray:
    x, y, z, w = rot.as_quat()
    return np.array([w, x, y, z])


def _matrix(rot: Rotation, t: np.ndarray) -> np.ndarray:
    m = np.eye(4)
    m[:3, :3], m[:3, 3] = rot.as_matrix(), t
    return m


CRS = 'PROJCS["ETRS89 / UTM zone 32N",AUTHORITY["EPSG","25832"]]'


@contextmanager
def _double_precision(crs: str = ""):
    """pye57's writer declares coordinates single precision; a file of float64 coordinates is
    written with its E57_SINGLE read as E57_DOUBLE. ``crs``: the file's coordinateMetadata, which
    pye57 writes empty (the only empty string of its file header)."""
    from pye57 import e57 as module
    from pye57 import libe57

    class Double:
        def __getattr__(self, name):
            return libe57.E57_DOUBLE if name == "E57_SINGLE" else getattr(libe57, name)

        @staticmethod
        def StringNode(imf, value=""):  # noqa: N802 (libE57's name)
            return libe57.StringNode(imf, value or crs)

    saved = module.libe57
    module.libe57 = Double()
    try:
        yield
    finally:
        module.libe57 = saved


def _scan(rng, xyz: np.ndarray, invalid: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """pye57 fields of a ROWS x COLS grid scan of ``xyz`` (row-major), with intensity and colour."""
    n = len(xyz)
    data = {"cartesianX": xyz[:, 0].copy(), "cartesianY": xyz[:, 1].copy(), "cartesianZ": xyz[:, 2].copy(),
            "intensity": rng.random(n).astype(np.float32),
            "colorRed": rng.integers(0, 256, n).astype(np.uint8),
            "colorGreen": rng.integers(0, 256, n).astype(np.uint8),
            "colorBlue": rng.integers(0, 256, n).astype(np.uint8),
            "rowIndex": (np.arange(n) // COLS).astype(np.uint16),
            "columnIndex": (np.arange(n) % COLS).astype(np.uint16)}
    if invalid is not None:
        data["cartesianInvalidState"] = invalid.astype(np.int8)
    return data


def _site(path: Path, rng) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """A three-scan file (float64 coordinates): scans 0 and 1 see one object (``world``) from two
    stations, each in its own frame; scan 2 has invalid points. Returns the scans and the object."""
    n = ROWS * COLS
    world = rng.normal(size=(n, 3)) * 5.0 + np.array([100.0, 200.0, 10.0])
    scans = []
    for i, (rot, t) in enumerate(POSES):
        local = rot.inv().apply(world - t) if i < 2 else rng.normal(size=(n, 3))
        invalid = None if i < 2 else np.where(rng.random(n) < 0.25, rng.choice([1, 2], n), 0)
        scans.append(_scan(rng, local, invalid))
    with _double_precision(CRS), pye57.E57(str(path), mode="w") as e57:
        for i, (data, (rot, t)) in enumerate(zip(scans, POSES)):
            e57.write_scan_raw(data, name=f"station {i}", rotation=_wxyz(rot), translation=t)
    return scans, world


def _single(path: Path, rng) -> dict[str, np.ndarray]:
    """A one-scan file in pye57's default single precision, no pose given (identity)."""
    data = {k: v for k, v in _scan(rng, rng.normal(size=(ROWS * COLS, 3)) * 3).items()}
    with pye57.E57(str(path), mode="w") as e57:
        e57.write_scan_raw(data, name="only")
    return data


def _valid(data) -> np.ndarray:
    return data.get("cartesianInvalidState", np.zeros(len(data["cartesianX"]))) == 0


def _xyz(data, dtype=np.float64) -> np.ndarray:
    return np.stack([data["cartesianX"], data["cartesianY"], data["cartesianZ"]], 1).astype(dtype)[_valid(data)]


def _truncated(src: Path, dst: Path) -> Path:
    raw = src.read_bytes()
    dst.write_bytes(raw[: len(raw) * 2 // 3])
    return dst


def test_reader_scans_poses_and_fields(tmp_path, rng):
    """read_cloud per part: bit-exact points in the scan's frame, the file's float type, the pose
    as written, intensity/colour/grid of the valid points, invalid points dropped."""
    scans, _ = _site(tmp_path / "site.e57", rng)
    assert scan_parts(tmp_path / "site.e57") == ["scan000", "scan001", "scan002"]
    for i, data in enumerate(scans):
        cloud = read_cloud(tmp_path / "site.e57", part=f"scan{i:03d}")
        valid = _valid(data)
        assert cloud.points.dtype == np.float64 and np.array_equal(cloud.points, _xyz(data))
        np.testing.assert_allclose(np.array(cloud.meta["pose"]), _matrix(*POSES[i]), rtol=0, atol=1e-15)
        assert np.array_equal(np.array(cloud.meta["pose"])[:3, 3], POSES[i][1])
        assert np.array_equal(cloud.intensity, data["intensity"][valid])
        rgb = np.stack([data["colorRed"], data["colorGreen"], data["colorBlue"]], 1)[valid]
        assert cloud.colors.dtype == np.uint8 and np.array_equal(cloud.colors, rgb)
        assert np.array_equal(cloud.pixel_index, np.flatnonzero(valid))  # row-major into COLS x ROWS
        assert (cloud.meta["width"], cloud.meta["height"], cloud.meta["organized"]) == (COLS, ROWS, True)
        assert cloud.meta["e57"]["name"] == f"station {i}" and cloud.meta["e57"]["guid"].startswith("{")
        assert cloud.meta["n_source_points"] == ROWS * COLS and cloud.meta["crs"] == CRS
    assert 0 < len(read_cloud(tmp_path / "site.e57", part="scan002")) < ROWS * COLS
    in_memory = read_cloud("member/site.e57", (tmp_path / "site.e57").read_bytes(), part="scan001")  # archive bytes
    assert np.array_equal(in_memory.points, _xyz(scans[1]))
    with pytest.raises(Exception, match="holds 3 scans"):
        read_cloud(tmp_path / "site.e57")
    single = _single(tmp_path / "one.e57", rng)
    cloud = read_cloud(tmp_path / "one.e57")  # one scan: no part needed; single precision stays float32
    assert cloud.points.dtype == np.float32 and np.array_equal(cloud.points, _xyz(single, np.float32))
    assert np.array_equal(np.array(cloud.meta["pose"]), np.eye(4)) and "crs" not in cloud.meta


def test_ingest_one_store_scan_per_e57_scan_and_a_truncated_file(tmp_path, rng):
    """One store scan per E57 scan (ids ``<file id>__scanNNN``), bit-exact points, poses, fields;
    a truncated copy quarantined with one line, the rest of the batch ingested; a rerun skips."""
    src = tmp_path / "src"
    src.mkdir()
    scans, world = _site(src / "site.e57", rng)
    single = _single(src / "one.e57", rng)
    _truncated(src / "site.e57", src / "cut.e57")
    sources, problems = discover(src, tmp_path / "staging")
    assert [s.scan_id for s in sources] == ["cut.e57", "one.e57", "site.e57"] and not problems
    store = tmp_path / "s.zarr"
    ScanStore(store, create=True)
    recs = ingest_files(str(store), sources, run="r1")
    assert [r["status"] for r in recs] == ["quarantined", "ingested", "ingested"], recs
    assert "\n" not in recs[0]["reason"] and recs[0]["reason"].startswith("truncated E57 file"), recs[0]
    assert [s["scan_id"] for s in recs[2]["scans"]] == ["site.e57__scan000", "site.e57__scan001", "site.e57__scan002"]
    st = ScanStore(store, mode="r")
    assert st.scans() == ["one.e57__scan000", "site.e57__scan000", "site.e57__scan001", "site.e57__scan002"]
    (q,) = st.quarantined()
    assert q["source"] == str(src / "cut.e57") and q["id"] == "cut.e57" and "\n" not in q["reason"]

    assert np.array_equal(st.read("one.e57__scan000"), _xyz(single, np.float32))
    assert st.read("one.e57__scan000").dtype == np.float32
    for i, data in enumerate(scans):
        sid = f"site.e57__scan{i:03d}"
        a = st.attrs(sid)
        valid = _valid(data)
        pts = st.read(sid)
        assert pts.dtype == np.float64 and np.array_equal(pts, _xyz(data)), sid
        pose = np.array(a["pose"], dtype=np.float64)
        assert pose.shape == (4, 4) and np.array_equal(pose[3], [0, 0, 0, 1])
        assert np.array_equal(pose[:3, 3], POSES[i][1])
        np.testing.assert_allclose(pose, _matrix(*POSES[i]), rtol=0, atol=1e-15)
        assert "common frame" in a["pose_maps"] and a["format"] == "e57" and a["source"] == str(src / "site.e57")
        assert a["e57"]["name"] == f"station {i}" and a["e57"]["scan_index"] == i and a["e57"]["scan_count"] == 3
        assert a["e57"]["guid"].startswith("{") and a["n_source_points"] == ROWS * COLS and a["crs"] == CRS
        assert np.array_equal(st.read(sid, "intensity"), data["intensity"][valid])
        rgb = np.stack([data["colorRed"], data["colorGreen"], data["colorBlue"]], 1)[valid]
        assert np.array_equal(st.read(sid, "colors"), rgb)
        assert np.array_equal(st.read(sid, "pixel_index"), (data["rowIndex"] * COLS + data["columnIndex"])[valid])
        assert (a["width"], a["height"]) == (COLS, ROWS)
    assert len(st.read("site.e57__scan002")) == int(_valid(scans[2]).sum()) < ROWS * COLS

    # the two stations' scans of one object, each through its stored pose, land in one frame
    common = []
    for sid in ("site.e57__scan000", "site.e57__scan001"):
        pose = np.array(st.attrs(sid)["pose"])
        common.append(st.read(sid) @ pose[:3, :3].T + pose[:3, 3])
    assert not np.allclose(st.read("site.e57__scan000"), st.read("site.e57__scan001"), atol=1e-3)
    assert np.abs(common[0] - common[1]).max() < 1e-9 and np.abs(common[0] - world).max() < 1e-9
    # an object's detection in each station's scan (in that scan's frame) is exported at one pose:
    # the file's common frame (both were exported in their own scan's frame)
    from scanforest.tasks.recognize import detections_table

    W = _matrix(Rotation.from_euler("z", 40, degrees=True), np.array([3.0, -2.0, 0.5]))
    rw = ScanStore(store)
    for sid in ("site.e57__scan000", "site.e57__scan001"):
        in_scan = np.linalg.inv(np.array(st.attrs(sid)["pose"])) @ W
        rw.write_stage(sid, "recognize", {"det_model": np.zeros(1, np.int32)},
                       {"detections": [{"model_id": 0, "model": "m", "score": 1.0, "inliers": 9, "pose": in_scan.tolist()}]})
    df = detections_table(str(store), ["site.e57__scan000", "site.e57__scan001"])
    poses = df[[f"pose_{r}{c}" for r in range(3) for c in range(4)]].to_numpy().reshape(2, 3, 4)
    assert np.abs(poses - W[:3]).max() < 1e-9 and set(df["source"]) == {str(src / "site.e57")}

    again = ingest_files(str(store), sources, run="r2")
    assert [r["status"] for r in again] == ["quarantined", "skipped", "skipped"]


def test_without_pye57_an_e57_file_is_quarantined_with_the_hint(tmp_path, rng, monkeypatch):
    _single(tmp_path / "one.e57", rng)
    monkeypatch.setitem(sys.modules, "pye57", None)  # import pye57 fails as where it is not installed
    store = tmp_path / "s.zarr"
    ScanStore(store, create=True)
    (rec,) = ingest_files(str(store), [Source(str(tmp_path / "one.e57"), "one.e57")])
    assert rec["status"] == "quarantined" and rec["reason"] == E57_NEEDS_PYE57
    assert ScanStore(store, mode="r").quarantined()[0]["reason"] == E57_NEEDS_PYE57


def test_part_ids_stay_within_the_id_rules():
    assert part_scan_id("site.e57", "scan000") == "site.e57__scan000"
    assert part_scan_id("a_b~112a501093a05b03.e57", "scan001") == "a_b~112a501093a05b03.e57__scan001"
    long = "a" * (MAX_ID_BYTES - 4) + ".e57"
    ids = {part_scan_id(long, f"scan{i:03d}") for i in range(3)}
    assert len(ids) == 3 and all(len(i) <= MAX_ID_BYTES and "~" in i for i in ids)


def test_ingest_command_on_an_e57_folder(tmp_path, rng, env):
    """``scanforest ingest`` in a subprocess: the three scans stored, the truncated copy quarantined."""
    src = tmp_path / "src"
    src.mkdir()
    _site(src / "site.e57", rng)
    _truncated(src / "site.e57", src / "cut.e57")
    store = tmp_path / "s.zarr"
    summary = json.loads(ok(sf("ingest", str(src), str(store), "--workers", "1", "--json", env=env, cwd=tmp_path)))
    assert (summary["ingested"], summary["quarantined"]) == (1, 1), summary
    (reason,) = summary["quarantine_reasons"]
    assert reason["source"].endswith("cut.e57") and reason["reason"].startswith("truncated E57 file")
    st = ScanStore(store, mode="r")
    assert st.scans() == ["site.e57__scan000", "site.e57__scan001", "site.e57__scan002"]
