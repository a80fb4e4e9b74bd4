"""Integrity of the scan store: what :meth:`Integrity.verify` finds (leftover, incomplete or
damaged scans, damaged stages, id collisions), what :meth:`Integrity.repair` does about it, and
the checks that a write read back whole (:func:`_check_written`).
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from scanforest.kernels.errors import InputError

from .locks import file_lock


class Integrity:
    """The checks and repairs of a :class:`~scanforest.tasks.store.scans.ScanStore` (a mixin: it
    uses the store's ``path``, ``root``, claims, scans and runs)."""

    def verify(self, *, read: bool = True) -> list[dict[str, str]]:
        """Scans that are not what their attrs say, one record each: ``scan_id``, ``problem``
        and ``detail``. Problems:

        ``leftover``    a folder under ``scans/`` without Zarr metadata (an interrupted delete)
        ``incomplete``  a group never flipped complete (a killed writer)
        ``damaged``     complete, but a promised array is missing, has another shape or dtype,
                        lacks chunk files, or (``read``) has a chunk that does not decode: cut
                        short or altered (``points`` must exist and match ``n_points``)
        ``stage``       a stage is recorded whose arrays are missing, cut short or do not decode
        ``collision``   several files were written as this one id (:meth:`collisions`)

        ``read=False`` checks the metadata and the chunk files' presence only (every chunk is
        otherwise read and decoded, one chunk row at a time). A scan whose claim another process
        holds is being written and is not judged.
        """
        return self._damage(read=read) + self.collisions()

    def _damage(self, *, read: bool = False) -> list[dict[str, str]]:
        """:meth:`verify`'s problems of the scans' own groups (all but collisions)."""
        scans_dir = Path(self.path) / "scans"
        if not scans_dir.is_dir():
            return []
        out = []
        for entry in sorted(os.scandir(scans_dir), key=lambda e: e.name):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            with file_lock(self._lock_path("scans", entry.name), wait=False, create=False) as free:
                if free:
                    out += self._problems_of(entry.name, read=read)
        return out

    def collisions(self) -> list[dict[str, str]]:
        """Scan ids that several files were written as, one record each (problem ``collision``).

        Versions before unique ids (:func:`legacy_scan_id`) gave different names one id, ``a b.pcd``
        and ``a_b.pcd`` or ``日本語.pcd`` and ``中文.pcd`` (``_.pcd``): the file written last kept
        the scan and the others were overwritten, with no trace in the scans. The ingest run's
        manifest shows it: one record per file, so that id comes up more than once. The latest
        ingest run of each source decides (one with records: a run killed early has none), so
        ingesting that source again with this version, where every file gets an id of its own and
        the file the scan holds keeps the old one, clears it. ``repair`` cannot: the scan is whole
        and the lost files are only in the source.
        """
        latest: dict[str, dict[str, Any]] = {}
        for run in self.runs():
            if run.get("flow") == "ingest" and run.get("records"):
                src = str((run.get("parameters") or {}).get("source"))
                if src not in latest or _run_order(run) >= _run_order(latest[src]):
                    latest[src] = run
        out = []
        for src, run in sorted(latest.items()):
            counts: dict[str, int] = {}
            for rec in run["records"]:
                counts[rec.get("scan_id")] = counts.get(rec.get("scan_id"), 0) + 1
            for sid, n in sorted((k, v) for k, v in counts.items() if k and v > 1):
                try:
                    held = f"it holds {self.attrs(sid).get('source')}"
                except InputError:
                    held = "the scan is gone"
                out.append({"scan_id": sid, "problem": "collision",
                            "detail": f"{n} files of ingest run {run['id']} were written as this one id (an older "
                                      f"version's ids), {n - 1} of them overwritten; {held}: ingest {src} again "
                                      "to give each file its own id"})
        return out

    def _problems_of(self, scan_id: str, *, read: bool = False) -> list[dict[str, str]]:
        try:
            return self._judge(scan_id, read)
        except (ValueError, KeyError, TypeError, OSError) as exc:  # a metadata file cut short or not JSON
            why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            return [{"scan_id": scan_id, "problem": "damaged", "detail": f"its metadata does not read back ({why})"}]

    def _judge(self, scan_id: str, read: bool) -> list[dict[str, str]]:
        """:meth:`_problems_of`, where a metadata file that does not parse raises."""
        def rec(problem: str, detail: str) -> dict[str, str]:
            return {"scan_id": scan_id, "problem": problem, "detail": detail}

        if not (Path(self.path) / "scans" / scan_id / "zarr.json").exists():
            return [rec("leftover", "folder without Zarr metadata (an interrupted write or delete)")]
        grp = self.root["scans"][scan_id]
        if not grp.attrs.get("complete", False):
            return [rec("incomplete", "never marked complete (an interrupted write)")]
        damage = _scan_problems(grp, read=read)
        if damage:
            return [rec("damaged", "; ".join(damage))]
        return [rec("stage", f"stage {stage!r}: " + "; ".join(found))
                for stage, found in _stage_problems(grp, read=read).items()]

    def repair(self, *, read: bool = True) -> list[dict[str, str]]:
        """Fix what :meth:`verify` finds so that the next run rewrites it; returns what was done.

        A leftover, incomplete or damaged scan is removed (the next ingest writes it again from
        its source); a damaged stage loses its record and its arrays (the next run of that stage
        redoes it). Each fix happens under the scan's claim after checking again, so a scan
        that a writer is busy with is left alone. A collision stays: only an ingest fixes it.
        ``read``: as :meth:`verify`'s.
        """
        self._writable()
        done = []
        for sid in sorted({found["scan_id"] for found in self._damage(read=read)}):
            with self.claim(sid, wait=False) as free:
                probs = self._problems_of(sid, read=read) if free else []
                if probs and probs[0]["problem"] == "stage":
                    self._drop_damaged_stages(sid, read=read)
                    done += [{**p, "action": "stage record and arrays dropped (run the stage again)"} for p in probs]
                elif probs:
                    shutil.rmtree(Path(self.path) / "scans" / sid)
                    done.append({**probs[0], "action": "scan removed (ingest again to restore it)"})
        return done

    def _drop_damaged_stages(self, scan_id: str, *, read: bool = False) -> None:
        grp = self.root["scans"][scan_id]
        stages = dict(grp.attrs.get("stages", {}))
        base = set(grp.attrs.get("arrays", {})) | {"points"}
        keys = set(grp.array_keys())
        for stage in _stage_problems(grp, read=read):
            rec = stages.pop(stage)
            for name in set(rec.get("arrays", {})) - base:
                if name in keys:
                    del grp[name]
        grp.attrs["stages"] = stages


def _run_order(run: dict[str, Any]) -> tuple[str, str]:
    """A run manifest's place in time: its start (UTC), then its id (flow, local start time, random)."""
    return run.get("started") or "", run["id"]



def _array_problems(grp, promised: dict[str, Any], *, read: bool = False) -> list[str]:
    """How the group's arrays differ from ``promised`` (``{name: {shape, dtype}}``); ``read``:
    and which of them has a chunk that does not decode (:func:`_unreadable`)."""
    keys = set(grp.array_keys())
    out = []
    for name, spec in promised.items():
        if name not in keys:
            out.append(f"array {name!r} is missing")
            continue
        z = grp[name]
        problem = _spec_problem(name, spec, list(z.shape), str(z.dtype), z.nchunks, z.nchunks_initialized)
        if problem is None and read:
            problem = _unreadable(name, z)
        if problem:
            out.append(problem)
    return out


def _unreadable(name: str, z) -> str | None:
    """Whether every chunk of the array ``z`` decodes, read one row of chunks at a time (a scan
    of any size in bounded memory): the first that does not, or None."""
    from .errors import StoreReadError, _decoded  # the reads' own rule of what a damaged chunk raises

    rows = z.chunks[0] if z.ndim else 1
    n = z.shape[0] if z.ndim else 1
    for start in range(0, n, max(1, rows)):
        try:
            _decoded("", "", name, lambda s=start: z[s:s + rows] if z.ndim else z[...])
        except StoreReadError as exc:
            return f"array {name!r} rows {start}-{min(n, start + rows) - 1} do not read back ({exc.reason})"
    return None


def _spec_problem(name: str, spec: dict[str, Any], shape: list, dtype: str, nchunks: int, have: int) -> str | None:
    """How one stored array differs from its promise (``{shape, dtype}``), or None."""
    if list(shape) != list(spec["shape"]) or dtype != spec["dtype"]:
        return f"array {name!r} is {list(shape)} {dtype}, attrs promise {spec['shape']} {spec['dtype']}"
    if have < nchunks:
        return f"array {name!r} lacks {nchunks - have} of {nchunks} chunks"
    return None


def _scan_problems(grp, *, read: bool = False) -> list[str]:
    """A complete scan's damage. Scans written before the ``arrays`` record existed are checked
    for their ``points`` against ``n_points`` only."""
    a = grp.attrs
    promised = a.get("arrays")
    if promised is not None:
        return _array_problems(grp, promised, read=read)
    if "points" not in set(grp.array_keys()):
        return ["array 'points' is missing"]
    rows = grp["points"].shape[0]
    if "n_points" in a and rows != a["n_points"]:
        return [f"array 'points' has {rows} rows, attrs say n_points = {a['n_points']}"]
    bad = _unreadable("points", grp["points"]) if read else None
    return [bad] if bad else []


def _stage_problems(grp, *, read: bool = False) -> dict[str, list[str]]:
    out = {}
    for stage, rec in grp.attrs.get("stages", {}).items():
        found = _array_problems(grp, rec["arrays"], read=read) if isinstance(rec, dict) and "arrays" in rec else []
        if found:
            out[stage] = found
    return out


def _raise_unwritten(what: str, found: list[str]) -> None:
    """Raise when freshly written arrays did not read back (``found``: the problems, none when
    they are whole): the task then fails and is retried instead of marking a damaged write as done."""
    if found:
        raise OSError(errno.EIO, f"{what}: written arrays did not read back: {'; '.join(found)}")


def _check_written(grp, promised: dict[str, Any], what: str) -> None:
    """:func:`_raise_unwritten` for the group's arrays against their promise (``{name: {shape, dtype}}``)."""
    _raise_unwritten(what, _array_problems(grp, promised))
