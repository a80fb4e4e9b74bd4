"""LAS/LAZ above the block budget, COPC files and E57 scans, read and stored block by block (issue
41, item 3): the same points (bit for bit) and attributes as the whole-file path, an interrupted
write left invisible and replaced by the next ingest, COPC queries against laspy's own
``CopcReader.query``, and the query's place in the up-to-date check."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from _copc import write_copc
from scanforest.kernels.errors import InputError
from scanforest.tasks import las as las_mod
from scanforest.tasks import readers
from scanforest.tasks.blocks import gather_blocks
from scanforest.tasks.ingest import Source, ingest_file
from scanforest.tasks.store import ScanStore
from scanforest.tasks.store import scans as store_scans

laspy = pytest.importorskip("laspy")

N = 2500  # over the budget of 1,000 below: blocks of 512 rows, chunks of 256


def _write_las(path, rng, n=N, *, wide_colour_at=None):
    h = laspy.LasHeader(point_format=3, version="1.2")
    h.scales, h.offsets = [0.001] * 3, [600_000.0, 5_000_000.0, 20.0]
    # extra bytes as scanners write them: a plain one and a scaled one of three values a point
    h.add_extra_dims([laspy.ExtraBytesParams(name="Reflectance", type=np.float32),
                      laspy.ExtraBytesParams(name="Deviation Amp", type="3u2", scales=np.full(3, 0.5),
                                             offsets=np.zeros(3))])
    las = laspy.LasData(h)
    las["Reflectance"] = rng.normal(size=n).astype(np.float32)
    las["Deviation Amp"] = rng.integers(0, 100, (n, 3)) * 0.5
    las.x = 600_000 + rng.uniform(0, 50, n)
    las.y = 5_000_000 + rng.uniform(0, 50, n)
    las.z = 20 + rng.uniform(0, 5, n)
    las.intensity = rng.integers(0, 65536, n)
    las.classification = rng.integers(0, 32, n)
    rgb = rng.integers(0, 256, (n, 3))
    if wide_colour_at is not None:  # one 16-bit value late in the file: every colour takes its high byte
        rgb[wide_colour_at, 1] = 51_000
    las.red, las.green, las.blue = rgb.T
    las.write(path)
    return las


@pytest.fixture
def small_budget(monkeypatch):
    monkeypatch.setattr(las_mod, "LAS_WHOLE_MAX_POINTS", 1000)
    monkeypatch.setattr(las_mod, "LAS_BLOCK_POINTS", 512)
    monkeypatch.setattr(store_scans, "CHUNK_ROWS", 256)


def _ingest(store, path, **kw):
    if not ScanStore.exists(store):
        ScanStore(store, create=True)
    return ingest_file(str(store), Source(str(path), path.name), **kw)


def _same_scan(a: ScanStore, b: ScanStore, sid: str):
    assert a.arrays(sid) == b.arrays(sid)
    for name in a.arrays(sid):
        x, y = a.read(sid, name), b.read(sid, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    skip = {"ingested_at", "ingest_run"}
    ta, tb = ({k: v for k, v in s.attrs(sid).items() if k not in skip} for s in (a, b))
    assert ta == tb


@pytest.mark.parametrize("wide", [None, 2100], ids=["8-bit colour", "16-bit colour in a late block"])
def test_las_over_the_budget_is_stored_in_blocks_as_the_whole_file_path_stores_it(tmp_path, rng, monkeypatch, wide):
    las = _write_las(tmp_path / "big.laz", rng, wide_colour_at=wide)
    whole = _ingest(tmp_path / "whole.zarr", tmp_path / "big.laz")  # the default budget: read whole
    monkeypatch.setattr(las_mod, "LAS_WHOLE_MAX_POINTS", 1000)
    monkeypatch.setattr(las_mod, "LAS_BLOCK_POINTS", 512)
    monkeypatch.setattr(store_scans, "CHUNK_ROWS", 256)
    calls = []
    real = ScanStore.write_scan_blocks

    def spy(self, scan_id, blocks, *a, **kw):
        blocks = list(blocks)
        calls.append(blocks)
        return real(self, scan_id, iter(blocks), *a, **kw)

    monkeypatch.setattr(ScanStore, "write_scan_blocks", spy)
    rec = _ingest(tmp_path / "blocks.zarr", tmp_path / "big.laz")
    assert whole["status"] == rec["status"] == "ingested" and rec["points"] == N
    assert len([b for b in calls[0] if isinstance(b, dict)]) == 5  # 2500 rows in blocks of 512
    assert any(isinstance(b, tuple) for b in calls[0]) == (wide is not None)  # the colour correction
    a, b = ScanStore(tmp_path / "whole.zarr"), ScanStore(tmp_path / "blocks.zarr")
    _same_scan(a, b, "big.laz")
    # georeferenced: both paths take the file's header offset as the scan's local origin
    assert b.attrs("big.laz")["origin"] == [600_000.0, 5_000_000.0, 20.0]
    assert b._scan("big.laz")["points"].nchunks == 10  # chunks of 256 rows
    # against laspy itself: float64 scaled coordinates, bit for bit; the colours' rule
    pts = b.read("big.laz")
    assert np.array_equal(pts, np.stack([las.x, las.y, las.z], axis=1))
    rgb = np.stack([las.red, las.green, las.blue], axis=1)
    expect = (rgb >> 8) if wide is not None else rgb
    assert np.array_equal(b.read("big.laz", "colors"), expect.astype(np.uint8))
    # the extra bytes kept (they were dropped), scaled ones as laspy scales them
    assert np.array_equal(b.read("big.laz", "extra_reflectance"), np.asarray(las["Reflectance"]))
    dev = b.read("big.laz", "extra_deviation_amp")
    assert dev.shape == (N, 3) and np.array_equal(dev, np.asarray(las["Deviation Amp"]))
    assert _ingest(tmp_path / "blocks.zarr", tmp_path / "big.laz")["status"] == "skipped"


def test_interrupted_block_write_is_invisible_and_replaced(tmp_path, rng, monkeypatch, small_budget):
    _write_las(tmp_path / "big.las", rng)
    store = tmp_path / "s.zarr"
    real = las_mod.las_columns
    seen = []

    def failing(record, dims):
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt  # a kill in the middle of the third block
        return real(record, dims)

    monkeypatch.setattr(las_mod, "las_columns", failing)
    with pytest.raises(KeyboardInterrupt):
        _ingest(store, tmp_path / "big.las")
    st = ScanStore(store)
    assert st.scans() == [] and st.scans(include_incomplete=True) == ["big.las"]
    with pytest.raises(InputError, match="incomplete"):
        st.read("big.las")
    monkeypatch.setattr(las_mod, "las_columns", real)
    assert _ingest(store, tmp_path / "big.las")["status"] == "ingested"
    st = ScanStore(store)
    assert st.scans() == ["big.las"] and st.read("big.las").shape == (N, 3)
    assert st.verify() == []


def test_truncated_laz_found_midway_is_quarantined(tmp_path, rng, small_budget):
    _write_las(tmp_path / "big.laz", rng)
    data = (tmp_path / "big.laz").read_bytes()
    (tmp_path / "cut.laz").write_bytes(data[: len(data) * 2 // 3])
    rec = _ingest(tmp_path / "s.zarr", tmp_path / "cut.laz")
    st = ScanStore(tmp_path / "s.zarr")
    assert rec["status"] == "quarantined" and "cut.laz" not in st.scans()
    # no orphan: the partial arrays written before the cut are removed (check found an
    # "interrupted write" right after a clean ingest, and a rerun left it)
    assert st.scans(include_incomplete=True) == [] and st.verify() == []
    assert not (tmp_path / "s.zarr" / "scans" / "cut.laz").exists()


def test_write_scan_blocks_keeps_the_promise(tmp_path):
    st = ScanStore(tmp_path / "s.zarr", create=True)
    cols = {"points": (np.float64, (3,)), "intensity": (np.float32, ())}
    block = {"points": np.zeros((4, 3)), "intensity": np.zeros(4, np.float32)}
    with pytest.raises(ValueError, match="gave 4 rows, 6 were promised"):
        st.write_scan_blocks("a", [block], 6, cols, {"n_points": 6})
    with pytest.raises(ValueError, match="float32"):
        st.write_scan_blocks("a", [{**block, "intensity": np.zeros(4)}], 4, cols, {})
    assert st.scans() == [] and st.scans(include_incomplete=True) == ["a"]
    st.write_scan_blocks("a", [block, block], 10, cols, lambda: {"n_points": 8}, at_most=True)
    assert st.scans() == ["a"] and st.read("a").shape == (8, 3) and st.attrs("a")["n_points"] == 8
    assert st.attrs("a")["arrays"]["intensity"] == {"shape": [8], "dtype": "float32"} and st.verify() == []


# ------------------------------------------------------------------------------------------ COPC


@pytest.fixture
def copc_file(tmp_path, rng):
    n = 3000
    xyz = np.round(rng.uniform([100, 200, 5], [110, 215, 9], (n, 3)), 2)
    write_copc(tmp_path / "site.copc.laz", xyz, intensity=rng.integers(0, 60000, n),
               rgb=rng.integers(0, 65536, (n, 3)), classification=rng.integers(0, 30, n))
    return tmp_path / "site.copc.laz"


def _query(path, **kw):
    """laspy's own answer, the reference."""
    with laspy.CopcReader.open(str(path)) as r:
        p = r.query(**kw)
    return np.stack([p.x, p.y, p.z], axis=1), p


def test_copc_full_cloud_and_queries_match_laspy(tmp_path, copc_file):
    full, rec = _query(copc_file)
    assert len(full) == 3000
    cloud = readers.read_cloud(copc_file)
    assert cloud.meta["format"] == "copc" and np.array_equal(cloud.points, full)
    assert np.array_equal(cloud.intensity, np.asarray(rec.intensity, np.float32))
    assert np.array_equal(cloud.colors, (np.stack([rec.red, rec.green, rec.blue], 1) >> 8).astype(np.uint8))
    assert np.array_equal(cloud.extra["classification"], np.asarray(rec.classification))
    from laspy.copc import Bounds

    box = [100, 200, 5, 104, 205, 9]
    cases = [({}, {}), ({"level": 1}, {"level": range(0, 2)}), ({"resolution": 1.0}, {"resolution": 1.0}),
             ({"bounds": ",".join(map(str, box))}, {"bounds": Bounds(mins=np.array(box[:3], float),
                                                                    maxs=np.array(box[3:], float))}),
             ({"level": 0, "bounds": box}, {"level": 0, "bounds": Bounds(mins=np.array(box[:3], float),
                                                                         maxs=np.array(box[3:], float))})]
    for ours, theirs in cases:
        scan = readers.open_blocks(copc_file, copc=ours, block_points=300)  # several nodes a block
        got = gather_blocks(scan)["points"]
        assert np.array_equal(got, _query(copc_file, **theirs)[0]), ours
        assert scan.n_kept == len(got) and 0 < len(got) <= 3000


def test_copc_ingest_records_its_query_in_the_up_to_date_check(tmp_path, copc_file, monkeypatch):
    monkeypatch.setattr(las_mod, "LAS_BLOCK_POINTS", 300)
    store = tmp_path / "s.zarr"
    sid = copc_file.name
    assert _ingest(store, copc_file)["status"] == "ingested"
    assert _ingest(store, copc_file)["status"] == "skipped"
    st = ScanStore(store)
    assert st.attrs(sid)["copc"] == {"level": None, "resolution": None, "bounds": None}
    assert np.array_equal(st.read(sid), _query(copc_file)[0])
    rec = _ingest(store, copc_file, copc={"level": 1})  # other settings: not a silent no-op
    assert rec["status"] == "ingested" and rec["points"] == len(_query(copc_file, level=range(0, 2))[0])
    assert _ingest(store, copc_file, copc={"level": 1})["status"] == "skipped"
    rec = _ingest(store, copc_file, copc={"bounds": "100,200,5,104,205,9"})
    st = ScanStore(store)
    assert rec["status"] == "ingested" and st.attrs(sid)["n_points"] == rec["points"] == st.read(sid).shape[0]
    assert st.attrs(sid)["copc"]["bounds"] == [100, 200, 5, 104, 205, 9] and st.verify() == []
    assert _ingest(store, copc_file)["status"] == "ingested"  # back to the full cloud
    rec = _ingest(store, copc_file, copc={"bounds": "0,0,0,1,1,1"})  # a tile outside the region: not a bad file
    assert rec["status"] == "outside" and "no point inside the COPC query's bounds" in rec["reason"], rec
    assert ScanStore(store).quarantined() == [] and st.read(sid).shape[0] == len(_query(copc_file)[0])


def test_copc_settings_are_checked():
    assert las_mod.copc_settings() == {"level": None, "resolution": None, "bounds": None}
    assert las_mod.copc_settings(level=2, bounds="1,2,3,4,5,6")["bounds"] == [1, 2, 3, 4, 5, 6]
    for bad in ({"level": 1, "resolution": 0.5}, {"level": -1}, {"resolution": 0}, {"bounds": "1,2,3"},
                {"bounds": "4,5,6,1,2,3"}, {"bounds": "a,b,c,d,e,f"}):
        with pytest.raises(InputError):
            las_mod.copc_settings(**bad)


# ------------------------------------------------------------------------------------------ E57


@pytest.mark.parametrize("nan_at", [[130, 131, 190, 220], []], ids=["NaN in blocks 3 and 4", "no NaN"])
def test_e57_scan_with_nan_points_is_stored_in_blocks_as_read_whole(tmp_path, rng, monkeypatch, nan_at):
    """An E57 scan without a grid whose first non-finite point comes after two blocks: the kept
    points and their ``pixel_index`` (places among the valid points) as the whole-file reading
    gives them (:func:`readers._finalise`'s rule), and as numpy says. pye57 writes no NaN
    coordinate (its bounds fail), so the NaNs are put into the blocks as libE57 gives them."""
    pye57 = pytest.importorskip("pye57")
    n = 300
    xyz = rng.normal(size=(n, 3)) * 4
    invalid = np.where(rng.random(n) < 0.2, 1, 0).astype(np.int8)
    data = {"cartesianX": xyz[:, 0].copy(), "cartesianY": xyz[:, 1].copy(), "cartesianZ": xyz[:, 2].copy(),
            "intensity": rng.random(n).astype(np.float32), "cartesianInvalidState": invalid}
    with pye57.E57(str(tmp_path / "nan.e57"), mode="w") as e57:
        e57.write_scan_raw(data, name="only")
    # nan_at: places among the valid points, in blocks 3 and 4 of 64 rows
    real = readers._E57Scan.blocks

    def with_nans(self):
        at = 0
        for block in real(self):
            m = len(block["points"])
            for i in nan_at:
                if at <= i < at + m:
                    block["points"][i - at, 1] = np.nan
            at += m
            yield block

    monkeypatch.setattr(readers._E57Scan, "blocks", with_nans)
    monkeypatch.setattr(readers, "E57_BLOCK_ROWS", 64)
    whole = readers.read_cloud(tmp_path / "nan.e57", part="scan000")
    rec = _ingest(tmp_path / "s.zarr", tmp_path / "nan.e57")
    assert rec["status"] == "ingested"
    st = ScanStore(tmp_path / "s.zarr")
    sid = "nan.e57__scan000"
    valid = np.stack([data["cartesianX"], data["cartesianY"], data["cartesianZ"]], 1)[invalid == 0]
    keep = np.setdiff1d(np.arange(len(valid)), nan_at)
    pts = st.read(sid)
    assert np.array_equal(pts, whole.points) and np.array_equal(pts, valid[keep].astype(pts.dtype))
    if nan_at:
        assert np.array_equal(st.read(sid, "pixel_index"), keep)
        assert np.array_equal(st.read(sid, "pixel_index"), whole.pixel_index)
    else:  # nothing dropped, no grid: no pixel_index, as read whole
        assert whole.pixel_index is None and "pixel_index" not in st.arrays(sid)
    assert np.array_equal(st.read(sid, "intensity"), whole.intensity)
    assert st.attrs(sid)["n_points"] == len(whole) and st.attrs(sid)["bbox"] == {"min": whole.bbox[0],
                                                                                  "max": whole.bbox[1]}
    assert st.attrs(sid)["dtype"] == str(whole.points.dtype) and st.verify() == []


@pytest.mark.parametrize("version,fmt", [("1.2", 3), ("1.4", 6)])
def test_las_point_count_reads_the_header_as_laspy_does(tmp_path, rng, version, fmt):
    las = laspy.LasData(laspy.LasHeader(point_format=fmt, version=version))
    las.x = las.y = las.z = rng.uniform(0, 1, 777)
    for suffix in (".las", ".laz"):
        las.write(tmp_path / f"a{suffix}")
        with laspy.open(tmp_path / f"a{suffix}") as r:
            assert las_mod.las_point_count(tmp_path / f"a{suffix}") == r.header.point_count == 777
    (tmp_path / "b.las").write_bytes(b"not a LAS file")
    assert las_mod.las_point_count(tmp_path / "b.las") is None and las_mod.las_point_count(tmp_path / "c.las") is None


def test_ingest_command_and_task_pass_the_copc_query_on(tmp_path, copc_file, monkeypatch):
    """``scanforest ingest --copc-level/--copc-resolution/--bounds`` -> run_ingest -> (the flow) ->
    the ingest task -> ingest_files: the query arrives checked; a bad one is refused first."""
    from typer.testing import CliRunner

    import scanforest.flows.ingest as flow_ingest
    from scanforest.deploy.cli import app
    from scanforest.flows.prefect_tasks import ingest_scan

    seen = {}
    monkeypatch.setattr(flow_ingest, "run_ingest", lambda *a, **kw: seen.update(kw) or {"files": 0})
    store = tmp_path / "s.zarr"
    res = CliRunner().invoke(app, ["ingest", str(copc_file.parent), str(store), "--copc-level", "1",
                                   "--bounds", "100,200,5,104,205,9", "--json"])
    assert res.exit_code == 0, res.output
    assert seen["copc"] == {"level": 1, "resolution": None, "bounds": [100, 200, 5, 104, 205, 9]}
    res = CliRunner().invoke(app, ["ingest", str(copc_file.parent), str(store), "--copc-level", "1",
                                   "--copc-resolution", "0.5"])
    assert isinstance(res.exception, InputError) and "not both" in str(res.exception)
    ScanStore(store, create=True)
    (rec,) = ingest_scan.fn(str(store), [Source(str(copc_file), copc_file.name)], copc=seen["copc"])
    assert rec["status"] == "ingested" and ScanStore(store).attrs(copc_file.name)["copc"] == seen["copc"]


def test_the_archive_command_takes_the_copc_query_to_its_ingest(tmp_path, copc_file, monkeypatch):
    """``scanforest archive --copc-level/--bounds`` (as ``ingest`` takes them) -> run_archive ->
    the archive flow -> its ingest: the checked query arrives; a bad one is one line before anything."""
    from typer.testing import CliRunner

    import scanforest.flows.archive as flow_archive
    from scanforest.deploy.cli import app

    src = tmp_path / "src"
    (src / "models").mkdir(parents=True)
    shutil.copy(copc_file, src / "models" / "m.copc.laz")
    seen = {}

    class Stop(Exception):
        pass

    def ingest_flow(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(flow_archive, "ingest_flow", ingest_flow)
    monkeypatch.setattr(flow_archive, "run_archive", lambda **kw: flow_archive.archive_flow.fn(**kw))
    res = CliRunner().invoke(app, ["archive", str(src), str(tmp_path / "s.zarr"), "--copc-level", "1",
                                   "--bounds", "100,200,5,104,205,9"])
    assert isinstance(res.exception, Stop), res.output
    assert seen["copc"] == {"level": 1, "resolution": None, "bounds": [100, 200, 5, 104, 205, 9]}
    res = CliRunner().invoke(app, ["archive", str(src), str(tmp_path / "s.zarr"), "--bounds", "1,2,3"])
    assert isinstance(res.exception, InputError) and "bounds must be 6" in str(res.exception)


@pytest.mark.parametrize("blocks", [False, True], ids=["read whole", "read in blocks"])
def test_a_las_file_cut_short_is_said_so(tmp_path, rng, monkeypatch, blocks):
    """A .las file that ends before the points its header declares was quarantined as laspy's
    "buffer size must be a multiple of element size": the reason says it is cut short, by how
    much, and how many whole points it holds."""
    _write_las(tmp_path / "a.las", rng)
    data = (tmp_path / "a.las").read_bytes()
    (tmp_path / "cut.las").write_bytes(data[:-1000])
    if blocks:
        monkeypatch.setattr(las_mod, "LAS_WHOLE_MAX_POINTS", 1000)
    rec = _ingest(tmp_path / "s.zarr", tmp_path / "cut.las")
    assert rec["status"] == "quarantined", rec
    assert "truncated LAS file: its header declares 2,500 points" in rec["reason"], rec["reason"]
    assert "ends 1,000 bytes short" in rec["reason"]
