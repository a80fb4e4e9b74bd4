"""Benchmarks measured over several commands: ``bench archive`` stage by stage (the stage
selection, the refusal to run a stage without its predecessors, the whole-archive figures from
recorded stages) and ``bench match`` worker count by worker count."""
from __future__ import annotations

import json

import numpy as np
import pytest

from scanforest.deploy.bench import archive as ba
from scanforest.deploy.bench._common import BenchReport
from scanforest.kernels.errors import InputError


def test_stage_selection_is_validated_and_ordered():
    assert ba.parse_stages("all") == list(ba.STAGES)
    assert ba.parse_stages("match,describe") == ["describe", "match"]
    with pytest.raises(InputError, match="unknown stage"):
        ba.parse_stages("ingest,detect")
    with pytest.raises(InputError, match="consecutive"):
        ba.parse_stages("ingest,recognize")
    # the one pass: ingest, then describe + match + recognize as one stage
    assert ba.parse_stages("all", "one-pass") == ["ingest", "process"]
    with pytest.raises(InputError, match="unknown stage"):
        ba.parse_stages("recognize", "one-pass")
    with pytest.raises(InputError, match="--pipeline must be"):
        ba.parse_stages("all", "fast")


def test_a_later_stage_needs_the_earlier_ones_recorded(tmp_path):
    with pytest.raises(InputError, match=r"\['ingest', 'describe', 'match'\] were not run"):
        ba.run(4, 1000, 2, 1, "cpu", tmp_path, None, stages_to_run=["recognize"], pipeline="staged")
    # a record made with another configuration does not count
    cfg = {"scans": 4, "points": 1000, "models": 2, "device": "cpu", "workers": 2}
    (tmp_path / ba.RECORD).write_text(json.dumps({"config": cfg, "stages": {"ingest": {}, "describe": {},
                                                                              "match": {}}}))
    with pytest.raises(InputError, match="were not run"):
        ba.run(4, 1000, 2, 1, "cpu", tmp_path, None, stages_to_run=["recognize"], pipeline="staged")
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
    # the stages' walls summed, labelled as the sum it is (no start-up inside it)
    assert "archive end to end: scans/s" not in rows
    assert rows["archive, sum of the stages' walls (start-ups and builds not included): scans/s"].value == \
        pytest.approx(100 / 135)
    assert rows["recognize precision"].value == 0.9 and rows["recognize recall"].value == 0.8
    rep = BenchReport("archive")
    ba._archive_rows(rep, done, 100, "cpu", 150.0)  # one invocation's wall clock when it ran them all
    assert {x.figure: x for x in rep.rows}["archive end to end: scans/s"].value == pytest.approx(100 / 150)


def test_bench_match_merges_worker_counts_recorded_on_its_workdir(tmp_path):
    """``bench match --workdir``: each worker count may run in its own command; the efficiency
    uses the recorded (queries/s, recall) of the same configuration only, whatever the
    synchronisation and budgets each command ran."""
    from scanforest.deploy.bench.match import _merge_recorded

    path = str(tmp_path / "bench-match.json")
    one = BenchReport("match", {"n": 10, "workers": [1], "sync_after": None, "backtracks": 384})
    first = {(1, None, 384): (100.0, 0.93), (1, 8, 384): (80.0, 0.94)}
    assert _merge_recorded(path, one, dict(first)) == first
    two = BenchReport("match", {"n": 10, "workers": [2], "sync_after": 8, "backtracks": [192, 256]})
    merged = _merge_recorded(path, two, {(2, None, 192): (300.0, 0.88), (2, 8, 256): (140.0, 0.95)})
    assert merged == {**first, (2, None, 192): (300.0, 0.88), (2, 8, 256): (140.0, 0.95)}
    assert any("earlier run" in x for x in two.notes)
    other = BenchReport("match", {"n": 20, "workers": [2], "sync_after": None})  # another configuration
    assert _merge_recorded(path, other, {(2, None, 64): (50.0, 0.9)}) == {(2, None, 64): (50.0, 0.9)}


def test_bench_match_efficiency_at_the_same_budget_and_at_matched_recall():
    """The same-budget efficiency divides by W x the 1-worker rate at that budget; the
    matched-recall efficiency takes the fastest W-worker budget whose recall is at least the
    1-worker recall (the figures of the 10M x 352 runs on 2 H200s)."""
    from scanforest.deploy.bench.match import _efficiency_rows

    qps = {(1, None, 384): (14562.0, 0.9307), (2, None, 384): (18297.0, 0.9799),
           (2, None, 192): (33664.0, 0.8807), (2, None, 256): (25765.0, 0.9426)}
    rep = BenchReport("match", {})
    _efficiency_rows(rep, qps, "gpu")
    rows = {x.figure: x.value for x in rep.rows}
    assert rows["parallel efficiency 1 -> 2 workers, 384 leaves per shard"] == pytest.approx(18297 / (2 * 14562))
    matched = [f for f in rows if "at recall >= 0.931" in f]
    assert len(matched) == 1 and "2 workers 256 leaves per shard" in matched[0]  # 192 misses the recall
    assert rows[matched[0]] == pytest.approx(25765 / (2 * 14562))
    one_budget = BenchReport("match", {})  # one budget: no matched-recall row (it would repeat the other)
    _efficiency_rows(one_budget, {(1, None, 384): (1.0, 0.9), (2, None, 384): (1.5, 0.95)}, "gpu")
    assert [x.figure for x in one_budget.rows] == ["parallel efficiency 1 -> 2 workers"]


def test_bench_match_curve_on_cpu_one_index_for_every_budget(tmp_path):
    """``bench match --backtracks 4,16``, one worker count per command on a kept workdir: the
    index is built once (budgets are set per query), the second command merges the first's
    figures, and every efficiency row is the ratio of the queries/s rows it names."""
    from scanforest.deploy.bench import match as bench_match

    kw = dict(method="banns", backtracks=[4, 16], leaf_size=16, device="cpu", block=100, clusters=10, shards=2,
              store_dtype="float16",
              workdir=str(tmp_path / "wd"))
    one = bench_match.run(1500, 150, 8, 4, [1], out=str(tmp_path / "one.json"), **kw)
    two = bench_match.run(1500, 150, 8, 4, [2], out=str(tmp_path / "two.json"), **kw)
    r1 = {x.figure: x.value for x in one.rows}
    r2 = {x.figure: x.value for x in two.rows}
    assert "index build (write + trees), 2 shards" in r1
    assert "index build (unchanged in the workdir: same generated data and parameters), 2 shards" in r2
    assert any("reference generated" in x for x in one.notes)
    assert not any("reference generated" in x for x in two.notes)  # nothing regenerated
    for b in (4, 16):
        assert 0 < r2[f"recall@4, 2 workers, {b} leaves per shard"] <= 1
        assert 0 < r2[f"worker busy share (searches + merges / workers x wall), 2 workers, {b} leaves per shard"]
        eff = r2[f"parallel efficiency 1 -> 2 workers, {b} leaves per shard"]
        assert eff == pytest.approx(r2[f"banns queries/s, 2 workers, {b} leaves per shard"]
                                    / (2 * r1[f"banns queries/s, 1 worker, {b} leaves per shard"]))
    assert any("earlier run" in x for x in two.notes)
    assert any(f.startswith("parallel efficiency 1 -> 2 workers at recall >=") for f in r2)
    other = bench_match.run(1500, 150, 8, 4, [1], out=str(tmp_path / "o.json"),
                            **{**kw, "clusters": 11, "backtracks": [4]})
    assert "index build (write + trees), 2 shards" in {x.figure for x in other.rows}  # other data: rebuilt
    with pytest.raises(InputError, match="positive leaf counts"):
        bench_match.run(100, 10, 8, 4, [1], method="banns", backtracks=[4, None], leaf_size=16, device="cpu",
                        block=10, out=None)


def test_bench_match_reference_drawn_on_the_workers(tmp_path):
    """``bench match --reference workers``: no store is written; the shards are drawn and
    indexed on the workers, an unlimited search has recall 1 against the brute force over the
    same rows, and a bad choice is refused."""
    from scanforest.deploy.bench import match as bench_match

    rep = bench_match.run(1200, 60, 8, 4, [1, 2], method="banns", backtracks=[None], leaf_size=16, device="cpu",
                          block=30, clusters=10, shards=2, store_dtype="float16", reference="workers",
                          out=str(tmp_path / "w.json"), workdir=str(tmp_path / "wd"))
    rows = {x.figure: x.value for x in rep.rows}
    assert not any(f.startswith("index build") for f in rows)
    assert not any(p.name.endswith(".zarr") for p in (tmp_path / "wd").iterdir())
    assert "shard load (rows drawn on the workers' cpus, trees built there), 2 workers" in rows
    for w in ("1 workers", "2 workers"):
        assert rows[f"recall@4, {w}"] == 1.0
    assert any("drawn on the workers, no store" in x for x in rep.notes)
    with pytest.raises(InputError, match="'store' or 'workers'"):
        bench_match.run(100, 10, 8, 4, [1], method="banns", backtracks=[4], leaf_size=16, device="cpu",
                        block=10, out=None, reference="disk")


def test_bench_match_reference_in_pieces():
    """Above ``whole_max`` rows the reference is made piece by piece (own seeds) straight into
    the stored dtype; at most ``whole_max`` it is the one-piece data of earlier runs."""
    from scanforest.deploy.bench._data import clustered
    from scanforest.deploy.bench.match import _reference

    whole = _reference(3000, 8, 10, "cpu", "float32")
    np.testing.assert_array_equal(whole, clustered(3000, 8, clusters=10, seed=1))
    parts = _reference(3000, 8, 10, "cpu", "float16", piece=1000, whole_max=0)
    assert parts.dtype == np.float16 and parts.shape == (3000, 8) and np.isfinite(parts).all()
    assert not np.array_equal(parts[:1000], parts[1000:2000])  # each piece its own draw
    np.testing.assert_array_equal(parts[:1000], clustered(1000, 8, clusters=10, seed=1_000_004).astype(np.float16))


def _rows(rep):
    return {r.figure: r for r in rep.rows}


def test_bench_tools_measures_every_tool_against_one_exact_answer(tmp_path):
    """scanforest's forest and FAISS on one data set: an unlimited-enough budget and FAISS's flat
    index are exact under the common recall rule, the approximate indexes lie in (0, 1], and the
    matched-recall rows compare scanforest's fastest point at the target with each tool's."""
    pytest.importorskip("faiss")
    from scanforest.deploy.bench import tools as bench_tools

    out = tmp_path / "tools.json"
    rep = bench_tools.run(3000, 200, 16, 4, device="cpu", trees=2, leaf_size=16, budgets=[2, 400], nprobes=[1, 8],
                          ef_search=[8, 64], threads=2, clusters=30, repeat=1, targets=[0.95], out=out)
    rows = _rows(rep)
    assert rows["scanforest KDForest recall@4, 2 trees, 400 leaves"].value == 1.0  # every leaf of both trees
    assert 0 < rows["scanforest KDForest recall@4, 2 trees, 2 leaves"].value < 1.0
    assert rows["FAISS IndexFlatL2 (exact) recall@4, exhaustive"].value == 1.0
    ivf = [r for f, r in rows.items() if f.startswith("FAISS IndexIVFFlat") and "recall" in f]
    hnsw = [r for f, r in rows.items() if f.startswith("FAISS IndexHNSWFlat") and "recall" in f]
    assert len(ivf) == 2 and len(hnsw) == 2 and all(0 < r.value <= 1 for r in ivf + hnsw)
    assert ivf[0].value <= ivf[1].value  # more probes never lose neighbours
    matched = [r for f, r in rows.items() if " vs FAISS " in f]
    assert {r.baseline.split(" (")[0] for r in matched} >= {"FAISS IndexFlatL2"}
    flat = next(r for r in matched if "IndexFlatL2" in r.figure)
    assert flat.baseline_value == rows["FAISS IndexFlatL2 (exact) queries/s, exhaustive"].value
    mine = {"2 leaves": rows["scanforest KDForest banns queries/s, 2 trees, 2 leaves"],
            "400 leaves": rows["scanforest KDForest banns queries/s, 2 trees, 400 leaves"],
            "exact brute force": rows["scanforest exact brute force queries/s (cpu)"]}
    fastest = max((r.value, name) for name, r in mine.items() if name == "exact brute force"
                  or r.extra["recall"] >= 0.95)
    assert flat.value == fastest[0] and f"scanforest ({fastest[1]}, " in flat.figure
    assert json.loads(out.read_text())["bench"] == "tools"
    with pytest.raises(InputError, match="--budgets"):
        bench_tools.run(100, 10, 4, 2, device="cpu", budgets=[0], out=out)
    with pytest.raises(InputError, match="--target"):
        bench_tools.run(100, 10, 4, 2, device="cpu", targets=[1.5], out=out)


def test_bench_tools_times_every_tool_at_query_batches(tmp_path):
    """``--batches``: each tool also searches the queries in batches (one call each); the answers
    in batches are the full set's (the same recall, exact for exact tools), a size not below the
    query count adds nothing, and the matched-recall rows are repeated within each size against
    that size's figures."""
    pytest.importorskip("faiss")
    from scanforest.deploy.bench import tools as bench_tools

    rep = bench_tools.run(2000, 150, 16, 4, device="cpu", trees=2, leaf_size=16, budgets=[400], nprobes=[8],
                          ef_search=[], threads=2, clusters=30, repeat=1, targets=[0.95], batches=[40, 500],
                          out=tmp_path / "b.json")
    rows = _rows(rep)
    batched = {f: r for f, r in rows.items() if ", batches of " in f and " vs " not in f}
    assert batched and all(", batches of 40 (" in f for f in batched)  # 500 >= 150 queries: the full set
    names = {f.split(" queries/s")[0].split(" nlist=")[0] for f in batched}
    assert names == {"scanforest exact brute force", "scanforest KDForest banns", "FAISS IndexFlatL2 (exact)",
                     "FAISS IndexIVFFlat"}, names
    forest = rows["scanforest KDForest banns queries/s, 2 trees, 400 leaves, batches of 40 (recall@4 1.000)"]
    assert forest.extra["recall"] == 1.0 and forest.extra["batch"] == 40
    assert rows["FAISS IndexFlatL2 (exact) queries/s, exhaustive, batches of 40 (recall@4 1.000)"].extra["recall"] == 1
    ivf = next(r for f, r in batched.items() if f.startswith("FAISS IndexIVFFlat"))
    whole = next(r for f, r in rows.items() if f.startswith("FAISS IndexIVFFlat") and "recall@4, nprobe=8" in f)
    assert ivf.extra["recall"] == whole.value
    matched = {r.baseline: r for f, r in rows.items() if f.startswith("batches of 40: ")}
    flat = matched["FAISS IndexFlatL2 (exact) (cpu (2 threads)), batches of 40"]
    assert flat.baseline_value == rows["FAISS IndexFlatL2 (exact) queries/s, exhaustive, batches of 40 "
                                       "(recall@4 1.000)"].value
    assert flat.value == max(r.value for f, r in batched.items() if f.startswith("scanforest"))
    with pytest.raises(InputError, match="--batches"):
        bench_tools.run(100, 10, 4, 2, device="cpu", batches=[0], out=tmp_path / "c.json")


def test_bench_tools_flann_baseline(tmp_path):
    """FLANN's KD-forest through deploy/baselines/flann_knn_bench.cpp, built here when
    libflann-dev is installed: checks covering every point of every tree are exact."""
    import shutil
    import subprocess
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "deploy" / "baselines" / "flann_knn_bench.cpp"
    if not Path("/usr/include/flann/flann.hpp").exists() or shutil.which("g++") is None:
        pytest.skip("libflann-dev and g++ are needed to build the FLANN baseline")
    binary = tmp_path / "flann_knn_bench"
    subprocess.run(["g++", "-O2", "-fopenmp", str(src), "-o", str(binary), "-llz4"], check=True)
    from scanforest.deploy.bench import tools as bench_tools

    rep = bench_tools.run(2000, 100, 8, 4, device="cpu", trees=2, leaf_size=16, budgets=[300],
                          flann_baseline=str(binary), flann_checks=[16, 4000], nprobes=[], ef_search=[],
                          threads=2, clusters=20, repeat=1, out=tmp_path / "t.json")
    rows = _rows(rep)
    assert rows["FLANN KDTreeIndex recall@4, 2 trees, checks=4000"].value == 1.0
    assert 0 < rows["FLANN KDTreeIndex recall@4, 2 trees, checks=16"].value < 1.0
    assert rows["FLANN KDTreeIndex build, 2 trees"].value > 0
    bad = bench_tools.run(500, 10, 8, 2, device="cpu", trees=2, leaf_size=16, budgets=[4],
                          flann_baseline=str(tmp_path / "missing"), nprobes=[], ef_search=[], threads=1,
                          repeat=1, out=tmp_path / "b.json")
    assert any("failed" in n for n in bad.notes) and not any(r.figure.startswith("FLANN") for r in bad.rows)


def test_bench_tools_several_forests_compete_as_one_tool(tmp_path):
    """``forests``: a forest per leaf size, each at its budgets, a curve each (the report's
    curve key is the name before "queries/s"); the matched-recall row takes scanforest's fastest
    point of any forest; the CLI's GPU default is two forests. A bad leaf size is one InputError."""
    pytest.importorskip("faiss")
    from scanforest.deploy.bench import tools as bench_tools
    from scanforest.flows.report import _curve_key

    rep = bench_tools.run(2000, 100, 16, 4, device="cpu", trees=1, forests=[(8, [1, 500]), (64, [1])],
                          nprobes=[4], ef_search=[], threads=2, clusters=20, repeat=1, targets=[0.5],
                          out=tmp_path / "t.json")
    rows = _rows(rep)
    a = rows["scanforest KDForest (leaf size 8) banns queries/s, 1 trees, 500 leaves"]
    b = rows["scanforest KDForest (leaf size 64) banns queries/s, 1 trees, 1 leaves"]
    assert a.extra["leaf_size"] == 8 and b.extra["leaf_size"] == 64
    assert rows["scanforest KDForest (leaf size 8) recall@4, 1 trees, 500 leaves"].value == 1.0
    rec = {"bench": "tools"}
    assert _curve_key(rec, {"figure": a.figure}) != _curve_key(rec, {"figure": b.figure})
    ours = [r for f, r in rows.items() if f.startswith("scanforest KDForest (") and " queries/s" in f
            and r.extra["recall"] >= 0.5] + [rows["scanforest exact brute force queries/s (cpu)"]]
    matched = next(r for f, r in rows.items() if " vs FAISS IndexIVFFlat" in f)
    assert matched.value == max(r.value for r in ours)
    assert [ls for ls, _ in bench_tools.DEFAULTS["gpu"]["forests"]] == [32, 128]
    with pytest.raises(InputError, match="--leaf-size"):
        bench_tools.run(500, 10, 8, 2, device="cpu", forests=[(0, [4])], nprobes=[], ef_search=[], repeat=1)


def test_bench_motion_accuracy_reports_tracked_epe_next_to_exact():
    """``bench motion``'s accuracy table: per sequence and method the EPE / coverage with exact
    tracks and with ``tracks=None`` (the built-in tracker; OpenCV's when importable), the ratio
    and a summary line; without cv2 the OpenCV columns are dashes."""
    from scanforest.deploy.bench import motion as bf

    have_cv2 = __import__("importlib").util.find_spec("cv2") is not None
    rows = bf.accuracy_rows("cpu", features=40, size=(96, 128))
    assert len(rows) == 8
    for r in rows:
        assert r["tracks_builtin"] > 0 and 0 < r["coverage_builtin"] <= 1
        assert np.isfinite(r["epe_builtin"]) and r["tracked_device"] == "cpu"
        if have_cv2:
            assert r["tracks_opencv"] > 0
            # the built-in tracker follows OpenCV's arithmetic: the same tracks to ~1e-3 px
            assert r["builtin_over_opencv_epe"] == pytest.approx(1.0, abs=0.02)
    text = bf.format_accuracy(rows)
    assert "EPE bi" in text and "bi/cv" in text and "built-in vs OpenCV tracks" in text
    assert len(text.splitlines()) == 2 + len(rows) + 1
    json.dumps(rows)                                     # goes to the report's params as is

    bare = bf.accuracy_rows("cpu", features=40, size=(96, 128), have_cv2=False)
    assert all("epe_opencv" not in r and "builtin_over_opencv_epe" not in r for r in bare)
    assert "OpenCV not importable" in bf.format_accuracy(bare)
    exact = bf.accuracy_rows("cpu", features=40, size=(96, 128), tracked=False)
    assert "EPE bi" not in bf.format_accuracy(exact)
    assert all("epe_builtin" not in r for r in exact)


def test_count_lists_of_the_bench_options_refuse_what_is_not_a_count():
    """``--budgets 8,x`` and the like: one clear error naming the text (exit 2 at the command)."""
    from scanforest.deploy.bench._common import parse_counts
    from scanforest.kernels.errors import InputError

    assert parse_counts("100900, 1m,10k,,1_000") == [100900, 1_000_000, 10_000, 1000]
    for bad in ("4,x", "1q", "inf", "nan"):
        with pytest.raises(InputError, match="is not a count"):
            parse_counts(bad)


@pytest.mark.parametrize("args,words", [
    (["tools", "--real", "{tmp}/no-such-folder", "--device", "cpu"], ["no-such-folder", "no such folder"]),
    (["ann", "--real", "{tmp}/empty", "--sizes", "", "--device", "cpu"], ["empty", "no .pcd/.ply clouds"]),
    (["shot", "--pcl-baseline", "{tmp}/no-such-program"], ["--pcl-baseline", "no such program"]),
    (["tools", "--flann-baseline", "{tmp}/empty", "--device", "cpu"], ["--flann-baseline", "no such program"]),
    (["recognize", "--pcl-baseline", "{tmp}/not-executable"], ["--pcl-baseline", "not executable"]),
    (["match", "--workers", "0", "--device", "cpu"], ["--workers", "'0'"]),
], ids=["real-missing", "real-empty", "pcl-baseline", "flann-baseline-folder", "pcl-baseline-mode", "workers-0"])
def test_bench_inputs_the_user_names_are_checked_in_one_line(tmp_path, monkeypatch, capsys, args, words):
    """A folder, a baseline program or a worker count given to a bench that cannot be used: one
    ``error:`` line naming the option or the path, exit 2, before anything is measured (they were a
    traceback, a note after the run, or a line about ``memory_bytes``)."""
    import sys

    from scanforest.deploy.cli import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    monkeypatch.chdir(tmp_path)
    argv = ["scanforest", "bench", *[a.format(tmp=tmp_path) for a in args], "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    assert not any((tmp_path / "out").glob("*.json"))  # nothing measured


def test_gpu_busy_is_sampled_for_the_visible_cards_only(monkeypatch):
    """nvidia-smi lists every card of the host: a run on GPUs 1 and 3 reports those two."""
    import subprocess
    import types

    from scanforest.deploy.bench._common import Utilization

    smi = ("0, GPU-aaaa, 90, 1000, 81559\n1, GPU-bbbb, 40, 2000, 81559\n2, GPU-cccc, 80, 3000, 81559\n"
           "3, GPU-dddd, 60, 4000, 81559\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=smi))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-dddd")
    u = Utilization()
    u._smi, u._visible = "nvidia-smi", ["1", "GPU-dddd"]
    assert u._gpu_sample() == {"1": 40.0, "3": 60.0}
    assert u.gpu_memory_peak == {"1": 2000.0, "3": 4000.0} and u.gpu_memory_total == 81559.0  # MiB
    u._visible = None  # unset: every card
    assert u._gpu_sample() == {"0": 90.0, "1": 40.0, "2": 80.0, "3": 60.0}
    u._gpu, u._cpu, u._stop, u._thread = {"1": [40.0, 20.0], "3": [60.0]}, [], types.SimpleNamespace(set=lambda: 0), \
        types.SimpleNamespace(join=lambda timeout: 0)
    u.__exit__(None, None, None)
    assert u.gpus == {"1": 30.0, "3": 60.0} and u.gpu == 45.0
    assert u.extra()["gpu_busy_pct_each"] == {"1": 30.0, "3": 60.0} and u.extra()["gpu_busy_pct_min"] == 30.0


def test_gpu_scaling_rows_compare_with_the_smallest_count(capsys):
    def rec(e2e, pro, each, ov):
        rows = [{"figure": "archive end to end: scans/s", "value": e2e, "extra": {}},
                {"figure": "process: scans/s", "value": pro,
                 "extra": {"gpu_busy_pct": sum(each) / len(each), "gpu_busy_pct_min": min(each),
                           "gpu_busy_pct_each": {str(i): v for i, v in enumerate(each)}}},
                {"figure": "whole archive (all stages): orchestration overhead", "value": ov, "extra": {}}]
        return {"rows": rows, "environment": {"gpu": "Card"}}

    rep = BenchReport("archive-gpus")
    ba.scaling_rows(rep, [(1, 100, rec(20.0, 30.0, [80.0], 3.0)), (4, 400, rec(60.0, 96.0, [70, 72, 74, 76], 6.0))])
    rows = {r.figure: r for r in rep.rows}
    four = rows["end to end on 4 GPUs: scans/s"]
    assert four.ratio == pytest.approx(3.0) and four.extra["efficiency"] == pytest.approx(0.75)
    assert rows["process stage on 4 GPUs: scans/s"].ratio == pytest.approx(3.2)
    assert rows["process stage on 4 GPUs: scans/s"].extra["gpu_busy_pct_min"] == 70
    assert rows["whole-archive overhead on 4 GPUs"].value == 6.0
    table = capsys.readouterr().out
    assert "3.00" in table and "0.80" in table and "70% 72% 74% 76%" in table


def test_gpu_scaling_needs_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr("scanforest.kernels.backend.gpu_count", lambda: 0)
    with pytest.raises(InputError, match="needs GPUs"):
        ba.run_gpu_scaling([1, 2], 10, 1000, 2, None, tmp_path, None)
    monkeypatch.setattr("scanforest.kernels.backend.gpu_count", lambda: 2)
    with pytest.raises(InputError, match=r"each count must be 1\.\.2"):
        ba.run_gpu_scaling([1, 4], 10, 1000, 2, None, tmp_path, None)
    assert not any(tmp_path.iterdir())  # refused before any archive is written


def test_gpu_scaling_hands_the_pass_batch_to_each_count_not_the_warm_up(tmp_path, monkeypatch):
    """``bench archive --gpus 1,2 --batch 16``: each counted run's command carries ``--batch 16``
    (scenes per Dask task in the pass), the uncounted warm-up runs with the flow's own batches."""
    import subprocess
    from pathlib import Path

    from typer.testing import CliRunner

    from scanforest.deploy.cli import app

    monkeypatch.setattr("scanforest.kernels.backend.gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr("scanforest.tasks.synth.write_archive", lambda *a, **k: None)
    monkeypatch.setattr(ba, "_link_archive", lambda *a, **k: None)
    monkeypatch.setattr(ba, "scaling_rows", lambda *a, **k: None)
    cmds = []

    real = subprocess.run

    def fake(cmd, *a, **kw):
        if "bench" not in cmd:
            return real(cmd, *a, **kw)
        cmds.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            json.dump({"rows": [], "notes": []}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake)
    res = CliRunner().invoke(app, ["bench", "archive", "--gpus", "1,2", "--scans", "4", "--batch", "16",
                                   "--workdir", str(tmp_path / "wd"), "--keep"])
    assert res.exit_code == 0, res.output
    tags = [c[c.index("--workdir") + 1].rsplit("/", 1)[-1] for c in cmds]
    assert tags == ["warmup", "gpus1", "gpus2"]
    assert ["--batch" in c for c in cmds] == [False, True, True]
    assert all(c[c.index("--batch") + 1] == "16" for c in cmds[1:])


def test_a_tool_that_under_reports_distances_cannot_raise_its_recall(rng):
    """Recall is scored from the canonical distances of the returned ids (every tool, scanforest
    included), or from the ids themselves: reported distances of zero do not count."""
    from scanforest.deploy.bench._data import canonical_recall, id_recall
    from scanforest.kernels.knn.bruteforce import knn_bruteforce, recall

    X = rng.standard_normal((500, 16)).astype(np.float32)
    Q = rng.standard_normal((40, 16)).astype(np.float32)
    ed, ei = knn_bruteforce(X, Q, 4, device="cpu")
    wrong = (ei + 250) % 500  # other rows, far from exact
    zeros = np.zeros(ed.shape, np.float32)  # what a flattering tool would report
    assert recall(zeros, ed, 4) == 1.0  # trusting reported distances would say perfect
    assert canonical_recall(X, Q, wrong, ed, 4) < 0.2
    assert canonical_recall(X, Q, ei, ed, 4) == 1.0
    assert id_recall(wrong, ei, 4) < 0.2 and id_recall(ei, ei, 4) == 1.0
    half = ei.copy()
    half[:, 2:] = -1  # missing neighbours never count
    assert id_recall(half, ei, 4) == 0.5 and canonical_recall(X, Q, half, ed, 4) == 0.5


def test_every_call_is_timed_warm_whatever_its_length():
    """One timing rule for both sides of a ratio: a slow first call (cold) is never the
    measurement, for a short call (median of repeats) and a long one (one warm call) alike."""
    import time

    from scanforest.deploy.bench._data import _timeit

    def fake(first: float, later: float):
        calls = []

        def fn():
            time.sleep(first if not calls else later)
            calls.append(1)
            return len(calls)
        return fn, calls

    for first, long_s in ((0.25, 10.0), (0.25, 0.1)):  # a short call, then one over long_s
        fn, calls = fake(first, 0.01)
        t, res = _timeit(fn, lambda: None, 3, long_s=long_s)
        assert t < 0.1, (first, long_s, t)  # the warm calls, not the cold one
        assert len(calls) == (4 if long_s > first else 2) and res == len(calls)


def _bench_recognize_open3d(tmp_path, *extra):
    from typer.testing import CliRunner

    from scanforest.deploy.cli import app

    out = tmp_path / "recognize.json"
    res = CliRunner().invoke(app, ["bench", "recognize", "--no-real", "--open3d-archive", "1", "--open3d-points",
                                   "5k", "--open3d-models", "1", "--open3d-voxels", "0.02", "--repeats", "1",
                                   "--threads", "2", "--out", str(out), *extra])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res, json.loads(out.read_text())


def test_bench_recognize_runs_open3d_on_the_same_scenes(tmp_path, monkeypatch):
    """``bench recognize --open3d`` (issue 41): scanforest and Open3D's global registration on the
    same synthetic scene, a row per tool and the ratio to Open3D's fastest successful setting."""
    pytest.importorskip("open3d")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # restored after the test
    _, rec = _bench_recognize_open3d(tmp_path, "--open3d")
    figs = [r["figure"] for r in rec["rows"]]
    tag = "synthetic archive 1 scenes x 5k pts, noise 0.2, 1 models"
    for tool in ("scanforest", "Open3D voxel 20 mm"):
        for what in ("seconds per scene", "success", "rotation error", "translation error"):
            assert any(f.startswith(f"{tag}: {tool} {what}") for f in figs), (tool, what, figs)
    ratio = [r for r in rec["rows"] if r["figure"] == f"{tag}: scanforest vs Open3D (fastest successful) "
             "seconds per scene"]
    assert len(ratio) == 1 and ratio[0]["baseline"].startswith(f"{tag}: Open3D voxel 20 mm")
    assert ratio[0]["ratio"] == pytest.approx(ratio[0]["baseline_value"] / ratio[0]["value"])
    for fast in ("fast 3 cm", "fast 4 cm"):  # sparse scenes: two points of scanforest's curve, each compared
        assert any(r["figure"] == f"{tag}: scanforest, {fast} vs Open3D (fastest successful) seconds per scene"
                   for r in rec["rows"]), fast
    assert rec["params"]["open3d"] is True
    assert any("where Open3D succeeds and scanforest does not" in n for n in rec["notes"])


def test_bench_recognize_times_each_tool_back_to_back(tmp_path, monkeypatch):
    """With ``--repeats 2`` each tool runs a scene twice in a row (the median of them), the tools
    taking turns scene by scene: interleaved run by run, every GPU run came after Open3D's on the
    CPU with the device idle (a 20k scene one run each: 11.7-18.4 ms, back to back 13-14 ms). The
    synthetic archive's rows take ``--repeats`` (they ran once a scene whatever it said)."""
    pytest.importorskip("open3d")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    from scanforest.deploy.bench import _open3d
    from scanforest.kernels import recognition

    order = []
    sf_real, o3d_real = recognition.recognize, _open3d.Open3DRecognizer.recognize
    monkeypatch.setattr(recognition, "recognize", lambda *a, **k: order.append("sf") or sf_real(*a, **k))
    monkeypatch.setattr(_open3d.Open3DRecognizer, "recognize",
                        lambda self, *a, **k: order.append("o3d") or o3d_real(self, *a, **k))
    _, rec = _bench_recognize_open3d(tmp_path, "--open3d", "--repeats", "2")
    tools = 3  # the preset, fast 3 cm and fast 4 cm on the CPU
    assert order[-(2 * tools + 2):] == ["sf"] * (2 * tools) + ["o3d"] * 2, order
    figs = [r["figure"] for r in rec["rows"]]
    assert any("seconds per scene (median over 1 scene(s), median of 2 warm runs each)" in f for f in figs), figs


def test_bench_recognize_open3d_on_pcl_scene_with_the_thinned_setting(tmp_path, monkeypatch, pcl_dir):
    """PCL's real scene against Open3D: scanforest at the tutorial's settings and on the thinned
    scene (scene_voxel 15 mm), each with its ratio to Open3D's fastest successful setting; the
    thinned one finds the carton at the true pose (the identity; polished on the scene's own
    points)."""
    pytest.importorskip("open3d")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    from typer.testing import CliRunner

    from scanforest.deploy.cli import app

    out = tmp_path / "recognize.json"
    res = CliRunner().invoke(app, ["bench", "recognize", "--pcl-dir", str(pcl_dir),
                                   "--method", "gc", "--open3d", "--open3d-voxels", "0.02", "--repeats", "1",
                                   "--threads", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rec = json.loads(out.read_text())
    tag = "PCL milk scene (gc)"
    rows = {r["figure"]: r for r in rec["rows"]}
    for tool in ("scanforest", "scanforest, thinned 15 mm"):
        ratio = rows[f"{tag}: {tool} vs Open3D (fastest successful) seconds per scene"]
        assert ratio["baseline"].startswith(f"{tag}: Open3D voxel 20 mm")
        assert rows[f"{tag}: {tool} success (instances within 5 deg, 10 mm)"]["value"] == 1.0
    assert rows[f"{tag}: scanforest, thinned 15 mm translation error (median over found)"]["value"] < 0.01


def test_bench_recognize_without_open3d_says_so(tmp_path, monkeypatch):
    """Without Open3D the peer is skipped with a note (how to install it), not a traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "open3d", None)  # `import open3d` raises ImportError
    res, rec = _bench_recognize_open3d(tmp_path)
    assert rec["params"]["open3d"] is False
    assert any("Open3D not importable" in n and "scanforest[bench]" in n for n in rec["notes"])
    assert "Open3D not importable" in res.output and "Traceback" not in res.output
    assert not any("Open3D" in r["figure"] for r in rec["rows"])
    # asked for by name (--open3d), its absence is an error before any run (it was a note, exit 0)
    from typer.testing import CliRunner

    from scanforest.deploy.cli import app

    res = CliRunner().invoke(app, ["bench", "recognize", "--no-real", "--open3d", "--open3d-archive", "1"])
    from scanforest.kernels.errors import InputError

    assert isinstance(res.exception, InputError) and "--open3d: Open3D does not import here" in str(res.exception)


def test_rss_growth_tells_a_warm_up_from_a_leak():
    """``bench ingest``'s memory figures: a process that grows at its start and then stays flat
    has a growth but no second-half growth; one that grows with every file has both."""
    from scanforest.deploy.bench.ingest import RssSampler

    mb = 1_000_000
    warm = [100 * mb + min(i, 10) * 3 * mb for i in range(100)]  # +30 MB over its first 10 samples
    leak = [100 * mb + i * mb for i in range(100)]  # +1 MB a sample, to the end
    s = RssSampler()
    s.samples = [(float(i), warm[i], {1: warm[i], 2: leak[i]}) for i in range(100)]
    m = s.summary()
    assert m["flow_growth_mb"] > 10 and abs(m["flow_late_growth_mb"]) < 1e-9
    assert m["worker_growth_mb"][0] > 10 and abs(m["worker_late_growth_mb"][0]) < 1e-9
    assert m["worker_late_growth_mb"][1] == pytest.approx(45.0)  # the last 10% (95-99) minus the middle (45-54)


def test_the_workers_warm_ups_are_timed_against_the_pass():
    """``bench archive`` on GPUs: whether the workers' warm-ups outlasted the library and index
    build, from each worker's warm-up report, against the pass's call and its first task."""
    from scanforest.deploy.bench._common import BenchReport
    from scanforest.deploy.bench.archive import _warm_up_note

    t_pass = 1_000.0

    class Client:
        def run(self, fn):
            assert fn.__name__ == "warm_up_report"
            return {"w0": {"seconds": 2.0, "started_at": 996.0, "ended_at": 998.0, "error": None,
                           "phases": {"device": 1.0, "describe": 0.5}},
                    "w1": {"seconds": 5.5, "started_at": 996.0, "ended_at": 1001.5, "error": None,
                           "phases": {"device": 3.0, "describe": 2.0}},
                    "w2": {"seconds": None, "started_at": 996.0, "ended_at": 997.0, "error": "OSError: x"},
                    "w3": {"seconds": None, "started_at": None, "ended_at": None, "error": None}}  # none started

    rep = BenchReport("archive", {})
    _warm_up_note(rep, Client(), t_pass, {"first_task_after": 1.92})
    assert rep.notes == ["process: 3 worker warm-ups, 2.0 / 3.8 / 5.5 s (min / median / max) (median / max: "
                         "device 2.00 / 3.00, describe 1.25 / 2.00); the first started -4.00 s from the pass's "
                         "call; the last ended +1.50 s from the pass's call, its first task started +1.92 s; "
                         "1 failed"]


def test_archive_timeline_tail_per_worker_and_per_gpu():
    """``bench archive``'s tail figures from a task stream: each worker's idle time between its
    own last task and the stage's last, and each GPU's (workers named ``gpu<i>-<j>``)."""
    from scanforest.deploy.bench.archive import _tail

    def task(worker, start, stop):
        return {"worker": worker, "startstops": [{"action": "transfer", "start": start - 1, "stop": stop + 9},
                                                 {"action": "compute", "start": start, "stop": stop}]}

    data = [task("a", 0, 4), task("a", 4, 9), task("b", 0, 10), task("c", 0, 6), task("d", 1, 8)]
    names = {"a": "gpu0-0", "b": "gpu0-1", "c": "gpu1-0", "d": "gpu1-1"}
    out = _tail(data, 10.0, names)
    assert out["tail_idle_mean"] == (1 + 0 + 4 + 2) / 4 and out["tail_idle_max"] == 4
    assert out["gpu_tail"] == {"0": 0.0, "1": 2.0}
    # plain worker names (one GPU, or a CPU cluster): no GPU split; no compute span: no figures
    assert "gpu_tail" not in _tail(data, 10.0, {}) and _tail([], 10.0, names) == {}


def test_bench_match_with_a_graph_on_drawn_shards():
    """``bench match --graph``: shards drawn on the workers fit their graph there and keep only the
    leaf-ordered rows, as a stored shard does; at the same small budget the walk finds more than
    the forest alone, and a bad graph option is refused before anything is drawn."""
    from scanforest.deploy.bench import match as bench_match

    kw = dict(method="banns", backtracks=[2], leaf_size=16, device="cpu", block=60, clusters=10, shards=2,
              reference="workers", out=None)
    plain = {x.figure: x.value for x in bench_match.run(3000, 60, 8, 4, [1], **kw).rows}
    rep = bench_match.run(3000, 60, 8, 4, [1], graph=8, graph_budget=16, **kw)
    walked = {x.figure: x.value for x in rep.rows}
    assert rep.params["graph_degree"] == 8
    assert walked["recall@4, 1 workers"] > plain["recall@4, 1 workers"]
    with pytest.raises(InputError, match="--graph-rounds must be in 0..16"):
        bench_match.run(300, 10, 8, 4, [1], graph=8, graph_rounds=99, **kw)


def test_bench_output_that_cannot_be_written_fails_before_the_run(tmp_path):
    """``--out`` under a file, or a ``.json`` name that is a folder: one line naming it, exit 2,
    before anything is measured (a bench of minutes used to end in a traceback); nothing is
    left in a location that can be written."""
    import subprocess
    import sys

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    folder = tmp_path / "taken.json"
    folder.mkdir()
    for out in (blocker / "r.json", folder):
        res = subprocess.run([sys.executable, "-m", "scanforest.deploy.cli", "bench", "tools", "--device", "cpu",
                              "--n", "2000", "--m", "20", "--out", str(out)], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 2, res.stdout + res.stderr
        lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and str(out) in lines[0] and "cannot write" in lines[0], res.stderr
        assert "scanforest bench tools" not in res.stdout  # nothing measured
    ok = tmp_path / "fine"
    BenchReport("x", out=ok)
    assert ok.is_dir() and not any(ok.iterdir())
