"""Ingest: one scan file -> one complete scan group in the store (idempotent); a file of several
scans (E57) -> one scan group per scan, ids from :func:`part_scan_id`.

:func:`ingest_file` is the unit of work (:func:`ingest_files` runs a batch of them as one Dask
task). It hashes the file, skips it when the store already holds a complete scan from the same
bytes, otherwise reads it, writes all arrays and marks the scan complete; an unreadable file is
recorded in the store's quarantine with the reason and the batch goes on.
:data:`ingest_scan` is the Prefect task around it.
"""
from __future__ import annotations

import errno
import fcntl
import glob as _glob
import hashlib
import json
import lzma
import math
import os
import re
import shutil
import stat
import tarfile
import time
import zipfile
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from scanforest.kernels.errors import InputError, ScanReadError

from .las import EmptyQuery, copc_settings, is_copc
from .readers import FORMATS, MULTI_SCAN_FORMATS, open_blocks, read_cloud, scan_parts
from .store import (MAX_ID_BYTES, ScanStore, file_lock, legacy_scan_id, scan_grid, scan_id_for, sha256_bytes,
                    sha256_file)

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")
SIDECAR_SUFFIX = ".gt.json"


@dataclass(frozen=True)
class Source:
    """One file to ingest: where it is and the scan id it gets.

    ``legacy_id``: the id an older version gave this file (:func:`~.store.legacy_scan_id`), where
    it differs; ingest keeps it when the store holds this file's scan under it (see
    :func:`ingest_file`).
    """

    path: str
    scan_id: str
    legacy_id: str | None = None
    #: what stores and messages name it by where ``path`` is a copy that goes away: an archive
    #: member's ``ARCHIVE::MEMBER`` (``path`` is its extracted file in the staging folder)
    origin: str | None = None

    @property
    def named(self) -> str:
        return self.origin or self.path


def is_archive(path: str | os.PathLike) -> bool:
    name = str(path).lower()
    return any(name.endswith(s) for s in ARCHIVE_SUFFIXES)


def part_scan_id(file_id: str, part: str) -> str:
    """The scan id of one scan of a file of several (E57): the file's id, ``__`` and the scan's
    part name, as if the file were a folder of its scans (``site.e57`` -> ``site.e57__scan000``,
    ``a_b~<hash>.e57`` -> ``a_b~<hash>.e57__scan000``). No file's own id is of that form (a part
    name has no scan suffix); one over :data:`MAX_ID_BYTES` takes :func:`scan_id_for`'s hashed form."""
    sid = f"{file_id}__{part}"
    return sid if len(sid.encode("utf-8")) <= MAX_ID_BYTES else scan_id_for(f"{file_id}/{part}")


def is_multi_scan(path: str | os.PathLike) -> bool:
    """Whether the file's format holds several scans (E57), from its name."""
    return FORMATS.get(Path(path).suffix.lower()) in MULTI_SCAN_FORMATS


def sidecar_for(path: str | os.PathLike) -> Path:
    """Ground-truth sidecar of a scan: ``scene_0001.pcd`` -> ``scene_0001.gt.json``."""
    p = Path(path)
    return p.with_name(p.name[: -len(p.suffix)] + SIDECAR_SUFFIX if p.suffix else p.name + SIDECAR_SUFFIX)


def read_sidecar(path: str | os.PathLike) -> dict[str, Any] | None:
    """The scan's sidecar as a dict, or None when it has none: ground truth, and ``origin``, the
    scanner's position in the file's coordinates for a georeferenced file that holds no offset
    (the scan's local frame and the point its normals face; checked: 3 finite numbers).

    A scan whose name is near the file system's limit (255 bytes) has a sidecar name that no file
    can have (``.gt.json`` is longer than ``.pcd``): that means no sidecar, not an error. Raises
    ``OSError`` or ``ValueError`` for a sidecar that exists and cannot be read or parsed.
    """
    side = sidecar_for(path)
    try:
        if not side.is_file():
            return None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            return None
        raise
    got = json.loads(side.read_text())
    if not isinstance(got, dict):
        raise ValueError(f"it holds a JSON {type(got).__name__}, not an object")
    if "origin" in got:  # the scanner's position (or any point near the scan), the file's coordinates
        o = got["origin"]
        if not (isinstance(o, list) and len(o) == 3 and all(_finite_number(v) for v in o)):
            got_ = repr(o) if len(repr(o)) <= 80 else repr(o)[:77] + "..."
            raise ValueError(f"its origin must be 3 finite numbers (x, y, z in the file's coordinates), got {got_}")
        got["origin"] = [float(v) for v in o]
    return got


def _finite_number(v) -> bool:
    """Whether a JSON value is a finite number (not a bool, a string, or an int past float's range)."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
    except OverflowError:
        return False


def ingest_file(store_path: str, source: Source, *, units: str = "m", run: str | None = None,
                copc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ingest one file into the store; never raises for a bad file (it is quarantined).

    ``run``: the ingest run's token, kept in the scan's attributes. When Dask runs this unit again
    after its worker was lost, the scan that the lost worker had finished is reported as
    ``ingested`` by this run, not ``skipped`` (a skip is work done by an earlier or another run).

    ``copc``: the query of COPC files (:func:`~.las.copc_settings`: a level, or a resolution,
    and bounds; default the full point cloud), recorded in the scan's ``copc`` attribute: a COPC
    scan is current only when it came from the same bytes with the same query.

    The scan keeps the file's ``legacy_id`` instead of its ``scan_id`` when the store holds a
    complete scan under that old id whose ``source`` is this very file: a store written before
    ids were unique keeps its ids, and a rerun on it stays a no-op. A scan there of another file
    (the one an old collision kept) is left alone, and this file gets its own id.

    The scan's claim is held from the "is it current?" check to the complete flag, so two
    ingests of the same file at once write it once: the second waits, then finds it current.
    A LAS/LAZ file of more than :data:`~.las.LAS_WHOLE_MAX_POINTS` points and a COPC file
    are hashed streaming and read and written block by block (:func:`~.readers.open_blocks`,
    :meth:`~.store.ScanStore.write_scan_blocks`), never whole in memory.
    Returns a record: ``status`` (``ingested`` | ``skipped`` | ``quarantined``), ``scan_id``,
    ``source``, ``points``, ``bytes``, ``seconds`` and ``reason`` for quarantined files. A file of
    several scans (E57) is one record too, ``scan_id`` its own id and ``scans`` a record per scan
    (see :func:`_ingest_parts`).
    """
    return _ingest_one(ScanStore(store_path), source, units=units, run=run, t0=time.perf_counter(), copc=copc)


def ingest_files(store_path: str, sources: list[Source], *, units: str = "m",
                 run: str | None = None, copc: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """:func:`ingest_file` for a batch of files in one unit of work (one Dask task): the store is
    opened once, and the worker goes from one file to the next without a scheduler round trip
    (one Dask task per file left a worker idle 1-2 ms between files of ~40 ms). Each file keeps
    its own claim and complete flag, so a batch cut off midway is resumed file by file."""
    store = ScanStore(store_path)
    return [_ingest_one(store, s, units=units, run=run, t0=time.perf_counter(), copc=copc) for s in sources]


def _ingest_one(store: ScanStore, source: Source, *, units: str, run: str | None, t0: float,
                part: str | None = None, digest: str | None = None,
                copc: dict[str, Any] | None = None) -> dict[str, Any]:
    """One file, or with ``part`` one scan of a file of several (``digest``: the file's sha256,
    ``source.scan_id``: the scan's id; the reader reads the file itself)."""
    if part is None:
        source = replace(source, scan_id=_stored_id(store, source))
        if is_multi_scan(source.path):
            return _ingest_parts(store, source, units=units, run=run, t0=t0)
    rec: dict[str, Any] = {"source": source.named, "scan_id": source.scan_id, "points": 0, "bytes": 0}

    def done(status: str, **fields) -> dict[str, Any]:
        return {**rec, "status": status, **fields, "seconds": time.perf_counter() - t0}

    expect: dict[str, Any] = {}  # attributes a current scan has besides its sha256
    if is_copc(source.path):
        try:
            expect["copc"] = copc_settings(**(copc or {}))
        except InputError as exc:
            raise InputError(f"{source.named}: {exc}") from exc
    blockwise = part is not None or bool(expect) or _many_points(source.path)
    data = None
    if digest is None:
        try:
            if blockwise:  # hashed streaming: the file is never in memory whole
                digest, rec["bytes"] = sha256_file(source.path), os.path.getsize(source.path)
            else:
                data = Path(source.path).read_bytes()
                digest, rec["bytes"] = sha256_bytes(data), len(data)
        except OSError as exc:
            store.quarantine(source.named, f"cannot read file: {exc.strerror or exc}", key=source.scan_id)
            return done("quarantined", reason=f"cannot read file: {exc}")

    def current() -> dict[str, Any]:
        a = store.attrs(source.scan_id)
        return done("ingested" if run and a.get("ingest_run") == run else "skipped", points=int(a.get("n_points", 0)),
                    group=store.group_summary(source.scan_id))

    try:
        sidecar = read_sidecar(source.path) or {}
    except (OSError, ValueError) as exc:
        reason = f"sidecar {sidecar_for(source.path).name} cannot be used: {exc}"
        store.quarantine(source.named, reason, digest, key=source.scan_id)
        return done("quarantined", reason=reason)
    if "origin" in sidecar:  # a scanner's position given (or changed) after the file was ingested: ingested again
        expect["origin"] = sidecar["origin"]
    if store.is_current(source.scan_id, digest, **expect):  # the common re-ingest case, without waiting for a claim
        return current()
    with store.claim(source.scan_id):
        if store.is_current(source.scan_id, digest, **expect):  # another ingest wrote it while we waited
            return current()
        try:
            scan = open_blocks(source.path, copc=expect.get("copc"), part=part) if blockwise else None
            cloud = read_cloud(source.path, data, part=part) if scan is None else None
        except EmptyQuery as exc:  # a tile outside the region asked for: nothing written, nothing quarantined
            return done("outside", reason=exc.reason)
        except ScanReadError as exc:
            store.quarantine(source.named, exc.reason, digest, key=source.scan_id)
            return done("quarantined", reason=exc.reason)
        made: dict[str, Any] = {}  # the scan's attributes, as written

        def attrs_of(meta, n_points, bbox, dtype) -> dict[str, Any]:
            made.update(_scan_attrs(source, digest, meta, n_points, bbox, dtype, units, run, sidecar))
            return made

        if scan is None:
            n = len(cloud)
            store.write_scan(source.scan_id, stored_arrays(cloud.arrays()),
                             attrs_of(cloud.meta, n, cloud.bbox, str(cloud.points.dtype)))
        else:
            try:
                store.write_scan_blocks(
                    source.scan_id, (stored_arrays(b) if isinstance(b, dict) else b for b in scan.blocks),
                    scan.n_points, scan.columns,
                    lambda: attrs_of(scan.meta, scan.n_kept, scan.bbox, str(np.dtype(scan.columns["points"][0]))),
                    at_most=not scan.exact, optional=scan.optional)
            except EmptyQuery as exc:  # the bounds crop every point away (found midway): nothing kept
                store.discard_incomplete(source.scan_id)
                return done("outside", reason=exc.reason)
            except ScanReadError as exc:  # found midway: its partial arrays removed, the file quarantined
                store.discard_incomplete(source.scan_id)
                store.quarantine(source.named, exc.reason, digest, key=source.scan_id)
                return done("quarantined", reason=exc.reason)
            n = scan.n_kept
        store.release(source.scan_id)
    # georeferenced with no file offset: its origin is its box's centre (said now, and by recognize)
    box = {"box_origin": True} if made.get("origin_from") == "box" else {}
    return done("ingested", points=n, group=store.group_summary(source.scan_id), **box)


def stored_arrays(arrays: dict[str, Any]) -> dict[str, Any]:
    """The store's arrays from a reader's (a whole cloud's, or one block's rows of them): the one
    place where read points become stored points, for the whole-file and the block-wise path
    alike. They are stored as read (bit-exact: float64 LAS coordinates stay the file's)."""
    return arrays


def _scan_attrs(source: Source, digest: str, meta: dict[str, Any], n_points: int,
                bbox: tuple[list[float], list[float]], dtype: str, units: str, run: str | None,
                sidecar: dict[str, Any]) -> dict[str, Any]:
    """A scan's attributes from its reader's ``meta`` and the figures of all its points (the
    whole-file and the block-wise path alike), the ``sidecar``'s on top; ``origin_from`` says
    where an origin other than 0 or the file's offset came from: the sidecar (the scanner's
    position), or the bounding box (the normals then face its centre: the commands say so)."""
    attrs: dict[str, Any] = {
        "source": source.named,
        "sha256": digest,
        "format": meta.get("format"),
        "encoding": meta.get("encoding"),
        "n_points": int(n_points),
        "n_source_points": meta.get("n_source_points", int(n_points)),
        "units": units,
        "bbox": {"min": bbox[0], "max": bbox[1]},
        "origin": (origin := _origin(bbox, meta)),
        "ingested_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dtype": dtype,
        "ingest_run": run,
    }
    for key in ("width", "height", "viewpoint", "organized", "pose", "pose_maps", "crs", "e57", "copc"):
        if key in meta:
            attrs[key] = meta[key]
    grid = scan_grid(meta)  # LAS/LAZ/COPC: the points are integers times the scale
    if grid is not None:
        attrs["coordinate_grid"] = grid
    if "origin" in sidecar:
        attrs["origin_from"] = "sidecar"
    elif any(origin) and origin != [float(v) for v in meta.get("offsets") or ()]:
        attrs["origin_from"] = "box"
    return {**attrs, **sidecar}


def _many_points(path: str) -> bool:
    """Whether a LAS/LAZ file declares more than :data:`~.las.LAS_WHOLE_MAX_POINTS` points
    (:func:`~.las.las_point_count`: its header's first bytes only); False for any other file
    or a header that cannot be read (read whole: the reader names the problem)."""
    if FORMATS.get(Path(path).suffix.lower()) not in ("las", "laz"):
        return False
    from . import las

    n = las.las_point_count(path)
    return n is not None and n > las.LAS_WHOLE_MAX_POINTS


def _origin(bbox, meta: dict[str, Any]) -> list[float]:
    """The scan's local origin (float64, the file's own coordinates): the stages compute on the
    points minus it (:func:`~.store.local_points`); the points are stored as the file has them.
    ``[0, 0, 0]`` for coordinates below 1024 m; else the file's own offset where it has one that
    is near every point (LAS header offsets), else the bounding-box centre rounded to 1 m
    (:func:`~scanforest.kernels.coordinates.choose_origin`)."""
    from scanforest.kernels.coordinates import choose_origin

    lo, hi = bbox
    return [float(v) for v in choose_origin(lo, hi, meta.get("offsets"))]


def _ingest_parts(store: ScanStore, source: Source, *, units: str, run: str | None, t0: float) -> dict[str, Any]:
    """A file of several scans (E57): each scan ingested as a scan of its own (:func:`part_scan_id`),
    each with its own claim and complete flag, all from the file's sha256 (hashed streaming: the
    file is never in memory whole). One record for the file: ``scans`` holds each scan's record;
    ``status`` is ``quarantined`` when the file or any scan of it could not be read (the readable
    scans are stored all the same, the unreadable ones quarantined under their own ids, a file
    that cannot be opened under its own), else ``ingested`` when this run wrote a scan of it,
    else ``skipped``."""
    rec: dict[str, Any] = {"source": source.named, "scan_id": source.scan_id, "points": 0, "bytes": 0}
    try:
        digest = sha256_file(source.path)
        rec["bytes"] = os.path.getsize(source.path)
        parts = scan_parts(source.path)
    except OSError as exc:
        store.quarantine(source.named, f"cannot read file: {exc.strerror or exc}", key=source.scan_id)
        return {**rec, "status": "quarantined", "reason": f"cannot read file: {exc}",
                "seconds": time.perf_counter() - t0}
    except ScanReadError as exc:
        store.quarantine(source.named, exc.reason, digest, key=source.scan_id)
        return {**rec, "status": "quarantined", "reason": exc.reason, "seconds": time.perf_counter() - t0}
    scans = [_ingest_one(store, replace(source, scan_id=part_scan_id(source.scan_id, part), legacy_id=None),
                         units=units, run=run, t0=time.perf_counter(), part=part, digest=digest)
             for part in parts]
    bad = [r for r in scans if r["status"] == "quarantined"]
    out = {**rec, "points": sum(r["points"] for r in scans if r["status"] != "quarantined"),
           "scans": [{k: r[k] for k in ("scan_id", "status", "points", "reason", "box_origin") if k in r}
                     for r in scans]}
    if bad:
        out.update(status="quarantined", reason=f"{len(bad)} of its {len(scans)} scans unreadable, "
                                                f"{bad[0]['scan_id']}: {bad[0]['reason']}")
    else:
        store.release(source.scan_id)  # the file's own record of an earlier failure
        out["status"] = "ingested" if any(r["status"] == "ingested" for r in scans) else "skipped"
    return {**out, "seconds": time.perf_counter() - t0}


def _stored_id(store: ScanStore, source: Source) -> str:
    """The file's ``legacy_id`` where the store holds this file's complete scan under it, else its
    ``scan_id`` (see :func:`ingest_file`)."""
    if source.legacy_id:
        try:
            if store.attrs(source.legacy_id).get("source") in (source.path, source.named):
                return source.legacy_id
        except (InputError, KeyError, OSError):  # no complete scan of that id, or one being replaced now
            pass
    return source.scan_id


# ---------------------------------------------------------------------------------- discovery


def is_glob(source: str) -> bool:
    return any(ch in source for ch in "*?[") and not os.path.lexists(source)


def check_source(source: str | os.PathLike, *, allow_empty: bool = False) -> None:
    """Fail before anything is created when ``source`` cannot give a scan: it does not exist, a
    glob matches no file, a folder holds no scan or archive, or a single file has an unknown format.
    ``allow_empty``: an existing folder (or a glob) with nothing to ingest is fine, as a scheduled
    ingest of a drop folder into an existing store finds it between deliveries.

    Raises :class:`InputError` with one line naming the source.
    """
    src = str(source)
    if is_glob(src):
        if not allow_empty and not any(os.path.isfile(p) for p in _glob.iglob(src, recursive=True)):
            raise InputError(f"ingest source {src} matches no file")
        return
    if not os.path.lexists(src):
        raise InputError(f"ingest source {src} does not exist")
    if os.path.isdir(src):
        if allow_empty:
            return
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            if any(_kind(os.path.join(dirpath, f)) for f in filenames if not _hidden_or_sidecar(f)):
                return
        raise InputError(f"ingest source {src} holds no scan files (formats: {', '.join(sorted(FORMATS))}, "
                         f"archives: {', '.join(ARCHIVE_SUFFIXES)})")
    reason = _unreadable(src)
    if reason:
        raise InputError(f"ingest source {src}: {reason}")
    if not _kind(src):
        raise InputError(f"ingest source {src}: unknown format {Path(src).suffix or '(no extension)'!r}; "
                         f"supported: {', '.join(sorted(FORMATS))} and archives ({', '.join(ARCHIVE_SUFFIXES)})")


def ignored_note(ignored: list[dict[str, str]], show: int = 3) -> str:
    """One line about the files that were passed over, e.g. 'ignored 4 files that are not scans: ...'."""
    names = ", ".join(os.path.basename(i["source"]) for i in ignored[:show])
    more = f" and {len(ignored) - show} more" if len(ignored) > show else ""
    reasons = sorted({i["reason"].split(" (")[0] for i in ignored})
    return f"ignored {len(ignored)} file(s) ({'; '.join(reasons)}): {names}{more}"


def discover(source: str | os.PathLike, staging: "str | os.PathLike | Staging", *,
             ignored: list[dict[str, str]] | None = None) -> tuple[list[Source], list[dict[str, str]]]:
    """Expand a folder, a glob, a single file or an archive into the files to ingest.

    Scan ids come from the paths relative to the folder or the glob's fixed part
    (:func:`~.store.scan_id_for`). Archives (.tar, .tar.gz, .tgz, .zip, ...) are extracted once,
    streaming, into ``staging`` (a folder, or a :class:`Staging` made only when an archive comes); their members' paths are prefixed by the archive's name without
    its suffix where the archive is the source, and by its path in the folder (suffix included)
    where it is found in one, so two archives never give one id. Each source also carries the id
    an older version gave it (``legacy_id``, see :func:`_offer_legacy_ids`). Returns the sources
    and a list of problems found while expanding (``{"source", "reason"}``: dangling links, link
    loops, unsafe members, corrupt archives), one per bad item, so the rest still ingests.

    Paths are resolved, so a file reached twice (a glob through a folder link loop, two links to
    one file) is ingested once, under its shortest path. In a folder, glob or archive, files that
    are not scans (README.md, notes, .json, a .txt that is not point rows) are passed over and,
    when ``ignored`` is given, appended to it with the reason; hidden files and ``*.gt.json``
    sidecars (read with their scan) are passed over silently.
    """
    src = str(source)
    ignored = [] if ignored is None else ignored
    staging = staging if isinstance(staging, Staging) else Path(staging)
    if is_glob(src):
        root = _glob_root(src)
        paths = sorted(_glob.glob(src, recursive=True), key=lambda p: (p.count(os.sep), p))
        items, problems = _collect(((p, os.path.relpath(p, root)) for p in paths), staging, ignored)
    else:
        check_source(src, allow_empty=True)  # the caller decides whether finding nothing is an error
        path = Path(src)
        if path.is_dir():
            regular: set[str] = set()
            items, problems = _collect(_walk(path, regular), staging, ignored, regular=regular)
        elif is_archive(path):
            items, problems = _expand_archive(path, staging, ignored)
        else:
            items, problems = [_source(os.path.realpath(path), path.name)], []
    return _offer_legacy_ids(items), problems


def _offer_legacy_ids(items: list[Source]) -> list[Source]:
    """Drop the old id of a source where it is another source's id now (``a b.pcd``'s old id
    ``a_b.pcd`` is the id of ``a_b.pcd`` under both rules, so that file keeps it), or where an
    earlier source of the same file offers it already (one extracted file listed from two copies
    of an archive): two sources never end up in one scan."""
    taken = {s.scan_id for s in items}
    offered: set[tuple[str, str]] = set()
    out = []
    for s in items:
        if s.legacy_id in taken or (s.legacy_id, s.path) in offered:
            s = replace(s, legacy_id=None)
        offered.add((s.legacy_id, s.path))
        out.append(s)
    return out


def _source(path: str, rel: str, legacy_rel: str | None = None) -> Source:
    """The file at ``path``, ``rel`` under the ingest root (``legacy_rel`` where an older version
    named it from another path: an archive member's)."""
    sid, old = scan_id_for(rel), legacy_scan_id(legacy_rel or rel)
    return Source(path, sid, old if old != sid else None)


def _walk(root: Path, regular: set[str] | None = None):
    """(path, path relative to root) of every file under root, sorted, folder by folder as
    :func:`os.walk` goes (hidden folders skipped; folder links are not followed). ``regular``: a
    set that receives the paths the folder listing itself shows to be regular files (not links),
    so :func:`_collect` asks the file system nothing more about them (8,000 files: three
    ``stat`` calls each, 0.6 s of a four-GPU ingest's start)."""
    root = os.fspath(root)

    def walk(folder: str, sub: str):
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:  # an unreadable folder is passed over, as os.walk does
            return
        files, dirs = [], []
        for e in entries:
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            if not is_dir:
                files.append(e)
            elif not e.name.startswith(".") and not e.is_symlink():
                dirs.append(e.name)
        for e in sorted(files, key=lambda e: e.name):
            if regular is not None and e.is_file(follow_symlinks=False):
                regular.add(e.path)
            yield e.path, e.name if not sub else f"{sub}{os.sep}{e.name}"
        for d in sorted(dirs):
            yield from walk(os.path.join(folder, d), d if not sub else f"{sub}{os.sep}{d}")

    yield from walk(root, "")


def _collect(pairs, staging: "Path | Staging", ignored: list[dict[str, str]], *, archives: bool = True,
             regular: set[str] | None = None):
    """Sources from (path, relative path) pairs, each bad item a problem of its own. An archive's
    members come as (path, relative path, the relative path older versions named them from).
    ``regular``: paths known to be regular files, not links (:func:`_walk`)."""
    items: list[Source] = []
    problems: list[dict[str, str]] = []
    seen: dict[str, str] = {}
    real_dirs: dict[str, str] = {}  # a folder's real path, resolved once for all its files
    regular = regular if regular is not None else set()
    for path, rel, *legacy_rel in pairs:
        name = os.path.basename(path)
        plain = path in regular  # a regular file: not a folder, not a link, readable as listed
        if _hidden_or_sidecar(name) or (not plain and os.path.isdir(path)):
            continue
        kind = _kind(path)
        if kind is None or (kind == "archive" and not archives):
            ignored.append({"source": path, "reason": "an archive inside an archive" if kind else "not a scan format"})
            continue
        # the same folder entry reached again (a glob through a folder link loop), or the same file
        # through another link: listed once, under its shortest path (pairs come shortest first)
        folder = os.path.dirname(path)
        if folder not in real_dirs:
            real_dirs[folder] = os.path.realpath(folder)
        entry = os.path.join(real_dirs[folder], name)
        real = os.path.realpath(path) if not plain and os.path.islink(path) else entry
        first = seen.get(entry) or seen.get(real)
        if first:
            ignored.append({"source": path, "reason": f"the same file as {first} (reached through a symbolic link)"})
            continue
        seen[entry] = seen[real] = path
        reason = None if plain else _unreadable(path)
        if reason:
            problems.append({"source": path, "reason": reason})
            continue
        if kind == "archive":
            sub, probs = _expand_archive(Path(real), staging, ignored, name=rel)
            items += sub
            problems += probs
        elif _suffix(path).lower() == ".txt" and not _looks_like_points(real):
            ignored.append({"source": path, "reason": "a .txt file that is not rows of point coordinates"})
        else:  # read through the link where its target's name gives no format (git-annex, DVC)
            same = _suffix(real).lower() == _suffix(path).lower()
            items.append(_source(real if same else path, rel, *legacy_rel))
    return items, problems


def _hidden_or_sidecar(name: str) -> bool:
    return name.startswith(".") or name.endswith(SIDECAR_SUFFIX)


def _kind(path: str) -> str | None:
    """"archive", "scan" (a reader's suffix) or None (not a scan) from the file name."""
    if is_archive(path):
        return "archive"
    return "scan" if supported(path) else None


def _unreadable(path: str) -> str | None:
    """Why ``path`` cannot be opened as a file (a link loop, a dangling link, ...), else None."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symbolic link loop"
        if os.path.islink(path):
            return f"dangling symbolic link (its target {os.readlink(path)} does not exist)"
        return f"cannot read file: {exc.strerror or exc}"
    return None if stat.S_ISREG(st.st_mode) else "not a regular file"


def _looks_like_points(path: str, head: int = 4096) -> bool:
    """A .txt is both an XYZ scan format and the usual notes file: it counts as a scan when one
    of its first two data lines is at least three numbers (a header line may come first)."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(head).decode("utf-8", "replace")
    except OSError:
        return True  # let the ingest itself report the read error
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(("#", "//"))][:2]
    for line in lines:
        fields = [t for t in re.split(r"[,;\s]+", line.strip()) if t]
        try:
            numbers = [float(t) for t in fields]
        except ValueError:
            continue
        if len(numbers) >= 3:
            return True
    return False


def _glob_root(pattern: str) -> str:
    parts = Path(pattern).parts
    fixed = []
    for part in parts:
        if any(ch in part for ch in "*?["):
            break
        fixed.append(part)
    return str(Path(*fixed)) if fixed else "."


def _archive_stem(path: Path) -> str:
    name = path.name
    for suf in sorted(ARCHIVE_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suf):
            return name[: -len(suf)]
    return path.stem


def _expand_archive(path: Path, staging: "Path | Staging", ignored: list[dict[str, str]],
                    name: str | None = None) -> tuple[list[Source], list[dict[str, str]]]:
    """Extract an archive into ``staging`` once (under a lock: two ingests of one archive at once
    extract it once, and neither reads a member the other is still writing) and list its scans,
    their relative paths under ``name`` (default: the archive's name without its suffix)."""
    staging = staging.acquire() if isinstance(staging, Staging) else staging
    problems: list[dict[str, str]] = []
    digest = sha256_file(path)[:12]
    stem = _archive_stem(path)
    dest = staging / f"{stem[:MAX_ID_BYTES]}-{digest}"
    done_marker = dest / ".extracted"
    with file_lock(staging / f".{dest.name}.lock"):
        if not done_marker.exists():
            dest.mkdir(parents=True, exist_ok=True)
            partial = last = None  # the member being written; the last one written whole
            is_zip = path.name.lower().endswith(".zip")
            try:
                for member, fin in _members(path):
                    if isinstance(fin, str):  # a member that is not a file: said, not extracted
                        ignored.append({"source": f"{path}::{member}", "reason": fin})
                        continue
                    if not _safe_member(member):
                        problems.append({"source": f"{path}::{member}", "reason": "unsafe archive member path"})
                        continue
                    try:
                        target = dest / member
                        target.parent.mkdir(parents=True, exist_ok=True)
                        partial = (member, target)
                        with fin, open(target, "wb") as fout:
                            while chunk := fin.read(1 << 22):
                                fout.write(chunk)
                        partial, last = None, (member, target)
                    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
                        if is_zip and not (isinstance(exc, OSError) and _extract_side(exc)):
                            # a zip's members are compressed and checked one by one: this one only
                            target.unlink(missing_ok=True)
                            partial = None
                            problems.append({"source": f"{path}::{member}",
                                             "reason": f"damaged archive member: {_error_name(exc)}: {exc}"})
                            continue
                        if not isinstance(exc, OSError) or not _extract_side(exc):
                            raise  # the archive's stream is broken: every later member too
                        partial = None  # this member only (a name too long for the file system, ...)
                        problems.append({"source": f"{path}::{member}",
                                         "reason": f"cannot extract: {exc.strerror or exc}"})
                done_marker.write_text(str(path))
            except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, zlib.error, lzma.LZMAError) as exc:
                at = ""
                if isinstance(exc, _ChecksumError):  # every member's copy is suspect: none is read
                    for child in dest.iterdir():
                        if child.is_dir():
                            shutil.rmtree(child)
                        else:
                            child.unlink()
                    at = " (none of its members is read: the damaged one is not known)"
                elif partial is not None:  # its copy is cut short: not a scan of its own (it read as empty)
                    partial[1].unlink(missing_ok=True)
                    at = (f" ({'it ends' if isinstance(exc, EOFError) else 'its stream breaks'} inside {partial[0]}; "
                          "the members before it are read)")
                elif last is not None and not isinstance(exc, EOFError) and _compressed_tar(path):
                    # a damaged gzip stream decompresses to garbage, unchecked (its CRC is at the
                    # end), until a tar header fails: the member before that failure is garbage too
                    last[1].unlink(missing_ok=True)
                    at = (f" (its stream breaks after {last[0]}, whose copy is not read: it came out of the "
                          "damage; the members before it are read)")
                problems.append({"source": str(path),
                                 "reason": f"corrupt or truncated archive{at}: {_archive_error(path, exc)}"})
    regular: set[str] = set()
    pairs = ((full, f"{name or stem}/{rel}", f"{stem}/{rel}") for full, rel in _walk(dest, regular))
    seen = len(ignored)
    items, probs = _collect(pairs, staging, ignored, archives=False, regular=regular)
    # named by the archive and the member, not by the staging copy (removed after a clean ingest)
    real_dest = os.path.realpath(dest)

    def member_of(p: str) -> str:
        for root in (str(dest), real_dest):
            if p.startswith(root + os.sep):
                return f"{path}::{os.path.relpath(p, root).replace(os.sep, '/')}"
        return p

    items = [replace(s, origin=member_of(s.path)) for s in items]
    for item in probs + ignored[seen:]:
        item["source"] = member_of(item["source"])
    return items, problems + probs


def _archive_error(path: Path, exc: BaseException) -> str:
    """An archive's error in one line: ``tarfile``'s "could not be opened" lists every method it
    tried on lines of their own (the first line alone ended in a colon); the one of the file's
    suffix is said, else the plain tar's."""
    text = str(exc)
    if "\n- method " in text:
        tried = dict(re.findall(r"- method (\w+): (.*)", text))
        name = path.name.lower()
        method = next((m for m, sfx in (("gz", ("gz", "tgz")), ("bz2", ("bz2", "tbz2", "tbz")), ("xz", ("xz", "txz")))
                       if name.endswith(sfx)), "tar")
        why = tried.get(method, text.splitlines()[0])
        quoted = re.fullmatch(r"\w+\((['\"])(.*)\1\)", why)  # ReadError('not a bzip2 file')
        text = (quoted.group(2) if quoted else why) + f" (read as {'/'.join(tried)})"
    return f"{_error_name(exc)}: {text}"


def _error_name(exc: BaseException) -> str:
    """An exception's class as a reader knows it (zlib's is called ``error``)."""
    return "zlib.error" if isinstance(exc, zlib.error) else type(exc).__name__


def _compressed_tar(path: Path) -> bool:
    """Whether a tar archive is compressed (its members' bytes come out of one stream)."""
    name = path.name.lower()
    return not name.endswith((".zip", ".tar"))


def _extract_side(exc: OSError) -> bool:
    """Whether an error while extracting a member is the extraction's, writing its copy (a name
    too long, a full disk, permissions: an ``errno``), not the archive's stream (gzip's
    ``BadGzipFile``, a bz2 stream's ``OSError``: no ``errno``; the member and every later one
    are unreadable)."""
    return exc.errno is not None


def _zip_name(info: zipfile.ZipInfo) -> str:
    """A zip member's name as its writer meant it: UTF-8 where the bytes are UTF-8 though the
    archive does not say so (Info-ZIP's zip on Linux writes them so; Python's zipfile reads them
    as cp437, which gave ``├╝n├»`` for ``ünï``, and another id than the same file in a tar)."""
    name = info.filename
    if not info.flag_bits & 0x800:
        try:
            return name.encode("cp437").decode("utf-8")
        except UnicodeError:
            pass
    return name


def _members(path: Path):
    """(name, open binary stream) of every file in a zip or tar archive, streaming; a tar's hard
    link gives its target's bytes, and its other members that are not files (symbolic links,
    devices, FIFOs) come as (name, why it is passed over). A tar that ends without its
    end-of-archive block (cut off at a member's header: ``tarfile`` takes that for the end) is a
    ``tarfile.ReadError`` after its members so far."""
    if path.name.lower().endswith(".zip"):
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.is_dir():
                    yield _zip_name(info), zf.open(info)
    else:
        with tarfile.open(path, "r:*") as tf:
            n = 0
            for member in tf:
                n += 1
                if member.isfile() or member.islnk():
                    yield member.name, tf.extractfile(member)
                elif member.issym():
                    yield member.name, f"a symbolic link in an archive (to {member.linkname}): not followed"
                elif not member.isdir():
                    yield member.name, "not a file (a device or FIFO in the archive)"
            tf.fileobj.seek(tf.offset)
            end = tf.fileobj.read(tarfile.BLOCKSIZE)
            if len(end) < tarfile.BLOCKSIZE or end.count(0) != tarfile.BLOCKSIZE:
                raise tarfile.ReadError(f"the archive ends without its end-of-archive block after {n} "
                                        "members: cut off")
            try:  # a compressed stream read to its end: gzip checks its CRC there, and only there
                while tf.fileobj.read(1 << 20):
                    pass
            except (OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
                raise _ChecksumError(f"its compressed stream fails at its end ({_error_name(exc)}: {exc})") from exc


class _ChecksumError(tarfile.ReadError):
    """A compressed tar whose members all read but whose stream fails its check at the end: the
    damage is in one of them, which one is not known."""


def _safe_member(name: str) -> bool:
    p = Path(name)
    return not p.is_absolute() and ".." not in p.parts


def supported(path: str) -> bool:
    return _suffix(path).lower() in FORMATS


def _suffix(path: str | os.PathLike) -> str:
    """``Path(path).suffix`` from the string (no path object built: called per listed file)."""
    name = os.path.basename(os.fspath(path))
    i = name.rfind(".")
    return name[i:] if 0 < i < len(name) - 1 else ""


def staging_note(path: str | os.PathLike, members: int) -> str:
    """The line that says a staging folder stays beside the store, with what it holds."""
    files, size = 0, 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            if not name.startswith("."):
                files += 1
                size += os.path.getsize(os.path.join(root, name))
    return (f"{path} keeps the {files:,} files extracted from archives ({size / 1e6:,.1f} MB) so that a rerun "
            f"retries the {members:,} quarantined archive member{'s' if members != 1 else ''} without extracting "
            "again; delete it when you no longer need that")


#: a folder under which ingests extract archives when the store's own folder cannot hold its
#: staging folder (read-only, or too small): each store gets ``NAME-HASH.staging`` in it
STAGING_ENV = "SCANFOREST_STAGING"


def staging_folder(store: str) -> Path:
    """Where an ingest into ``store`` extracts archives: ``STORE.staging`` beside the store (on the
    workers' shared file system where the store is), or under ``$SCANFOREST_STAGING``."""
    store = os.path.abspath(str(store).rstrip("/"))
    under = os.environ.get(STAGING_ENV)
    name = os.path.basename(store) + ".staging"
    if not under and len(os.fsencode(name)) <= 255:
        return Path(store + ".staging")
    # under another folder, or a store name near the file system's 255 bytes: the name cut (on a
    # character boundary) and told apart by its path's hash
    tag = hashlib.sha256(store.encode()).hexdigest()[:12]
    stem = os.fsencode(os.path.basename(store))[:255 - len(f"-{tag}.staging")].decode("utf-8", "ignore")
    return Path(os.path.abspath(under) if under else os.path.dirname(store)) / f"{stem}-{tag}.staging"


class Staging:
    """The folder next to the store that archives are extracted into, shared by its ingests.

    It is made when the first archive comes (:meth:`acquire`): a source without archives writes
    nothing beside the store, so a store whose folder is read-only still ingests a folder of
    scans. Each ingest holds a shared ``flock`` on ``STAGING/.in-use`` from then on, and removes
    the folder only when it can turn that into an exclusive lock, i.e. when no other ingest is
    still reading extracted files. A lock obtained on a file that a remover unlinked meanwhile is
    taken again on the new one (the inode check), so no ingest runs unprotected.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd: int | None = None

    def __enter__(self) -> "Staging":
        return self

    def acquire(self) -> Path:
        """The folder, made and held (shared lock) from the first call on. A folder that cannot be
        written is a user error naming :data:`STAGING_ENV` (every archive would fail alike)."""
        lock = self.path / ".in-use"
        try:
            while self._fd is None:
                self.path.mkdir(parents=True, exist_ok=True)
                try:
                    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
                except FileNotFoundError:  # removed between mkdir and open
                    continue
                fcntl.flock(fd, fcntl.LOCK_SH)
                try:
                    same = os.stat(lock).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    self._fd = fd
                else:
                    os.close(fd)
        except OSError as exc:
            raise InputError(f"cannot extract archives into {self.path}: {exc.strerror or exc}; set "
                             f"{STAGING_ENV} to a folder that can be written (and that the workers can read)") from None
        return self.path

    def holds_files(self) -> bool:
        """Whether anything was extracted here (lock files and markers are hidden)."""
        return self._fd is not None and any(not name.startswith(".") for name in os.listdir(self.path))

    def remove(self) -> bool:
        """Remove the folder unless another ingest is using it (or it was never made); returns
        whether it is gone."""
        if self._fd is None:
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        return True

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
