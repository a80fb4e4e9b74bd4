"""The library stage: a model library from model scans and the index over its reference rows, as
a stage of its own (``scanforest library build``), so that ``match --library`` can match the
scenes against it and ``recognize`` takes every scene from its stored description and matches.

Idempotent: a library whose models (ids and sha256) and parameters are unchanged is kept, and so
is an index whose library and search parameters are unchanged; when both are, the command says
so without importing Prefect or starting its API (:func:`~scanforest.tasks.library.library_unchanged`)
and records no run.
"""
from __future__ import annotations

import time
from typing import Any

from prefect import flow

from scanforest.tasks import index as idx
from scanforest.tasks.library import check_library_build, library_unchanged, summary
from scanforest.tasks.library import index_params as _index
from scanforest.tasks.recognize import build_library, library_index_name
from scanforest.tasks.store import ScanStore

from .inputs import absolute_path
from .prefect_api import ensure_prefect_api
from .records import RUN_HOOKS, record_run


@flow(name="scanforest-library-build", **RUN_HOOKS)
def library_build_flow(store: str, models: list[str], name: str = "default", params: dict | None = None,
                       index_params: dict | None = None, device: str = "auto") -> dict[str, Any]:
    """Build (or keep, when unchanged) the model library ``name`` from the ``models`` (scan ids),
    then the index over its reference rows (``library-<name>``, one shard; kept when unchanged)."""
    t0 = time.perf_counter()
    store = absolute_path(store)
    st = check_library_build(store, models, params, index_params)
    lib = build_library(store, models, name=name, params=params or {}, device=device)
    ref, ref_scan, ref_row, scans, source = idx.collect_library_reference(st, name)
    ix = idx.build_index(store, library_index_name(name), ref, shards=1, params=_index(index_params),
                         ref_scan=ref_scan, ref_row=ref_row, scans=scans, device=device, library=source)
    out = summary(store, name, lib["status"], ix["name"], ix["status"], time.perf_counter() - t0)
    record_run(ScanStore(store), "library-build",
               {"name": name, "models": list(models), "params": params or {}, "index_params": _index(index_params),
                "device": device}, out, [])
    return out


def run_library_build(store, models, **kw) -> dict[str, Any]:
    """``library build``: the user's errors first, then nothing at all when the library and its
    index are unchanged (no Prefect API, no run record), else the flow."""
    store = absolute_path(store)
    models = list(models)
    check_library_build(store, models, kw.get("params"), kw.get("index_params"))
    done = library_unchanged(store, models, kw.get("name", "default"), kw.get("params"), kw.get("index_params"))
    if done is not None:
        return done
    ensure_prefect_api()
    return library_build_flow(store=store, models=models, **kw)
