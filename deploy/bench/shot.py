"""``scanforest bench shot``: SHOT352 keypoints/s, GPU and CPU in the same run.

It measures SHOT352 keypoints/s end to end (host->device copy of the points, grid
build, normals by k-NN, neighbour lists, frames and histograms) for the PCL recognition scene
with every valid point as a keypoint, and for a synthetic scene of random surfaces (10M points by
default), on the GPU and with the CPU backend in the same run (the CPU on a keypoint subset, its
rate being per keypoint). It also times the four thread-group mappings of the SHOT kernel and
the approximate mode, and prints a phase breakdown.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    bench.command("shot")(bench_shot)


def synthetic_surfaces(n: int, *, seed: int = 0, xp=np, extent: float = 6.0):
    """``n`` points on random spheres and planes inside a cube of ``extent`` metres.

    Density is chosen so that a 0.02 m sphere holds roughly 150 points (like a Kinect scene
    at ~1 m).
    """
    rng = np.random.default_rng(seed)
    density = 150 / (np.pi * 0.02 ** 2)          # points per m^2
    area = n / density
    shapes = []
    acc = 0.0
    while acc < area:
        if rng.random() < 0.7:
            r = rng.uniform(0.05, 0.4)
            a = 4 * np.pi * r * r
            shapes.append(("s", rng.uniform(0.5, extent - 0.5, 3), r, None, a))
        else:
            s = rng.uniform(0.3, 1.2)
            q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
            a = s * s
            shapes.append(("p", rng.uniform(0.5, extent - 0.5, 3), s, q, a))
        acc += shapes[-1][-1]
    areas = np.array([s[-1] for s in shapes])
    counts = np.floor(areas / areas.sum() * n).astype(np.int64)
    counts[0] += n - counts.sum()
    g = xp.random.default_rng(seed)
    out = xp.empty((n, 3), xp.float32)
    o = 0
    for (kind, c, s, q, _), m in zip(shapes, counts):
        if m == 0:
            continue
        if kind == "s":
            v = g.standard_normal((int(m), 3), dtype=xp.float32)
            v /= xp.linalg.norm(v, axis=1, keepdims=True)
            out[o:o + m] = v * xp.float32(s) + xp.asarray(c, dtype=xp.float32)
        else:
            uv = (g.random((int(m), 2), dtype=xp.float32) - 0.5) * xp.float32(s)
            qq = xp.asarray(q[:, :2].T, dtype=xp.float32)
            out[o:o + m] = uv @ qq + xp.asarray(c, dtype=xp.float32)
        o += m
    return out


def _events():
    import cupy as cp

    return cp.cuda.Event(), cp.cuda.Event()


class _Phases:
    """CUDA-event timer for consecutive phases on the current stream."""

    def __init__(self):
        import cupy as cp

        self.cp = cp
        self.marks = []

    def mark(self, name):
        ev = self.cp.cuda.Event()
        ev.record()
        self.marks.append((name, ev))

    def result(self):
        self.marks[-1][1].synchronize()
        out = {}
        for (_, a), (name, b) in zip(self.marks[:-1], self.marks[1:]):
            out[name] = self.cp.cuda.get_elapsed_time(a, b) / 1e3
        return out


def gpu_pipeline(pts_host, radius, normal_k, *, keypoints="all", approximate=False, lpk=None,
                 copy_out=False, host_buffers=None):
    """End-to-end GPU SHOT on host points; returns (desc, frames, phases dict seconds)."""
    import cupy as cp

    from scanforest.kernels.backend import pinned_empty
    from scanforest.kernels.descriptors import shot_gpu as sg
    from scanforest.kernels.neighbors import search_gpu as ng

    ph = _Phases()
    ph.mark("start")
    pts = cp.asarray(pts_host)
    ph.mark("h2d points")
    # normals: k-NN on a grid sized for k, computed in input order
    gk = ng.build_grid_knn(pts, normal_k)
    ph.mark("normals grid")
    idx, _ = ng.knn(gk, pts, normal_k)
    ph.mark("normals k-NN")
    n = pts.shape[0]
    nrm0 = cp.empty((n, 3), cp.float32)
    curv = cp.empty(n, cp.float32)
    off = cp.arange(0, (n + 1) * normal_k, normal_k, dtype=cp.int64)
    sg.launch_normals(pts, gk.points, off, idx.reshape(-1), [np.float64(0)] * 3, nrm0, curv, lpk=8)
    del idx, off, gk
    ph.mark("normals PCA")
    g = ng.build_grid(pts, radius)
    nrm = nrm0[g.order]
    ph.mark("SHOT grid build")
    kp = g.points if keypoints == "all" else cp.ascontiguousarray(g.points[keypoints])
    nk = kp.shape[0]
    desc = cp.empty((nk, 352), cp.float32)
    frames = cp.empty((nk, 3, 3), cp.float32)
    counts = ng.count(g, kp, radius)
    cap = None
    if approximate:
        from scanforest.kernels.descriptors.shot import median_count

        cap = median_count(counts)
    ph.mark("neighbour count")
    t_fill = t_shot = 0.0
    budget = 1 << 28
    if copy_out:
        # results leave through pinned memory on a second stream, batch by batch, so the copy
        # of one batch overlaps the SHOT of the next (4 batches: 8 measured 4.95M keypoints/s on an
        # H100, the smaller launches and per-batch host syncs costing more than the copy they hide)
        # a pipeline reuses its pinned buffers scene after scene (``host_buffers``); a fresh
        # cudaHostAlloc of 340 MB costs more than the copy
        host_desc, host_frames = host_buffers or (pinned_empty((nk, 352), np.float32),
                                                  pinned_empty((nk, 3, 3), np.float32))
        copy_stream = cp.cuda.Stream(non_blocking=True)
        budget = min(budget, max(1, int(counts.sum()) // 4 + 1))
    for s, e in sg.batches(counts, budget):
        a, b = _events()
        c, d = _events()
        a.record()
        off = ng.offsets_from_counts(counts[s:e])
        nidx, d2 = ng.fill(g, kp[s:e], radius, off, int(off[-1]))
        if approximate:
            off, nidx, d2 = ng.cap_lists(g, off, nidx, d2, cap)
        b.record()
        c.record()
        sg.launch_shot(kp[s:e], g, nrm, off, nidx, d2, radius, desc[s:e], frames[s:e],
                       lpk=lpk or sg.DEFAULT_LPK)
        d.record()
        if copy_out:
            copy_stream.wait_event(d)
            desc[s:e].get(stream=copy_stream, out=host_desc[s:e], blocking=False)
            frames[s:e].get(stream=copy_stream, out=host_frames[s:e], blocking=False)
        d.synchronize()
        t_fill += cp.cuda.get_elapsed_time(a, b) / 1e3
        t_shot += cp.cuda.get_elapsed_time(c, d) / 1e3
        del nidx, d2, off
    ph.mark("lists + SHOT")
    if copy_out:  # the timeline's last event waits for the copies (what the copy did not hide)
        cp.cuda.get_current_stream().wait_event(copy_stream.record())
        ph.mark("d2h descriptors")
        copy_stream.synchronize()
        desc, frames = host_desc, host_frames
    phases = ph.result()
    total = sum(phases.values())   # first to last event: every gap on the stream included
    rest = phases.pop("lists + SHOT")
    phases["neighbour lists (fill/cap)"] = t_fill
    phases["SHOT kernel"] = t_shot
    phases["other (offsets, host syncs)"] = rest - t_fill - t_shot
    phases["_total"] = total
    return desc, frames, phases, int(counts.sum()), cap


def cpu_pipeline(pts, radius, normal_k, kp_idx):
    from scanforest.kernels.descriptors.normals import normals
    from scanforest.kernels.descriptors.shot import shot

    t0 = time.perf_counter()
    n, _ = normals(pts, k=normal_k, device="cpu")
    t1 = time.perf_counter()
    d, f = shot(pts, n, kp_idx, radius, device="cpu")
    t2 = time.perf_counter()
    return d, f, {"normals (all points)": t1 - t0, "SHOT": t2 - t1}


def bench_shot(
    scene: Path = typer.Option(None, help="Dense scene (default: ../shared/data/pcl/"
                               "milk_cartoon_all_small_clorox.pcd)."),
    radius: float = typer.Option(0.02, help="SHOT radius (m)."),
    normal_k: int = typer.Option(10, help="k of the normal estimation."),
    synthetic: int = typer.Option(10_000_000, help="Points of the synthetic scene (0: skip)."),
    cpu_keypoints: int = typer.Option(20_000, help="Keypoints timed on the CPU backend."),
    repeat: int = typer.Option(3, help="Timed repetitions (median)."),
    out: Path = typer.Option(None, help="JSON file or folder for the record."),
    pcl_baseline: Path = typer.Option(None, help="PCL baseline binary (build deploy/baselines/"
                                      "pcl_shot_bench.cpp): PCL's NormalEstimationOMP + SHOTEstimationOMP "
                                      "against the CPU backend, all points as keypoints, same thread count."),
    threads: int = typer.Option(0, help="Threads of the PCL comparison (0: all cores)."),
) -> None:
    """SHOT352 keypoints/s end to end, GPU and CPU in the same run, with a phase breakdown."""
    from scanforest.kernels.backend import describe_device, gpu_available, pinned_empty
    from scanforest.tasks.readers import read_cloud

    from ._common import BenchReport, check_program

    check_program(pcl_baseline, "--pcl-baseline")
    if scene is None:
        from ._data import pcl_data_dir

        scene = pcl_data_dir() / "milk_cartoon_all_small_clorox.pcd"
    pts = np.ascontiguousarray(read_cloud(scene).points, dtype=np.float32)
    rep = BenchReport("shot", {"scene": str(scene), "points": len(pts), "radius": radius,
                               "normal_k": normal_k, "synthetic": synthetic,
                               "cpu_keypoints": cpu_keypoints, "repeat": repeat}, out=out)
    cpu_dev = describe_device("cpu")
    rng = np.random.default_rng(0)

    cpu_out = {}

    def cpu_rate(p, label):
        sub = np.sort(rng.choice(len(p), size=min(cpu_keypoints, len(p)), replace=False))
        cpu_pipeline(p[:2000], radius, normal_k, np.arange(100))  # warm-up / JIT
        dcpu, fcpu, ph = cpu_pipeline(p, radius, normal_k, sub)
        cpu_out[label] = (sub, dcpu, fcpu)
        # per-keypoint rate: normals are needed for every point, charged in full
        rate = len(sub) / (ph["SHOT"] + ph["normals (all points)"] * len(sub) / len(p))
        shot_rate = len(sub) / ph["SHOT"]
        rep.add(f"CPU keypoints/s end to end, {label}", rate, "keypoints/s", cpu_dev,
                keypoints=len(sub), **ph)
        rep.add(f"CPU keypoints/s SHOT only, {label}", shot_rate, "keypoints/s", cpu_dev)
        return rate

    if pcl_baseline is not None:
        _pcl_comparison(rep, pcl_baseline, scene, pts, radius, normal_k, threads, repeat)
    cpu_dense = cpu_rate(pts, f"{scene.name} (r={radius})")
    if not gpu_available():
        rep.note("no GPU: GPU rows skipped")
        rep.finish(out)
        return
    import cupy as cp

    from scanforest.kernels.descriptors import shot_gpu as sg

    gdev = describe_device("gpu")

    def gpu_case(p, label, cpu_baseline, **kw):
        if kw.get("copy_out"):  # pinned output buffers, allocated once as a pipeline would
            kw["host_buffers"] = (pinned_empty((len(p), 352), np.float32), pinned_empty((len(p), 3, 3), np.float32))
        gpu_pipeline(p, radius, normal_k, **kw)  # warm-up (compilation)
        cp.cuda.Device().synchronize()
        runs = [gpu_pipeline(p, radius, normal_k, **kw) for _ in range(repeat)]
        totals = [r[2]["_total"] for r in runs]
        best = runs[int(np.argsort(totals)[len(totals) // 2])]
        _, _, phases, entries, cap = best
        nk = len(p)
        row = rep.add(f"GPU keypoints/s end to end, {label}", nk / phases["_total"], "keypoints/s",
                      gdev, baseline="CPU same scene", baseline_value=cpu_baseline,
                      keypoints=nk, neighbour_entries=entries, cap=cap,
                      **{k: v for k, v in phases.items()})
        return row, phases

    dense_label = f"{scene.name}, all {len(pts)} points (r={radius})"
    # thread-group mapping comparison (SHOT kernel time only); the fastest is used below
    kernel_ms = {}
    for lpk in sg.LPK_CHOICES:
        ts = []
        for _ in range(repeat + 1):
            _, _, phl, _, _ = gpu_pipeline(pts, radius, normal_k, lpk=lpk)
            ts.append(phl["SHOT kernel"])
        t = float(np.median(ts[1:]))
        kernel_ms[lpk] = t * 1e3
        rep.add(f"SHOT kernel keypoints/s, {lpk} lanes per keypoint, dense scene", len(pts) / t,
                "keypoints/s", gdev, kernel_ms=t * 1e3)
    best = min(kernel_ms, key=kernel_ms.get)
    rep.note(f"fastest mapping: {best} lanes per keypoint (used for the end-to-end rows)")
    _, ph = gpu_case(pts, dense_label, cpu_dense, lpk=best)
    for k, v in ph.items():
        rep.note(f"dense phase {k}: {v * 1e3:.2f} ms")
    _, ph = gpu_case(pts, dense_label + " + D2H of descriptors", cpu_dense, copy_out=True, lpk=best)
    rep.note(f"dense D2H of descriptors+frames (pinned, overlapped with SHOT in 4+ batches), the part not "
             f"hidden behind the kernels: {ph.get('d2h descriptors', 0) * 1e3:.2f} ms")
    _, pha = gpu_case(pts, dense_label + " APPROXIMATE", cpu_dense, approximate=True, lpk=best)
    for k, v in pha.items():
        rep.note(f"dense approximate phase {k}: {v * 1e3:.2f} ms")
    try:
        _agreement(rep, pts, radius, normal_k, best, cpu_out, gdev)
    except Exception as exc:  # keep the timing rows even if this check breaks
        rep.note(f"agreement check failed: {type(exc).__name__}: {exc}")
    if synthetic > 0:
        try:
            syn = cp.asnumpy(synthetic_surfaces(synthetic, xp=cp))
            # the CPU baseline of this row is the dense scene's CPU rate (a CPU run on 10M
            # points would spend most of the device session on normals)
            _, ph = gpu_case(syn, f"synthetic {synthetic} points, all keypoints (r={radius})",
                             cpu_dense, lpk=best)
            for k, v in ph.items():
                rep.note(f"synthetic phase {k}: {v * 1e3:.2f} ms")
        except Exception as exc:
            rep.note(f"synthetic scene failed: {type(exc).__name__}: {exc}")
    rep.finish(out)


def _pcl_comparison(rep, binary, scene, pts, radius, normal_k, threads, repeat):
    """PCL's OMP normals + SHOT (external binary) vs the CPU backend, all points, same threads."""
    import os

    from ._common import numba_threads, run_baseline

    threads = threads or os.cpu_count() or 1
    cmd = [binary, scene, radius, normal_k, threads, max(1, repeat)]
    got = run_baseline(rep, cmd)
    if got is None:
        return
    pcl, _ = got
    with numba_threads(threads):
        cpu_pipeline(pts[:2000], radius, normal_k, np.arange(100))  # JIT warm-up
        tot = []
        for _ in range(max(1, repeat)):
            _, _, ph = cpu_pipeline(pts, radius, normal_k, np.arange(len(pts)))
            tot.append((ph["normals (all points)"] + ph["SHOT"], ph))
        t, ph = sorted(tot, key=lambda x: x[0])[len(tot) // 2]
    dev = f"cpu ({threads} threads)"
    base = f"PCL 1.13 NormalEstimationOMP + SHOTEstimationOMP keypoints/s, all {pcl['points']} points"
    rep.add(base, pcl["keypoints_per_s"], "keypoints/s", dev, normals_s=pcl["normals_s"], shot_s=pcl["shot_s"])
    rep.add(f"CPU backend keypoints/s, all {len(pts)} points (same pipeline)", len(pts) / t, "keypoints/s", dev,
            baseline=base, baseline_value=pcl["keypoints_per_s"], **ph)
    rep.note(f"PCL baseline: {' '.join(map(str, cmd))}: normals {pcl['normals_s']:.2f} s, SHOT {pcl['shot_s']:.2f} s; "
             f"CPU backend: normals {ph['normals (all points)']:.2f} s, SHOT {ph['SHOT']:.2f} s")


def _agreement(rep, pts, radius, normal_k, best, cpu_out, gdev):
    """GPU vs CPU descriptors on the CPU's keypoint subset (same pipeline: k-NN normals)."""
    import cupy as cp

    from scanforest.kernels.neighbors import search_gpu as ng

    sub, dcpu, fcpu = next(iter(cpu_out.values()))
    dg, fg, _, _, _ = gpu_pipeline(pts, radius, normal_k, lpk=best)
    g_order = ng.build_grid(cp.asarray(pts), radius).order
    pos = cp.empty_like(g_order)
    pos[g_order] = cp.arange(len(pts), dtype=g_order.dtype)
    pos = cp.asnumpy(pos)[sub]
    dgs = cp.asnumpy(dg[cp.asarray(pos)])
    same_nan = bool((np.isnan(dgs[:, 0]) == np.isnan(dcpu[:, 0])).all())
    ok = np.isfinite(dgs[:, 0]) & np.isfinite(dcpu[:, 0])
    err = np.abs(dgs[ok] - dcpu[ok]).max(axis=1)
    rep.add("GPU vs CPU descriptors: max abs diff (dense, CPU keypoint subset)", float(err.max()),
            "abs", gdev, higher_is_better=False, same_nan_pattern=same_nan,
            keypoints_over_1e4=int((err > 1e-4).sum()), keypoints=int(ok.sum()),
            median=float(np.median(err)))
