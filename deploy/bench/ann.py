"""``scanforest bench ann``: KD-tree P-BANNS / P-ANNS against exact GEMM brute force.

For every (N, d) setting the benchmark generates synthetic clustered data (Gaussian clusters,
queries drawn from the same clusters but distinct from the indexed points, so no query finds
its own copy), builds the tree, and reports side by side: build time, queries/s and
recall@1 / recall@P of P-BANNS (sliding window on and off), P-ANNS and the exact fp32 GEMM brute
force (the baseline row, measured in the same run), plus the CPU backend on a query subset.
"""
from __future__ import annotations

import time

import numpy as np
import typer

from ._common import parse_counts
from ._data import _timeit, clustered, pcl_shot_dataset


VARIANTS = ("banns-window", "banns-plain", "anns")


class _Summary(list):
    """Side-by-side rows, printed as soon as they are measured (a killed run keeps its rows)."""

    head = (f"{'setting':34s} {'method':20s} {'bk':>5s} {'build s':>8s} {'search s':>9s} {'q/s':>12s} "
            f"{'R@1':>6s} {'R@P':>6s}")

    @staticmethod
    def fmt(row):
        tag, label, b, tb, t, qps, r1, rk = row
        return f"{tag:34s} {label:20s} {str(b):>5s} {tb:>8s} {t:9.4f} {qps:12,.0f} {r1:6.3f} {rk:6.3f}"

    def append(self, row):
        if not self:
            print(self.head, flush=True)
        super().append(row)
        print(self.fmt(row), flush=True)

    @property
    def lines(self):
        return ["side by side:", self.head] + [self.fmt(r) for r in self]


def run_bench(sizes, dims, queries, k, backtracks, leaf_size, device, out, cpu_queries, clusters,
              repeat, time_limit, windows=(True, False), variants=VARIANTS, cpu_max_n=2_000_000,
              window_kernel="rotate", real=None, real_radius=10.0, split="variance"):
    """The ``bench ann`` run. ``window_kernel`` names the GPU P-BANNS window kernel of the
    windowed rows (passed to each search as ``sliding_window=``; no module setting changes)."""
    from scanforest.kernels.backend import resolve_device

    dev = resolve_device(device)
    return _run_bench(sizes, dims, queries, k, backtracks, leaf_size, dev, out, cpu_queries, clusters, repeat,
                      time_limit, windows, variants, cpu_max_n, window_kernel, real, real_radius, split)


def _run_bench(sizes, dims, queries, k, backtracks, leaf_size, dev, out, cpu_queries, clusters, repeat,
               time_limit, windows, variants, cpu_max_n, window_kernel, real, real_radius, split):
    from scanforest.kernels.backend import describe_device, to_numpy
    from scanforest.kernels.knn.bruteforce import knn_bruteforce, pair_distances, recall
    from scanforest.kernels.knn.kdtree import build_kdtree, query_kdtree

    from ._common import BenchReport

    params = dict(window_kernel=window_kernel, sizes=sizes, dims=dims, queries=queries, k=k, backtracks=backtracks, leaf_size=leaf_size,
                  device=dev, cpu_queries=cpu_queries, clusters=clusters, repeat=repeat,
                  real=str(real) if real else None, real_radius=real_radius, split=split)
    rep = BenchReport("ann", params, out=out)
    t_start = time.time()
    summary = _Summary()
    if dev == "gpu":
        import cupy as cp

        xp = cp
        sync = cp.cuda.Device().synchronize
    else:
        xp = np
        sync = lambda: None  # noqa: E731
    gname = describe_device(dev)
    cname = describe_device("cpu")
    warmed = set()
    settings = [(n, d) for n in sizes for d in dims]
    if real:
        settings.append(("real", 352))
    for n, d in settings:
        if d not in warmed:  # compile every kernel (all variants) on a small problem first
            Xw = clustered(4096, d, clusters=16, seed=5, xp=xp)
            tw = build_kdtree(Xw, leaf_size=leaf_size, split=split)
            knn_bruteforce(Xw, Xw[:300], k)
            for method in ("banns", "anns"):
                for w in windows:
                    query_kdtree(tw, Xw[:300], k, method=method, backtracks=4,
                                 sliding_window=window_kernel if (w and dev == "gpu") else w)
            sync()
            warmed.add(d)
        if time.time() - t_start > time_limit:
            rep.note(f"time limit {time_limit}s reached: skipped N={n}, d={d} and later settings")
            continue
        if n == "real":
            t0 = time.perf_counter()
            X, Q, clouds = pcl_shot_dataset(real, device=dev, radius_factor=real_radius,
                                            max_queries=queries or 100_000)
            sync()
            n, m = len(X), len(Q)
            tag = f"PCL SHOT352 N={n:,} M={m:,} P={k}"
            rep.note(f"real descriptors ({time.perf_counter() - t0:.1f} s to make): SHOT352 at every point of "
                     + "; ".join(f"{c[0]} ({c[1]:,} pts, {c[2]:,} valid, r={real_radius:g}x{c[3]:.4g})"
                                 for c in clouds)
                     + f"; {m:,} random descriptors held out as queries, the rest indexed")
        else:
            m = queries or n
            tag = f"N={n:,} M={m:,} d={d} P={k}"
            X = clustered(n, d, clusters=clusters, seed=1, xp=xp)
            Q = clustered(m, d, clusters=clusters, seed=2, xp=xp)
        sync()
        t_bf, (ed, ei) = _timeit(lambda: knn_bruteforce(X, Q, k), sync, repeat)
        bf_qps = m / t_bf
        base_name = f"exact GEMM brute force q/s ({tag})"
        rep.add(base_name, bf_qps, "queries/s", gname, seconds=t_bf)
        summary.append((tag, "brute force (exact)", "-", "-", t_bf, bf_qps, 1.0, 1.0))
        t_build, tree = _timeit(lambda: build_kdtree(X, leaf_size=leaf_size, split=split), sync, max(1, repeat - 1))
        rep.add(f"KD-tree build time ({tag})", t_build, "s", gname, higher_is_better=False,
                n_nodes=tree.n_nodes, depth=tree.depth, leaves=tree.n_leaves)
        todo = []
        if dev == "gpu" and "banns-window" in variants:
            todo.append(("P-BANNS window", "banns", True))
        if "anns" in variants:
            todo.append(("P-ANNS", "anns", True))
        if dev == "gpu" and "banns-plain" in variants:
            todo.append(("P-BANNS no-window", "banns", False))
        for b in backtracks:
            for label, method, w in todo:
                if time.time() - t_start > time_limit:
                    break
                wk = window_kernel if (w and dev == "gpu") else w
                t, (fd, fi, st) = _timeit(lambda: query_kdtree(tree, Q, k, method=method, backtracks=b,
                                                               sliding_window=wk, return_stats=True),
                                          sync, repeat)
                # scored by the canonical distances of the returned ids, not the reported ones
                fd = pair_distances(X, Q, fi, device=dev)
                r1 = recall(fd[:, :1], ed[:, :1])
                rk = recall(fd, ed)
                rep.add(f"{label} q/s, backtracks={b} ({tag})", m / t, "queries/s", gname,
                        baseline=base_name, baseline_value=bf_qps, seconds=t, recall_at_1=r1,
                        recall_at_P=rk, build_s=t_build, stats=st)
                rep.add(f"{label} recall@{k}, backtracks={b} ({tag})", rk, "fraction", gname)
                summary.append((tag, label, b, f"{t_build:.3f}", t, m / t, r1, rk))
                if method == "banns":
                    print(f"  {tag} {label} bk={b}: {st}", flush=True)
        # CPU backend on a query subset
        if cpu_queries and n <= cpu_max_n and time.time() - t_start < time_limit:
            Xc = to_numpy(X)
            mc = min(cpu_queries, m)
            Qc = to_numpy(Q[:mc])
            edc = to_numpy(ed[:mc])
            knn_bruteforce(Xc, Qc[:2], k, device="cpu")  # compile before timing
            t_cbf, _ = _timeit(lambda: knn_bruteforce(Xc, Qc, k, device="cpu"), lambda: None, 1)
            cbase = f"CPU exact brute force q/s ({tag})"
            rep.add(cbase, mc / t_cbf, "queries/s", cname, seconds=t_cbf)
            summary.append((tag, "CPU brute force", "-", "-", t_cbf, mc / t_cbf, 1.0, 1.0))
            t0 = time.perf_counter()
            ctree = build_kdtree(Xc, leaf_size=leaf_size, split=split, device="cpu")
            t_cbuild = time.perf_counter() - t0
            rep.add(f"CPU KD-tree build time ({tag})", t_cbuild, "s", cname, higher_is_better=False)
            if dev == "gpu":
                rep.add(f"GPU build vs CPU build ({tag})", t_build, "s", gname, baseline="CPU build",
                        baseline_value=t_cbuild, higher_is_better=False)
            query_kdtree(ctree, Qc[:2], k, backtracks=backtracks[0])  # JIT warm-up, not timed
            for b in backtracks:
                t, (_, fi) = _timeit(lambda: query_kdtree(ctree, Qc, k, backtracks=b), lambda: None, 1)
                fd = pair_distances(Xc, Qc, fi, device="cpu")
                r1, rk = recall(fd[:, :1], edc[:, :1]), recall(fd, edc)
                rep.add(f"CPU P-ANNS q/s, backtracks={b} ({tag})", mc / t, "queries/s", cname,
                        baseline=cbase, baseline_value=mc / t_cbf, recall_at_1=r1, recall_at_P=rk)
                summary.append((tag, "CPU P-ANNS", b, f"{t_cbuild:.3f}", t, mc / t, r1, rk))
        X = Q = tree = ctree = Xc = None  # release device memory before the next setting
        if dev == "gpu":
            cp.get_default_memory_pool().free_all_blocks()
    print("\n".join(summary.lines))
    rep.note("recall@P: a returned neighbour counts when its distance <= the exact P-th distance (ties count); "
             "synthetic queries are distinct samples of the same clusters (no self matches)")
    rep.note("q/s rows of the GPU are over all M queries; CPU rows over the first --cpu-queries queries")
    rep.finish(out)
    return rep


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("ann")
    def bench_ann(
        sizes: str = typer.Option("100900", "--sizes", help="comma list of N (k/m suffixes ok; \"\" with --real: real data only)"),
        dims: str = typer.Option("4,16,64,128,256,512,352", "--dims", help="comma list of d"),
        queries: int = typer.Option(0, "--queries", help="M queries (0: M = N)"),
        k: int = typer.Option(4, "-k", help="neighbours per query (P)"),
        backtracks: str = typer.Option("4,16,64", "--backtracks", help="comma list of leaf-visit budgets"),
        leaf_size: int = typer.Option(64, "--leaf-size"),
        device: str = typer.Option("auto", "--device"),
        out: str = typer.Option(None, "--out", help="JSON file or folder"),
        cpu_queries: int = typer.Option(500, "--cpu-queries", help="queries for the CPU rows (0: none)"),
        clusters: int = typer.Option(1000, "--clusters"),
        repeat: int = typer.Option(3, "--repeat"),
        time_limit: float = typer.Option(1e9, "--time-limit", help="stop starting settings after this (s)"),
        variants: str = typer.Option(",".join(VARIANTS), "--variants", help="subset of " + ",".join(VARIANTS)),
        cpu_max_n: int = typer.Option(2_000_000, "--cpu-max-n", help="CPU rows only for N up to this"),
        window_kernel: str = typer.Option("rotate", "--window-kernel",
                                          help="P-BANNS sliding-window kernel: rotate (threads over leaf "
                                               "points) or tile (threads over queries)"),
        real: str = typer.Option(None, "--real", help="folder of PCD/PLY clouds (e.g. ../shared/data/pcl): add a "
                                 "setting of their SHOT352 descriptors (all points; --queries held out, "
                                 "default 100k)"),
        real_radius: float = typer.Option(10.0, "--real-radius", help="SHOT radius in cloud resolutions"),
        split: str = typer.Option("variance", "--split", help="KD-tree split rule: variance (sample variance, "
                                  "mean cut) | median (sample extent, median cut) | midpoint (the paper's)"),
    ):
        """KD-tree P-BANNS / P-ANNS vs exact GEMM brute force on synthetic clustered data."""
        run_bench(parse_counts(sizes), parse_counts(dims), queries, k, parse_counts(backtracks), leaf_size, device, out,
                  cpu_queries, clusters, repeat, time_limit,
                  variants=tuple(v.strip() for v in variants.split(",") if v.strip()), cpu_max_n=cpu_max_n,
                  window_kernel=window_kernel, real=real, real_radius=real_radius, split=split)


if __name__ == "__main__":  # standalone: python -m scanforest.deploy.bench.ann --sizes ...
    _app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    _bench = typer.Typer()
    _app.add_typer(_bench, name="bench")
    register(_app, _bench)
    _app(["bench", "ann", *__import__("sys").argv[1:]])
