"""The text readers (XYZ, TXT, CSV, Leica PTS): rows of numbers as scanners, survey tools,
spreadsheets and Windows tools write them (a header row or none, ``,`` ``;`` tab or spaces
between the numbers, decimal commas, quoted numbers, UTF-16); :func:`read_xyz` gives the
:class:`~.cloud.PointCloud` that :func:`~.readers.read_cloud` returns for them."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from scanforest.kernels.errors import ScanReadError

from .cloud import PointCloud, to_uint8

_XYZ_NAMES = {
    "x": "x", "y": "y", "z": "z",
    "nx": "nx", "ny": "ny", "nz": "nz", "normal_x": "nx", "normal_y": "ny", "normal_z": "nz",
    "r": "r", "g": "g", "b": "b", "red": "r", "green": "g", "blue": "b",
    "i": "i", "intensity": "i",
}


def _bad_text_line(numbered: list[tuple[int, str]], delim: str | None, exc: ValueError) -> str:
    """The first of the (line number, text) rows that is not as many numbers as the first row,
    named by its line in the file (numpy's message counts rows after the header and comments,
    from 0 or 1 as the case may be)."""
    want = None
    for no, ln in numbered:
        fields = ln.split(delim)
        try:
            [float(t) for t in fields]
        except ValueError:
            return f"malformed text row on line {no}: {ln.strip()[:80]!r} is not {want or 'all'} numbers"
        if want is None:
            want = len(fields)
        elif len(fields) != want:
            return f"malformed text row on line {no}: {len(fields)} columns where the rows before have {want}"
    return f"malformed text rows: {exc}"


#: a number written with a decimal comma (a European spreadsheet's export: ``1,25;3,5;0,75``)
_DECIMAL_COMMA = re.compile(r"[-+]?\d+,\d+([eE][-+]?\d+)?")


def _text_layout(lines: list[str]) -> tuple[str | None, bool]:
    """The delimiter of text rows (``,`` ``;`` tab, or None for runs of spaces) and whether their
    numbers have a decimal comma (then the rows are read with ``,`` as ``.``), from the last
    row (a header row may differ)."""
    row = lines[-1].strip()
    if ";" in row:
        delim = ";"
    elif "\t" in row and "," in row:
        delim = "\t"
    elif "," in row and not (len(row.split()) >= 3 and all(_DECIMAL_COMMA.fullmatch(t) for t in row.split())):
        return ",", False
    else:
        delim = None
    fields = [t.strip().strip('"') for t in row.split(delim) if t.strip()]
    return delim, any(_DECIMAL_COMMA.fullmatch(t) for t in fields)


def read_xyz(path, data: bytes) -> PointCloud:
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # UTF-16 (PowerShell's and Notepad's "Unicode")
        text = data.decode("utf-16", "replace")
    else:
        text = data.decode("utf-8-sig", "replace")  # a byte-order mark (Excel's CSV) is not a column name
    numbered = [(i, ln) for i, ln in enumerate(text.splitlines(), 1)
                if ln.strip() and not ln.lstrip().startswith(("#", "//"))]
    lines = [ln for _, ln in numbered]
    pts_file = Path(path).suffix.lower() == ".pts"
    declared = None
    if len(lines) > 1 and re.fullmatch(r"\s*\d+\s*", lines[0]) and len(lines[1].replace(",", " ").split()) >= 3:
        declared, lines = int(lines[0]), lines[1:]  # Leica PTS: the point count first
    if not lines:
        return PointCloud(np.zeros((0, 3)))
    delim, decimal_comma = _text_layout(lines)
    if '"' in lines[-1] or decimal_comma or (delim and lines[-1].rstrip().endswith(delim)):
        # a spreadsheet's CSV: quoted numbers, decimal commas, a delimiter closing every row
        table_rows = [ln.replace('"', "").rstrip() for ln in lines]
        if delim and all(ln.endswith(delim) for ln in table_rows[1:] or table_rows):
            table_rows = [ln[:-1] if ln.endswith(delim) else ln for ln in table_rows]
        if decimal_comma:
            table_rows = [ln.replace(",", ".") for ln in table_rows]
        lines = table_rows
        numbered = [(no, ln) for (no, _), ln in zip(numbered[len(numbered) - len(lines):], lines)]
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
        raise ScanReadError(path, _bad_text_line(numbered[len(numbered) - len(lines):], delim, exc)) from exc
    ncol = table.shape[1]
    if ncol < 3:
        raise ScanReadError(path, f"text rows need at least 3 columns (x y z), got {ncol}")
    if names is None:
        names = ["x", "y", "z"]
        rest = table[:, 3:]

        def u8(a):  # colour channels: whole numbers 0-255
            return bool(np.all((a >= 0) & (a <= 255) & (a == np.rint(a))))

        norms = np.linalg.norm(rest[:, :3], axis=1) if rest.shape[1] >= 3 else None
        if norms is not None and np.allclose(norms[np.isfinite(norms)], 1.0, atol=1e-2):
            names += ["nx", "ny", "nz"]
        elif rest.shape[1] == 4 and u8(rest[:, 1:]) and (pts_file or not u8(rest[:, :1])):
            names += ["i", "r", "g", "b"]  # x y z intensity r g b (Leica PTS)
        elif rest.shape[1] >= 3 and u8(rest[:, :3]):
            names += ["r", "g", "b"]
        elif rest.shape[1] == 1 and pts_file:
            names += ["i"]  # x y z intensity (PTS without colour)
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
        cloud.colors = to_uint8(table[:, [col["r"], col["g"], col["b"]]].astype(np.int64))
    if "i" in col:
        cloud.intensity = table[:, col["i"]].astype(np.float32)
    known = set(_XYZ_NAMES.values())
    for i, n in enumerate(names):  # the other columns kept, by their header name or place
        if n not in known and re.fullmatch(r"[a-z0-9_]+", n):
            cloud.extra[n] = table[:, i]
    cloud.meta.update(encoding="text", columns=names)
    if declared is not None:
        cloud.meta["declared_points"] = declared
    return cloud
