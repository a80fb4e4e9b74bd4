"""The HTML report: its contents on a store with every kind of record (old and new run records,
failed and interrupted runs, failed items, detections checked against ground truth), the
throughput plot's time axis, and rendering in headless Chromium (screenshot taken, page not
blank, every plot decoded)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import numpy as np
import pytest

from scanforest.flows.report import _throughput_figure, write_report
from scanforest.tasks.store import ScanStore

T0 = 1_790_000_000  # a whole second, so the ISO times below are exact


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("headless Chromium is not installed (apt-get install chromium)")


def _pose(angle_deg: float, t) -> np.ndarray:
    a = np.radians(angle_deg)
    pose = np.eye(4)
    pose[:2, :2] = [[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]]
    pose[:3, 3] = t
    return pose


def _batched(n_batches: int, per_batch: int, span: float, start: float) -> list[dict]:
    """Records of a batched task (5 s per item): every item of a batch carries the batch's finish time."""
    return [{"scan_id": f"s{b}-{i}", "status": "described", "seconds": 5.0,
             "finished_at": start + span * (b + 1) / n_batches} for b in range(n_batches) for i in range(per_batch)]


def _recognized_scene(st: ScanStore) -> None:
    """A scene with ground truth and recognize-stage results written as ``tasks.recognize`` writes
    them. The ground truth's model ids follow the synthetic order (model_b = 0), the library's
    another (model_b = 1): only the names match them. Detections: model_b at its true pose
    (correct), model_a rotated 40 degrees off (false), model_b again at the same pose (false: each
    instance is found once); model_a's instance is missed."""
    truth = [{"model_id": 0, "model": "model_b", "pose": _pose(30, [0.1, 0.2, 0.9]).tolist()},
             {"model_id": 1, "model": "model_a", "pose": _pose(-20, [-0.3, 0.0, 1.0]).tolist()}]
    st.write_scan("scenes__scene_0000.pcd", {"points": np.zeros((10, 3), np.float32)},
                  {"n_points": 10, "format": "pcd", "ground_truth": truth})
    names = ["models__model_a.pcd", "models__model_b.pcd"]
    st.root.require_group("libraries").require_group("default").attrs.update({"names": names, "complete": True})
    dets = [(1, 0.91, 900, _pose(30.5, [0.101, 0.2, 0.9])), (0, 0.75, 500, _pose(20, [-0.3, 0.0, 1.0])),
            (1, 0.60, 400, _pose(30, [0.1, 0.2, 0.901]))]
    det_dicts = [{"model_id": m, "model": names[m], "score": s, "inliers": n, "visible": 1000, "pose": p.tolist(),
                  "correspondences": 20, "hypothesis_score": s, "icp_rmse": 0.001, "model_name": names[m]}
                 for m, s, n, p in dets]
    arrays = {"det_model": np.array([d[0] for d in dets], np.int32),
              "det_pose": np.array([d[3] for d in dets], np.float64),
              "det_score": np.array([d[1] for d in dets], np.float32),
              "det_inliers": np.array([d[2] for d in dets], np.int32)}
    st.write_stage("scenes__scene_0000.pcd", "recognize", arrays,
                   {"library": "default", "content_hash": "x", "params": {}, "detections": det_dicts,
                    "timings": {"io": 0.01}, "device": "cpu", "seconds": 0.5,
                    "evaluation": {"tp": 1, "fp": 2, "fn": 1, "rotation_errors": [0.5], "translation_errors": [0.001],
                                   "resolution": 0.005}})


def _store(tmp_path):
    """Runs whose ids sort alphabetically the other way from their times: ingest (the old record
    format: no status, no started), describe (completed, 100 s of batched items), recognize
    (failed, with failed items), align (still marked running: interrupted)."""
    st = ScanStore(tmp_path / "s.zarr", create=True)
    for i in range(3):
        st.write_scan(f"s{i}", {"points": np.random.default_rng(i).normal(size=(50, 3)).astype(np.float32)},
                      {"n_points": 50, "format": "npy"})
    _recognized_scene(st)
    st.quarantine("/data/bad.pcd", "truncated binary PCD: 10 data bytes, header needs 600", key="bad.pcd")
    recs = [{"scan_id": f"s{i}", "status": "ingested", "seconds": 0.5, "finished_at": T0 + 1.0 + i} for i in range(3)]
    st.write_run("ingest-1", {"flow": "ingest", "summary": {"ingested": 3, "seconds": 4.0}, "records": recs,
                              "finished": _iso(T0 + 4)})
    st.write_run("describe-1", {"flow": "describe", "status": "completed", "started": _iso(T0 + 100),
                                "finished": _iso(T0 + 200), "summary": {"described": 20},
                                "records": _batched(4, 5, 100.0, T0 + 100)})
    failed_items = [{"scan_id": "s1", "status": "failed", "reason": "ValueError: no keypoints", "seconds": 1.0,
                     "finished_at": T0 + 305.0},
                    {"scan_id": "s2", "status": "recognized", "seconds": 2.0, "finished_at": T0 + 306.0}]
    st.write_run("recognize-1", {"flow": "recognize", "status": "failed", "started": _iso(T0 + 300),
                                 "finished": _iso(T0 + 310), "error": "RuntimeError: worker lost three times",
                                 "parameters": {}, "summary": {}, "records": failed_items})
    st.write_run("align-1", {"flow": "align", "status": "running", "started": _iso(T0 + 400), "parameters": {}})
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [{"figure": "P-ANNS queries/s", "value": v, "unit": "queries/s", "extra": {"recall": r, "method": "anns"}}
            for v, r in ((1e6, 0.8), (5e5, 0.9), (2e5, 0.97))]
    (bench / "ann-1.json").write_text(json.dumps({"bench": "ann", "environment": {"gpu": None}, "rows": rows}))
    return st, bench


def test_bench_curves_one_per_tool():
    """``bench tools`` rows become one recall/throughput curve per tool (scanforest, each FAISS
    index, FLANN), not one per first word of the figure; other benches keep their method."""
    from scanforest.flows.report import _curve_key

    rec = {"bench": "tools", "environment": {"gpu": "NVIDIA H100 80GB HBM3"}}
    keys = {_curve_key(rec, {"figure": f, "device": dev, "extra": {"recall": 0.9}}) for f, dev in (
        ("scanforest KDForest banns queries/s, 1 trees, 128 leaves", "gpu (NVIDIA H100 80GB HBM3)"),
        ("scanforest KDForest banns queries/s, 1 trees, 256 leaves", "gpu (NVIDIA H100 80GB HBM3)"),
        ("FAISS GPU IVFFlat nlist=2048 queries/s, nprobe=8", "gpu (NVIDIA H100 80GB HBM3)"),
        ("FAISS GPU CAGRA degree 32 queries/s, itopk=32, host queries", "gpu (NVIDIA H100 80GB HBM3)"),
        ("FLANN KDTreeIndex queries/s, 4 trees, checks=512", "cpu (16 threads)"))}
    assert keys == {"tools: scanforest KDForest banns [NVIDIA H100 80GB HBM3]",
                    "tools: FAISS GPU IVFFlat nlist=2048 [NVIDIA H100 80GB HBM3]",
                    "tools: FAISS GPU CAGRA degree 32 [NVIDIA H100 80GB HBM3]", "tools: FLANN KDTreeIndex"}
    assert _curve_key({"bench": "ann"}, {"figure": "P-ANNS queries/s", "extra": {"method": "anns"}}) == "ann: anns"


def _section(text: str, title: str) -> str:
    return text.split(f"<h2>{title}</h2>", 1)[1].split("<h2>", 1)[0]


def test_report_contents(tmp_path):
    st, bench = _store(tmp_path)
    text = write_report(st.path, tmp_path / "r.html", bench_dir=bench).read_text()
    assert text.count("data:image/png;base64,") == 3  # throughput, benchmark curves, detections
    runs = _section(text, "Runs")
    order = [re.search(f"<td[^>]*>{r}</td>", runs).start()
             for r in ("align-1", "recognize-1", "describe-1", "ingest-1")]
    assert order == sorted(order)  # newest first, not alphabetical
    assert "running or interrupted" in runs and _iso(T0 + 400) in runs
    det = _section(text, "Detections")
    verdicts = re.findall(r"<td[^>]*>(yes|no)</td></tr>", det)
    assert verdicts == ["yes", "no", "no"]
    assert "1 correct, 2 false, 1 missed" in det
    assert "(0.101, 0.200, 0.900)" in det and re.search(r"<td[^>]*>30\.5</td>", det)  # translation, rotation
    fail = _section(text, "Failures")
    for needle in ("bad.pcd", "truncated binary PCD", "recognize-1", "RuntimeError: worker lost three times",
                   "align-1", "ValueError: no keypoints"):
        assert needle in fail
    assert re.search("<td[^>]*>s1</td>", fail) and not re.search("<td[^>]*>s2</td>", fail)  # failed items only


def test_throughput_axis_is_run_time(tmp_path):
    """A run of 100 s whose items come in 4 batches (5 items each, 5 s per item, every batch
    stamped with its finish) is plotted from 0 to 100 s, in the new record format and the old."""
    recs = _batched(4, 5, 100.0, T0)
    new = {"id": "new", "started": _iso(T0), "finished": _iso(T0 + 100), "records": recs}
    old = {"id": "old", "finished": _iso(T0 + 100), "summary": {"seconds": 100.0}, "records": recs}
    untimed = {"id": "untimed", "records": [{"scan_id": "a", "status": "ingested", "seconds": 1.0}]}
    fig, skipped = _throughput_figure([new, old, untimed])
    try:
        ax = fig.axes[0]
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert set(lines) == {"new", "old"} and skipped == ["untimed"]
        for ln in lines.values():
            x, y = np.asarray(ln.get_xdata()), np.asarray(ln.get_ydata())
            assert x[0] == 0 and x[-1] == pytest.approx(100.0) and y[-1] == 20
            assert sorted(set(x[1:])) == pytest.approx([25.0, 50.0, 75.0, 100.0])
        assert ax.get_xlim()[1] >= 100.0
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def _render(chromium, html_path, tmp_path) -> tuple[np.ndarray, str]:
    """Screenshot of the page and its DOM after load, with the natural width of every image
    (a copy of the page with a load handler that writes them into the body: 0 = not decoded)."""
    probe = html_path.with_name("probe.html")
    probe.write_text(html_path.read_text().replace(
        "</body>", "<script>addEventListener('load',()=>{document.body.dataset.imgs="
                   "[...document.images].map(i=>i.naturalWidth).join(',')})</script></body>"))
    shot = tmp_path / "shot.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600"]
    res = subprocess.run([chromium, *flags, f"--screenshot={shot}", html_path.as_uri()], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    dom = subprocess.run([chromium, *flags, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    from PIL import Image

    return np.asarray(Image.open(shot).convert("L"), dtype=np.float32), dom.stdout


def test_report_renders_in_headless_chromium(tmp_path):
    chromium = _chromium()
    st, bench = _store(tmp_path)
    out = write_report(st.path, tmp_path / "r.html", bench_dir=bench)
    img, dom = _render(chromium, out, tmp_path)
    assert img.shape == (1600, 1200)
    assert img.std() > 5  # text, tables and plots were drawn: not a blank page
    assert "scanforest report" in dom and "running or interrupted" in dom
    widths = re.search(r'data-imgs="([^"]*)"', dom).group(1).split(",")
    assert len(widths) == 3 and all(int(w) > 100 for w in widths)


@pytest.mark.parametrize("quarantine", [False, True], ids=["empty", "quarantine-only"])
def test_report_of_store_without_runs(tmp_path, quarantine):
    st = ScanStore(tmp_path / "s.zarr", create=True)
    if quarantine:
        st.quarantine("/data/bad.ply", "zero points", key="bad.ply")
    out = write_report(st.path, tmp_path / "r.html", bench_dir=tmp_path / "none")
    text = out.read_text()
    for line in ("No runs recorded", "No timed runs", "No recognition results yet"):
        assert line in text
    assert ("bad.ply" in text) == quarantine
    assert ("No quarantined files, failed runs or failed items" in text) != quarantine
    if shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome"):
        img, dom = _render(_chromium(), out, tmp_path)
        assert "scanforest report" in dom and img.std() > 1


def test_a_killed_run_on_this_host_is_interrupted(tmp_path):
    """A ``running`` record names its host and process: when that process is gone on this host
    the run was killed, and the report says so; a live process is still running."""
    import os
    import socket
    import subprocess
    import sys

    from scanforest.flows.report import _status

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    assert _status({"status": "running", "host": host, "pid": dead.pid}) == "interrupted"
    assert _status({"status": "running", "host": host, "pid": os.getpid()}) == "running"
    assert _status({"status": "running", "host": "elsewhere", "pid": 1}) == "running or interrupted"
    assert _status({"status": "failed"}) == "failed" and _status({}) == "completed"


# -- finding 8 of issue 38: long ids and reasons wrap at 1280 px, tables read as text, benchmarks --

LONG_ID = ("scenes__site_42__" + "a" * 180 + "_very_long_scan_name_without_any_break_" + "b" * 20)[:246] + ".pcd"
LONG_REASON = ("header/data mismatch: the header of /data/archive/2026/november/site_42/" + "deep_folder/" * 8
               + "scan.pcd promises 1,234,567 points of 4 fields but the binary data holds 98,765 bytes; the file "
               "was probably cut off during the upload, and the end of this reason stays on screen: END-OF-REASON")


def _long_store(tmp_path):
    """The store of :func:`_store` plus a scan with a 250-character id (failed in a run), a
    quarantined file with a 250-character path and a long reason, and a run whose summary has
    40 figures and a long note."""
    st, bench = _store(tmp_path)
    assert len(LONG_ID) == 250
    st.write_scan(LONG_ID, {"points": np.zeros((10, 3), np.float32)}, {"n_points": 1_234_567, "format": "ply"})
    st.quarantine("/data/archive/" + "x" * 232 + ".pcd", LONG_REASON, key="long.pcd")
    summary = {f"figure_number_{i}": 1_234_567 * i for i in range(40)}
    summary.update({"keypoints": 234_205, "seconds": 3725.5, "task_seconds": 12.25,
                    "ignored_note": "ignored 40 files: " + ",".join(f"notes/readme_{i}.txt" for i in range(40))})
    st.write_run("describe-" + "z" * 120, {
        "flow": "describe", "status": "completed", "started": _iso(T0 + 500), "finished": _iso(T0 + 4225),
        "summary": summary, "records": [{"scan_id": LONG_ID, "status": "failed", "reason": LONG_REASON,
                                         "seconds": 1.0, "finished_at": T0 + 600}]})
    return st, bench


#: Run on load: the page's widths, every element reaching past the right edge of the viewport,
#: every cell or paragraph whose content is wider than its box, and where the reason's last
#: word was drawn; written as JSON into the body's data-layout attribute.
_LAYOUT_PROBE = """<script>addEventListener('load', () => {
  const de = document.documentElement, vw = de.clientWidth, say = e => e.tagName + ': ' + e.textContent.slice(0, 60);
  const wide = [...document.body.querySelectorAll('*')].filter(e => e.getBoundingClientRect().right > vw + 0.5);
  const clipped = [...document.querySelectorAll('td,th,p,h1,h2,h3')].filter(e => e.scrollWidth > e.clientWidth + 1);
  const marks = [], walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    const i = n.data.indexOf('END-OF-REASON');
    if (i < 0 || n.parentElement.closest('script')) continue;
    const r = document.createRange(); r.setStart(n, i); r.setEnd(n, i + 13);
    const b = r.getBoundingClientRect(); marks.push([b.left, b.right, b.width]);
  }
  document.body.dataset.layout = JSON.stringify({inner: innerWidth, client: vw, scroll: de.scrollWidth,
    wide: wide.map(say), clipped: clipped.map(say), marks});
})</script></body>"""


def _layout(chromium, html_path, tmp_path, width=1280) -> dict:
    probe = html_path.with_name("layout-probe.html")
    probe.write_text(html_path.read_text().replace("</body>", _LAYOUT_PROBE))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},2000"]
    dom = subprocess.run([chromium, *flags, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    import html

    found = re.search(r'data-layout="([^"]*)"', dom.stdout)
    assert found, dom.stdout[-2000:]
    return json.loads(html.unescape(found.group(1)))


def test_report_fits_1280_px_with_long_ids_and_reasons(tmp_path):
    """At 1280 px nothing reaches past the right edge (no horizontal scrolling), no cell's text is
    wider than its cell (wrapped, not clipped), and the long reason's last word is on screen in
    both tables that hold it (quarantine, failed items)."""
    chromium = _chromium()
    st, bench = _long_store(tmp_path)
    out = write_report(st.path, tmp_path / "r.html", bench_dir=bench)
    lay = _layout(chromium, out, tmp_path)
    assert lay["inner"] == 1280, lay
    assert lay["scroll"] <= lay["client"], f"page {lay['scroll']} px wide in a {lay['client']} px viewport"
    assert lay["wide"] == [] and lay["clipped"] == [], lay
    assert len(lay["marks"]) == 2 and all(0 <= left and right <= lay["client"] and w > 0
                                          for left, right, w in lay["marks"]), lay["marks"]


def test_report_tables_are_formatted_for_people(tmp_path):
    """The store table lists formats and stages as "ply 1, npy 3", not JSON; numbers carry
    thousands separators; run times read as dates and durations; summaries as words."""
    st, bench = _long_store(tmp_path)
    text = write_report(st.path, tmp_path / "r.html", bench_dir=bench).read_text()
    store = _section(text, "Store")
    assert "{" not in store and "&quot;" not in store
    assert re.search(r"<th>formats</th><td>[^<]*\bnpy 3\b", store) and "ply 1" in store and "recognize 1" in store
    assert "1,234,727" in store  # points: 3 x 50 + 10 + 10 + 1,234,567
    runs = _section(text, "Runs")
    assert "2026-09-21 14:21:40 UTC" in runs and "1 h 02 min" in runs  # started, took (3,725 s)
    assert "keypoints 234,205" in runs and "figure number 39 48,148,113" in runs and "task seconds 12 s" in runs
    assert "=" not in re.sub(r"<[^>]*>", "", runs)  # no key=value
    fail = _section(text, "Failures")
    assert re.search(r"<td[^>]*><time datetime=\"[^\"]+\">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</time></td>", fail)


def _bench_record(folder, name="ingest", stamp="20261127-101500"):
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"figure": "ingest scans/s (200 scans)", "value": 1234.5, "unit": "scans/s", "device": "cpu (2 cores)",
             "baseline": "one file at a time", "baseline_value": 411.5, "ratio": 3.0, "extra": {}},
            {"figure": "ingest wall time", "value": 162.0, "unit": "s", "device": "cpu (2 cores)", "extra": {}}]
    (folder / f"{name}-{stamp}.json").write_text(json.dumps(
        {"bench": name, "params": {}, "environment": {"gpu": None, "time": "2026-11-27T10:15:00+0000"},
         "seconds": 170.0, "rows": rows, "notes": []}))
    (folder / "bench-stages.json").write_text(json.dumps({"ingest": {"when": "x"}}))  # not a bench record


def test_benchmarks_section_from_bench_records_or_absent(tmp_path, monkeypatch):
    """Bench records without a recall curve (here ``bench ingest``) fill the Benchmarks section with
    their rows; ``bench-results/`` beside the store is found from another working folder; without
    any record the section is absent, not an empty heading."""
    st = ScanStore(tmp_path / "s.zarr", create=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    text = write_report(st.path, tmp_path / "none.html").read_text()
    assert "<h2>Benchmarks</h2>" not in text
    _bench_record(tmp_path / "bench-results")  # where `scanforest bench ingest` run beside the store writes
    text = write_report(st.path, tmp_path / "r.html").read_text()
    bench = _section(text, "Benchmarks")
    assert "ingest scans/s (200 scans)" in bench and "1,234 scans/s" in bench and "3.00x one file at a time" in bench
    assert "2 min 42 s" in bench and "ingest-20261127-101500.json" in bench and "bench-stages" not in bench
    assert "data:image/png" not in bench  # no recall rows: no curve, no empty plot
