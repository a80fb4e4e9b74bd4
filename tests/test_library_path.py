"""Models to detections as one path (issue 38, finding 7), run as a user runs it: ``ingest ->
describe -> library build -> match --library -> recognize``. ``library build`` makes the model
library and the index over it as a stage of its own (a no-op when nothing changed), ``match
--library`` matches the scenes against that index, and ``recognize`` (the library's models and
parameters) takes every scene from those stored results: ``from_stored`` all, ``recomputed 0``,
with the detections of a plain recognition from the points. The summary names each recomputed
scene with its reason.

One small synthetic store (2 models, 2 scenes of 20k points) and five flow commands keep the file
near a minute of CI's 2 cores. The README's real-data path (PCL's clouds) is the same commands.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from _userpath import fresh_env, ok, one_line_error, sf

from scanforest.tasks.store import ScanStore

# the sparse synthetic preset (kernels/synthetic/scenes.py) through the command line's options: a
# library described through rendered views with wide SHOT radii, scenes described as recognition does
LIBRARY = ["--model-ss", "0.012", "--descr-rad", "0.06", "--rf-rad", "0.05", "--views", "16"]
DESCRIBE = ["--keypoint-radius", "0.015", "--shot-radius", "0.06"]
RECOGNIZE = ["--scene-ss", "0.015", "--cg-size", "0.02", "--cg-thresh", "3"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return fresh_env(tmp_path_factory, cold=False)


def _json(proc) -> dict:
    return json.loads(ok(proc))


def test_library_build_match_recognize_from_stored_results(env, tmp_path):
    from scanforest.tasks.synth import write_archive

    write_archive(tmp_path / "arch", n_models=2, n_scenes=2, points_per_scene=20_000, points_per_model=3_000,
                  n_instances=2, seed=0)
    store = str(tmp_path / "s.zarr")
    run = dict(env=env, cwd=tmp_path)
    assert _json(sf("ingest", str(tmp_path / "arch"), store, "--json", **run))["ingested"] == 4
    scenes = sorted(s for s in ScanStore(store, mode="r").scans() if s.startswith("scenes__"))
    assert _json(sf("describe", store, *DESCRIBE, "--json", **run))["described"] == 4

    lib = _json(sf("library", "build", store, "-m", "models__*", *LIBRARY, "--json", **run))
    assert lib["library_status"] == "built" and lib["index_status"] == "built" and lib["models"] == 2, lib
    assert lib["reference_descriptors"] > 1000 and lib["index"] == "library-default"
    # unchanged models and parameters: a no-op
    again = _json(sf("library", "build", store, "-m", "models__*", *LIBRARY, "--json", **run))
    assert again["status"] == "unchanged" and again["index_status"] == "unchanged", again

    m = _json(sf("match", store, "--library", "default", "--json", **run))
    assert m["matched"] == 2 and m["index"] == "library-default" and m["library"] == "default", m
    # no --models: the library's models, with its parameters (used as built, not rebuilt)
    rc = _json(sf("recognize", store, *RECOGNIZE, "--json", **run))
    assert rc["recognized"] == 2 and rc["from_stored"] == 2 and rc["recomputed"] == 0, rc
    assert "recompute_reasons" not in rc and rc["failed"] == 0 and rc["library"] == "unchanged", rc

    # the same detections (models and poses) as a plain recognize, which describes and matches each
    # scene itself (recognize_scan's recomputed path: sf.recognize on the points with the library)
    from scanforest.kernels.recognition import recognize
    from scanforest.tasks.recognize import load_library

    st = ScanStore(store, mode="r")
    library = load_library(store, "default")
    params = dict(scene_ss=0.015, method="hough", cg_size=0.02, cg_thresh=3)
    found = 0
    for s in scenes:
        rec = st.attrs(s)["stages"]["recognize"]
        assert rec["source"] == "stored" and rec["reason"] is None
        want = recognize(st.read(s, "points").astype(np.float32), library, device="cpu", **params)
        assert [d["model_id"] for d in rec["detections"]] == [d.model_id for d in want], s
        for d, w in zip(rec["detections"], want):
            np.testing.assert_allclose(np.asarray(d["pose"]), w.pose, atol=1e-5)
        found += len(want)
    assert found >= 1  # something was compared

    # no index over a library that is not there: one line, exit 2
    one_line_error(sf("match", store, "--library", "nope", **run), "nope", "library build")


def test_recognize_summary_names_each_recomputed_scene_and_why():
    from scanforest.flows.recognize import summarize

    recs = [{"scan_id": "a", "status": "recognized", "source": "stored", "reason": None},
            {"scan_id": "b", "status": "recognized", "source": "recomputed", "reason": "the scan is not matched"},
            {"scan_id": "c", "status": "recognized", "source": "recomputed", "reason": "the scan is not described"},
            {"scan_id": "d", "status": "skipped", "source": "stored"}]
    s = summarize(recs)
    assert s["from_stored"] == 1 and s["recomputed"] == 2 and s["skipped"] == 1
    assert s["recomputed_scenes"] == {"b": "the scan is not matched", "c": "the scan is not described"}
    assert s["recompute_reasons"] == {"the scan is not matched": 1, "the scan is not described": 1}
    assert "recomputed_scenes" not in summarize(recs[:1])
