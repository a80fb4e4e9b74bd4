"""A small COPC writer for the tests (laspy reads COPC but does not write it; no COPC writer is a
dependency): LAS 1.4, point format 7, the COPC info VLR first, each octree node one LAZ chunk
compressed by lazrs, the hierarchy one page in an EVLR, the LAZ chunk table after the chunks."""
from __future__ import annotations

import io
import struct

import numpy as np


def write_copc(path, xyz: np.ndarray, *, intensity=None, rgb=None, classification=None, depth: int = 2,
               scale: float = 0.01) -> dict[tuple[int, int, int, int], np.ndarray]:
    """Write the points as a COPC file; point ``i`` goes to level ``i % (depth + 1)``, in the node
    of that level that holds it. Returns ``{(level, x, y, z): indices of its points}``."""
    import laspy
    import lazrs
    from laspy.vlrs.known import LasZipVlr

    xyz = np.asarray(xyz, np.float64)
    n = len(xyz)
    hdr = laspy.LasHeader(point_format=7, version="1.4")
    hdr.offsets = np.floor(xyz.min(0))
    hdr.scales = [scale] * 3
    lo, hi = xyz.min(0), xyz.max(0)
    center = (lo + hi) / 2
    half = float((hi - lo).max()) / 2 + 4 * scale
    level = np.arange(n) % (depth + 1)
    cells = np.floor((xyz - (center - half)) / (2 * half / 2.0 ** level[:, None])).astype(np.int64)
    cells = np.clip(cells, 0, (2 ** level[:, None]) - 1)
    keys = np.column_stack([level, cells])
    order = np.lexsort(keys.T[::-1])
    rec = laspy.ScaleAwarePointRecord.zeros(n, header=hdr)
    rec.x, rec.y, rec.z = xyz[order, 0], xyz[order, 1], xyz[order, 2]
    if intensity is not None:
        rec.intensity = np.asarray(intensity)[order]
    if rgb is not None:
        rec.red, rec.green, rec.blue = (np.asarray(rgb)[order, j] for j in range(3))
    if classification is not None:
        rec.classification = np.asarray(classification)[order]
    raw = rec.array.tobytes()
    size = hdr.point_format.size
    nodes: dict[tuple[int, int, int, int], np.ndarray] = {}
    sorted_keys = keys[order]
    start = 0
    while start < n:
        stop = start + 1
        while stop < n and (sorted_keys[stop] == sorted_keys[start]).all():
            stop += 1
        nodes[tuple(int(v) for v in sorted_keys[start])] = order[start:stop]
        start = stop
    vlr = lazrs.LazVlr.new_for_compression(7, 0, True)
    chunks = []
    at = 0
    for key, idx in nodes.items():
        out = bytes(lazrs.compress_points(vlr, raw[at * size:(at + len(idx)) * size], False))
        end = struct.unpack("<q", out[:8])[0]
        chunks.append(out[8:end])
        at += len(idx)

    info = bytearray(160)
    hdr.vlrs.append(laspy.VLR(user_id="copc", record_id=1, description="copc info", record_data=bytes(info)))
    hdr.vlrs.append(LasZipVlr(vlr.record_data()))
    hdr.point_count = n
    hdr.mins, hdr.maxs = xyz.min(0), xyz.max(0)
    hdr.are_points_compressed = True
    hdr.number_of_evlrs = 1
    probe = io.BytesIO()
    hdr.write_to(probe)
    data_at = hdr.offset_to_point_data
    offsets = []
    pos = data_at + 8
    for c in chunks:
        offsets.append(pos)
        pos += len(c)
    table = io.BytesIO()
    lazrs.write_chunk_table(table, [(len(idx), len(c)) for idx, c in zip(nodes.values(), chunks)], vlr)
    evlr_at = pos + len(table.getvalue())
    entries = b"".join(struct.pack("<4iQii", *key, off, len(c), len(idx))
                       for (key, idx), off, c in zip(nodes.items(), offsets, chunks))
    spacing = 2 * half / 8
    info = struct.pack("<5d2Q2d", *center, half, spacing, evlr_at + 60, len(entries), 0.0, 0.0) + bytes(88)
    hdr.vlrs[0] = laspy.VLR(user_id="copc", record_id=1, description="copc info", record_data=info)
    hdr.start_of_first_evlr = evlr_at
    with open(path, "wb") as fh:
        hdr.write_to(fh)
        assert fh.tell() == data_at
        fh.write(struct.pack("<q", pos))
        for c in chunks:
            fh.write(c)
        fh.write(table.getvalue())
        fh.write(struct.pack("<H16sHQ32s", 0, b"copc", 1000, len(entries), b"copc hierarchy"))
        fh.write(entries)
    return nodes
