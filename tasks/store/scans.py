"""The scans of the store (``STORE/scans/<scan_id>/``) and the store itself: :class:`ScanStore`
opens or creates it, reads and writes scans and their stages, quarantine records and run
manifests; scan ids (:func:`scan_id_for`), stage records (:func:`stage_matches`,
:func:`stage_digest`); its errors are :mod:`.errors`' (:class:`StoreWriteError`, :class:`StoreReadError`).
The layout is in the package's docstring (:mod:`scanforest.tasks.store`); the claims are
:mod:`.locks`', the checks :mod:`.integrity`', the named things beside the scans (libraries,
indexes, sequences, runs) :mod:`.catalog`'s.

Visibility rule: a scan group is written with ``complete = False`` and flipped to ``True`` only
after every array is written and read back with the shape its ``arrays`` record promises;
:meth:`ScanStore.scans` lists complete scans only, and a later ingest replaces an incomplete group.
A scan too large for memory is written block by block (:meth:`ScanStore.write_scan_blocks`) under
the same rule.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import json
import os
import re
import unicodedata
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from scanforest.kernels.errors import InputError

from .catalog import Catalog, plain_name as _plain_name
from .errors import WHERE_ERRNOS, StoreReadError, StoreWriteError, _decoded, _where_error  # noqa: F401 - re-exported
from .integrity import Integrity, _array_problems, _check_written, _raise_unwritten, _scan_problems, _spec_problem
from .locks import LOCKS, Claims, file_lock

LAYOUT_VERSION = 1
CHUNK_ROWS = 1 << 18  # 262,144 rows per chunk: ~3 MB of float32 xyz, good for parallel writes
MAX_ID_BYTES = 200  # scan ids are one file name: leave room under NAME_MAX (255) for ".lock" etc.


def utc_now() -> str:
    """The time now in UTC, ISO 8601 to the second: the store's timestamps (``created``, ``written``,
    a quarantine's ``time``), which flows take before a run to tell the records it wrote."""
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
_PLAIN_PART = re.compile(r"[A-Za-z0-9._-]+")
_EXT = re.compile(r"\.[A-Za-z0-9_-]{1,15}$")
ID_HASH_MARK = "~"  # never in a plain id (outside the safe set), always in a hashed one
ID_HASH_HEX = 16


def scan_id_for(relpath: str) -> str:
    """The scan id of a file from its path relative to the ingest root: unique, stable, readable.

    A path whose parts are all made of ``A-Z a-z 0-9 . _ -`` is its own id, the parts joined by
    ``__`` (``scenes/scene_01.pcd`` -> ``scenes__scene_01.pcd``), when splitting the id on ``__``
    gives those parts back, it does not start with ``.`` (a hidden folder) and it fits
    :data:`MAX_ID_BYTES`. Any other path keeps a readable head, then ``~``, 16 hex digits of the
    SHA-256 of the whole relative path, and the extension (so ``x.pcd`` and ``x.ply`` stay
    apart): ``a b.pcd`` -> ``a_b~<hash>.pcd``, ``scène 1.pcd`` -> ``scene_1~<hash>.pcd``,
    ``日本語.pcd`` -> ``scan~<hash>.pcd``, a 255-byte name -> its first ~180 bytes ``~<hash>.pcd``.
    Plain ids never hold ``~`` and hashed ones always do, and the split rule makes the join
    reversible (``a/b.pcd`` and ``a__b.pcd`` cannot both be plain), so two paths never share an id
    short of a 64-bit hash collision. Plain ids are the ids older versions gave;
    :func:`legacy_scan_id` gives any path's old id, for stores written before.

    Ids are ASCII: a Unicode name is a file name whose bytes macOS may rewrite (HFS+ stores NFD,
    APFS takes NFC and NFD spellings for one name), Zarr v3 recommends the portable set for node
    names, and ids are typed in shells and patterns. The head keeps letters without their accents
    (``é`` -> ``e``); other characters become ``_``. The full path stays in the scan's ``source``.
    """
    parts = [p for p in _as_posix(relpath).split("/") if p not in ("", ".")]
    plain = "__".join(parts)
    if (parts and all(_PLAIN_PART.fullmatch(p) for p in parts) and plain.split("__") == parts
            and not plain.startswith(".") and len(plain) <= MAX_ID_BYTES):
        return plain
    head = "__".join(_ascii(p) for p in parts)
    ext = _EXT.search(head)
    ext = ext[0] if ext and ext.start() > 0 else ""
    tag = hashlib.sha256("/".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:ID_HASH_HEX]
    head = head[: len(head) - len(ext)][: MAX_ID_BYTES - len(ID_HASH_MARK) - len(tag) - len(ext)].strip("._")
    return f"{head or 'scan'}{ID_HASH_MARK}{tag}{ext}"


def _as_posix(relpath: str) -> str:
    """``Path(relpath).as_posix()``, without building a path where ``relpath`` is already in that
    form (a folder's listing: thousands of files a discovery)."""
    if (os.sep == "/" and isinstance(relpath, str) and relpath and relpath != "." and "//" not in relpath
            and "/./" not in relpath and not relpath.startswith("./") and not relpath.endswith(("/", "/."))):
        return relpath
    return Path(relpath).as_posix()


def _ascii(name: str) -> str:
    """``name`` in the safe set: accents dropped (NFKD, combining marks removed), the rest ``_``."""
    return _SAFE.sub("_", "".join(ch for ch in unicodedata.normalize("NFKD", name) if not unicodedata.combining(ch)))


def legacy_scan_id(relpath: str) -> str:
    """The id versions before unique ids gave a path: unsafe characters became ``_`` with no hash,
    so ``a b.pcd`` and ``a_b.pcd``, or ``日本語.pcd`` and ``中文.pcd`` (``_.pcd``), shared one scan.
    Ingest reuses it for a file whose scan an older version wrote under it (see
    :func:`scanforest.tasks.ingest.discover`), so those stores keep their ids."""
    posix = _as_posix(relpath)
    parts = [p for p in posix.split("/") if p not in ("", ".")]
    sid = "__".join(_SAFE.sub("_", p) for p in parts).lstrip(".") or "scan"
    if len(sid) <= MAX_ID_BYTES:
        return sid
    ext = _SAFE.sub("_", Path(parts[-1]).suffix)[:16]
    tag = hashlib.sha1(posix.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return f"{sid[: MAX_ID_BYTES - len(tag) - len(ext) - 1]}-{tag}{ext}"


def _read_root_meta(path: Path) -> dict | None:
    """The root ``zarr.json`` of ``path`` as a dict, or None when there is none."""
    try:
        return json.loads((path / "zarr.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InputError(f"{path} is not a scanforest scan store (unreadable zarr.json: {exc})") from exc


#: store -> scan -> ((inode, mtime ns, size) of its zarr.json, (complete, local extent) or None
#: for a non-group): what :meth:`ScanStore._scan_summaries` parsed, kept while the file is
#: unchanged, for the :data:`_SUMMARY_STORES` stores listed last
_SUMMARIES: dict[str, dict[str, tuple[tuple[int, int, int], tuple[bool, float | None] | None]]] = {}
_SUMMARY_STORES = 4


#: a cloud's per-point arrays (:class:`~scanforest.tasks.readers.PointCloud`'s): one row a point
PER_POINT = ("normals", "colors", "intensity", "pixel_index")


def _cloud_rows(scan_id: str, arrays: dict[str, np.ndarray]) -> int:
    """The points of a scan about to be written: ``points`` must be (N, 3) and each per-point
    array (:data:`PER_POINT`) N rows long (a reader of the stored cloud takes them row by row)."""
    pts = arrays["points"]
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise InputError(f"scan {scan_id!r}: points must be an (N, 3) array, got shape {pts.shape}")
    for name in PER_POINT:
        if name in arrays and len(arrays[name]) != len(pts):
            raise InputError(f"scan {scan_id!r}: {name} has {len(arrays[name])} rows for {len(pts)} points")
    return len(pts)


def _new_scan_id(scan_id) -> str:
    """``scan_id`` of a scan about to be written, refused unless it is one node of the store: an
    empty id named the ``scans`` group itself (writing it replaced every scan), ``a/b`` a scan
    inside another, ``..`` a node outside."""
    if not isinstance(scan_id, str) or not _plain_name(scan_id):
        raise InputError(f"scan id {scan_id!r} cannot name a scan: give a non-empty name without '/' "
                         "that is not '.' or '..'")
    return scan_id


def _summary(path: str, store: str, name: str) -> tuple[bool, float | None, float | None] | None:
    """(complete, local extent, coordinate grid) of the scan group whose ``zarr.json`` is
    ``path`` (:func:`scan_extent`, :func:`scan_grid`); None when it is not a group."""
    try:
        with open(path, "rb") as fh:
            meta = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        raise InputError(f"{store}: scan {name!r} has an unreadable zarr.json ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("node_type") != "group":
        return None
    a = meta.get("attributes") or {}
    return bool(a.get("complete", False)), scan_extent(a), scan_grid(a)


def scan_extent(attrs: dict[str, Any]) -> float | None:
    """The largest coordinate magnitude whose float32 spacing the scan's stages see (from its
    attributes ``bbox``, ``origin`` and ``arrays``; None without a ``bbox``): its extent about its
    local origin, or, for points stored as float32 in the file's own coordinates, those
    coordinates' magnitude, whose precision they carry whatever origin the stages take (a
    float32 E57 in UTM coordinates: points 0.25-0.5 m apart, zero detections and no word)."""
    box = attrs.get("bbox") or {}
    if box.get("min") is None or box.get("max") is None:
        return None
    lo, hi = np.asarray(box["min"], np.float64), np.asarray(box["max"], np.float64)
    o = scan_origin(attrs)
    extent = float(max(np.abs(lo - o).max(), np.abs(hi - o).max()))
    if ((attrs.get("arrays") or {}).get("points") or {}).get("dtype") == "float32":
        extent = max(extent, float(max(np.abs(lo).max(), np.abs(hi).max())))
    return extent


def scan_grid(attrs: dict[str, Any]) -> float | None:
    """The grid the scan's file stored its coordinates on (a LAS/LAZ/COPC scale, the largest of
    the three axes': a stored scan's attribute ``coordinate_grid``, or a reader's ``scales``), or
    None (float coordinates)."""
    g = attrs.get("coordinate_grid", max(attrs["scales"]) if attrs.get("scales") else None)
    return None if g is None else float(g)


def _is_store_meta(meta: dict | None) -> bool:
    return bool(meta) and meta.get("node_type") == "group" and "scanforest_store" in meta.get("attributes", {})


class ScanStore(Claims, Integrity):
    """A Zarr v3 scan store (see :mod:`scanforest.tasks.store` for the layout).

    Parameters
    ----------
    path : str or path-like
        Directory of the store.
    mode : {"a", "r"}
        ``"r"`` refuses writes.
    create : bool
        Create the store when ``path`` does not exist (or is an empty folder). Only ingest does
        this: every other stage needs scans, so a mistyped path is an error, not a new empty store.

    Raises
    ------
    InputError
        No store at ``path`` (and ``create`` is false), or ``path`` holds something else.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "a", *, create: bool = False):
        import zarr

        if mode not in ("a", "r"):
            raise InputError(f"store mode must be 'a' or 'r', got {mode!r}")
        if create and mode == "r":
            raise InputError("a store cannot be created read-only")
        self.path = str(path)
        self.mode = mode
        root = Path(self.path)
        if create:
            with self._writing():
                self._create(root)
        elif not root.exists():
            raise InputError(f"no scan store at {self.path} (create one with: scanforest ingest SOURCE {self.path})")
        elif not root.is_dir() or not _is_store_meta(_read_root_meta(root)):
            raise InputError(f"{self.path} is not a scanforest scan store (no zarr.json with scanforest_store)")
        self.root = zarr.open_group(self.path, mode="r" if mode == "r" else "r+", zarr_format=3)

    def _create(self, root: Path) -> None:
        """Make the root group and its three subgroups, once, even when several ingests start together."""
        import zarr

        if root.exists():
            if not root.is_dir():
                raise InputError(f"{self.path} exists and is not a folder, so it cannot be a scan store")
            if not _is_store_meta(_read_root_meta(root)) and set(os.listdir(root)) - {LOCKS}:
                raise InputError(f"{self.path} exists and is not a scanforest scan store; "
                                 "give a new or empty folder for the store")
        root.mkdir(parents=True, exist_ok=True)
        with file_lock(root / LOCKS / "store.lock"):
            meta = _read_root_meta(root)
            if meta is None:
                zarr.create_group(self.path, zarr_format=3,
                                  attributes={"scanforest_store": LAYOUT_VERSION, "created": utc_now()})
            elif not _is_store_meta(meta):
                raise InputError(f"{self.path} holds a Zarr hierarchy that is not a scanforest scan store")
            grp = zarr.open_group(self.path, mode="r+", zarr_format=3)
            for name in ("scans", "quarantine", "runs"):
                grp.require_group(name)

    @staticmethod
    def exists(path: str | os.PathLike) -> bool:
        """Whether ``path`` holds a scanforest store (callers that must not create one ask this)."""
        return _is_store_meta(_read_root_meta(Path(path))) if Path(path).is_dir() else False

    def __repr__(self) -> str:
        return f"ScanStore({self.path!r}, scans={len(self.scans())})"

    def _writable(self) -> None:
        if self.mode == "r":
            raise InputError(f"{self.path}: store opened read-only")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around a write into the store: an ``OSError`` that says the store's location cannot be
        written (no space left, quota, read-only: :data:`WHERE_ERRNOS`), raised here or under a
        Zarr call, becomes a :class:`StoreWriteError` naming the store and the reason. One whose
        file is outside the store (a temporary file elsewhere) keeps its own type."""
        try:
            yield
        except StoreWriteError:
            raise
        except Exception as exc:
            found = _where_error(exc)
            if found is None or (found.filename and not _inside(str(found.filename), self.path)):
                raise
            from ..preflight import write_problem

            raise StoreWriteError(self.path, write_problem(found)) from exc

    @functools.cached_property
    def catalog(self) -> Catalog:
        """The store's libraries, indexes, sequences and runs (:class:`~.catalog.Catalog`), read
        through this opened store."""
        return Catalog(self)

    # ------------------------------------------------------------------ listing
    def _group(self, kind: str):
        return self.root[kind] if kind in self.root else None

    def scans(self, *, include_incomplete: bool = False) -> list[str]:
        """Ids of the scans in the store, sorted; only completely written ones by default."""
        return sorted(name for name, (complete, *_) in self._scan_summaries().items()
                      if complete or include_incomplete)

    def _scan_summaries(self) -> dict[str, tuple[bool, float | None, float | None]]:
        """Each scan group's (complete, local extent: :meth:`local_extents`'s figure or None,
        coordinate grid: :func:`scan_grid`),
        from its ``zarr.json`` (Zarr writes it whole, by an atomic rename), parsed once per
        version of the file in this process (:data:`_SUMMARIES`). Through Zarr's group listing,
        which builds a group object for each child, 2,000 scans took 1.0 s on a GPU host and
        8,000 took 2.3 s on 2 cores; a first read this way 0.5 s, a repeated one 0.05 s, and an
        archive run lists its scans five times before its first task (2026-11-28)."""
        folder = os.path.join(self.path, "scans")
        try:
            entries = [e for e in os.scandir(folder) if e.is_dir() and not e.name.startswith(".")]
        except FileNotFoundError:
            return {}
        out: dict[str, tuple[bool, float | None, float | None]] = {}
        key = os.path.realpath(self.path)
        old, kept = _SUMMARIES.pop(key, {}), {}
        for entry in entries:
            path = os.path.join(entry.path, "zarr.json")
            try:
                st = os.stat(path)
            except FileNotFoundError:  # a folder that is not (yet) a group
                continue
            version = (st.st_ino, st.st_mtime_ns, st.st_size)
            hit = old.get(entry.name)
            if hit is None or hit[0] != version:
                hit = (version, _summary(path, self.path, entry.name))
            kept[entry.name] = hit
            if hit[1] is not None:
                out[entry.name] = hit[1]
        _SUMMARIES[key] = kept  # the scans there now, the store's entry the newest
        while len(_SUMMARIES) > _SUMMARY_STORES:
            _SUMMARIES.pop(next(iter(_SUMMARIES)))
        return out

    def group_summary(self, scan_id: str) -> list | None:
        """``[inode, mtime_ns, size, complete, local extent, grid]`` of a scan group's ``zarr.json`` as
        it is now, or None (not a group, or rewritten while read): what a worker that wrote the
        scan hands the flow (:meth:`remember_summaries`), so that the flow's next listing reads
        no ``zarr.json`` again (8,000 scans: 0.8 s on a four-GPU host, 2026-11-28)."""
        path = self._meta_file("scans", scan_id)
        try:
            before = os.stat(path)
            summary = _summary(path, self.path, scan_id)
            after = os.stat(path)
        except (OSError, InputError):
            return None
        version = (after.st_ino, after.st_mtime_ns, after.st_size)
        if summary is None or version != (before.st_ino, before.st_mtime_ns, before.st_size):
            return None
        return [*version, *summary]

    @staticmethod
    def remember_summaries(path: str | os.PathLike, groups: dict[str, list]) -> None:
        """Take :meth:`group_summary`'s figures of scans (by id) into this process's listing
        cache of the store at ``path``; a listing still checks each file's version, so a scan
        rewritten since is read again."""
        key = os.path.realpath(os.fspath(path))
        kept = _SUMMARIES.setdefault(key, {})
        for name, g in groups.items():
            if g and len(g) == 6:
                kept[name] = ((int(g[0]), int(g[1]), int(g[2])),
                              (bool(g[3]), *(None if v is None else float(v) for v in g[4:])))

    def __contains__(self, scan_id: str) -> bool:
        if not self._node_file("scans", scan_id):
            return False
        summary = _summary(self._meta_file("scans", scan_id), self.path, scan_id)
        return bool(summary and summary[0])

    def attrs(self, scan_id: str) -> dict[str, Any]:
        return dict(self._scan(scan_id).attrs)

    def _scan(self, scan_id: str, *, complete: bool = True):
        # opened by its path in one round through Zarr (through the scans group: four)
        grp = None
        if _plain_name(scan_id):
            try:
                grp = self.root[f"scans/{scan_id}"]
            except (KeyError, FileNotFoundError):
                grp = None
        if grp is None or not hasattr(grp, "groups"):  # none, or an array where a scan belongs
            raise InputError(f"{self.path}: no scan {scan_id!r}")
        if complete and not grp.attrs.get("complete", False):
            raise InputError(f"{self.path}: scan {scan_id!r} is incomplete (an interrupted write); re-ingest it")
        return grp

    def _node_file(self, kind: str, name: str) -> bool:
        """Whether the group ``kind/name`` has its ``zarr.json`` (a look at the file system, no
        opening through Zarr): False means there is no such node."""
        return _plain_name(name) and os.path.isfile(self._meta_file(kind, name))

    def _meta_file(self, kind: str, name: str) -> str:
        """The ``zarr.json`` of the node ``name`` under ``kind`` (``scans``, ...)."""
        return os.path.join(self.path, kind, name, "zarr.json")

    def sources(self, scan_ids: Iterable[str]) -> dict[str, str]:
        """Each scan's ``source`` (the file it was ingested from), read from its group's
        ``zarr.json`` (one file read a scan, no Zarr round trip); scans without one are left out."""
        out = {}
        for sid in scan_ids:
            try:
                with open(self._meta_file("scans", sid), "rb") as fh:
                    src = (json.loads(fh.read()).get("attributes") or {}).get("source")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(src, str):
                out[sid] = src
        return out

    def is_current(self, scan_id: str, sha256: str, **settings) -> bool:
        """True when the scan is complete, intact (every promised array present with its shape and
        chunks) and came from bytes with this sha256 (and, where given, was read with these
        ``settings``, e.g. ``copc``: the attributes of those names hold them): a damaged scan, or
        one read with other settings, is re-ingested."""
        if not self._node_file("scans", scan_id):  # no scan yet (every new file): nothing to open
            return False
        try:
            grp = self.root[f"scans/{scan_id}"]
            a = grp.attrs
            return (bool(a.get("complete", False)) and a.get("sha256") == sha256
                    and all(a.get(k) == _jsonable(v) for k, v in settings.items()) and not _scan_problems(grp))
        except (KeyError, OSError):  # no such scan, or a writer is replacing it right now
            return False

    # ------------------------------------------------------------------ scans
    def write_scan(self, scan_id: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Write one scan under its claim; readers see it only once it is whole.

        An existing group of that id (incomplete, damaged, or from older bytes) is replaced. The
        attrs record every array's shape and dtype (``arrays``), and ``complete`` is set only
        after the written group has been read back against that record.
        """
        self._writable()
        _new_scan_id(scan_id)
        if "points" not in arrays:
            raise InputError("write_scan needs a 'points' array")
        arrays = {name: np.asarray(arr) for name, arr in arrays.items()}
        _cloud_rows(scan_id, arrays)
        promised = {name: _spec(arr) for name, arr in arrays.items()}
        with self._writing(), self.claim(scan_id):
            scans = self.root.require_group("scans")
            grp = scans.create_group(scan_id, overwrite=True,
                                     attributes={**_jsonable(attrs), "arrays": promised, "complete": False})
            # the arrays created, written and read back in one round through Zarr's event loop
            # (one by one: about a dozen round trips a scan, most of an ingest's time per file)
            _raise_unwritten(scan_id, _write_arrays(grp, arrays))
            grp.attrs["complete"] = True

    def write_scan_blocks(self, scan_id: str, blocks: Iterable[Any], n_points: int,
                          columns: dict[str, tuple[Any, tuple[int, ...]]],
                          attrs: dict[str, Any] | Callable[[], dict[str, Any]], *, at_most: bool = False,
                          optional: Iterable[str] = ()) -> None:
        """:meth:`write_scan` for a scan that does not fit in memory whole: its arrays are created
        with their final shape (``n_points`` rows; ``columns``: ``{name: (dtype, trailing shape)}``,
        ``points`` among them) and written block by block as ``blocks`` gives them, so only one
        block is in memory at a time.

        Each block is a ``{name: rows}`` dict (every column, the same number of rows) written at
        the rows that follow the previous one, or a ``(start, {name: rows})`` pair written at
        ``start`` (some of the columns: a correction of rows written before, which does not move
        on). ``attrs`` may be a function called once every block is written (figures such as the
        bounding box are known only then). ``at_most``: ``n_points`` is an upper bound (a reader
        that drops points as it goes): the arrays are cut to the rows written. ``optional``:
        columns that blocks may leave out (a reader that finds out midway that it needs one gives
        its earlier rows as corrections first); one that no block gave is not stored.

        The same guarantees as :meth:`write_scan`: the scan's claim is held throughout; the group
        is created with ``complete = False`` and its ``arrays`` record, every array is checked
        after the last block as :meth:`write_scan` checks it (shape, dtype, every chunk stored:
        nothing is read back whole), and only then is ``complete`` set. Blocks that give more or
        fewer rows than ``n_points``, an exception of the reader midway, or a crash leave the
        group incomplete: invisible, and replaced by the next ingest.
        """
        self._writable()
        _new_scan_id(scan_id)
        if "points" not in columns:
            raise InputError("write_scan_blocks needs a 'points' column")
        n_points = int(n_points)
        specs = {name: (np.dtype(dt), tuple(int(s) for s in tail)) for name, (dt, tail) in columns.items()}
        promised = {name: {"shape": [n_points, *tail], "dtype": str(dt)} for name, (dt, tail) in specs.items()}
        with self._writing(), self.claim(scan_id):
            scans = self.root.require_group("scans")
            grp = scans.create_group(scan_id, overwrite=True, attributes={"arrays": promised, "complete": False})
            zs = {}
            for name, (dt, tail) in specs.items():
                shape = (n_points, *tail)
                zs[name] = grp.create_array(name, shape=shape, dtype=dt, overwrite=True, config=_ARRAY_CONFIG,
                                            compressors=_compressors(),
                                            chunks=(min(CHUNK_ROWS, max(1, n_points)), *tail))
            row = 0
            optional, used = set(optional), set()
            for block in blocks:
                start, block = block if isinstance(block, tuple) else (None, block)
                used |= optional & set(block)
                if start is None and not set(specs) - optional <= set(block) <= set(specs):
                    raise ValueError(f"{scan_id}: a block gives {sorted(block)}, "
                                     f"the scan's columns are {sorted(specs)}")
                for name, rows in block.items():
                    rows = np.asarray(rows)
                    if rows.dtype != specs[name][0] or rows.shape[1:] != specs[name][1]:
                        raise ValueError(f"{scan_id}: block of {name!r} is {rows.dtype} {rows.shape[1:]}, "
                                         f"the column is {specs[name][0]} {specs[name][1]}")
                    at = row if start is None else int(start)
                    if at + len(rows) > n_points:
                        raise ValueError(f"{scan_id}: blocks give more than the {n_points} rows promised")
                    if len(rows):
                        zs[name][at:at + len(rows)] = rows
                if start is None:
                    lengths = {len(v) for v in block.values()}
                    if len(lengths) != 1:
                        raise ValueError(f"{scan_id}: a block's columns have different row counts {sorted(lengths)}")
                    row += lengths.pop()
            if row != n_points and not (at_most and row < n_points):
                raise ValueError(f"{scan_id}: blocks gave {row} rows, {n_points} were promised")
            for name in optional - used:
                del grp[name]
                del zs[name], promised[name]
            if row != n_points:
                for name, z in zs.items():
                    z.resize((row, *specs[name][1]))
                    promised[name]["shape"][0] = row
            if row != n_points or optional - used:
                grp.attrs["arrays"] = promised
            final = attrs() if callable(attrs) else attrs
            _check_written(scans[scan_id], promised, scan_id)
            grp.attrs.update({**_jsonable(final), "arrays": promised})
            grp.attrs["complete"] = True

    @staticmethod
    def _write_array(grp, name: str, arr: np.ndarray, chunk_rows: int = CHUNK_ROWS):
        """One array into ``grp`` (callers run it inside :meth:`_writing`, which names the store
        when it fails for lack of space or a read-only mount)."""
        chunks = _chunks_for(arr, chunk_rows)
        # every chunk is stored, even one equal to the fill value, so a missing chunk file is damage
        z = grp.create_array(name, shape=arr.shape, dtype=arr.dtype, chunks=chunks, overwrite=True,
                             config=_ARRAY_CONFIG, compressors=_compressors())
        if arr.size:
            z[...] = arr
        return z

    def read(self, scan_id: str, name: str = "points") -> np.ndarray:
        grp = self._scan(scan_id)
        if name not in grp:
            raise InputError(f"{self.path}: scan {scan_id!r} has no array {name!r} (has: {sorted(grp.array_keys())})")
        return _decoded(self.path, scan_id, name, lambda: grp[name][...])

    def read_many(self, scan_id: str, names) -> dict[str, np.ndarray]:
        """Several arrays of one scan, read concurrently: the scan group is opened once and the
        arrays' metadata and chunks are fetched together (one round through Zarr's event loop
        instead of two per array). A missing array is the same one-line error as :meth:`read`, a
        damaged one the same :class:`StoreReadError`."""
        names = list(names)
        grp = self._scan(scan_id)
        try:
            return dict(zip(names, _gather_arrays(grp, names)))
        except KeyError:
            have = sorted(grp.array_keys())
            missing = [n for n in names if n not in have]
            if not missing:
                raise
        except (InputError, MemoryError):
            raise
        except Exception:  # noqa: BLE001 - a damaged chunk: which array, read one by one
            for n in names:
                _decoded(self.path, scan_id, n, lambda n=n: grp[n][...])
            raise
        raise InputError(f"{self.path}: scan {scan_id!r} has no array {missing[0]!r} (has: {have})")

    def _complete_summaries(self, scan_ids: Iterable[str] | None) -> dict[str, tuple[float | None, float | None]]:
        """(local extent, coordinate grid) of each complete scan (``scan_ids``: these only), from
        one pass over the scans' groups (:meth:`_scan_summaries`)."""
        want = None if scan_ids is None else set(scan_ids)
        return {name: (extent, grid) for name, (complete, extent, grid) in self._scan_summaries().items()
                if complete and (want is None or name in want)}

    def local_extents(self, scan_ids: Iterable[str] | None = None) -> dict[str, float]:
        """The largest coordinate magnitude of each complete scan (``scan_ids``: these only) in its
        local frame, from its attributes (``bbox`` less ``origin``: :func:`scan_origin`), read in
        one pass over the scans' groups; scans without a ``bbox`` are left out."""
        return {n: e for n, (e, _) in self._complete_summaries(scan_ids).items() if e is not None}

    def coordinate_grids(self, scan_ids: Iterable[str] | None = None) -> dict[str, float]:
        """The file grid (:func:`scan_grid`: a LAS scale) of each complete scan that has one
        (``scan_ids``: these only), from the one pass over the scans' groups."""
        return {n: g for n, (_, g) in self._complete_summaries(scan_ids).items() if g is not None}

    def check_coordinates(self, scan_ids: Iterable[str] | None, radii: dict[str, float | None]) -> list[str]:
        """Refuse, before any work, a run whose every scan (of ``scan_ids``; None: all) has local
        coordinates too coarse in float32, or a file grid too coarse, for ``radii`` (name ->
        length): :class:`InputError`
        naming the first and the numbers (:func:`scanforest.kernels.coordinates.check_spacing`).
        Where only some are, the others go on: those are returned, and each fails alone with the
        same line when its unit of work checks it (one scan with a stray point 500 km up stopped
        a whole archive, with no trace of why in the store's records)."""
        from scanforest.kernels.coordinates import check_spacing

        extents = sorted((n, eg) for n, eg in self._complete_summaries(scan_ids).items() if eg[0] is not None)
        bad: list[tuple[str, InputError]] = []
        for sid, (extent, grid) in extents:
            try:
                check_spacing(extent, radii, f"{self.path}: scan {sid}", grid=grid)
            except InputError as exc:
                bad.append((sid, exc))
        if bad and len(bad) == len(extents):
            raise bad[0][1]
        return [sid for sid, _ in bad]

    def arrays(self, scan_id: str) -> list[str]:
        return sorted(self._scan(scan_id).array_keys())

    def read_cloud(self, scan_id: str):
        """The scan back as a :class:`~scanforest.tasks.readers.PointCloud`."""
        from ..readers import PointCloud

        grp = self._scan(scan_id)
        keys = set(grp.array_keys())
        get = lambda n: _decoded(self.path, scan_id, n, lambda: grp[n][...]) if n in keys else None  # noqa: E731
        cloud = PointCloud(get("points"), normals=get("normals"), colors=get("colors"),
                           intensity=get("intensity"), pixel_index=get("pixel_index"),
                           meta=dict(grp.attrs))
        cloud.extra = {k[6:]: get(k) for k in keys if k.startswith("extra_")}
        return cloud

    def write_stage(self, scan_id: str, stage: str, arrays: dict[str, np.ndarray],
                    attrs: dict[str, Any] | None = None) -> None:
        """Write a later stage's arrays (e.g. ``describe``: keypoints, frames, descriptors) into a scan.

        Runs under the scan's claim, on attrs read after the claim was taken, so two stages
        written at once both keep their records. The record ``stages.<stage>`` (with the arrays'
        shapes) is set last, after the arrays read back whole, so a half-written stage is never
        seen as done: :meth:`has_stage` is the idempotency check for tasks.
        """
        self.write_stages(scan_id, [(stage, arrays, attrs)])

    def write_stages(self, scan_id: str, items) -> dict[str, dict[str, Any]]:
        """:meth:`write_stage` for several stages of one scan under one claim: ``items`` are
        ``(stage, arrays, attrs)``, where ``attrs`` may be a function of the records made before
        it in this call (``{stage: record}``), e.g. to name the :func:`stage_digest` of the
        description a match was made from.

        The records of the stages being replaced go first; then every array of every stage is
        written and read back in one round through Zarr's event loop (:func:`_write_arrays`);
        then all the records are set at once. A crash in between leaves none of these stages
        recorded, never one whose arrays are half written. Returns the records written."""
        self._writable()
        items = [(stage, {name: np.asarray(arr) for name, arr in arrays.items()}, attrs)
                 for stage, arrays, attrs in items]
        names = [name for _, arrays, _ in items for name in arrays]
        if len(set(names)) != len(names):
            raise ValueError(f"{scan_id}: two stages of one write_stages call name the same array")
        written: dict[str, dict[str, Any]] = {}
        with self._writing(), self.claim(scan_id):
            grp = self._scan(scan_id)
            stages = dict(grp.attrs.get("stages", {}))
            dropped = [stage for stage, _, _ in items if stages.pop(stage, None) is not None]
            if dropped:
                grp.attrs["stages"] = stages
            all_arrays = {name: arr for _, arrays, _ in items for name, arr in arrays.items()}
            _raise_unwritten(f"{scan_id} stages {[s for s, _, _ in items]}", _write_arrays(grp, all_arrays))
            for stage, arrays, attrs in items:
                a = attrs(written) if callable(attrs) else attrs
                written[stage] = {**_jsonable(a or {}), "arrays": {n: _spec(x) for n, x in arrays.items()},
                                  "written": utc_now()}
            grp.attrs["stages"] = {**stages, **written}
        return written

    def stage(self, scan_id: str, stage: str) -> dict[str, Any] | None:
        """The record of ``stage`` for this scan (None when the stage was not written)."""
        try:
            rec = self._scan(scan_id).attrs.get("stages", {}).get(stage)
        except InputError:
            return None
        return None if rec is None else dict(rec)

    def has_stage(self, scan_id: str, stage: str, **params) -> bool:
        """True when ``stage`` was completely written for this scan (with these params, if given)."""
        try:
            rec = self._scan(scan_id).attrs.get("stages", {}).get(stage)
        except InputError:
            return False
        return stage_matches(rec, **params)

    # ------------------------------------------------------------------ quarantine
    def discard_incomplete(self, scan_id: str) -> bool:
        """Remove the scan's group if it is incomplete (a block-wise write that stopped midway on
        a file found truncated): the store keeps no orphan arrays, and ``check`` finds none.
        A complete scan is never touched. Returns whether a group was removed. The caller holds
        the scan's claim (:meth:`claim`)."""
        self._writable()
        if not self._node_file("scans", scan_id):
            return False
        g = self._group("scans")
        grp = g[scan_id] if g is not None and scan_id in g else None
        if grp is None or not hasattr(grp, "groups") or grp.attrs.get("complete", False):
            return False
        with self._writing():
            del g[scan_id]
        return True

    def quarantine(self, source: str, reason: str, sha256: str | None = None, *, key: str | None = None) -> str:
        """Record a rejected file under ``key`` (default: an id made from the source's name).

        One group per file, written under that record's own claim; re-quarantining replaces it.
        """
        self._writable()
        qid = key or scan_id_for(Path(source).name)
        with self._lock(self._lock_path("quarantine", qid), wait=True):
            self.root.require_group("quarantine").create_group(
                qid, overwrite=True,
                attributes={"source": source, "reason": reason, "sha256": sha256, "time": utc_now()})
        return qid

    def quarantined(self) -> list[dict[str, Any]]:
        g = self._group("quarantine")
        if g is None:
            return []
        return sorted((dict(child.attrs, id=name) for name, child in g.groups()), key=lambda d: d["id"])

    def release(self, source_id: str) -> None:
        """Drop a quarantine record (done automatically when the file later ingests cleanly)."""
        if not self._node_file("quarantine", source_id):  # the common case: never quarantined
            return
        g = self._group("quarantine")
        if g is not None and source_id in g:
            with self._lock(self._lock_path("quarantine", source_id), wait=True):
                if source_id in g:
                    del g[source_id]

    # ------------------------------------------------------------------ runs
    def write_run(self, run_id: str, record: dict[str, Any]) -> None:
        """Add ``record`` to the manifest of run ``run_id`` (``runs/<run_id>/``, created when new)."""
        with self._writing():
            runs = self.root.require_group("runs")
            grp = runs.require_group(run_id)
            grp.attrs.update(_jsonable(record))

    def count_noop_run(self, flow: str, summary: dict[str, Any], when: str, run_id: str | None = None) -> None:
        """Count a run of ``flow`` that found nothing to do instead of keeping its manifest: run
        ``run_id``'s record (opened by its start) is removed, and the ``runs`` group's
        ``noop_runs`` attribute keeps per flow the count, the first and last time (``when``) and
        the last run's scalar figures of ``summary``."""
        with self._writing():
            runs = self.root.require_group("runs")
            with file_lock(os.path.join(self.path, LOCKS, "runs", "noop.lock")):
                if run_id is not None and run_id in runs:
                    del runs[run_id]
                counts = dict(runs.attrs.get("noop_runs") or {})
                old = counts.get(flow) or {}
                counts[flow] = {"count": int(old.get("count", 0)) + 1, "first": old.get("first", when), "last": when,
                                "summary": {k: v for k, v in summary.items() if not isinstance(v, (list, dict))}}
                runs.attrs["noop_runs"] = _jsonable(counts)

    def runs(self) -> list[dict[str, Any]]:
        """:meth:`Catalog.runs <.catalog.Catalog.runs>`."""
        return self.catalog.runs()

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
        damaged = sorted({p["scan_id"] for p in self._damage() if p["problem"] in ("damaged", "stage")})
        return {"path": self.path, "scans": len(scans), "points": n_points, "formats": formats,
                "stages": stages, "incomplete": incomplete, "damaged": damaged,
                "quarantined": len(self.quarantined()),
                "runs": len(self.runs())}


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it."""
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _spec(arr: np.ndarray) -> dict[str, Any]:
    return {"shape": list(arr.shape), "dtype": str(arr.dtype)}


def _jsonable(obj: Any, where: str = "attrs") -> Any:
    """``obj`` as JSON can hold it (arrays and numpy scalars as lists and numbers, paths as
    strings); anything else is an :class:`InputError` naming where it is."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    raise InputError(f"{where} is a {type(obj).__name__}, which a scan's attributes (JSON) cannot hold")


def scan_origin(attrs: dict[str, Any]) -> np.ndarray:
    """The scan's local origin (float64, (3,)) from its attributes (``origin``, written at ingest:
    :func:`scanforest.kernels.coordinates.choose_origin`); ``[0, 0, 0]`` for a scan written
    before it existed. The stored points stay the file's own coordinates; the stages compute on
    :func:`local_points`, and give poses back in the file's coordinates."""
    o = attrs.get("origin")
    return np.zeros(3) if o is None else np.asarray(o, np.float64).reshape(3)


def local_points(points, attrs: dict[str, Any], xp=np):
    """The scan's stored ``points`` in its local frame, float32: minus its origin
    (:func:`scan_origin`), subtracted in float64 before the cast; the points as float32 when the
    origin is 0, as every stage took them before origins existed."""
    from scanforest.kernels.coordinates import to_local

    return to_local(points, scan_origin(attrs), xp)


def stage_matches(record: dict[str, Any] | None, **params) -> bool:
    """Whether a stage record exists and holds these params (:meth:`ScanStore.has_stage` on a
    record the caller has read already)."""
    return record is not None and all(record.get(k) == _jsonable(v) for k, v in params.items())


def stage_digest(record: dict[str, Any] | None) -> str | None:
    """The identity of one stage record (None for none): a digest of the whole record, its
    write time and timings included, so a stage written again, even with the same parameters,
    has a new one. A later stage that used this one's arrays records it, and finds out that
    they changed since."""
    if record is None:
        return None
    return hashlib.sha256(json.dumps(_jsonable(record), sort_keys=True).encode()).hexdigest()[:20]


def iter_chunks(n: int, size: int) -> Iterable[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def _gather_arrays(grp, names: list[str]) -> list[np.ndarray]:
    """``[grp[n][...] for n in names]`` with the reads issued together on Zarr's event loop."""
    import asyncio

    try:
        from zarr.core.sync import sync
        agrp = grp._async_group
    except (ImportError, AttributeError):  # another Zarr layout: read one by one
        return [grp[n][...] for n in names]

    async def _all():
        arrs = await asyncio.gather(*(agrp.getitem(n) for n in names))
        return await asyncio.gather(*(a.getitem(Ellipsis) for a in arrs))

    return [np.asarray(a) for a in sync(_all())]


def _chunks_for(arr: np.ndarray, chunk_rows: int = CHUNK_ROWS) -> tuple[int, ...]:
    return (min(chunk_rows, max(1, arr.shape[0])),) + tuple(arr.shape[1:]) if arr.ndim else ()


def _write_arrays(grp, arrays: dict[str, np.ndarray]) -> list[str]:
    """Write ``arrays`` into the group (each replaced, every chunk stored) and read them back:
    the problems found (:func:`_array_problems`), none when all are whole. The creates, the chunk
    writes and the read-back are issued together on Zarr's event loop: one round trip from this
    thread, where writing them one by one costs about seven."""
    import asyncio

    promised = {name: _spec(arr) for name, arr in arrays.items()}
    try:
        from zarr.core.sync import sync
        agrp = grp._async_group
    except (ImportError, AttributeError):  # another Zarr layout: one by one
        for name, arr in arrays.items():
            ScanStore._write_array(grp, name, arr)
        return _array_problems(grp, promised)

    async def stored_chunks(z) -> int:
        # one existence check per chunk key: Zarr's nchunks_initialized lists the array's folder
        # recursively, which costs more than writing a small array
        import itertools

        keys = [f"{z.store_path.path}/{z.metadata.encode_chunk_key(c)}".lstrip("/")
                for c in itertools.product(*(range(n) for n in z.cdata_shape))]
        found = await asyncio.gather(*(z.store_path.store.exists(k) for k in keys))
        return sum(found)

    async def stored_spec(z) -> dict[str, Any]:
        # the metadata document as stored (read and parsed as JSON: cheaper than opening the array)
        import json

        from zarr.core.buffer import default_buffer_prototype

        key = f"{z.store_path.path}/zarr.json".lstrip("/")
        buf = await z.store_path.store.get(key, prototype=default_buffer_prototype())
        doc = json.loads(buf.to_bytes()) if buf is not None else {}
        return {"shape": doc.get("shape"), "dtype": str(doc.get("data_type"))}

    async def create(name: str, arr: np.ndarray, meta):
        if meta is None:
            return await agrp.create_array(name, shape=arr.shape, dtype=arr.dtype, chunks=_chunks_for(arr),
                                           overwrite=True, config=_ARRAY_CONFIG, compressors=_compressors())
        # the metadata document Zarr would write, written as Zarr's own create does, less its
        # check-and-create of every parent group (the scan's group exists: its claim is held)
        from zarr.core.array import AsyncArray
        from zarr.core.buffer import default_buffer_prototype

        sp = agrp.store_path / name
        await sp.delete_dir()
        docs = meta.to_buffer_dict(default_buffer_prototype())
        await asyncio.gather(*((sp / key).set(buf) for key, buf in docs.items()))
        return AsyncArray(metadata=meta, store_path=sp, config=_ARRAY_CONFIG)

    metas = {name: _array_metadata(arr) for name, arr in arrays.items()}

    async def one(name: str, arr: np.ndarray):
        z = await create(name, arr, metas[name])
        if arr.size:
            await z.setitem(Ellipsis, arr)
        back = await stored_spec(z)
        if back != promised[name]:  # another dtype spelling, or a real difference: Zarr's own reading
            opened = await agrp.getitem(name)
            back = {"shape": list(opened.shape), "dtype": str(opened.dtype)}
        return back, z.nchunks, await stored_chunks(z)

    async def _all():
        return await asyncio.gather(*(one(n, a) for n, a in arrays.items()))

    found = (_spec_problem(name, spec, back["shape"], back["dtype"], nchunks, have)
             for (name, spec), (back, nchunks, have) in zip(promised.items(), sync(_all())))
    return [p for p in found if p]


#: every chunk is stored, even one equal to the fill value, so a missing chunk file is damage
_ARRAY_CONFIG = {"write_empty_chunks": True}
#: the scans' arrays' compression: Zstandard at level 1 (Zarr's default codec, at its default
#: level 3 before). One scene's SHOT rows (8,683 x 352 float32, 12.2 MB) compress to 17.9% of
#: their size in 14 ms at level 1 and to 18.3% in 30 ms at level 3 (2-core development
#: machine); every worker of an archive pass writes one such array a scene, so level 3 was
#: host CPU the pass competes for. Reading is the same codec at the same speed.
ZSTD_LEVEL = 1


def _compressors():
    from zarr.codecs import ZstdCodec

    # zstd's content checksum: a chunk altered on disk fails to decode instead of reading as
    # other numbers (no cost measured: 2M x 3 float32 written in 0.22 s, read in 0.03 s, either way)
    return (ZstdCodec(level=ZSTD_LEVEL, checksum=True),)


_TEMPLATES: dict[tuple[str, int], dict] = {}


def _array_metadata(arr: np.ndarray):
    """The Zarr v3 metadata :meth:`ScanStore._write_array` would create for ``arr`` (its chunks
    from :func:`_chunks_for`), built from a document Zarr made once per dtype and rank with its
    own defaults (codecs, fill value); None where this Zarr does not allow that (its own create
    is used then)."""
    try:
        import zarr
        from zarr.core.metadata.v3 import ArrayV3Metadata
        from zarr.storage import MemoryStore

        key = (arr.dtype.str, arr.ndim)
        if key not in _TEMPLATES:
            z = zarr.create_array(MemoryStore(), shape=(1,) * arr.ndim, dtype=arr.dtype, chunks=(1,) * arr.ndim,
                                  config=_ARRAY_CONFIG, compressors=_compressors())
            _TEMPLATES[key] = z.metadata.to_dict()
        doc = json.loads(json.dumps(_TEMPLATES[key]))
        doc["shape"] = list(arr.shape)
        doc["chunk_grid"]["configuration"]["chunk_shape"] = list(_chunks_for(arr))
        return ArrayV3Metadata.from_dict(doc)
    except Exception:  # noqa: BLE001 - another Zarr layout: its create_array
        return None

