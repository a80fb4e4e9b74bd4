"""LAS/LAZ and COPC reading shared by the whole-file readers (:mod:`scanforest.tasks.readers`)
and the block-wise path of large files: laspy records -> stored arrays (:func:`las_columns`, one
conversion for both), LAS/LAZ files of more than :data:`LAS_WHOLE_MAX_POINTS` points read through
laspy's chunk iterator (:func:`open_las_blocks`), COPC files (``*.copc.laz``) through their octree,
node by node, with an optional query (:func:`copc_settings`: a level or a resolution, and bounds;
:func:`copc_blocks`). Their points are laspy's, bit for bit (float64 scaled coordinates)."""
from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from scanforest.kernels.errors import ScanReadError

from .blocks import BlockScan


class EmptyQuery(ScanReadError):
    """A COPC query (its bounds) that selects no point of the file: the file is not bad, it lies
    outside the region asked for (ingest counts it ``outside``, it quarantines nothing)."""


def las_meta(path, header) -> dict[str, Any]:
    return {"encoding": "laz" if Path(path).suffix.lower() == ".laz" else "las",
            "las_version": str(header.version), "point_format": int(header.point_format.id),
            "scales": list(map(float, header.scales)), "offsets": list(map(float, header.offsets))}


def las_columns(record, dims: set[str]) -> dict[str, np.ndarray]:
    """The stored arrays of LAS/LAZ/COPC points (a laspy point record, whole or one block):
    ``points`` (float64 scaled coordinates), ``intensity``, ``rgb`` (the file's colour, turned into
    ``colors`` by :func:`las_colors`), ``extra_classification``. The one conversion of the
    whole-file and the block-wise reading: each value depends on its own point only."""
    out = {"points": np.stack([np.asarray(record.x), np.asarray(record.y), np.asarray(record.z)],
                              axis=1).astype(np.float64)}
    if "intensity" in dims:
        out["intensity"] = np.asarray(record.intensity, dtype=np.float32)
    if {"red", "green", "blue"} <= dims:
        out["rgb"] = np.stack([record.red, record.green, record.blue], axis=1)
    if "classification" in dims:
        out["extra_classification"] = np.asarray(record.classification, dtype=np.uint8)
    for name, key, dtype, _shape in extra_dims(record.point_format):
        out[key] = np.asarray(record[name]).astype(dtype, copy=False)
    return out


def check_las_size(path, header, size: int) -> None:
    """ScanReadError where an uncompressed LAS file ends before the points its header declares
    (laspy's message was "buffer size must be a multiple of element size")."""
    if getattr(header, "are_points_compressed", False):
        return  # LAZ: its chunk table and the decompressor say where it ends
    n, rec = int(header.point_count), int(header.point_format.size)
    need = int(header.offset_to_point_data) + n * rec
    if size < need:
        raise ScanReadError(path, f"truncated LAS file: its header declares {n:,} points of {rec} bytes from byte "
                                  f"{int(header.offset_to_point_data):,}, and the file ends {need - size:,} bytes "
                                  f"short ({max(size - int(header.offset_to_point_data), 0) // rec:,} whole points)")


def extra_dims(point_format) -> list[tuple[str, str, Any, tuple[int, ...]]]:
    """The file's extra-bytes dimensions (a scanner's reflectance, amplitude or deviation, a
    processing tool's own fields) as stored arrays: ``(laspy name, extra_<name>, dtype, shape
    per point)``, the name in lower case with other characters than letters, digits and ``_``
    as ``_``; scaled ones as float64 (laspy's scaled values), the others in their own type."""
    out, taken = [], {"extra_classification"}
    for d in point_format.extra_dimensions:
        key = "extra_" + re.sub(r"[^0-9a-z_]+", "_", str(d.name).strip().lower()).strip("_")
        if key == "extra_" or key in taken:
            continue
        taken.add(key)
        base = np.float64 if d.scales is not None else np.dtype(d.dtype).base
        out.append((d.name, key, base, () if int(d.num_elements) == 1 else (int(d.num_elements),)))
    return out


def las_colors(rgb: np.ndarray | None, shift: bool | None = None) -> np.ndarray | None:
    """8-bit colours from the file's 16-bit ones: their high byte where any value of the cloud is
    over 255, else the values as they are (the readers' rule for integer colour), or with
    ``shift`` given, that choice made for the whole cloud by the caller (a block does not see the
    others)."""
    if rgb is None:
        return None
    if shift is None:
        shift = bool(rgb.size) and int(rgb.max()) > 255
    return (rgb.astype(np.uint32) >> 8).astype(np.uint8) if shift else rgb.astype(np.uint8)


#: LAS/LAZ files of more points than this are read and stored block by block
#: (:func:`open_las_blocks`), never whole: 4M points are ~130 MB as laspy's record plus the float64
#: coordinates and attributes; below it the whole-file path (one write, fewer round trips) is
#: faster and holds little. Tests lower it.
LAS_WHOLE_MAX_POINTS = 4_000_000

#: points per block of the block-wise path: a multiple of the store's chunk rows (262,144), so
#: each block fills whole chunks
LAS_BLOCK_POINTS = 1 << 20


def copc_settings(level: int | None = None, resolution: float | None = None,
                  bounds: Any = None) -> dict[str, Any]:
    """The COPC query of an ingest, checked: ``level`` (the octree's levels 0 .. ``level``: a
    decimated cloud), or ``resolution`` (the levels that give this point spacing, laspy's rule),
    and ``bounds`` (``xmin, ymin, zmin, xmax, ymax, zmax``, a comma string or 6 numbers). All None:
    the full point cloud. Raises :class:`~scanforest.kernels.errors.InputError`."""
    from scanforest.kernels.errors import InputError

    if level is not None and resolution is not None:
        raise InputError("give a COPC level or a COPC resolution, not both")
    if level is not None and (int(level) != level or level < 0):
        raise InputError(f"COPC level must be a whole number >= 0, got {level}")
    if resolution is not None and not (np.isfinite(resolution) and resolution > 0):
        raise InputError(f"COPC resolution must be > 0, got {resolution}")
    if bounds is not None:
        try:
            b = [float(v) for v in (bounds.split(",") if isinstance(bounds, str) else bounds)]
        except (TypeError, ValueError) as exc:
            raise InputError(f"bounds must be 6 numbers xmin,ymin,zmin,xmax,ymax,zmax, got {bounds!r}") from exc
        if len(b) != 6 or not all(np.isfinite(b)) or any(b[i] > b[i + 3] for i in range(3)):
            raise InputError(f"bounds must be 6 finite numbers xmin,ymin,zmin,xmax,ymax,zmax with min <= max, "
                             f"got {bounds!r}")
        bounds = b
    return {"level": None if level is None else int(level),
            "resolution": None if resolution is None else float(resolution), "bounds": bounds}


def is_copc(path: str | os.PathLike) -> bool:
    """Whether the file is a COPC (``*.copc.laz``, read through its octree)."""
    return str(path).lower().endswith(".copc.laz")


def las_point_count(path: str | os.PathLike) -> int | None:
    """The point count a LAS/LAZ header declares, from its first 255 bytes (the 64-bit count of
    LAS 1.4 where set, else the legacy 32-bit one); None where the file is not LAS or unreadable.
    Ingest asks it of every LAS/LAZ file to choose the block-wise path: ~0.02 ms, where opening
    the file with laspy costs ~1.2 ms, more than reading and hashing a small file."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(255)
    except OSError:
        return None
    if len(head) < 111 or head[:4] != b"LASF":
        return None
    legacy = int.from_bytes(head[107:111], "little")
    if (head[24], head[25]) >= (1, 4) and len(head) >= 255:
        return int.from_bytes(head[247:255], "little") or legacy
    return legacy


def _finite_las(header) -> bool:
    """Whether every coordinate the header allows (int32 x scale + offset) is finite: then no point
    is dropped, as the block-wise path assumes."""
    s, o = np.asarray(header.scales, float), np.asarray(header.offsets, float)
    return bool(np.isfinite(s).all() and np.isfinite(o).all() and (np.abs(s) * 2.0**31 + np.abs(o) < 1e300).all())


def _las_column_specs(point_format) -> dict[str, tuple[Any, tuple[int, ...]]]:
    dims = set(point_format.dimension_names)
    cols: dict[str, tuple[Any, tuple[int, ...]]] = {"points": (np.float64, (3,))}
    if "intensity" in dims:
        cols["intensity"] = (np.float32, ())
    if {"red", "green", "blue"} <= dims:
        cols["colors"] = (np.uint8, (3,))
    if "classification" in dims:
        cols["extra_classification"] = (np.uint8, ())
    for _name, key, dtype, shape in extra_dims(point_format):
        cols[key] = (dtype, shape)
    return cols


def _las_blocks(path, scan: BlockScan, records, dims: set[str], crop=None):
    """Blocks of stored arrays from laspy point records (:func:`las_columns` each). Colours:
    :func:`las_colors` decides for the whole cloud (the high byte where any value is over 255):
    blocks are written as they are until a value over 255 comes, and then the rows written
    before, all at most 255, get their high byte, 0, as a correction. ``crop``: a function of a
    record that keeps some of its points (COPC bounds); non-finite points are dropped there."""
    fmt = scan.meta.get("format", "las").upper()
    shift, row, seen = False, 0, 0
    lo = np.full(3, np.inf)
    hi = np.full(3, -np.inf)
    try:
        for rec in records:
            seen += len(rec)
            if crop is not None:
                rec = crop(rec)
            cols = las_columns(rec, dims)
            if crop is not None:
                finite = np.isfinite(cols["points"]).all(axis=1)
                if not finite.all():
                    cols = {k: v[finite] for k, v in cols.items()}
            rgb = cols.pop("rgb", None)
            if rgb is not None:
                if not shift and len(rgb) and int(rgb.max()) > 255:
                    shift = True
                    for start in range(0, row, LAS_BLOCK_POINTS):
                        yield start, {"colors": np.zeros((min(row - start, LAS_BLOCK_POINTS), 3), np.uint8)}
                cols["colors"] = las_colors(rgb, shift)
            m = len(cols["points"])
            if m:
                lo = np.minimum(lo, cols["points"].min(0))
                hi = np.maximum(hi, cols["points"].max(0))
                yield cols
            row += m
    except (ScanReadError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - library errors: one line naming the file
        raise ScanReadError(path, f"corrupt or unreadable {fmt} file: {type(exc).__name__}: {exc}") from exc
    if scan.exact and seen != scan.n_points:
        raise ScanReadError(path, f"LAS header declares {scan.n_points} points, data has {seen}")
    if row == 0:
        if crop is not None:
            raise EmptyQuery(path, "no point inside the COPC query's bounds")
        raise ScanReadError(path, "zero-point cloud (the file declares no points)")
    scan.n_kept, scan.bbox = row, (lo.tolist(), hi.tolist())


def _copc_open(path, data: bytes | None = None):
    try:
        import laspy

        return laspy.CopcReader.open(io.BytesIO(data) if data is not None else str(path))
    except ImportError as exc:
        raise ScanReadError(path, "COPC needs laspy with lazrs: pip install 'laspy[lazrs]'") from exc
    except FileNotFoundError as exc:
        raise ScanReadError(path, f"cannot read file: {exc.strerror or exc}") from exc
    except Exception as exc:  # noqa: BLE001
        raise ScanReadError(path, f"corrupt or unreadable COPC file: {type(exc).__name__}: {exc}") from exc


def _copc_nodes(reader, settings: dict[str, Any]):
    """The octree nodes of the query and its bounds (laspy's :meth:`CopcReader.query`: levels
    from a resolution by its rule; ``level`` here is the levels 0 .. level)."""
    from math import ceil, log2

    from laspy.copc import Bounds, load_octree_for_query

    levels = None
    if settings.get("resolution") is not None:
        top = max(1, ceil(log2(reader.copc_info.spacing / settings["resolution"])) + 1)
        levels = range(0, top)
    elif settings.get("level") is not None:
        levels = range(0, settings["level"] + 1)
    bounds = None
    if settings.get("bounds") is not None:
        b = np.asarray(settings["bounds"], float)
        bounds = Bounds(mins=b[:3], maxs=b[3:]).ensure_3d(reader.header.mins, reader.header.maxs)
    nodes = load_octree_for_query(reader.source, reader.copc_info, reader.root_page,
                                  query_bounds=bounds, level_range=levels)
    return sorted(nodes, key=lambda node: node.offset), bounds


def _copc_crop(reader, bounds):
    """laspy's crop of a query's points to its bounds (on the integer coordinates)."""
    if bounds is None:
        return lambda rec: rec
    h = reader.header
    lo = np.round((bounds.mins - h.offsets) / h.scales).astype(np.int32)
    hi = np.round((bounds.maxs - h.offsets) / h.scales).astype(np.int32)

    def crop(rec):
        keep = ((lo[0] <= rec.X) & (rec.X <= hi[0]) & (lo[1] <= rec.Y) & (rec.Y <= hi[1])
                & (lo[2] <= rec.Z) & (rec.Z <= hi[2]))
        return rec[np.asarray(keep)]

    return crop


def copc_blocks(path, settings: dict[str, Any], block: int | None = None, data: bytes | None = None) -> BlockScan:
    """A COPC file's query (``settings``) read node by node, the nodes in file order grouped into
    blocks of at most ``block`` points (a bigger node is a block of its own): the points of
    :meth:`laspy.CopcReader.query`, in its order, never all in memory."""
    block = int(block or LAS_BLOCK_POINTS)
    reader = _copc_open(path, data)
    try:
        nodes, bounds = _copc_nodes(reader, settings)
    except Exception as exc:  # noqa: BLE001
        reader.source.close()
        raise ScanReadError(path, f"corrupt or unreadable COPC file: {type(exc).__name__}: {exc}") from exc
    total = sum(int(nd.point_count) for nd in nodes)
    if total == 0:
        reader.source.close()
        if settings.get("bounds") is not None:
            raise EmptyQuery(path, "no point inside the COPC query's bounds")
        raise ScanReadError(path, "zero-point cloud (the COPC query selects no point)")
    header = reader.header
    dims = set(header.point_format.dimension_names)
    meta = {"format": "copc", **las_meta(path, header), "encoding": "copc",
            "n_source_points": int(header.point_count), "copc": settings}
    scan = BlockScan(total, _las_column_specs(header.point_format), meta, exact=False)

    def records():
        with reader:
            group: list = []
            size = 0
            for nd in nodes + [None]:
                if group and (nd is None or size + int(nd.point_count) > block):
                    yield reader._fetch_and_decompress_points_of_nodes(group)
                    group, size = [], 0
                if nd is not None:
                    group.append(nd)
                    size += int(nd.point_count)

    scan.blocks = _las_blocks(path, scan, records(), dims, crop=_copc_crop(reader, bounds))
    return scan


def open_las_blocks(path: str | os.PathLike, block_points: int | None = None) -> BlockScan | None:
    """A LAS/LAZ file of more than :data:`LAS_WHOLE_MAX_POINTS` points opened to be read in blocks
    of ``block_points`` (default :data:`LAS_BLOCK_POINTS`) through laspy's chunk iterator; None
    for any other file, or one whose header cannot promise finite coordinates (read whole)."""
    block = int(block_points or LAS_BLOCK_POINTS)
    fmt = _las_format(path)
    if fmt is None:
        return None
    import laspy

    try:
        reader = laspy.open(str(path))
    except Exception:  # noqa: BLE001 - read whole: the whole-file reader names the problem as it always did
        return None
    header = reader.header
    n = int(header.point_count)
    if n <= LAS_WHOLE_MAX_POINTS or not _finite_las(header):
        reader.close()
        return None
    try:
        check_las_size(path, header, os.path.getsize(path))
    except ScanReadError:
        reader.close()
        raise
    dims = set(header.point_format.dimension_names)
    scan = BlockScan(n, _las_column_specs(header.point_format), {"format": fmt, **las_meta(path, header),
                                                  "n_source_points": n})

    def records():
        with reader:
            yield from reader.chunk_iterator(block)

    scan.blocks = _las_blocks(path, scan, records(), dims)
    return scan


def _las_format(path) -> str | None:
    """``las`` or ``laz`` from the file name (a COPC file is neither here), else None."""
    name = str(path).lower()
    if is_copc(name):
        return None
    return "las" if name.endswith(".las") else "laz" if name.endswith(".laz") else None
