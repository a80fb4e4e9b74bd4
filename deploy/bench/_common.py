"""Benchmark reporting shared by every ``scanforest bench ...`` command.

A benchmark measures its figures and the baseline in the same run and hands rows to
:class:`BenchReport`, which prints one table (figure, value, unit, device, baseline, ratio) and
writes the whole record (rows, environment, parameters) as JSON.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("bench-results")


@dataclass
class BenchRow:
    figure: str                 # what was measured, e.g. "P-BANNS queries/s (N=10M, d=352)"
    value: float
    unit: str
    device: str                 # "cpu (2 cores)" / "gpu (NVIDIA H100 80GB HBM3)"
    baseline: str | None = None  # name of the baseline row measured in the same run
    baseline_value: float | None = None
    higher_is_better: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """Speed-up over the baseline (>1 means better than the baseline)."""
        if self.baseline_value in (None, 0) or self.value in (None, 0):
            return None
        r = self.value / self.baseline_value
        return r if self.higher_is_better else 1.0 / r


def environment() -> dict[str, Any]:
    from scanforest.kernels.backend import gpu_available, gpu_name

    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu_name() if gpu_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import numpy

        env["numpy"] = numpy.__version__
        import cupy  # noqa: F401

        env["cupy"] = cupy.__version__
    except Exception:
        pass
    return env


_UNCHECKED = object()


def check_out(out) -> None:
    """An :class:`~scanforest.kernels.errors.InputError` (one line) unless a bench's JSON can be
    written at ``out`` (a ``.json`` file or a folder; None: :data:`DEFAULT_DIR`): its folder is
    made and a file tried in it, so a read-only or misnamed location fails before the run, not
    after it."""
    import tempfile

    from scanforest.kernels.errors import InputError

    path = Path(out) if out else DEFAULT_DIR
    folder = path.parent if path.suffix == ".json" else path
    try:
        if path.suffix == ".json" and path.is_dir():
            raise IsADirectoryError(21, "a folder of that name exists")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".bench-probe-"):
            pass
    except OSError as exc:
        where = f"--out {path}" if out else f"{path} (the default --out, in the working folder)"
        raise InputError(f"{where}: cannot write the bench's JSON there ({exc.strerror or exc})") from None


def check_program(path, flag: str) -> None:
    """A baseline program the user named (``--pcl-baseline``, ``--flann-baseline``) that is not an
    executable file: one line, before anything is measured (it was a note after the run)."""
    if path is None or str(path) == "":
        return
    import os

    from scanforest.kernels.errors import InputError

    p = Path(path)
    if not p.is_file():
        raise InputError(f"{flag} {p}: no such program (build it from its source in deploy/baselines/)")
    if not os.access(p, os.X_OK):
        raise InputError(f"{flag} {p}: not executable (chmod +x it)")


class BenchReport:
    """Collect rows, print them as a table, write JSON to ``out`` (a file or a folder).

    ``echo=True`` also prints every row as it is added (long runs that may be cut off)."""

    def __init__(self, name: str, params: dict[str, Any] | None = None, *, echo: bool = False, out=_UNCHECKED):
        """``out``: where :meth:`finish` will write (None: :data:`DEFAULT_DIR`), checked now, before
        anything is measured (:func:`check_out`)."""
        if out is not _UNCHECKED:
            check_out(out)
        self.name = name
        self.params = dict(params or {})
        self.rows: list[BenchRow] = []
        self.notes: list[str] = []
        self.started = time.time()
        self.echo = echo
        self._t0 = time.perf_counter()

    def add(self, figure: str, value: float, unit: str, device: str, *, baseline: str | None = None,
            baseline_value: float | None = None, higher_is_better: bool = True, **extra) -> BenchRow:
        row = BenchRow(figure, float(value), unit, device, baseline,
                       None if baseline_value is None else float(baseline_value), higher_is_better, extra)
        self.rows.append(row)
        if self.echo:  # a long run that is cut off keeps the rows it printed
            print(f"row: {figure}: {row.value:.6g} (t={time.perf_counter() - self._t0:.0f} s)", flush=True)
        return row

    def note(self, text: str) -> None:
        self.notes.append(text)

    def table(self) -> str:
        head = ("figure", "value", "unit", "device", "baseline", "ratio")
        body = []
        for r in self.rows:
            ratio = r.ratio
            body.append((r.figure, _fmt(r.value), r.unit, r.device, r.baseline or "-",
                         "-" if ratio is None else f"{ratio:.2f}x"))
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
        out = [f"scanforest bench {self.name}", line(head), line(["-" * w for w in widths])]
        out += [line(b) for b in body]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def write(self, out: str | os.PathLike | None = None) -> Path:
        path = Path(out) if out else DEFAULT_DIR
        if path.suffix != ".json":
            path.mkdir(parents=True, exist_ok=True)
            path = path / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "bench": self.name,
            "params": self.params,
            "environment": environment(),
            "seconds": time.time() - self.started,
            "rows": [dict(asdict(r), ratio=r.ratio) for r in self.rows],
            "notes": self.notes,
        }
        path.write_text(json.dumps(record, indent=2, default=str))
        return path

    def finish(self, out: str | os.PathLike | None = None) -> Path:
        """Print the table and write the JSON; returns the JSON path."""
        print(self.table())
        path = self.write(out)
        print(f"wrote {path}")
        return path


def parse_counts(text: str) -> list[int]:
    """``"100900,1m,10k"`` -> ``[100900, 1000000, 10000]`` (k/m suffixes, underscores allowed);
    anything else is an :class:`~scanforest.kernels.errors.InputError` naming the text."""
    from scanforest.kernels.errors import InputError

    out = []
    for raw in str(text).split(","):
        part = raw.strip().lower().replace("_", "")
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            mult, part = 1000, part[:-1]
        elif part.endswith("m"):
            mult, part = 1_000_000, part[:-1]
        try:
            v = float(part) * mult
        except ValueError:
            raise InputError(f"{raw.strip()!r} in {text!r} is not a count (a number, optionally with k or m)") \
                from None
        if not math.isfinite(v):
            raise InputError(f"{raw.strip()!r} in {text!r} is not a count (a number, optionally with k or m)")
        out.append(int(v))
    return out


def _fmt(v: float) -> str:
    if v == 0 or 1e-3 <= abs(v) < 1e7:
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:.3e}"


class numba_threads:
    """Numba threads of the CPU backend set to ``n`` inside the block (0 or None: unchanged), so a
    comparison with an external baseline runs on the same thread count."""

    def __init__(self, n: int | None):
        self.n = n

    def __enter__(self):
        import numba

        self.old = numba.get_num_threads()
        if self.n:
            numba.set_num_threads(min(int(self.n), numba.config.NUMBA_NUM_THREADS))
        return self

    def __exit__(self, *exc):
        import numba

        numba.set_num_threads(self.old)


def baseline_lines(rep: "BenchReport", cmd: list[str]) -> list[dict] | None:
    """Run an external baseline program (``deploy/baselines/``) that prints one JSON line per
    result; returns those lines, or None with a note in ``rep`` when it cannot be run or prints
    no result."""
    import subprocess

    try:
        res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=True)
        runs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
        if not runs:
            raise ValueError("no result line")
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        err = getattr(exc, "stderr", None)
        rep.note(f"baseline {' '.join(map(str, cmd))} failed: {exc}" + (f" ({err.strip()[-300:]})" if err else ""))
        return None
    return runs


def run_baseline(rep: "BenchReport", cmd: list[str]) -> tuple[dict, int] | None:
    """:func:`baseline_lines` of a program that prints one line per repetition with a
    ``total_s`` field: (the median repetition, repetitions), or None."""
    runs = baseline_lines(rep, cmd)
    if runs is None:
        return None
    return sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2], len(runs)


class Utilization:
    """Host CPU and GPU utilisation sampled in a background thread while the block runs.

    ``cpu`` is the mean busy share of all host cores (psutil); ``gpus`` maps each GPU this
    process may use (``CUDA_VISIBLE_DEVICES``, by index or UUID; all of them when unset) to the
    mean of ``nvidia-smi``'s utilisation of it, and ``gpu`` is their mean (None without
    nvidia-smi), all in percent: which resource a stage is bound by, and whether every GPU
    of a run did its share. ``nvidia-smi`` lists every card of the host whatever the process
    sees, so the cards are picked out by index or UUID."""

    def __init__(self, period: float = 1.0):
        self.period = period
        self.cpu: float | None = None
        self.gpu: float | None = None
        self.gpus: dict[str, float] = {}
        self.gpu_memory_peak: dict[str, float] = {}  # MiB used at the most, each visible card
        self.gpu_memory_total: float | None = None  # MiB, the first visible card

    def __enter__(self):
        import shutil
        import threading

        self._cpu, self._gpu = [], {}
        self._stop = threading.Event()
        self._smi = shutil.which("nvidia-smi")
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        self._visible = None if vis is None else [v.strip() for v in vis.split(",") if v.strip()]
        try:
            import psutil

            psutil.cpu_percent(None)  # starts the interval
            self._psutil = psutil
        except ImportError:  # pragma: no cover - distributed depends on psutil
            self._psutil = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _gpu_sample(self) -> dict[str, float] | None:
        """``{index: busy %}`` of the visible GPUs, or None; their memory in use goes to
        :attr:`gpu_memory_peak`."""
        import subprocess

        try:
            out = subprocess.run([self._smi, "--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total",
                                  "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5).stdout.splitlines()
            rows = [[c.strip() for c in line.split(",")] for line in out if line.count(",") == 4]
            got = {}
            for idx, uuid, util, used, total in rows:
                if self._visible is None or any(v == idx or (v.startswith("GPU-") and uuid.startswith(v))
                                                for v in self._visible):
                    got[idx] = float(util)
                    self.gpu_memory_peak[idx] = max(self.gpu_memory_peak.get(idx, 0.0), float(used))
                    self.gpu_memory_total = self.gpu_memory_total or float(total)
            return got or None
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def _run(self):
        while not self._stop.wait(self.period):
            if self._psutil is not None:
                self._cpu.append(self._psutil.cpu_percent(None))
            if self._smi:
                g = self._gpu_sample()
                for idx, v in (g or {}).items():
                    self._gpu.setdefault(idx, []).append(v)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)
        self.cpu = sum(self._cpu) / len(self._cpu) if self._cpu else None
        self.gpus = {idx: sum(v) / len(v) for idx, v in sorted(self._gpu.items(), key=lambda kv: int(kv[0]))}
        self.gpu = sum(self.gpus.values()) / len(self.gpus) if self.gpus else None

    def extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: round(v, 1) for k, v in (("host_cpu_busy_pct", self.cpu),
                                                           ("gpu_busy_pct", self.gpu)) if v is not None}
        if len(self.gpus) > 1:  # each card's share: one idle GPU hides in a mean
            out["gpu_busy_pct_each"] = {idx: round(v, 1) for idx, v in self.gpus.items()}
            out["gpu_busy_pct_min"] = round(min(self.gpus.values()), 1)
        return out


def read_record(path, config: dict) -> dict | None:
    """A bench's record kept on its workdir (JSON with a ``config``), when it was made with
    ``config``; None when absent, unreadable or of another configuration."""
    import json

    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("config") == config else None
