"""HTML report of a store: runs, throughput over time, benchmark curves, detections, failures.

One self-contained HTML file (plots embedded as PNG data URIs), so it can be mailed, archived or
opened from a Prefect artifact link without a server.

Run records (``STORE/runs/<id>``) come in two generations, and the report reads both: the first
had no ``status`` and was written only when a flow completed (``finished`` ISO time); the current
one is written when a flow starts (``status = "running"``, ``started``) and rewritten when it ends
(``"completed"``, or ``"failed"`` with a one-line ``error``). A record still ``"running"`` may be
a live flow or one whose process died, and nothing in the store tells the two apart, so the report
says "running or interrupted".
"""
from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from scanforest.tasks.store import ScanStore

#: detection rows written into the page at most (the full table: ``scanforest recognize --export``)
MAX_DETECTION_ROWS = 1000


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _pyplot().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _epoch(iso: str | None) -> float | None:
    """Epoch seconds of an ISO time; times without a zone are UTC (run records write UTC)."""
    if not iso:
        return None
    try:
        t = _dt.datetime.fromisoformat(str(iso).replace("Z", "+00:00"))
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)).timestamp()


def _run_start(run: dict) -> float | None:
    """When the run started (epoch seconds): its ``started`` time; records from before runs had
    one give their end less the flow's own ``summary.seconds``, or just the end. That end is the
    ``finished`` time, cut to whole seconds, or the last item's ``finished_at`` where later (the
    item finished before the record was written): on short runs the second cut off matters."""
    started = _epoch(run.get("started"))
    if started is not None:
        return started
    finished = _epoch(run.get("finished"))
    if finished is None:
        return None
    ends = [r["finished_at"] for r in run.get("records") or [] if isinstance(r.get("finished_at"), (int, float))]
    end = max([finished, *ends])
    seconds = (run.get("summary") or {}).get("seconds")
    return end - seconds if isinstance(seconds, (int, float)) else end


def _start_key(run: dict) -> float:
    """Sort key: the run's start, runs without any time last when sorted newest first."""
    start = _run_start(run)
    return float("-inf") if start is None else start


def _status(run: dict) -> str:
    """The run's state as the report shows it (records without ``status`` are completed runs). A
    ``running`` record names the host and process that wrote it: on that host, a process that is
    gone means the run was interrupted (killed); elsewhere the report cannot tell."""
    from .records import process_gone

    status = run.get("status", "completed")
    if status != "running":
        return status
    gone = process_gone(run)
    return "running or interrupted" if gone is None else "interrupted" if gone else "running"


def _started(run: dict) -> str:
    """The run's ``started`` time, or for older records the start estimated by :func:`_run_start`."""
    if run.get("started"):
        return run["started"]
    start = _run_start(run)
    return "" if start is None else "≈ " + _dt.datetime.fromtimestamp(start, _dt.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def _finish_times(run: dict) -> list[float] | None:
    """Seconds from the run's start at which each of its items finished, sorted; None when no
    record carries ``finished_at``.

    Items of a batched task all carry the batch's finish time, so the first finish can lie long
    after the run began: the origin is the run's start, not the earliest record. Every item began
    no later than its ``finished_at`` less its ``seconds``, which bounds the origin from above
    where the start is unknown or only estimated (older records).
    """
    recs = [r for r in run.get("records") or [] if isinstance(r.get("finished_at"), (int, float))]
    if not recs:
        return None
    first_begin = min(r["finished_at"] - float(r.get("seconds") or 0.0) for r in recs)
    start = _run_start(run)
    t0 = first_begin if start is None else min(start, first_begin)
    return sorted(r["finished_at"] - t0 for r in recs)


def _throughput_figure(runs: list[dict], *, max_runs: int = 8):
    """Items finished against seconds since each run's start, for the newest ``max_runs`` runs
    with timed items (``runs`` newest first). Returns the figure (None without any) and the ids
    of runs whose records carry no finish times."""
    series, untimed = [], []
    for run in runs:
        if not run.get("records"):
            continue
        ts = _finish_times(run)
        if ts is None:
            untimed.append(run["id"])
        elif len(series) < max_runs:
            series.append((run["id"], ts))
    if not series:
        return None, untimed
    fig, ax = _pyplot().subplots(figsize=(7, 3.2))
    for name, ts in series:
        ax.plot([0.0, *ts], range(len(ts) + 1), label=_clip(name, 40), drawstyle="steps-post")
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since run start")
    ax.set_ylabel("items finished")
    ax.set_title("Throughput over time")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig, untimed


def _curve_key(rec: dict, row: dict) -> str:
    """The curve a recall/throughput row belongs to: its bench and method, or for a row named
    "<tool> queries/s, <setting>" (``bench tools``: scanforest, FLANN, each FAISS index) the tool,
    with the GPU it ran on when the file names one."""
    extra = row.get("extra") or {}
    bench, figure = rec.get("bench"), str(row.get("figure", ""))
    if "method" in extra:
        return f"{bench}: {extra['method']}"
    if " queries/s" not in figure:
        return f"{bench}: {figure.split(' ')[0]}"
    gpu = (rec.get("environment") or {}).get("gpu")
    where = f" [{gpu}]" if gpu and not str(row.get("device", "")).startswith("cpu") else ""
    return f"{bench}: {figure.split(' queries/s')[0]}{where}"


def _bench_dirs(store_path: str | Path, bench_dir: str | Path) -> list[Path]:
    """Folders that may hold the store's ``scanforest bench`` records, existing ones only, each
    once: ``bench_dir`` as given (``BenchReport.write`` writes into ``bench-results/`` of the
    folder the bench ran in) and, for a relative ``bench_dir``, the same name beside the store and
    inside it, so a report made from another folder still finds the records of benches run where
    the store is."""
    bench_dir, store = Path(bench_dir), Path(store_path)
    candidates = [bench_dir]
    if not bench_dir.is_absolute():
        candidates += [store.parent / bench_dir, store / bench_dir]
    out, seen = [], set()
    for d in candidates:
        key = d.resolve() if d.exists() else None
        if key is not None and d.is_dir() and key not in seen:
            seen.add(key)
            out.append(d)
    return out


def _bench_time(rec: dict, path: Path) -> float:
    """When a bench record was written: its ``environment.time``, else the stamp in its file name
    (``NAME-YYYYmmdd-HHMMSS.json``, local time), else the file's modification time."""
    t = _epoch((rec.get("environment") or {}).get("time"))
    if t is not None:
        return t
    stamp = path.stem[-15:]
    try:
        return _dt.datetime.strptime(stamp, "%Y%m%d-%H%M%S").timestamp()
    except ValueError:
        return path.stat().st_mtime


def _bench_records(dirs: list[Path]) -> list[dict]:
    """Every bench record (a JSON object with ``bench`` and ``rows``, as ``BenchReport.write``
    writes it) in ``dirs``, newest first; other JSON files (``bench-stages.json`` and the like)
    are left out."""
    out = []
    for d in dirs:
        for f in sorted(d.glob("*.json")):
            try:
                rec = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(rec, dict) or "bench" not in rec or not isinstance(rec.get("rows"), list):
                continue
            out.append({"file": f.name, "dir": str(d), "bench": str(rec.get("bench")), "time": _bench_time(rec, f),
                        "gpu": (rec.get("environment") or {}).get("gpu"), "rows": rec["rows"],
                        "seconds": rec.get("seconds"), "record": rec})
    out.sort(key=lambda r: (-r["time"], r["file"]))
    return out


def _bench_plot(records: list[dict]) -> str | None:
    """Recall/throughput points from every bench row that carries a recall figure (None: none)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        for row in r["rows"]:
            extra = row.get("extra") or {}
            recall = extra.get("recall") if "recall" in extra else extra.get("recall@k")
            if recall is None or "/s" not in str(row.get("unit", "")):
                continue
            try:
                points.setdefault(_curve_key(r["record"], row), []).append((float(recall), float(row["value"])))
            except (TypeError, ValueError):
                continue
    if not points:
        return None
    fig, ax = _pyplot().subplots(figsize=(7, 3.6))
    for key, pts in sorted(points.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=_clip(key, 60))
    ax.set_yscale("log")
    ax.set_xlabel("recall")
    ax.set_ylabel("queries / s")
    ax.set_title("Recall vs throughput (benchmarks)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig)


# -- formatting for people ---------------------------------------------------------------------

def _clip(text: str, n: int = 40) -> str:
    """``text`` cut to ``n`` characters in the middle (plot labels: ids of any length)."""
    text = str(text)
    return text if len(text) <= n else text[: n // 2 - 1] + "…" + text[-(n - n // 2):]


def _num(v: Any) -> str:
    """A number as people read it: thousands separators, a sensible number of decimals."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        a = abs(v)
        if a >= 100 or (v.is_integer() and a >= 1):
            return f"{v:,.0f}"
        return "0" if v == 0 else f"{v:.3g}"
    return str(v)


def _share(part: int, whole: int) -> str:
    """A precision or recall: "n/a" of nothing (no detections, no true instances)."""
    return f"{part / whole:.3f}" if whole else "n/a"


def _duration(seconds: Any) -> str:
    """Seconds as a readable duration: ``0.25 s``, ``4.0 s``, ``42 s``, ``1 min 40 s``, ``2 h 03 min``."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return str(seconds)
    if s != s:
        return str(seconds)
    if s < 1:
        return f"{s:.2f} s"
    if s < 10:
        return f"{s:.1f} s"
    if s < 59.5:
        return f"{s:.0f} s"
    m = int(round(s)) // 60
    if m < 60:
        return f"{m} min {int(round(s)) % 60:02d} s"
    h = m // 60
    if h < 48:
        return f"{h} h {m % 60:02d} min"
    return f"{h // 24} d {h % 24:02d} h"


def _when(iso: Any) -> str:
    """An ISO time as ``2026-11-27 16:18:50 UTC`` (times without a zone are UTC); other text as it is."""
    t = _epoch(iso) if isinstance(iso, str) else None
    if t is None:
        return "" if iso is None else str(iso)
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _minute(t: float) -> str:
    """Epoch seconds as ``2026-11-27 16:18 UTC``."""
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _words(key: str) -> str:
    return str(key).replace("_", " ")


def _value(key: str, v: Any) -> str:
    """A summary value: durations for ``*seconds`` keys, numbers formatted, small dicts inline."""
    if isinstance(v, dict):
        return _pairs(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and str(key).endswith("seconds"):
        return _duration(v)
    return _num(v)


def _pairs(d: dict) -> str:
    """``{"pcd": 10, "ply": 3}`` as ``pcd 10, ply 3`` (nested dicts in parentheses, lists left out)."""
    out = []
    for k, v in d.items():
        if v is None:
            continue
        if isinstance(v, dict):
            out.append(f"{_words(k)} ({_pairs(v)})" if v else "")
        elif isinstance(v, (list, tuple)):  # per-item lists (failures, results): the tables show them
            continue
        else:
            out.append(f"{_words(k)} {_value(k, v)}")
    return ", ".join(x for x in out if x)


def _bench_value(row: dict) -> str:
    v, unit = row.get("value"), str(row.get("unit") or "")
    if isinstance(v, (int, float)) and unit in ("s", "seconds"):
        return _duration(v)
    return f"{_num(v)} {unit}".strip()


def _bench_baseline(row: dict) -> str:
    ratio, base = row.get("ratio"), row.get("baseline")
    if not isinstance(ratio, (int, float)) or not base:
        return ""
    return f"{ratio:.2f}x {base}"


def _short(name: str) -> str:
    """A library model's name as ground truth spells it (``models__model_002.pcd`` -> ``model_002``)."""
    return name.split("__")[-1].rsplit(".", 1)[0]


def _correct(dets: list[dict], truth: list[dict], name_to_id: dict[str, int], max_translation: float,
             max_rotation_deg: float = 15.0) -> list[bool]:
    """Which detections are correct, by the rule of ``kernels.recognition.evaluate`` (same model,
    rotation and translation within tolerance, each ground-truth instance taken once by the
    nearest such detection): the stored evaluation has the counts only, the table needs the
    verdict per detection. Ground-truth model ids are mapped through the library's names the
    way ``tasks.recognize.recognize_scan`` maps them."""
    from scanforest.kernels.recognition import pose_errors

    used: set[int] = set()
    for g in truth:
        model_id = name_to_id.get(g.get("model"), g["model_id"])
        best = None
        for i, d in enumerate(dets):
            if i in used or int(d["model_id"]) != int(model_id):
                continue
            rot, tra = pose_errors(d["pose"], g["pose"])
            if rot <= max_rotation_deg and tra <= max_translation and (best is None or tra < best[0]):
                best = (tra, i)
        if best is not None:
            used.add(best[1])
    return [i in used for i in range(len(dets))]


def _library_names(store: ScanStore, name: str | None) -> dict[str, int]:
    attrs = store.catalog.find_library(name, complete=False) if name is not None else None
    if attrs is None:
        return {}
    return {_short(n): i for i, n in enumerate(attrs.get("names", []))}


def _detections(store: ScanStore) -> dict[str, Any]:
    """Every stored detection as a table row, and per scene the detections counted as correct,
    false or unchecked (no ground truth), plus the ground-truth instances missed.

    ``stages.recognize.detections`` is a list of dicts (``Detection.as_dict`` plus
    ``model_name``); the verdict needs the scan's ``ground_truth`` attrs and the evaluation's
    ``resolution`` (the tolerance is 10 resolutions, as the recognize task evaluates)."""
    rows, scenes = [], []
    names: dict[str | None, dict[str, int]] = {}
    for sid in store.scans():
        attrs = store.attrs(sid)
        rec = attrs.get("stages", {}).get("recognize")
        if rec is None:
            continue
        dets = rec.get("detections") or []
        truth = attrs.get("ground_truth")
        resolution = (rec.get("evaluation") or {}).get("resolution")
        verdicts: list[bool | None] = [None] * len(dets)
        if truth is not None and resolution:
            lib = rec.get("library")
            if lib not in names:
                names[lib] = _library_names(store, lib)
            name_to_id = {**{_short(d.get("model_name", d["model"])): d["model_id"] for d in dets}, **names[lib]}
            verdicts = _correct(dets, truth, name_to_id, 10 * resolution)
        for d, ok in zip(dets, verdicts):
            pose = np.asarray(d["pose"], np.float64)
            angle = np.degrees(np.arccos(np.clip((np.trace(pose[:3, :3]) - 1.0) / 2.0, -1.0, 1.0)))
            rows.append([sid, d.get("model_name", d["model"]), f"{d['score']:.3f}",
                         _num(d["inliers"]) + (f" / {_num(d['visible'])}" if d.get("visible") else ""),
                         "(" + ", ".join(f"{x:.3f}" for x in pose[:3, 3]) + ")", f"{angle:.1f}",
                         "" if ok is None else ("yes" if ok else "no")])
        checked = truth is not None and bool(resolution)
        tp = sum(v is True for v in verdicts)
        scenes.append({"scan_id": sid, "correct": tp, "false": sum(v is False for v in verdicts),
                       "unchecked": sum(v is None for v in verdicts),
                       "missed": len(truth) - tp if checked else 0, "checked": checked})
    return {"rows": rows, "scenes": scenes}


def _detections_plot(scenes: list[dict], *, max_labels: int = 24) -> str:
    """Stacked bars per scene: correct, false and unchecked detections, and hatched above them
    the ground-truth instances missed (bars of height 0 are left out: their edges would show)."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _pyplot().subplots(figsize=(7, 3))
    x = np.arange(len(scenes))
    bottom = np.zeros(len(scenes))
    for key, style in (("correct", {"color": "tab:green"}), ("false", {"color": "tab:red"}),
                       ("unchecked", {"color": "tab:blue"}),
                       ("missed", {"color": "none", "edgecolor": "tab:red", "hatch": "//"})):
        h = np.array([s[key] for s in scenes], float)
        if h.any():
            ax.bar(x[h > 0], h[h > 0], bottom=bottom[h > 0], label=key, **style)
            bottom += h
    if len(scenes) <= max_labels:
        ax.set_xticks(x, [_clip(s["scan_id"], 32) for s in scenes], rotation=30, ha="right", fontsize=7)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("scene")
    ax.set_ylabel("detections")
    ax.set_title("Detections per scene")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return _png(fig)


#: bench records listed in the report at most (newest first), and rows shown of each bench's newest
MAX_BENCH_RECORDS = 30
MAX_BENCH_ROWS = 60

#: The page's style. Wide content wraps instead of running past the right edge: ids, paths,
#: reasons and summaries (class ``w``) break anywhere when they must and are given room
#: (``min-width``); short words, times and numbers (``t``, ``n``) do not break.
CSS = ("*{box-sizing:border-box}"
       "body{font-family:system-ui,sans-serif;margin:2em auto;padding:0 16px;max-width:1200px;color:#222}"
       "h1,h2,h3,p{overflow-wrap:anywhere}h2{margin-top:1.6em}.sub{color:#666}img{max-width:100%;height:auto}"
       "table{border-collapse:collapse;margin:.5em 0;font-size:13px;max-width:100%}"
       "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top;overflow-wrap:break-word}"
       "th{background:#f3f3f3;white-space:nowrap}"
       ".w{overflow-wrap:anywhere;min-width:12em}.t{white-space:nowrap}"
       ".n{white-space:nowrap;text-align:right;font-variant-numeric:tabular-nums}"
       "table.kv th{text-align:left;width:9em}table.kv td{overflow-wrap:anywhere}")


def write_report(store_path: str, out: str | Path, *, bench_dir: str | Path = "bench-results") -> Path:
    """Write the HTML report of ``store_path`` to ``out``; returns the path.

    Bench records are read from ``bench_dir`` and, for a relative one, the same folder beside and
    inside the store (see :func:`_bench_dirs`); without any, the page has no Benchmarks section."""
    store = ScanStore(store_path, mode="r")
    info = store.info()
    runs = sorted(store.runs(), key=_start_key, reverse=True)  # newest first
    tfig, untimed = _throughput_figure(runs)
    tp = _png(tfig) if tfig is not None else None
    bench = _bench_records(_bench_dirs(store_path, bench_dir))
    bp = _bench_plot(bench)
    det = _detections(store)
    quarantine = store.quarantined()
    esc = html.escape

    def cell(c, kind):
        if isinstance(c, tuple):  # (text, ISO time): a <time> element
            text, iso = c
            body = f'<time datetime="{esc(str(iso))}">{esc(text)}</time>' if iso else esc(text)
        else:
            body = esc(str(c))
        return f"<td class={kind}>{body}</td>" if kind else f"<td>{body}</td>"

    def table(headers, rows, kinds=""):
        """Columns' kinds, one letter each: w (ids, paths, reasons: wrap anywhere), t (no wrap),
        n (number: right, no wrap), or - (plain text)."""
        kinds = [k if k in "wtn" else "" for k in kinds.ljust(len(headers), "-")]
        head = "".join(f"<th>{esc(str(h))}</th>" for h in headers)
        body = "".join("<tr>" + "".join(cell(c, k) for c, k in zip(r, kinds)) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def when(iso):
        return (_when(iso), iso) if iso else ""

    def started(r):
        text = _started(r)  # an ISO time, or "≈ ISO" estimated for older records
        if not text:
            return ""
        return ("≈ " + _when(text[2:])) if text.startswith("≈") else (_when(text), text)

    def took(r):
        start, end = _run_start(r), _epoch(r.get("finished"))
        if start is not None and end is not None and r.get("started"):
            return _duration(max(0.0, end - start))
        seconds = (r.get("summary") or {}).get("seconds")
        return _duration(seconds) if isinstance(seconds, (int, float)) else ""

    def summary(r):
        return _pairs({k: v for k, v in (r.get("summary") or {}).items() if k != "seconds"})  # "took" has it

    def items(r):
        return ", ".join(f"{n:,} {s}" for s, n in Counter(x.get("status", "?") for x in r.get("records") or []).items())

    store_rows = [("scans", _num(info["scans"])), ("points", _num(info["points"])),
                  ("formats", _pairs(info["formats"]) or "none"), ("stages", _pairs(info["stages"]) or "none"),
                  ("quarantined", _num(info["quarantined"])), ("incomplete", _num(len(info["incomplete"]))),
                  ("damaged", _num(len(info.get("damaged") or []))), ("runs", _num(info["runs"]))]
    parts = [f"<h1>scanforest report</h1><p class=sub>{esc(str(store.path))}</p>",
             "<h2>Store</h2>",
             "<table class=kv><tbody>" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>"
                                                 for k, v in store_rows) + "</tbody></table>",
             "<h2>Runs</h2>"]
    if runs:
        parts.append("<p class=sub>Newest first; times in UTC.</p>" + table(
            ["run", "flow", "status", "started", "took", "items", "summary"],
            [[r["id"], r.get("flow", ""), _status(r), started(r), took(r), items(r), summary(r)] for r in runs],
            "wtttn-w"))
    else:
        parts.append("<p>No runs recorded.</p>")
    parts.append("<h2>Throughput over time</h2>"
                 + (f'<img alt="throughput" src="{tp}">' if tp else "<p>No timed runs.</p>"))
    if untimed:
        parts.append(f"<p class=sub>Not plotted (records without finish times): {esc(', '.join(untimed))}.</p>")
    if bench:
        parts.append("<h2>Benchmarks</h2>")
        if bp:
            parts.append(f'<img alt="recall vs throughput" src="{bp}">')
        latest: dict[str, dict] = {}
        for b in bench:  # newest first: the first of each bench is its newest
            latest.setdefault(b["bench"], b)
        for name, b in sorted(latest.items()):
            rows = b["rows"]
            parts.append(f"<h3>bench {esc(name)}</h3><p class=sub>Newest record: {esc(b['file'])}, {_minute(b['time'])}"
                         + (f", {esc(str(b['gpu']))}" if b["gpu"] else "")
                         + (f", took {esc(_duration(b['seconds']))}" if isinstance(b["seconds"], (int, float)) else "")
                         + (f"; the first {MAX_BENCH_ROWS} of {len(rows):,} rows" if len(rows) > MAX_BENCH_ROWS else "")
                         + ".</p>")
            parts.append(table(["figure", "value", "device", "vs baseline"],
                               [[r.get("figure", ""), _bench_value(r), r.get("device", ""), _bench_baseline(r)]
                                for r in rows[:MAX_BENCH_ROWS]], "wn-w"))
        parts.append("<h3>Records</h3><p class=sub>Newest first" + (
            f"; the newest {MAX_BENCH_RECORDS} of {len(bench):,}" if len(bench) > MAX_BENCH_RECORDS else "")
            + ".</p>" + table(
            ["written", "bench", "file", "gpu", "rows"],
            [[_minute(b["time"]), b["bench"], str(Path(b["dir"]) / b["file"]), b["gpu"] or "", _num(len(b["rows"]))]
             for b in bench[:MAX_BENCH_RECORDS]],
            "ttw-n"))
    parts.append("<h2>Detections</h2>")
    if det["scenes"]:
        rows, scenes = det["rows"], det["scenes"]
        checked = [s for s in scenes if s["checked"]]
        line = f"{len(rows):,} detections in {len(scenes):,} recognised scenes."
        if checked:
            tp_, fp_, fn_ = (sum(s[k] for s in checked) for k in ("correct", "false", "missed"))
            line += (f" Against ground truth ({len(checked):,} scenes): {tp_:,} correct, {fp_:,} false, {fn_:,} missed;"
                     f" precision {_share(tp_, tp_ + fp_)}, recall {_share(tp_, tp_ + fn_)}.")
        if len(rows) > MAX_DETECTION_ROWS:
            line += f" Table: the first {MAX_DETECTION_ROWS:,} (all of them: scanforest recognize --export)."
        parts.append(f'<img alt="detections" src="{_detections_plot(scenes)}"><p>{esc(line)}</p>' + table(
            ["scene", "model", "score", "inliers / visible", "translation", "rotation (deg)", "correct"],
            rows[:MAX_DETECTION_ROWS], "wwnntnt"))
    else:
        parts.append("<p>No recognition results yet.</p>")
    failed_runs = [r for r in runs if r.get("status") == "failed" or _status(r) in ("interrupted",
                                                                                  "running or interrupted")]
    failed_items = [[r["id"], x.get("scan_id", ""), x.get("reason", "")]
                    for r in runs for x in r.get("records") or [] if x.get("status") == "failed"]
    parts.append("<h2>Failures</h2>")
    if quarantine:
        parts.append("<h3>Quarantined files</h3>" + table(
            ["file", "reason", "time"], [[q["source"], q["reason"], when(q.get("time"))] for q in quarantine], "wwt"))
    if failed_runs:
        parts.append("<h3>Failed or interrupted runs</h3>" + table(
            ["run", "flow", "status", "started", "error"],
            [[r["id"], r.get("flow", ""), _status(r), when(r.get("started")), r.get("error", "")] for r in failed_runs],
            "wtttw"))
    if failed_items:
        parts.append("<h3>Failed items</h3>" + table(["run", "scan", "reason"], failed_items, "www"))
    if not (quarantine or failed_runs or failed_items):
        parts.append("<p>No quarantined files, failed runs or failed items.</p>")
    doc = (f"<!doctype html><html><head><meta charset=utf-8>"
           f"<meta name=viewport content='width=device-width, initial-scale=1'><title>scanforest report</title>"
           f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    return out
