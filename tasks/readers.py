"""Readers for scan files: PCD (ascii, binary, binary_compressed), PLY, LAS/LAZ, COPC, XYZ/CSV text, NPY, E57.

Every reader returns a :class:`PointCloud` with finite ``points`` only: organised clouds (PCD with
HEIGHT > 1) lose their NaN holes and keep ``pixel_index`` (row-major index into WIDTH x HEIGHT) so
the image structure can be recovered. Normals, colour and intensity are kept when the file has them.
Coordinates keep the file's float type (float32 PCD stays float32, LAS stays float64), so a round
trip file -> store -> array is exact.

An E57 file holds several scans (:func:`scan_parts` lists them, ``read_cloud(..., part=)`` reads
one, each in its own frame with its pose in ``meta``); it is read with the optional ``pye57``.

Large files are read in blocks (:func:`open_blocks`, a :class:`BlockScan` that ingest writes block
by block): LAS/LAZ files of more than :data:`~.las.LAS_WHOLE_MAX_POINTS` points through laspy's
chunk iterator, COPC files (``*.copc.laz``) through their octree, node by node, with an optional
query (:func:`~.las.copc_settings`), both in :mod:`.las`, and E57 scans. The points are those the
whole-file reading gives, bit for bit.

Any problem becomes a :class:`~scanforest.kernels.errors.ScanReadError` naming the file and the
reason (truncated data, header/data mismatch, empty file, zero points, all NaN, unknown format).
"""
from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from scanforest.kernels.errors import ScanReadError

from .blocks import BlockScan, gather_blocks
from .cloud import PointCloud, to_uint8
from .text import read_xyz
from .las import (check_las_size, copc_blocks, copc_settings, is_copc, las_colors, las_columns, las_meta,
                  open_las_blocks)

#: the format libraries, imported where a format is read (a missing optional one fails only its
#: format); ingest's Dask workers import them as they start (``flows.worker_setup.INGEST_PRELOAD``)
FORMAT_LIBRARIES = ("pypcd4", "plyfile", "laspy")

#: file suffix -> format name
FORMATS = {
    ".pcd": "pcd",
    ".ply": "ply",
    ".las": "las",
    ".laz": "laz",
    ".xyz": "xyz",
    ".txt": "xyz",
    ".csv": "csv",
    ".pts": "xyz",
    ".npy": "npy",
    ".e57": "e57",
}

#: formats whose file holds several scans, each a store scan of its own (:func:`scan_parts`)
MULTI_SCAN_FORMATS = frozenset({"e57"})

#: the one-line reason an E57 file is quarantined with where the optional pye57 is missing
E57_NEEDS_PYE57 = "E57 needs pye57: pip install 'scanforest[e57]'"

#: points per block read from an E57 scan: a scan is read block by block into its arrays, never
#: whole into the library's buffers
E57_BLOCK_ROWS = 1 << 18


def detect_format(path: str | os.PathLike) -> str:
    """Format name from the file name (``.pcd``, ``.ply``, ``.las``/``.laz``, ``.copc.laz``,
    ``.xyz``/``.txt``/``.csv``, ``.npy``, ``.e57``)."""
    if is_copc(path):
        return "copc"
    suffix = Path(path).suffix.lower()
    fmt = FORMATS.get(suffix)
    if fmt is None:
        raise ScanReadError(path, f"unknown format {suffix or '(no extension)'!r}; "
                                  f"supported: {', '.join(sorted(FORMATS))}")
    return fmt


def scan_parts(path: str | os.PathLike, *, format: str | None = None) -> list[str]:
    """The scans a file holds, each by the part name that :func:`read_cloud` takes: ``[""]`` (the
    file is one scan) for every format but E57, whose scans are ``scan000``, ``scan001``, ... in the
    file's order (only the file's header is read).

    Raises
    ------
    ScanReadError
        The E57 file is missing, empty, truncated or corrupt, holds no scan, or pye57 is missing.
    """
    fmt = format or detect_format(path)
    if fmt not in MULTI_SCAN_FORMATS:
        return [""]
    with _OpenedE57(path) as e57:
        n = _e57_count(path, e57)
    return [_e57_part(i) for i in range(n)]


def read_cloud(path: str | os.PathLike, data: bytes | None = None, *, format: str | None = None,
               part: str | None = None) -> PointCloud:
    """Read one scan file (or one scan of an E57 file).

    Parameters
    ----------
    path : path-like
        The file; its suffix picks the reader unless ``format`` is given.
    data : bytes, optional
        The file's bytes when they are already in memory (archive members); ``path`` then only
        names the file in errors and picks the format.
    format : str, optional
        Force a reader: ``pcd``, ``ply``, ``las``, ``laz``, ``copc``, ``xyz``, ``csv``, ``npy`` or ``e57``.
    part : str, optional
        The scan of a file of several (:func:`scan_parts`: ``scan001``); default: the file's only scan.

    Raises
    ------
    ScanReadError
        The file is missing, empty, truncated, inconsistent, unknown, or has no finite point.
    """
    if not isinstance(path, (str, os.PathLike)):
        from scanforest.kernels.errors import InputError

        raise InputError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    fmt = format or detect_format(path)
    if fmt in MULTI_SCAN_FORMATS:  # read from the file, block by block, never as bytes in memory
        try:
            return _finalise(path, _read_e57(path, data, part))
        except MemoryError as exc:
            raise ScanReadError(path, "out of memory while reading") from exc
    if part:
        raise ScanReadError(path, f"a {fmt.upper()} file is one scan: it has no part {part!r}")
    if data is None:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ScanReadError(path, f"cannot read file: {exc.strerror or exc}") from exc
    if len(data) == 0:
        raise ScanReadError(path, "empty file (0 bytes)")
    reader = _READERS.get(fmt)
    if reader is None:
        raise ScanReadError(path, f"unknown format {fmt!r}")
    try:
        cloud = reader(path, data)
    except ScanReadError:
        raise
    except MemoryError as exc:
        raise ScanReadError(path, "out of memory while reading") from exc
    except Exception as exc:  # library errors become one clear message naming the file
        raise ScanReadError(path, f"corrupt or unreadable {fmt.upper()} file: {type(exc).__name__}: {exc}") from exc
    cloud.meta.setdefault("format", fmt)
    return _finalise(path, cloud)


# ----------------------------------------------------------------------------------------------
# helpers


def _finalise(path, cloud: PointCloud) -> PointCloud:
    pts = cloud.points
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise ScanReadError(path, f"points must be (N, 3), got shape {pts.shape}")
    n_source = int(pts.shape[0])
    cloud.meta.setdefault("n_source_points", n_source)
    if n_source == 0:
        raise ScanReadError(path, "zero-point cloud (the file declares no points)")
    finite = np.isfinite(pts).all(axis=1)
    n_finite = int(finite.sum())
    if n_finite == 0:
        raise ScanReadError(path, f"no finite point: all {n_source} points are NaN or infinite")
    if n_finite < n_source:
        keep = np.flatnonzero(finite)
        cloud.points = pts[keep]
        for name in ("normals", "colors", "intensity", "pixel_index"):
            value = getattr(cloud, name)
            if value is not None:
                setattr(cloud, name, value[keep])
        cloud.extra = {k: v[keep] for k, v in cloud.extra.items()}
        if cloud.pixel_index is None:
            cloud.pixel_index = keep.astype(np.int64)
    cloud.points = np.ascontiguousarray(cloud.points)
    if cloud.points.dtype not in (np.float32, np.float64):
        cloud.points = cloud.points.astype(np.float64)
    return cloud


def _rgb_from_packed(values: np.ndarray) -> np.ndarray:
    """PCL packs rgb/rgba as one 32-bit word (0xAARRGGBB), stored as float or uint32."""
    u = np.ascontiguousarray(values).view(np.uint32) if values.dtype.itemsize == 4 else values.astype(np.uint32)
    return np.stack([(u >> 16) & 255, (u >> 8) & 255, u & 255], axis=1).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# PCD

_PCD_HEADER_KEYS = ("VERSION", "FIELDS", "SIZE", "TYPE", "COUNT", "WIDTH", "HEIGHT", "VIEWPOINT", "POINTS", "DATA")


def _read_pcd(path, data: bytes) -> PointCloud:
    import pypcd4

    header, body_offset = _split_pcd_header(path, data)
    version = header.get("VERSION", "0.7")
    encoding = header.get("DATA", "").lower()
    if encoding not in ("ascii", "binary", "binary_compressed"):
        raise ScanReadError(path, f"PCD header: unknown DATA encoding {encoding!r}")
    # pypcd4 accepts only VERSION 0.7; PCL itself reads 0.5/0.6 files the same way.
    lines = data[:body_offset].decode("ascii", "replace").splitlines(keepends=True)
    if version not in (".7", "0.7"):
        lines = [re.sub(r"^VERSION\s+\S+", "VERSION 0.7", ln) for ln in lines]
    if "VIEWPOINT" not in header:
        lines.insert(next(i for i, ln in enumerate(lines) if ln.startswith("POINTS")),
                     "VIEWPOINT 0 0 0 1 0 0 0\n")
    header_fields = header.get("FIELDS", "").split()
    counts = [int(c) for c in header["COUNT"].split()] if "COUNT" in header else [1] * len(header_fields)
    if "COUNT" not in header:  # optional (PCL reads one value a field): pypcd4 requires it
        lines.insert(next(i for i, ln in enumerate(lines) if ln.startswith("WIDTH")),
                     "COUNT " + " ".join("1" for _ in header_fields) + "\n")
    width = int(header.get("WIDTH", "0"))
    height = int(header.get("HEIGHT", "1"))
    npoints = int(header.get("POINTS", width * height))
    if width * height != npoints:
        raise ScanReadError(path, f"PCD header mismatch: WIDTH*HEIGHT = {width}*{height} != POINTS {npoints}")
    body = data[body_offset:]
    _check_pcd_body(path, header, encoding, npoints, body)
    pc = pypcd4.PointCloud.from_fileobj(io.BytesIO("".join(lines).encode("ascii") + body))
    fields = list(pc.fields)
    if npoints == 0:
        return PointCloud(np.zeros((0, 3), np.float32), meta={"encoding": encoding})
    arr = pc.pc_data
    if len(arr) != npoints:
        raise ScanReadError(path, f"PCD data has {len(arr)} points but the header declares {npoints}")
    for name in ("x", "y", "z"):
        if name not in fields:
            raise ScanReadError(path, f"PCD has no {name!r} field (fields: {' '.join(fields)})")
    dtype = np.result_type(arr["x"].dtype, np.float32)
    points = np.stack([arr["x"], arr["y"], arr["z"]], axis=1).astype(dtype, copy=False)
    cloud = PointCloud(points)
    if all(f in fields for f in ("normal_x", "normal_y", "normal_z")):
        cloud.normals = np.stack([arr["normal_x"], arr["normal_y"], arr["normal_z"]], axis=1).astype(np.float32)
    for cname in ("rgb", "rgba"):
        if cname in fields:
            cloud.colors = _rgb_from_packed(arr[cname])
            break
    if "intensity" in fields:
        cloud.intensity = arr["intensity"].astype(np.float32)
    used = {"x", "y", "z", "normal_x", "normal_y", "normal_z", "rgb", "rgba", "intensity"}
    # the header's fields over pypcd4's columns: a field of COUNT c is c columns (FPFH's 33), kept
    # as one (N, c) array; padding fields ("_", pypcd4 renames them at random) are not kept
    at = 0
    for f, c in zip(header_fields, counts) if len(counts) == len(header_fields) else ():
        names, at = fields[at:at + c], at + c
        if f in used or f.startswith("_") or len(names) != c:
            continue
        cloud.extra[f] = np.asarray(arr[names[0]]) if c == 1 else np.stack([arr[n] for n in names], axis=1)
    if height > 1:
        cloud.pixel_index = np.arange(npoints, dtype=np.int64)
    vp = [float(v) for v in header.get("VIEWPOINT", "0 0 0 1 0 0 0").split()]
    cloud.meta.update(encoding=encoding, width=width, height=height, viewpoint=vp,
                      pcd_version=version, fields=fields, organized=height > 1)
    return cloud


def _split_pcd_header(path, data: bytes) -> tuple[dict[str, str], int]:
    header: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:
            end = len(data)
        raw = data[pos:end].decode("ascii", "replace").strip()
        pos = end + 1
        if not raw or raw.startswith("#"):
            continue
        key, _, value = raw.partition(" ")
        key = key.upper()
        if key not in _PCD_HEADER_KEYS:
            raise ScanReadError(path, f"not a PCD file: unexpected header line {raw[:60]!r}")
        header[key] = value.strip()
        if key == "DATA":
            return header, pos
    raise ScanReadError(path, "PCD header has no DATA line (truncated or not a PCD file)")


def _check_pcd_body(path, header: dict[str, str], encoding: str, npoints: int, body: bytes) -> None:
    """Size checks pypcd4 does not do, so truncation is reported as such."""
    try:
        sizes = [int(s) for s in header["SIZE"].split()]
        counts = [int(c) for c in header.get("COUNT", " ".join("1" * len(sizes))).split()]
        fields = header["FIELDS"].split()
    except (KeyError, ValueError) as exc:
        raise ScanReadError(path, f"PCD header is incomplete or malformed ({exc})") from exc
    if not (len(sizes) == len(counts) == len(fields)):
        raise ScanReadError(path, f"PCD header mismatch: {len(fields)} FIELDS, {len(sizes)} SIZE, {len(counts)} COUNT")
    record = sum(s * c for s, c in zip(sizes, counts))
    if encoding == "binary":
        need = record * npoints
        if len(body) < need:
            raise ScanReadError(path, f"truncated binary PCD: {len(body)} data bytes, header needs {need}")
    elif encoding == "binary_compressed":
        if npoints == 0:
            return
        if len(body) < 8:
            raise ScanReadError(path, "truncated binary_compressed PCD: missing the size words")
        compressed, uncompressed = np.frombuffer(body[:8], dtype="<u4")
        if uncompressed != record * npoints:
            raise ScanReadError(path, f"PCD header/data mismatch: decompressed size {uncompressed} "
                                      f"!= {record} bytes x {npoints} points")
        if len(body) - 8 < compressed:
            raise ScanReadError(path, f"truncated binary_compressed PCD: {len(body) - 8} of {compressed} "
                                      "compressed bytes present")
    else:  # ascii
        lines = [ln for ln in body.splitlines() if ln.strip()]
        if len(lines) != npoints:
            raise ScanReadError(path, f"PCD header/data mismatch: {len(lines)} ascii rows, POINTS says {npoints}")


# ----------------------------------------------------------------------------------------------
# PLY


def _read_ply(path, data: bytes) -> PointCloud:
    from plyfile import PlyData

    ply = PlyData.read(io.BytesIO(data))
    if "vertex" not in ply:
        raise ScanReadError(path, "PLY file has no 'vertex' element")
    cloud = _from_records(path, ply["vertex"].data, "PLY vertex", "property")
    cloud.meta.update(encoding="ascii" if ply.text else ("binary_" + ply.byte_order.replace("<", "little_endian")
                                                         .replace(">", "big_endian").replace("=", "native")))
    return cloud


def _from_records(path, rec, what: str, member: str) -> PointCloud:
    """A cloud from a record array (a PLY vertex element, a structured NPY): x/y/z, normals
    (nx/ny/nz), colours (red/green/blue or r/g/b), intensity, and every other numeric field of
    one value a point as ``extra_<name>`` (a PLY's alpha, quality or label, a structured NPY's
    time or class: dropped before). The known names are matched in any case (``X Y Z``).
    ``what``/``member`` name them in errors."""
    names = rec.dtype.names or ()
    by_lower: dict[str, str] = {}
    for n in names:
        by_lower.setdefault(n.lower(), n)

    def col(*want):  # the fields of these names (any case), or None where one is missing
        got = [by_lower.get(w) for w in want]
        return None if None in got else got

    xyz = col("x", "y", "z")
    if xyz is None:
        missing = next(w for w in ("x", "y", "z") if w not in by_lower)
        raise ScanReadError(path, f"{what} has no {missing!r} {member} (has: {' '.join(names)})")
    dtype = np.result_type(rec[xyz[0]].dtype, np.float32)
    cloud = PointCloud(np.stack([rec[n] for n in xyz], axis=1).astype(dtype, copy=False))
    used = set(xyz)
    if (nrm := col("nx", "ny", "nz")) is not None:
        cloud.normals = np.stack([rec[n] for n in nrm], axis=1).astype(np.float32)
        used |= set(nrm)
    for trio in (("red", "green", "blue"), ("r", "g", "b")):
        if (rgb := col(*trio)) is not None:
            cloud.colors = to_uint8(np.stack([rec[n] for n in rgb], axis=1))
            used |= set(rgb)
            break
    for iname in ("intensity", "scalar_intensity"):
        if (i := col(iname)) is not None:
            cloud.intensity = np.asarray(rec[i[0]], dtype=np.float32)
            used.add(i[0])
            break
    for name in names:  # the other per-point numbers, by name (a list property or a text field is not one)
        c = rec[name]
        if (name not in used and re.fullmatch(r"[A-Za-z0-9_]+", name) and c.ndim == 1
                and (np.issubdtype(c.dtype, np.number) or c.dtype == np.bool_)):
            cloud.extra[name] = np.asarray(c)
    return cloud


# ----------------------------------------------------------------------------------------------
# LAS / LAZ


def _read_las(path, data: bytes) -> PointCloud:
    import laspy

    try:
        las = laspy.read(io.BytesIO(data))
    except Exception:  # a file cut short is said as such; the header is read again only then
        with laspy.open(io.BytesIO(data)) as head:
            check_las_size(path, head.header, len(data))
        raise
    cols = las_columns(las.points, set(las.point_format.dimension_names))
    cloud = PointCloud(cols["points"], intensity=cols.get("intensity"), colors=las_colors(cols.get("rgb")))
    cloud.extra.update({k[6:]: v for k, v in cols.items() if k.startswith("extra_")})
    if las.header.point_count != len(cloud.points):
        raise ScanReadError(path, f"LAS header declares {las.header.point_count} points, data has {len(cloud.points)}")
    cloud.meta.update(las_meta(path, las.header))
    return cloud


def open_blocks(path: str | os.PathLike, *, copc: dict[str, Any] | None = None,
                block_points: int | None = None, part: str | None = None) -> BlockScan | None:
    """A LAS/LAZ file of more than :data:`~.las.LAS_WHOLE_MAX_POINTS` points, any COPC file
    (:func:`~.las.is_copc`, queried with ``copc``: :func:`~.las.copc_settings`), or scan ``part`` of
    an E57 file, opened to be read in blocks (LAS, COPC: of ``block_points``, default
    :data:`~.las.LAS_BLOCK_POINTS`;
    E57: of :data:`E57_BLOCK_ROWS`); None for any other file (read whole by :func:`read_cloud`),
    a LAS file whose header cannot promise finite coordinates included. The points and
    attributes are those :func:`read_cloud` gives, bit for bit.

    Raises
    ------
    ScanReadError
        The file cannot be opened, its header is corrupt, or its query selects no point.
    """
    if detect_format(path) == "e57":
        return _e57_block_scan(path, part)
    if is_copc(path):
        return copc_blocks(path, copc_settings(**(copc or {})), block_points)
    return open_las_blocks(path, block_points)


def _read_copc(path, data: bytes) -> PointCloud:
    """A whole COPC file (its full point cloud, as :meth:`laspy.CopcReader.query` gives it)."""
    scan = copc_blocks(path, copc_settings(), None, data)
    cols = gather_blocks(scan)
    cloud = PointCloud(cols["points"], intensity=cols.get("intensity"), colors=cols.get("colors"))
    cloud.extra.update({k[6:]: v for k, v in cols.items() if k.startswith("extra_")})
    cloud.meta.update(scan.meta)
    return cloud


# ----------------------------------------------------------------------------------------------
# NPY


def _read_npy(path, data: bytes) -> PointCloud:
    arr = np.load(io.BytesIO(data), allow_pickle=False)
    if arr.dtype.names:
        if arr.ndim != 1:
            raise ScanReadError(path, f"structured NPY must be one record a point, got shape {arr.shape}")
        return _from_records(path, arr, "structured NPY", "field")
    if arr.ndim != 2 or arr.shape[1] < 3:
        raise ScanReadError(path, f"NPY array must be (N, 3) or (N, >=3), got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.number) or np.issubdtype(arr.dtype, np.complexfloating):
        raise ScanReadError(path, f"NPY array has non-real dtype {arr.dtype} (points are real numbers)")
    pts = arr[:, :3]
    if pts.dtype not in (np.float32, np.float64):
        pts = pts.astype(np.float64)
    cloud = PointCloud(pts)
    if arr.shape[1] >= 6:
        cloud.normals = arr[:, 3:6].astype(np.float32)
    for i in range(6 if arr.shape[1] >= 6 else 3, arr.shape[1]):  # the other columns kept, by place
        cloud.extra[f"c{i}"] = arr[:, i]
    return cloud


# ----------------------------------------------------------------------------------------------
# E57 (ASTM E2807), through pye57's libE57 bindings

_E57_XYZ = ("cartesianX", "cartesianY", "cartesianZ")
_E57_RAE = ("sphericalRange", "sphericalAzimuth", "sphericalElevation")
_E57_RGB = ("colorRed", "colorGreen", "colorBlue")


def _e57_part(index: int) -> str:
    return f"scan{index:03d}"


class _OpenedE57:
    """An E57 file opened for reading (``with``); every failure a one-line ScanReadError."""

    def __init__(self, path, data: bytes | None = None):
        self.path, self.data, self.tmp, self.e57 = path, data, None, None

    def __enter__(self):
        try:
            import pye57
        except ImportError as exc:
            raise ScanReadError(self.path, E57_NEEDS_PYE57) from exc
        where = str(self.path)
        if self.data is not None:  # bytes given (libE57 reads files only): through a temporary file
            import tempfile

            fd, self.tmp = tempfile.mkstemp(suffix=".e57")
            with os.fdopen(fd, "wb") as fh:
                fh.write(self.data)
            where = self.tmp
        try:
            if os.path.getsize(where) == 0:
                raise ScanReadError(self.path, "empty file (0 bytes)")
            self.e57 = pye57.E57(where)
        except ScanReadError:
            self._cleanup()
            raise
        except OSError as exc:
            self._cleanup()
            raise ScanReadError(self.path, f"cannot read file: {exc.strerror or exc}") from exc
        except Exception as exc:
            self._cleanup()
            raise ScanReadError(self.path, _e57_reason(exc)) from exc
        return self.e57

    def __exit__(self, *exc) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        if self.e57 is not None:
            try:
                self.e57.close()
            except Exception:  # closing a file libE57 found damaged
                pass
            self.e57 = None
        if self.tmp:
            os.unlink(self.tmp)
            self.tmp = None


def _e57_reason(exc: BaseException, what: str = "corrupt or truncated E57 file") -> str:
    """One line for a libE57 error (its messages span lines: the error, then debug context)."""
    text = " ".join(str(exc).split())
    sizes = re.search(r"filePhysicalLength=(\d+) file->length=(\d+)", text)
    if "ErrorBadFileLength" in text and sizes and int(sizes[2]) < int(sizes[1]):
        return f"truncated E57 file: {sizes[2]} of its {sizes[1]} bytes present"
    text = text.split(" **** ")[0].strip()
    return f"{what}: {type(exc).__name__}: {text[:200]}" if text else f"{what}: {type(exc).__name__}"


def _e57_count(path, e57) -> int:
    n = int(e57.scan_count)
    if n == 0:
        raise ScanReadError(path, "E57 file holds no scan (its data3D list is empty)")
    return n


def _read_e57(path, data: bytes | None, part: str | None) -> PointCloud:
    with _OpenedE57(path, data) as e57:
        n = _e57_count(path, e57)
        index = _e57_index(path, n, part)
        try:
            cloud = _read_e57_scan(path, e57, index, n)
        except (ScanReadError, MemoryError):
            raise
        except Exception as exc:
            raise ScanReadError(path, _e57_reason(exc, f"E57 scan {index} is corrupt or truncated")) from exc
    return cloud


def _e57_pose(node) -> tuple[np.ndarray, bool]:
    """The scan's pose (rotation quaternion w, x, y, z + translation) as a 4x4 float64 matrix that
    maps its points into the file's common frame; identity (and False) where the scan has none."""
    pose = np.eye(4)
    if not node.isDefined("pose"):
        return pose, False
    p = node["pose"]
    if p.isDefined("rotation"):
        r = p["rotation"]
        w, x, y, z = (float(r[k].value()) for k in ("w", "x", "y", "z"))
        norm = np.sqrt(w * w + x * x + y * y + z * z)
        if not norm > 0:
            raise ValueError(f"pose rotation is not a rotation quaternion ({w}, {x}, {y}, {z})")
        w, x, y, z = w / norm, x / norm, y / norm, z / norm
        pose[:3, :3] = [[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]]
    if p.isDefined("translation"):
        t = p["translation"]
        pose[:3, 3] = [float(t[k].value()) for k in ("x", "y", "z")]
    return pose, True


def _e57_string(node, name: str) -> str | None:
    try:
        return str(node[name].value()) if node.isDefined(name) else None
    except Exception:  # not a string node
        return None


class _E57Scan:
    """Scan ``index`` of an open E57 file, set up to be read block by block (:meth:`blocks`): its
    fields, point count, coordinate type and ``meta`` (pose, names, CRS, grid), read from its header."""

    def __init__(self, path, e57, index: int, count: int):
        from pye57 import libe57
        from pye57.utils import get_node

        self.path, self.e57, self.index = path, e57, index
        node = e57.data3d[index]  # typed nodes: a StructureNode, its points a CompressedVectorNode
        self.points_node = node["points"]
        proto = libe57.StructureNode(self.points_node.prototype())
        fields = {proto.get(i).elementName() for i in range(proto.childCount())}
        self.n = n = int(self.points_node.childCount())
        if set(_E57_XYZ) <= fields:
            self.coords, self.state, self.spherical = _E57_XYZ, "cartesianInvalidState", False
            nodes = [get_node(proto, f) for f in self.coords]
            single = all(isinstance(c, libe57.FloatNode) and c.precision() == libe57.E57_SINGLE for c in nodes)
        elif set(_E57_RAE) <= fields:
            self.coords, self.state, self.spherical, single = _E57_RAE, "sphericalInvalidState", True, False
        else:
            raise ScanReadError(path, f"E57 scan {index} has neither cartesian nor spherical coordinates "
                                      f"(fields: {' '.join(sorted(fields))})")
        # single-precision coordinates stay float32 (exact); double, scaled-integer and spherical are float64
        self.dtype = np.float32 if single else np.float64
        want: dict[str, Any] = {f: np.float64 for f in self.coords}
        self.has_intensity = "intensity" in fields
        self.has_rgb = set(_E57_RGB) <= fields
        self.has_grid = {"rowIndex", "columnIndex"} <= fields
        if self.has_intensity:
            want["intensity"] = np.float64
        if self.has_rgb:
            want.update({f: np.float64 for f in _E57_RGB})
        # integer buffers as C long long: pye57's binding takes numpy's int64 (format "l" on Linux) for 32 bits
        if self.has_grid:
            want.update(rowIndex=np.longlong, columnIndex=np.longlong)
        if self.state in fields:
            want[self.state] = np.longlong
        self.want = want
        if self.has_grid:
            self.grid = _e57_grid(node, proto)
            rmin, rmax, cmin, cmax = self.grid
            self.width, self.height = cmax - cmin + 1, rmax - rmin + 1
        if self.has_rgb:
            self.rgb_max = [float(get_node(proto, f).maximum()) for f in _E57_RGB]
        pose, has_pose = _e57_pose(node)
        record = {"scan_index": index, "scan_count": count, "name": _e57_string(node, "name"),
                  "guid": _e57_string(node, "guid"), "file_guid": _e57_string(e57.root, "guid"),
                  "coordinates": "spherical" if self.spherical else "cartesian", "has_pose": has_pose}
        self.meta: dict[str, Any] = {
            "format": "e57", "encoding": "e57", "n_source_points": n, "e57": record, "pose": pose.tolist(),
            "pose_maps": "points (the scan's own frame) -> the E57 file's common frame: p' = R p + t"}
        crs = _e57_string(e57.root, "coordinateMetadata")
        if crs:
            self.meta["crs"] = crs
        if self.has_grid:
            self.meta.update(width=int(self.width), height=int(self.height), organized=True)

    def columns(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        cols: dict[str, tuple[Any, tuple[int, ...]]] = {"points": (self.dtype, (3,))}
        if self.has_intensity:
            cols["intensity"] = (np.float32, ())
        if self.has_rgb:
            cols["colors"] = (np.uint8, (3,))
        if self.has_grid:
            cols["pixel_index"] = (np.int64, ())
        return cols

    def blocks(self):
        """The scan's valid points (its invalid state dropped), one block per libE57 read of
        :data:`E57_BLOCK_ROWS` points: ``{points, intensity, colors, pixel_index}`` as it has them."""
        from pye57 import libe57

        path, index, n, bufs = self.path, self.index, self.n, {}
        cap = max(1, min(n, E57_BLOCK_ROWS))
        bufs = {f: np.empty(cap, dt) for f, dt in self.want.items()}
        vec = libe57.VectorSourceDestBuffer()
        for f, b in bufs.items():
            vec.append(libe57.SourceDestBuffer(self.e57.image_file, f, b, cap, True, True))
        if self.has_grid:
            rmin, rmax, cmin, cmax = self.grid
        seen = 0
        reader = self.points_node.reader(vec)
        try:
            while (got := int(reader.read())) > 0:
                if seen + got > n:
                    raise ScanReadError(path, f"E57 scan {index} has more points than its {n} declared")
                valid = bufs[self.state][:got] == 0 if self.state in bufs else np.ones(got, bool)
                m = int(valid.sum())
                a, b, c = (bufs[f][:got][valid] for f in self.coords)
                if self.spherical:  # range, azimuth, elevation -> x, y, z (E57 convention), float64
                    a, b, c = a * np.cos(c) * np.cos(b), a * np.cos(c) * np.sin(b), a * np.sin(c)
                block = {"points": np.empty((m, 3), self.dtype)}
                block["points"][:, 0], block["points"][:, 1], block["points"][:, 2] = a, b, c
                if self.has_intensity:
                    block["intensity"] = bufs["intensity"][:got][valid].astype(np.float32)
                if self.has_rgb:
                    colors = block["colors"] = np.empty((m, 3), np.uint8)
                    for j, f in enumerate(_E57_RGB):
                        v = bufs[f][:got][valid]  # 8-bit as is, wider colour scaled from its declared maximum
                        if self.rgb_max[j] > 255:
                            v = np.clip(np.rint(v * (255 / self.rgb_max[j])), 0, 255)
                        colors[:, j] = v
                if self.has_grid:
                    row, col = bufs["rowIndex"][:got][valid], bufs["columnIndex"][:got][valid]
                    if m and (row.min() < rmin or row.max() > rmax or col.min() < cmin or col.max() > cmax):
                        raise ScanReadError(path, f"E57 scan {index}: rowIndex/columnIndex outside its index bounds "
                                                  f"rows {rmin}..{rmax}, columns {cmin}..{cmax}")
                    block["pixel_index"] = ((row - rmin) * self.width + (col - cmin)).astype(np.int64)
                seen += got
                yield block
        finally:
            reader.close()
        if seen != n:
            raise ScanReadError(path, f"truncated E57 scan {index}: {seen} of its {n} points present")


def _read_e57_scan(path, e57, index: int, count: int) -> PointCloud:
    """Scan ``index`` of an open E57 file: its points in its own frame, invalid ones dropped, read
    in blocks of :data:`E57_BLOCK_ROWS` points into arrays sized once."""
    scan = _E57Scan(path, e57, index, count)
    n = scan.n
    out = {name: np.empty((n, *tail), dt) for name, (dt, tail) in scan.columns().items()}
    kept = 0
    for block in scan.blocks():
        m = len(block["points"])
        for name, rows in block.items():
            out[name][kept:kept + m] = rows
        kept += m
    cloud = PointCloud(out["points"][:kept], intensity=out["intensity"][:kept] if scan.has_intensity else None,
                       colors=out["colors"][:kept] if scan.has_rgb else None,
                       pixel_index=out["pixel_index"][:kept] if scan.has_grid else None)
    cloud.meta.update(scan.meta)
    if kept == 0 and n:
        raise ScanReadError(path, f"E57 scan {index}: all {n} points are marked invalid")
    return cloud


def _e57_index(path, n: int, part: str | None) -> int:
    """The index of scan ``part`` (``scan001``) of an E57 file of ``n`` scans (0 for none: then it must hold one)."""
    if part is None or part == "":
        if n > 1:
            raise ScanReadError(path, f"E57 file holds {n} scans: read one with part='scan000' .. "
                                      f"'{_e57_part(n - 1)}' (ingest stores each as a scan of its own)")
        return 0
    index = int(part[4:]) if re.fullmatch(r"scan\d{3,}", part) else -1
    if not 0 <= index < n:
        raise ScanReadError(path, f"E57 file has no scan {part!r} "
                                  f"(it holds {n}: scan000 .. {_e57_part(n - 1)})")
    return index


def _e57_block_scan(path, part: str | None) -> BlockScan:
    """Scan ``part`` of an E57 file opened to be read and stored block by block: the blocks of
    :meth:`_E57Scan.blocks` with :func:`_finalise`'s rule applied to each (non-finite points
    dropped; where the scan has no grid and a point is dropped, ``pixel_index`` records each kept
    point's place among the valid ones)."""
    opened = _OpenedE57(path)
    e57 = opened.__enter__()
    index = part
    try:
        n = _e57_count(path, e57)
        index = _e57_index(path, n, part)
        sc = _E57Scan(path, e57, index, n)
    except BaseException as exc:
        opened.__exit__(None, None, None)
        if isinstance(exc, (ScanReadError, MemoryError)) or not isinstance(exc, Exception):
            raise
        raise ScanReadError(path, _e57_reason(exc, f"E57 scan {index} is corrupt or truncated")) from exc
    cols = sc.columns()
    optional = set()
    if "pixel_index" not in cols:
        cols["pixel_index"] = (np.int64, ())
        optional.add("pixel_index")
    scan = BlockScan(sc.n, cols, dict(sc.meta), exact=False, optional=optional)

    def blocks():
        valid = kept = 0
        indexed = not optional
        lo, hi = np.full(3, np.inf), np.full(3, -np.inf)
        with opened:
            try:
                for block in sc.blocks():
                    m = len(block["points"])
                    finite = np.isfinite(block["points"]).all(axis=1)
                    if not finite.all():
                        if not indexed:  # the rows kept so far are the valid points 0 .. kept-1
                            indexed = True
                            for start in range(0, kept, E57_BLOCK_ROWS):
                                stop = min(kept, start + E57_BLOCK_ROWS)
                                yield start, {"pixel_index": np.arange(start, stop, dtype=np.int64)}
                        keep = np.flatnonzero(finite)
                        block = {k: v[keep] for k, v in block.items()}
                        if "pixel_index" not in block:
                            block["pixel_index"] = (valid + keep).astype(np.int64)
                    elif indexed and "pixel_index" not in block:
                        block["pixel_index"] = np.arange(valid, valid + m, dtype=np.int64)
                    valid += m
                    if len(block["points"]):
                        lo = np.minimum(lo, block["points"].min(0))
                        hi = np.maximum(hi, block["points"].max(0))
                        kept += len(block["points"])
                        yield block
            except (ScanReadError, MemoryError):
                raise
            except Exception as exc:  # noqa: BLE001
                raise ScanReadError(path, _e57_reason(exc, f"E57 scan {index} is corrupt or truncated")) from exc
        if valid == 0 and sc.n:
            raise ScanReadError(path, f"E57 scan {index}: all {sc.n} points are marked invalid")
        if sc.n == 0:
            raise ScanReadError(path, "zero-point cloud (the file declares no points)")
        if kept == 0:
            raise ScanReadError(path, f"no finite point: all {valid} points are NaN or infinite")
        scan.n_kept, scan.bbox = kept, (lo.astype(np.float64).tolist(), hi.astype(np.float64).tolist())

    scan.blocks = blocks()
    return scan


def _e57_grid(node, proto) -> tuple[int, int, int, int]:
    """Row and column bounds of an organised scan: its ``indexBounds`` where given, else the bounds
    its ``rowIndex``/``columnIndex`` fields declare."""
    from pye57.utils import get_node

    if node.isDefined("indexBounds"):
        ib = node["indexBounds"]
        if all(ib.isDefined(k) for k in ("rowMinimum", "rowMaximum", "columnMinimum", "columnMaximum")):
            return tuple(int(ib[k].value()) for k in ("rowMinimum", "rowMaximum", "columnMinimum", "columnMaximum"))
    r, c = get_node(proto, "rowIndex"), get_node(proto, "columnIndex")
    return int(r.minimum()), int(r.maximum()), int(c.minimum()), int(c.maximum())


_READERS = {
    "pcd": _read_pcd,
    "ply": _read_ply,
    "las": _read_las,
    "laz": _read_las,
    "copc": _read_copc,
    "xyz": read_xyz,
    "csv": read_xyz,
    "npy": _read_npy,
}


# ----------------------------------------------------------------------------------------------
# writers (used by the synthetic archive, tests and round trips)


def write_cloud(path: str | os.PathLike, points: np.ndarray, *, normals=None, colors=None,
                encoding: str = "binary_compressed") -> Path:
    """Write a cloud as PCD (``encoding`` ascii/binary/binary_compressed), PLY (ascii/binary), or NPY."""
    path = Path(path)
    fmt = detect_format(path)
    points = np.asarray(points)
    if fmt == "npy":
        cols = [points] + ([np.asarray(normals, points.dtype)] if normals is not None else [])
        np.save(path, np.concatenate(cols, axis=1) if len(cols) > 1 else points)
    elif fmt == "pcd":
        import pypcd4

        fields = ["x", "y", "z"]
        arrays = [points[:, 0], points[:, 1], points[:, 2]]
        types = [points.dtype] * 3
        if normals is not None:
            fields += ["normal_x", "normal_y", "normal_z"]
            arrays += [normals[:, 0], normals[:, 1], normals[:, 2]]
            types += [np.dtype(np.float32)] * 3
        if colors is not None:
            c = np.asarray(colors, np.uint32)
            fields.append("rgb")
            arrays.append((c[:, 0] << 16) | (c[:, 1] << 8) | c[:, 2])
            types.append(np.dtype(np.uint32))
        pc = pypcd4.PointCloud.from_points(arrays, tuple(fields), tuple(types))
        pc.save(path, encoding=pypcd4.Encoding(encoding))
    elif fmt == "ply":
        from plyfile import PlyData, PlyElement

        props = [("x", points.dtype.str), ("y", points.dtype.str), ("z", points.dtype.str)]
        cols = [points[:, 0], points[:, 1], points[:, 2]]
        if normals is not None:
            props += [("nx", "f4"), ("ny", "f4"), ("nz", "f4")]
            cols += [normals[:, i] for i in range(3)]
        if colors is not None:
            props += [("red", "u1"), ("green", "u1"), ("blue", "u1")]
            cols += [np.asarray(colors)[:, i] for i in range(3)]
        vertex = np.empty(len(points), dtype=props)
        for (name, _), c in zip(props, cols):
            vertex[name] = c
        PlyData([PlyElement.describe(vertex, "vertex")], text=(encoding == "ascii")).write(str(path))
    else:
        raise ScanReadError(path, f"writing {fmt} is not supported (write PCD, PLY or NPY)")
    return path
