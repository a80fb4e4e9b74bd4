"""The library stage's checks, made before anything starts (no Prefect, no Dask, no kernels
imported): the user's errors (:func:`check_library_build`) and whether there is anything to do
(:func:`library_unchanged`); and the stage's summary. The stage itself is
:func:`scanforest.flows.library.library_build_flow` (the library: :func:`~.recognize.build_library`;
its index: :func:`~.index.build_index`)."""
from __future__ import annotations

import time
from typing import Any

from scanforest.kernels.errors import InputError

from .options import check_options
from .preflight import check_store_location
from .recognize import library_current, library_index_name
from .store import ScanStore


#: the index over a library: exact search unless asked otherwise (a library has thousands to tens of
#: thousands of rows, where brute force is fast, and it gives exactly the matches ``recognize``
#: computes itself)
INDEX_DEFAULTS = {"method": "exact"}
#: the index's search methods (``scanforest.kernels.knn.kdforest.METHODS``, not imported here)
METHODS = ("banns", "anns", "exact")

#: the library's parameters, each an option of ``library build`` (:mod:`.options`: its rule)
_OPTIONS = ("model_ss", "descr_rad", "rf_rad", "normal_k", "normal_radius", "views", "voxel")


def index_params(given: dict | None) -> dict[str, Any]:
    """The index parameters a library build asks for: the defaults and what was given (not None)."""
    return {**INDEX_DEFAULTS, **{k: v for k, v in (given or {}).items() if v is not None}}


def summary(store: str, name: str, lib_status: str, index: str, index_status: str, seconds: float) -> dict:
    cat = ScanStore(store, mode="r").catalog
    a = cat.library_attrs(name)
    ia = cat.find_index(index) or {}
    return {"library": name, "status": "unchanged" if lib_status == index_status == "unchanged" else "built",
            "library_status": lib_status, "models": len(a.get("model_scans") or []),
            "reference_descriptors": int(ia.get("n", 0)), "index": index, "index_status": index_status,
            "method": (ia.get("params") or {}).get("method", "banns"), "params": a.get("build_params", {}),
            "seconds": seconds}


def library_unchanged(store: str, models: list[str], name: str = "default", params: dict | None = None,
                      index_params_: dict | None = None) -> dict[str, Any] | None:
    """The summary of a ``library build`` with nothing to do (the library and its index are what
    it would build), found from attributes without building anything; None when there is work.

    The index counts as unchanged when it is built over the library as it is now, as one shard of
    float32 rows, with the search parameters asked for (its trees' split rule aside); anything else
    goes to the flow, where :func:`~scanforest.tasks.index.build_index` decides by its content hash."""
    t0 = time.perf_counter()
    if not library_current(store, models, name, params):
        return None
    cat = ScanStore(store, mode="r").catalog
    lib = cat.library_attrs(name)
    index = library_index_name(name)
    ia = cat.find_index(index)
    if ia is None:
        return None
    have = {k: v for k, v in (ia.get("params") or {}).items() if k != "split"}
    if (ia.get("library") != {"name": name, "content_hash": lib.get("content_hash")}
            or have != index_params(index_params_) or len(ia.get("shards") or []) != 1
            or ia.get("dtype", "float32") != "float32"):
        return None
    return summary(store, name, "unchanged", index, "unchanged", time.perf_counter() - t0)


def check_voxel_views(params: dict | None) -> None:
    """A thinned library (``voxel``) is described from the thinned model, not from rendered views:
    the two refused together in one line, before anything is built."""
    p = params or {}
    if p.get("voxel") is not None and (p.get("views") or 0) > 0:
        raise InputError("--voxel cannot be combined with --views (the views are rendered from the whole model)")


def check_library_build(store: str, models: list[str], params: dict | None, index_params_: dict | None):
    """User errors of a library build (``store``: an absolute path), found before anything
    starts; the store."""
    st = ScanStore(store)
    check_store_location(store)
    if not models:
        raise InputError("no model scans given for the library (--models)")
    have = set(st.scans())
    missing = [m for m in models if m not in have]
    if missing:
        raise InputError(f"{store}: no model scan {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    p = params or {}
    check_options(p, names=_OPTIONS)
    check_voxel_views(p)
    ip = index_params(index_params_)
    if ip.get("method") not in METHODS:
        raise InputError(f"--method must be one of {', '.join(METHODS)}, got {ip.get('method')!r}")
    check_options(ip, names=("backtracks",))
    return st
