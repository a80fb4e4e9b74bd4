"""Benchmarks measured over several commands: ``bench archive`` stage by stage (the stage
selection, the refusal to run a stage without its predecessors, the whole-archive figures from
recorded stages) and ``bench match`` worker count by worker count."""
from __future__ import annotations

import json

import pytest

from scanforest.flows import bench_archive as ba
from scanforest.flows._bench import BenchReport
from scanforest.kernels.errors import InputError


def test_stage_selection_is_validated_and_ordered():
    assert ba.parse_stages("all") == list(ba.STAGES)
    assert ba.parse_stages("match,describe") == ["describe", "match"]
    with pytest.raises(InputError, match="unknown stage"):
        ba.parse_stages("ingest,detect")
    with pytest.raises(InputError, match="consecutive"):
        ba.parse_stages("ingest,recognize")


def test_a_later_stage_needs_the_earlier_ones_recorded(tmp_path):
    with pytest.raises(InputError, match=r"\['ingest', 'describe', 'match'\] were not run"):
        ba.run(4, 1000, 2, 1, "cpu", tmp_path, None, stages_to_run=["recognize"])
    # a record made with another configuration does not count
    cfg = {"scans": 4, "points": 1000, "models": 2, "device": "cpu", "workers": 2}
    (tmp_path / ba.RECORD).write_text(json.dumps({"config": cfg, "stages": {"ingest": {}, "describe": {},
                                                                              "match": {}}}))
    with pytest.raises(InputError, match="were not run"):
        ba.run(4, 1000, 2, 1, "cpu", tmp_path, None, stages_to_run=["recognize"])
    assert ba._load_record(tmp_path / ba.RECORD, cfg).keys() == {"ingest", "describe", "match"}


def test_whole_archive_figures_from_recorded_stages():
    def r(wall, task, nw, **kw):
        return {"wall": wall, "task_seconds": task, "workers": nw, "scans": 100, "util": {}, "when": "t", **kw}

    done = {"ingest": r(10, 18, 2), "describe": r(20, 38, 2), "match": r(5, 9, 1),
            "recognize": r(100, 196, 2, precision=0.9, recall=0.8)}
    rep = BenchReport("archive")
    ba._archive_rows(rep, done, 100, "cpu", None)
    rows = {x.figure: x for x in rep.rows}
    busy = 9 + 19 + 5 + 98  # match's busy time (9 s on 1 lane) is clamped to its 5 s wall
    assert rows["whole archive (all stages): orchestration overhead"].value == pytest.approx(100 * (1 - busy / 135))
    assert rows["archive end to end: scans/s"].value == pytest.approx(100 / 135)  # the stages' walls summed
    assert rows["recognize precision"].value == 0.9 and rows["recognize recall"].value == 0.8
    rep = BenchReport("archive")
    ba._archive_rows(rep, done, 100, "cpu", 150.0)  # one invocation's wall clock when it ran them all
    assert {x.figure: x for x in rep.rows}["archive end to end: scans/s"].value == pytest.approx(100 / 150)


def test_bench_match_merges_worker_counts_recorded_on_its_workdir(tmp_path):
    """``bench match --workdir``: each worker count may run in its own command; the efficiency
    uses the recorded queries/s of the same configuration only."""
    from scanforest.flows.bench_match import _merge_recorded

    path = str(tmp_path / "bench-match.json")
    one = BenchReport("match", {"n": 10, "workers": [1], "sync_after": None})
    assert _merge_recorded(path, one, {(1, None): 100.0, (1, 8): 80.0}) == {(1, None): 100.0, (1, 8): 80.0}
    two = BenchReport("match", {"n": 10, "workers": [2], "sync_after": None})
    merged = _merge_recorded(path, two, {(2, None): 150.0})
    assert merged == {(1, None): 100.0, (1, 8): 80.0, (2, None): 150.0}
    assert any("earlier run" in x for x in two.notes)
    other = BenchReport("match", {"n": 20, "workers": [2], "sync_after": None})  # another configuration
    assert _merge_recorded(path, other, {(2, None): 50.0}) == {(2, None): 50.0}
