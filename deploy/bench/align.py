"""``scanforest bench align``: parametric chamfer alignment (PChA) timings and convergence.

It runs the paper's settings on synthetic data with a known transform
(reference and observed points are independent samples of one shape, see
:func:`scanforest.kernels.align.pcha.synthetic_problem`): 1M observed points, 2-D and 3-D, every model;
time per LM iteration (one evaluation of f, g, H at the candidate plus the host step) and total
(upload of points and of the distance-transform table included, the DT itself excluded as in
the paper; a second row with the table already resident), fused vs two-kernel, batched vs one
at a time, with the CPU backend (numba, all cores) as the baseline measured in the same run; a
size sweep gives the break-even point size; ``--convergence`` adds the convergence table.
"""
from __future__ import annotations

import time

import numpy as np
import typer

from ._common import parse_counts


def _sync():
    """Wait for the GPU. A CUDA error raises here, where the timing it would falsify is taken,
    instead of being swallowed."""
    from scanforest.kernels.backend import gpu_available

    if not gpu_available():  # no CuPy or no GPU: nothing ran on a device
        return
    import cupy as cp

    cp.cuda.Device().synchronize()


def _median_time(fn, repeat: int, warmup: int = 1):
    for _ in range(warmup):
        fn()
    _sync()
    ts = []
    res = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), res


def convergence_table(models=None, levels=(0.25, 0.5, 1.0, 1.5), trials: int = 10,
                      n_points: int = 20000, device: str = "cpu", success: float = 1e-2,
                      chain: bool = True, lookups=("corners", "cell")):
    """Convergence rate and final error per model and initial-error level.

    For every (dim, model, level) ``trials`` random transforms (:func:`random_transform`: level
    1.0 = rotations up to 20 deg, translations up to 0.2 of the shape size, 10 % scale, 0.1
    affine and 0.05 projective distortion) are aligned from the identity, all trials of a cell
    batched in one :func:`align_batch`. A trial succeeds when the RMS displacement between the
    estimated and the true transform over the observed points is below ``success`` (relative to
    the shape size, about 1). Returns a list of dict rows.
    """
    from scanforest.kernels.align import transforms as T
    from scanforest.kernels.align.edt import distance_transform
    from scanforest.kernels.align.pcha import align_batch, point_error, synthetic_problem

    rows = []
    for dim, names in T.MODEL_NAMES.items():
        _, ref, _ = synthetic_problem("rigid", dim, 100, n_reference=max(4000, n_points // 2), seed=0)
        grid = distance_transform(ref, device=device)
        for name in names:
            if models and name not in models and f"{dim}d-{name}" not in models:
                continue
            for level, lookup in [(lv, lk) for lk in lookups for lv in levels]:
                probs = [synthetic_problem(name, dim, n_points, level=level, seed=1000 + t)
                         for t in range(trials)]
                obs = [p[0] for p in probs]
                t0 = time.perf_counter()
                res = align_batch(obs, None, name, grid=grid, device=device, lookup=lookup,
                                  chain=chain and name in ("affine", "projective"))
                dt = time.perf_counter() - t0
                errs = np.array([point_error(r.transform, p[2], p[0]) for r, p in zip(res, probs)])
                its = np.array([r.iterations for r in res])
                mono = all(np.all(np.diff(r.history) <= 1e-12 * r.history[0]) for r in res)
                rows.append(dict(dim=dim, model=name, level=level, lookup=lookup, trials=trials,
                                 rate=float(np.mean(errs < success)),
                                 median_error=float(np.median(errs)), max_error=float(errs.max()),
                                 median_iterations=float(np.median(its)), monotone=mono,
                                 seconds=dt))
    return rows


def format_convergence(rows) -> str:
    head = (f"{'dim':>3} {'model':<11} {'lookup':<7} {'level':>5} {'rate':>5} {'med err':>9} "
            f"{'max err':>9} {'med it':>6} mono")
    lines = ["convergence (success: RMS point error < 1e-2 of the shape size)", head]
    for r in rows:
        lines.append(f"{r['dim']:>3} {r['model']:<11} {r['lookup']:<7} {r['level']:>5.2f} {r['rate']:>5.2f} "
                     f"{r['median_error']:>9.2e} {r['max_error']:>9.2e} {r['median_iterations']:>6.0f} "
                     f"{'yes' if r['monotone'] else 'NO'}")
    return "\n".join(lines)


def run_bench(points, dims, models, batch, batch_points, sweep, device, out, cpu, convergence,
              trials, repeat, level, time_limit):
    from ._common import BenchReport
    from scanforest.kernels.align import transforms as T
    from scanforest.kernels.align.edt import distance_transform
    from scanforest.kernels.align.pcha import (CpuEvaluator, align, align_batch, point_error,
                                               synthetic_problem)
    from scanforest.kernels.backend import describe_device, resolve_device

    dev = resolve_device(device)
    params = dict(points=points, dims=dims, models=models, batch=batch, batch_points=batch_points,
                  sweep=sweep, device=dev, cpu=cpu, level=level, repeat=repeat)
    rep = BenchReport("align", params, out=out)
    _add = rep.add

    def add(*a, **k):  # print every row as soon as it is measured (a killed run keeps them)
        row = _add(*a, **k)
        print(f"  {row.figure}: {row.value:.4g} {row.unit} [{row.device}]", flush=True)
        return row

    rep.add = add
    cpu_name = describe_device("cpu")
    gpu_name = describe_device("gpu") if dev == "gpu" else None
    t_start = time.time()
    if dev == "gpu":
        from scanforest.kernels.align.pcha import gpu_evaluator

    for dim in dims:
        _, ref, _ = synthetic_problem("rigid", dim, 100, n_reference=max(4000, points // 4), seed=0)
        t_cpu_dt, grid_cpu = _median_time(lambda: distance_transform(ref, device="cpu"), 1, 0)
        rep.add(f"{dim}-D distance transform, Nq={len(ref):,}, grid {grid_cpu.shape} (excluded)",
                t_cpu_dt * 1e3, "ms", cpu_name, higher_is_better=False)
        if dev == "gpu":
            t_gpu_dt, grid_gpu = _median_time(lambda: distance_transform(ref, device="gpu"), 3)
            rep.add(f"{dim}-D distance transform, grid {grid_gpu.shape} (excluded)", t_gpu_dt * 1e3,
                    "ms", gpu_name, baseline="cpu distance transform", baseline_value=t_cpu_dt * 1e3,
                    higher_is_better=False)
        for name in T.MODEL_NAMES[dim]:
            if models and name not in models:
                continue
            if time.time() - t_start > time_limit:
                rep.note(f"time limit reached before {dim}-D {name}")
                break
            m = T.get_model(name, dim)
            obs, _, M = synthetic_problem(name, dim, points, level=level, seed=7)
            chain = False
            tag = f"{dim}-D {name}, N={points:,}"
            # CPU baseline: total and per evaluation
            t_cpu = per_cpu = None
            if cpu:
                t_cpu, r_cpu = _median_time(
                    lambda: align(obs, None, name, grid=grid_cpu, device="cpu", chain=chain), 1)
                ev = CpuEvaluator(m, grid_cpu, [grid_cpu.normalize(obs)])
                P = T.from_matrix(m, T.conjugate(M, grid_cpu.center, grid_cpu.scale))[None]
                per_cpu, _ = _median_time(lambda: ev(P, np.ones(1, bool), np.ones(1)), repeat)
                rep.add(f"{tag}: total (CPU numba, {r_cpu.iterations} it)", t_cpu * 1e3, "ms",
                        cpu_name, higher_is_better=False, iterations=r_cpu.iterations,
                        error=point_error(r_cpu.transform, M, obs), status=r_cpu.status)
                rep.add(f"{tag}: f,g,H evaluation (CPU numba)", per_cpu * 1e3, "ms", cpu_name,
                        higher_is_better=False)
            if dev != "gpu":
                continue
            import cupy as cp

            # total, like the paper: points and DT table uploaded from the host, LM to the end
            t_tot, r_gpu = _median_time(
                lambda: align(obs, None, name, grid=grid_cpu, device="gpu", chain=chain), repeat)
            rep.add(f"{tag}: total incl. upload of points + DT table, fused ({r_gpu.iterations} it)",
                    t_tot * 1e3, "ms", gpu_name, baseline="CPU numba total" if cpu else None,
                    baseline_value=None if t_cpu is None else t_cpu * 1e3, higher_is_better=False,
                    iterations=r_gpu.iterations, error=point_error(r_gpu.transform, M, obs),
                    status=r_gpu.status)
            obs_d = cp.asarray(obs)
            t_res, r_res = _median_time(
                lambda: align(obs_d, None, name, grid=grid_gpu, device="gpu", chain=chain), repeat)
            rep.add(f"{tag}: total, points + table resident on GPU, fused", t_res * 1e3, "ms",
                    gpu_name, baseline="CPU numba total" if cpu else None,
                    baseline_value=None if t_cpu is None else t_cpu * 1e3, higher_is_better=False)
            rep.add(f"{tag}: time per LM iteration (total/iterations), fused",
                    t_res / max(1, r_res.iterations) * 1e3, "ms", gpu_name, higher_is_better=False)
            t_2k, r_2k = _median_time(
                lambda: align(obs_d, None, name, grid=grid_gpu, device="gpu", chain=chain,
                              form="two_kernel"), repeat)
            rep.add(f"{tag}: total, resident, two-kernel ({r_2k.iterations} it)", t_2k * 1e3, "ms",
                    gpu_name, baseline="fused total", baseline_value=t_res * 1e3,
                    higher_is_better=False)
            t_cell, r_cell = _median_time(
                lambda: align(obs_d, None, name, grid=grid_gpu, device="gpu", chain=chain,
                              lookup="cell"), repeat)
            rep.add(f"{tag}: total, resident, fused, paper's single-cell lookup "
                    f"({r_cell.iterations} it)", t_cell * 1e3, "ms", gpu_name,
                    baseline="fused total", baseline_value=t_res * 1e3, higher_is_better=False,
                    error=point_error(r_cell.transform, M, obs))
            # per-evaluation times: host round trip (upload, kernels, download, host contraction)
            # and the kernels alone (CUDA events)
            on = (obs_d - cp.asarray(grid_gpu.center)) / grid_gpu.scale
            P = T.from_matrix(m, T.conjugate(M, grid_gpu.center, grid_gpu.scale))[None]
            forms = [("fused", "reduced", "corners"), ("fused", "full", "corners"),
                     ("two_kernel", "full", "corners"), ("fused", "reduced", "cell")]
            k_base = None
            seen = set()
            for form, hess, lk in forms:
                if m.compositional:
                    hess = "full"  # the projective model has no reduced statistics
                if (form, hess, lk) in seen:
                    continue
                seen.add((form, hess, lk))
                ev = gpu_evaluator(m, grid_gpu, [on], form=form, hessian=hess, lookup=lk)
                t_ev, _ = _median_time(lambda: ev(P, np.ones(1, bool), np.ones(1)), repeat * 5, 3)
                k_ms = ev.kernel_ms(P)
                if k_base is None:
                    k_base = k_ms
                label = f"{form} ({hess} H, {lk} lookup)"
                rep.add(f"{tag}: f,g,H evaluation round trip, {label}", t_ev * 1e3, "ms", gpu_name,
                        baseline="CPU numba evaluation" if per_cpu else None,
                        baseline_value=None if per_cpu is None else per_cpu * 1e3,
                        higher_is_better=False)
                rep.add(f"{tag}: f,g,H kernels only (CUDA events), {label}", k_ms, "ms", gpu_name,
                        baseline="fused kernels", baseline_value=k_base, higher_is_better=False)
            del obs_d, on

    # batched vs one at a time (3-D rigid)
    if dev == "gpu" and batch > 0 and 3 in dims:
        import cupy as cp

        _, ref, _ = synthetic_problem("rigid", 3, 100, n_reference=max(4000, points // 4), seed=0)
        grid_gpu = distance_transform(ref, device="gpu")
        grid_cpu = grid_gpu.to("cpu")
        obs = [synthetic_problem("rigid", 3, batch_points, level=level, seed=100 + i)[0]
               for i in range(batch)]
        obs_d = [cp.asarray(o) for o in obs]
        t_b, rb = _median_time(lambda: align_batch(obs_d, None, "rigid", grid=grid_gpu,
                                                   device="gpu"), repeat)
        t_s, _ = _median_time(lambda: [align(o, None, "rigid", grid=grid_gpu, device="gpu")
                                       for o in obs_d], 1)
        tag = f"3-D rigid, {batch} alignments x {batch_points:,} points"
        t_c = None
        if cpu:
            t_c, _ = _median_time(lambda: align_batch(obs, None, "rigid", grid=grid_cpu,
                                                      device="cpu"), 1, 0)
            rep.add(f"{tag}: CPU numba", t_c * 1e3, "ms", cpu_name, higher_is_better=False)
        rep.add(f"{tag}: GPU one at a time", t_s * 1e3, "ms", gpu_name,
                baseline="CPU numba" if t_c else None, baseline_value=t_c and t_c * 1e3,
                higher_is_better=False)
        rep.add(f"{tag}: GPU batched (one launch per LM iteration)", t_b * 1e3, "ms", gpu_name,
                baseline="GPU one at a time", baseline_value=t_s * 1e3, higher_is_better=False,
                max_iterations=max(r.iterations for r in rb))

    # size sweep, break-even (3-D rigid, table resident on each device)
    if sweep and cpu and dev == "gpu":
        import cupy as cp

        _, ref, _ = synthetic_problem("rigid", 3, 100, n_reference=max(4000, max(sweep) // 4), seed=0)
        grid_gpu = distance_transform(ref, device="gpu")
        grid_cpu = grid_gpu.to("cpu")
        even = None
        for n in sweep:
            obs, _, M = synthetic_problem("rigid", 3, n, level=level, seed=3)
            obs_d = cp.asarray(obs)
            tc, rc = _median_time(lambda: align(obs, None, "rigid", grid=grid_cpu, device="cpu"),
                                  repeat)
            tg, rg = _median_time(lambda: align(obs_d, None, "rigid", grid=grid_gpu, device="gpu"),
                                  repeat)
            rep.add(f"sweep 3-D rigid N={n:,}: GPU total ({rg.iterations} it; CPU {rc.iterations} it)",
                    tg * 1e3, "ms", gpu_name, baseline="CPU numba total", baseline_value=tc * 1e3,
                    higher_is_better=False)
            if even is None and tg < tc:
                even = n
        rep.note(f"break-even (3-D rigid, GPU total < CPU numba total, tables resident): "
                 f"N = {even if even is not None else 'not reached in the sweep'}")

    if convergence:
        print("convergence table ...", flush=True)
        rows = convergence_table(trials=trials, device=dev)
        rep.params["convergence"] = rows
        print(format_convergence(rows))
    rep.note("paper reference (not measured here): PGPU 790 ms for a 1.14M-point 3-D scan, "
             "3-D similarity, GTX 760; target < 40 ms")
    return rep.finish(out)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("align")
    def bench_align(
        points: str = typer.Option("1m", "--points", help="observed points (k/m suffix ok)"),
        dims: str = typer.Option("2,3", "--dims"),
        models: str = typer.Option("", "--models", help="comma list (default: every model)"),
        batch: int = typer.Option(64, "--batch", help="alignments in the batched row (0: skip)"),
        batch_points: str = typer.Option("16k", "--batch-points"),
        sweep: str = typer.Option("1k,3k,10k,30k,100k,300k,1m", "--sweep", help="'' to skip"),
        device: str = typer.Option("auto", "--device"),
        out: str = typer.Option(None, "--out", help="JSON file or folder"),
        cpu: bool = typer.Option(True, "--cpu/--no-cpu", help="CPU numba baseline rows"),
        convergence: bool = typer.Option(False, "--convergence", help="print the convergence table"),
        trials: int = typer.Option(10, "--trials", help="trials per convergence cell"),
        repeat: int = typer.Option(3, "--repeat"),
        level: float = typer.Option(0.5, "--level", help="initial error level of the timed runs"),
        time_limit: float = typer.Option(1e9, "--time-limit"),
    ):
        """PChA timings (paper settings) and, with --convergence, the convergence table."""
        run_bench(parse_counts(points)[0], parse_counts(dims), [m for m in models.split(",") if m],
                  batch, parse_counts(batch_points)[0], parse_counts(sweep), device, out, cpu, convergence,
                  trials, repeat, level, time_limit)
