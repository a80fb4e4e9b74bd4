"""One pipeline (issue 24): the recognize stage takes a scene's description and matches from the
describe and match stages (an index built over the model library) instead of describing and
matching it again, and gives the detections of ``sf.recognize``; a scene whose stored outputs
do not fit is recognised from its points, and a scene described or matched again is recognised
again."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.errors import InputError
from scanforest.kernels.recognition import recognize
from scanforest.kernels.synthetic import scenes as S
from scanforest.tasks import index as idx
from scanforest.tasks.describe import DescribeParams, describe_scan
from scanforest.tasks.recognize import build_library, describe_params_for, load_library, recognize_scan, stored_inputs
from scanforest.tasks.store import ScanStore

LIB = dict(model_ss=0.01, descr_rad=0.04, rf_rad=0.03, normal_radius=0.015, views=16)
REC = dict(scene_ss=0.015, method="gc", cg_size=0.02, cg_thresh=5, normal_radius=0.015, inlier_dist=0.008,
           min_inlier_fraction=0.7, match_k=2)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A store with two model scans, their library 'lib', an exact index 'ix' over the library
    (two shards), and the scene's points to write under any scan id."""
    models = S.model_library(2, 6000, seed=3)
    scene = S.make_scene(models, n_instances=2, n_points=40_000, noise=0.2, clutter=1, seed=5)
    store = str(tmp_path_factory.mktemp("pipe") / "s.zarr")
    st = ScanStore(store, create=True)
    mids = []
    for m in models:
        mids.append(f"models__{m.name}")
        st.write_scan(mids[-1], {"points": m.points, "normals": m.normals}, {"sha256": m.name})
    build_library(store, mids, name="lib", params=LIB, device="cpu")
    ref, ref_scan, ref_row, scans, src = idx.collect_library_reference(st, "lib")
    idx.build_index(store, "ix", ref, shards=2, params={"method": "exact"}, ref_scan=ref_scan, ref_row=ref_row,
                    scans=scans, library=src)
    from distributed import Client

    with Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None) as client:
        yield {"store": store, "scene": scene, "models": mids, "client": client}


def _scene(world, sid: str) -> str:
    gt = [dict(g, pose=np.asarray(g["pose"]).tolist()) for g in world["scene"].ground_truth]
    ScanStore(world["store"]).write_scan(sid, {"points": world["scene"].points}, {"sha256": sid, "ground_truth": gt})
    return sid


def _match(world, sid: str, k: int = 4, index: str = "ix") -> dict:
    from scanforest.flows.distributed import DistributedIndex
    from scanforest.flows.match import _match_batch

    di = DistributedIndex(world["client"], world["store"], index, device="cpu")
    try:
        return _match_batch(di, world["store"], [sid], k)[0]
    finally:
        di.close()


def _want(world, sid: str):
    st = ScanStore(world["store"], mode="r")
    return recognize(st.read(sid, "points"), load_library(world["store"], "lib"), device="cpu", **REC)


def _same(world, sid: str, want) -> None:
    st = ScanStore(world["store"], mode="r")
    assert st.read(sid, "det_model").tolist() == [d.model_id for d in want]
    assert st.read(sid, "det_inliers").tolist() == [d.inliers for d in want]
    np.testing.assert_allclose(st.read(sid, "det_pose"), np.array([d.pose for d in want]).reshape(-1, 4, 4),
                               atol=1e-6)


def _describe(world, sid: str, params: DescribeParams | None = None, **kw) -> dict:
    p = params or describe_params_for(REC, ScanStore(world["store"], mode="r").catalog.library_attrs("lib")["params"])
    return describe_scan(world["store"], sid, p, device="cpu", **kw)


def test_describe_params_follow_the_recognition_and_library_params():
    p = describe_params_for(REC, {"descr_rad": 0.04})
    assert p == DescribeParams(normal_k=None, normal_radius=0.015, keypoint_radius=0.015, shot_radius=0.04)
    assert "viewpoint" not in p.as_dict()  # the origin: the record scans described before carry
    q = describe_params_for({"descr_rad": 0.05, "viewpoint": (0, 0, 1)}, {})
    assert (q.normal_k, q.normal_radius, q.keypoint_radius, q.shot_radius) == (10, None, 0.03, 0.05)
    assert q.as_dict()["viewpoint"] == (0.0, 0.0, 1.0)
    assert describe_params_for({}, {}).shot_radius == 0.02  # ModelLibrary.build's default
    with pytest.raises(InputError, match="scene_ss"):
        describe_params_for({"scene_ss": -1}, {})


def test_index_over_the_library_is_its_reference_in_order(world):
    st = ScanStore(world["store"], mode="r")
    lib = load_library(world["store"], "lib")
    g = st.root["indexes"]["ix"]
    np.testing.assert_array_equal(g["reference"][...], lib.reference())
    np.testing.assert_array_equal(g["ref_row"][...], lib.valid_rows)
    np.testing.assert_array_equal(g["ref_scan"][...], lib.model_id[lib.valid_rows])
    cat = ScanStore(world["store"], mode="r").catalog
    attrs = cat.index_attrs("ix")
    assert attrs["library"] == {"name": "lib", "content_hash": cat.library_attrs("lib")["content_hash"]}
    assert attrs["scans"] == world["models"]


def test_recognize_from_the_stored_description_and_matches_equals_recognize(world):
    sid = _scene(world, "scene_stored")
    assert _describe(world, sid)["status"] == "described"
    assert _match(world, sid)["status"] == "matched"
    res = recognize_scan(world["store"], sid, "lib", REC, device="cpu")
    assert res["status"] == "recognized" and res["source"] == "stored" and res["reason"] is None
    want = _want(world, sid)
    assert len(want) == 2
    _same(world, sid, want)
    rec = ScanStore(world["store"], mode="r").stage(sid, "recognize")
    assert rec["source"] == "stored" and set(rec["inputs"]) == {"describe", "match"}
    assert res["evaluation"]["tp"] == 2 and res["evaluation"]["fp"] == 0
    # the stored description is recognition's own: the same keypoints and SHOT rows
    from scanforest.kernels.recognition import describe

    st = ScanStore(world["store"], mode="r")
    d = describe(st.read(sid, "points").astype(np.float32), normal_radius=0.015, keypoint_radius=0.015,
                 descr_rad=0.04, device="cpu")
    np.testing.assert_array_equal(st.read(sid, "kp_index"), d["keypoints"])
    np.testing.assert_array_equal(st.read(sid, "kp_shot"), d["descriptors"])


def test_a_scene_described_otherwise_is_recognised_from_its_points(world):
    sid = _scene(world, "scene_other")
    _describe(world, sid, DescribeParams(normal_k=10, keypoint_radius=0.02, shot_radius=0.04))
    _match(world, sid)
    res = recognize_scan(world["store"], sid, "lib", REC, device="cpu")
    assert res["source"] == "recomputed"
    assert "described with other parameters" in res["reason"] and "keypoint_radius 0.02" in res["reason"]
    assert ScanStore(world["store"], mode="r").stage(sid, "recognize")["source"] == "recomputed"
    _same(world, sid, _want(world, sid))


def test_matches_that_do_not_fit_are_not_used(world):
    st = ScanStore(world["store"])
    lib = ScanStore(world["store"], mode="r").catalog.library_attrs("lib")
    sid = _scene(world, "scene_fit")
    assert stored_inputs(st, sid, "lib", lib, REC)["reason"] == "the scan is not described"
    _describe(world, sid)
    assert stored_inputs(st, sid, "lib", lib, REC)["reason"] == "the scan is not matched"
    _match(world, sid, k=2)
    assert stored_inputs(st, sid, "lib", lib, REC)["fits"]
    why = stored_inputs(st, sid, "lib", lib, {**REC, "ratio": 0.9})["reason"]
    assert why == "matched with k=2; recognition needs 3 neighbours"
    # another library (or this one rebuilt): the index is not over it
    assert "not built over this library" in stored_inputs(st, sid, "other", lib, REC)["reason"]
    # an index over scans, not over the library
    ref = st.read(sid, "kp_shot")
    idx.build_index(world["store"], "scans", ref[np.isfinite(ref).all(axis=1)], params={"method": "exact"},
                    scans=[sid])
    _match(world, sid, k=4, index="scans")
    assert "not built over this library" in stored_inputs(st, sid, "lib", lib, REC)["reason"]
    res = recognize_scan(world["store"], sid, "lib", REC, device="cpu")
    assert res["source"] == "recomputed"
    _same(world, sid, _want(world, sid))
    # the index rebuilt since the scene was matched
    _match(world, sid)
    assert stored_inputs(st, sid, "lib", lib, REC)["fits"]
    g = st.root["indexes"]["ix"]
    old = g.attrs["content_hash"]
    try:
        g.attrs["content_hash"] = "rebuilt"
        assert stored_inputs(st, sid, "lib", lib, REC)["reason"] == "index 'ix' was rebuilt since the scan was matched"
    finally:
        g.attrs["content_hash"] = old


def test_recognize_resumes_and_redoes_a_scene_described_or_matched_again(world):
    store = world["store"]
    sid = _scene(world, "scene_resume")
    _describe(world, sid)
    _match(world, sid)
    first = recognize_scan(store, sid, "lib", REC, device="cpu")
    assert first["status"] == "recognized" and first["source"] == "stored"
    again = recognize_scan(store, sid, "lib", REC, device="cpu")
    assert again["status"] == "skipped" and again["source"] == "stored"
    # described again with other parameters: the matches are stale too; recognised again, from its points
    _describe(world, sid, DescribeParams(normal_k=10, keypoint_radius=0.02, shot_radius=0.04))
    redo = recognize_scan(store, sid, "lib", REC, device="cpu")
    assert redo["status"] == "recognized" and redo["source"] == "recomputed"
    assert recognize_scan(store, sid, "lib", REC, device="cpu")["status"] == "skipped"
    # described as recognition describes again: the old matches belong to another description, so
    # they are not used (and the detections recognised from the points stand)
    _describe(world, sid)
    st = ScanStore(store)
    reason = stored_inputs(st, sid, "lib", st.catalog.library_attrs("lib"), REC)["reason"]
    assert reason == "the matches are older than the description (the scan was described again)"
    assert recognize_scan(store, sid, "lib", REC, device="cpu")["status"] == "skipped"
    # matched again (the match stage sees the new description): recognised again, from the store
    assert _match(world, sid)["status"] == "matched"
    assert _match(world, sid)["status"] == "skipped"
    last = recognize_scan(store, sid, "lib", REC, device="cpu")
    assert last["status"] == "recognized" and last["source"] == "stored"
    _same(world, sid, _want(world, sid))
    # described again with the same parameters (forced): a new describe record, recognised again
    _describe(world, sid, force=True)
    _match(world, sid)
    assert recognize_scan(store, sid, "lib", REC, device="cpu")["status"] == "recognized"


def test_index_build_refuses_both_or_neither_reference(world):
    from scanforest.flows.inputs import check_index_build

    with pytest.raises(InputError, match="not both"):
        check_index_build(world["store"], ["scene_x"], 1, {}, "float32", library="lib")
    with pytest.raises(InputError, match="no complete model library 'nope'"):
        check_index_build(world["store"], None, 1, {}, "float32", library="nope")
    with pytest.raises(InputError, match="no reference scans"):
        check_index_build(world["store"], None, 1, {}, "float32")
    check_index_build(world["store"], None, 1, {}, "float32", library="lib")


def test_a_failed_batched_recognition_is_said_and_counted(world, monkeypatch, caplog):
    """The one pass recognises a chunk of scans together; when that fails, the scans are
    recognised one by one (the same detections) and the failure is logged and kept on each scan's
    record: a GPU fault must not show up only as a slowdown."""
    import logging

    from scanforest.tasks import pipeline, recognize as rz

    def broken(*a, **k):
        raise RuntimeError("injected batch fault")

    monkeypatch.setattr(rz, "_recognize_stored_many", broken)
    sid = _scene(world, "scene_fallback")
    with caplog.at_level(logging.WARNING, logger="scanforest"):
        recs = pipeline.process_batch(world["store"], [sid], library="lib", index="ix", params=REC, k=4, device="cpu")
    assert recs[0]["status"] == "recognized", recs[0]
    assert recs[0]["batched_fallback"] == "RuntimeError: injected batch fault"
    assert "batched recognition of 1 scans failed (RuntimeError: injected batch fault)" in caplog.text
    _same(world, sid, _want(world, sid))


def test_a_scan_short_of_device_memory_runs_again_after_the_cache_is_released(world, monkeypatch, caplog):
    """A scan whose recognition runs out of device memory (cuBLAS's workspace, CuPy's pool) is
    run once more after the worker gives its cached blocks back: the same detections as an
    undisturbed run, the first failure kept on its record and counted; a second failure stays a
    failure, with where it happened."""
    import logging

    from scanforest.tasks import pipeline, recognize as rz

    class CUBLASError(RuntimeError):
        pass

    calls, released = {"n": 0}, []
    one, many = rz._recognize_stored, rz._recognize_stored_many

    def short_once(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise CUBLASError("CUBLAS_STATUS_ALLOC_FAILED")
        return one(*a, **k)

    def batch_fails(*a, **k):
        raise CUBLASError("CUBLAS_STATUS_ALLOC_FAILED")

    monkeypatch.setattr(rz, "_recognize_stored_many", batch_fails)
    monkeypatch.setattr(rz, "_recognize_stored", short_once)
    monkeypatch.setattr(pipeline, "release_gpu_cache", lambda: released.append(1))
    sid = _scene(world, "scene_short_of_memory")
    with caplog.at_level(logging.WARNING, logger="scanforest"):
        recs = pipeline.process_batch(world["store"], [sid], library="lib", index="ix", params=REC, k=4, device="cpu")
    assert recs[0]["status"] == "recognized", recs[0]
    assert recs[0]["device_memory_retry"] == "CUBLASError: CUBLAS_STATUS_ALLOC_FAILED" and released == [1]
    assert "1 scan(s) ran out of device memory (CUBLASError: CUBLAS_STATUS_ALLOC_FAILED)" in caplog.text
    _same(world, sid, _want(world, sid))

    def always_short(*a, **k):
        raise CUBLASError("CUBLAS_STATUS_ALLOC_FAILED")

    monkeypatch.setattr(rz, "_recognize_stored", always_short)
    sid = _scene(world, "scene_short_twice")
    recs = pipeline.process_batch(world["store"], [sid], library="lib", index="ix", params=REC, k=4, device="cpu")
    assert recs[0]["status"] == "failed" and recs[0]["device_memory"] and len(released) == 2
    assert recs[0]["where"].startswith("test_one_pipeline.py:") and "always_short" in recs[0]["where"], recs[0]
    monkeypatch.setattr(rz, "_recognize_stored_many", many)


def test_a_process_task_run_retried_after_a_transient_error_counts_each_scene_once(world, monkeypatch, tmp_path,
                                                                                  prefect_api):
    """The one pass's task run holds three batches (one Dask task each); the second fails once
    with a transient error after its scene was written. Prefect retries the task run: every scene
    is counted once as recognised by this run (the ones the first try wrote are this run's, not
    skipped), and each holds the detections of an undisturbed run."""
    from scanforest.flows import batching, prefect_tasks
    from scanforest.flows.archive import process_flow
    from scanforest.tasks import pipeline

    pts = world["scene"].points[:8000]
    sids = [f"scene_retry_{i}" for i in range(3)]
    for sid in sids:
        ScanStore(world["store"]).write_scan(sid, {"points": pts}, {"sha256": sid})
    from _faults import fails_once

    marks = tmp_path / "calls"
    flaky = fails_once(pipeline.process_batch, marks)  # the second Dask task, its scene written
    in_parts = prefect_tasks.in_parts
    monkeypatch.setattr(prefect_tasks, "in_parts", lambda fn, *a, **k: in_parts(flaky, *a, **k))
    monkeypatch.setattr(batching, "MIN_TASK_RUNS", 1)  # one task run holds all three batches
    monkeypatch.setattr(batching, "TASK_RUNS_PER_WORKER", 1)
    s = process_flow(world["store"], sids, library="lib", index="ix", k=4, params=REC, device="cpu",
                     scheduler=world["client"].scheduler.address, batch=1, progress=False)
    assert len(list(marks.iterdir())) == 6  # the task run's three batches, twice
    assert s["recognized"] == 3 and s["skipped"] == 0 and s["failed"] == 0, s
    for sid in sids:
        _same(world, sid, _want(world, sid))


def test_one_batch_opens_the_store_once(world, monkeypatch):
    """A batch of the one pass opens the store once: the library's and the index's attributes,
    the library and the index's shards (cold or warm in this process) and every scan's reads and
    writes go through that one opened store."""
    import zarr

    from scanforest.tasks import pipeline, recognize as rz

    opened, groups = [], []
    init, open_group = ScanStore.__init__, zarr.open_group

    def counted_init(self, path, *a, **k):
        opened.append(str(path))
        init(self, path, *a, **k)

    def counted_open_group(*a, **k):
        groups.append(a[0] if a else k.get("store"))
        return open_group(*a, **k)

    st = ScanStore(world["store"])
    pts = world["scene"].points[:4000]
    sids = [f"scene_open_once_{i}" for i in range(2)]
    for sid in sids:
        st.write_scan(sid, {"points": pts}, {"sha256": sid})
    monkeypatch.setattr(ScanStore, "__init__", counted_init)
    monkeypatch.setattr(zarr, "open_group", counted_open_group)
    for cold in (True, False):  # the library and the shards loaded here, then found in this process's caches
        if cold:
            pipeline._resident_index.cache_clear()
            rz._load_library_cached.cache_clear()
        opened.clear(), groups.clear()
        recs = pipeline.process_batch(world["store"], sids, library="lib", index="ix", params=REC, k=4, device="cpu")
        assert [r["status"] for r in recs] == (["recognized"] * 2 if cold else ["skipped"] * 2), recs
        assert opened == [world["store"]] and len(groups) == 1, (cold, opened, groups)


def test_stored_shards_read_the_index_attrs_once(world, monkeypatch):
    opened = []
    init = ScanStore.__init__

    def counted_init(self, path, *a, **k):
        opened.append(str(path))
        init(self, path, *a, **k)

    monkeypatch.setattr(ScanStore, "__init__", counted_init)
    src = idx.StoredShards(world["store"], "ix")
    assert src.attrs["shards"] == src.attrs["shards"] and len(src.attrs["shards"]) == 2
    assert opened == [world["store"]]


def test_a_worker_warms_up_once_in_the_background():
    """``warm_worker`` (the archive's GPU workers, while the library and the index are built)
    starts one background warm-up per process that runs the description and search kernels on a
    synthetic cloud; the first batch waits for it, a second call starts nothing."""
    from scanforest.tasks import pipeline

    pipeline.warm_worker("cpu")
    pipeline._WARM.wait_done()
    assert pipeline.warm_worker("cpu") is False
    assert pipeline._WARM.error is None and pipeline._WARM.seconds is not None and pipeline._WARM.seconds > 0
    rep = pipeline.warm_up_report()  # what bench archive reads from every worker
    assert rep["error"] is None and rep["started_at"] <= rep["ended_at"]
    assert rep["ended_at"] - rep["started_at"] == pytest.approx(rep["seconds"], abs=0.05)
    assert set(rep["phases"]) == {"imports", "device", "describe", "search"}
    assert sum(rep["phases"].values()) == pytest.approx(rep["seconds"], abs=0.05)
