"""Ingest: one scan file -> one complete scan group in the store (idempotent).

:func:`ingest_file` is the unit of work that runs on a Dask worker. It hashes the file, skips it
when the store already holds a complete scan from the same bytes, otherwise reads it, writes all
arrays and marks the scan complete; an unreadable file is recorded in the store's quarantine with
the reason and the batch goes on. :data:`ingest_scan` is the Prefect task around it.
"""
from __future__ import annotations

import json
import os
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scanforest.kernels.errors import ScanReadError

from .readers import FORMATS, read_cloud
from .store import ScanStore, scan_id_for, sha256_bytes

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")
SIDECAR_SUFFIX = ".gt.json"


@dataclass(frozen=True)
class Source:
    """One file to ingest: where it is and the scan id it gets."""

    path: str
    scan_id: str


def is_archive(path: str | os.PathLike) -> bool:
    name = str(path).lower()
    return any(name.endswith(s) for s in ARCHIVE_SUFFIXES)


def sidecar_for(path: str | os.PathLike) -> Path:
    """Ground-truth sidecar of a scan: ``scene_0001.pcd`` -> ``scene_0001.gt.json``."""
    p = Path(path)
    return p.with_name(p.name[: -len(p.suffix)] + SIDECAR_SUFFIX if p.suffix else p.name + SIDECAR_SUFFIX)


def _skip_name(name: str) -> bool:
    base = os.path.basename(name)
    return base.startswith(".") or base.endswith(SIDECAR_SUFFIX) or base.endswith(".json")


def ingest_file(store_path: str, source: Source, *, units: str = "m") -> dict[str, Any]:
    """Ingest one file into the store; never raises for a bad file (it is quarantined).

    Returns a record: ``status`` (``ingested`` | ``skipped`` | ``quarantined``), ``scan_id``,
    ``source``, ``points``, ``bytes``, ``seconds`` and ``reason`` for quarantined files.
    """
    t0 = time.perf_counter()
    store = ScanStore(store_path)
    rec: dict[str, Any] = {"source": source.path, "scan_id": source.scan_id, "points": 0, "bytes": 0}
    try:
        data = Path(source.path).read_bytes()
    except OSError as exc:
        store.quarantine(source.path, f"cannot read file: {exc.strerror or exc}", key=source.scan_id)
        return {**rec, "status": "quarantined", "reason": f"cannot read file: {exc}",
                "seconds": time.perf_counter() - t0}
    digest = sha256_bytes(data)
    rec["bytes"] = len(data)
    if store.is_current(source.scan_id, digest):
        return {**rec, "status": "skipped", "points": int(store.attrs(source.scan_id).get("n_points", 0)),
                "seconds": time.perf_counter() - t0}
    try:
        cloud = read_cloud(source.path, data)
    except ScanReadError as exc:
        store.quarantine(source.path, exc.reason, digest, key=source.scan_id)
        return {**rec, "status": "quarantined", "reason": exc.reason, "seconds": time.perf_counter() - t0}
    attrs: dict[str, Any] = {
        "source": source.path,
        "sha256": digest,
        "format": cloud.meta.get("format"),
        "encoding": cloud.meta.get("encoding"),
        "n_points": len(cloud),
        "n_source_points": cloud.meta.get("n_source_points", len(cloud)),
        "units": units,
        "bbox": {"min": cloud.bbox[0], "max": cloud.bbox[1]},
        "ingested_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dtype": str(cloud.points.dtype),
    }
    for key in ("width", "height", "viewpoint", "organized"):
        if key in cloud.meta:
            attrs[key] = cloud.meta[key]
    side = sidecar_for(source.path)
    if side.is_file():
        try:
            attrs.update(json.loads(side.read_text()))
        except (OSError, ValueError) as exc:
            store.quarantine(source.path, f"ground-truth sidecar {side.name} is unreadable: {exc}", digest,
                             key=source.scan_id)
            return {**rec, "status": "quarantined", "reason": f"bad sidecar {side.name}",
                    "seconds": time.perf_counter() - t0}
    store.write_scan(source.scan_id, cloud.arrays(), attrs)
    store.release(source.scan_id)
    return {**rec, "status": "ingested", "points": len(cloud), "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------- discovery


def discover(source: str | os.PathLike, staging: str | os.PathLike) -> tuple[list[Source], list[dict[str, str]]]:
    """Expand a folder, a glob, a single file or an archive into the files to ingest.

    Archives (.tar, .tar.gz, .tgz, .zip, ...) are extracted once, streaming, into ``staging``;
    scan ids are the member paths prefixed by the archive's name. Returns the sources and a
    list of problems found while expanding (``{"source", "reason"}``: unsafe or corrupt archives).
    """
    src = str(source)
    problems: list[dict[str, str]] = []
    if any(ch in src for ch in "*?[") and not Path(src).exists():
        import glob as _glob

        paths = sorted(p for p in _glob.glob(src, recursive=True) if os.path.isfile(p))
        root = _glob_root(src)
        items: list[Source] = []
        for p in paths:
            if _skip_name(p):
                continue
            if is_archive(p):
                sub, probs = _expand_archive(Path(p), Path(staging))
                items += sub
                problems += probs
            else:
                items.append(Source(os.path.abspath(p), scan_id_for(os.path.relpath(p, root))))
        return items, problems
    path = Path(src)
    if not path.exists():
        from scanforest.kernels.errors import InputError

        raise InputError(f"ingest source {src!r} does not exist")
    if path.is_file():
        if is_archive(path):
            return _expand_archive(path, Path(staging))
        return [Source(str(path.resolve()), scan_id_for(path.name))], []
    items = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fname in sorted(filenames):
            full = Path(dirpath) / fname
            if _skip_name(fname):
                continue
            if is_archive(full):
                sub, probs = _expand_archive(full, Path(staging))
                items += sub
                problems += probs
                continue
            items.append(Source(str(full.resolve()), scan_id_for(os.path.relpath(full, path))))
    return items, problems


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


def _expand_archive(path: Path, staging: Path) -> tuple[list[Source], list[dict[str, str]]]:
    from .store import sha256_file

    problems: list[dict[str, str]] = []
    digest = sha256_file(path)[:12]
    stem = _archive_stem(path)
    dest = staging / f"{stem}-{digest}"
    done_marker = dest / ".extracted"
    if not done_marker.exists():
        dest.mkdir(parents=True, exist_ok=True)
        try:
            for member, fin in _members(path):
                if not _safe_member(member):
                    problems.append({"source": f"{path}::{member}", "reason": "unsafe archive member path"})
                    continue
                target = dest / member
                target.parent.mkdir(parents=True, exist_ok=True)
                with fin, open(target, "wb") as fout:
                    while chunk := fin.read(1 << 22):
                        fout.write(chunk)
            done_marker.write_text(str(path))
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
            problems.append({"source": str(path), "reason": f"corrupt or truncated archive: {type(exc).__name__}: {exc}"})
    items = []
    for dirpath, dirnames, filenames in os.walk(dest):
        dirnames.sort()
        for fname in sorted(filenames):
            if _skip_name(fname):
                continue
            full = Path(dirpath) / fname
            rel = os.path.relpath(full, dest)
            items.append(Source(str(full), scan_id_for(f"{stem}/{rel}")))
    return items, problems


def _members(path: Path):
    """(name, open binary stream) of every regular file in a zip or tar archive, streaming."""
    if path.name.lower().endswith(".zip"):
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.is_dir():
                    yield info.filename, zf.open(info)
    else:
        with tarfile.open(path, "r:*") as tf:
            for member in tf:
                if member.isfile():
                    yield member.name, tf.extractfile(member)


def _safe_member(name: str) -> bool:
    p = Path(name)
    return not p.is_absolute() and ".." not in p.parts


def supported(path: str) -> bool:
    return Path(path).suffix.lower() in FORMATS
