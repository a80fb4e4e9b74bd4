"""Ingest flow on a real local Dask cluster with Prefect's API: folders, archives, quarantine, resume."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from scanforest.flows.ingest import run_ingest
from scanforest.kernels.synthetic import scenes as synthetic
from scanforest.tasks.ingest import Source, discover, ingest_file, ingest_files
from scanforest.tasks.readers import read_cloud, write_cloud
from scanforest.tasks.store import ScanStore
from scanforest.tasks.synth import corrupt_copy, write_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch")
    made = write_archive(root, n_models=3, n_scenes=3, points_per_scene=5_000, points_per_model=2_000)
    return root, made


def test_folder_with_one_corrupt_file(tmp_path, archive):
    root, made = archive
    src = tmp_path / "src"
    src.mkdir()
    for p in made["scenes"]:
        (src / p.name).write_bytes(p.read_bytes())
        (src / p.with_name(p.stem + ".gt.json").name).write_bytes(p.with_name(p.stem + ".gt.json").read_bytes())
    corrupt_copy(made["scenes"][0], src / "broken.pcd", 0.3)
    (src / "notes.doc").write_text("not a scan")
    store = tmp_path / "s.zarr"
    summary = run_ingest(str(src), str(store), workers=2, progress=False)
    assert summary["ingested"] == 3 and summary["quarantined"] == 1 and summary["skipped"] == 0
    assert summary["ignored"] == 1 and "notes.doc" in summary["ignored_note"]  # not a scan format: no failure
    st = ScanStore(store, mode="r")
    assert st.scans() == ["scene_0000.pcd", "scene_0001.pcd", "scene_0002.pcd"]
    reasons = {q["id"]: q["reason"] for q in st.quarantined()}
    assert reasons["broken.pcd"].startswith("truncated binary")  # lzf falls back to binary for noise
    assert set(reasons) == {"broken.pcd"}
    # the good scans are exact and carry their ground truth and attributes
    for p in made["scenes"]:
        np.testing.assert_array_equal(st.read(p.name), read_cloud(p).points)
        a = st.attrs(p.name)
        assert a["complete"] and a["n_points"] == len(read_cloud(p)) and len(a["sha256"]) == 64 and a["units"] == "m"
        assert len(a["ground_truth"]) == 3 and np.asarray(a["ground_truth"][0]["pose"]).shape == (4, 4)
        assert a["bbox"]["min"] == st.read(p.name).min(0).tolist()
    # re-ingesting unchanged files is a no-op
    again = run_ingest(str(src), str(store), workers=2, progress=False)
    assert again["skipped"] == 3 and again["ingested"] == 0
    assert st.scans() == ["scene_0000.pcd", "scene_0001.pcd", "scene_0002.pcd"]
    assert len(ScanStore(store).runs()) == 2


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_archives_and_globs(tmp_path, archive, kind):
    root, made = archive
    arc = tmp_path / f"batch.{kind}"
    files = made["scenes"] + [p.with_name(p.stem + ".gt.json") for p in made["scenes"]]
    if kind == "zip":
        with zipfile.ZipFile(arc, "w") as zf:
            for p in files:
                zf.write(p, f"scenes/{p.name}")
    else:
        with tarfile.open(arc, "w:gz") as tf:
            for p in files:
                tf.add(p, f"scenes/{p.name}")
    store = tmp_path / "s.zarr"
    summary = run_ingest(str(arc), str(store), workers=1, progress=False)
    assert summary["ingested"] == 3 and summary["quarantined"] == 0
    st = ScanStore(store, mode="r")
    assert st.scans() == ["batch__scenes__scene_0000.pcd", "batch__scenes__scene_0001.pcd",
                          "batch__scenes__scene_0002.pcd"]
    assert "ground_truth" in st.attrs("batch__scenes__scene_0001.pcd")
    assert not Path(str(store) + ".staging").exists()  # staging removed after a clean ingest
    # each scan names the archive and its member (it named the removed staging copy)
    assert st.attrs("batch__scenes__scene_0001.pcd")["source"] == f"{arc}::scenes/scene_0001.pcd"
    from scanforest.flows.inputs import resolve_scan_names
    assert resolve_scan_names(st, ["scenes/scene_0002.pcd"]) == ["batch__scenes__scene_0002.pcd"]
    assert resolve_scan_names(st, ["scene_0002.pcd"]) == ["batch__scenes__scene_0002.pcd"]
    # a rerun skips every member (the same scans, not new ones)
    assert run_ingest(str(arc), str(store), workers=1, progress=False)["skipped"] == 3


def test_truncated_archive_is_quarantined(tmp_path, archive):
    root, made = archive
    arc = tmp_path / "t.tar.gz"
    with tarfile.open(arc, "w:gz") as tf:
        for p in made["models"]:
            tf.add(p, p.name)
    corrupt_copy(arc, tmp_path / "cut.tar.gz", 0.6)
    srcs, problems = discover(tmp_path / "cut.tar.gz", tmp_path / "staging")
    assert problems and "corrupt or truncated archive" in problems[0]["reason"]


def _npy_members(rng, n=4, points=4000):
    out = []
    for i in range(n):
        b = io.BytesIO()
        np.save(b, rng.random((points, 3)).astype(np.float32))
        out.append((f"s{i}.npy", b.getvalue()))
    return out


def test_a_damaged_archive_gives_no_member_made_of_its_damage(tmp_path, rng):
    """A .tar.gz cut inside a member left that member's partial copy, quarantined as an "empty
    file" beside the archive's own reason; a .tar.gz damaged inside a member decompressed to
    garbage (gzip checks its CRC at the end only) until a header failed, and that member was
    ingested with points of 1e38; a zip's damaged member stopped every later one. Now: the member
    the archive ends or breaks in is named in the archive's reason and not read; a zip's damaged
    member alone is quarantined; the members before the damage are ingested bit for bit."""
    members = _npy_members(rng)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    whole = buf.getvalue()
    src = tmp_path / "src"
    src.mkdir()
    (src / "cut.tar.gz").write_bytes(whole[:len(whole) // 2])
    flipped = bytearray(whole)
    for k in range(len(flipped) // 2, len(flipped) // 2 + 200):
        flipped[k] ^= 0x5A
    (src / "flipped.tar.gz").write_bytes(bytes(flipped))
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members[:3]:
            zf.writestr(name, data)
    z = bytearray(zbuf.getvalue())
    at = z.find(b"s1.npy") + 40  # inside the second member's compressed bytes
    for k in range(at, at + 50):
        z[k] ^= 0x33
    (src / "damaged.zip").write_bytes(bytes(z))
    srcs, problems = discover(src, tmp_path / "staging")
    reasons = {p["source"].replace(str(src) + "/", ""): p["reason"] for p in problems}
    assert "it ends inside s" in reasons["cut.tar.gz"], reasons
    assert "its stream breaks" in reasons["flipped.tar.gz"] and "not read" in reasons["flipped.tar.gz"], reasons
    assert reasons["damaged.zip::s1.npy"].startswith("damaged archive member: "), reasons
    got = {s.origin.replace(str(src) + "/", ""): s for s in srcs}
    assert {"damaged.zip::s0.npy", "damaged.zip::s2.npy"} <= set(got)
    for name, s in got.items():  # every member read is the member written, none made of damage
        want = dict(members)[name.split("::")[1]]
        np.testing.assert_array_equal(read_cloud(s.path).points, np.load(io.BytesIO(want)))
    broke = reasons["flipped.tar.gz"].split("after ")[1].split(",")[0]
    assert f"flipped.tar.gz::{broke}" not in got and len([n for n in got if n.startswith("cut")]) >= 1
    # the flow: the store holds the members before the damage, and no staging folder stays
    summary = run_ingest(str(src), str(tmp_path / "s.zarr"), workers=1, progress=False)
    assert summary["ingested"] == len(got) and summary["quarantined"] == 3
    assert "staging_note" not in summary and not (tmp_path / "s.zarr.staging").exists()


def test_a_tar_gz_whose_checksum_fails_gives_no_member(tmp_path, rng):
    """gzip checks its CRC at the end of its stream only, and tarfile stops at the end-of-archive
    block before it: an archive whose checksum fails (here its trailer, so every tar header reads)
    had all its members ingested. Its stream is read to the end now; which member is damaged is
    not known, so none is read and the archive says why."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in _npy_members(rng, 3, 500):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    data = bytearray(buf.getvalue())
    data[-8] ^= 0xFF  # the CRC-32 of the gzip trailer
    (tmp_path / "crc.tar.gz").write_bytes(bytes(data))
    srcs, problems = discover(tmp_path / "crc.tar.gz", tmp_path / "staging")
    assert srcs == [] and len(problems) == 1, (srcs, problems)
    assert "none of its members is read" in problems[0]["reason"] and "fails at its end" in problems[0]["reason"]
    (tmp_path / "ok.tar.gz").write_bytes(buf.getvalue())  # the same archive intact: all three
    assert len(discover(tmp_path / "ok.tar.gz", tmp_path / "staging2")[0]) == 3

def test_the_staging_folder_kept_for_a_quarantined_member_is_said(tmp_path, rng):
    """A member that fails its reader keeps the extracted files for a rerun: the summary says
    where, how much, and why (a 200 MB folder stayed beside the store without a word); a loose
    file that fails its reader keeps nothing (the whole folder stayed)."""
    members = _npy_members(rng, 2)
    src = tmp_path / "src"
    src.mkdir()
    with zipfile.ZipFile(src / "a.zip", "w") as zf:
        for name, data in members:
            zf.writestr(name, data)
        zf.writestr("bad.npy", b"\x93NUMPY" + bytes(100))
    summary = run_ingest(str(src), str(tmp_path / "s.zarr"), workers=1, progress=False)
    assert summary["ingested"] == 2 and summary["quarantined"] == 1
    staging = tmp_path / "s.zarr.staging"
    assert staging.is_dir() and summary["staging_note"].startswith(f"{staging} keeps the 3 files extracted")
    assert "retries the 1 quarantined archive member without" in summary["staging_note"]
    (src / "a.zip").unlink()
    for name, data in members:
        (src / name).write_bytes(data)
    (src / "bad.npy").write_bytes(b"\x93NUMPY" + bytes(100))
    summary = run_ingest(str(src), str(tmp_path / "t.zarr"), workers=1, progress=False)
    assert summary["quarantined"] == 1 and "staging_note" not in summary
    assert not (tmp_path / "t.zarr.staging").exists()

def test_a_store_whose_folder_cannot_hold_its_staging_folder(tmp_path, rng, prefect_api, monkeypatch):
    """The staging folder is made when an archive comes: a folder of scans ingests where
    ``STORE.staging`` cannot be made (a read-only folder; here a file in its place), which
    crashed with a traceback. An archive there is one line naming SCANFOREST_STAGING, exit 2,
    and no store left behind; with it set, the archive is extracted under it and removed after."""
    members = _npy_members(rng, 2)
    src = tmp_path / "src"
    src.mkdir()
    for name, data in members:
        (src / name).write_bytes(data)
    (tmp_path / "s.zarr.staging").write_text("in the way")
    summary = run_ingest(str(src), str(tmp_path / "s.zarr"), workers=1, progress=False)
    assert summary["ingested"] == 2 and summary["quarantined"] == 0
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as zf:
        for name, data in members:
            zf.writestr(name, data)
    (tmp_path / "t.zarr.staging").write_text("in the way")
    env = dict(os.environ, PREFECT_API_URL=prefect_api)
    env.pop("SCANFOREST_STAGING", None)
    res = subprocess.run([sys.executable, "-m", "scanforest.deploy.cli", "ingest", str(tmp_path / "a.zip"),
                          str(tmp_path / "t.zarr"), "--workers", "1"], env=env, capture_output=True, text=True)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(lines) == 1 and "t.zarr.staging" in lines[0] and "SCANFOREST_STAGING" in lines[0], res.stderr
    assert not (tmp_path / "t.zarr").exists()
    monkeypatch.setenv("SCANFOREST_STAGING", str(tmp_path / "elsewhere"))
    summary = run_ingest(str(tmp_path / "a.zip"), str(tmp_path / "t.zarr"), workers=1, progress=False)
    assert summary["ingested"] == 2 and sorted(ScanStore(tmp_path / "t.zarr", mode="r").scans()) == ["a__s0.npy",
                                                                                                   "a__s1.npy"]
    assert list((tmp_path / "elsewhere").iterdir()) == []  # removed after a clean ingest
    # a store name near the file system's 255 bytes (non-ASCII): its staging folder's name is cut to fit
    from scanforest.tasks.ingest import staging_folder

    long_store = tmp_path / ("é" * 120 + ".zarr")  # 246 bytes
    for where in (None, str(tmp_path / "elsewhere")):
        if where:
            monkeypatch.setenv("SCANFOREST_STAGING", where)
        else:
            monkeypatch.delenv("SCANFOREST_STAGING")
        folder = staging_folder(str(long_store))
        assert len(os.fsencode(folder.name)) <= 255 and folder.name.startswith("é" * 100)
    summary = run_ingest(str(tmp_path / "a.zip"), str(long_store), workers=1, progress=False)
    assert summary["ingested"] == 2 and not staging_folder(str(long_store)).exists()


def test_tar_cut_at_a_member_header_hard_links_and_symlinks(tmp_path, archive):
    """A tar cut where a member's header begins read as a shorter, complete archive: its members
    so far are listed and the archive is a problem ("cut off"), as a cut inside a member's data
    is. A hard-linked member is a file (it was dropped), a symbolic link is said and passed over."""
    root, made = archive
    src = tmp_path / "src"
    src.mkdir()
    for p in made["models"]:
        (src / p.name).write_bytes(p.read_bytes())
    first = made["models"][0].name
    os.link(src / first, src / "hard_copy.pcd")
    os.symlink(first, src / "soft_copy.pcd")
    arc = tmp_path / "t.tar"
    with tarfile.open(arc, "w") as tf:
        for p in sorted(src.iterdir()):
            tf.add(p, p.name)
    srcs, problems = discover(arc, tmp_path / "staging", ignored=(ignored := []))
    names = sorted(Path(s.path).name for s in srcs)
    assert "hard_copy.pcd" in names and "soft_copy.pcd" not in names and problems == []
    assert read_cloud(next(s.path for s in srcs if s.path.endswith("hard_copy.pcd"))).points.shape[0] > 0
    assert any("soft_copy.pcd" in i["source"] and "symbolic link" in i["reason"] for i in ignored)
    with tarfile.open(arc) as tf:  # the offset of the second member's header
        second = tf.getmembers()[1].offset
    (tmp_path / "cut.tar").write_bytes(arc.read_bytes()[:second])
    srcs, problems = discover(tmp_path / "cut.tar", tmp_path / "staging2")
    assert len(srcs) == 1 and len(problems) == 1, (srcs, problems)
    assert "corrupt or truncated archive" in problems[0]["reason"] and "cut off" in problems[0]["reason"]


def test_an_ingest_whose_only_source_is_a_corrupt_zip_quarantines_it(tmp_path, archive):
    """The flow with no scan to map (the archive itself the only problem) ran one empty batch and
    crashed (AttributeError in the flow, exit 1): the archive is quarantined, nothing else."""
    root, made = archive
    arc = tmp_path / "z.zip"
    with zipfile.ZipFile(arc, "w") as zf:
        for p in made["models"]:
            zf.write(p, p.name)
    (tmp_path / "cut.zip").write_bytes(arc.read_bytes()[:-50])
    summary = run_ingest(str(tmp_path / "cut.zip"), str(tmp_path / "s.zarr"), workers=1, progress=False)
    assert summary["ingested"] == 0 and summary["quarantined"] == 1
    assert "corrupt or truncated archive" in summary["quarantine_reasons"][0]["reason"]


def test_a_linked_file_is_read_by_the_link_name(tmp_path, archive):
    """git-annex and DVC keep scans as links to content-named blobs: the format comes from the
    link's name (it came from the target's and was "unknown format"); the scan reads the same."""
    root, made = archive
    blobs, work = tmp_path / "objects", tmp_path / "work"
    blobs.mkdir()
    work.mkdir()
    (blobs / "SHA256E-s123--deadbeef").write_bytes(made["models"][0].read_bytes())
    os.symlink(blobs / "SHA256E-s123--deadbeef", work / "scan.pcd")
    srcs, problems = discover(work, tmp_path / "staging")
    assert problems == [] and [s.scan_id for s in srcs] == ["scan.pcd"]
    got = read_cloud(srcs[0].path).points
    assert np.array_equal(got, read_cloud(made["models"][0]).points)


def test_glob_source(tmp_path, archive):
    root, made = archive
    items, _ = discover(str(root / "scenes" / "*.pcd"), tmp_path / "st")
    assert [s.scan_id for s in items] == ["scene_0000.pcd", "scene_0001.pcd", "scene_0002.pcd"]


def test_incomplete_scan_is_invisible_and_replaced(tmp_path, rng):
    p = write_cloud(tmp_path / "a.npy", rng.normal(size=(100, 3)).astype(np.float32))
    store = ScanStore(tmp_path / "s.zarr", create=True)
    # simulate a writer killed after creating the group and some arrays, before the complete flag
    grp = store.root["scans"].create_group("a.npy")
    grp.attrs.update({"complete": False, "sha256": "x"})
    grp.create_array("points", shape=(10, 3), dtype="f4")
    assert store.scans() == [] and store.info()["incomplete"] == ["a.npy"]
    rec = ingest_file(str(tmp_path / "s.zarr"), Source(str(p), "a.npy"))
    assert rec["status"] == "ingested"
    assert store.scans() == ["a.npy"] and store.read("a.npy").shape == (100, 3)


def test_a_batch_of_files_is_one_unit_that_goes_on_past_a_bad_file(tmp_path, archive):
    """ingest_files (one Dask task per batch): one record per file in order, a corrupt file
    quarantined while the rest are written, and a rerun of the batch finds them current."""
    root, made = archive
    bad = tmp_path / "broken.pcd"
    corrupt_copy(made["scenes"][0], bad, 0.3)
    srcs = [Source(str(made["scenes"][0]), "a"), Source(str(bad), "bad"), Source(str(made["scenes"][1]), "b")]
    store = tmp_path / "s.zarr"
    ScanStore(store, create=True)
    recs = ingest_files(str(store), srcs, run="r1")
    assert [r["scan_id"] for r in recs] == ["a", "bad", "b"]
    assert [r["status"] for r in recs] == ["ingested", "quarantined", "ingested"]
    st = ScanStore(store, mode="r")
    assert st.scans() == ["a", "b"]
    assert st.read("b").shape == read_cloud(made["scenes"][1]).points.shape
    again = ingest_files(str(store), srcs, run="r2")  # another run: the good ones are current
    assert [r["status"] for r in again] == ["skipped", "quarantined", "skipped"]
    # the same run again (Dask rescheduled the batch of a lost worker): its files count as its own
    assert [r["status"] for r in ingest_files(str(store), srcs[:1], run="r1")] == ["ingested"]


def test_ingest_killed_midway_and_rerun(tmp_path, prefect_api):
    """A real process kill (SIGKILL of the whole process group) during ingest, then a rerun."""
    src = tmp_path / "src"
    src.mkdir()
    lib = synthetic.model_library(2, 2_000, seed=3)
    for i in range(40):
        sc = synthetic.make_scene(lib, n_instances=2, n_points=120_000, seed=i, occlusion=False)
        write_cloud(src / f"s{i:03d}.pcd", sc.points, encoding="binary")
    store = tmp_path / "s.zarr"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PREFECT_API_URL=prefect_api)
    proc = subprocess.Popen([sys.executable, "-m", "scanforest.deploy.cli", "ingest", str(src), str(store),
                             "--workers", "1"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if (store / "zarr.json").exists() and len(ScanStore(store, mode="r").scans()) >= 3:
                break  # (the folder appears a moment before the group's metadata)
            if proc.poll() is not None:
                pytest.fail("ingest finished before it could be killed")
            time.sleep(0.2)
        else:
            pytest.fail("ingest made no progress")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    st = ScanStore(store, mode="r")
    done = st.scans()
    assert 3 <= len(done) < 40
    for sid in done:  # every visible scan is whole
        np.testing.assert_array_equal(st.read(sid), read_cloud(src / sid).points)
    summary = run_ingest(str(src), str(store), workers=2, progress=False)
    assert summary["skipped"] == len(done)
    assert summary["ingested"] == 40 - len(done) and summary["quarantined"] == 0
    st = ScanStore(store, mode="r")
    assert st.scans() == sorted(f"s{i:03d}.pcd" for i in range(40))
    assert st.info()["incomplete"] == []


def test_ingest_stopped_with_ctrl_c_and_rerun(tmp_path, rng, prefect_api):
    """Ctrl-C mid-ingest (SIGINT to the command's process group, as a terminal sends it, its
    workers in a session of their own): exit 130 within seconds, one line said and nothing else
    (no traceback, no library's error lines), its workers ended where they were; every scan the
    store shows is whole and the rerun ingests the rest."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(160):
        np.save(src / f"s{i:03d}.npy", rng.random((20_000, 3)).astype(np.float32))
    store = tmp_path / "s.zarr"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PREFECT_API_URL=prefect_api)
    errfile = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "scanforest.deploy.cli", "ingest", str(src), str(store),
                             "--workers", "2"], env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=errfile)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (store / "zarr.json").exists():
            assert proc.poll() is None, "ingest finished before it could be stopped"
            time.sleep(0.05)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.time()
        proc.wait(30)
        stopped = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    errfile.close()
    err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 130 and stopped < 6, (stopped, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("interrupted: stopping") for ln in lines), err
    st = ScanStore(store, mode="r")
    done = st.scans()
    for sid in done:
        np.testing.assert_array_equal(st.read(sid), np.load(src / sid))
    summary = run_ingest(str(src), str(store), workers=2, progress=False)
    assert summary["skipped"] == len(done) and summary["ingested"] == 160 - len(done)
    assert ScanStore(store, mode="r").info()["incomplete"] == []


def test_cli_info_and_bad_store(tmp_path):
    from typer.testing import CliRunner

    from scanforest.deploy.cli import app

    store = ScanStore(tmp_path / "s.zarr", create=True)
    store.write_scan("x", {"points": np.zeros((5, 3), np.float32)}, {"n_points": 5, "format": "npy"})
    res = CliRunner().invoke(app, ["info", str(tmp_path / "s.zarr"), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout[: res.stdout.rindex("}") + 1])["scans"] == 1
    res = subprocess.run([sys.executable, "-m", "scanforest.deploy.cli", "info", str(tmp_path / "nope.zarr")],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "no scan store at" in res.stderr and "Traceback" not in res.stderr


def test_archive_written_by_several_processes_is_the_same(tmp_path, archive):
    root, made = archive
    par = write_archive(tmp_path / "par", n_models=3, n_scenes=3, points_per_scene=5_000, points_per_model=2_000,
                        jobs=2)
    assert [p.name for p in par["scenes"]] == [p.name for p in made["scenes"]]
    for a, b in zip(made["scenes"], par["scenes"]):
        assert a.read_bytes() == b.read_bytes()
        assert a.with_name(a.stem + ".gt.json").read_text() == b.with_name(b.stem + ".gt.json").read_text()


def test_the_ignored_files_note_is_said_once(capsys):
    """Ingest's note of the files it passed over goes to stderr as one line; the summary table
    repeated it as a row (the same note twice)."""
    from scanforest.deploy.cli.core import print_summary

    print_summary("ingest", {"files": 2, "ignored": 1, "ignored_note": "ignored 1 file(s) (not a scan format): a.doc"})
    out = capsys.readouterr().out
    assert "a.doc" not in out and "ignored" in out


def test_a_zip_with_utf8_names_it_does_not_flag_gives_the_names_and_ids_of_its_tar(tmp_path):
    """Info-ZIP's zip (Linux) writes UTF-8 names without the archive's UTF-8 flag; Python's
    zipfile then reads them as cp437 (``ünï`` came out ``├╝n├»``) and the same file got another
    scan id from the zip than from a tar of it."""
    from scanforest.tasks.ingest import discover

    pts = np.random.default_rng(0).random((200, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", pts)
    placeholder, real = "scenes/XXnXX/scene.npy", "scenes/ünï/scene.npy"
    assert len(placeholder.encode()) == len(real.encode())
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as zf:
        zf.write(tmp_path / "x.npy", placeholder)  # ASCII: no UTF-8 flag; its bytes made UTF-8 below
    data = (tmp_path / "a.zip").read_bytes().replace(placeholder.encode(), real.encode())
    (tmp_path / "a.zip").write_bytes(data)
    with zipfile.ZipFile(tmp_path / "a.zip") as zf:
        assert zf.namelist() != [real]  # what zipfile makes of it
    with tarfile.open(tmp_path / "a.tar", "w") as tf:
        tf.add(tmp_path / "x.npy", real)
    (tmp_path / "s1").mkdir()
    (tmp_path / "s2").mkdir()
    from_zip, _ = discover(tmp_path / "a.zip", tmp_path / "s1")
    from_tar, _ = discover(tmp_path / "a.tar", tmp_path / "s2")
    assert [s.origin.split("::")[1] for s in from_zip] == [real]
    assert [s.scan_id for s in from_zip] == [s.scan_id for s in from_tar]
