"""``scanforest bench tools``: the KD-forest side by side with FLANN and FAISS.

One data set (synthetic Gaussian clusters, or SHOT352 of real clouds), one exact answer (the
brute force), and on it every tool's recall@P / queries-per-second curve:

* scanforest's KD-forest (``KDForest``: ``--trees`` randomized trees sharing one budget of
  ``--budgets`` leaves per query), on the CPU or the GPU; with ``--recall``, also ``KDForest()``
  with the device's defaults searched at each recall target (the budget the index calibrates on
  its own rows, the calibration's time and estimate reported);
* FLANN's randomized KD-forest (``KDTreeIndex``, the forest PCL's recognition matches SHOT
  with), an external program (``deploy/baselines/flann_knn_bench.cpp``) given by
  ``--flann-baseline``, with ``--flann-trees`` trees (default: the same) and ``--flann-checks``
  points per query;
* FAISS (``faiss-cpu`` when installed): ``IndexFlatL2`` (exact), ``IndexIVFFlat`` over
  ``--nprobe`` lists and ``IndexHNSWFlat`` over ``--ef-search``;
* with ``--device gpu`` and a ``faiss-gpu`` build: ``GpuIndexFlatL2``, ``GpuIndexIVFFlat`` over
  ``--gpu-nprobe`` and ``GpuIndexCagra`` (cuVS) over ``--itopk``, on the same GPU in the same run.

With ``--batches``, every tool but FLANN is also timed searching the queries in consecutive
batches of each size (one call per batch, as recognition queries 2k-20k keypoints a scene), its
recall measured on those answers, and compared at matched recall within each batch size.

CPU tools run on ``--threads`` threads (numba, OpenMP). Recall counts a returned neighbour when
its canonical distance (:func:`scanforest.kernels.knn.bruteforce.pair_distances`, the brute force's
own arithmetic) is at most the exact P-th distance, for every tool alike. The last rows compare
scanforest with each tool at matched recall: for every ``--target``, the fastest measured point
of each at recall >= the target (scanforest's exact brute force included, at recall 1), with no
interpolation.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from scanforest.kernels.errors import InputError

from ._data import _best_at, _ivf_lists, _ivf_train_rows, _timeit, canonical_recall, clustered


def _host_ids(ids) -> np.ndarray:
    """Answer ids as int64 numpy (from numpy, CuPy or PyTorch)."""
    if hasattr(ids, "cpu"):
        ids = ids.cpu().numpy()
    elif hasattr(ids, "get"):
        ids = ids.get()
    return np.asarray(ids).astype(np.int64, copy=False)


def _batched(rep, search, Qs, X, Q, k, ed, sync, repeat, batches, name, setting, where, curves, **extra):
    """``search(Q_part) -> (dist, ids)`` timed over the queries ``Qs`` (``Q`` as the tool takes
    them: host, CuPy or PyTorch) in consecutive batches of each size in ``batches`` (one call per
    batch; the answers gathered after the clock stops), with the recall of those answers against
    ``ed``: rows ``... queries/s, SETTING, batches of B`` and each size's curve point in
    ``curves[B][name]``. Sizes not smaller than the query set are the full-set row already."""
    m = len(Q)
    for b in batches:
        if b >= m:
            continue
        t, parts = _timeit(lambda: [search(Qs[a:a + b]) for a in range(0, m, b)], sync, repeat)
        ids = np.concatenate([_host_ids(p[1]) for p in parts])
        r = canonical_recall(X, Q, ids, ed, k)
        rep.add(f"{name} queries/s, {setting}, batches of {b} (recall@{k} {r:.3f})", m / t, "queries/s", where,
                recall=r, batch=b, **extra)
        curves.setdefault(b, {}).setdefault(name, []).append((m / t, r, setting))


def _recorder(rep, faiss, X, Q, k, ed, where, prefix, sync, repeat, base, curves, batches=(), batch_curves=None):
    """``record(go, label, setting, build_s, part=None)``: time ``go()`` (a search of all of ``Q``),
    score its ids, add the rows and the point of the tool's curve (FAISS on the host and on the
    GPU); with ``part`` (the same search of a slice of the queries) also at each of ``batches``."""
    m = len(Q)

    def record(go, label, setting, build_s, part=None, queries=None):
        t, (_, ids) = _timeit(go, sync, repeat)
        r = canonical_recall(X, Q, _host_ids(ids), ed, k)
        rep.add(f"{prefix} {label} queries/s, {setting}", m / t, "queries/s", where, baseline=base[0],
                baseline_value=base[1], recall=r, build_s=build_s, faiss=faiss.__version__)
        rep.add(f"{prefix} {label} recall@{k}, {setting}", r, "", where)
        curves.setdefault(f"{prefix} {label}", []).append((m / t, r, setting))
        if part is not None and batches:
            _batched(rep, part, Q if queries is None else queries, X, Q, k, ed, sync, repeat, batches,
                     f"{prefix} {label}", setting, where, batch_curves, build_s=build_s)

    return record


def _flat_and_ivf(rep, search, X, where, prefix, names, make_flat, make_ivf, nlist, nprobes, sync):
    """The exhaustive index, then IVF-Flat over ``nprobes`` (FAISS on the host and on the GPU
    alike): ``names`` are the two indexes' labels, ``make_ivf(nlist)`` builds an empty IVF."""
    t0 = time.perf_counter()
    flat = make_flat()
    flat.add(X)
    sync()
    search(flat, names[0], "exhaustive", time.perf_counter() - t0)
    del flat
    if not nprobes:
        return
    nl = _ivf_lists(len(X), nlist)
    t0 = time.perf_counter()
    ivf = make_ivf(nl)
    ivf.train(_ivf_train_rows(X, nl))
    ivf.add(X)
    sync()
    build = time.perf_counter() - t0
    rep.add(f"{prefix} {names[1]} build (nlist={nl})", build, "s", where, higher_is_better=False)
    for p in nprobes:
        ivf.nprobe = int(p)
        search(ivf, f"{names[1]} nlist={nl}", f"nprobe={p}", build)


def _faiss_rows(rep, X, Q, k, ed, threads, cdev, **kw):
    """FAISS Flat, IVF-Flat and HNSW on the host on ``threads`` threads: rows, and
    ``{tool: [(q/s, recall, setting)]}``. FAISS's thread count is restored afterwards."""
    try:
        import faiss
    except ImportError:
        rep.note("FAISS rows skipped: faiss is not installed (pip install faiss-cpu)")
        return {}
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(threads)
    try:
        return _faiss_curves(faiss, rep, X, Q, k, ed, cdev, **kw)
    finally:
        faiss.omp_set_num_threads(before)


def _faiss_curves(faiss, rep, X, Q, k, ed, cdev, *, nlist, nprobes, hnsw_m, ef_construction, ef_search, repeat,
                  base, batches=(), batch_curves=None):
    d = X.shape[1]
    curves = {}
    record = _recorder(rep, faiss, X, Q, k, ed, cdev, "FAISS", lambda: None, repeat, base, curves, batches,
                       batch_curves)

    def search(index, label, setting, build_s):
        record(lambda: index.search(Q, k), label, setting, build_s, part=lambda q: index.search(q, k))

    _flat_and_ivf(rep, search, X, cdev, "FAISS", ("IndexFlatL2 (exact)", "IndexIVFFlat"), lambda: faiss.IndexFlatL2(d),
                  lambda nl: faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, nl), nlist, nprobes, lambda: None)
    if ef_search:
        t0 = time.perf_counter()
        hnsw = faiss.IndexHNSWFlat(d, hnsw_m)
        hnsw.hnsw.efConstruction = ef_construction
        hnsw.add(X)
        build = time.perf_counter() - t0
        rep.add(f"FAISS IndexHNSWFlat build (M={hnsw_m}, efConstruction={ef_construction})", build, "s", cdev,
                higher_is_better=False)
        for ef in ef_search:
            hnsw.hnsw.efSearch = max(int(ef), k)
            search(hnsw, f"IndexHNSWFlat M={hnsw_m}", f"efSearch={ef}", build)
        del hnsw
    return curves


def _faiss_gpu_rows(rep, X, Q, k, ed, gdev, sync, *, nlist, nprobes, cagra_degrees, itopk, repeat, base, batches=(),
                    batch_curves=None):
    """FAISS on the GPU (``faiss-gpu``, with cuVS where it was built with it): GpuIndexFlatL2
    (exhaustive), GpuIndexIVFFlat over ``nprobes`` and GpuIndexCagra over ``itopk`` (an index at
    each of ``cagra_degrees``). The queries
    stay on the device when PyTorch is there to hand them over (``faiss.contrib.torch_utils``,
    DLPack from CuPy), as the forest's do; otherwise they go from the host (noted). Rows, and
    ``{tool: [(q/s, recall, setting)]}``."""
    try:
        import faiss
    except ImportError:
        rep.note("FAISS GPU rows skipped: faiss is not installed")
        return {}
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
        rep.note(f"FAISS GPU rows skipped: this faiss {faiss.__version__} has no GPU support (faiss-gpu)")
        return {}
    from scanforest.kernels.backend import to_numpy

    d = X.shape[1]
    Xh, Qh = np.ascontiguousarray(to_numpy(X)), np.ascontiguousarray(to_numpy(Q))
    qin, where = Qh, "host arrays, transfers included"
    try:
        import faiss.contrib.torch_utils  # noqa: F401  (GPU indexes then take CUDA tensors)
        import torch

        qin, where = torch.from_dlpack(Q), "device arrays (PyTorch via DLPack)"
    except Exception:
        pass
    cuvs = "CUVS" in faiss.get_compile_options()
    rep.note(f"FAISS {faiss.__version__} GPU ({'with' if cuvs else 'without'} cuVS): queries from {where}")
    res = faiss.StandardGpuResources()
    curves = {}
    record = _recorder(rep, faiss, Xh, Qh, k, ed, gdev, "FAISS GPU", sync, repeat, base, curves, batches,
                       batch_curves)

    def search(index, label, setting, build_s, params=None):
        if params is None:
            record(lambda: index.search(qin, k), label, setting, build_s, part=lambda q: index.search(q, k),
                   queries=qin)
        else:  # torch_utils' search takes no params (it keeps the array search as search_numpy)
            go = getattr(index, "search_numpy", index.search)
            record(lambda: go(Qh, k, params=params), label, setting + ", host queries", build_s,
                   part=lambda q: go(q, k, params=params))

    _flat_and_ivf(rep, search, Xh, gdev, "FAISS GPU", ("GpuIndexFlatL2", "IVFFlat"),
                  lambda: faiss.GpuIndexFlatL2(res, d),
                  lambda nl: faiss.GpuIndexIVFFlat(res, d, nl, faiss.METRIC_L2, faiss.GpuIndexIVFFlatConfig()),
                  nlist, nprobes, sync)
    for degree in (cagra_degrees if itopk and hasattr(faiss, "GpuIndexCagra") else ()):
        held = _device_in_use()
        t0 = time.perf_counter()
        cfg = faiss.GpuIndexCagraConfig()
        cfg.graph_degree = degree
        cfg.intermediate_graph_degree = 2 * degree
        cagra = faiss.GpuIndexCagra(res, d, faiss.METRIC_L2, cfg)
        cagra.train(Xh)
        sync()
        build = time.perf_counter() - t0
        held = _device_in_use() - held
        rep.add(f"FAISS GPU CAGRA build (degree {degree})", build, "s", gdev, higher_is_better=False,
                index_device_bytes=held)
        rep.note(f"FAISS GPU CAGRA (degree {degree}, intermediate {2 * degree}): built in "
                 f"{build:.2f} s; the index holds {held / 2**20:.0f} MiB on the device (the device's memory in use "
                 "after its build less before it, CuPy's cached blocks given back first)")
        for it in itopk:
            sp = faiss.SearchParametersCagra()
            sp.itopk_size = max(int(it), k)
            search(cagra, f"CAGRA degree {degree}", f"itopk={sp.itopk_size}", build, sp)
        del cagra
    if itopk and not hasattr(faiss, "GpuIndexCagra"):
        rep.note("FAISS GPU CAGRA rows skipped: this faiss has no GpuIndexCagra (built without cuVS)")
    return curves


def _recall_rows(rep, KDForest, X, Q, k, ed, recalls, method, split, dev, gdev, sync, repeat, base, mine):
    """``KDForest()`` (the device's defaults) searched at each recall target: the budget it
    calibrates on its own rows (the calibration timed apart), its queries/s and measured recall."""
    t0 = time.perf_counter()
    forest = KDForest(method=method, split=split, device=dev).fit(X)
    sync()
    build = time.perf_counter() - t0
    shape = f"{forest.n_trees_} trees, leaf size {forest.leaf_size_}"
    rep.add(f"scanforest KDForest() build ({shape}: the {dev} defaults)", build, "s", gdev, higher_is_better=False)
    for r in recalls:
        cal = forest.calibrate(k, r)
        sync()
        b = "unlimited" if cal["budget"] is None else f"{cal['budget']} leaves"
        rep.add(f"scanforest KDForest() recall={r} calibration ({b}, sample recall {cal['recall']:.3f} on "
                f"{cal['sample']} rows, {len(cal['probes'])} probes)", cal["seconds"], "s", gdev,
                higher_is_better=False)
        t, (_, fi) = _timeit(lambda: forest.query(Q, k, recall=r), sync, repeat)
        got = canonical_recall(X, Q, fi, ed, k)
        rep.add(f"scanforest KDForest() recall={r} queries/s ({shape}, {b})", len(Q) / t, "queries/s", gdev,
                baseline=base[0], baseline_value=base[1], recall=got, target=r, budget=cal["budget"],
                estimate=cal["recall"], calibration_s=cal["seconds"], build_s=build)
        rep.add(f"scanforest KDForest() recall={r} recall@{k} on the queries", got, "", gdev)
        mine.append((len(Q) / t, got, f"KDForest() recall={r}: {b}"))


def _duplicate_share(X: np.ndarray) -> float:
    """Share of the rows equal to another row, bit for bit."""
    if not len(X):
        return 0.0
    _, counts = np.unique(X.view(np.dtype((np.void, X.dtype.itemsize * X.shape[1]))).ravel(), return_counts=True)
    return float(counts[counts > 1].sum()) / len(X)


def _device_in_use() -> int:
    """Bytes in use on the current GPU by every allocator (FAISS's included): total less free,
    after CuPy's pool gives its cached blocks back."""
    import cupy as cp

    cp.get_default_memory_pool().free_all_blocks()
    free, total = cp.cuda.runtime.memGetInfo()
    return int(total - free)


def _device_bytes(dev: str) -> int:
    """Bytes CuPy's memory pool holds on the device now (0 on a CPU)."""
    if dev != "gpu":
        return 0
    import cupy as cp

    return int(cp.get_default_memory_pool().used_bytes())


def _forest_curve(rep, forest, name, method, trees, ls, budgets, build, X, Q, k, ed, sync, repeat, base, mine,
                  batches, by_batch, where, *, setting, batch_setting=None):
    """``forest`` searched at each of ``budgets`` leaves: its queries/s and recall rows, its point
    on scanforest's curve (``setting(b)`` names it) and at each batch size (``batch_setting(b)``,
    default ``setting(b)``)."""
    forest.query(Q[:8], k, backtracks=int(budgets[0]))  # JIT / kernel warm-up
    for b in budgets:
        t, (_, fi) = _timeit(lambda: forest.query(Q, k, backtracks=int(b)), sync, repeat)
        r = canonical_recall(X, Q, fi, ed, k)
        rep.add(f"{name} {method} queries/s, {trees} trees, {b} leaves", len(Q) / t, "queries/s", where,
                baseline=base[0], baseline_value=base[1], recall=r, build_s=build, leaf_size=ls)
        rep.add(f"{name} recall@{k}, {trees} trees, {b} leaves", r, "", where)
        mine.append((len(Q) / t, r, setting(b)))
        _batched(rep, lambda q: forest.query(q, k, backtracks=int(b)), Q, X, Q, k, ed, sync, repeat,
                 batches, f"{name} {method}", (batch_setting or setting)(b), where, by_batch, build_s=build,
                 leaf_size=ls)


def _scan_dtypes(text: str) -> tuple:
    """``--graph-scan``'s list, each one of :data:`~scanforest.kernels.knn.kdforest.SCAN_DTYPES`."""
    from scanforest.kernels.knn.kdforest import SCAN_DTYPES

    got = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in got if t not in SCAN_DTYPES]
    if bad or not got:
        raise InputError(f"--graph-scan takes {', '.join(SCAN_DTYPES)} (comma list), got {text!r}")
    return got


def _graph_rows(rep, KDForest, X, Q, k, ed, trees, ls, method, split, dev, gdev, sync, repeat, base, mine, batches,
                by_batch, *, degree, expands, rounds, budget, leaves, scans=("float32",)):
    """The forest with a neighbour graph (``KDForest(graph_degree=...)``): its build (trees and
    graph) and device memory, then a curve per expansion width over the forest budgets, for each
    of ``scans`` (``scan_dtype``: float16 scores the leaves and the walk on half rows, the lists
    re-ranked in float32)."""
    before = _device_bytes(dev)
    t0 = time.perf_counter()
    forest = KDForest(n_trees=trees, leaf_size=ls, method=method, split=split, device=dev, graph_degree=degree,
                      graph_budget=budget).fit(X)
    sync()
    build = time.perf_counter() - t0
    gs = forest.graph_stats_
    rep.add(f"scanforest KDForest + graph build, {trees} trees (leaf size {ls}), graph degree {degree} at {budget} "
            "leaves a row", build, "s", gdev, higher_is_better=False, graph_s=round(gs["seconds"], 3),
            graph_bytes=gs["bytes"], index_device_bytes=_device_bytes(dev) - before)
    rep.note(f"scanforest graph: {gs['degree']} neighbours a row found at {budget} leaves in {gs['seconds']:.2f} s "
             f"({gs['bytes'] / 2**20:.0f} MiB) of the {build:.2f} s build; the index holds "
             f"{(_device_bytes(dev) - before) / 2**20:.0f} MiB on the device"
             if dev == "gpu" else f"scanforest graph: {gs['degree']} neighbours a row at {budget} leaves in "
             f"{gs['seconds']:.2f} s of the {build:.2f} s build")
    for scan in scans:
        forest.set_params(scan_dtype=scan)
        half = ", half scan" if scan == "float16" else ""
        for rr in rounds:
            for e in expands:
                forest.set_params(graph_expand=int(e), graph_rounds=int(rr))
                _forest_curve(rep, forest, f"scanforest KDForest + graph (expand {e} x {rr}{half})", method, trees,
                              ls, leaves, build, X, Q, k, ed, sync, repeat, base, mine, batches, by_batch, gdev,
                              setting=lambda b, e=e, rr=rr: f"{b} leaves + graph {degree}, expand {e} x {rr}{half}")


def _flann_rows(rep, binary, X, Q, k, ed, trees, threads, checks, repeat, cdev, base):
    """FLANN's KDTreeIndex through ``deploy/baselines/flann_knn_bench``: rows and its curve."""
    from ._common import baseline_lines

    m, d = Q.shape
    with tempfile.TemporaryDirectory(prefix="sf-flann-") as tmp:
        xf, qf = Path(tmp, "x.f32"), Path(tmp, "q.f32")
        X.tofile(xf)
        Q.tofile(qf)
        lines = baseline_lines(rep, [binary, xf, qf, len(X), m, d, k, trees, threads, Path(tmp, "ids"),
                                     ",".join(map(str, checks)), repeat])
        if lines is None:
            return {}
        curve = []
        for ln in lines:
            ids = np.fromfile(ln["ids"], np.int64).reshape(m, k)
            r = canonical_recall(X, Q, ids, ed, k)
            rep.add(f"FLANN KDTreeIndex queries/s, {trees} trees, checks={ln['checks']}", ln["queries_per_s"],
                    "queries/s", cdev, baseline=base[0], baseline_value=base[1], recall=r, build_s=ln["build_s"])
            rep.add(f"FLANN KDTreeIndex recall@{k}, {trees} trees, checks={ln['checks']}", r, "", cdev)
            curve.append((ln["queries_per_s"], r, f"checks={ln['checks']}"))
        rep.add(f"FLANN KDTreeIndex build, {trees} trees", lines[0]["build_s"], "s", cdev, higher_is_better=False)
    return {f"FLANN KDTreeIndex ({trees} trees)": curve}


#: the CLI's defaults by device: on a GPU the forests that are fastest at the matched recalls on
#: the PCL SHOT352 (one tree, P-BANNS in batched rounds; leaf size 32 up to recall 0.95, 128 above:
#: on one H200 32-row leaves reached 0.979 at 512 leaves, 128-row ones 0.986 at 256 leaves at
#: 1.02x the speed; docs/benchmarks.md), every real row (n = 0; synthetic data: the CPU's n) and
#: 20k queries; on a CPU FLANN's four trees, of 32-row leaves (``KDForest()``'s CPU default)
DEFAULTS = {"gpu": {"n": 0, "m": 20000, "trees": 1, "forests": ((32, (64, 128, 256, 512, 768)),
                                                               (128, (64, 128, 192, 256)))},
            "cpu": {"n": 100_000, "m": 2000, "trees": 4, "forests": ((32, (16, 32, 64, 128)),)}}


def run(n: int, m: int, d: int, k: int, *, device: str = "auto", trees: int = 4, leaf_size: int = 32,
        budgets=(8, 32, 128), method: str | None = None, split: str = "variance",
        flann_baseline: str | None = None, flann_checks=None, flann_trees: int | None = None,
        nlist: int = 0, nprobes=(1, 4, 16), hnsw_m: int = 32, ef_construction: int = 80, ef_search=(16, 64, 256),
        threads: int = 0, clusters: int = 1000, real: str | None = None, targets=(0.9, 0.95, 0.98),
        repeat: int = 3, gpu_nprobes=(4, 8, 16, 32), cagra_degree=32, itopk=(32, 64, 128, 256), out=None,
        forests=None, recalls=(), batches=(), graph: int = 0, graph_expands=(4, 8), graph_rounds=(2,),
        graph_budget: int = 128, graph_leaves=(16, 32, 64, 128), radius: float | None = None,
        graph_scans=("float32",)):
    """Measure every tool on one data set and print the table (see the module docstring).

    ``forests``: several scanforest forests, ``[(leaf_size, budgets), ...]`` (a curve each; the
    fastest point at a recall is scanforest's); default one, ``leaf_size`` with ``budgets``.
    ``recalls``: targets searched by ``KDForest()`` (the device's defaults) with ``recall=``.
    ``batches``: query batch sizes every tool but FLANN is also timed at (one call per batch).
    ``graph``: also a forest with a neighbour graph of this degree (the first forest's leaf size,
    the graph built at ``graph_budget`` leaves a row), searched at ``graph_leaves`` leaves and
    each of ``graph_expands`` list entries expanded in each of ``graph_rounds`` round counts (a curve a pair).
    ``radius``: with ``real``, every cloud's SHOT at this fixed support radius (metres) instead of
    10 resolutions: the near-duplicate-heavy variant."""
    from scanforest.kernels.backend import describe_device, resolve_device, to_numpy
    from scanforest.kernels.knn.bruteforce import knn_bruteforce
    from scanforest.kernels.knn.kdforest import KDForest, check_recall

    from ._common import BenchReport, numba_threads

    targets = [float(t) for t in (targets if isinstance(targets, (list, tuple)) else [targets])]
    recalls = [check_recall(float(r)) for r in recalls]
    batches = sorted({int(b) for b in batches})
    if any(b < 1 for b in batches):
        raise InputError(f"--batches must be positive query counts, got {batches}")
    if not targets or not all(0 < t <= 1 for t in targets):
        raise InputError(f"--target values must be in (0, 1], got {targets}")
    forests = [(int(ls), [int(b) for b in bs]) for ls, bs in (forests or [(leaf_size, budgets)])]
    leaf_size, budgets = forests[0]  # FLANN's default checks follow the first forest
    for ls, bs in forests:
        if any(b < 1 for b in bs) or not bs:
            raise InputError(f"--budgets must be positive leaf counts, got {bs}")
        if ls < 1:
            raise InputError(f"--leaf-size must be positive, got {ls}")
    if graph:  # the graph's settings checked before anything is measured (one line each)
        if not graph_expands:
            raise InputError("--graph-expand needs at least one list width")
        if not graph_rounds:
            raise InputError("--graph-rounds needs at least one round count")
        from scanforest.flows.inputs import check_graph_options

        for e in graph_expands:
            for rr in graph_rounds:
                check_graph_options({"graph_degree": int(graph), "graph_expand": int(e), "graph_rounds": int(rr),
                                     "graph_budget": int(graph_budget)})
        if not graph_leaves or any(int(b) < 1 for b in graph_leaves):
            raise InputError(f"--graph-leaves must be positive leaf counts, got {list(graph_leaves)}")
    if radius is not None and (not real or not radius > 0):
        raise InputError(f"--radius needs --real and a positive support radius in metres, got {radius!r}")
    degrees = [int(cagra_degree)] if np.isscalar(cagra_degree) else [int(g) for g in cagra_degree]
    if not degrees or any(not 1 <= g <= 1024 for g in degrees):
        raise InputError(f"--cagra-degree must be graph degrees from 1 to 1024, got {degrees}")
    if any(int(it) < 1 for it in itopk):
        raise InputError(f"--itopk must be positive list sizes, got {list(itopk)}")
    dev = resolve_device(device)
    threads = int(threads or os.cpu_count() or 1)
    method = method or "banns"  # batched rounds on both devices (kdtree.query_kdtree)
    checks = list(flann_checks or [int(b) * leaf_size for b in budgets])
    flann_trees = int(flann_trees or trees)
    rep = BenchReport("tools", {"n": n, "m": m, "d": d, "k": k, "device": dev, "trees": trees,
                                "leaf_size": leaf_size, "split": split, "budgets": list(budgets), "method": method,
                                **({"forests": forests} if len(forests) > 1 else {}),
                                "flann_baseline": flann_baseline, "flann_checks": checks,
                                "flann_trees": flann_trees, "nlist": nlist, "nprobes": list(nprobes), "hnsw_m": hnsw_m,
                                "ef_construction": ef_construction, "ef_search": list(ef_search),
                                "threads": threads, "clusters": clusters, "real": real, "targets": targets,
                                **({"radius": radius} if radius is not None else {}),
                                **({"recalls": recalls} if recalls else {}),
                                **({"batches": batches} if batches else {}),
                                **({"graph": {"degree": graph, "expand": list(graph_expands), "rounds": list(graph_rounds),
                                              "budget": graph_budget, "leaves": list(graph_leaves),
                                              "scans": list(graph_scans)}}
                                   if graph else {})},
                      echo=True, out=out)
    if dev == "gpu":
        import cupy as cp

        xp, sync = cp, cp.cuda.Device().synchronize
    else:
        xp, sync = np, (lambda: None)
    if real:
        from ._data import pcl_shot_dataset

        X, Q, clouds = pcl_shot_dataset(real, device=dev, max_queries=m, radius=radius)  # n = 0: every row
        if n and len(X) > n:  # a random subset of the reference, the same for every tool
            X = X[xp.asarray(np.sort(np.random.default_rng(3).choice(len(X), n, replace=False)))]
        rep.note("data: SHOT352 at every point of " + ", ".join(c[0] for c in clouds)
                 + f"; {len(Q):,} held-out descriptors as queries, {len(X):,} indexed; support "
                 + ("10 resolutions of each cloud" if radius is None else f"{radius * 100:g} cm on every cloud"))
    else:
        X = clustered(n, d, clusters=clusters, seed=1, xp=xp)
        Q = clustered(m, d, clusters=clusters, seed=2, xp=xp)
        rep.note(f"data: {n:,} x {d} reference and {m:,} queries from {clusters} Gaussian clusters (queries are "
                 "distinct samples of the same clusters)")
    n, m, d = int(X.shape[0]), int(Q.shape[0]), int(X.shape[1])
    Xh, Qh = np.ascontiguousarray(to_numpy(X)), np.ascontiguousarray(to_numpy(Q))
    if real:
        rep.note(f"data: {_duplicate_share(Xh):.1%} of the indexed rows repeat another bit for bit")
    gdev = describe_device(dev) if dev == "gpu" else f"cpu ({threads} threads)"
    cdev = f"cpu ({threads} threads)"
    curves = {}
    by_batch: dict[int, dict] = {}  # {batch size: {tool: [(q/s, recall, setting)]}}, scanforest's under MINE
    with numba_threads(threads):
        knn_bruteforce(X[:512], Q[:8], k)  # compile / warm up
        t_bf, (ed, _) = _timeit(lambda: knn_bruteforce(X, Q, k), sync, repeat)
        ed = to_numpy(ed)
        base = (f"scanforest exact brute force queries/s ({dev})", m / t_bf)
        rep.add(base[0], base[1], "queries/s", gdev, seconds=t_bf)
        mine = [(base[1], 1.0, "exact brute force")]
        _batched(rep, lambda q: knn_bruteforce(X, q, k), Q, X, Q, k, ed, sync, repeat, batches,
                 "scanforest exact brute force", "exact", gdev, by_batch)
        for ls, bs in forests:
            # several forests: a curve each (the report draws one per name before "queries/s")
            name = "scanforest KDForest" + (f" (leaf size {ls})" if len(forests) > 1 else "")
            leaf = f"leaf size {ls}, " if len(forests) > 1 else ""
            t0 = time.perf_counter()
            forest = KDForest(n_trees=trees, leaf_size=ls, method=method, split=split, device=dev).fit(X)
            sync()
            build = time.perf_counter() - t0
            rep.add(f"scanforest KDForest build, {trees} trees (leaf size {ls}, {split} split)", build, "s", gdev,
                    higher_is_better=False)
            _forest_curve(rep, forest, name, method, trees, ls, bs, build, X, Q, k, ed, sync, repeat, base, mine,
                          batches, by_batch, gdev, setting=lambda b, leaf=leaf: f"{leaf}{b} leaves",
                          batch_setting=lambda b, leaf=leaf: f"{trees} trees, {leaf}{b} leaves")
            forest = None  # its GPU memory goes back before the next forest and the other tools
        if graph:
            _graph_rows(rep, KDForest, X, Q, k, ed, trees, forests[0][0], method, split, dev, gdev, sync, repeat, base,
                        mine, batches, by_batch, degree=graph, expands=graph_expands, rounds=graph_rounds,
                        budget=graph_budget, leaves=graph_leaves, scans=graph_scans)
        if recalls:
            _recall_rows(rep, KDForest, X, Q, k, ed, recalls, method, split, dev, gdev, sync, repeat, base, mine)
    if flann_baseline:
        curves.update(_flann_rows(rep, flann_baseline, Xh, Qh, k, ed, flann_trees, threads, checks, repeat, cdev,
                                  base))
        if batches:
            rep.note("FLANN rows: the whole query set only (its program takes no batch size)")
    else:
        rep.note("FLANN rows skipped: no --flann-baseline program (build deploy/baselines/flann_knn_bench.cpp)")
    if dev == "gpu":
        curves.update(_faiss_gpu_rows(rep, X, Q, k, ed, gdev, sync, nlist=nlist, nprobes=list(gpu_nprobes),
                                      cagra_degrees=degrees, itopk=list(itopk), repeat=repeat, base=base,
                                      batches=batches, batch_curves=by_batch))
    if nprobes or ef_search:
        curves.update(_faiss_rows(rep, Xh, Qh, k, ed, threads, cdev, nlist=nlist, nprobes=list(nprobes),
                                  hnsw_m=hnsw_m, ef_construction=ef_construction, ef_search=list(ef_search),
                                  repeat=repeat, base=base, batches=batches, batch_curves=by_batch))
    else:
        rep.note("FAISS host rows skipped: --nprobe and --ef-search are empty")
    for target in targets:
        ours = _best_at(mine, target)
        for tool, pts in curves.items():
            theirs = _best_at(pts, target)
            if theirs is None:
                rep.note(f"at recall@{k} >= {target}: {tool} has no measured point (widen its settings)")
                continue
            where = gdev if tool.startswith("FAISS GPU") else cdev
            rep.add(f"scanforest ({ours[2]}, recall {ours[1]:.3f}) vs {tool} ({theirs[2]}, recall {theirs[1]:.3f}) "
                    f"at recall@{k} >= {target}", ours[0], "queries/s", gdev, baseline=f"{tool} ({where})",
                    baseline_value=theirs[0])
    for b, tools in sorted(by_batch.items()):  # the same comparison within each batch size
        ours_pts = [p for name, pts in tools.items() if name.startswith("scanforest") for p in pts]
        for target in targets:
            ours = _best_at(ours_pts, target)
            for tool, pts in tools.items():
                if tool.startswith("scanforest"):
                    continue
                theirs = _best_at(pts, target)
                if ours is None or theirs is None:
                    rep.note(f"batches of {b}, recall@{k} >= {target}: "
                             f"{'scanforest' if ours is None else tool} has no measured point")
                    continue
                where = gdev if tool.startswith("FAISS GPU") else cdev
                rep.add(f"batches of {b}: scanforest ({ours[2]}, recall {ours[1]:.3f}) vs {tool} ({theirs[2]}, "
                        f"recall {theirs[1]:.3f}) at recall@{k} >= {target}", ours[0], "queries/s", gdev,
                        baseline=f"{tool} ({where}), batches of {b}", baseline_value=theirs[0])
    rep.note(f"recall@{k}: a returned neighbour counts when its canonical distance is <= the exact {k}-th distance "
             "(ties count), the same rule for every tool; queries/s: median of "
             f"{repeat} searches of all {m:,} queries after a warm-up (FLANN: median of its own repetitions)")
    rep.finish(out)
    return rep


def register(app, bench) -> None:
    """Add this bench to ``scanforest bench`` (found by :mod:`scanforest.deploy.cli`)."""
    import typer

    from ._common import parse_counts

    @bench.command("tools")
    def bench_tools(
        n: str = typer.Option("", "--n", help="reference rows (k/m suffixes ok; with --real: at most this many, 0 "
                              "every row; default: 100k on a CPU, every real row on a GPU)"),
        m: int = typer.Option(0, "--m", help="queries (default: 2,000 on a CPU, 20,000 on a GPU)"),
        d: int = typer.Option(352, "--d", help="dimensions (synthetic data)"),
        k: int = typer.Option(4, "-k", help="neighbours per query (P)"),
        device: str = typer.Option("auto", "--device", help="where scanforest runs: auto | cpu | gpu"),
        trees: int = typer.Option(0, "--trees", help="randomized trees (scanforest and FLANN alike; default: 4 on a "
                                  "CPU, 1 on a GPU)"),
        leaf_size: str = typer.Option("", "--leaf-size", help="scanforest leaf size, or a comma list (a forest each, "
                                      "every one searched at --budgets; default: 32 on a CPU; on a GPU 32 at "
                                      "64,128,256,512,768 leaves and 128 at 64,128,192,256)"),
        budgets: str = typer.Option("", "--budgets", help="scanforest leaves per query (comma list; default: 16,32,64,128 "
                                    "on a CPU; on a GPU see --leaf-size)"),
        method: str = typer.Option(None, "--method", help="scanforest search: banns (default: batched rounds, "
                                   "each leaf scanned once for the queries that take it) | anns (a query at a time)"),
        split: str = typer.Option("variance", "--split", help="scanforest split rule: variance | median | midpoint"),
        flann_baseline: str = typer.Option(None, "--flann-baseline", help="FLANN program (build deploy/baselines/"
                                           "flann_knn_bench.cpp)"),
        flann_trees: int = typer.Option(0, "--flann-trees", help="FLANN's randomized trees (0: --trees)"),
        flann_checks: str = typer.Option("", "--flann-checks", help="FLANN points per query (comma list; default: "
                                         "budgets x leaf size)"),
        nlist: int = typer.Option(0, "--nlist", help="FAISS IVF lists (0: 4 sqrt(N))"),
        nprobe: str = typer.Option("1,4,16", "--nprobe", help="FAISS IVF probes (comma list; empty: no IVF)"),
        hnsw_m: int = typer.Option(32, "--hnsw-m"),
        ef_construction: int = typer.Option(80, "--ef-construction"),
        ef_search: str = typer.Option("16,64,256", "--ef-search", help="FAISS HNSW efSearch (comma list; empty: "
                                      "no HNSW)"),
        threads: int = typer.Option(0, "--threads", help="CPU threads of every CPU tool (0: all cores)"),
        clusters: int = typer.Option(1000, "--clusters"),
        real: str = typer.Option(None, "--real", help="folder of PCD/PLY clouds: their SHOT352 instead of synthetic "
                                 "data"),
        target: str = typer.Option("0.9,0.95,0.98", "--target", help="recall@P values of the matched-recall "
                                   "comparison (comma list)"),
        repeat: int = typer.Option(3, "--repeat"),
        gpu_nprobe: str = typer.Option("4,8,16,32", "--gpu-nprobe", help="FAISS GPU IVF-Flat probes (--device gpu; "
                                       "comma list; empty: none)"),
        cagra_degree: str = typer.Option("32", "--cagra-degree", help="FAISS GPU CAGRA graph degree (comma list: "
                                         "an index built and searched at each)"),
        itopk: str = typer.Option("32,64,128,256", "--itopk", help="FAISS GPU CAGRA itopk_size (comma list; empty: "
                                  "no CAGRA)"),
        recall: str = typer.Option("", "--recall", help="recall@P targets (comma list): KDForest() with the "
                                   "device's defaults, its budget calibrated on its own rows for each"),
        batches: str = typer.Option("", "--batches", help="query batch sizes (comma list, k suffix ok, e.g. "
                                    "1k,10k,100k): every tool but FLANN also timed searching the queries in "
                                    "batches of each size, one call per batch, and compared within each size"),
        graph: int = typer.Option(0, "--graph", help="also a forest with a neighbour graph of this many neighbours "
                                  "a row (0: none), searched from its leaves"),
        graph_expand: str = typer.Option("4,8", "--graph-expand", help="list entries whose graph neighbours are "
                                         "scored, per round (comma list: a curve each)"),
        graph_rounds: str = typer.Option("2", "--graph-rounds", help="rounds of the graph expansion, each over "
                                         "entries not expanded before (comma list: a curve each)"),
        graph_budget: int = typer.Option(128, "--graph-budget", help="leaves a row's graph search scans"),
        graph_leaves: str = typer.Option("16,32,64,128", "--graph-leaves", help="forest leaves per query before the "
                                         "graph (comma list)"),
        graph_scan: str = typer.Option("float32", "--graph-scan", help="the graph forest's scan_dtype (comma list: "
                                       "float32, float16; a curve each): float16 scores leaves and walk on half "
                                       "rows and re-ranks each list in float32"),
        radius: float = typer.Option(None, "--radius", help="with --real: SHOT at this fixed support radius (m) on "
                                     "every cloud instead of 10 resolutions (the near-duplicate-heavy variant)"),
        out: str = typer.Option(None, "--out", help="JSON file or folder"),
    ):
        """scanforest's KD-forest against FLANN's KD-forest and FAISS (Flat, IVF-Flat, HNSW; on the GPU also
        IVF-Flat and CAGRA), one data set."""
        from scanforest.kernels.backend import resolve_device

        from ._common import check_program

        check_program(flann_baseline, "--flann-baseline")
        dflt = DEFAULTS[resolve_device(device)]
        n_rows = parse_counts(n)[0] if n.strip() else dflt["n"] if real else DEFAULTS["cpu"]["n"]
        leaves, given = parse_counts(leaf_size), parse_counts(budgets)
        if leaves or given:  # what was asked: each leaf size (default 32) at the budgets (default the first's)
            forests = [(ls, given or list(dflt["forests"][0][1])) for ls in (leaves or [32])]
        else:
            forests = [(ls, list(bs)) for ls, bs in dflt["forests"]]
        run(n_rows, m or dflt["m"], d, k, device=device, trees=trees or dflt["trees"], forests=forests,
            method=method, split=split, flann_baseline=flann_baseline,
            flann_checks=parse_counts(flann_checks), flann_trees=flann_trees, nlist=nlist,
            nprobes=parse_counts(nprobe), hnsw_m=hnsw_m,
            ef_construction=ef_construction, ef_search=parse_counts(ef_search), threads=threads, clusters=clusters,
            real=real, targets=[float(t) for t in target.split(",") if t.strip()], repeat=repeat,
            gpu_nprobes=parse_counts(gpu_nprobe), cagra_degree=parse_counts(cagra_degree) or [32],
            itopk=parse_counts(itopk), out=out,
            recalls=[float(r) for r in recall.split(",") if r.strip()], batches=parse_counts(batches),
            graph=graph, graph_expands=parse_counts(graph_expand), graph_rounds=parse_counts(graph_rounds),
            graph_budget=graph_budget, graph_leaves=parse_counts(graph_leaves), radius=radius,
            graph_scans=_scan_dtypes(graph_scan))
