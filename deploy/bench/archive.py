"""``scanforest bench archive``: a synthetic archive through ingest -> describe -> match ->
recognize on the local cluster; scans/s per stage and the orchestration overhead.

``--pipeline one-pass`` (the default, as the archive flow runs it): ingest, then ONE pass that
describes, matches and recognises each scene on one worker (stage ``process``); ``staged``: the
three as separate passes (stages ``describe``, ``match``, ``recognize``).

One pipeline, as the archive flow runs it: the scenes are described with the parameters
recognition uses, the index is built over the model library (built, untimed, before it, like the
index), and the recognize stage takes every scene's description and matches from the store
(the report says for how many scenes it did).

Overhead of a stage = 1 - (time spent inside the units of work, i.e. kernels and store I/O,
summed over scans) / (wall time x workers): everything that is neither kernels nor I/O —
Prefect task runs, Dask scheduling, transfers, idle workers at the tail of the run. The match
stage's workers are the ones holding index shards; its store I/O runs in the flow process beside
them, so its busy time can exceed that capacity (overhead 0, counted as the stage's wall time in
the whole-archive figure, never as credit against the other stages).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

from ._common import BenchReport, Utilization, read_record


STAGES = ("ingest", "describe", "match", "recognize")
ONE_PASS = ("ingest", "process")
RECORD = "bench-stages.json"


def stages_of(pipeline: str) -> tuple[str, ...]:
    from scanforest.kernels.errors import InputError

    if pipeline not in ("one-pass", "staged"):
        raise InputError(f"--pipeline must be one-pass or staged, got {pipeline!r}")
    return ONE_PASS if pipeline == "one-pass" else STAGES


def parse_stages(text: str, pipeline: str = "staged") -> list[str]:
    """``"all"`` or a comma list of consecutive stages, returned in pipeline order."""
    from scanforest.kernels.errors import InputError

    order = stages_of(pipeline)
    if text.strip() in ("", "all"):
        return list(order)
    want = {x.strip() for x in text.split(",") if x.strip()}
    bad = sorted(want - set(order))
    if bad:
        raise InputError(f"unknown stage(s) {bad}; the stages are {', '.join(order)}")
    out = [x for x in order if x in want]
    if order.index(out[-1]) - order.index(out[0]) + 1 != len(out):
        raise InputError(f"the stages must be consecutive in {' -> '.join(order)}, got {', '.join(out)}")
    return out


def _load_record(path: Path, config: dict) -> dict:
    """Stages measured by earlier invocations on the same workdir and configuration."""
    return (read_record(path, config) or {}).get("stages", {})


def run(scans: int, points: int, models: int, workers: int | None, device: str, workdir: Path, out,
        keep: bool = False, stages_to_run: list[str] | None = None, pipeline: str = "one-pass",
        batch: int | None = None) -> BenchReport:
    """Run the selected stages (default: all) over the archive in ``workdir``.

    A subset runs on the store that earlier invocations left in ``workdir`` (same configuration):
    each stage is always a complete run over the whole archive, and its figures are recorded in
    ``workdir/bench-stages.json``, so a long archive can be measured stage by stage (for example
    within a per-command time limit) and the whole-archive figures combine the recorded stages.
    ``batch``: scenes per Dask task in the one pass (default: the flow's own choice)."""
    from scanforest.flows.archive import process_flow
    from scanforest.flows.cluster import cluster_with_api, dask_client, warm_gpu_workers
    from scanforest.flows.describe import run_describe
    from scanforest.flows.ingest import run_ingest
    from scanforest.flows.match import run_index_build, run_match
    from scanforest.flows.recognize import run_recognize
    from scanforest.kernels.backend import describe_device, gpu_count, resolve_device
    from scanforest.kernels.errors import InputError
    from scanforest.kernels.synthetic.scenes import recognition_presets
    from scanforest.tasks.recognize import build_library, describe_params_for
    from scanforest.tasks.store import ScanStore
    from scanforest.tasks.synth import write_archive

    dev = resolve_device(device)
    order = stages_of(pipeline)
    todo = list(stages_to_run or order)
    config = {"scans": scans, "points": points, "models": models, "device": dev, "workers": workers}
    if pipeline != "staged":  # records of staged runs (made before the one pass existed) stay valid
        config["pipeline"] = pipeline
    if batch:
        config["batch"] = batch
    record_path = workdir / RECORD
    store = workdir / "store.zarr"
    done = {} if todo[0] == "ingest" else _load_record(record_path, config)
    missing = [x for x in order[:order.index(todo[0])] if x not in done]
    if missing:
        raise InputError(f"{workdir}: stage(s) {missing} were not run on this workdir with this configuration "
                         f"({config}); run them first (--stages {','.join(missing)}) or run all stages")
    rep = BenchReport("archive", {**config, "stages": todo}, echo=True, out=out)
    archive = workdir / "archive"
    t0 = time.perf_counter()
    write_archive(archive, n_models=models, n_scenes=scans, points_per_scene=points, points_per_model=12_000,
                  jobs=min(16, os.cpu_count() or 1))
    rep.note(f"archive of {scans} scenes x {points:,} points + {models} models made in "
             f"{time.perf_counter() - t0:.1f} s (not counted)")
    if todo[0] == "ingest":
        shutil.rmtree(store, ignore_errors=True)
        record_path.unlink(missing_ok=True)
    devname = describe_device(dev)
    # recorded stages first: their rows come from the invocation that measured them
    for name in order[:order.index(todo[0])]:
        r = done[name]
        rep.note(f"{name}: measured by an earlier invocation ({r['when']}) on this workdir")
        _stage_rows(rep, name, r, devname, recorded=True)

    def stage(name, wall, task_s, nw, n, util, skipped=0, failures=(), **more):  # rows printed as each stage ends
        for f in failures:  # a failed scan is not work done: say which and why, and count them
            rep.note(f"{name}: failed: {f['scan_id']}: {f['reason']}" + (f" (at {f['where']})" if f.get("where") else ""))
        if skipped:  # work done before this invocation (one that was cut off) is not measured here
            raise InputError(f"{workdir}: the {name} stage found {skipped} of {n} scans already done by an "
                             "earlier invocation, so its figures would not measure the work; run the "
                             "stages again from ingest (or use a fresh --workdir)")
        r = {"wall": wall, "task_seconds": task_s, "workers": nw, "scans": n, "util": util.extra(),
             "failed": len(failures), "when": time.strftime("%Y-%m-%dT%H:%M:%S"), **more}
        done[name] = r
        _stage_rows(rep, name, r, devname)
        record_path.write_text(json.dumps({"config": config, "stages": done}, indent=1))

    lib_params, rec_params = recognition_presets(dev, points)
    t_all = time.perf_counter()  # the end-to-end clock: every start-up it needs is inside it
    # the stages share one local cluster, as the archive flow's do, started while the API boots
    with cluster_with_api(device=dev, workers=workers), dask_client(None, n_workers=workers, device=dev) as client:
        clock = {"api_and_cluster_start": time.perf_counter() - t_all}  # the time outside the stages

        @contextlib.contextmanager
        def spent(key: str):  # the end-to-end time of the bench's own steps, accounted apart
            t = time.perf_counter()
            yield
            clock[key] = clock.get(key, 0.0) + time.perf_counter() - t

        timeline = _Timeline(client)
        calls: list[float] = []  # each stage's flow call, as the timeline timed it
        t_stages = time.perf_counter()
        if "ingest" in todo:
            with Utilization() as u, timeline("ingest"):
                s = run_ingest(str(archive), str(store), workers=workers, progress=False)
            with spent("bench_notes"):
                calls.append(timeline.figures.get("timeline", {}).get("call_seconds", 0.0))
                rep.note(f"ingest: {s['files']} files found in {s.get('discover_seconds', 0.0):.2f} s")
                _call_note(rep, "ingest", timeline.figures.get("timeline", {}), s["seconds"], s["seconds"])
                stage("ingest", s["seconds"], s["task_seconds"], s["workers"], s["files"], u, s["skipped"],
                      **timeline.figures)
        if todo != ["ingest"]:
            with spent("scan_listing"):
                ids = ScanStore(str(store), mode="r").scans()
            model_ids = [x for x in ids if x.startswith("models__")]
            scene_ids = [x for x in ids if not x.startswith("models__")]
        if "describe" in todo:
            # the scenes, as recognition describes them (the library describes the models)
            params = describe_params_for(rec_params, lib_params)
            with Utilization() as u, timeline("describe"):
                s = run_describe(str(store), scans=scene_ids, params=params, device=dev, workers=workers,
                                 progress=False)
            stage("describe", s["seconds"], s["task_seconds"], s["workers"], s["scans"], u, s["skipped"],
                  s.get("failures", ()), **timeline.figures)
        def library_and_index(shards: int) -> None:
            t0 = time.perf_counter()
            lib = build_library(str(store), model_ids, name="bench", params=lib_params, device=dev)
            t1 = time.perf_counter()
            run_index_build(str(store), None, library="bench", name="models", shards=shards, params={"method": "exact"})
            clock["library_and_index"] = clock.get("library_and_index", 0.0) + time.perf_counter() - t0
            rep.note(f"model library 'bench' ({lib['status']}) in {t1 - t0:.1f} s, its index in "
                     f"{time.perf_counter() - t1:.1f} s (in the end-to-end time, not in a stage's)")

        def recognition_notes(name: str, s: dict) -> dict:
            rep.note(f"{name}: {s['from_stored']} of {s['recognized']} scenes from the stored description and "
                     f"matches, {s['recomputed']} described and matched again"
                     + "".join(f"; {n}: {why}" for why, n in s.get("recompute_reasons", {}).items()))
            print(rep.notes[-1], flush=True)
            if s.get("gpu_cache_trims"):  # each: the next chunk's device blocks allocated again
                rep.note(f"{name}: {s['gpu_cache_trims']} chunks ended with a worker's device cache given back "
                         "(more than its share of the GPU)")
                print(rep.notes[-1], flush=True)
            again = {k: s[k] for k in ("batched_fallbacks", "device_memory_retries") if s.get(k)}
            if again:  # scans that were run a second way: counted, never only a slowdown
                rep.note(f"{name}: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in again.items()))
                print(rep.notes[-1], flush=True)
            per_scene = {k: v / max(1, s["recognized"]) for k, v in s.get("phase_seconds", {}).items()}
            cpu = s.get("cpu_seconds")
            if cpu:  # the host's share of a scene: where the host, not the GPU, bounds a pass
                rep.note(f"{name}: worker CPU {cpu / max(1, s['scenes']):.3f} core-seconds a scene "
                         f"({cpu / max(1e-9, s['task_seconds']):.2f} cores a busy worker)")
                print(rep.notes[-1], flush=True)
            return dict(phase_seconds_per_scene=per_scene, cpu_seconds=cpu,
                        precision=s.get("precision"), recall=s.get("recall"), from_stored=s["from_stored"],
                        recomputed=s["recomputed"])

        if "process" in todo:
            # one shard: every worker holds the whole (small) index over the library on its device;
            # the workers warm up meanwhile, as in the archive flow
            with spent("warm_up_start"):
                warmed = warm_gpu_workers(dev)
            library_and_index(1)
            t_pass = time.time()
            with Utilization() as u, timeline("process"):
                s = process_flow(str(store), scene_ids, library="bench", index="models", k=4, params=rec_params,
                                 device=dev, workers=workers, progress=False, batch=batch)
            with spent("bench_notes"):
                calls.append(timeline.figures.get("timeline", {}).get("call_seconds", 0.0))
                if warmed:  # did the workers' warm-up outlast the library and the index?
                    _warm_up_note(rep, client, t_pass, timeline.figures.get("timeline", {}))
                _call_note(rep, "process", timeline.figures.get("timeline", {}), s["seconds"], s["scenes_seconds"])
                if dev == "gpu":
                    _gpu_memory_note(rep, client, u)
                stage("process", s["scenes_seconds"], s["task_seconds"], s["workers"], s["scenes"], u,
                      s["skipped"], s.get("failures", ()), **recognition_notes("process", s), **timeline.figures)
        if "match" in todo:
            # the index over the library is small (tens of thousands of rows): one shard per GPU, or one
            # per CPU worker
            library_and_index(gpu_count() if dev == "gpu" else max(1, workers or 2))
            with Utilization() as u, timeline("match"):
                s = run_match(str(store), k=4, name="models", device=dev, workers=workers, progress=False)
            # match: the busy time is store I/O (in the flow process) plus the shard searches and merges
            # (on the workers); its capacity is the wall time x the workers that hold shards
            stage("match", s["scans_seconds"], s["task_seconds"], s["lanes"], s["scans"], u, s["scans"] - s["matched"],
                  **timeline.figures)
        if "recognize" in todo:
            with Utilization() as u, timeline("recognize"):
                s = run_recognize(str(store), model_ids, library="bench", device=dev, workers=workers,
                                  progress=False, library_params=lib_params, params=rec_params)
            stage("recognize", s["scenes_seconds"], s["task_seconds"], s["workers"], s["scenes"], u, s["skipped"],
                  s.get("failures", ()), **recognition_notes("recognize", s), **timeline.figures)
        t_close = time.perf_counter()
        clock["in_cluster"] = t_close - t_stages
    total = time.perf_counter() - t_all
    clock["cluster_stop"] = time.perf_counter() - t_close
    # the stages' walls, and what the stages' flow calls spent beside them (flow runs, the cluster's
    # plugins, summaries and run records)
    walls = sum(done[x]["wall"] for x in todo if x in done)
    clock["stage_walls"] = walls
    if set(todo) <= {"ingest", "process"}:  # the stages whose flow calls are timed (calls)
        # the flow calls beside their stage walls: flow runs on the API, store listings, run records
        clock["stage_calls_beside_walls"] = sum(calls) - walls
    clock["other_in_cluster"] = clock.pop("in_cluster") - sum(
        v for k, v in clock.items() if k not in ("api_and_cluster_start", "cluster_stop"))
    rep.note(f"end to end {total:.1f} s: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in clock.items()))
    print(rep.notes[-1], flush=True)
    if all(x in done for x in order):
        _archive_rows(rep, done, scans, devname, total if todo == list(order) else None, order)
    rep.finish(out)
    if not keep and order[-1] in todo:
        shutil.rmtree(workdir, ignore_errors=True)
    return rep


def _warm_up_note(rep: BenchReport, client, t_pass: float, tl: dict) -> None:
    """A note of the workers' warm-ups (:func:`~scanforest.tasks.pipeline.warm_up_report`) against
    the pass's call (``t_pass``, wall clock) and its first task (``tl``: the stage's timeline)."""
    import statistics

    from scanforest.tasks.pipeline import warm_up_report

    reps = [r for r in client.run(warm_up_report).values() if r.get("ended_at")]
    if not reps:
        return
    secs = sorted(r["seconds"] for r in reps if r.get("seconds") is not None)
    errors = sum(bool(r.get("error")) for r in reps)
    last = max(r["ended_at"] for r in reps) - t_pass
    first = min(r["started_at"] for r in reps) - t_pass
    phases = {}
    for r in reps:
        for k, v in (r.get("phases") or {}).items():
            phases.setdefault(k, []).append(v)
    rep.note(f"process: {len(reps)} worker warm-ups"
             + (f", {min(secs):.1f} / {statistics.median(secs):.1f} / {max(secs):.1f} s (min / median / max)"
                if secs else "")
             + (" (median / max: " + ", ".join(f"{k} {statistics.median(v):.2f} / {max(v):.2f}"
                                                for k, v in phases.items()) + ")" if phases else "")
             + f"; the first started {first:+.2f} s from the pass's call"
             + f"; the last ended {last:+.2f} s from the pass's call"
             + (f", its first task started {tl['first_task_after']:+.2f} s" if "first_task_after" in tl else "")
             + (f"; {errors} failed" if errors else ""))
    print(rep.notes[-1], flush=True)


class _Timeline:
    """Where a stage's time goes on the workers, from Dask's task stream: how long after the
    stage's call its first task started, how long before the call returned its last one ended,
    and the workers' busy seconds as Dask counts them (for the overhead's breakdown:
    start-up, tail, and the gaps between tasks)."""

    def __init__(self, client):
        self.client = client
        self.figures: dict = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        from distributed import get_task_stream

        self.figures = {}
        t0 = time.time()
        with get_task_stream(self.client) as ts:
            yield
        t1 = time.time()
        spans = [ss for d in ts.data for ss in d.get("startstops", ()) if ss.get("action") == "compute"]
        if spans:
            first, last = min(x["start"] for x in spans), max(x["stop"] for x in spans)
            self.figures = {"timeline": {"stage": name, "call_seconds": t1 - t0, "first_task_after": first - t0,
                                         "after_last_task": t1 - last,
                                         "dask_busy_seconds": sum(x["stop"] - x["start"] for x in spans),
                                         "dask_tasks": len(ts.data),
                                         **_tail(ts.data, last, self._names())}}

    def _names(self) -> dict[str, str]:
        try:
            return {a: str(w.get("name", a)) for a, w in self.client.scheduler_info(n_workers=-1)["workers"].items()}
        except Exception:  # noqa: BLE001 - the tail's GPU split is a note, not the measurement
            return {}


def _tail(data: list[dict], last: float, names: dict[str, str]) -> dict:
    """The stage's end: how long each worker sat idle between its own last task and the stage's
    last (mean and max over the workers), and, for shared-GPU workers (named ``gpu<i>-<j>``), how
    long before the stage's last task each GPU's last task ended (a GPU whose workers ran out of
    work while another's still computed)."""
    ends: dict[str, float] = {}
    for d in data:
        w = d.get("worker")
        for ss in d.get("startstops", ()):
            if ss.get("action") == "compute" and w:
                ends[w] = max(ends.get(w, 0.0), ss["stop"])
    if not ends:
        return {}
    idle = [last - e for e in ends.values()]
    out = {"tail_idle_mean": sum(idle) / len(idle), "tail_idle_max": max(idle)}
    gpus: dict[str, float] = {}
    for w, e in ends.items():
        nm = names.get(w, "")
        if nm.startswith("gpu") and "-" in nm:
            g = nm[3:].split("-")[0]
            gpus[g] = max(gpus.get(g, 0.0), e)
    if len(gpus) > 1:
        out["gpu_tail"] = {g: last - e for g, e in sorted(gpus.items())}
    return out


def _call_note(rep: BenchReport, name: str, tl: dict, body: float, work: float) -> None:
    """Where a stage's flow call went: its flow's body (``body`` seconds, of which ``work`` its
    scans' tasks) and the rest (Prefect's flow run: created, started, finished on the API)."""
    if "call_seconds" not in tl:
        return
    call = tl["call_seconds"]
    rep.note(f"{name}: the flow call {call:.2f} s: its body {body:.2f} s"
             + (f" (its scans {work:.2f} s)" if work != body else "")
             + f", Prefect's flow run and the command around it {call - body:.2f} s")
    print(rep.notes[-1], flush=True)


def _gpu_memory_note(rep: BenchReport, client, util) -> None:
    """The GPUs' memory in the pass: the peak each card's memory reached (nvidia-smi), and what
    the workers' memory pools hold at its end (in use, and cached for their next arrays)."""
    from scanforest.tasks.pipeline import gpu_pool_report

    pools = sorted(client.run(gpu_pool_report).values(), key=lambda p: p["held_bytes"])
    if not pools:
        return
    gb = 1e9
    held = [p["held_bytes"] / gb for p in pools]
    peak = util.gpu_memory_peak
    rep.note("process: GPU memory" + (f" peak {', '.join(f'{v / 1024:.1f}' for v in peak.values())} GB of "
                                      f"{util.gpu_memory_total / 1024:.0f} GB a card;" if peak else "")
             + f" the workers' pools hold {min(held):.2f}-{max(held):.2f} GB (median {held[len(held) // 2]:.2f}, "
             f"in use {max(p['used_bytes'] for p in pools) / gb:.2f} at most) after the pass"
             + (f", each may keep {pools[0]['share_bytes'] / gb:.1f} GB" if pools[0].get("share_bytes") else ""))
    print(rep.notes[-1], flush=True)


def _stage_rows(rep: BenchReport, name: str, r: dict, devname: str, recorded: bool = False) -> None:
    nw, wall = r["workers"], r["wall"]
    what = f"{devname}, {nw} {'shard workers' if name == 'match' else 'workers'}"
    extra = {**r["util"], **({"recorded": True} if recorded else {})}
    rep.add(f"{name}: scans/s", r["scans"] / wall, "scans/s", what, **extra)
    if "failed" in r:
        rep.add(f"{name}: failed scans", r["failed"], "scans", what, higher_is_better=False)
    if r["util"] and not recorded:  # which resource bounds the stage
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in r["util"].items()), flush=True)
    if r["task_seconds"] is not None:
        overhead = max(0.0, 1.0 - r["task_seconds"] / (wall * nw))
        rep.add(f"{name}: orchestration overhead", 100 * overhead, "%", what, higher_is_better=False,
                wall=wall, task_seconds=r["task_seconds"], **extra,
                **({"timeline": r["timeline"]} if r.get("timeline") else {}))
    tl = r.get("timeline")
    if tl and not recorded:  # where the overhead goes
        rep.note(f"{name}: {tl['dask_tasks']} Dask tasks; the first started {tl['first_task_after']:.2f} s into "
                 f"the stage's {tl['call_seconds']:.2f} s call (flow start included), the last ended "
                 f"{tl['after_last_task']:.2f} s before it returned; workers busy {tl['dask_busy_seconds']:.1f} s "
                 f"by Dask's count"
                 + (f"; at the end a worker sat idle {tl['tail_idle_mean']:.2f} s on average (at most "
                    f"{tl['tail_idle_max']:.2f} s) before the last task ended" if "tail_idle_mean" in tl else "")
                 + ("; each GPU's last task ended " + ", ".join(f"GPU {g} {v:.2f} s" for g, v in tl["gpu_tail"].items())
                    + " before it" if tl.get("gpu_tail") else ""))
        print(rep.notes[-1], flush=True)
    if r.get("phase_seconds_per_scene"):  # where the recognize stage's time goes
        rep.note(f"{name}, seconds per scene by phase: "
                 + ", ".join(f"{k} {v:.3f}" for k, v in r["phase_seconds_per_scene"].items()))
        if not recorded:
            print(rep.notes[-1], flush=True)


def _archive_rows(rep: BenchReport, done: dict, scans: int, devname: str, total: float | None,
                  order=STAGES) -> None:
    """Whole-archive figures over the pipeline's stages (``total``: the wall clock of one
    invocation that ran them all; otherwise the stages' walls are summed)."""
    timed = [(r["wall"], r["task_seconds"], r["workers"]) for r in (done[x] for x in order)
             if r["task_seconds"] is not None]
    if timed:  # every stage, weighted by its wall time; busy time clamped to the stage's capacity
        busy = sum(min(w, t / nw) for w, t, nw in timed)
        span = sum(w for w, _, _ in timed)
        rep.add("whole archive (all stages): orchestration overhead", 100 * max(0.0, 1.0 - busy / span), "%",
                devname, higher_is_better=False, wall=span, busy=busy)
    walls = sum(done[x]["wall"] for x in order)
    if total is not None:  # one invocation's clock, start-ups included
        rep.add("archive end to end: scans/s", scans / total, "scans/s", devname, stages_wall=walls, total_wall=total)
    else:  # stages measured by several invocations: labelled as the sum it is
        rep.add("archive, sum of the stages' walls (start-ups and builds not included): scans/s", scans / walls,
                "scans/s", devname, stages_wall=walls, total_wall=None)
    rec = done[order[-1]]
    for key in ("precision", "recall"):  # None where undefined (no detections, no true instances)
        if rec.get(key) is not None:
            rep.add(f"recognize {key}", rec[key], "", devname)


def _link_archive(src: Path, dst: Path, scenes: int) -> None:
    """``dst`` holds the models and the first ``scenes`` scenes of the archive ``src`` (with their
    sidecars) as hard links (copies where links fail): every GPU count ingests the same files."""
    for sub in ("models", "scenes"):
        (dst / sub).mkdir(parents=True, exist_ok=True)
    names = [p.name for p in sorted((src / "models").iterdir())]
    names = [("models", n) for n in names] + [("scenes", f"scene_{i:04d}{ext}") for i in range(scenes)
                                               for ext in (".pcd", ".gt.json")]
    for sub, name in names:
        a, b = src / sub / name, dst / sub / name
        if a.exists() and not b.exists():
            try:
                os.link(a, b)
            except OSError:
                shutil.copy2(a, b)


def scaling_rows(rep: BenchReport, runs: list[tuple[int, int, dict]]) -> None:
    """Rows of a GPU-count scaling run from each count's ``bench archive`` record: end-to-end and
    process-stage scans/s with their speed-up over the smallest count (per GPU: the efficiency),
    every GPU's busy share in the pass, the whole-archive overhead and the recognition quality."""
    def rows_of(rec):
        return {r["figure"]: r for r in rec["rows"]}

    g0, _, base = runs[0]
    b = rows_of(base)
    for g, scans, rec in runs:
        r = rows_of(rec)
        what = f"{rec['environment'].get('gpu') or 'gpu'} x{g}"
        for fig, key in (("archive end to end: scans/s", "end to end"), ("process: scans/s", "process stage"),
                         ("ingest: scans/s", "ingest")):
            if fig not in r:
                continue
            v, v0 = r[fig]["value"], b.get(fig, {}).get("value")
            extra = {k: r[fig]["extra"][k] for k in ("gpu_busy_pct", "gpu_busy_pct_each", "gpu_busy_pct_min",
                                                       "host_cpu_busy_pct") if k in r[fig]["extra"]}
            eff = None if not v0 else v / v0 * g0 / g
            rep.add(f"{key} on {g} GPU{'s' if g > 1 else ''}: scans/s", v, "scans/s", what,
                    baseline=None if g == g0 else f"{key} on {g0} GPU{'s' if g0 > 1 else ''}",
                    baseline_value=None if g == g0 else v0, gpus=g, scans=scans, efficiency=eff, **extra)
        ov = r.get("whole archive (all stages): orchestration overhead")
        if ov:
            rep.add(f"whole-archive overhead on {g} GPU{'s' if g > 1 else ''}", ov["value"], "%", what,
                    higher_is_better=False, gpus=g)
        for q in ("recognize precision", "recognize recall"):
            if q in r:
                rep.add(f"{q} on {g} GPU{'s' if g > 1 else ''}", r[q]["value"], "", what, gpus=g)
    head = f"{'GPUs':>4}  {'scans':>6}  {'end to end':>10}  {'x':>5}  {'eff':>4}  {'process':>8}  {'x':>5}  " \
           f"{'eff':>4}  {'GPU busy in the pass (each)':<28}  overhead"
    lines = [head]
    for g, scans, rec in runs:
        r = rows_of(rec)
        e2e, pro = r.get("archive end to end: scans/s", {}), r.get("process: scans/s", {})
        e0 = b.get("archive end to end: scans/s", {}).get("value")
        p0 = b.get("process: scans/s", {}).get("value")
        ex = pro.get("extra", {})
        each = ex.get("gpu_busy_pct_each") or ({"": ex["gpu_busy_pct"]} if "gpu_busy_pct" in ex else {})
        ov = r.get("whole archive (all stages): orchestration overhead", {}).get("value")
        sp = lambda v, v0: (v / v0) if v and v0 else float("nan")  # noqa: E731
        lines.append(f"{g:>4}  {scans:>6}  {e2e.get('value', float('nan')):>10.2f}  {sp(e2e.get('value'), e0):>5.2f}  "
                     f"{sp(e2e.get('value'), e0) * g0 / g:>4.2f}  {pro.get('value', float('nan')):>8.2f}  "
                     f"{sp(pro.get('value'), p0):>5.2f}  {sp(pro.get('value'), p0) * g0 / g:>4.2f}  "
                     f"{' '.join(f'{v:.0f}%' for v in each.values()):<28}  "
                     f"{'-' if ov is None else f'{ov:.1f}%'}")
    rep.note("scaling (scans per GPU fixed; x: speed-up over the first row, eff: per GPU):\n" + "\n".join(lines))
    print("\n".join(lines), flush=True)


def run_gpu_scaling(gpus: list[int], scans: int, points: int, models: int, workers_per_gpu: int | None,
                    workdir: Path, out, keep: bool = False, pipeline: str = "one-pass", warmup: int = 16,
                    batch: int | None = None) -> BenchReport:
    """``bench archive --gpus 1,2,4``: the archive on the first G GPUs for each G, ``scans`` scenes
    per GPU (so 2,000 on one GPU, 8,000 on four), each count a fresh ``bench archive`` process of
    its own (``CUDA_VISIBLE_DEVICES`` naming those cards, its own local cluster: one worker set
    per GPU) over the same files. A warm-up archive of ``warmup`` scenes (one GPU, two workers) runs first
    (not counted) so that no count pays the compilers' caches."""
    import subprocess
    import sys

    from scanforest.kernels.backend import gpu_count
    from scanforest.kernels.errors import InputError
    from scanforest.tasks.synth import write_archive

    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    devs = [d.strip() for d in vis.split(",") if d.strip()] if vis else [str(i) for i in range(gpu_count())]
    if not devs:
        raise InputError("--gpus needs GPUs, and this machine has none visible")
    gpus = sorted(set(gpus))
    if not gpus or gpus[0] < 1 or gpus[-1] > len(devs):
        raise InputError(f"--gpus {','.join(map(str, gpus))}: each count must be 1..{len(devs)} "
                         f"(the GPUs this machine shows)")
    rep = BenchReport("archive-gpus", {"gpus": gpus, "scans_per_gpu": scans, "points": points, "models": models,
                                       "workers_per_gpu": workers_per_gpu, "pipeline": pipeline, "batch": batch},
                      echo=True, out=out)
    shared = workdir / "archive-all"
    t0 = time.perf_counter()
    write_archive(shared, n_models=models, n_scenes=scans * gpus[-1], points_per_scene=points,
                  points_per_model=12_000, jobs=os.cpu_count() or 1)
    rep.note(f"archive of {scans * gpus[-1]} scenes made in {time.perf_counter() - t0:.1f} s (not counted)")

    def one(g: int, n: int, tag: str, workers: int | None = None) -> dict:
        wd = workdir / tag
        shutil.rmtree(wd, ignore_errors=True)
        _link_archive(shared, wd / "archive", n)
        cmd = [sys.executable, "-m", "scanforest.deploy.cli", "bench", "archive", "--scans", str(n),
               "--points", str(points), "--models", str(models), "--device", "gpu", "--pipeline", pipeline,
               "--workdir", str(wd), "--out", str(wd.with_suffix(".json"))]
        if workers or workers_per_gpu:
            cmd += ["--workers", str(workers or workers_per_gpu * g)]
        if batch and tag != "warmup":
            cmd += ["--batch", str(batch)]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devs[:g])}
        print(f"--- {tag}: {n} scans on GPU(s) {env['CUDA_VISIBLE_DEVICES']}", flush=True)
        res = subprocess.run(cmd, env=env)
        if res.returncode != 0:
            raise InputError(f"bench archive on {g} GPU(s) ({tag}) exited {res.returncode}; its output is above")
        rec = json.loads(wd.with_suffix(".json").read_text())
        if not keep:
            shutil.rmtree(wd, ignore_errors=True)
        return rec

    if warmup:  # two workers on one GPU fill the kernel caches every count then reads
        one(1, min(warmup, scans), "warmup", workers=2)
        rep.note(f"warm-up: {min(warmup, scans)} scenes on one GPU, 2 workers (not counted)")
    runs = [(g, scans * g, one(g, scans * g, f"gpus{g}")) for g in gpus]
    scaling_rows(rep, runs)
    rep.finish(out)
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return rep


def register(app, bench) -> None:
    """Add this bench to ``scanforest bench`` (found by :mod:`scanforest.deploy.cli`)."""
    import typer

    from scanforest.flows.cluster import check_workers

    @bench.command("archive")
    def bench_archive(
        scans: int = typer.Option(1000, help="Synthetic scenes in the archive."),
        points: int = typer.Option(20_000, help="Points per scene."),
        models: int = typer.Option(4, help="Library models."),
        workers: Optional[int] = typer.Option(None, "--workers", "-w", callback=check_workers),
        device: str = typer.Option("auto"),
        workdir: Path = typer.Option(Path("bench-archive"), help="Scratch folder (removed afterwards)."),
        keep: bool = typer.Option(False, help="Keep the scratch folder."),
        stages: str = typer.Option("all", help="Stages to run, e.g. 'ingest,describe,match' then 'recognize' "
                                   "in a second invocation on the same --workdir (kept until the last stage has run)."),
        pipeline: str = typer.Option("one-pass", help="one-pass (ingest, then describe + match + recognize "
                                     "in one pass: stage 'process') or staged (three passes)."),
        gpus: Optional[str] = typer.Option(None, "--gpus", help="GPU counts, e.g. 1,2,4: the archive on the first "
                                           "G GPUs for each G with --scans scenes PER GPU (weak scaling), each "
                                           "count its own process and cluster; a scaling table with each GPU's "
                                           "busy share. --workers is then per GPU."),
        warmup: int = typer.Option(16, help="With --gpus: scenes of an uncounted warm-up run first (one GPU, "
                                   "2 workers: it fills the compilers' caches)."),
        batch: Optional[int] = typer.Option(None, "--batch", min=1, help="Scenes per Dask task in the one pass "
                                            "(default: the archive flow's choice, about 8 tasks a worker, "
                                            "its last two rounds a half and a quarter; N is kept to the end)."),
        out: Optional[str] = typer.Option(None, "--out"),
    ):
        """Archive throughput through every stage and the orchestration overhead per stage."""
        if gpus is not None:
            from ._common import parse_counts
            from scanforest.kernels.errors import InputError

            if stages.strip() not in ("", "all"):
                raise InputError("--gpus runs every stage; leave --stages out")
            run_gpu_scaling(parse_counts(gpus), scans, points, models, workers, workdir, out, keep, pipeline,
                            warmup, batch)
            return
        run(scans, points, models, workers, device, workdir, out, keep, parse_stages(stages, pipeline), pipeline,
            batch)
