"""The scan store: a Zarr v3 hierarchy that every stage reads from and writes to.

Layout (``STORE`` is a directory, or any zarr store URL)::

    STORE/
      zarr.json                      root group; attrs: scanforest_store (layout version), created
      scans/<scan_id>/               one group per scan
          points        (N, 3) float32|float64, chunks of CHUNK_ROWS rows
          normals       (N, 3) float32          (when the source had them)
          colors        (N, 3) uint8
          intensity     (N,)   float32
          pixel_index   (N,)   int64           (organised clouds: index into WIDTH x HEIGHT)
          extra_<name>  other per-point fields
          <stage arrays>  written later by describe/match/recognize (keypoints, descriptors, ...)
        attrs: source, sha256, format, encoding, n_points, units, bbox, ingested_at,
               ground_truth (synthetic scenes), complete (bool), and per-stage records
      quarantine/<id>/               one group per rejected file; attrs: source, reason, sha256, time
      runs/<run_id>/                 run manifests (what ran, versions, parameters, timings)

Visibility rule: a scan group is written with ``complete = False`` and flipped to ``True`` only
after every array is written; :meth:`ScanStore.scans` lists complete scans only, and a later
ingest replaces an incomplete group. Every write is to its own group, so Dask workers can write
different scans in parallel without locks.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from scanforest.kernels.errors import InputError

LAYOUT_VERSION = 1
CHUNK_ROWS = 1 << 18  # 262,144 rows per chunk: ~3 MB of float32 xyz, good for parallel writes


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def scan_id_for(relpath: str) -> str:
    """A stable, filesystem-safe scan id from a path relative to the ingest root.

    ``a/b/scene 1.pcd`` -> ``a__b__scene_1.pcd``: the extension stays so ``x.pcd`` and ``x.ply``
    are different scans.
    """
    parts = [p for p in Path(relpath).as_posix().split("/") if p not in ("", ".")]
    sid = "__".join(_SAFE.sub("_", p) for p in parts)
    return sid.lstrip(".") or "scan"


class ScanStore:
    """A Zarr v3 scan store (see the module docstring for the layout).

    Parameters
    ----------
    path : str or path-like
        Directory of the store (created on first write with ``mode="a"``).
    mode : {"a", "r"}
        ``"r"`` refuses writes and requires an existing store.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "a"):
        import zarr

        self.path = str(path)
        self.mode = mode
        if mode == "r" and not Path(self.path).exists():
            raise InputError(f"store {self.path!r} does not exist")
        try:
            self.root = zarr.open_group(self.path, mode="r" if mode == "r" else "a", zarr_format=3)
        except Exception as exc:
            raise InputError(f"{self.path}: not a scanforest (Zarr v3) store: {exc}") from exc
        if mode != "r" and "scanforest_store" not in self.root.attrs:
            self.root.attrs.update({"scanforest_store": LAYOUT_VERSION, "created": _now()})
        if mode != "r":
            for name in ("scans", "quarantine", "runs"):
                if name not in self.root:
                    self.root.require_group(name)

    def __repr__(self) -> str:
        return f"ScanStore({self.path!r}, scans={len(self.scans())})"

    # ------------------------------------------------------------------ listing
    def _group(self, kind: str):
        return self.root[kind] if kind in self.root else None

    def scans(self, *, include_incomplete: bool = False) -> list[str]:
        """Ids of the scans in the store, sorted; only completely written ones by default."""
        g = self._group("scans")
        if g is None:
            return []
        out = []
        for name, child in g.groups():
            if include_incomplete or child.attrs.get("complete", False):
                out.append(name)
        return sorted(out)

    def __contains__(self, scan_id: str) -> bool:
        return scan_id in self.scans()

    def attrs(self, scan_id: str) -> dict[str, Any]:
        return dict(self._scan(scan_id).attrs)

    def _scan(self, scan_id: str, *, complete: bool = True):
        g = self._group("scans")
        if g is None or scan_id not in g:
            raise InputError(f"{self.path}: no scan {scan_id!r}")
        grp = g[scan_id]
        if complete and not grp.attrs.get("complete", False):
            raise InputError(f"{self.path}: scan {scan_id!r} is incomplete (an interrupted write); re-ingest it")
        return grp

    def is_current(self, scan_id: str, sha256: str) -> bool:
        """True when the scan exists, is complete and came from bytes with this sha256."""
        g = self._group("scans")
        if g is None or scan_id not in g:
            return False
        a = g[scan_id].attrs
        return bool(a.get("complete", False)) and a.get("sha256") == sha256

    # ------------------------------------------------------------------ scans
    def write_scan(self, scan_id: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Write one scan atomically with respect to readers (complete flag set last).

        An existing group of that id (incomplete, or from older bytes) is replaced.
        """
        if self.mode == "r":
            raise InputError(f"{self.path}: store opened read-only")
        if "points" not in arrays:
            raise InputError("write_scan needs a 'points' array")
        scans = self.root.require_group("scans")
        if scan_id in scans:
            del scans[scan_id]
        grp = scans.create_group(scan_id)
        grp.attrs.update({**_jsonable(attrs), "complete": False})
        for name, arr in arrays.items():
            self._write_array(grp, name, np.asarray(arr))
        grp.attrs["complete"] = True

    @staticmethod
    def _write_array(grp, name: str, arr: np.ndarray, chunk_rows: int = CHUNK_ROWS):
        chunks = (min(chunk_rows, max(1, arr.shape[0])),) + tuple(arr.shape[1:]) if arr.ndim else ()
        z = grp.create_array(name, shape=arr.shape, dtype=arr.dtype, chunks=chunks, overwrite=True)
        if arr.size:
            z[...] = arr
        return z

    def read(self, scan_id: str, name: str = "points") -> np.ndarray:
        grp = self._scan(scan_id)
        if name not in grp:
            raise InputError(f"{self.path}: scan {scan_id!r} has no array {name!r} (has: {sorted(grp.array_keys())})")
        return grp[name][...]

    def arrays(self, scan_id: str) -> list[str]:
        return sorted(self._scan(scan_id).array_keys())

    def read_cloud(self, scan_id: str):
        """The scan back as a :class:`~scanforest.tasks.readers.PointCloud`."""
        from .readers import PointCloud

        grp = self._scan(scan_id)
        keys = set(grp.array_keys())
        get = lambda n: grp[n][...] if n in keys else None  # noqa: E731
        cloud = PointCloud(get("points"), normals=get("normals"), colors=get("colors"),
                           intensity=get("intensity"), pixel_index=get("pixel_index"),
                           meta=dict(grp.attrs))
        cloud.extra = {k[6:]: grp[k][...] for k in keys if k.startswith("extra_")}
        return cloud

    def write_stage(self, scan_id: str, stage: str, arrays: dict[str, np.ndarray],
                    attrs: dict[str, Any] | None = None) -> None:
        """Write a later stage's arrays (e.g. ``describe``: keypoints, frames, descriptors) into a scan.

        The stage's record ``stages.<stage>`` is set last, so a half-written stage is never seen
        as done: :meth:`has_stage` is the idempotency check for tasks.
        """
        grp = self._scan(scan_id)
        stages = dict(grp.attrs.get("stages", {}))
        stages.pop(stage, None)
        grp.attrs["stages"] = stages
        for name, arr in arrays.items():
            self._write_array(grp, name, np.asarray(arr))
        stages[stage] = {**_jsonable(attrs or {}), "written": _now()}
        grp.attrs["stages"] = stages

    def has_stage(self, scan_id: str, stage: str, **params) -> bool:
        """True when ``stage`` was completely written for this scan (with these params, if given)."""
        try:
            rec = self._scan(scan_id).attrs.get("stages", {}).get(stage)
        except InputError:
            return False
        if rec is None:
            return False
        return all(rec.get(k) == _jsonable(v) for k, v in params.items())

    # ------------------------------------------------------------------ quarantine
    def quarantine(self, source: str, reason: str, sha256: str | None = None, *, key: str | None = None) -> str:
        """Record a rejected file under ``key`` (default: an id made from the source's name).

        One group per file, so parallel writers never collide; re-quarantining replaces the record.
        """
        qid = key or scan_id_for(Path(source).name)
        q = self.root.require_group("quarantine")
        if qid in q:
            del q[qid]
        grp = q.create_group(qid)
        grp.attrs.update({"source": source, "reason": reason, "sha256": sha256, "time": _now()})
        return qid

    def quarantined(self) -> list[dict[str, Any]]:
        g = self._group("quarantine")
        if g is None:
            return []
        return sorted((dict(child.attrs, id=name) for name, child in g.groups()), key=lambda d: d["id"])

    def release(self, source_id: str) -> None:
        """Drop a quarantine record (done automatically when the file later ingests cleanly)."""
        g = self._group("quarantine")
        if g is not None and source_id in g:
            del g[source_id]

    # ------------------------------------------------------------------ runs
    def write_run(self, run_id: str, record: dict[str, Any]) -> None:
        runs = self.root.require_group("runs")
        grp = runs.require_group(run_id)
        grp.attrs.update(_jsonable(record))

    def runs(self) -> list[dict[str, Any]]:
        g = self._group("runs")
        if g is None:
            return []
        return sorted((dict(child.attrs, id=name) for name, child in g.groups()), key=lambda d: d["id"])

    # ------------------------------------------------------------------ summary
    def info(self) -> dict[str, Any]:
        scans = self.scans()
        incomplete = sorted(set(self.scans(include_incomplete=True)) - set(scans))
        n_points = 0
        formats: dict[str, int] = {}
        stages: dict[str, int] = {}
        g = self._group("scans")
        for sid in scans:
            a = g[sid].attrs
            n_points += int(a.get("n_points", 0))
            formats[a.get("format", "?")] = formats.get(a.get("format", "?"), 0) + 1
            for st in a.get("stages", {}):
                stages[st] = stages.get(st, 0) + 1
        return {"path": self.path, "scans": len(scans), "points": n_points, "formats": formats,
                "stages": stages, "incomplete": incomplete, "quarantined": len(self.quarantined()),
                "runs": len(self.runs())}


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return obj


def iter_chunks(n: int, size: int) -> Iterable[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))
