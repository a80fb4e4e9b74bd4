"""Benchmark data and timing shared by ``scanforest bench ann``, ``bench tools`` and ``bench match``.

Synthetic clustered descriptors (:func:`clustered`), SHOT352 of real clouds
(:func:`pcl_shot_dataset`), where PCL's test clouds are (:func:`pcl_data_dir`) and the
warm-up-then-median timer (:func:`_timeit`). They live apart
from the commands so that one command's module never imports another's.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np


def pcl_data_dir() -> Path:
    """PCL's test clouds, the benches' default real data: ``SCANFOREST_PCL_DATA`` when set, else
    ``shared/data/pcl`` beside the checkout (the development layout; a bench given no cloud and
    finding none there says which file is missing)."""
    env = os.environ.get("SCANFOREST_PCL_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "pcl"  # deploy/bench/ -> ../shared


def clustered(n: int, d: int, *, clusters: int = 1000, spread: float = 0.35, seed: int = 0, xp=np,
              centers_seed: int = 12345):
    """``n`` points of ``d`` dims around ``clusters`` Gaussian centres (centres ~ N(0, 1))."""
    crng = np.random.default_rng(centers_seed + d)
    centers = xp.asarray(crng.standard_normal((clusters, d)).astype(np.float32))
    if xp is np:
        rng = np.random.default_rng(seed)
        lab = rng.integers(0, clusters, n)
        return (centers[lab] + spread * rng.standard_normal((n, d), dtype=np.float32)).astype(np.float32)
    rng = xp.random.default_rng(seed)
    lab = rng.integers(0, clusters, n)
    out = rng.standard_normal((n, d), dtype=xp.float32)
    out *= xp.float32(spread)
    out += centers[lab]
    return out


def canonical_recall(X, Q, ids, exact_dist, k: int) -> float:
    """Recall@``k`` of the ids a tool returned, each pair scored by its canonical distance
    (:func:`~scanforest.kernels.knn.bruteforce.pair_distances`, bit for bit the brute force's),
    never by the distance the tool reported: a tool that under-reports its distances cannot
    raise its own recall. The same rule for scanforest and for every other tool."""
    from scanforest.kernels.knn.bruteforce import pair_distances, recall

    return recall(pair_distances(X, Q, ids, device="auto"), exact_dist, k)


def id_recall(found_ids, exact_ids, k: int) -> float:
    """Recall@``k`` by ids, where the reference rows are not at hand (``bench match`` at 10M-100M
    rows drawn on the workers): a returned id counts when the exact search returned it for that
    query. Distances reported by the search are not used; a tie broken otherwise by the two
    searches can only lower the figure."""
    import numpy as np

    f = np.asarray(found_ids)[:, :k]
    e = np.asarray(exact_ids)[:, :k]
    hit = (f[:, :, None] == e[:, None, :]).any(axis=2) & (f >= 0)
    return float(hit.sum()) / max(1, e.shape[0] * e.shape[1])


def _timeit(fn, sync, repeat: int, long_s: float = 20.0):
    """Wall time of ``fn()`` after one untimed warm-up call, synchronising the device: the median
    of ``repeat`` warm calls, or of one warm call when the warm-up took over ``long_s`` seconds.

    One rule for every call, so both sides of a ratio are timed alike: a first call is never
    the measurement (on one H100 a 5.7 s first brute-force pass ran at 69% of the speed of the
    next one: library handles and memory pools still growing), however long it takes; a long
    call is timed once warm instead of ``repeat`` times, which changes the spread, not the rule.
    """
    t0 = time.perf_counter()
    res = fn()
    sync()
    reps = 1 if time.perf_counter() - t0 > long_s else max(1, int(repeat))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), res


def pcl_shot_dataset(folder, *, device="auto", radius_factor: float = 10.0, normal_k: int = 10,
                     max_queries: int = 100_000, seed: int = 0, radius: float | None = None):
    """Real descriptors: SHOT352 of every cloud in ``folder``, split into reference and queries.

    Every valid point of every ``*.pcd``/``*.ply`` cloud is a keypoint; normals by PCA over
    ``normal_k`` neighbours, SHOT support radius ``radius_factor`` x the cloud's resolution (mean
    nearest-neighbour distance), or a fixed ``radius`` (metres) for every cloud: the
    near-duplicate-heavy variant (a support of a few points on the sparse clouds gives many equal
    descriptors). Descriptors with an invalid frame (NaN) are dropped. A random
    ``max_queries`` of the rest (at most 10%) are held out as queries and removed from the
    reference, so no query finds its own copy. Returns ``(reference, queries, per-cloud rows)``
    on the device.
    """
    from pathlib import Path

    import scanforest as sf
    from scanforest.kernels.backend import resolve_device
    from scanforest.kernels.neighbors.search import knn

    dev = resolve_device(device)
    xp = np
    if dev == "gpu":
        import cupy as xp
    from scanforest.kernels.errors import InputError

    if not Path(folder).is_dir():
        raise InputError(f"{folder}: no such folder (--real names a folder of .pcd/.ply clouds)")
    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in (".pcd", ".ply"))
    if not files:
        raise InputError(f"{folder}: no .pcd/.ply clouds in it (--real names a folder of them)")
    parts, rows = [], []
    for f in files:
        pts = xp.asarray(sf.read(f).points.astype(np.float32))
        _, d2 = knn(pts, k=2, device=dev)  # resolution on the cloud's device (float32 k-NN)
        res = float(xp.sqrt(d2[:, 1].astype(xp.float64)).mean())
        nrm, _ = sf.normals(pts, k=normal_k, device=dev)
        desc, _ = sf.shot(pts, nrm, xp.arange(len(pts)), radius_factor * res if radius is None else float(radius),
                          device=dev)
        ok = xp.isfinite(desc[:, 0])
        parts.append(desc[ok])
        rows.append((f.name, len(pts), int(ok.sum()), res))
    allx = xp.concatenate(parts)
    n = len(allx)
    m = min(max_queries, n // 10)
    perm = xp.asarray(np.random.default_rng(seed).permutation(n))
    return xp.ascontiguousarray(allx[perm[m:]]), xp.ascontiguousarray(allx[perm[:m]]), rows


# ---- matched recall and IVF settings, shared by bench tools and bench match
def _best_at(points, target):
    """The fastest ``(queries/s, recall, setting)`` with recall >= target, or None."""
    ok = [p for p in points if p[1] >= target]
    return max(ok, key=lambda p: p[0]) if ok else None


def _ivf_lists(n: int, nlist: int) -> int:
    """IVF lists: ``nlist``, or 4 sqrt(N) with at least 39 training rows per list."""
    return nlist or max(1, min(n // 39, int(4 * np.sqrt(n))))


def _ivf_train_rows(X, nl: int):
    """The rows k-means trains the IVF lists on: 64 per list at most, the same for every IVF."""
    n = len(X)
    return X[np.random.default_rng(0).choice(n, 64 * nl, replace=False)] if n > 64 * nl else X
