"""No scan lost to its name (issue 38, findings 1 and 2): every file the file system accepts gets
a scan id of its own, stable and within :data:`MAX_ID_BYTES`; a 255-byte name is ingested; a
store from an older version, whose ids made different names one scan, keeps its ids and ``check``
reports the collision there until an ingest of the source gives each file its own scan."""
from __future__ import annotations

import json
import os
import tarfile
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from _userpath import ok, sf

from scanforest.tasks.ingest import Source, discover, ingest_files
from scanforest.tasks.readers import read_cloud, write_cloud
from scanforest.tasks.store import MAX_ID_BYTES, ScanStore, scan_id_for

#: names that older versions' ids made one scan: the three as ``_.pcd``, the two as ``a_b.pcd``
COLLIDING = {"日本語.pcd": "_.pcd", "中文.pcd": "_.pcd", "한국어.pcd": "_.pcd",
             "a b.pcd": "a_b.pcd", "a_b.pcd": "a_b.pcd"}
LONG = "é" * 125 + "a.pcd"  # 255 bytes in UTF-8, the most a file name may have


@pytest.fixture(scope="module")
def env(prefect_api) -> dict[str, str]:
    """This test process's environment, its Prefect API included (conftest's ``prefect_api``: a
    user with a server; a local API per command costs CI 5-6 s of CPU each)."""
    return {**os.environ, "PREFECT_API_URL": prefect_api}


def _folder(path: Path) -> dict[str, Path]:
    """The tricky names, each with different points."""
    path.mkdir()
    rng = np.random.default_rng(7)
    return {name: write_cloud(path / name, rng.random((40 + i, 3)).astype(np.float32))
            for i, name in enumerate([*COLLIDING, LONG])}


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``path`` with its modification time and size."""
    return {str(p.relative_to(path)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in path.rglob("*") if p.is_file()}


def test_ids_are_unique_stable_readable_and_short():
    nfc = unicodedata.normalize("NFC", "scène.pcd")
    names = [*COLLIDING, LONG, "a" * 251 + ".pcd", "a" * 251 + ".ply", "a" * 250 + "b.pcd",
             "é" * 124 + "ab.pcd", "é" * 124 + "ac.pcd", nfc, unicodedata.normalize("NFD", nfc), "scene.pcd",
             "a/b.pcd", "a__b.pcd", "a_/b.pcd", "a/_b.pcd", "a___b.pcd", "x.pcd", "x.ply", "X.pcd", "x~1.pcd",
             "__init__.pcd", "init.pcd", ".hidden/x.pcd", "hidden/x.pcd", "a.b/c.pcd", "a_b/c.pcd", "a b/c.pcd",
             "\udcff.pcd", "\udcfe.pcd", "tab\t.pcd", "new\nline.pcd", "back\\slash.pcd", "noext",
             "/".join(["d" * 120] * 3) + "/scan.pcd", "/".join(["d" * 120] * 3) + "/scan2.pcd"]
    ids = [scan_id_for(n) for n in names]
    assert len(set(ids)) == len(names), [i for i in ids if ids.count(i) > 1]
    for name, sid in zip(names, ids):
        assert len(sid.encode("utf-8")) <= MAX_ID_BYTES and sid.isascii() and sid.isprintable(), (name, sid)
        assert "/" not in sid and not sid.startswith((".", "__")) and "\\" not in sid, sid
        assert sid == scan_id_for(name) == scan_id_for(f"./{name}")  # stable
    # names of the safe set are their own id, as older versions had them (old stores keep working)
    for name, sid in [("scene_01.pcd", "scene_01.pcd"), ("scenes/scene_01.pcd", "scenes__scene_01.pcd"),
                      ("a_b.pcd", "a_b.pcd"), ("models/milk.pcd", "models__milk.pcd")]:
        assert scan_id_for(name) == sid
    # a name that had to change keeps a readable head, its extension and a hash of the whole path
    assert scan_id_for("a b.pcd").startswith("a_b~") and scan_id_for("a b.pcd").endswith(".pcd")
    assert scan_id_for(nfc).startswith("scene~") and scan_id_for("x.ply") != scan_id_for("x.pcd")
    assert scan_id_for("a" * 251 + ".pcd").endswith(".pcd") and len(scan_id_for("a" * 251 + ".pcd")) == MAX_ID_BYTES
    assert scan_id_for(LONG).startswith("e" * 125 + "a~")  # accents dropped: 130 bytes of head, not 255
    # the same id in every version from this one on: ids name stored scans
    assert scan_id_for("日本語.pcd") == "scan~86c186e156a71ef8.pcd"


def test_discover_and_ingest_give_every_file_its_own_scan(tmp_path):
    """The unit of work on a fresh store: the 255-byte name (whose sidecar name would be longer
    than any file name) is ingested like the others, and two archives of one name in one folder
    do not share ids."""
    files = _folder(tmp_path / "src")
    rng = np.random.default_rng(3)
    for arc in ("batch.tar", "batch.tar.gz"):
        member = write_cloud(tmp_path / "m.pcd", rng.random((30, 3)).astype(np.float32))
        with tarfile.open(tmp_path / "src" / arc, "w:gz" if arc.endswith("gz") else "w") as tf:
            tf.add(member, "scans/m.pcd")
    sources, problems = discover(tmp_path / "src", tmp_path / "staging")
    assert problems == [] and len(sources) == len(files) + 2
    assert len({s.scan_id for s in sources}) == len(sources)
    store = tmp_path / "s.zarr"
    ScanStore(store, create=True)
    recs = ingest_files(str(store), sources)
    assert [r["status"] for r in recs] == ["ingested"] * len(sources), recs
    st = ScanStore(store, mode="r")
    assert len(st.scans()) == len(sources)
    held = {st.attrs(sid)["source"]: sid for sid in st.scans()}
    for path in files.values():
        np.testing.assert_array_equal(st.read(held[str(path)]), read_cloud(path).points)
    assert [r["status"] for r in ingest_files(str(store), sources)] == ["skipped"] * len(sources)


def test_an_old_store_keeps_the_ids_of_the_files_it_holds(tmp_path):
    """On a store whose ``_.pcd`` holds 日本語.pcd and whose ``a_b.pcd`` holds ``a b.pcd`` (the
    last written of each collision): 日本語.pcd keeps ``_.pcd``, a_b.pcd takes back its own id
    ``a_b.pcd`` (the same under the old and the new rule) and ``a b.pcd`` gets a new one; the
    next pass skips every file."""
    files = _folder(tmp_path / "src")
    store = tmp_path / "s.zarr"
    ScanStore(store, create=True)
    order = ("a_b.pcd", "a b.pcd", "中文.pcd", "日本語.pcd")
    ingest_files(str(store), [Source(os.path.realpath(files[n]), COLLIDING[n]) for n in order])
    sources, _ = discover(tmp_path / "src", tmp_path / "staging")
    recs = {Path(r["source"]).name: r for r in ingest_files(str(store), sources)}
    assert (recs["日本語.pcd"]["scan_id"], recs["日本語.pcd"]["status"]) == ("_.pcd", "skipped")
    assert (recs["a_b.pcd"]["scan_id"], recs["a_b.pcd"]["status"]) == ("a_b.pcd", "ingested")
    assert recs["a b.pcd"]["scan_id"] == scan_id_for("a b.pcd") != "a_b.pcd"
    st = ScanStore(store, mode="r")
    assert len(st.scans()) == len(files)
    for path in files.values():
        sid = next(sid for sid in st.scans() if st.attrs(sid)["source"] == str(path))
        np.testing.assert_array_equal(st.read(sid), read_cloud(path).points)
    assert {r["status"] for r in ingest_files(str(store), sources)} == {"skipped"}


def _old_store(store: Path, src: Path, files: dict[str, Path]) -> None:
    """What versions before unique ids left: the colliding names written as one scan each, the
    last one written kept (they went in name order: 한국어.pcd and a_b.pcd), and the run record
    listing each file's id. The 255-byte name never got in (its ingest failed)."""
    ScanStore(store, create=True)
    recs = ingest_files(str(store), [Source(os.path.realpath(files[n]), COLLIDING[n]) for n in sorted(COLLIDING)])
    ScanStore(store).write_run("ingest-20261101T120000-0a1b2c", {
        "flow": "ingest", "status": "completed", "parameters": {"source": str(src), "units": "m"},
        "records": [{"scan_id": r["scan_id"], "status": r["status"]} for r in recs],
        "started": "2026-11-01T12:00:00Z", "finished": "2026-11-01T12:00:01Z"})


def test_old_store_with_collisions_checked_ingested_and_rerun_as_a_user(tmp_path, env):
    """The user's path on a store an older version wrote: ``check`` reports the two ids that
    several files were written as; ``ingest`` gives every file a scan of its own (the files those
    scans hold keep their old ids, nothing renamed), exit 0; a rerun skips every file and writes
    nothing; ``check`` is clean."""
    src = tmp_path / "src"
    files = _folder(src)
    store = tmp_path / "s.zarr"
    _old_store(store, src, files)
    assert ScanStore(store, mode="r").scans() == ["_.pcd", "a_b.pcd"]

    proc = sf("check", str(store), "--json", env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = {p["scan_id"]: p for p in json.loads(proc.stdout)["problems"]}
    assert {sid: p["problem"] for sid, p in found.items()} == {"_.pcd": "collision", "a_b.pcd": "collision"}
    assert found["_.pcd"]["detail"].startswith("3 files of ingest run") and "한국어.pcd" in found["_.pcd"]["detail"]

    summary = json.loads(ok(sf("ingest", str(src), str(store), "--workers", "1", "--json", env=env, cwd=tmp_path)))
    # kept: 한국어.pcd in _.pcd and a_b.pcd in a_b.pcd, the scans the old ingest left of them
    assert (summary["ingested"], summary["skipped"], summary["quarantined"]) == (4, 2, 0), summary
    st = ScanStore(store, mode="r")
    held = {st.attrs(sid)["source"]: sid for sid in st.scans()}
    assert len(st.scans()) == len(files) and sorted(held) == sorted(str(p) for p in files.values())
    assert held[str(files["한국어.pcd"])] == "_.pcd" and held[str(files["a_b.pcd"])] == "a_b.pcd"
    for path in files.values():
        np.testing.assert_array_equal(st.read(held[str(path)]), read_cloud(path).points)
    before = _tree(store / "scans")

    again = json.loads(ok(sf("ingest", str(src), str(store), "--workers", "1", "--json", env=env, cwd=tmp_path)))
    assert (again["ingested"], again["skipped"], again["quarantined"]) == (0, len(files), 0), again
    assert _tree(store / "scans") == before

    out = ok(sf("check", str(store), env=env, cwd=tmp_path))
    assert f"{len(files)} scans, no problems" in out


def test_commands_take_a_files_own_name_for_its_scan(tmp_path, env):
    """Ids are ASCII, so ``scène été.pcd`` is stored as ``scene_ete~<hash>.pcd``; a command given
    the file's own name (as the folder spells it, NFC or NFD, alone or with its folder) finds its
    scan; a name two files share is one line naming their scans, exit 2, nothing written."""
    from scanforest.flows.inputs import resolve_scan_names

    src = tmp_path / "src"
    rng = np.random.default_rng(3)
    names = ["scène été.pcd", "a/x é.pcd", "b/x é.pcd", "plain.pcd"]
    for i, name in enumerate(names):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        write_cloud(src / name, rng.random((30 + i, 3)).astype(np.float32))
    store = tmp_path / "s.zarr"
    sources, _ = discover(src, tmp_path / "staging")
    ScanStore(store, create=True)
    ingest_files(str(store), sources)
    st = ScanStore(store, mode="r")
    sid = {st.attrs(s)["source"]: s for s in st.scans()}
    ete = sid[str(src / "scène été.pcd")]
    assert ete != "scène été.pcd" and "~" in ete
    nfd = unicodedata.normalize("NFD", "scène été.pcd")
    assert resolve_scan_names(st, ["scène été.pcd", nfd, "plain.pcd", "plain*", "a/x é.pcd", "nope.pcd"]) == [
        ete, ete, "plain.pcd", "plain*", sid[str(src / "a" / "x é.pcd")], "nope.pcd"]
    assert resolve_scan_names(st, [unicodedata.normalize("NFD", "b/x é.pcd")]) == [sid[str(src / "b" / "x é.pcd")]]
    before = _tree(store)
    proc = sf("describe", str(store), "--scan", "x é.pcd", env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "'x é.pcd' is the name of 2 scanned files" in line and sid[str(src / "a" / "x é.pcd")] in line
    assert _tree(store) == before
    listing = ok(sf("info", str(store), "--scans", env=env, cwd=tmp_path))  # each id beside its file
    assert f"{ete}\t" in listing and any(ln.startswith(ete) and ln.endswith(str(src / "scène été.pcd"))
                                          for ln in listing.splitlines())
