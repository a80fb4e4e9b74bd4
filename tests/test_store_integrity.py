"""Store integrity: concurrent ingests, check/repair, store creation only by ingest, per-item
isolation in discovery (long paths, link loops, files that are not scans)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from scanforest.kernels.errors import InputError
from scanforest.tasks.ingest import discover
from scanforest.tasks.readers import read_cloud, write_cloud
from scanforest.tasks.store import ScanStore, stage_matches


#: the commands report to this test process's Prefect API (conftest's ``prefect_api``: a user with
#: a server), started before them
pytestmark = pytest.mark.usefixtures("prefect_api")


def _cli(*args, cwd=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "scanforest.deploy.cli", *map(str, args)], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(*args, cwd=None):
    proc = _cli(*args, cwd=cwd)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _scans(folder, n, rng):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        write_cloud(folder / f"s{i:03d}.pcd", rng.normal(size=(int(rng.integers(2_000, 5_000)), 3)).astype(np.float32),
                    encoding="binary")
    return sorted(folder.glob("*.pcd"))


def test_two_concurrent_ingests_leave_every_scan_whole(tmp_path, rng):
    files = _scans(tmp_path / "src" / "scans", 40, rng)
    arc = tmp_path / "batch.tar"
    with tarfile.open(arc, "w") as tf:
        for p in files:
            tf.add(p, f"scans/{p.name}")
    store = tmp_path / "s.zarr"
    procs = [_cli("ingest", arc, store, "--workers", "2") for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    st = ScanStore(store, mode="r")
    assert st.scans() == [f"batch__scans__{p.name}" for p in files]
    for p in files:
        np.testing.assert_array_equal(st.read(f"batch__scans__{p.name}"), read_cloud(p).points)
    assert st.verify() == [] and st.quarantined() == []
    assert not (tmp_path / "s.zarr.staging").exists()
    assert len(st.runs()) == 2


def _ingested(tmp_path, rng, n=3):
    files = _scans(tmp_path / "src", n, rng)
    code, out, err = _run("ingest", tmp_path / "src", tmp_path / "s.zarr", "--workers", "1")
    assert code == 0, err
    return files, tmp_path / "s.zarr"


def test_check_finds_repairs_and_reingest_restores(tmp_path, rng):
    files, store = _ingested(tmp_path, rng)
    assert _run("check", store)[0] == 0
    import shutil

    shutil.rmtree(store / "scans" / "s001.pcd" / "points")  # damage a complete scan by hand
    code, out, err = _run("check", store, "--json")
    rep = json.loads(out)
    assert code == 1 and [(p["scan_id"], p["problem"]) for p in rep["problems"]] == [("s001.pcd", "damaged")]
    assert "points" in rep["problems"][0]["detail"]
    assert "s001.pcd" in ScanStore(store, mode="r").info()["damaged"]
    code, out, err = _run("check", store)
    assert code == 1 and "s001.pcd" in out and "damaged" in out
    code, out, err = _run("check", store, "--repair")
    assert code == 0, out + err
    assert _run("check", store)[0] == 0
    assert ScanStore(store, mode="r").scans() == ["s000.pcd", "s002.pcd"]
    code, out, err = _run("ingest", tmp_path / "src", store, "--workers", "1")
    assert code == 0, err
    st = ScanStore(store, mode="r")
    for p in files:
        np.testing.assert_array_equal(st.read(p.name), read_cloud(p).points)


def test_reingest_rewrites_damaged_scan_with_same_bytes(tmp_path, rng):
    from scanforest.tasks.ingest import Source, ingest_file

    files, store = _ingested(tmp_path, rng, n=2)
    chunk = store / "scans" / "s000.pcd" / "points" / "c" / "0" / "0"
    chunk.unlink()  # a lost chunk reads back as zeros: the scan must not count as current
    rec = ingest_file(str(store), Source(str(files[0]), "s000.pcd"))
    assert rec["status"] == "ingested"
    np.testing.assert_array_equal(ScanStore(store, mode="r").read("s000.pcd"), read_cloud(files[0]).points)


def test_stage_with_missing_arrays_is_found_and_dropped(tmp_path, rng):
    st = ScanStore(tmp_path / "s.zarr", create=True)
    st.write_scan("a", {"points": rng.normal(size=(20, 3)).astype(np.float32)}, {"n_points": 20})
    st.write_stage("a", "describe", {"kp_index": np.arange(5), "kp_shot": np.ones((5, 352), np.float32)}, {"k": 1})
    st.write_stage("a", "match", {"match_ids": np.zeros((5, 4), np.int64)}, {"k": 4})
    assert st.has_stage("a", "describe") and st.verify() == []
    import shutil

    shutil.rmtree(tmp_path / "s.zarr" / "scans" / "a" / "kp_shot")
    assert [(p["scan_id"], p["problem"]) for p in st.verify()] == [("a", "stage")]
    st.repair()
    assert st.verify() == [] and not st.has_stage("a", "describe") and st.has_stage("a", "match")
    assert "kp_index" not in st.arrays("a") and "points" in st.arrays("a")


def test_read_many_equals_read_and_names_a_missing_array(tmp_path, rng):
    st = ScanStore(tmp_path / "s.zarr", create=True)
    pts = rng.normal(size=(3000, 3)).astype(np.float32)
    st.write_scan("a", {"points": pts}, {"n_points": len(pts)})
    st.write_stage("a", "match", {"match_ids": rng.integers(-1, 9, (700, 4)),
                                  "match_dist": rng.random((700, 4)).astype(np.float32)}, {"k": 4})
    got = st.read_many("a", ["match_dist", "points", "match_ids"])
    assert list(got) == ["match_dist", "points", "match_ids"]
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, st.read("a", name))
        assert arr.dtype == st.read("a", name).dtype
    with pytest.raises(InputError, match="has no array 'kp_shot'"):
        st.read_many("a", ["points", "kp_shot"])
    assert st.stage("a", "match") is not None and stage_matches(st.stage("a", "match"), k=4)
    assert not stage_matches(st.stage("a", "match"), k=2) and not stage_matches(None)


def _chunk_files(array_dir):
    return sorted(p for p in (array_dir / "c").rglob("*") if p.is_file())


def test_a_chunk_cut_short_or_altered_is_found_read_as_one_error_and_repaired(tmp_path, rng):
    """A chunk file cut short (a full disk, a copy stopped) or with one byte altered (the
    store's arrays carry zstd's checksum) is still a chunk file: ``verify`` reads every chunk
    and finds it (``read=False`` does not, as before), a read of it is one error naming the
    scan, the array and the repair, and ``repair`` removes the scan or drops the stage."""
    from scanforest.tasks.store import StoreReadError

    st = ScanStore(tmp_path / "s.zarr", create=True)
    pts = {s: rng.normal(size=(3000, 3)).astype(np.float32) for s in "abc"}
    for s, p in pts.items():
        st.write_scan(s, {"points": p, "intensity": rng.random(len(p)).astype(np.float32)}, {"n_points": len(p)})
    st.write_stage("b", "describe", {"kp_index": np.arange(50), "kp_shot": rng.random((50, 352)).astype(np.float32)},
                   {"k": 1})
    assert st.verify() == []
    cut = _chunk_files(tmp_path / "s.zarr" / "scans" / "a" / "points")[0]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    flip = _chunk_files(tmp_path / "s.zarr" / "scans" / "b" / "kp_shot")[0]
    data = bytearray(flip.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flip.write_bytes(bytes(data))

    assert st.verify(read=False) == []  # the files are all there
    found = {p["scan_id"]: p for p in st.verify()}
    assert set(found) == {"a", "b"} and found["a"]["problem"] == "damaged" and found["b"]["problem"] == "stage"
    assert "'points' rows 0-2999 do not read back" in found["a"]["detail"]
    assert "'kp_shot'" in found["b"]["detail"]
    for read in (lambda: st.read("a"), lambda: st.read_many("a", ["intensity", "points"]), lambda: st.read_cloud("a"),
                 lambda: st.read_many("b", ["kp_index", "kp_shot"])):
        with pytest.raises(StoreReadError) as err:
            read()
        msg = str(err.value)
        assert "cannot be read" in msg and "scanforest check" in msg and "--repair" in msg and len(msg.splitlines()) == 1
        assert ("'a', array 'points'" in msg) or ("'b', array 'kp_shot'" in msg), msg
    assert isinstance(err.value, InputError)  # a user error: a scan's one-line failure, not retried
    np.testing.assert_array_equal(st.read("c"), pts["c"])

    # an array's metadata file cut short: check, info and repair still run (a JSON traceback before)
    meta = tmp_path / "s.zarr" / "scans" / "c" / "intensity" / "zarr.json"
    meta.write_bytes(meta.read_bytes()[:40])
    found = {p["scan_id"]: p for p in st.verify()}
    assert found["c"]["problem"] == "damaged" and "metadata does not read back" in found["c"]["detail"]
    assert st.info()["damaged"] == ["c"]  # info checks the metadata only (a chunk cut short: check)

    done = {p["scan_id"]: p["action"] for p in st.repair()}
    assert set(done) == {"a", "b", "c"} and "removed" in done["a"] and "dropped" in done["b"]
    assert st.verify() == [] and st.scans() == ["b"] and not st.has_stage("b", "describe")
    np.testing.assert_array_equal(st.read("b"), pts["b"])


def test_incomplete_and_leftover_groups_are_found(tmp_path, rng):
    st = ScanStore(tmp_path / "s.zarr", create=True)
    st.write_scan("ok", {"points": np.ones((4, 3), np.float32)}, {"n_points": 4})
    st.root["scans"].create_group("half", attributes={"complete": False})
    (tmp_path / "s.zarr" / "scans" / "junk").mkdir()
    assert {(p["scan_id"], p["problem"]) for p in st.verify()} == {("half", "incomplete"), ("junk", "leftover")}
    import fcntl

    with st.claim("half"):  # create the claim file
        pass
    fd = os.open(tmp_path / "s.zarr" / ".locks" / "scans" / "half.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another writer busy with the scan: not judged, not repaired
    try:
        assert [p["scan_id"] for p in st.verify()] == ["junk"]
        assert [p["scan_id"] for p in st.repair()] == ["junk"]
    finally:
        os.close(fd)
    assert [p["scan_id"] for p in st.repair()] == ["half"]
    assert st.verify() == [] and st.scans() == ["ok"]


def test_the_scan_listing_follows_every_change_of_the_store(tmp_path):
    """The listing parses each scan's zarr.json once per version of the file: a scan completed,
    rewritten, removed or added after a listing is seen by the next one, from this object or
    another, and the local extents follow a rewritten bounding box."""
    import shutil

    path = tmp_path / "s.zarr"
    st = ScanStore(path, create=True)
    pts = np.ones((4, 3), np.float32)
    st.write_scan("a", {"points": pts}, {"n_points": 4, "bbox": {"min": [0, 0, 0], "max": [1, 2, 3]}})
    st.root["scans"].create_group("b", attributes={"complete": False})
    assert st.scans() == ["a"] and st.scans(include_incomplete=True) == ["a", "b"]
    assert st.local_extents() == {"a": 3.0} and "a" in st and "b" not in st and "zz" not in st
    st.root["scans"]["b"].attrs.update({"complete": True})
    other = ScanStore(path, mode="r")
    assert st.scans() == other.scans() == ["a", "b"] and "b" in other
    st.write_scan("a", {"points": pts}, {"n_points": 4, "bbox": {"min": [-5, 0, 0], "max": [1, 2, 3]}})
    assert st.local_extents() == {"a": 5.0}
    shutil.rmtree(path / "scans" / "b")
    st.write_scan("c", {"points": pts}, {"n_points": 4})
    assert other.scans() == ["a", "c"] and st.local_extents() == {"a": 5.0}
    (path / "scans" / "c" / "zarr.json").write_text("{not json")
    with pytest.raises(InputError, match="scan 'c' has an unreadable zarr.json"):
        st.scans()


def test_summaries_handed_by_the_writer_spare_the_listing_and_follow_rewrites(tmp_path, monkeypatch):
    """An ingest's workers hand the flow each scan group's summary (group_summary); the flow's
    next listing then reads no zarr.json, lists the same scans and extents as a cold listing,
    and still reads again a scan rewritten since."""
    import scanforest.tasks.store.scans as S

    path = tmp_path / "s.zarr"
    st = ScanStore(path, create=True)
    pts = np.ones((4, 3), np.float32)
    for i, name in enumerate(("a", "b", "c")):
        st.write_scan(name, {"points": pts}, {"n_points": 4, "bbox": {"min": [0, 0, 0], "max": [1, 2, 3 + i]}})
    st.root["scans"].create_group("d", attributes={"complete": False})
    handed = {n: ScanStore(path, mode="r").group_summary(n) for n in ("a", "b", "c", "d", "missing")}
    assert handed["missing"] is None and handed["d"][3] is False and handed["a"][3:] == [True, 3.0, None]
    S._SUMMARIES.clear()
    ScanStore.remember_summaries(path, handed)
    reads = []
    real = S._summary
    monkeypatch.setattr(S, "_summary", lambda *a: reads.append(a[2]) or real(*a))
    assert st.scans() == ["a", "b", "c"] and st.local_extents() == {"a": 3.0, "b": 4.0, "c": 5.0}
    assert reads == []
    st.write_scan("b", {"points": pts}, {"n_points": 4, "bbox": {"min": [-9, 0, 0], "max": [1, 2, 3]}})
    assert st.local_extents()["b"] == 9.0 and reads == ["b"]
    S._SUMMARIES.clear()
    cold = ScanStore(path, mode="r")
    assert cold.scans(include_incomplete=True) == ["a", "b", "c", "d"] and cold.local_extents()["b"] == 9.0


def test_only_ingest_creates_a_store(tmp_path):
    with pytest.raises(InputError, match=r"^no scan store at .*nope\.zarr \(create one with: scanforest ingest"):
        ScanStore(tmp_path / "nope.zarr")
    assert not (tmp_path / "nope.zarr").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.csv").write_text("1,2,3\n")
    for kw in ({}, {"create": True}, {"mode": "r"}):
        with pytest.raises(InputError, match="not a scanforest scan store"):
            ScanStore(tmp_path / "other", **kw)
    assert sorted(os.listdir(tmp_path / "other")) == ["data.csv"]
    code, out, err = _run("info", tmp_path / "nope.zarr")
    assert code == 2 and err.startswith("error: no scan store at") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "nope.zarr").exists()


@pytest.mark.parametrize("case", ["missing", "empty", "only_notes", "glob_nothing"])
def test_ingest_of_nothing_fails_in_one_line_and_leaves_nothing(tmp_path, case):
    src = {"missing": tmp_path / "nowhere", "empty": tmp_path / "empty", "only_notes": tmp_path / "notes",
           "glob_nothing": tmp_path / "g" / "*.pcd"}[case]
    if case in ("empty", "only_notes", "glob_nothing"):
        src.parent.mkdir(exist_ok=True) if case == "glob_nothing" else src.mkdir()
    if case == "only_notes":
        (src / "README.md").write_text("# scans go here\n")
    code, out, err = _run("ingest", src, "store.zarr", "--workers", "1", cwd=tmp_path)
    assert code == 2 and err.startswith("error: ") and str(src) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "store.zarr").exists() and not (tmp_path / "store.zarr.staging").exists()


def test_relative_store_is_written_where_the_user_is(tmp_path, rng):
    _scans(tmp_path / "src", 2, rng)
    code, out, err = _run("ingest", "src", "rel.zarr", "--workers", "1", cwd=tmp_path)
    assert code == 0, err
    st = ScanStore(tmp_path / "rel.zarr", mode="r")
    assert st.scans() == ["s000.pcd", "s001.pcd"]
    assert st.attrs("s000.pcd")["source"] == str(tmp_path / "src" / "s000.pcd")


def test_discovery_isolates_bad_items(tmp_path, rng):
    src = tmp_path / "src"
    good = _scans(src, 2, rng)
    deep = src / ("d" * 120) / ("e" * 120) / ("f" * 100 + ".pcd")  # relative path ~350 characters
    deep.parent.mkdir(parents=True)
    write_cloud(deep, rng.normal(size=(100, 3)).astype(np.float32))
    os.symlink("loop_b.pcd", src / "loop_a.pcd")
    os.symlink("loop_a.pcd", src / "loop_b.pcd")
    os.symlink("gone.pcd", src / "dangling.pcd")
    (src / "README.md").write_text("scans of the lab\n")
    (src / "notes.txt").write_text("scanned on monday\nsecond pass by bob\n")
    (src / "meta.json").write_text("{}")
    (src / "pts.txt").write_text("x y z\n1 2 3\n4 5 6\n")
    ignored = []
    items, problems = discover(src, tmp_path / "staging", ignored=ignored)
    ids = sorted(s.scan_id for s in items)
    assert len(ids) == 4 and "s000.pcd" in ids and "pts.txt" in ids
    long_id = [i for i in ids if i.startswith("ddd")][0]
    assert len(long_id.encode()) <= 200 and long_id.endswith(".pcd")
    assert {(os.path.basename(p["source"]), p["reason"].split(" (")[0]) for p in problems} == {
        ("loop_a.pcd", "symbolic link loop"), ("loop_b.pcd", "symbolic link loop"),
        ("dangling.pcd", "dangling symbolic link")}
    assert sorted(os.path.basename(i["source"]) for i in ignored) == ["README.md", "meta.json", "notes.txt"]
    # the whole batch through the CLI: every good scan in, the bad links quarantined, notes ignored
    code, out, err = _run("ingest", src, tmp_path / "s.zarr", "--workers", "1")
    assert code == 0, err
    st = ScanStore(tmp_path / "s.zarr", mode="r")
    assert sorted(st.scans()) == ids
    assert st.attrs(long_id)["source"] == str(deep)
    np.testing.assert_array_equal(st.read(long_id), read_cloud(deep).points)
    assert sorted(q["source"].rsplit("/", 1)[-1] for q in st.quarantined()) == ["dangling.pcd", "loop_a.pcd", "loop_b.pcd"]
    assert "ignored 3 file(s)" in err


def test_glob_through_folder_link_loop_ingests_each_file_once(tmp_path, rng):
    src = tmp_path / "src"
    files = _scans(src, 2, rng)
    os.symlink(".", src / "again")  # a folder link loop
    ignored = []
    items, problems = discover(str(src / "**" / "*.pcd"), tmp_path / "staging", ignored=ignored)
    assert [s.scan_id for s in items] == [p.name for p in files] and problems == []
    assert ignored and all("reached through a symbolic link" in i["reason"] for i in ignored)


def test_direct_file_with_unknown_extension_is_one_line_error(tmp_path):
    (tmp_path / "scan.doc").write_text("not a scan")
    code, out, err = _run("ingest", tmp_path / "scan.doc", tmp_path / "s.zarr", "--workers", "1")
    assert code == 2 and err.startswith("error: ") and "unknown format '.doc'" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "s.zarr").exists()


def test_write_stages_writes_every_stage_in_one_round_and_reads_back(tmp_path, rng, monkeypatch):
    import scanforest.tasks.store.scans as store_mod

    st = ScanStore(tmp_path / "s.zarr", create=True)
    st.write_scan("a", {"points": rng.normal(size=(300, 3)).astype(np.float32)}, {"n_points": 300})
    desc = {"kp_index": np.arange(7), "kp_shot": rng.random((7, 352)).astype(np.float32),
            "kp_frames": np.zeros((0, 9), np.float32)}
    match = {"match_ids": rng.integers(-1, 9, (7, 4)), "match_dist": rng.random((7, 4)).astype(np.float32)}
    rec = st.write_stages("a", [("describe", desc, {"k": 1}),
                                ("match", match, lambda w: {"describe": sorted(w), "k": 4})])
    assert rec["match"]["describe"] == ["describe"] and st.verify() == []
    for name, arr in {**desc, **match}.items():
        back = st.read("a", name)
        np.testing.assert_array_equal(back, arr)
        assert back.dtype == arr.dtype and back.shape == arr.shape
    assert st.stage("a", "describe")["arrays"]["kp_frames"] == {"shape": [0, 9], "dtype": "float32"}
    assert stage_matches(st.stage("a", "match"), k=4)
    # a write that does not read back whole: an error, and neither stage is left recorded
    monkeypatch.setattr(store_mod, "_write_arrays", lambda grp, arrays: ["array 'kp_shot' lacks 1 of 1 chunks"])
    with pytest.raises(OSError, match="did not read back"):
        st.write_stages("a", [("describe", desc, {"k": 2}), ("match", match, {"k": 4})])
    assert st.stage("a", "describe") is None and st.stage("a", "match") is None
    with pytest.raises(ValueError, match="same array"):
        st.write_stages("a", [("describe", desc, {}), ("again", {"kp_index": np.arange(2)}, {})])
    # write_scan goes the same way (one round): a scan that does not read back stays incomplete,
    # so nobody sees it, and a listing does not count it
    with pytest.raises(OSError, match="b: written arrays did not read back"):
        st.write_scan("b", {"points": np.zeros((4, 3), np.float32)}, {"n_points": 4})
    assert "b" not in st and st.scans() == ["a"] and "b" in st.scans(include_incomplete=True)
    monkeypatch.undo()
    st.write_scan("b", {"points": np.ones((4, 3), np.float32)}, {"n_points": 4})
    assert st.scans() == ["a", "b"] and (st.read("b") == 1).all() and st.verify() == []


def test_write_arrays_finds_chunks_that_were_not_stored(tmp_path, monkeypatch):
    import zarr.core.array

    from scanforest.tasks.store.scans import _write_arrays

    st = ScanStore(tmp_path / "s.zarr", create=True)
    st.write_scan("a", {"points": np.zeros((4, 3), np.float32)}, {"n_points": 4})
    grp = st._scan("a")
    arrays = {"x": np.ones((5, 3), np.float32), "y": np.float32(2.0), "z": np.zeros((0, 9), np.float32)}
    assert _write_arrays(grp, arrays) == []

    async def lost(self, selection, value, prototype=None):  # a write that never reaches the disk
        return None

    monkeypatch.setattr(zarr.core.array.AsyncArray, "setitem", lost)
    assert _write_arrays(grp, arrays) == ["array 'x' lacks 1 of 1 chunks", "array 'y' lacks 1 of 1 chunks"]


def test_write_arrays_stores_what_zarrs_own_create_stores(tmp_path):
    from scanforest.tasks.store.scans import _array_metadata, _write_arrays

    st = ScanStore(tmp_path / "s.zarr", create=True)
    for sid in ("fast", "zarr"):
        st.write_scan(sid, {"points": np.zeros((4, 3), np.float32)}, {"n_points": 4})
    arrays = {"f32": np.arange(12, dtype=np.float32).reshape(4, 3), "i64": np.arange(5, dtype=np.int64),
              "f64": np.ones((2, 4, 4)), "i32": np.int32(7), "empty": np.zeros((0, 352), np.float32),
              "u8": np.arange(300_000, dtype=np.uint8), "b": np.array([True, False])}
    assert all(_array_metadata(np.asarray(a)) is not None for a in arrays.values())  # the direct path is taken
    assert _write_arrays(st._scan("fast"), arrays) == []
    for name, arr in arrays.items():
        ScanStore._write_array(st._scan("zarr"), name, arr)
    assert _write_arrays(st._scan("fast"), arrays) == []  # written again over itself
    for name, arr in arrays.items():
        fast, own = st._scan("fast")[name], st._scan("zarr")[name]
        assert fast.metadata.to_dict() == own.metadata.to_dict(), name
        np.testing.assert_array_equal(fast[...], arr)
        assert fast.nchunks_initialized == own.nchunks_initialized == fast.nchunks


def test_write_scan_refuses_ids_and_arrays_that_are_not_a_scan(tmp_path):
    """An empty id named the scans group itself (writing it removed every scan), ``a/b`` a scan
    inside another; points that are not (N, 3), per-point arrays of another length and attributes
    JSON cannot hold: each an InputError naming it, the store's scans untouched."""
    from scanforest.tasks.store import ScanStore

    st = ScanStore(tmp_path / "s.zarr", create=True)
    P = np.random.default_rng(0).random((50, 3), dtype=np.float32)
    st.write_scan("s1", {"points": P}, {"n_points": 50})
    for bad in ("", "a/b", ".", "..", None):
        with pytest.raises(InputError, match="cannot name a scan"):
            st.write_scan(bad, {"points": P[:10]}, {})
    with pytest.raises(InputError, match=r"points must be an \(N, 3\) array"):
        st.write_scan("s2", {"points": P[:, :2]}, {})
    with pytest.raises(InputError, match="normals has 20 rows for 50 points"):
        st.write_scan("s2", {"points": P, "normals": P[:20]}, {})
    with pytest.raises(InputError, match=r"attrs\['when'\] is a object"):
        st.write_scan("s2", {"points": P}, {"when": object()})
    assert st.scans() == ["s1"] and np.array_equal(st.read("s1"), P)
    assert ScanStore(tmp_path / "s.zarr").verify() == []


def test_library_and_index_names_are_one_node_of_the_store(tmp_path):
    """An empty name was the libraries' (indexes') group itself: making it removed every other
    one; ``a/b`` nested one in another and ``..`` left the store. Each is refused, nothing lost."""
    import pytest as _pytest

    from scanforest.kernels.errors import InputError
    from scanforest.tasks.store import ScanStore

    st = ScanStore(tmp_path / "s.zarr", create=True)
    with st.catalog.new_library("kept") as g:
        g.attrs.update({"complete": True})
    with st.catalog.new_index("kept") as g:
        g.attrs.update({"complete": True})
    for bad in ("", ".", "..", "a/b", "../x", ".kept.partial-1-x"):
        with _pytest.raises(InputError, match="cannot name a library"):
            st.catalog.new_library(bad)
        with _pytest.raises(InputError, match="cannot name an index"):
            st.catalog.new_index(bad)
        with _pytest.raises(InputError, match="cannot name a library"):
            st.catalog.find_library(bad)
    assert st.catalog.libraries() == ["kept"] and st.catalog.indexes() == ["kept"]


def test_a_failed_or_killed_rebuild_keeps_the_index_and_the_library_it_replaces(tmp_path, rng):
    """A rebuild of an index (a library, a sequence) is written under a hidden name and takes the
    old one's place only when whole: a build that fails (here the forest's own parameter check,
    as a bad --random-dims did on the workers) or whose process is killed leaves the old one
    complete and loadable (it used to be removed first: `match` then said "no complete index")."""
    from scanforest.tasks.index import build_index, load_shard

    st = ScanStore(tmp_path / "s.zarr", create=True)
    rows = rng.random((500, 8)).astype(np.float32)
    first = build_index(str(st.path), "default", rows, params={"n_trees": 2, "leaf_size": 16})
    assert first["status"] == "built"
    with pytest.raises(InputError, match="random_dims"):
        build_index(str(st.path), "default", rows[:400], params={"n_trees": 2, "leaf_size": 16, "random_dims": 0})
    kept = st.catalog.find_index("default")
    assert kept is not None and kept["content_hash"] == first["content_hash"] and kept["n"] == 500
    load_shard(str(st.path), "default", 0)  # still loads
    folder = tmp_path / "s.zarr" / "indexes"
    assert sorted(os.listdir(folder)) == ["default", "zarr.json"]  # the failed build's group is gone
    # a writer killed mid-build (its process gone) left its hidden group: the next build removes it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / f".default.partial-{int(dead.stdout)}-0a1b2c3d").mkdir()
    again = build_index(str(st.path), "default", rows[:400], params={"n_trees": 2, "leaf_size": 16})
    assert again["status"] == "built" and st.catalog.find_index("default")["n"] == 400
    assert sorted(os.listdir(folder)) == ["default", "zarr.json"] and st.catalog.indexes() == ["default"]


def test_float32_points_in_georeferenced_coordinates_are_too_coarse_alone_or_in_a_run(tmp_path, rng):
    """Points stored as float32 in UTM-sized file coordinates (pye57 writes single precision)
    are 0.25-0.5 m apart whatever origin the stages take: they gave zero detections and no word.
    A run of only such scans is refused in one line; beside fine ones, each fails alone."""
    from scanforest.tasks.describe import DescribeParams, check_scan_spacing
    from scanforest.tasks.store.scans import scan_extent

    st = ScanStore(tmp_path / "s.zarr", create=True)
    local = rng.uniform(-1, 1, (300, 3))
    utm = (local + [512345.0, 4123456.0, 87.0]).astype(np.float32)
    for sid, pts in (("utm32", utm), ("utm64", utm.astype(np.float64)), ("fine", local.astype(np.float32))):
        lo, hi = pts.min(0).astype(np.float64), pts.max(0).astype(np.float64)
        origin = [0.0, 0.0, 0.0] if sid == "fine" else np.round((lo + hi) / 2).tolist()
        st.write_scan(sid, {"points": pts}, {"n_points": len(pts), "bbox": {"min": lo.tolist(), "max": hi.tolist()},
                                             "origin": origin})
    assert scan_extent(st.attrs("utm32")) > 4e6 and scan_extent(st.attrs("utm64")) < 3
    radii = {"shot_radius": 0.02}
    with pytest.raises(InputError, match="scan utm32: .*float32 spacing"):
        st.check_coordinates(["utm32"], radii)
    assert st.check_coordinates(None, radii) == ["utm32"]  # the others go on
    with pytest.raises(InputError, match="scan utm32"):
        check_scan_spacing(st, "utm32", st.attrs("utm32"), DescribeParams(shot_radius=0.02))
    check_scan_spacing(st, "utm64", st.attrs("utm64"), DescribeParams(shot_radius=0.02))  # float64 in the file: its local frame is fine
