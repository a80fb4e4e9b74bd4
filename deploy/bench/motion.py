"""``scanforest bench motion``: dense motion from sparse tracks, GPU against the CPU backend.

Prefect-free and OpenCV-free (tracks are the synthetic generator's exact tracks; KLT is timed
separately when OpenCV is importable), so it runs on a bare GPU machine.

Scene: the two-layer synthetic sequence (:func:`scanforest.kernels.synthetic.sequences.sequence`,
``layers``: background (-1.2, 0.3) px/frame, foreground disc (2.1, 0.8) px/frame, so the DFS
has 4 x 2 = 8 labels, the paper's count), ``--features`` exact tracks per pair (default 156: the
feature count of the paper's timed 320x240 runs, Fig. 4 and 5). Per size and method:

* CPU numba (all cores), one pair per call - the baseline of every GPU row;
* GPU end to end, one pair per call: host frames uploaded, flow and mask downloaded (the
  paper's 6.2 ms / 48 ms include every transfer);
* GPU resident, one pair per call: frames already on the device, result left there (CUDA
  events around the whole API call: table upload, feature sampling, flow kernel);
* GPU resident, ``--batch`` pairs per call (a sequence of batch + 1 frames, one launch);
* the flow kernel alone (CUDA events).

KLT tracking time is not included in these figures; with OpenCV present it is its own row
(``cv2.goodFeaturesToTrack`` + ``calcOpticalFlowPyrLK`` on the CPU). ``--tracking`` (default)
adds the figures *with* tracking, frames on the host (issue 25), per size:

* the built-in tracker alone (:mod:`scanforest.kernels.motion.tracking`: the GPU tracker on a
  GPU run, the numba one otherwise), one pair per call and ``--batch`` pairs per call (each
  frame's pyramid built once), against OpenCV's tracking time measured in the same run;
* per method, dense flow end to end from host frames with tracking included (``tracks=None``:
  upload, tracking, flow, download), one pair per call and ``--batch`` pairs per call, with
  pairs/s and the tracking share; the baseline is the same call with ``tracker="opencv"``.

The tracked feature count is ``--features`` (``max_features``) for both trackers. Warm-up
calls are excluded; figures are medians over ``--repeat`` calls.

``--accuracy`` (default) prints EPE / AE / coverage per synthetic 320x240 sequence and method
with the exact tracks and, unless ``--no-accuracy-tracked``, the EPE and coverage of the same
call with ``tracks=None`` on the bench's device: tracks from the built-in tracker and from
OpenCV (when importable), ``--features`` each, with their EPE ratio (built-in / OpenCV) per row
and a one-line summary (the issue's "no worse than with OpenCV's tracks"); the rows go to the
JSON (``params.accuracy``; ``epe_builtin``, ``epe_opencv``, ``builtin_over_opencv_epe``, ...).

``scanforest bench flow``, the bench's name before issue 40, is a deprecated alias for one release:
the same command after one line on stderr (:data:`RENAMED`). Its records before the rename say
``"bench": "flow"``; this one writes ``motion``.
"""
from __future__ import annotations

import importlib.util
import statistics
import time

import numpy as np
import typer
import typer.core

from ._common import parse_counts

#: the line the deprecated ``scanforest bench flow`` prints (on stderr) before it runs
RENAMED = ("`scanforest bench flow` is renamed `scanforest bench motion`; the old name goes in the "
           "next release")

#: (background, foreground) flows giving DFS sizes for the label sweep
_SWEEP = {8: ((-1.2, 0.3), (2.1, 0.8)), 25: ((0.0, 0.0), (4.0, 4.0)), 64: ((0.0, 0.0), (7.0, 7.0)),
          128: ((0.0, 0.0), (15.0, 7.0)), 256: ((0.0, 0.0), (15.0, 15.0))}


def _sync():
    import cupy as cp

    cp.cuda.Device().synchronize()


def gpu_ms(fn, repeat: int, warmup: int = 2) -> float:
    """Median CUDA-event time of ``fn()`` (ms)."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    _sync()
    ts = []
    for _ in range(repeat):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return float(statistics.median(ts))


def wall_ms(fn, repeat: int, warmup: int = 1, gpu: bool = False) -> float:
    """Median wall time of ``fn()`` (ms), synchronising the GPU after each call."""
    for _ in range(warmup):
        fn()
    if gpu:
        _sync()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if gpu:
            _sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(ts))


def split_ms(fn, repeat: int, warmup: int = 2) -> tuple[float, float]:
    """Median host (Python, launch) and device time of ``fn()`` in ms (cupyx.profiler)."""
    from cupyx.profiler import benchmark

    r = benchmark(fn, n_repeat=repeat, n_warmup=warmup)
    return float(np.median(r.cpu_times) * 1e3), float(np.median(r.gpu_times[0]) * 1e3)


def _scene(h, w, n_frames, features, flows=None, seed=3):
    from scanforest.kernels.synthetic.sequences import sequence, tracks_from_flow

    bg, fg = flows or _SWEEP[8]
    seq = sequence("layers", height=h, width=w, n_frames=n_frames, background=bg, foreground=fg,
                   seed=seed)
    tracks = [tracks_from_flow(seq, t, n=features, seed=seed + t) for t in range(n_frames - 1)]
    return seq, tracks


def accuracy_rows(device: str, features: int = 156, size=(240, 320), cpu_check: bool = True,
                  tracked: bool = True, have_cv2: bool | None = None):
    """EPE / AE / coverage per synthetic sequence and method (exact tracks); CPU vs GPU agreement.

    With ``tracked`` each row also gets the EPE / coverage / track count of the same call with
    ``tracks=None``, i.e. tracked on ``device`` by the built-in tracker (``*_builtin``) and by
    OpenCV (``*_opencv``, when cv2 is importable; ``klt_tracks`` on the host), ``features``
    features each, and ``builtin_over_opencv_epe`` (EPE over classified pixels, built-in /
    OpenCV: < 1 means the built-in tracks give the lower error)."""
    from scanforest.kernels.backend import to_numpy
    from scanforest.kernels.motion.metrics import flow_errors
    from scanforest.kernels.motion.optical_flow import dense_flow
    from scanforest.kernels.synthetic.sequences import KINDS, sequence, tracks_from_flow

    if have_cv2 is None:
        have_cv2 = importlib.util.find_spec("cv2") is not None
    trackers = (("builtin",) + (("opencv",) if have_cv2 else ())) if tracked else ()
    rows = []
    h, w = size
    for kind in KINDS:
        seq = sequence(kind, height=h, width=w, seed=1, pole=(kind == "layers"))
        tr = tracks_from_flow(seq, 0, n=features, seed=1)
        for method in ("interpolation", "hypotheses"):
            r = dense_flow(seq.frames[0], seq.frames[1], tr, method=method, device=device)
            flow, valid = to_numpy(r.flow), to_numpy(r.valid)
            e = flow_errors(flow, seq.flows[0], valid)
            row = dict(kind=kind + ("+pole" if kind == "layers" else ""), method=method,
                       **e.as_dict(), labels=None if r.labels is None else len(r.labels[0]))
            if kind == "layers":
                pole = seq.layers[0] == 2
                row["pole_epe_all"] = float(np.linalg.norm(flow[pole] - seq.flows[0][pole], axis=1).mean())
            if cpu_check and device == "gpu":
                rc = dense_flow(seq.frames[0], seq.frames[1], tr, method=method, device="cpu")
                both = valid & rc.valid
                row["cpu_gpu_valid_agree"] = float((valid == rc.valid).mean())
                row["cpu_gpu_max_flow_diff_on_common_valid"] = float(
                    np.abs(flow[both] - rc.flow[both]).max()) if both.any() else 0.0
            for tracker in trackers:      # the user path: tracks=None, tracked in the same call
                rt = dense_flow(seq.frames[0], seq.frames[1], None, method=method, device=device,
                                tracker=tracker, klt={"max_features": features})
                et = flow_errors(to_numpy(rt.flow), seq.flows[0], to_numpy(rt.valid))
                row[f"epe_{tracker}"] = et.epe
                row[f"epe_all_{tracker}"] = et.epe_all
                row[f"coverage_{tracker}"] = et.coverage
                row[f"tracks_{tracker}"] = int(rt.n_features[0])
                row[f"labels_{tracker}"] = None if rt.labels is None else len(rt.labels[0])
            if trackers:
                row["tracked_device"] = device
            if "epe_opencv" in row:
                row["builtin_over_opencv_epe"] = (row["epe_builtin"] / row["epe_opencv"]
                                                  if row["epe_opencv"] > 0 else None)
            rows.append(row)
    return rows


def _f(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


def format_accuracy(rows) -> str:
    tracked = any("epe_builtin" in r for r in rows)
    head = (f"{'sequence':<13} {'method':<13} {'EPE':>7} {'AE deg':>7} {'EPE all':>8} {'cover':>6} "
            f"{'labels':>6}")
    title = "accuracy on synthetic 320x240 sequences (exact tracks; EPE/AE over classified pixels)"
    if tracked:
        dev = next(r["tracked_device"] for r in rows if "tracked_device" in r)
        head += (f" | {'EPE bi':>7} {'cov bi':>6} {'n bi':>4} | {'EPE cv':>7} {'cov cv':>6} "
                 f"{'n cv':>4} | {'bi/cv':>6}")
        title = ("accuracy on synthetic 320x240 sequences (EPE/AE over classified pixels); left: "
                 f"exact tracks; right: tracks=None on {dev}, built-in tracker (bi) and OpenCV "
                 "(cv), n = tracks used; bi/cv = EPE built-in / EPE OpenCV")
    out = [title, head]
    for r in rows:
        line = (f"{r['kind']:<13} {r['method']:<13} {r['epe']:>7.3f} {r['ae']:>7.2f} "
                f"{r['epe_all']:>8.3f} {r['coverage']:>6.3f} {str(r['labels'] or '-'):>6}")
        if tracked:
            line += (f" | {_f(r.get('epe_builtin'), '.3f', 7)} {_f(r.get('coverage_builtin'), '.3f', 6)}"
                     f" {_f(r.get('tracks_builtin'), 'd', 4)}"
                     f" | {_f(r.get('epe_opencv'), '.3f', 7)} {_f(r.get('coverage_opencv'), '.3f', 6)}"
                     f" {_f(r.get('tracks_opencv'), 'd', 4)}"
                     f" | {_f(r.get('builtin_over_opencv_epe'), '.4f', 6)}")
        line += (f"  pole EPE {r['pole_epe_all']:.2f}" if 'pole_epe_all' in r else "")
        line += (f"  cpu=gpu valid {r['cpu_gpu_valid_agree']:.4f}, max |dflow| "
                 f"{r['cpu_gpu_max_flow_diff_on_common_valid']:.2e}"
                 if 'cpu_gpu_valid_agree' in r else "")
        out.append(line)
    summary = tracking_summary(rows)
    if summary:
        out.append(summary)
    return "\n".join(out)


def tracking_summary(rows) -> str | None:
    """One line: the dense flow's EPE with built-in tracks against OpenCV's tracks."""
    if not any("epe_builtin" in r for r in rows):
        return None
    both = [r for r in rows if r.get("builtin_over_opencv_epe") is not None]
    if not both:
        return "built-in vs OpenCV tracks: OpenCV not importable, built-in tracker only"
    worst = max(both, key=lambda r: r["builtin_over_opencv_epe"])
    ratios = [r["builtin_over_opencv_epe"] for r in both]
    n_worse = sum(q > 1.0 + 1e-3 for q in ratios)
    return (f"built-in vs OpenCV tracks: EPE ratio {min(ratios):.4f}..{max(ratios):.4f} over "
            f"{len(both)} rows, {n_worse} more than 0.1 % worse (worst: {worst['kind']} "
            f"{worst['method']} {worst['epe_builtin']:.3f} vs {worst['epe_opencv']:.3f} px); "
            f"coverage {min(r['coverage_builtin'] - r['coverage_opencv'] for r in both):+.4f}.."
            f"{max(r['coverage_builtin'] - r['coverage_opencv'] for r in both):+.4f} (bi - cv)")


def run_bench(sizes, features: int = 156, batch: int = 8, repeat: int = 20, device: str = "auto",
              out=None, cpu: bool = True, cpu_repeat: int = 3, label_sweep=(8, 25, 64, 128, 256),
              accuracy: bool = True, merry_go_round: bool = True, time_limit: float = 1e9,
              tracking: bool = True, accuracy_tracked: bool = True):
    """Run the benchmark; ``sizes`` is a list of (width, height). Returns the JSON path."""
    from scanforest.kernels.backend import describe_device, resolve_device, to_numpy
    from scanforest.kernels.motion.optical_flow import dense_flow

    from ._common import BenchReport

    dev = resolve_device(device)
    rep = BenchReport("motion", dict(sizes=[f"{w}x{h}" for w, h in sizes], features=features,
                                     batch=batch, repeat=repeat, device=dev, cpu=cpu,
                                     label_sweep=list(label_sweep), tracking=tracking), out=out)
    _add = rep.add

    def add(*a, **k):  # print each row as it is measured
        row = _add(*a, **k)
        print(f"  {row.figure}: {row.value:.4g} {row.unit} [{row.device}]", flush=True)
        return row

    rep.add = add
    cpu_name = describe_device("cpu")
    gpu_name = describe_device("gpu") if dev == "gpu" else None
    t_start = time.time()
    from scanforest.kernels.motion.optical_flow import klt_tracks

    have_cv2 = importlib.util.find_spec("cv2") is not None
    for w, h in sizes:
        if time.time() - t_start > time_limit:
            rep.note(f"time limit reached before {w}x{h}")
            break
        seq, tracks = _scene(h, w, batch + 1, features)
        f0, f1, tr0 = seq.frames[0], seq.frames[1], tracks[0]
        tag = f"{w}x{h}, {features} features"
        t_klt = None
        if have_cv2:
            t_klt = wall_ms(lambda: klt_tracks(f0, f1, max_features=features), max(3, repeat // 4))
            rep.add(f"{tag}: KLT tracking (OpenCV, CPU; not included below)", t_klt, "ms/pair",
                    cpu_name, higher_is_better=False)
        if tracking:
            tracking_rows(rep, seq, tag, features, batch, repeat, dev, cpu, t_klt, have_cv2,
                          cpu_name, gpu_name)
        for method in ("interpolation", "hypotheses"):
            mtag = f"{tag}, {method}" + (", 8 labels" if method == "hypotheses" else "")
            t_cpu = None
            if cpu:
                reps = cpu_repeat if w * h <= 640 * 480 else 1
                t_cpu = wall_ms(lambda: dense_flow(f0, f1, tr0, method=method, device="cpu"), reps)
                rep.add(f"{mtag}: CPU numba, 1 pair/call", t_cpu, "ms/pair", cpu_name,
                        higher_is_better=False)
            if dev != "gpu":
                continue
            import cupy as cp

            base = dict(baseline="CPU numba" if t_cpu else None, baseline_value=t_cpu,
                        higher_is_better=False)

            def e2e():
                r = dense_flow(f0, f1, tr0, method=method, device="gpu")
                return to_numpy(r.flow), to_numpy(r.valid)

            t = wall_ms(e2e, repeat, 2, gpu=True)
            rep.add(f"{mtag}: GPU end to end incl. upload + download, 1 pair/call", t, "ms/pair",
                    gpu_name, fps=1e3 / t, **base)
            d01 = (cp.asarray(f0), cp.asarray(f1))

            def one():
                return dense_flow(d01[0], d01[1], tr0, method=method, device="gpu")

            t = gpu_ms(one, repeat)
            host, devt = split_ms(one, repeat)
            rep.add(f"{mtag}: GPU resident, 1 pair/call", t, "ms/pair", gpu_name, fps=1e3 / t,
                    host_ms=host, device_ms=devt, **base)
            ds = cp.asarray(seq.frames)
            tb = gpu_ms(lambda: dense_flow(ds, None, tracks, method=method, device="gpu"),
                        max(3, repeat // 2))
            rep.add(f"{mtag}: GPU resident, {batch} pairs/call (one launch)", tb / batch,
                    "ms/pair", gpu_name, fps=batch * 1e3 / tb, **base)
            # the flow kernel alone, tables prepared once
            r = dense_flow(ds, None, tracks, method=method, device="gpu")
            k1 = _kernel_ms(ds[:2], tracks[:1], method, r, repeat)
            rep.add(f"{mtag}: flow kernel only, 1 pair/launch (CUDA events)", k1, "ms/pair",
                    gpu_name, fps=1e3 / k1, **base)
            k_ms = _kernel_ms(ds, tracks, method, r, repeat)
            evals = w * h * features * batch / (k_ms * 1e-3)      # pixel-feature pairs per second
            nl = len(r.labels[0]) if r.labels else 0
            rep.add(f"{mtag}: flow kernel only, {batch} pairs/launch (CUDA events)", k_ms / batch,
                    "ms/pair", gpu_name, fps=batch * 1e3 / k_ms, pixel_features_per_s=evals,
                    pixel_feature_labels_per_s=evals * nl if nl else None, **base)
        if dev == "gpu" and merry_go_round and (w, h) == (320, 240):
            _merry_go_round(rep, gpu_name, cpu_name, cpu, repeat)
    if dev == "gpu" and label_sweep:
        import cupy as cp

        w, h = max(sizes, key=lambda s: s[0] * s[1])
        for nl in label_sweep:
            if nl not in _SWEEP or time.time() - t_start > time_limit:
                continue
            seq, tracks = _scene(h, w, batch + 1, features, flows=_SWEEP[nl], seed=5)
            ds = cp.asarray(seq.frames)
            r = dense_flow(ds[:2], None, tracks[:1], method="hypotheses", device="gpu")
            tb = gpu_ms(lambda: dense_flow(ds, None, tracks, method="hypotheses", device="gpu"),
                        max(3, repeat // 2))
            rep.add(f"label sweep {w}x{h}, {features} features, hypotheses, {len(r.labels[0])} labels: "
                    f"GPU resident, {batch} pairs/call", tb / batch, "ms/pair", gpu_name,
                    higher_is_better=False, fps=batch * 1e3 / tb, labels=len(r.labels[0]))
            del ds
    if accuracy:
        t_acc = time.perf_counter()
        rows = accuracy_rows(dev, features, cpu_check=cpu, tracked=accuracy_tracked,
                             have_cv2=have_cv2)
        rep.params["accuracy"] = rows
        rep.params["accuracy_s"] = time.perf_counter() - t_acc
        print(format_accuracy(rows))
        summary = tracking_summary(rows)
        if summary:
            rep.note(f"accuracy 320x240 on {dev}, {summary}")
        for r in rows:
            rep.add(f"accuracy {r['kind']} 320x240, {r['method']}: EPE (classified px)", r["epe"],
                    "px", describe_device(dev), higher_is_better=False, ae=r["ae"],
                    epe_all=r["epe_all"], coverage=r["coverage"])
            if "epe_builtin" in r:
                cv = "epe_opencv" in r
                rep.add(f"accuracy {r['kind']} 320x240, {r['method']}: EPE (classified px), "
                        "builtin tracks", r["epe_builtin"], "px", describe_device(dev),
                        baseline="same with OpenCV tracks" if cv else None,
                        baseline_value=r.get("epe_opencv"), higher_is_better=False,
                        epe_all=r["epe_all_builtin"], coverage=r["coverage_builtin"],
                        tracks=r["tracks_builtin"], coverage_opencv=r.get("coverage_opencv"),
                        tracks_opencv=r.get("tracks_opencv"))
    rep.note("paper (Kim, Hwangbo & Kanade 2009, GeForce 8800 GTX, transfers included): 320x240, "
             "~150-156 KLT features: interpolation 6.2 ms, hypotheses (8 labels) 48 ms; "
             "422 features: interpolation ~14 ms, hypotheses (25 labels) ~120 ms")
    rep.note("KLT tracking is not included in the flow figures except the rows marked 'incl. "
             "tracking' (own row when OpenCV is present)")
    return rep.finish(out)


def tracking_rows(rep, seq, tag, features, batch, repeat, dev, cpu, t_klt, have_cv2, cpu_name,
                  gpu_name):
    """Issue 25: the built-in tracker alone and dense flow with tracking included, frames on
    the host, against OpenCV's tracking measured in the same run."""
    from scanforest.kernels.backend import to_numpy
    from scanforest.kernels.motion.optical_flow import dense_flow
    from scanforest.kernels.motion.tracking import sparse_tracks

    f0, f1 = seq.frames[0], seq.frames[1]
    frames = seq.frames[:batch + 1]
    klt = {"max_features": features}
    reps = max(3, repeat // 4)
    gpu = dev == "gpu"
    base = dict(baseline="OpenCV KLT" if t_klt else None, baseline_value=t_klt,
                higher_is_better=False)
    devs = (["cpu"] if cpu else []) + (["gpu"] if gpu else [])
    t_track = {}
    for d in devs:
        name = gpu_name if d == "gpu" else cpu_name
        r = 1 if (d == "cpu" and f0.shape[0] * f0.shape[1] > 640 * 480) else reps
        t = wall_ms(lambda: sparse_tracks(f0, f1, device=d, host=True, **klt), r, gpu=d == "gpu")
        n = len(sparse_tracks(f0, f1, device=d, host=True, **klt)[0])
        t_track[d] = t
        rep.add(f"{tag}: tracking only, builtin {d.upper()}, host frames, 1 pair/call", t,
                "ms/pair", name, fps=1e3 / t, tracks=n, **base)
        tb = wall_ms(lambda: sparse_tracks(frames, device=d, host=True, **klt), r, gpu=d == "gpu")
        rep.add(f"{tag}: tracking only, builtin {d.upper()}, host frames, {batch} pairs/call",
                tb / batch, "ms/pair", name, fps=batch * 1e3 / tb, **base)
    big = f0.shape[0] * f0.shape[1] > 640 * 480
    for method in ("interpolation", "hypotheses"):
        for d in devs:
            if d == "cpu" and big and gpu:
                continue        # seconds per call; the CPU flow rows above give that baseline
            name = gpu_name if d == "gpu" else cpu_name
            r = 1 if (d == "cpu" and big) else reps

            def e2e(tracker, fr0=f0, fr1=f1, d=d):
                res = dense_flow(fr0, fr1, None, method=method, device=d, klt=klt,
                                 tracker=tracker)
                return to_numpy(res.flow), to_numpy(res.valid)

            t_cv = wall_ms(lambda: e2e("opencv"), r, gpu=d == "gpu") if have_cv2 else None
            if t_cv:
                rep.add(f"{tag}, {method}: {d.upper()} end to end incl. OpenCV tracking, host "
                        "frames, 1 pair/call", t_cv, "ms/pair", name, fps=1e3 / t_cv,
                        tracking_share=(t_klt / t_cv) if t_klt else None, higher_is_better=False)
            t = wall_ms(lambda: e2e("builtin"), r, gpu=d == "gpu")
            rep.add(f"{tag}, {method}: {d.upper()} end to end incl. builtin tracking, host frames, "
                    "1 pair/call", t, "ms/pair", name, fps=1e3 / t,
                    tracking_share=t_track[d] / t, baseline="same with OpenCV tracking"
                    if t_cv else None, baseline_value=t_cv, higher_is_better=False)
            rep.note(f"{tag}, {method}, {d.upper()}, host frames, tracking included: "
                     f"{t:.1f} ms/pair = {1e3 / t:.1f} pairs/s, builtin tracking "
                     f"{t_track[d]:.1f} ms ({100 * t_track[d] / t:.0f} % of it)"
                     + (f"; with OpenCV tracking ({t_klt:.1f} ms, {t_klt / t_track[d]:.2g}x the "
                        f"builtin's) {t_cv:.1f} ms/pair = {1e3 / t_cv:.1f} pairs/s"
                        if t_cv and t_klt else ""))
            if d == "cpu" and big:
                continue                        # a CPU batch at 1080p adds nothing but minutes
            tb = wall_ms(lambda: e2e("builtin", frames, None), r, gpu=d == "gpu")
            tb_cv = wall_ms(lambda: e2e("opencv", frames, None), r, gpu=d == "gpu") if have_cv2 else None
            rep.add(f"{tag}, {method}: {d.upper()} end to end incl. builtin tracking, host frames, "
                    f"{batch} pairs/call", tb / batch, "ms/pair", name, fps=batch * 1e3 / tb,
                    baseline=f"same with OpenCV tracking, {batch} pairs/call" if tb_cv else None,
                    baseline_value=None if tb_cv is None else tb_cv / batch,
                    higher_is_better=False)


def _kernel_ms(ds, tracks, method, r, repeat):
    """CUDA-event time of the flow kernel alone for a sequence already on the device."""
    from scanforest.kernels.motion.optical_flow import gpu_flow_kernel

    return gpu_ms(gpu_flow_kernel(ds, tracks, method, r.params), repeat)


def _merry_go_round(rep, gpu_name, cpu_name, cpu, repeat):
    """The paper's second configuration: 422 features; hypotheses with 25 labels (size unknown
    in the paper; measured at 320x240)."""
    from scanforest.kernels.motion.optical_flow import dense_flow

    seq, tracks = _scene(240, 320, 2, 422, flows=_SWEEP[25], seed=11)
    f0, f1 = seq.frames[0], seq.frames[1]
    for method in ("interpolation", "hypotheses"):
        tag = f"320x240, 422 features, {method}" + (", 25 labels" if method == "hypotheses" else "")
        t_cpu = None
        if cpu:
            t_cpu = wall_ms(lambda: dense_flow(f0, f1, tracks[0], method=method, device="cpu"), 3)
            rep.add(f"{tag}: CPU numba", t_cpu, "ms/pair", cpu_name, higher_is_better=False)

        def e2e():
            r = dense_flow(f0, f1, tracks[0], method=method, device="gpu")
            r.flow.get(), r.valid.get()

        t = wall_ms(e2e, repeat, 2, gpu=True)
        rep.add(f"{tag}: GPU end to end incl. transfers", t, "ms/pair", gpu_name,
                baseline="CPU numba" if t_cpu else None, baseline_value=t_cpu,
                higher_is_better=False)


def _sizes(text: str) -> list[tuple[int, int]]:
    from scanforest.kernels.errors import InputError

    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            w, h = (int(v) for v in part.split("x"))
        except ValueError:
            raise InputError(f"sizes are WIDTHxHEIGHT, comma separated; got {part!r}") from None
        out.append((w, h))
    return out


class _RenamedCommand(typer.core.TyperCommand):
    """The ``bench flow`` alias: ``bench motion`` after the rename line (printed before the
    arguments are parsed, so ``--help`` and a usage error print it too)."""

    def parse_args(self, ctx, args):
        typer.echo(RENAMED, err=True)
        return super().parse_args(ctx, args)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("motion")
    def bench_motion(
        sizes: str = typer.Option("320x240,1920x1080", "--sizes", help="WIDTHxHEIGHT list"),
        features: int = typer.Option(156, "--features", help="tracks per pair (paper: 156)"),
        batch: int = typer.Option(8, "--batch", help="pairs per call in the batched rows"),
        repeat: int = typer.Option(20, "--repeat"),
        device: str = typer.Option("auto", "--device"),
        out: str = typer.Option(None, "--out", help="JSON file or folder"),
        cpu: bool = typer.Option(True, "--cpu/--no-cpu", help="CPU numba baseline rows"),
        labels: str = typer.Option("8,25,64,128,256", "--labels", help="label sweep at the "
                                   "largest size ('' to skip)"),
        accuracy: bool = typer.Option(True, "--accuracy/--no-accuracy", help="EPE table on "
                                      "the synthetic 320x240 sequences"),
        accuracy_tracked: bool = typer.Option(True, "--accuracy-tracked/--no-accuracy-tracked",
                                              help="the EPE table also with tracks from the "
                                              "built-in tracker and OpenCV (when importable)"),
        time_limit: float = typer.Option(1e9, "--time-limit"),
        tracking: bool = typer.Option(True, "--tracking/--no-tracking", help="rows with KLT "
                                      "tracking included (built-in tracker vs OpenCV)"),
    ):
        """Both flow methods on the GPU at the paper's size and 1080p, CPU baseline in the same run."""
        run_bench(_sizes(sizes), features=features, batch=batch, repeat=repeat, device=device,
                  out=out, cpu=cpu, label_sweep=parse_counts(labels), accuracy=accuracy,
                  time_limit=time_limit, tracking=tracking, accuracy_tracked=accuracy_tracked)

    bench.command("flow", cls=_RenamedCommand, hidden=True,
                  help=f"Deprecated: renamed `scanforest bench motion`. {bench_motion.__doc__}")(bench_motion)


if __name__ == "__main__":  # standalone: python -m scanforest.deploy.bench.motion --sizes ...
    _app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    _bench = typer.Typer()
    _app.add_typer(_bench, name="bench")
    register(_app, _bench)
    _app(["bench", "motion", *__import__("sys").argv[1:]])
