"""``scanforest bench tools``: the KD-forest side by side with FLANN and FAISS.

One data set (synthetic Gaussian clusters, or SHOT352 of real clouds), one exact answer (the
brute force), and on it every tool's recall@P / queries-per-second curve:

* scanforest's KD-forest (``KDForest``: ``--trees`` randomized trees sharing one budget of
  ``--budgets`` leaves per query), on the CPU or the GPU;
* FLANN's randomized KD-forest (``KDTreeIndex``, the forest PCL's recognition matches SHOT
  with), an external program (``deploy/baselines/flann_knn_bench.cpp``) given by
  ``--flann-baseline``, with ``--flann-trees`` trees (default: the same) and ``--flann-checks``
  points per query;
* FAISS (``faiss-cpu`` when installed): ``IndexFlatL2`` (exact), ``IndexIVFFlat`` over
  ``--nprobe`` lists and ``IndexHNSWFlat`` over ``--ef-search``.

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

from ._data import _timeit, clustered


def _best_at(points, target):
    """The fastest ``(queries/s, recall, setting)`` with recall >= target, or None."""
    ok = [p for p in points if p[1] >= target]
    return max(ok, key=lambda p: p[0]) if ok else None


def _recall_of(X, Q, ids, ed, k):
    """Recall@k of another tool's ids, by the brute force's own distances of those pairs."""
    from scanforest.kernels.knn.bruteforce import pair_distances, recall

    return recall(pair_distances(X, Q, ids, device="cpu"), ed, k)


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
                  base):
    n, d = X.shape
    m = len(Q)
    curves = {}

    def search(index, label, setting, build_s):
        t, (_, ids) = _timeit(lambda: index.search(Q, k), lambda: None, repeat)
        r = _recall_of(X, Q, ids, ed, k)
        rep.add(f"FAISS {label} queries/s, {setting}", m / t, "queries/s", cdev, baseline=base[0],
                baseline_value=base[1], recall=r, build_s=build_s, faiss=faiss.__version__)
        rep.add(f"FAISS {label} recall@{k}, {setting}", r, "", cdev)
        curves.setdefault(f"FAISS {label}", []).append((m / t, r, setting))

    t0 = time.perf_counter()
    flat = faiss.IndexFlatL2(d)
    flat.add(X)
    search(flat, "IndexFlatL2 (exact)", "exhaustive", time.perf_counter() - t0)
    del flat
    if nprobes:
        nl = nlist or max(1, min(n // 39, int(4 * np.sqrt(n))))
        t0 = time.perf_counter()
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, nl)
        rng = np.random.default_rng(0)
        train = X[rng.choice(n, min(n, 64 * nl), replace=False)] if n > 64 * nl else X
        ivf.train(train)
        ivf.add(X)
        build = time.perf_counter() - t0
        rep.add(f"FAISS IndexIVFFlat build (nlist={nl})", build, "s", cdev, higher_is_better=False)
        for p in nprobes:
            ivf.nprobe = int(p)
            search(ivf, f"IndexIVFFlat nlist={nl}", f"nprobe={p}", build)
        del ivf
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
            r = _recall_of(X, Q, ids, ed, k)
            rep.add(f"FLANN KDTreeIndex queries/s, {trees} trees, checks={ln['checks']}", ln["queries_per_s"],
                    "queries/s", cdev, baseline=base[0], baseline_value=base[1], recall=r, build_s=ln["build_s"])
            rep.add(f"FLANN KDTreeIndex recall@{k}, {trees} trees, checks={ln['checks']}", r, "", cdev)
            curve.append((ln["queries_per_s"], r, f"checks={ln['checks']}"))
        rep.add(f"FLANN KDTreeIndex build, {trees} trees", lines[0]["build_s"], "s", cdev, higher_is_better=False)
    return {f"FLANN KDTreeIndex ({trees} trees)": curve}


def run(n: int, m: int, d: int, k: int, *, device: str = "auto", trees: int = 4, leaf_size: int = 32,
        budgets=(8, 32, 128), method: str | None = None, split: str = "variance",
        flann_baseline: str | None = None, flann_checks=None, flann_trees: int | None = None,
        nlist: int = 0, nprobes=(1, 4, 16), hnsw_m: int = 32, ef_construction: int = 80, ef_search=(16, 64, 256),
        threads: int = 0, clusters: int = 1000, real: str | None = None, targets=(0.9, 0.95, 0.98),
        repeat: int = 3, out=None):
    """Measure every tool on one data set and print the table (see the module docstring)."""
    from scanforest.kernels.backend import describe_device, resolve_device, to_numpy
    from scanforest.kernels.knn.bruteforce import knn_bruteforce, recall
    from scanforest.kernels.knn.kdforest import KDForest

    from ._common import BenchReport, numba_threads

    targets = [float(t) for t in (targets if isinstance(targets, (list, tuple)) else [targets])]
    if not targets or not all(0 < t <= 1 for t in targets):
        raise InputError(f"--target values must be in (0, 1], got {targets}")
    if any(int(b) < 1 for b in budgets) or not budgets:
        raise InputError(f"--budgets must be positive leaf counts, got {list(budgets)}")
    dev = resolve_device(device)
    threads = int(threads or os.cpu_count() or 1)
    method = method or ("banns" if dev == "gpu" else "anns")
    checks = list(flann_checks or [int(b) * leaf_size for b in budgets])
    flann_trees = int(flann_trees or trees)
    rep = BenchReport("tools", {"n": n, "m": m, "d": d, "k": k, "device": dev, "trees": trees,
                                "leaf_size": leaf_size, "split": split, "budgets": list(budgets), "method": method,
                                "flann_baseline": flann_baseline, "flann_checks": checks,
                                "flann_trees": flann_trees, "nlist": nlist, "nprobes": list(nprobes), "hnsw_m": hnsw_m,
                                "ef_construction": ef_construction, "ef_search": list(ef_search),
                                "threads": threads, "clusters": clusters, "real": real, "targets": targets},
                      echo=True)
    if dev == "gpu":
        import cupy as cp

        xp, sync = cp, cp.cuda.Device().synchronize
    else:
        xp, sync = np, (lambda: None)
    if real:
        from ._data import pcl_shot_dataset

        X, Q, clouds = pcl_shot_dataset(real, device=dev, max_queries=m)
        if n and len(X) > n:  # a random subset of the reference, the same for every tool
            X = X[xp.asarray(np.sort(np.random.default_rng(3).choice(len(X), n, replace=False)))]
        rep.note("data: SHOT352 at every point of " + ", ".join(c[0] for c in clouds)
                 + f"; {len(Q):,} held-out descriptors as queries, {len(X):,} indexed")
    else:
        X = clustered(n, d, clusters=clusters, seed=1, xp=xp)
        Q = clustered(m, d, clusters=clusters, seed=2, xp=xp)
        rep.note(f"data: {n:,} x {d} reference and {m:,} queries from {clusters} Gaussian clusters (queries are "
                 "distinct samples of the same clusters)")
    n, m, d = int(X.shape[0]), int(Q.shape[0]), int(X.shape[1])
    Xh, Qh = np.ascontiguousarray(to_numpy(X)), np.ascontiguousarray(to_numpy(Q))
    gdev = describe_device(dev) if dev == "gpu" else f"cpu ({threads} threads)"
    cdev = f"cpu ({threads} threads)"
    curves = {}
    with numba_threads(threads):
        knn_bruteforce(X[:512], Q[:8], k)  # compile / warm up
        t_bf, (ed, _) = _timeit(lambda: knn_bruteforce(X, Q, k), sync, repeat)
        ed = to_numpy(ed)
        base = (f"scanforest exact brute force queries/s ({dev})", m / t_bf)
        rep.add(base[0], base[1], "queries/s", gdev, seconds=t_bf)
        mine = [(base[1], 1.0, "exact brute force")]
        t0 = time.perf_counter()
        forest = KDForest(n_trees=trees, leaf_size=leaf_size, method=method, split=split, device=dev).fit(X)
        sync()
        build = time.perf_counter() - t0
        rep.add(f"scanforest KDForest build, {trees} trees (leaf size {leaf_size}, {split} split)", build, "s", gdev,
                higher_is_better=False)
        forest.query(Q[:8], k, backtracks=int(budgets[0]))  # JIT / kernel warm-up
        for b in budgets:
            t, (fd, _) = _timeit(lambda: forest.query(Q, k, backtracks=int(b)), sync, repeat)
            r = recall(fd, ed, k)
            rep.add(f"scanforest KDForest {method} queries/s, {trees} trees, {b} leaves", m / t, "queries/s", gdev,
                    baseline=base[0], baseline_value=base[1], recall=r, build_s=build)
            rep.add(f"scanforest KDForest recall@{k}, {trees} trees, {b} leaves", r, "", gdev)
            mine.append((m / t, r, f"{b} leaves"))
        del forest
    if flann_baseline:
        curves.update(_flann_rows(rep, flann_baseline, Xh, Qh, k, ed, flann_trees, threads, checks, repeat, cdev,
                                  base))
    else:
        rep.note("FLANN rows skipped: no --flann-baseline program (build deploy/baselines/flann_knn_bench.cpp)")
    curves.update(_faiss_rows(rep, Xh, Qh, k, ed, threads, cdev, nlist=nlist, nprobes=list(nprobes), hnsw_m=hnsw_m,
                              ef_construction=ef_construction, ef_search=list(ef_search), repeat=repeat, base=base))
    for target in targets:
        ours = _best_at(mine, target)
        for tool, pts in curves.items():
            theirs = _best_at(pts, target)
            if theirs is None:
                rep.note(f"at recall@{k} >= {target}: {tool} has no measured point (widen its settings)")
                continue
            rep.add(f"scanforest ({ours[2]}, recall {ours[1]:.3f}) vs {tool} ({theirs[2]}, recall {theirs[1]:.3f}) "
                    f"at recall@{k} >= {target}", ours[0], "queries/s", gdev, baseline=f"{tool} ({cdev})",
                    baseline_value=theirs[0])
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
        n: str = typer.Option("100k", "--n", help="reference rows (k/m suffixes ok; with --real: at most this many)"),
        m: int = typer.Option(2000, "--m", help="queries"),
        d: int = typer.Option(352, "--d", help="dimensions (synthetic data)"),
        k: int = typer.Option(4, "-k", help="neighbours per query (P)"),
        device: str = typer.Option("auto", "--device", help="where scanforest runs: auto | cpu | gpu"),
        trees: int = typer.Option(4, "--trees", help="randomized trees (scanforest and FLANN alike)"),
        leaf_size: int = typer.Option(32, "--leaf-size"),
        budgets: str = typer.Option("8,32,128", "--budgets", help="scanforest leaves per query (comma list)"),
        method: str = typer.Option(None, "--method", help="scanforest search: banns | anns (default: banns on "
                                   "GPUs, anns on CPUs)"),
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
        out: str = typer.Option(None, "--out", help="JSON file or folder"),
    ):
        """scanforest's KD-forest against FLANN's KD-forest and FAISS (Flat, IVF-Flat, HNSW), one data set."""
        run(parse_counts(n)[0], m, d, k, device=device, trees=trees, leaf_size=leaf_size,
            budgets=parse_counts(budgets), method=method, split=split, flann_baseline=flann_baseline,
            flann_checks=parse_counts(flann_checks), flann_trees=flann_trees, nlist=nlist,
            nprobes=parse_counts(nprobe), hnsw_m=hnsw_m,
            ef_construction=ef_construction, ef_search=parse_counts(ef_search), threads=threads, clusters=clusters,
            real=real, targets=[float(t) for t in target.split(",") if t.strip()], repeat=repeat, out=out)
