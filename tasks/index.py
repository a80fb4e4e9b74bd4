"""A persisted, sharded KD-forest index in the scan store, and the worker-side shard operations.

Layout::

    STORE/indexes/<name>/
        reference   (N, d) float32   the reference descriptors, chunked by shard
        ref_scan    (N,)   int32     which reference scan each row came from (index into attrs.scans)
        ref_row     (N,)   int64     the row within that scan's descriptor array (keypoint number)
        shard_<i>/  perm child split_dim split_val start end lo hi  (the tree of shard i, built once)
      attrs: params, shards [[start, stop], ...], n, d, content_hash, scans, complete,
             library {name, content_hash} (an index over a model library, see below)

The reference is either the SHOT rows of reference scans (their describe stage) or a model
library's (:func:`collect_library_reference`: ``ModelLibrary.reference()``, in order, so a
search's id ``i`` is library row ``library.valid_rows[i]``, ``ref_scan`` the model and
``ref_row`` the library row). The recognize stage uses the matches against an index over its
own library instead of matching again.

The content hash covers the reference bytes and the parameters; building again with the same
reference and parameters is a no-op, and a change rebuilds. Workers load their shard (the rows
and the persisted tree) from the store, so shards never travel through the scheduler.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from scanforest.kernels.errors import InputError, OutOfMemory
from scanforest.kernels.knn.sharded import Shard, gather_rows, shard_ranges
from scanforest.kernels.knn.topk import merge_topk

from .store import ScanStore, _jsonable

log = logging.getLogger("scanforest")

TREE_ARRAYS = ("perm", "child", "split_dim", "split_val", "start", "end", "lo", "hi")
FOREST_KEYS = ("n_trees", "leaf_size", "backtracks", "method", "random_dims", "seed", "max_depth", "sliding_window",
               "split", "descent", "leaves_per_round", "recall", "graph_degree", "graph_budget", "graph_expand",
               "graph_rounds")


REFERENCE_DTYPES = ("float32", "float16")
#: the forest layout of a stored index where its parameters leave it out
STORED_LAYOUT = {"n_trees": 1, "leaf_size": 64}


def content_hash(reference: np.ndarray, params: dict[str, Any]) -> str:
    """SHA-256 over the parameters, the shape and dtype, and the SHA-256 of every 65,536-row
    block of the reference (blocks hashed on all cores: hashlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    step = 1 << 16

    def block(a: int) -> bytes:
        return hashlib.sha256(np.ascontiguousarray(reference[a:a + step]).tobytes()).digest()

    h = hashlib.sha256()
    h.update(json.dumps(_jsonable(params), sort_keys=True).encode())
    h.update(f"{reference.shape} {reference.dtype}".encode())
    with ThreadPoolExecutor() as pool:
        for digest in pool.map(block, range(0, reference.shape[0], step)):
            h.update(digest)
    return h.hexdigest()


def collect_reference(store: ScanStore, scans: list[str], array: str = "kp_shot"):
    """Stack the (finite) descriptor rows of ``scans``; returns reference, ref_scan, ref_row."""
    refs, sid, rows = [], [], []
    for j, s in enumerate(scans):
        a = store.read(s, array).astype(np.float32, copy=False)
        ok = np.flatnonzero(np.isfinite(a).all(axis=1))
        refs.append(a[ok])
        sid.append(np.full(len(ok), j, np.int32))
        rows.append(ok.astype(np.int64))
    if not refs or sum(len(r) for r in refs) == 0:
        raise InputError(f"no finite {array!r} rows in the reference scans {scans[:5]}...")
    return np.concatenate(refs), np.concatenate(sid), np.concatenate(rows)


def collect_library_reference(store: ScanStore, library: str):
    """The reference of an index over the stored model library ``library``: its finite descriptor
    rows in library order (``ModelLibrary.reference()``; read without loading the rest of it).

    Returns ``reference, ref_scan, ref_row, scans, source``: ``ref_scan`` the model of each row
    (an index into ``scans``, the library's model scans in its order), ``ref_row`` its library
    row (``valid_rows``), ``source`` ``{"name", "content_hash"}`` of the library (recorded in the
    index's attributes)."""
    attrs = store.catalog.find_library(library)
    if attrs is None:
        raise InputError(f"{store.path}: no complete model library {library!r} (build it first: "
                         "`scanforest recognize` or the archive flow builds it)")
    desc = store.catalog.library_arrays(library, ["descriptors"])["descriptors"].astype(np.float32, copy=False)
    rows = np.flatnonzero(np.isfinite(desc).all(axis=1))  # = ModelLibrary.valid_rows
    if len(rows) == 0:
        raise InputError(f"{store.path}: model library {library!r} has no finite descriptor")
    scans = list(attrs.get("model_scans") or attrs.get("names") or [])
    ref_scan = np.asarray(store.catalog.library_arrays(library, ["model_id"])["model_id"], np.int32)[rows]
    return (np.ascontiguousarray(desc[rows]), ref_scan, rows.astype(np.int64), scans,
            {"name": library, "content_hash": attrs["content_hash"]})


def build_index(store_path: str, name: str, reference: np.ndarray, *, shards: int = 1,
                params: dict[str, Any] | None = None, ref_scan=None, ref_row=None, scans=None,
                build_trees: bool = True, device: str = "cpu", dtype: str = "float32",
                library: dict[str, str] | None = None) -> dict[str, Any]:
    """Write ``reference`` as a sharded index ``name`` (no-op if the content hash matches).

    The hash covers the rows and the forest parameters, the split rule of the trees included
    when ``params`` leave it to the default, so a changed default rebuilds the index once.
    ``library`` (``{"name", "content_hash"}``, from :func:`collect_library_reference`) names the
    model library the rows came from; it is recorded in the attributes and hashed too, so the
    index of a rebuilt library is a new index even where its rows did not change.

    ``dtype="float16"`` stores the rows in half precision (half the disk and host memory;
    e.g. 100M SHOT352 rows are 70 GB instead of 141 GB). The trees are built on, and searches
    load, the stored (rounded) rows as float32, so every answer is exact for them.

    A path with no store gets one holding only the index (an index of generated or external
    rows, as ``bench match`` builds); the ``index build`` command refuses a missing store before
    it gets here.
    """
    from scanforest.kernels.knn.kdforest import KDForest

    store = ScanStore(store_path, create=True)
    params = {k: v for k, v in (params or {}).items() if k in FOREST_KEYS}
    if params.get("method", "banns") != "exact":  # the trees' split rule is part of the index, default or not
        params.setdefault("split", KDForest().split)
    if dtype not in REFERENCE_DTYPES:
        raise InputError(f"dtype must be one of {REFERENCE_DTYPES}, got {dtype!r}")
    if reference.ndim != 2 or reference.shape[0] == 0:
        raise InputError(f"reference must be a non-empty (N, d) array, got {reference.shape}")
    if dtype == "float16" and reference.dtype != np.float16:
        if max(float(reference.max()), -float(reference.min())) >= 65504:
            raise InputError("reference has values beyond float16's range (65504): store it as float32")
        reference = reference.astype(np.float16)
    if not _all_finite(reference):
        raise InputError("reference has NaN or infinite rows; drop them first")
    ranges = shard_ranges(reference.shape[0], shards)
    hashed = {**params, "shards": shards} if dtype == "float32" else {**params, "shards": shards, "dtype": dtype}
    if library is not None:
        library = {"name": str(library["name"]), "content_hash": str(library["content_hash"])}
        hashed["library"] = library
    digest = content_hash(reference, hashed)
    found = store.catalog.find_index(name)
    if found is not None and found.get("content_hash") == digest:
        return {"name": name, "status": "unchanged", "content_hash": digest, "n": int(reference.shape[0])}
    with store.catalog.new_index(name) as g:  # in place of the old one once whole
        t0 = time.perf_counter()
        rows = max(1, min(1 << 16, ranges[0][1] - ranges[0][0]))
        z = g.create_array("reference", shape=reference.shape, dtype=dtype, chunks=(rows, reference.shape[1]),
                           compressors=None)  # float descriptors barely compress; raw chunks load faster
        for i, j in _row_blocks(z, 0, reference.shape[0]):  # block by block: no whole-array copies
            z[i:j] = reference[i:j].astype(dtype, copy=False)
        if ref_scan is not None:
            store._write_array(g, "ref_scan", np.asarray(ref_scan, np.int32))
            store._write_array(g, "ref_row", np.asarray(ref_row, np.int64))
        build_s = []
        if build_trees and params.get("method", "banns") != "exact":
            from scanforest.kernels.backend import resolve_device

            dev = resolve_device(device)
            graph = params.get("graph_degree") is not None
            for i, (a, b) in enumerate(ranges):
                t = time.perf_counter()
                # the trees only (no leaf-ordered copy): one copy of the shard's rows on the device; a
                # graph is found by searching the rows, so its shard keeps them while it is built
                forest = _fit_forest(_stored_rows(reference, a, b, dev), params, i, dev, keep_rows=graph)
                grp = g.require_group(f"shard_{i}")
                _write_tree(store, grp, forest.tree_)
                if graph and getattr(forest, "graph_", None) is not None:
                    from scanforest.kernels.backend import to_numpy

                    store._write_array(grp, "graph", to_numpy(forest.graph_in_leaf_order()))
                    grp.attrs["graph"] = _jsonable({k: v for k, v in forest.graph_stats_.items() if k != "bytes"})
                del forest
                free_gpu_pool()  # a shard's rows and tree on the GPU: give them back before the next one
                build_s.append(time.perf_counter() - t)
        g.attrs.update({"params": _jsonable(params), "shards": [list(r) for r in ranges], "n": int(reference.shape[0]),
                        "d": int(reference.shape[1]), "dtype": dtype, "content_hash": digest, "scans": list(scans or []),
                        "build_seconds": build_s, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        **({"library": library} if library is not None else {}), "complete": True})
    return {"name": name, "status": "built", "content_hash": digest, "n": int(reference.shape[0]),
            "shards": len(ranges), "seconds": time.perf_counter() - t0, "tree_seconds": build_s}


# a float16 index keeps its leaf-ordered rows in half precision on GPUs (the search kernels widen
# them exactly in registers: the same answers, half the memory and half the bytes a leaf scan reads)
GPU_HALF_ROWS = True


def resident_row_bytes(dtype: str, device: str) -> int:
    """Bytes per value of a forest shard's resident rows: 2 for a float16 index on a GPU."""
    return 2 if (str(dtype) == "float16" and device == "gpu" and GPU_HALF_ROWS) else 4


def plan_for(n: int, d: int, params: dict[str, Any], device: str, *, k: int = 4, memory=None,
             dtype: str = "float32", shards: int | None = None, block: int | None = None):
    """The placement plan of an ``n`` x ``d`` reference stored as ``dtype`` on this machine's
    devices (or on workers of ``memory``: one value each), :func:`plan_shards`: as few shards as
    fit, in as many copies as the devices allow (``shards``: a fixed count, copies only). Trees
    built on a GPU count their float32 rows there. Raises :class:`InputError` when the index
    cannot fit them."""
    from scanforest.kernels.backend import device_memory, resolve_device
    from scanforest.kernels.knn.sharded import plan_shards

    dev = resolve_device(device)
    mem = memory if memory is not None else device_memory(dev)
    plan = plan_shards(n, d, mem, k=k, block=block, n_trees=int(params.get("n_trees") or 1),
                       leaf_size=int(params.get("leaf_size") or 64), method=params.get("method") or "banns",
                       device=dev, row_bytes=resident_row_bytes(dtype, dev),
                       build_row_bytes=4 if dev == "gpu" else 0, shards=shards,
                       graph_degree=int(params.get("graph_degree") or 0))
    if not plan.fits:
        raise InputError(f"an index of {n:,} x {d} rows does not fit {len(mem)} {dev} device(s) of "
                         f"{min(mem) / 2**30:.1f} GiB: {plan.describe()}; it needs at least {plan.min_workers} "
                         "such devices (or a smaller reference)")
    return plan


def _all_finite(a: np.ndarray, step: int = 1 << 18) -> bool:
    """``np.isfinite(a).all()`` block by block on all cores (no full-size temporary); float16
    is checked on its exponent bits (numpy's float16 arithmetic is slow)."""
    from concurrent.futures import ThreadPoolExecutor

    def ok(i: int) -> bool:
        blk = a[i:i + step]
        if blk.dtype == np.float16:
            return bool(((np.ascontiguousarray(blk).view(np.uint16) & 0x7C00) != 0x7C00).all())
        return bool(np.isfinite(blk).all())

    with ThreadPoolExecutor() as pool:
        return all(pool.map(ok, range(0, a.shape[0], step)))


def _fit_forest(X, params: dict[str, Any], shard: int, device: str, keep_rows: bool = True):
    from scanforest.kernels.knn.kdforest import KDForest

    # a stored index keeps its layout whatever device builds it: one tree of 64-row leaves unless
    # its parameters say otherwise (what the memory plans assume; KDForest's own defaults differ by device)
    p = dict(params)
    for key, value in STORED_LAYOUT.items():
        if p.get(key) is None:
            p[key] = value
    p["seed"] = int(p.get("seed", 0)) + shard
    recall = p.pop("recall", None)
    return _searched_at(KDForest(device=device, **p).fit(X, keep_rows=keep_rows), recall if keep_rows else None)


def _searched_at(forest, recall):
    """``forest``, its queries that name no budget searched at the recall target ``recall``
    (an index built with ``--recall``): each shard calibrates its budget per ``k`` on its own
    rows at its first such query (:meth:`KDForest.calibrate`)."""
    if recall is not None:
        from scanforest.kernels.knn.kdforest import check_recall

        forest.recall_target_ = check_recall(recall)
    return forest


def _write_tree(store: ScanStore, grp, tree) -> None:
    from scanforest.kernels.backend import to_numpy

    for name in TREE_ARRAYS:
        store._write_array(grp, name, to_numpy(getattr(tree, name)))
    # root node of every tree of a packed forest; a single tree is stored as [0]
    roots = np.zeros(1, np.int32) if tree.roots is None else to_numpy(tree.roots).astype(np.int32)
    store._write_array(grp, "roots", roots)
    grp.attrs.update({"depth": int(tree.depth), "leaf_size": int(tree.leaf_size), "params": _jsonable(tree.params)})


def _shard_nbytes(shard: Shard) -> int:
    """Bytes a resident shard holds (rows and tree), for Dask's placement decisions."""
    f = shard.forest
    total = int(getattr(getattr(f, "_fit_X", None), "nbytes", 0)) + int(getattr(getattr(f, "graph_", None), "nbytes", 0))
    tree = getattr(f, "tree_", None)
    if tree is not None:
        for name in TREE_ARRAYS + ("points",):
            total += int(getattr(getattr(tree, name, None), "nbytes", 0))
    return max(total, 1)


try:  # without it Dask sizes a Shard at ~50 bytes and happily copies it to where the queries are
    from dask.sizeof import sizeof as _sizeof

    _sizeof.register(Shard)(_shard_nbytes)
except ImportError:  # pragma: no cover - dask is a dependency
    pass


def _pin_on_dask_cuda() -> bool:
    """On a dask-cuda worker, keep resident shards out of its spilling: its DeviceHostFile
    counts a Shard (not a CUDA array) as host data and would write it to disk once the host
    share is full (a 100M x 352 index puts 74 GiB in each shard); objects that dask-cuda
    calls "spillable" manage themselves and stay. Done in the worker when a shard loads (where
    dask-cuda is already imported); True when registered."""
    import sys

    if "dask_cuda" not in sys.modules:
        return False
    try:
        from dask_cuda.is_spillable_object import is_spillable_object
    except Exception:  # another dask-cuda layout: its default spilling applies
        return False
    is_spillable_object.register(Shard)(lambda shard: True)
    return True


@dataclass(frozen=True)
class StoredShards:
    """The shards of index ``name`` in the store at ``store_path``, as a :class:`DistributedIndex`
    loads them (``attrs``: the index's attributes, read once; ``load``: :func:`load_shard`)."""

    store_path: str
    name: str

    @functools.cached_property
    def attrs(self) -> dict[str, Any]:
        return ScanStore(self.store_path, mode="r").catalog.index_attrs(self.name)

    @property
    def key(self) -> str:
        return self.name

    def load(self, shard: int, device: str = "auto", method: str | None = None) -> Shard:
        return load_shard(self.store_path, self.name, shard, device, method)


def load_shard(store: str | ScanStore, name: str, shard: int, device: str = "auto", method: str | None = None) -> Shard:
    """Load shard ``shard`` of index ``name`` on this worker (GPU when ``device`` resolves to it);
    ``store``: the opened store, or its path (opened here).

    The persisted tree is used as it is, and the device holds one copy of the rows, in the
    tree's leaf order; an index written without trees builds the shard's tree here.
    ``method="exact"`` loads the rows only and searches them by brute force (the exact
    baseline on the same shards and workers).
    """
    from scanforest.kernels.backend import resolve_device
    from scanforest.kernels.knn.kdtree import KDTree

    _pin_on_dask_cuda()
    st = store if isinstance(store, ScanStore) else ScanStore(store, mode="r")
    g = st.catalog.index_group(name)
    attrs = dict(g.attrs)
    a, b = attrs["shards"][shard]
    z = g["reference"]  # float32, or float16 (widened on the device after the upload)
    dev = resolve_device(device)
    params = dict(attrs["params"])
    if method is not None:
        params["method"] = method
    if params.get("method", "banns") == "exact":  # float16 stays float16 on a GPU: half the memory
        half = resident_row_bytes(str(z.dtype), dev) == 2
        return Shard(a, b, _fit_forest(_stored_rows(z, a, b, dev, dtype=np.float16 if half else np.float32),
                                       params, shard, dev))
    if f"shard_{shard}" not in g:
        return Shard(a, b, _fit_forest(_stored_rows(z, a, b, dev), params, shard, dev))
    tg = g[f"shard_{shard}"]
    if dev == "gpu":
        import cupy as xp
    else:
        xp = np
    perm = np.asarray(tg["perm"][...], np.int64)
    if perm.size % max(1, int(b - a)) or (perm.size and (perm.min() < 0 or perm.max() >= b - a)):
        raise InputError(f"index {name!r} shard {shard} in {st.path}: its tree's permutation does not "
                         f"index its {b - a} rows (a damaged store: rebuild the index)")
    arrays = {k: xp.asarray(tg[k][...]) for k in TREE_ARRAYS if k != "perm"}
    arrays["perm"] = xp.asarray(perm)
    roots = np.asarray(tg["roots"][...], np.int32) if "roots" in tg else np.zeros(1, np.int32)
    arrays["roots"] = None if roots.shape == (1,) else xp.asarray(roots)
    # one copy of the rows on the device: the leaf-ordered ones; the exact fallbacks search
    # them through ``perm`` (same answer as on the rows in input order)
    half = resident_row_bytes(str(z.dtype), dev) == 2
    points = _leaf_rows(z, a, b, perm, dev, dtype=np.float16 if half else np.float32)
    tree = KDTree(dev, points=points, depth=int(tg.attrs["depth"]), leaf_size=int(tg.attrs["leaf_size"]),
                  params=dict(tg.attrs.get("params", {})), data=None, **arrays)
    forest = resident_forest(tree, params, shard, dev, int(b - a))
    if "graph" in tg:  # over the leaf-ordered rows the shard holds (KDForest.graph_in_leaf_order)
        graph = np.asarray(tg["graph"][...], np.int32)
        if graph.shape[0] != b - a or (graph.size and (graph.min() < -1 or graph.max() >= b - a)):
            raise InputError(f"index {name!r} shard {shard} in {st.path}: its graph does not join its {b - a} rows "
                             "(a damaged store: rebuild the index)")
        forest.set_leaf_graph(xp.asarray(graph))
    return Shard(a, b, forest)


def resident_forest(tree, params: dict[str, Any], shard: int, dev: str, rows: int):
    """A fitted KDForest around a built ``tree`` whose ``points`` are the shard's leaf-ordered
    rows (one copy of the rows on the device; the exact fallbacks search them through ``perm``)."""
    from scanforest.kernels.knn.kdforest import KDForest

    p = dict(params)
    p["seed"] = int(p.get("seed", 0)) + shard
    recall = p.pop("recall", None)
    forest = KDForest(device=dev, **p)
    forest._validate()
    forest.device_, forest.n_samples_fit_, forest.n_features_in_ = dev, int(rows), int(tree.points.shape[1])
    forest._fit_X, forest.tree_, forest.stats_ = None, tree, {}
    return _searched_at(forest, recall)


# rows per host block when a shard streams from the store to a GPU (a whole number of chunks):
# the host then never holds a whole shard (at 50M x 352 float16 one is 35 GB, and the workers
# of a machine share its memory)
STREAM_BYTES = 1 << 28


def _row_blocks(z, a: int, b: int, nbytes: int = STREAM_BYTES):
    """Chunk-aligned ``[i, j)`` row ranges covering ``[a, b)`` of the stored array ``z`` (or of
    a host array), about ``nbytes`` each."""
    c = int(getattr(z, "chunks", (1,))[0])  # a numpy array: any row
    row = int(np.prod(z.shape[1:])) * z.dtype.itemsize
    step = max(1, nbytes // max(1, row * c)) * c
    i = a
    while i < b:
        j = min(b, (i // c) * c + step)
        yield i, j
        i = j


def _stored_rows(z, a: int, b: int, dev: str, nbytes: int = STREAM_BYTES, dtype=np.float32):
    """Rows ``a:b`` of the stored reference ``z`` (or of a host array) as float32 on ``dev``
    (or float16 on a GPU from a float16 store: ``dtype=np.float16``).

    To a GPU they stream in blocks of about ``nbytes``: float16 travels as it is and is widened
    there, and neither side ever holds a second whole copy (``cupy.asarray`` of a host array
    stages all of it in page-locked memory, which CuPy's pinned pool then keeps: a 35 GB
    upload left 35 GB of the host's memory pinned).
    """
    if dev != "gpu":
        return np.ascontiguousarray(z[a:b], dtype=np.float32)
    import cupy as cp

    dtype = np.dtype(dtype)
    if dtype == np.float16 and z.dtype != np.float16:
        raise InputError("float16 rows need a float16 store (rounding here would change the answers)")
    out = cp.empty((b - a,) + tuple(z.shape[1:]), dtype)
    for i, j in _row_blocks(z, a, b, nbytes):
        out[i - a:j - a] = cp.asarray(z[i:j])
    _free_pinned()
    return out


def _free_pinned() -> None:
    """Give the staging buffers of finished uploads back to the host."""
    import cupy as cp

    cp.cuda.get_current_stream().synchronize()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def _leaf_rows(z, a: int, b: int, perm: np.ndarray, dev: str, *, where: str = "auto",
               nbytes: int = STREAM_BYTES, dtype=np.float32):
    """``z[a:b][perm]`` as ``dtype`` on ``dev`` (float32; on a GPU also float16 from a float16
    store): a shard's rows in its trees' leaf order.

    On a GPU the gather happens where there is room for it: ``where="device"`` streams the rows
    in their stored dtype to the GPU and gathers there (the host holds one block at a time; the
    GPU briefly holds the stored rows beside the float32 result), ``where="host"`` reads the
    rows into host memory once and uploads them gathered, block by block (no second copy on
    either side); ``"auto"`` picks the device when its free memory holds both with a quarter
    to spare.
    """
    if dev != "gpu":
        return np.ascontiguousarray(gather_rows(np.ascontiguousarray(z[a:b]), perm), dtype=np.float32)
    import cupy as cp

    from scanforest.kernels.backend import free_memory

    dtype = np.dtype(dtype)
    if dtype == np.float16 and z.dtype != np.float16:
        raise InputError("float16 leaf rows need a float16 store (rounding here would change the answers)")
    shape = tuple(z.shape[1:])
    row = int(np.prod(shape))
    out_bytes = perm.size * row * dtype.itemsize
    if where == "auto":
        need = (b - a) * row * z.dtype.itemsize + out_bytes
        where = "device" if free_memory("gpu")[0] >= 1.25 * need else "host"
    if where not in ("device", "host"):
        raise ValueError(f"where must be 'auto', 'device' or 'host', got {where!r}")
    out = cp.empty((perm.size,) + shape, dtype)
    step = max(1, nbytes // max(1, row * dtype.itemsize))
    if where == "device":
        rows = cp.empty((b - a,) + shape, z.dtype)
        for i, j in _row_blocks(z, a, b, nbytes):
            rows[i - a:j - a] = cp.asarray(z[i:j])
        for i in range(0, perm.size, step):
            out[i:i + step] = rows[cp.asarray(perm[i:i + step])]
        del rows
    else:
        X = z[a:b]
        for i in range(0, perm.size, step):
            out[i:i + step] = cp.asarray(gather_rows(X, perm[i:i + step]))
        del X
    _free_pinned()
    return out


def search_shard(shard: Shard, Q, k: int, *, min_block: int = 256, stats: bool = False,
                 skip_invalid: bool = False, **search):
    """Top-k of one shard for a query block, on the host as numpy; an out-of-memory error splits
    the block in halves and retries (down to ``min_block`` rows) instead of failing the run.

    ``search`` (``bounds=`` per-query squared-distance bounds, ``backtracks=`` budget) goes to
    :meth:`KDForest.query`. With ``stats=True`` the result is ``(dist2, ids, stats)`` where
    ``stats`` is ``{"leaves": leaves this shard scanned for the block (0 for brute force),
    "seconds": time spent in the search}``. ``skip_invalid``: rows that are not all finite (a
    keypoint without a descriptor, as a block of :class:`StoredQueries` holds them) are not
    searched and answer ``(inf, -1)``.
    """
    from scanforest.kernels.backend import to_numpy

    if skip_invalid:
        ok = np.isfinite(np.asarray(Q)).all(axis=1)
        if not ok.all():
            return _search_valid(shard, np.asarray(Q), ok, k, min_block=min_block, stats=stats, **search)
    t0 = time.perf_counter()
    try:
        with _search_stream(shard):
            d, i, st = shard.query(Q, k, return_stats=True, **search)
            d, i = to_numpy(d), to_numpy(i)
            if not stats:
                return d, i
            lv = st.get("leaves_visited")
            return d, i, {"leaves": 0 if lv is None else int(np.asarray(to_numpy(lv), np.int64).sum()),
                          "seconds": time.perf_counter() - t0}
    except (MemoryError, OutOfMemory) as exc:
        err = exc
    except Exception as exc:  # cupy.cuda.memory.OutOfMemoryError is not a MemoryError subclass
        if "OutOfMemory" not in type(exc).__name__:
            raise
        err = exc
    if len(Q) <= min_block:
        raise OutOfMemory(f"shard [{shard.start}, {shard.stop}) cannot search even {len(Q)} queries: {err}")
    log.warning("shard [%d, %d): out of memory on a block of %d queries; searching it in halves",
                shard.start, shard.stop, len(Q))
    free_gpu_pool()
    h = len(Q) // 2
    b = search.get("bounds")
    halves = []
    for sl in (slice(None, h), slice(h, None)):
        kw = dict(search)
        if b is not None and np.ndim(b) == 1:
            kw["bounds"] = b[sl]
        halves.append(search_shard(shard, Q[sl], k, min_block=min_block, stats=stats, **kw))
    out = (np.concatenate([halves[0][0], halves[1][0]]), np.concatenate([halves[0][1], halves[1][1]]))
    return out + (_add_stats(halves[0][2], halves[1][2]),) if stats else out


def _search_valid(shard: Shard, Q: np.ndarray, ok: np.ndarray, k: int, *, stats: bool, **search):
    """:func:`search_shard` of the rows ``ok`` of ``Q``; the others answer ``(inf, -1)``."""
    m = len(Q)
    dist = np.full((m, k), np.inf, np.float32)
    ids = np.full((m, k), -1, np.int64)
    st = {"leaves": 0, "seconds": 0.0}
    if ok.any():
        b = search.get("bounds")
        if b is not None and np.ndim(b) == 1:
            search = {**search, "bounds": np.asarray(b)[ok]}
        res = search_shard(shard, Q[ok], k, stats=True, **search)
        dist[ok], ids[ok], st = res[0], res[1], res[2]
    return (dist, ids, st) if stats else (dist, ids)


_STREAMS = threading.local()


def _search_stream(shard: Shard):
    """The calling thread's own CUDA stream for a GPU shard's searches (a null context on the
    host). A worker with two threads then runs two query blocks on one GPU side by side: one
    block's host syncs and small launches leave the GPU idle, the other fills it (one H100,
    10M x 352, 4 GPUs: 1.13-1.17M -> 1.21-1.23M queries/s at 1M queries). One stream per
    thread, kept: CuPy's memory pool keeps freed blocks per stream. A blocking stream: it waits
    for work on the legacy default stream (queries a SHOT kernel of the one-pass pipeline just
    wrote there), and two of them run side by side."""
    if getattr(shard.forest, "device_", "cpu") != "gpu":
        return contextlib.nullcontext()
    import cupy as cp

    dev = cp.cuda.Device().id
    streams = _STREAMS.__dict__.setdefault("by_device", {})
    if dev not in streams:
        streams[dev] = cp.cuda.Stream(non_blocking=False)
    return streams[dev]


def _add_stats(*stats, seconds: float = 0.0) -> dict:
    return {"leaves": sum(int(s["leaves"]) for s in stats),
            "seconds": seconds + sum(float(s["seconds"]) for s in stats)}


def free_gpu_pool() -> None:
    """Give CuPy's cached device and pinned host blocks back (a no-op without CuPy): between
    shards here, and on every worker of a cluster before a bench's next case."""
    from scanforest.kernels.backend import release_gpu_cache

    release_gpu_cache()


@dataclass(frozen=True)
class QueryFile:
    """Query rows in an ``.npy`` file that every worker can read (a local disk on one host, a
    shared file system across hosts): a distributed match reads each block on the workers that
    search it, so no query byte goes through the client, whose one connection otherwise carries
    every block (about 2 GB/s of float32 SHOT rows: the ceiling of four H100s matching from one
    client). Made with :meth:`write` or from any ``(M, d)`` ``.npy``."""
    path: str

    @staticmethod
    def write(path, Q) -> "QueryFile":
        import os

        path = os.path.abspath(str(path))
        np.save(path, np.ascontiguousarray(Q, dtype=np.float32))
        return QueryFile(path)

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape, from the file's header."""
        return tuple(self._map().shape)

    def read(self, a: int, b: int) -> np.ndarray:
        """Rows ``[a, b)`` as contiguous float32 (a block read where it is searched)."""
        return np.ascontiguousarray(self._map()[a:b], dtype=np.float32)

    def _map(self):
        try:
            return np.load(self.path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise InputError(f"{self.path}: cannot read the queries ({exc})") from None


@dataclass(frozen=True)
class StoredQueries:
    """The descriptors of described scans, as one query array read on the workers that search it
    (:meth:`~scanforest.flows.distributed.DistributedIndex.query`): rows ``[a, b)`` of the scans'
    ``array`` stacked in order, keypoints without a descriptor included (they answer
    ``(inf, -1)``). The flow that matches them sends a store path and row counts, not rows: on
    several GPUs the client's one connection otherwise carries every descriptor. The workers must
    see the store (as every stage's workers do)."""
    store: str
    scans: tuple[str, ...]
    rows: tuple[int, ...]
    d: int
    array: str = "kp_shot"

    @staticmethod
    def of(st: ScanStore, scan_ids, array: str = "kp_shot", records=None) -> "StoredQueries":
        """The scans' rows, from their describe records (the array's shape written with it;
        ``records``: those records where the caller has read them already)."""
        rows, d = [], None
        for j, sid in enumerate(scan_ids):
            rec = (st.stage(sid, "describe") if records is None else records[j]) or {}
            shape = ((rec.get("arrays") or {}).get(array) or {}).get("shape")
            if not shape:  # a record without the arrays' shapes (an older store): read the array
                shape = st.read(sid, array).shape
            rows.append(int(shape[0]))
            d = int(shape[1]) if len(shape) > 1 else d
        return StoredQueries(st.path, tuple(scan_ids), tuple(rows), int(d or 0), array)

    @property
    def path(self) -> str:  # named in errors, as a query file's path is
        return self.store

    @property
    def shape(self) -> tuple[int, int]:
        return (int(sum(self.rows)), self.d)

    def read(self, a: int, b: int) -> np.ndarray:
        """Rows ``[a, b)`` as contiguous float32, the store opened once."""
        st = ScanStore(self.store, mode="r")
        out, start = [], 0
        for sid, n in zip(self.scans, self.rows):
            lo, hi = max(a, start), min(b, start + n)
            if lo < hi:
                out.append(np.asarray(st.read(sid, self.array)[lo - start:hi - start], dtype=np.float32))
            start += n
            if start >= b:
                break
        if not out:
            return np.zeros((0, self.d), np.float32)
        return np.ascontiguousarray(np.concatenate(out) if len(out) > 1 else out[0])


def merge_parts(*parts, k: int):
    """Global top-k of per-shard ``(dist2, ids)`` parts; ``(dist2, ids, stats)`` parts keep the
    summed statistics (leaves, and seconds including this merge) as a third element."""
    if parts and len(parts[0]) == 3:
        t0 = time.perf_counter()
        d, i = merge_topk([(p[0], p[1]) for p in parts], k)
        return d, i, _add_stats(*(p[2] for p in parts), seconds=time.perf_counter() - t0)
    return merge_topk(list(parts), k)


def kth_bound(part) -> np.ndarray:
    """The global k-th squared distance of each query (``inf`` where fewer than k were found):
    the bound that the second phase of a bound synchronisation prunes with."""
    d = np.asarray(part[0], np.float32)
    # one ulp above: a point at exactly the k-th distance with a smaller id than the one phase 1
    # found must still be returned by phase 2 (the tie rule orders by id)
    return np.ascontiguousarray(np.nextafter(d[:, -1], np.float32(np.inf)))


def merge_phases(first, second, k: int):
    """Union of the two phases of a synchronised search, duplicates removed (a point found in
    both phases counts once); leaf counts summed."""
    from scanforest.kernels.knn.kdforest import merge_topk_unique

    t0 = time.perf_counter()
    d, i = merge_topk_unique([(first[0], first[1]), (second[0], second[1])], k)
    return d, i, _add_stats(first[2], second[2], seconds=time.perf_counter() - t0)
