"""Models to detections as one path (issue 38, finding 7): the summary of ``recognize`` names each
recomputed scene with its reason. The path itself, run as a user runs it (``ingest -> describe ->
library build -> match --library -> recognize``, nothing recomputed, ``library build`` again a
no-op, ``match --library`` of a missing library one line), is the README's real-data path on
PCL's clouds: ``test_user_paths.py::test_pcl_clouds_through_every_stage_and_the_report`` (one
pipeline of flow commands, where a synthetic copy of it cost CI two minutes).
"""
from __future__ import annotations


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
