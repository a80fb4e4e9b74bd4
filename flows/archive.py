"""The archive flow: one run takes a store through every stage, ingest -> library -> describe ->
index -> match -> recognize, as subflows (each its own flow run on the server, with its own Dask
client).

One pipeline: the model library is built first, the scenes are described with the parameters
recognition uses (:func:`~scanforest.tasks.recognize.describe_params_for`), the index is built
over the library's reference rows and the scenes are matched against it, so the recognize stage
takes every scene's description and matches from the store instead of describing and matching
it a second time (each scene's record says ``source: "stored"``).

``pipeline="one-pass"`` (the default) runs describe -> match -> recognize as ONE pass over the
scenes (:func:`process_flow`): a Dask task takes a batch of scenes and, for each, reads its points
once, describes, matches against the index's shards (resident on the worker) and recognises on
its device, writing the three stages' arrays and records in the background while the next scene
computes. ``pipeline="staged"`` runs them as three passes (three subflows), each over every scene
through the store: for an index too large for one worker, whose shards must be spread over
the cluster.

Every stage is resumable on its own (a scan's stage is recorded only after its arrays are
written, an unchanged index or library is kept), so a rerun after a crash, or the next scheduled
run after new scans arrived, does only the work that is missing."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from scanforest.kernels.errors import InputError
from scanforest.tasks.describe import DescribeParams
from scanforest.tasks.recognize import build_library, describe_params_for, description_key
from scanforest.tasks.store import ScanStore

from .batching import TASKS_IN_FLIGHT, auto_batch, map_batches
from .cluster import cluster_scope, cluster_with_api, dask_client, n_workers, warm_gpu_workers
from .describe import describe_flow
from .ingest import ingest_flow
from .inputs import (DEFAULT_MODELS, absolute_path, check_archive_models, check_recognize, check_recognize_params,
                     is_model)
from .match import index_build_flow, match_flow
from .recognize import other_libraries, recognize_flow, replaced_note, summarize
from .records import RUN_HOOKS, count_redone, record_run

PIPELINES = ("one-pass", "staged")


#: callbacks ``(stage, summary)`` of the archive runs in this process (:func:`stage_reports`)
_STAGE_REPORTS: list = []


@contextlib.contextmanager
def stage_reports(report) -> Iterator[None]:
    """Within the block, :func:`archive_flow` hands each stage's summary to ``report(stage,
    summary)`` as the stage ends (``scanforest archive`` prints ingest's table then, so a run
    stopped later, by a Ctrl-C or a failed scene, still shows what ingest did and quarantined)."""
    _STAGE_REPORTS.append(report)
    try:
        yield
    finally:
        _STAGE_REPORTS.remove(report)


def _stage_done(stage: str, summary: dict[str, Any]) -> None:
    for report in list(_STAGE_REPORTS):
        report(stage, summary)


def run_archive(*, source: str | None = None, device: str = "auto", scheduler: str | None = None,
                workers: int | None = None, **kwargs) -> dict[str, Any]:
    """:func:`archive_flow` as the commands run it (``scanforest archive``, ``scanforest demo``):
    on a cluster started while Prefect's API boots (:func:`~.cluster.cluster_with_api`), its
    workers importing the format readers when there is a ``source`` to ingest.
    ``kwargs``: the flow's other parameters."""
    from .worker_setup import INGEST_PRELOAD

    with cluster_with_api(device=device, workers=workers, scheduler=scheduler,
                          preload=INGEST_PRELOAD if source is not None else ()):
        return archive_flow(source=source, device=device, scheduler=scheduler, workers=workers, **kwargs)


@flow(name="scanforest-archive")
def archive_flow(store: str, source: str | None = None, models: str = DEFAULT_MODELS, index: str = "models",
                 library: str = "default", describe: dict | None = None, index_params: dict | None = None,
                 shards: int | str = 1, k: int = 4, library_params: dict | None = None,
                 recognize: dict | None = None, device: str = "auto", scheduler: str | None = None,
                 workers: int | None = None, progress: bool = True, pipeline: str = "one-pass",
                 copc: dict | None = None) -> dict[str, Any]:
    """Ingest ``source`` (when given) into ``store``, build the model library ``library`` from the
    model scans (scan ids matching the glob ``models``), describe the other scans as recognition
    describes a scene, build the index ``index`` over the library, match the scenes against it
    (top ``k``) and recognise the models in them from those stored outputs.

    ``recognize`` holds the recognition parameters and ``library_params`` the library's; the
    scenes' :class:`DescribeParams` follow from them. ``describe`` may only repeat them (e.g.
    ``{"normal_k": 10}``): a description recognition would not use is refused. Returns each
    stage's summary under its name (``process`` for the one-pass pipeline's describe + match +
    recognize). ``copc``: ingest's COPC query (:func:`~.ingest.ingest_flow`)."""
    if pipeline not in PIPELINES:
        raise InputError(f"pipeline must be one of {', '.join(PIPELINES)}, got {pipeline!r}")
    check_recognize_params(library_params, recognize)  # a bad value refused before anything is ingested
    # one local cluster for every stage (its workers start once, and keep the library and the
    # index they load); with a scheduler, the stages use its workers
    with cluster_scope(device=device, workers=workers):
        out: dict[str, Any] = {}
        store = absolute_path(store)
        cluster = dict(scheduler=scheduler, workers=workers, progress=progress)
        if source is not None:
            check_archive_models(source, store, models)  # before the store is made or anything ingested
            out["ingest"] = ingest_flow(source=source, store=store, copc=copc, **cluster)
            _stage_done("ingest", out["ingest"])
        ids = ScanStore(store, mode="r").scans()
        model_ids = [s for s in ids if is_model(s, models)]
        if not model_ids:  # the library needs the models: say so before describing anything
            raise InputError(f"no scan of {store} matches the models pattern {models!r} "
                             f"(scan ids look like {ids[:3]})")
        scene_ids = [s for s in ids if s not in set(model_ids)]
        # every scan a model (all under models/, or --models '*'): the library is built, no scene is
        # recognised, and the summary says why instead of a bare 0
        no_scene = None if scene_ids else (
            f"no scene to recognise: all {len(ids)} scan{'s' if len(ids) != 1 else ''} of {store} "
            f"{'are models' if len(ids) != 1 else 'is a model'} (the models pattern {models!r}); scenes "
            "added outside the models are recognised by the next run")
        rec_params = dict(recognize or {})
        check_recognize(store, model_ids, scene_ids, library_params, rec_params)
        need = int(rec_params.get("match_k", 1)) + (1 if rec_params.get("ratio") is not None else 0)
        if int(k) < need:
            raise InputError(f"k={k} neighbours are fewer than recognition uses ({need}: match_k"
                             f"{' + 1 for the ratio test' if need > int(rec_params.get('match_k', 1)) else ''})")
        warm_gpu_workers(device)  # while the library and the index are built here
        out["library"] = build_library(store, model_ids, name=library, params=library_params or {}, device=device)
        lib_attrs = ScanStore(store, mode="r").catalog.library_attrs(library)
        params = describe_params_for(rec_params, lib_attrs.get("params"))
        if describe:
            asked = DescribeParams(**{**params.__dict__, **describe})
            want, got = description_key(params.as_dict()), description_key(asked.as_dict())
            bad = [f"{key} {got[key]} (recognition describes with {want[key]})"
                   for key in want if got[key] != want[key]]
            if bad:
                raise InputError("the archive describes scenes as recognition does; describe= asks for "
                                 + ", ".join(bad) + ": leave it out, or change the recognition parameters")
        if pipeline == "one-pass":
            out["index-build"] = index_build_flow(store=store, library=library, name=index, shards=shards,
                                                  params=index_params, k=k)
            out["process"] = process_flow(store=store, scenes=scene_ids, library=library, index=index, k=k,
                                          params=rec_params, device=device, **cluster)
            if no_scene:
                out["process"]["note"] = no_scene
            return out
        out["describe"] = describe_flow(store=store, scans=scene_ids, params=params, device=device, **cluster)
        out["index-build"] = index_build_flow(store=store, library=library, name=index, shards=shards,
                                              params=index_params, k=k)
        out["match"] = match_flow(store=store, k=k, name=index, device=device, **cluster)
        out["recognize"] = recognize_flow(store=store, models=model_ids, library=library,
                                          library_params=library_params, params=rec_params, device=device,
                                          render=False, **cluster)
        if no_scene:
            out["recognize"]["note"] = no_scene
        return out


@flow(name="scanforest-process", task_runner=ThreadPoolTaskRunner(max_workers=TASKS_IN_FLIGHT), **RUN_HOOKS)
def process_flow(store: str, scenes: list[str], library: str, index: str, k: int = 4, params: dict | None = None,
                 device: str = "auto", scheduler: str | None = None, workers: int | None = None,
                 batch: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Describe, match and recognise ``scenes`` in one pass (one Dask task per batch of scenes;
    :func:`scanforest.tasks.pipeline.process_batch`), against the model library ``library`` and
    the index ``index`` built over it. Each scene's three stages are written as their own stages
    would write them; a scene whose recognition is current is skipped, one whose description or
    matches are current is recognised from them. A scene that fails is recorded with its reason
    and the rest go on."""
    from scanforest.tasks.store import utc_now

    from .prefect_tasks import process_batch_task

    t0 = time.perf_counter()
    store = absolute_path(store)
    st = ScanStore(store, mode="r")
    params = dict(params or {})
    replaced = other_libraries(st, list(scenes), library)
    with dask_client(scheduler, n_workers=workers, device=device) as client:
        nw = n_workers(client)
        since = utc_now()
        t1 = time.perf_counter()
        nb = batch or auto_batch(len(scenes), nw)
        recs = map_batches(process_batch_task, list(scenes), item_param="scan_ids",
                           common=dict(store=store, library=library, index=index, params=params, k=int(k),
                                       device=device),
                           label="process", batch=nb, progress=progress, workers=nw, parts_param="parts",
                           taper=batch is None)  # a batch size given (bench archive --batch) is kept to the end
        t_scenes = time.perf_counter() - t1
    count_redone(recs, st, "recognize", since, "recognized")
    summary = summarize(recs)
    summary.update(scenes=len(scenes), workers=nw, batch=nb, seconds=time.perf_counter() - t0,
                   scenes_seconds=t_scenes,
                   task_seconds=float(sum(r.get("task_seconds", r.get("seconds", 0.0)) for r in recs)),
                   cpu_seconds=float(sum(r.get("cpu_seconds", 0.0) for r in recs)),
                   described=sum(bool(r.get("described")) for r in recs),
                   matched=sum(bool(r.get("matched")) for r in recs),
                   # scans whose chunk's batched recognition failed and that were recognised one by one
                   batched_fallbacks=sum(bool(r.get("batched_fallback")) for r in recs),
                   # scans that ran out of device memory and were run again once the worker gave its
                   # cached blocks back (tasks.pipeline.process_batch)
                   device_memory_retries=sum(bool(r.get("device_memory_retry")) for r in recs),
                   # chunks after which a worker gave back its device cache beyond its share
                   gpu_cache_trims=sum(bool(r.get("gpu_cache_trim")) for r in recs))
    if replaced:
        summary["replaced_note"] = replaced_note(replaced, library)
    record_run(ScanStore(store), "process", {"library": library, "index": index, "k": int(k), "params": params,
                                             "device": device, "batch": nb}, summary, recs)
    return summary
