"""Readers: every PCL file, every encoding, round trips, and every kind of bad input."""
from __future__ import annotations

import io

import numpy as np
import pytest

from scanforest.kernels.errors import ScanReadError
from scanforest.tasks.readers import read_cloud, write_cloud
from scanforest.tasks.store import ScanStore

PCL_FILES = ["bun0.pcd", "bunny.pcd", "cturtle.pcd", "five_people.pcd", "milk.pcd",
             "milk_cartoon_all_small_clorox.pcd", "milk_color.pcd", "office1.pcd", "rops_cloud.pcd",
             "table_scene_mug_stereo_textured.pcd"]


def _independent_pcd_xyz(path) -> tuple[int, np.ndarray]:
    """A minimal PCD decoder written from the format spec (not pypcd4): (declared points, finite xyz)."""
    import lzf

    data = path.read_bytes()
    header, pos = {}, 0
    while True:
        end = data.index(b"\n", pos)
        line = data[pos:end].decode().strip()
        pos = end + 1
        if not line or line.startswith("#"):
            continue
        k, _, v = line.partition(" ")
        header[k] = v.split()
        if k == "DATA":
            break
    fields, sizes = header["FIELDS"], [int(s) for s in header["SIZE"]]
    types, n = header["TYPE"], int(header["POINTS"][0])
    enc = header["DATA"][0]
    dt = np.dtype([(f, {("F", 4): "<f4", ("F", 8): "<f8", ("U", 4): "<u4", ("U", 1): "u1"}[(t, s)])
                   for f, t, s in zip(fields, types, sizes)])
    body = data[pos:]
    if enc == "ascii":
        table = np.loadtxt(io.StringIO(body.decode()), ndmin=2)
        xyz = table[:, [fields.index(c) for c in "xyz"]]
    elif enc == "binary_compressed":
        csize, usize = np.frombuffer(body[:8], "<u4")
        raw = lzf.decompress(body[8:8 + csize], int(usize))
        cols, off = {}, 0
        for f, s in zip(fields, sizes):  # column-major: all x, then all y, ...
            cols[f] = np.frombuffer(raw[off:off + s * n], dtype=dt[f])
            off += s * n
        xyz = np.stack([cols["x"], cols["y"], cols["z"]], 1)
    else:
        xyz = np.frombuffer(body[: dt.itemsize * n], dt)
        xyz = np.stack([xyz["x"], xyz["y"], xyz["z"]], 1)
    return n, xyz[np.isfinite(xyz).all(1)]


@pytest.mark.parametrize("name", PCL_FILES)
def test_every_pcl_file_reads_with_right_count(pcl_dir, name):
    path = pcl_dir / name
    declared, finite = _independent_pcd_xyz(path)
    cloud = read_cloud(path)
    assert len(cloud) == len(finite)
    assert cloud.meta["n_source_points"] == declared
    np.testing.assert_array_equal(cloud.points, finite.astype(np.float32))
    if cloud.meta.get("organized"):
        assert cloud.pixel_index is not None and len(cloud.pixel_index) == len(cloud)
        assert cloud.pixel_index.max() < cloud.meta["width"] * cloud.meta["height"]
        assert np.all(np.diff(cloud.pixel_index) > 0)


def test_known_counts_and_fields(pcl_dir):
    bun = read_cloud(pcl_dir / "bun0.pcd")
    assert len(bun) == 397 and bun.normals.shape == (397, 3) and "curvature" in bun.extra
    assert len(read_cloud(pcl_dir / "milk.pcd")) == 13704
    assert read_cloud(pcl_dir / "milk_color.pcd").colors.shape == (13704, 3)
    assert read_cloud(pcl_dir / "cturtle.pcd").intensity.shape == (167198,)
    scene = read_cloud(pcl_dir / "milk_cartoon_all_small_clorox.pcd")
    assert scene.meta["width"] == 640 and scene.meta["height"] == 480 and len(scene) < 307200
    assert read_cloud(pcl_dir / "bunny.pcd").meta["pcd_version"] == ".5"  # old header, still read


@pytest.mark.parametrize("encoding", ["ascii", "binary", "binary_compressed"])
def test_pcd_round_trip_through_store_is_exact(tmp_path, rng, encoding):
    pts = rng.normal(size=(1234, 3)).astype(np.float32)
    nrm = rng.normal(size=(1234, 3)).astype(np.float32)
    col = rng.integers(0, 256, size=(1234, 3)).astype(np.uint8)
    path = write_cloud(tmp_path / f"c_{encoding}.pcd", pts, normals=nrm, colors=col, encoding=encoding)
    cloud = read_cloud(path)
    if encoding == "ascii":  # ascii PCD is written with 8 significant digits (as PCL does)
        np.testing.assert_allclose(cloud.points, pts, rtol=2e-7, atol=1e-12)
    else:
        np.testing.assert_array_equal(cloud.points, pts)
        np.testing.assert_array_equal(cloud.normals, nrm)
    np.testing.assert_array_equal(cloud.colors, col)
    store = ScanStore(tmp_path / "s.zarr", create=True)
    store.write_scan("c", cloud.arrays(), {"n_points": len(cloud)})
    back = store.read_cloud("c")  # file -> store -> array is bit-exact
    np.testing.assert_array_equal(back.points, cloud.points)
    np.testing.assert_array_equal(back.normals, cloud.normals)
    np.testing.assert_array_equal(back.colors, col)


@pytest.mark.parametrize("ascii_", [True, False])
def test_ply_round_trip_is_exact(tmp_path, rng, ascii_):
    pts = rng.normal(size=(500, 3)).astype(np.float32)
    nrm = rng.normal(size=(500, 3)).astype(np.float32)
    col = rng.integers(0, 256, size=(500, 3)).astype(np.uint8)
    path = write_cloud(tmp_path / "c.ply", pts, normals=nrm, colors=col, encoding="ascii" if ascii_ else "binary")
    cloud = read_cloud(path)
    np.testing.assert_array_equal(cloud.points, pts)
    np.testing.assert_array_equal(cloud.normals, nrm)
    np.testing.assert_array_equal(cloud.colors, col)
    store = ScanStore(tmp_path / "s.zarr", create=True)
    store.write_scan("c", cloud.arrays(), {})
    np.testing.assert_array_equal(store.read("c", "points"), pts)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_npy_round_trip_is_exact(tmp_path, rng, dtype):
    pts = rng.normal(size=(777, 3)).astype(dtype)
    np.save(tmp_path / "c.npy", pts)
    cloud = read_cloud(tmp_path / "c.npy")
    assert cloud.points.dtype == dtype
    store = ScanStore(tmp_path / "s.zarr", create=True)
    store.write_scan("c", cloud.arrays(), {})
    back = store.read("c", "points")
    assert back.dtype == dtype
    np.testing.assert_array_equal(back, pts)


def test_xyz_and_csv_text(tmp_path, rng):
    pts = np.round(rng.normal(size=(50, 3)), 6)
    nrm = rng.normal(size=(50, 3))
    nrm /= np.linalg.norm(nrm, axis=1, keepdims=True)
    np.savetxt(tmp_path / "a.xyz", np.hstack([pts, nrm]), fmt="%.9f")
    c = read_cloud(tmp_path / "a.xyz")
    np.testing.assert_allclose(c.points, pts, atol=1e-9)
    np.testing.assert_allclose(c.normals, nrm, atol=1e-6)
    col = rng.integers(0, 256, size=(50, 3))
    (tmp_path / "b.csv").write_text("x,y,z,red,green,blue\n" + "\n".join(
        f"{p[0]},{p[1]},{p[2]},{r},{g},{b}" for p, (r, g, b) in zip(pts, col)))
    c = read_cloud(tmp_path / "b.csv")
    np.testing.assert_allclose(c.points, pts)
    np.testing.assert_array_equal(c.colors, col)
    # a bad row is named by its line in the file (numpy counted rows after the header, from 0)
    (tmp_path / "bad.csv").write_text("# survey export\nx,y,z\n1,2,3\n\n4,5,oops\n")
    with pytest.raises(ScanReadError, match=r"bad\.csv: malformed text row on line 5: '4,5,oops' is not 3 numbers"):
        read_cloud(tmp_path / "bad.csv")
    (tmp_path / "short.xyz").write_text("1 2 3\n4 5 6\n7 8\n")
    with pytest.raises(ScanReadError, match=r"line 3: 2 columns where the rows before have 3"):
        read_cloud(tmp_path / "short.xyz")


def test_las_and_laz(tmp_path, rng):
    import laspy

    pts = rng.uniform(0, 100, size=(300, 3))
    for suffix in ("las", "laz"):
        hdr = laspy.LasHeader(point_format=3, version="1.2")
        hdr.scales = [0.001] * 3
        hdr.offsets = [0.0] * 3
        las = laspy.LasData(hdr)
        las.x, las.y, las.z = pts[:, 0], pts[:, 1], pts[:, 2]
        las.intensity = np.arange(300, dtype=np.uint16)
        las.red = las.green = las.blue = np.full(300, 65535, np.uint16)
        las.write(tmp_path / f"a.{suffix}")
        c = read_cloud(tmp_path / f"a.{suffix}")
        np.testing.assert_allclose(c.points, pts, atol=1e-3)
        np.testing.assert_array_equal(c.intensity, np.arange(300))
        assert (c.colors == 255).all() and c.meta["encoding"] == suffix


# ---------------------------------------------------------------------------------- bad input

def _pcd(tmp_path, name, body: bytes):
    p = tmp_path / name
    p.write_bytes(body)
    return p


def test_truncated_binary_compressed(tmp_path, pcl_dir):
    data = (pcl_dir / "milk.pcd").read_bytes()
    p = _pcd(tmp_path, "trunc.pcd", data[: len(data) // 2])
    with pytest.raises(ScanReadError, match=r"trunc\.pcd: truncated binary_compressed PCD"):
        read_cloud(p)


def test_truncated_binary(tmp_path, rng):
    p = write_cloud(tmp_path / "b.pcd", rng.normal(size=(100, 3)).astype(np.float32), encoding="binary")
    data = p.read_bytes()
    p.write_bytes(data[:-50])
    with pytest.raises(ScanReadError, match="truncated binary PCD"):
        read_cloud(p)


HEADER = ("VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nCOUNT 1 1 1\nWIDTH {n}\nHEIGHT 1\n"
          "VIEWPOINT 0 0 0 1 0 0 0\nPOINTS {n}\nDATA ascii\n")


def test_header_data_mismatch(tmp_path):
    p = _pcd(tmp_path, "mismatch.pcd", (HEADER.format(n=10) + "1 2 3\n4 5 6\n").encode())
    with pytest.raises(ScanReadError, match=r"mismatch\.pcd: PCD header/data mismatch: 2 ascii rows, POINTS says 10"):
        read_cloud(p)
    bad = HEADER.format(n=4).replace("WIDTH 4", "WIDTH 3")
    p = _pcd(tmp_path, "wh.pcd", (bad + "1 2 3\n" * 4).encode())
    with pytest.raises(ScanReadError, match="WIDTH\\*HEIGHT"):
        read_cloud(p)


def test_empty_file(tmp_path):
    p = _pcd(tmp_path, "empty.pcd", b"")
    with pytest.raises(ScanReadError, match=r"empty\.pcd: empty file"):
        read_cloud(p)


def test_zero_point_cloud(tmp_path):
    p = _pcd(tmp_path, "zero.pcd", HEADER.format(n=0).encode())
    with pytest.raises(ScanReadError, match="zero-point cloud"):
        read_cloud(p)
    np.save(tmp_path / "zero.npy", np.zeros((0, 3), np.float32))
    with pytest.raises(ScanReadError, match="zero-point"):
        read_cloud(tmp_path / "zero.npy")


def test_all_nan_cloud(tmp_path):
    p = _pcd(tmp_path, "nan.pcd", (HEADER.format(n=3) + "nan nan nan\n" * 3).encode())
    with pytest.raises(ScanReadError, match="all 3 points are NaN"):
        read_cloud(p)


def test_unknown_extension(tmp_path):
    p = tmp_path / "scan.foo"
    p.write_bytes(b"123")
    with pytest.raises(ScanReadError, match=r"scan\.foo: unknown format '\.foo'"):
        read_cloud(p)


def test_garbage_and_wrong_shape(tmp_path):
    p = _pcd(tmp_path, "junk.pcd", b"\x00\x01garbage")
    with pytest.raises(ScanReadError, match="junk.pcd"):
        read_cloud(p)
    np.save(tmp_path / "flat.npy", np.zeros(12))
    with pytest.raises(ScanReadError, match=r"flat\.npy: NPY array must be \(N, 3\)"):
        read_cloud(tmp_path / "flat.npy")
    (tmp_path / "bad.ply").write_bytes(b"ply\nformat ascii 1.0\nelement vertex 3\nend_header\n")
    with pytest.raises(ScanReadError, match="bad.ply"):
        read_cloud(tmp_path / "bad.ply")


def test_nan_holes_are_dropped_with_pixel_index(tmp_path):
    body = "VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nCOUNT 1 1 1\nWIDTH 2\nHEIGHT 2\nPOINTS 4\nDATA ascii\n"
    body += "1 1 1\nnan nan nan\n2 2 2\n3 3 nan\n"
    c = read_cloud(_pcd(tmp_path, "org.pcd", body.encode()))
    np.testing.assert_array_equal(c.points, [[1, 1, 1], [2, 2, 2]])
    np.testing.assert_array_equal(c.pixel_index, [0, 2])


def test_text_columns_as_scanners_write_them(tmp_path):
    """Leica PTS (the point count first; x y z intensity r g b) gave the intensity as red and lost
    blue, or was refused for its count line; Excel's CSV (a byte-order mark) had "no x/y/z
    columns"; columns the reader does not know were dropped: they are kept, named by the header
    or by their place."""
    rows = "7.4050 -4.2637 2.0630 200 197 148 128\n1 2 3 10 20 30 40\n"
    (tmp_path / "a.pts").write_text("2\n" + rows)
    (tmp_path / "b.pts").write_text(rows)
    for name in ("a.pts", "b.pts"):
        c = read_cloud(tmp_path / name)
        assert c.points.tolist() == [[7.405, -4.2637, 2.063], [1, 2, 3]]
        assert c.colors.tolist() == [[197, 148, 128], [20, 30, 40]] and c.intensity.tolist() == [200, 10]
    assert read_cloud(tmp_path / "a.pts").meta["declared_points"] == 2
    (tmp_path / "c.xyz").write_text("7 -4 2 -1200 197 148 128\n1 2 3 -10 20 30 40\n")  # intensity not 0-255
    c = read_cloud(tmp_path / "c.xyz")
    assert c.intensity.tolist() == [-1200, -10] and c.colors.tolist() == [[197, 148, 128], [20, 30, 40]]
    (tmp_path / "d.csv").write_bytes("x,y,z,return\n1,2,3,1\n4,5,6,2\n".encode("utf-8-sig"))
    c = read_cloud(tmp_path / "d.csv")
    assert c.points.tolist() == [[1, 2, 3], [4, 5, 6]] and c.extra["return"].tolist() == [1, 2]
    (tmp_path / "e.xyz").write_text("1 2 3 0.5\n4 5 6 0.7\n")
    assert read_cloud(tmp_path / "e.xyz").extra["c3"].tolist() == [0.5, 0.7]
    (tmp_path / "f.pts").write_text("1 2 3 -7\n4 5 6 9\n")  # PTS without colour: x y z intensity
    assert read_cloud(tmp_path / "f.pts").intensity.tolist() == [-7, 9]


def test_npy_extra_columns_kept_and_complex_refused(tmp_path):
    a = np.arange(20, dtype=np.float64).reshape(5, 4)
    np.save(tmp_path / "a.npy", a)
    c = read_cloud(tmp_path / "a.npy")
    assert np.array_equal(c.points, a[:, :3]) and np.array_equal(c.extra["c3"], a[:, 3])
    np.save(tmp_path / "z.npy", np.ones((4, 3)) + 1j)  # the imaginary part was thrown away
    with pytest.raises(ScanReadError, match="non-real dtype complex128"):
        read_cloud(tmp_path / "z.npy")


def test_ply_and_structured_npy_keep_every_per_point_field(tmp_path, rng):
    """A PLY vertex's other properties (alpha, a label, a quality) and a structured NPY's fields
    (intensity, colours, time) are kept, as PCD's and XYZ's other fields are: both readers kept x/y/z
    and normals only (a PLY its colours and intensity too). A face list is not a point's field."""
    import struct

    n = 50
    v = np.zeros(n, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"),
                           ("blue", "u1"), ("alpha", "u1"), ("label", "<i4"), ("quality", "<f8")])
    for f in ("x", "y", "z"):
        v[f] = rng.random(n)
    v["red"], v["alpha"], v["label"], v["quality"] = 7, rng.integers(0, 256, n), rng.integers(0, 9, n), rng.random(n)
    props = "".join(f"property {t} {f}\n" for f, t in (("x", "float"), ("y", "float"), ("z", "float"),
                    ("red", "uchar"), ("green", "uchar"), ("blue", "uchar"), ("alpha", "uchar"), ("label", "int"),
                    ("quality", "double")))
    head = (f"ply\nformat binary_little_endian 1.0\nelement vertex {n}\n{props}element face 1\n"
            "property list uchar int vertex_indices\nend_header\n").encode()
    (tmp_path / "m.ply").write_bytes(head + v.tobytes() + struct.pack("<Biii", 3, 0, 1, 2))
    c = read_cloud(tmp_path / "m.ply")
    np.testing.assert_array_equal(c.points, np.stack([v["x"], v["y"], v["z"]], axis=1))
    assert (c.colors[:, 0] == 7).all() and set(c.extra) == {"alpha", "label", "quality"}
    for f in ("alpha", "label", "quality"):
        np.testing.assert_array_equal(c.extra[f], v[f])
    s = np.zeros(n, dtype=[("x", "f8"), ("y", "f8"), ("z", "f8"), ("intensity", "u2"), ("r", "u1"), ("g", "u1"),
                           ("b", "u1"), ("time", "f8"), ("note", "U3")])
    s["x"], s["intensity"], s["r"], s["time"], s["note"] = rng.random(n), 300, 9, rng.random(n), "abc"
    np.save(tmp_path / "s.npy", s)
    c = read_cloud(tmp_path / "s.npy")
    assert c.points.dtype == np.float64 and (c.intensity == 300).all() and (c.colors[:, 0] == 9).all()
    assert set(c.extra) == {"time"}  # a text field is not a per-point number
    np.testing.assert_array_equal(c.extra["time"], s["time"])
    store = ScanStore(tmp_path / "s.zarr", create=True)
    store.write_scan("s", c.arrays(), {})
    np.testing.assert_array_equal(store.read("s", "extra_time"), s["time"])
    np.save(tmp_path / "t.npy", s.reshape(5, 10))
    with pytest.raises(ScanReadError, match="one record a point"):
        read_cloud(tmp_path / "t.npy")


@pytest.mark.parametrize("name,write", [
    ("euro.csv", lambda P: "x;y;z\n" + "".join(f"{a:.4f};{b:.4f};{c:.4f}\n".replace(".", ",") for a, b, c in P)),
    ("euro_tab.txt", lambda P: "".join(f"{a:.4f}\t{b:.4f}\t{c:.4f}\n".replace(".", ",") for a, b, c in P)),
    ("euro_space.xyz", lambda P: "".join(f"{a:.4f} {b:.4f} {c:.4f}\n".replace(".", ",") for a, b, c in P)),
    ("quoted.csv", lambda P: '"x","y","z"\n' + "".join(f'"{a:.4f}","{b:.4f}","{c:.4f}"\n' for a, b, c in P)),
    ("trailing.csv", lambda P: "x,y,z\n" + "".join(f"{a:.4f},{b:.4f},{c:.4f},\n" for a, b, c in P)),
    ("utf16.xyz", lambda P: "".join(f"{a:.4f} {b:.4f} {c:.4f}\r\n" for a, b, c in P)),
])
def test_text_as_spreadsheets_and_windows_tools_write_it(tmp_path, rng, name, write):
    """Decimal commas (a European spreadsheet's CSV, with ';', tabs or spaces between the
    numbers), quoted numbers, a delimiter closing each row, and UTF-16 text (PowerShell's default,
    Notepad's "Unicode") read as the numbers they are: each was quarantined as a malformed row."""
    P = np.round(rng.random((40, 3)) * 100 - 50, 4)
    text = write(P)
    (tmp_path / name).write_bytes(text.encode("utf-16") if name.startswith("utf16") else text.encode())
    np.testing.assert_array_equal(read_cloud(tmp_path / name).points, P)


def test_text_with_a_decimal_comma_is_not_taken_for_commas_between_numbers(tmp_path):
    """Comma-separated whole numbers stay three columns; a row that is neither is still said."""
    (tmp_path / "ints.csv").write_text("1,2,3\n4,5,6\n")
    np.testing.assert_array_equal(read_cloud(tmp_path / "ints.csv").points, [[1, 2, 3], [4, 5, 6]])
    (tmp_path / "bad.csv").write_text("x;y;z\n1,5;2,5;3,5\n1,5;abc;3\n")
    with pytest.raises(ScanReadError, match="line 3"):
        read_cloud(tmp_path / "bad.csv")


def _pcd_bytes(fields, sizes, types, counts, n, data, body: bytes) -> bytes:
    head = [f"FIELDS {' '.join(fields)}", f"SIZE {' '.join(map(str, sizes))}", f"TYPE {' '.join(types)}"]
    if counts is not None:
        head.append(f"COUNT {' '.join(map(str, counts))}")
    return ("VERSION 0.7\n" + "\n".join(head) + f"\nWIDTH {n}\nHEIGHT 1\nPOINTS {n}\nDATA {data}\n").encode() + body


def test_pcd_fields_of_several_values_padding_and_no_count_line(tmp_path, rng):
    """A field of COUNT 33 (PCL's FPFH) is one (N, 33) array (it was 33 arrays fpfh__0000..),
    padding fields ("_") are not kept (pypcd4 renamed them at random: 'extra_#$%&~~bYILzw__0000'
    was stored), and a header without its optional COUNT line reads as one value a field, as PCL
    reads it (a two-line pydantic error quarantined it)."""
    n = 30
    P = rng.random((n, 3)).astype(np.float32)
    rec = np.zeros(n, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("_", "u1", (4,)), ("fpfh", "<f4", (33,)),
                             ("label", "<u4")])
    rec["x"], rec["y"], rec["z"] = P.T
    rec["fpfh"] = rng.random((n, 33))
    rec["label"] = np.arange(n)
    (tmp_path / "f.pcd").write_bytes(_pcd_bytes(["x", "y", "z", "_", "fpfh", "label"], [4, 4, 4, 1, 4, 4],
                                                ["F", "F", "F", "U", "F", "U"], [1, 1, 1, 4, 33, 1], n, "binary",
                                                rec.tobytes()))
    c = read_cloud(tmp_path / "f.pcd")
    assert set(c.extra) == {"fpfh", "label"}
    np.testing.assert_array_equal(c.extra["fpfh"], rec["fpfh"])
    np.testing.assert_array_equal(c.extra["label"], rec["label"])
    store = ScanStore(tmp_path / "s.zarr", create=True)
    store.write_scan("f", c.arrays(), {})
    np.testing.assert_array_equal(store.read("f", "extra_fpfh"), rec["fpfh"])
    body = "".join(f"{a} {b} {d}\n" for a, b, d in P).encode()
    (tmp_path / "nc.pcd").write_bytes(_pcd_bytes(["x", "y", "z"], [4, 4, 4], ["F", "F", "F"], None, n, "ascii", body))
    np.testing.assert_array_equal(read_cloud(tmp_path / "nc.pcd").points, P)


def test_a_reader_library_message_over_several_lines_is_one_line(tmp_path):
    """pydantic's message for a header pypcd4 refuses is three lines; the quarantine line and
    the store's reason are one line each."""
    head = b"VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F Q\nCOUNT 1 1 1\nWIDTH 1\nHEIGHT 1\nPOINTS 1\nDATA ascii\n"
    (tmp_path / "q.pcd").write_bytes(head + b"1 2 3\n")
    with pytest.raises(ScanReadError) as info:
        read_cloud(tmp_path / "q.pcd")
    assert "\n" not in info.value.reason and "Input should be 'F', 'U' or 'I'" in info.value.reason


def test_ply_coordinates_named_in_capitals(tmp_path):
    """``X Y Z`` (and ``NX``, ``Red``) are the coordinates, normals and colour, as in lower case
    (the file was quarantined: "PLY vertex has no 'x' property (has: X Y Z)")."""
    (tmp_path / "c.ply").write_bytes(b"ply\nformat ascii 1.0\nelement vertex 2\nproperty double X\nproperty double Y\n"
                                     b"property double Z\nproperty uchar Red\nproperty uchar Green\nproperty uchar Blue\n"
                                     b"end_header\n0 0.5 1 1 2 3\n1 0 0 4 5 6\n")
    c = read_cloud(tmp_path / "c.ply")
    np.testing.assert_array_equal(c.points, [[0, 0.5, 1], [1, 0, 0]])
    np.testing.assert_array_equal(c.colors, [[1, 2, 3], [4, 5, 6]])
    assert c.extra == {}
