"""The HTML report renders in headless Chromium (screenshot taken, page not blank)."""
from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from scanforest.flows.report import write_report
from scanforest.tasks.store import ScanStore


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("headless Chromium is not installed (apt-get install chromium)")


def _store(tmp_path):
    st = ScanStore(tmp_path / "s.zarr")
    for i in range(3):
        st.write_scan(f"s{i}", {"points": np.random.default_rng(i).normal(size=(50, 3)).astype(np.float32)},
                      {"n_points": 50, "format": "npy"})
    st.quarantine("/data/bad.pcd", "truncated binary PCD: 10 data bytes, header needs 600", key="bad.pcd")
    recs = [{"scan_id": f"s{i}", "status": "ingested", "seconds": 0.5, "finished_at": 1000.0 + i} for i in range(3)]
    st.write_run("ingest-1", {"flow": "ingest", "summary": {"ingested": 3, "seconds": 2.0}, "records": recs})
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [{"figure": "P-ANNS queries/s", "value": v, "unit": "queries/s", "extra": {"recall": r, "method": "anns"}}
            for v, r in ((1e6, 0.8), (5e5, 0.9), (2e5, 0.97))]
    (bench / "ann-1.json").write_text(json.dumps({"bench": "ann", "environment": {"gpu": None}, "rows": rows}))
    return st, bench


def test_report_contents(tmp_path):
    st, bench = _store(tmp_path)
    out = write_report(st.path, tmp_path / "r.html", bench_dir=bench)
    text = out.read_text()
    for section in ("Throughput over time", "Recall vs throughput", "Failures", "bad.pcd", "ingest-1"):
        assert section in text or section.lower() in text.lower()
    assert text.count("data:image/png;base64,") == 2  # throughput + benchmark curves


def test_report_renders_in_headless_chromium(tmp_path):
    chromium = _chromium()
    st, bench = _store(tmp_path)
    out = write_report(st.path, tmp_path / "r.html", bench_dir=bench)
    shot = tmp_path / "shot.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600"]
    res = subprocess.run([chromium, *flags, f"--screenshot={shot}", out.as_uri()], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    from PIL import Image

    img = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert img.shape == (1600, 1200)
    assert img.std() > 5  # text, tables and plots were drawn: not a blank page
    dom = subprocess.run([chromium, *flags, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120)
    assert "scanforest report" in dom.stdout and dom.stdout.count("<img") == 2
