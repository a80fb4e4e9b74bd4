"""The motion flow (Prefect flow ``scanforest-motion``): image sequences in the store -> (H, W, 2)
flow field per frame pair.

Each sequence's consecutive pairs are split into batches; one Prefect task per batch hands the
work unit :func:`scanforest.tasks.motion.motion_pairs` to the Dask cluster, which computes the
batch in one kernel launch and writes every pair into its own group (idempotent: pairs already
written with the same parameters are skipped). A frame folder given as ``source`` is ingested
first (itself skipped when the folder's bytes are unchanged). The run's record in the store is of
kind ``motion`` (stores written before the rename keep their ``flow`` records, listed as they are).
"""
from __future__ import annotations

import time
from typing import Any

from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner

from scanforest.kernels.errors import InputError
from scanforest.kernels.motion.optical_flow import METHODS, TRACKERS
from scanforest.tasks import motion as T
from scanforest.tasks.store import ScanStore

from .batching import auto_batch, map_units
from .cluster import dask_client, n_workers
from .prefect_api import ensure_prefect_api
from .prefect_tasks import RETRY_DELAYS, not_a_user_error, on_cluster
from .records import record_run


def _checked(result):
    """A unit's result; a user error it raised on its worker is raised here (one line, no
    worker traceback; not retried: :func:`not_a_user_error`)."""
    if isinstance(result, T.UserError):
        result.reraise()
    return result


@task(name="motion-ingest", retries=2, retry_delay_seconds=RETRY_DELAYS,
      retry_condition_fn=not_a_user_error, task_run_name="ingest frames {source}")
def ingest_sequence_task(store: str, source: str, seq_id: str | None = None,
                         tracks_dir: str | None = None, force: bool = False) -> dict[str, Any]:
    """A frame folder -> a sequence of the store (skipped when unchanged)."""
    return _checked(on_cluster(T.catching_user_errors, T.ingest_sequence, store, source, seq_id,
                               tracks_dir=tracks_dir, force=force))


@task(name="motion-pairs", retries=2, retry_delay_seconds=RETRY_DELAYS,
      retry_condition_fn=not_a_user_error,
      task_run_name="motion {seq_id} pairs {first}..{last} ({method})")
def motion_pairs_task(store: str, seq_id: str, pairs: list[int], first: int, last: int,
                    method: str, options: dict) -> list[dict[str, Any]]:
    """Flow fields of a batch of pairs of one sequence (pairs already written are skipped)."""
    return _checked(on_cluster(T.catching_user_errors, T.motion_pairs, store, seq_id, pairs,
                               method=method, **options,
                               key=f"motion-{seq_id}-{method}-{first}-{last}-{id(options):x}"))


@flow(name="scanforest-motion", task_runner=ThreadPoolTaskRunner(max_workers=32))
def motion_flow(store: str, sequences: list[str] | None = None, source: str | None = None,
                seq_id: str | None = None, tracks_dir: str | None = None,
                methods: list[str] | None = None, params: dict | None = None,
                klt: dict | None = None, tracker: str = "builtin", device: str = "auto",
                png_dir: str | None = None,
                scheduler: str | None = None, workers: int | None = None,
                batch: int | None = None, force: bool = False,
                progress: bool = True) -> dict[str, Any]:
    """Dense flow of every consecutive frame pair of ``sequences`` (default: all of the store).

    ``source`` (a frame folder) is ingested first as ``seq_id``; ``methods`` is a list of
    ``interpolation`` / ``hypotheses`` (default: both); ``params`` go to the kernels (sigma_c,
    sigma_x, sigma_f, tau, max_labels); ``png_dir`` receives ``<seq>/<method>/<t>.png``
    colour-wheel images; ``batch`` pairs per task (and per kernel launch).
    """
    t0 = time.perf_counter()
    methods = check_motion(methods, tracker, source, params, batch)
    with dask_client(scheduler, n_workers=workers, device=device) as client:
        nw = n_workers(client)
        ingested = None
        if source:
            ingested = ingest_sequence_task(store, source, seq_id, tracks_dir, force)
            seqs = [ingested["seq_id"]] if sequences is None else list(sequences)
        else:
            seqs = T.sequences(store) if sequences is None else list(sequences)
        have = set(T.sequences(store))
        missing = [s for s in seqs if s not in have]
        if missing:
            raise InputError(f"{store}: no sequence {missing[:5]} (have: {sorted(have)[:10]})")
        options = dict(params=dict(params or {}), klt=klt, tracker=tracker, device=device,
                       png_dir=png_dir, force=force)
        units = []
        for sid in seqs:
            if tracker == "builtin":
                T.check_trackable(store, sid, klt)      # one line now, not one per batch later
            n = T.prepare_outputs(store, sid, methods)
            b = batch or max(1, min(16, auto_batch(n, nw, max_batch=16)))
            for m in methods:
                for i in range(0, n, b):
                    ts = list(range(i, min(n, i + b)))
                    units.append(dict(store=store, seq_id=sid, pairs=ts, first=ts[0], last=ts[-1],
                                      method=m, options=options))
        out = map_units(motion_pairs_task, units, label="motion", progress=progress,
                        weights=[len(u["pairs"]) for u in units])
    recs = [r for rs in out for r in rs]
    written = [r for r in recs if r["status"] == "written"]
    summary = {"sequences": len(seqs), "pairs": len(recs), "written": len(written),
               "skipped": len(recs) - len(written), "methods": methods, "workers": nw,
               "mean_coverage": (sum(r["coverage"] for r in written) / len(written)) if written else None,
               "seconds": time.perf_counter() - t0}
    if ingested is not None:
        summary["ingest"] = ingested.get("status")
    record_run(ScanStore(store), "motion", {"methods": methods, "params": params or {},
                                            "device": device, "png_dir": png_dir}, summary,
               [dict(r, scan_id=f"{r['seq_id']}:{r['pair']}:{r['method']}") for r in recs])
    summary["results"] = recs
    return summary


def check_motion(methods=None, tracker: str = "builtin", source: str | None = None, params: dict | None = None,
                 batch: int | None = None) -> list[str]:
    """The cheap checks of a motion run's arguments, before a Prefect API or a cluster starts (a
    frame folder's frame headers here, the frames on the cluster; ``params`` and ``batch`` by
    their options' rules, :mod:`scanforest.tasks.options`). Returns the methods."""
    from scanforest.tasks.options import check_option, check_options

    check_options(params, names=("sigma_c", "sigma_x", "sigma_f", "tau", "max_labels"))
    check_option("--batch", batch)
    methods = list(methods or METHODS)
    for m in methods:
        if m not in METHODS:
            raise InputError(f"method must be one of {METHODS}, got {m!r}")
    if tracker not in TRACKERS:
        raise InputError(f"tracker must be one of {TRACKERS}, got {tracker!r}")
    if source:
        frames = T.list_frames(source)
        if len(frames) < 2:
            raise InputError(f"{source}: a sequence needs at least 2 frames, found {len(frames)} "
                             f"(extensions {', '.join(T.FRAME_EXTS)})")
        for f in frames:  # headers only: a file that is not an image is one line before anything starts
            T.check_frame(f)
    return methods


def run_motion(store, **kw) -> dict[str, Any]:
    """Start a Prefect API if none is configured and run :func:`motion_flow`."""
    check_motion(kw.get("methods"), kw.get("tracker", "builtin"), kw.get("source"), kw.get("params"),
                 kw.get("batch"))
    ensure_prefect_api()
    return motion_flow(store=str(store), **kw)
