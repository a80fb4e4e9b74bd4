"""HTML report of a store: runs, throughput over time, benchmark curves, detections, failures.

One self-contained HTML file (plots embedded as PNG data URIs), so it can be mailed, archived or
opened from a Prefect artifact link without a server.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from scanforest.tasks.store import ScanStore


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _throughput_plot(runs: list[dict]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for run in runs:
        recs = [r for r in run.get("records", []) if "finished_at" in r]
        if len(recs) < 2:
            continue
        t = sorted(r["finished_at"] for r in recs)
        t0 = t[0] - min(r.get("seconds", 0.0) for r in recs)
        series.append((run["id"], [x - t0 for x in t]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for name, ts in series[-8:]:
        ax.plot(ts, range(1, len(ts) + 1), label=name, drawstyle="steps-post")
    ax.set_xlabel("seconds since run start")
    ax.set_ylabel("scans finished")
    ax.set_title("Throughput over time")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig)


def _bench_plot(bench_dir: Path) -> tuple[str | None, list[dict]]:
    """Recall/throughput points from every bench JSON row that carries a recall figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = sorted(bench_dir.glob("*.json")) if bench_dir.is_dir() else []
    records, points = [], {}
    for f in files:
        try:
            rec = json.loads(f.read_text())
        except ValueError:
            continue
        records.append({"file": f.name, "bench": rec.get("bench"), "gpu": rec.get("environment", {}).get("gpu"),
                        "rows": len(rec.get("rows", []))})
        for row in rec.get("rows", []):
            extra = row.get("extra") or {}
            recall = extra.get("recall") if "recall" in extra else extra.get("recall@k")
            if recall is None or "/s" not in str(row.get("unit", "")):
                continue
            key = f"{rec.get('bench')}: {extra.get('method', row['figure'].split(' ')[0])}"
            points.setdefault(key, []).append((float(recall), float(row["value"])))
    if not points:
        return None, records
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key, pts in sorted(points.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    ax.set_yscale("log")
    ax.set_xlabel("recall")
    ax.set_ylabel("queries / s")
    ax.set_title("Recall vs throughput (benchmarks)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig), records


def _detections_plot(store: ScanStore) -> tuple[str | None, list[list[Any]]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for sid in store.scans():
        rec = store.attrs(sid).get("stages", {}).get("recognize")
        if rec is not None:
            rows.append([sid, rec.get("detections", 0), rec.get("seconds", 0.0)])
    if not rows:
        return None, rows
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(range(len(rows)), [r[1] for r in rows])
    ax.set_xlabel("scene")
    ax.set_ylabel("detections")
    ax.set_title("Detections per scene")
    return _png(fig), rows


def write_report(store_path: str, out: str | Path, *, bench_dir: str | Path = "bench-results") -> Path:
    """Write the HTML report of ``store_path`` to ``out``; returns the path."""
    store = ScanStore(store_path, mode="r")
    info = store.info()
    runs = store.runs()
    tp = _throughput_plot(runs)
    bp, bench_records = _bench_plot(Path(bench_dir))
    dp, det_rows = _detections_plot(store)
    quarantine = store.quarantined()
    esc = html.escape

    def table(headers, rows):
        head = "".join(f"<th>{esc(str(h))}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    parts = [f"<h1>scanforest report</h1><p class=sub>{esc(store.path)}</p>",
             "<h2>Store</h2>",
             table(["scans", "points", "formats", "stages", "quarantined", "incomplete", "runs"],
                   [[info["scans"], f"{info['points']:,}", json.dumps(info["formats"]), json.dumps(info["stages"]),
                     info["quarantined"], len(info["incomplete"]), info["runs"]]]),
             "<h2>Runs</h2>",
             table(["run", "flow", "finished", "summary"],
                   [[r["id"], r.get("flow"), r.get("finished", ""),
                     ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in r.get("summary", {}).items() if not isinstance(v, (list, dict)))]
                    for r in runs]) if runs else "<p>No runs recorded.</p>"]
    parts.append("<h2>Throughput over time</h2>" + (f'<img alt="throughput" src="{tp}">' if tp else "<p>No timed runs.</p>"))
    parts.append("<h2>Benchmarks</h2>" + (f'<img alt="recall vs throughput" src="{bp}">' if bp else
                                          "<p>No recall/throughput benchmark results found.</p>"))
    if bench_records:
        parts.append(table(["file", "bench", "gpu", "rows"], [[b["file"], b["bench"], b["gpu"], b["rows"]]
                                                              for b in bench_records]))
    parts.append("<h2>Detections</h2>" + (f'<img alt="detections" src="{dp}">' + table(["scene", "detections", "seconds"], det_rows)
                                          if dp else "<p>No recognition results yet.</p>"))
    parts.append("<h2>Failures</h2>" + (table(["file", "reason", "time"], [[q["source"], q["reason"], q.get("time", "")]
                                                                         for q in quarantine])
                                        if quarantine else "<p>No quarantined files.</p>"))
    css = ("body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}"
           "table{border-collapse:collapse;margin:.5em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;"
           "text-align:left}th{background:#f3f3f3}img{max-width:100%}.sub{color:#666}h2{margin-top:1.6em}")
    doc = (f"<!doctype html><html><head><meta charset=utf-8><title>scanforest report</title><style>{css}</style>"
           f"</head><body>{''.join(parts)}</body></html>")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    return out
