"""``scanforest bench match``: distributed matching throughput on 1..W workers (one per GPU with
dask-cuda), parallel efficiency, bytes moved between workers, against the exact brute force on
the same devices in the same run."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from scanforest.kernels._backend import describe_device, resolve_device
from scanforest.kernels.bruteforce import knn_bruteforce, recall

from ._bench import BenchReport
from ._runner import dask_client


def _transfer_bytes(client) -> int:
    def get(dask_worker):
        return int(dask_worker.transfer_outgoing_bytes_total)

    return int(sum(client.run(get).values()))


def run(n: int, m: int, d: int, k: int, workers: list[int], *, method: str, backtracks: int | None,
        leaf_size: int, device: str, block: int, out, clusters: int = 1000) -> BenchReport:
    from scanforest.tasks import index as idx

    from .cli_ann import clustered
    from .distributed import DistributedIndex

    dev = resolve_device(device)
    rep = BenchReport("match", {"n": n, "m": m, "d": d, "k": k, "workers": workers, "method": method,
                                "backtracks": backtracks, "leaf_size": leaf_size, "block": block})
    X = clustered(n, d, clusters=clusters, seed=1)
    Q = clustered(m, d, clusters=clusters, seed=2)
    tmp = tempfile.mkdtemp(prefix="sf-bench-match-")
    try:
        # exact brute force on one device: the baseline and the recall reference
        t0 = time.perf_counter()
        if dev == "gpu":
            import cupy as cp

            Xd, Qd = cp.asarray(X), cp.asarray(Q)
            knn_bruteforce(Xd, Qd[: min(m, 1000)], k)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            bd, _ = knn_bruteforce(Xd, Qd, k)
            cp.cuda.Device().synchronize()
            bd = cp.asnumpy(bd)
            del Xd, Qd
            cp.get_default_memory_pool().free_all_blocks()
        else:
            bd, _ = knn_bruteforce(X, Q, k, device="cpu")
        t_bf = time.perf_counter() - t0
        devname = describe_device(dev)
        rep.add("exact brute force queries/s (1 device)", m / t_bf, "queries/s", devname)
        base_qps = {}
        for w in workers:
            store = os.path.join(tmp, f"s{w}.zarr")
            t0 = time.perf_counter()
            idx.build_index(store, "bench", X, shards=w,
                            params={"method": method, "leaf_size": leaf_size, "backtracks": backtracks},
                            device=dev)
            t_build = time.perf_counter() - t0
            with dask_client(None, n_workers=w, device=dev) as client:
                di = DistributedIndex(client, store, "bench", device=dev)
                client.gather(di.shards)
                di.query(Q[: min(m, block)], k, block=block)  # warm-up (kernels compiled, pools grown)
                b0 = _transfer_bytes(client)
                t0 = time.perf_counter()
                dist, ids = di.query(Q, k, block=block)
                t = time.perf_counter() - t0
                moved = _transfer_bytes(client) - b0
                di.close()
            qps = m / t
            base_qps[w] = qps
            r = recall(dist, bd, k)
            label = f"{method} queries/s, {w} worker{'s' if w > 1 else ''}"
            rep.add(label, qps, "queries/s", f"{devname} x{w}", baseline="exact brute force (1 device)",
                    baseline_value=m / t_bf, recall=r, method=method, workers=w)
            rep.add(f"index build (write + trees), {w} shards", t_build, "s", devname, higher_is_better=False)
            nblocks = -(-m // block)
            rep.add(f"bytes moved between workers per query block, {w} workers", moved / nblocks, "bytes",
                    f"{devname} x{w}", higher_is_better=False)
            rep.add(f"recall@{k}, {w} workers", r, "", f"{devname} x{w}")
        if 1 in base_qps:
            for w, q in base_qps.items():
                if w > 1:
                    rep.add(f"parallel efficiency 1 -> {w} workers", q / (w * base_qps[1]), "", f"{devname}")
        rep.note("workers share one host; with one GPU, several workers share it (efficiency then measures "
                 "orchestration, not GPU scaling)" if dev == "gpu" else
                 f"CPU workers share {os.cpu_count()} cores")
        rep.finish(out)
        return rep
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def register_bench(bench) -> None:
    import typer

    @bench.command("match")
    def bench_match(
        n: int = typer.Option(200_000, help="Reference descriptors."),
        m: int = typer.Option(20_000, help="Queries."),
        d: int = typer.Option(352, help="Dimension (SHOT: 352)."),
        k: int = typer.Option(4, "-k"),
        workers: str = typer.Option("1,2", help="Worker counts to run (comma separated)."),
        method: str = typer.Option("anns"),
        backtracks: int = typer.Option(256, help="Leaf visits per query (0 = unlimited, exact)."),
        leaf_size: int = typer.Option(64),
        block: int = typer.Option(10_000, help="Queries per block sent to every shard."),
        device: str = typer.Option("auto"),
        out: str = typer.Option(None, "--out"),
    ):
        """Distributed matching: queries/s on 1..W workers, efficiency, bytes moved, vs brute force."""
        run(n, m, d, k, [int(w) for w in workers.split(",")], method=method, backtracks=backtracks or None,
            leaf_size=leaf_size, device=device, block=block, out=out)

