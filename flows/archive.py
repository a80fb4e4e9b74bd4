"""The archive flow: one run takes a store through every stage, ingest -> describe -> index ->
match -> recognize, as subflows (each its own flow run on the server, with its own Dask client).

Every stage is resumable on its own (a scan's stage is recorded only after its arrays are
written, an unchanged index or library is kept), so a rerun after a crash, or the next scheduled
run after new scans arrived, does only the work that is missing."""
from __future__ import annotations

import fnmatch
from typing import Any

from prefect import flow

from scanforest.kernels.errors import InputError
from scanforest.tasks.describe import DescribeParams
from scanforest.tasks.store import ScanStore

from .describe import describe_flow
from .ingest import ingest_flow
from .match import index_build_flow, match_flow
from .recognize import recognize_flow


@flow(name="scanforest-archive")
def archive_flow(store: str, source: str | None = None, models: str = "models__*", index: str = "models",
                 library: str = "default", describe: dict | None = None, index_params: dict | None = None,
                 shards: int | str = 1, k: int = 4, library_params: dict | None = None,
                 recognize: dict | None = None, device: str = "auto", scheduler: str | None = None,
                 workers: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Ingest ``source`` (when given) into ``store``, describe every scan, build the index
    ``index`` over the model scans (scan ids matching the glob ``models``), match the other
    described scans against it and recognise the models in them. ``describe`` holds
    :class:`DescribeParams` fields, ``recognize`` the recognition parameters. Returns each
    stage's summary under its name."""
    out: dict[str, Any] = {}
    cluster = dict(scheduler=scheduler, workers=workers, progress=progress)
    if source is not None:
        out["ingest"] = ingest_flow(source=source, store=store, **cluster)
    ids = ScanStore(store, mode="r").scans()
    model_ids = [s for s in ids if fnmatch.fnmatchcase(s, models)]
    if not model_ids:  # the index and recognition need the models: say so before describing anything
        raise InputError(f"no scan of {store} matches the models pattern {models!r} "
                         f"(scan ids look like {ids[:3]})")
    out["describe"] = describe_flow(store=store, params=DescribeParams(**(describe or {})), device=device,
                                    **cluster)
    out["index-build"] = index_build_flow(store=store, reference=model_ids, name=index, shards=shards,
                                          params=index_params, k=k)
    out["match"] = match_flow(store=store, k=k, name=index, device=device, **cluster)
    out["recognize"] = recognize_flow(store=store, models=model_ids, library=library,
                                      library_params=library_params, params=recognize, device=device,
                                      render=False, **cluster)
    return out
