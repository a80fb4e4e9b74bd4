"""Readers for scan files: PCD (ascii, binary, binary_compressed), PLY, LAS/LAZ, XYZ/CSV text, NPY.

Every reader returns a :class:`PointCloud` with finite ``points`` only: organised clouds (PCD with
HEIGHT > 1) lose their NaN holes and keep ``pixel_index`` (row-major index into WIDTH x HEIGHT) so
the image structure can be recovered. Normals, colour and intensity are kept when the file has them.
Coordinates keep the file's float type (float32 PCD stays float32, LAS stays float64), so a round
trip file -> store -> array is exact.

Any problem becomes a :class:`~scanforest.kernels.errors.ScanReadError` naming the file and the
reason (truncated data, header/data mismatch, empty file, zero points, all NaN, unknown format).
"""
from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scanforest.kernels.errors import ScanReadError

#: the format libraries, imported where a format is read (a missing optional one fails only its
#: format); Dask workers import them as they start (``flows.worker_setup.WORKER_PRELOAD``)
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
}


@dataclass
class PointCloud:
    """A scan in memory.

    Attributes
    ----------
    points : (N, 3) float32 or float64
        Finite coordinates only.
    normals : (N, 3) float32 or None
    colors : (N, 3) uint8 or None
    intensity : (N,) float32 or None
    pixel_index : (N,) int64 or None
        For organised clouds: the row-major index of each kept point in the WIDTH x HEIGHT image.
    meta : dict
        ``format``, ``encoding``, ``width``, ``height``, ``viewpoint``, ``n_source_points`` ...
    extra : dict
        Other per-point fields the file carried (e.g. ``curvature``), each (N,) or (N, k).
    """

    points: np.ndarray
    normals: np.ndarray | None = None
    colors: np.ndarray | None = None
    intensity: np.ndarray | None = None
    pixel_index: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.points.shape[0])

    @property
    def bbox(self) -> tuple[list[float], list[float]]:
        return self.points.min(0).tolist(), self.points.max(0).tolist()

    def arrays(self) -> dict[str, np.ndarray]:
        """Every per-point array by store name (points first)."""
        out = {"points": self.points}
        for name in ("normals", "colors", "intensity", "pixel_index"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out.update({f"extra_{k}": v for k, v in self.extra.items()})
        return out


def detect_format(path: str | os.PathLike) -> str:
    """Format name from the file name (``.pcd``, ``.ply``, ``.las``/``.laz``, ``.xyz``/``.txt``/``.csv``, ``.npy``)."""
    suffix = Path(path).suffix.lower()
    fmt = FORMATS.get(suffix)
    if fmt is None:
        raise ScanReadError(path, f"unknown format {suffix or '(no extension)'!r}; "
                                  f"supported: {', '.join(sorted(FORMATS))}")
    return fmt


def read_cloud(path: str | os.PathLike, data: bytes | None = None, *, format: str | None = None) -> PointCloud:
    """Read one scan file.

    Parameters
    ----------
    path : path-like
        The file; its suffix picks the reader unless ``format`` is given.
    data : bytes, optional
        The file's bytes when they are already in memory (archive members); ``path`` then only
        names the file in errors and picks the format.
    format : str, optional
        Force a reader: ``pcd``, ``ply``, ``las``, ``laz``, ``xyz``, ``csv`` or ``npy``.

    Raises
    ------
    ScanReadError
        The file is missing, empty, truncated, inconsistent, unknown, or has no finite point.
    """
    fmt = format or detect_format(path)
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
    used = {"x", "y", "z", "normal_x", "normal_y", "normal_z", "rgb", "rgba", "intensity", "_"}
    for f in fields:
        if f not in used and not f.startswith("_"):
            cloud.extra[f] = np.asarray(arr[f])
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
    v = ply["vertex"].data
    names = v.dtype.names or ()
    for name in ("x", "y", "z"):
        if name not in names:
            raise ScanReadError(path, f"PLY vertex has no {name!r} property (has: {' '.join(names)})")
    dtype = np.result_type(v["x"].dtype, np.float32)
    cloud = PointCloud(np.stack([v["x"], v["y"], v["z"]], axis=1).astype(dtype, copy=False))
    if all(n in names for n in ("nx", "ny", "nz")):
        cloud.normals = np.stack([v["nx"], v["ny"], v["nz"]], axis=1).astype(np.float32)
    for trio in (("red", "green", "blue"), ("r", "g", "b")):
        if all(n in names for n in trio):
            cloud.colors = _to_uint8(np.stack([v[n] for n in trio], axis=1))
            break
    for iname in ("intensity", "scalar_intensity"):
        if iname in names:
            cloud.intensity = np.asarray(v[iname], dtype=np.float32)
    cloud.meta.update(encoding="ascii" if ply.text else ("binary_" + ply.byte_order.replace("<", "little_endian")
                                                         .replace(">", "big_endian").replace("=", "native")))
    return cloud


def _to_uint8(c: np.ndarray) -> np.ndarray:
    if np.issubdtype(c.dtype, np.floating):
        scale = 255.0 if c.size and float(np.nanmax(c)) <= 1.0 else 1.0
        return np.clip(np.rint(c * scale), 0, 255).astype(np.uint8)
    if c.size and int(c.max()) > 255:  # 16-bit colour (LAS, some PLY)
        return (c.astype(np.uint32) >> 8).astype(np.uint8)
    return c.astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# LAS / LAZ


def _read_las(path, data: bytes) -> PointCloud:
    import laspy

    las = laspy.read(io.BytesIO(data))
    cloud = PointCloud(np.stack([np.asarray(las.x), np.asarray(las.y), np.asarray(las.z)], axis=1).astype(np.float64))
    dims = set(las.point_format.dimension_names)
    if "intensity" in dims:
        cloud.intensity = np.asarray(las.intensity, dtype=np.float32)
    if {"red", "green", "blue"} <= dims:
        cloud.colors = _to_uint8(np.stack([las.red, las.green, las.blue], axis=1))
    if "classification" in dims:
        cloud.extra["classification"] = np.asarray(las.classification, dtype=np.uint8)
    if las.header.point_count != len(cloud.points):
        raise ScanReadError(path, f"LAS header declares {las.header.point_count} points, data has {len(cloud.points)}")
    cloud.meta.update(encoding="laz" if Path(path).suffix.lower() == ".laz" else "las",
                      las_version=str(las.header.version), point_format=int(las.point_format.id),
                      scales=list(map(float, las.header.scales)), offsets=list(map(float, las.header.offsets)))
    return cloud


# ----------------------------------------------------------------------------------------------
# XYZ / CSV text

_XYZ_NAMES = {
    "x": "x", "y": "y", "z": "z",
    "nx": "nx", "ny": "ny", "nz": "nz", "normal_x": "nx", "normal_y": "ny", "normal_z": "nz",
    "r": "r", "g": "g", "b": "b", "red": "r", "green": "g", "blue": "b",
    "i": "i", "intensity": "i",
}


def _read_xyz(path, data: bytes) -> PointCloud:
    text = data.decode("utf-8", "replace")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(("#", "//"))]
    if not lines:
        return PointCloud(np.zeros((0, 3)))
    delim = "," if "," in lines[0] else (";" if ";" in lines[0] else None)
    first = lines[0].split(delim)
    names = None
    try:
        [float(t) for t in first]
    except ValueError:
        names = [_XYZ_NAMES.get(t.strip().lower().strip('"'), t.strip().lower()) for t in first]
        lines = lines[1:]
        if not lines:
            return PointCloud(np.zeros((0, 3)))
    try:
        table = np.loadtxt(lines, delimiter=delim, dtype=np.float64, ndmin=2)
    except ValueError as exc:
        raise ScanReadError(path, f"malformed text row: {exc}") from exc
    ncol = table.shape[1]
    if ncol < 3:
        raise ScanReadError(path, f"text rows need at least 3 columns (x y z), got {ncol}")
    if names is None:
        names = ["x", "y", "z"]
        rest = table[:, 3:]
        if rest.shape[1] >= 3:
            norms = np.linalg.norm(rest[:, :3], axis=1)
            if np.allclose(norms[np.isfinite(norms)], 1.0, atol=1e-2):
                names += ["nx", "ny", "nz"]
            elif np.all((rest[:, :3] >= 0) & (rest[:, :3] <= 255) & (rest[:, :3] == np.rint(rest[:, :3]))):
                names += ["r", "g", "b"]
        names += [f"c{i}" for i in range(len(names), ncol)]
    if len(names) != ncol:
        raise ScanReadError(path, f"header names {len(names)} columns but rows have {ncol}")
    col = {n: i for i, n in enumerate(names)}
    if not {"x", "y", "z"} <= col.keys():
        raise ScanReadError(path, f"text header has no x/y/z columns: {names}")
    cloud = PointCloud(table[:, [col["x"], col["y"], col["z"]]])
    if {"nx", "ny", "nz"} <= col.keys():
        cloud.normals = table[:, [col["nx"], col["ny"], col["nz"]]].astype(np.float32)
    if {"r", "g", "b"} <= col.keys():
        cloud.colors = _to_uint8(table[:, [col["r"], col["g"], col["b"]]].astype(np.int64))
    if "i" in col:
        cloud.intensity = table[:, col["i"]].astype(np.float32)
    cloud.meta.update(encoding="text", columns=names)
    return cloud


# ----------------------------------------------------------------------------------------------
# NPY


def _read_npy(path, data: bytes) -> PointCloud:
    arr = np.load(io.BytesIO(data), allow_pickle=False)
    if arr.dtype.names:
        names = arr.dtype.names
        for name in ("x", "y", "z"):
            if name not in names:
                raise ScanReadError(path, f"structured NPY has no {name!r} field (fields: {names})")
        dtype = np.result_type(arr["x"].dtype, np.float32)
        cloud = PointCloud(np.stack([arr["x"], arr["y"], arr["z"]], axis=1).astype(dtype, copy=False))
        if {"nx", "ny", "nz"} <= set(names):
            cloud.normals = np.stack([arr["nx"], arr["ny"], arr["nz"]], axis=1).astype(np.float32)
        return cloud
    if arr.ndim != 2 or arr.shape[1] < 3:
        raise ScanReadError(path, f"NPY array must be (N, 3) or (N, >=3), got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.number):
        raise ScanReadError(path, f"NPY array has non-numeric dtype {arr.dtype}")
    pts = arr[:, :3]
    if pts.dtype not in (np.float32, np.float64):
        pts = pts.astype(np.float64)
    cloud = PointCloud(pts)
    if arr.shape[1] >= 6:
        cloud.normals = arr[:, 3:6].astype(np.float32)
    return cloud


_READERS = {
    "pcd": _read_pcd,
    "ply": _read_ply,
    "las": _read_las,
    "laz": _read_las,
    "xyz": _read_xyz,
    "csv": _read_xyz,
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
