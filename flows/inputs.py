"""A stage's input as every process must see it, checked in the flow process before any work is
submitted (and before a cluster starts): paths made absolute (:func:`absolute_path`), the store
opened (:func:`open_store`), the scans named found in it (:func:`require_scans`), a file's own name
taken for its scan's id (:func:`resolve_scan_names`); and each stage's user errors
(``check_*``), found here without importing Prefect, Dask or the flows, so that a command
given a bad argument answers in about a second, not after the 3-5 s those imports take."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from scanforest.tasks.options import check_option, check_options, flag

if TYPE_CHECKING:
    from scanforest.tasks.store import ScanStore


def absolute_path(path: str) -> str:
    """A store (or source) path as every process must see it: absolute in the flow process, before
    any work is submitted (a worker of an existing cluster has another working folder, and a
    relative path there names another store). URLs (``s3://...``) are kept."""
    path = str(path)
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def open_store(store: str, mode: str = "a"):
    """An existing scan store, or a user error in one line (``ScanStore`` says which: none there,
    or something else there; for ``mode="a"``, :func:`~scanforest.tasks.preflight.check_store_location`
    says when it cannot be written: read-only, full); only ingest creates stores. The stages'
    input checks open their store here, before a cluster starts."""
    from scanforest.tasks.preflight import check_store_location
    from scanforest.tasks.store import ScanStore

    path = absolute_path(store)
    st = ScanStore(path, mode=mode)
    if mode == "a":
        check_store_location(path)
    return st


def require_scans(st, ids, kind: str = "scan") -> None:
    """Every id names a scan of the store ``st`` (a user error in one line otherwise)."""
    from scanforest.kernels.errors import InputError

    have = set(st.scans())
    missing = [s for s in ids or () if s not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{st.path}: no {kind} {missing[0]!r}{more}")


def resolve_scan_names(st, names: list[str] | None) -> list[str] | None:
    """Scan ids for the names a user typed: an id (or a glob pattern) as it is; otherwise a file's
    path relative to its ingest root, or its name alone, spelt as the user's folder spells it.
    Ids are ASCII (``scène été.pcd`` is stored as ``scene_ete~<hash>.pcd``), so without this a
    command given the file's own name answered "no scan". A file of several scans (E57) names
    them all. A name that several files share is a user error naming them; one that names
    nothing is left as typed, for the caller's check to report."""
    import unicodedata

    from scanforest.kernels.errors import InputError
    from scanforest.tasks.store import scan_id_for

    if not names:
        return names

    def nfc(text: str) -> str:
        return unicodedata.normalize("NFC", text.replace(os.sep, "/"))

    have = set(st.scans())
    sources: dict[str, str] | None = None
    out: list[str] = []
    for name in names:
        if name in have or any(ch in name for ch in "*?["):
            out.append(name)
            continue
        rel = name.replace(os.sep, "/").strip("/")
        ids = {scan_id_for(unicodedata.normalize(form, rel)) for form in ("NFC", "NFD")} | {scan_id_for(rel)}
        if len(ids & have) == 1:
            out.append(next(iter(ids & have)))
            continue
        if sources is None:
            sources = st.sources(have)
        key = nfc(rel)
        hits = sorted(sid for sid, src in sources.items() if nfc(src) == key or nfc(src).endswith(("/" + key, "::" + key)))
        files = {sources[h] for h in hits}
        if len(files) > 1:
            raise InputError(f"{st.path}: {name!r} is the name of {len(files)} scanned files (scans "
                             f"{', '.join(hits[:3])}{', ...' if len(hits) > 3 else ''}): give a scan id "
                             f"(scanforest info {st.path} --scans lists them)")
        out.extend(hits or [name])
    return out


def check_index_build(store: str, reference: list[str] | None, shards, params: dict | None, dtype: str, *,
                      library: str | None = None, name: str = "default") -> ScanStore:
    """User errors of an index build, found before any cluster starts: the index's ``name`` is
    one node of the store, and the reference is either scans (``reference``) or a stored model
    library (``library``), not both."""
    from scanforest.kernels.errors import InputError
    from scanforest.kernels.knn.kdforest import METHODS as KDFOREST_METHODS
    from scanforest.tasks.store.catalog import check_name

    check_name("index", name)
    st = open_store(store)
    if library is not None:
        if reference:
            raise InputError("give the index's reference as scans or as a model library, not both")
        if st.catalog.find_library(library) is None:
            have = st.catalog.libraries()
            raise InputError(f"{store}: no complete model library {library!r} "
                             f"({'libraries: ' + ', '.join(have) if have else 'the store has none'}; "
                             "`scanforest library build` builds one)")
    elif not reference:
        raise InputError("no reference scans given for the index (or a model library)")
    else:
        require_scans(st, reference)
    if shards != "auto" and (not str(shards).isdigit() or int(shards) < 1):
        raise InputError(f"--shards takes a positive number or 'auto', got {shards!r}")
    p = params or {}
    if p.get("method", "banns") not in KDFOREST_METHODS:
        raise InputError(f"--method must be one of {', '.join(KDFOREST_METHODS)}, got {p.get('method')!r}")
    check_options(p, names=("leaf_size", "backtracks", "recall", "random_dims", "seed"))
    if p.get("recall") is not None and p.get("backtracks") is not None:
        raise InputError(f"give --recall or --backtracks, not both (got --recall {p['recall']} and "
                         f"--backtracks {p['backtracks']})")
    check_graph_options(p)
    if dtype not in ("float32", "float16"):
        raise InputError(f"--dtype must be float32 or float16, got {dtype!r}")
    return st


def check_graph_options(p: dict) -> None:
    """The graph options of an index (``--graph``, ``--graph-budget``, ``--graph-expand``,
    ``--graph-rounds``): one line naming the option, where ``p`` names a graph."""
    from scanforest.kernels.errors import InputError

    if p.get("graph_degree") is not None:
        if p.get("method", "banns") == "exact":
            raise InputError("--graph needs a forest (--method banns or anns): an exact index searches every row")
        check_options(p, names=("graph_degree", "graph_budget", "graph_expand", "graph_rounds"))


def check_match(store: str, queries: list[str] | None, k: int, name: str) -> tuple[ScanStore, dict]:
    """User errors of a match run, found before any cluster starts: the store, the index, ``k``
    and the query scans (each must exist and be described)."""
    from scanforest.kernels.errors import InputError

    check_option("-k", k)
    st = open_store(store)
    if st.catalog.find_index(name) is None and st.catalog.find_library(name) is not None:
        # `match STORE` after `library build`: the library's index is not named like the library
        raise InputError(f"{store}: no complete index {name!r}, but a model library {name!r}: match against "
                         f"it with --library {name}")
    attrs = st.catalog.index_attrs(name)
    if queries is not None:
        have = set(st.scans())
        bad = [q for q in queries if q not in have or not st.has_stage(q, "describe")]
        if bad:
            raise InputError(f"{store}: query scan {bad[0]!r} is not in the store or not described"
                             + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return st, attrs


#: the recognition and library parameters that are options of ``recognize``, ``archive`` and
#: ``library build``, checked by their options' rules (:mod:`scanforest.tasks.options`)
_OPTIONS = ("model_ss", "scene_ss", "rf_rad", "descr_rad", "cg_size", "cg_thresh", "voxel", "normal_k",
            "normal_radius", "views")


def check_recognize_params(library_params: dict | None, params: dict | None):
    """The recognition and library parameters' own user errors (no store needed: the archive
    flow checks them before it ingests), each named by its option; the checked ``RecognizeParams``."""
    from scanforest.kernels.errors import InputError

    check_options(library_params, names=_OPTIONS)
    check_options(params, names=_OPTIONS)
    from scanforest.tasks.library import check_voxel_views

    check_voxel_views(library_params)
    p = params or {}
    method = p.get("method")
    if method is not None and method not in ("hough", "gc"):
        raise InputError(f"--method must be hough or gc, got {method!r}")
    if method == "gc" and p.get("cg_thresh") is not None and float(p["cg_thresh"]) < 3:
        raise InputError(f"--cg-thresh must be at least 3 with --method gc (a pose needs 3 correspondences), "
                         f"got {p['cg_thresh']}")
    from scanforest.kernels.recognition import RecognizeParams

    # the rest of what every worker's recognize() will check: names and values, a parameter's
    # message under its option's name (RecognizeParams says ``descr_rad must ...``)
    try:
        return RecognizeParams().replace(**p)
    except InputError as exc:
        name = str(exc).split(" ", 1)[0]
        if name in p:
            raise InputError(flag(name) + str(exc)[len(name):]) from None
        raise


def check_recognize(store: str, models: list[str], scenes: list[str] | None, library_params: dict | None,
                    params: dict | None) -> ScanStore:
    """User errors of a recognize run, found before any cluster starts."""
    from scanforest.kernels.errors import InputError
    from scanforest.tasks.recognize import LIBRARY_DEFAULTS

    st = open_store(store)
    if not models:
        raise InputError("no model scans given (--models)")
    require_scans(st, models, "model scan")
    require_scans(st, scenes, "scene scan")
    p = check_recognize_params(library_params, params)
    lp = {**LIBRARY_DEFAULTS, **{k: v for k, v in (library_params or {}).items() if v is not None}}
    # coordinates too coarse in float32 for the radii (a scan many km across), before any work
    st.check_coordinates(models, {k: lp.get(k) for k in ("model_ss", "descr_rad", "rf_rad")})
    st.check_coordinates(scenes, {"scene_ss": p.scene_ss, "descr_rad": p.descr_rad or lp.get("descr_rad"),
                                  "normal_radius": p.normal_radius, "cg_size": p.cg_size,
                                  "rf_rad": (p.rf_rad or lp.get("rf_rad")) if p.method == "hough" else None})
    return st


def check_describe(store: str, scans: list[str] | None) -> None:
    """The store exists and holds the named scans (a user error otherwise, before any work)."""
    require_scans(open_store(store), scans)


def check_align(store: str, pairs: list[list[str]]) -> ScanStore:
    """User errors of an align run (the store, the pairs), found before any cluster starts."""
    from scanforest.kernels.errors import InputError

    st = open_store(store)
    have = set(st.scans())
    for p in pairs:  # the first bad pair, and what is wrong with it
        if len(p) != 2:
            raise InputError(f"an align pair names two scans (OBSERVED:REFERENCE), got {':'.join(map(str, p))!r}")
        missing = [s for s in p if s not in have]
        if missing:
            raise InputError(f"{st.path}: no scan {missing[0]!r} (align pair {p[0]}:{p[1]}; "
                             f"scanforest info {st.path} --scans lists them)")
    return st


def library_index_for_match(store: str, library: str) -> str:
    """``match --library NAME``: the index built over the model library NAME as it is now
    (``scanforest library build`` makes it); a user error naming the fix when there is none."""
    from scanforest.tasks.recognize import library_index

    return library_index(absolute_path(store), library)


def check_ingest(source: str, store: str, copc: dict | None = None) -> dict:
    """User errors of an ingest, found before any cluster starts: the source (a missing one, or one
    without scans when the ingest would create the store) and the COPC query; the checked query."""
    from scanforest.tasks.ingest import check_source
    from scanforest.tasks.las import copc_settings
    from scanforest.tasks.store import ScanStore

    # an ingest into an existing store may find nothing new (a drop folder between deliveries); one
    # that would create the store must find scans, or it leaves nothing behind
    check_source(absolute_path(str(source)), allow_empty=ScanStore.exists(absolute_path(str(store))))
    return copc_settings(**(copc or {}))


#: the archive's models pattern by default: scans under a ``models/`` folder, at the top of the source
#: (``models__NAME``) or inside an archive or folder given as the source (``odd.zip`` holds
#: ``odd__models__NAME``: with ``models__*`` alone, a zip of the README's layout found no model)
DEFAULT_MODELS = "models__*"


def is_model(scan_id: str, models: str) -> bool:
    """Whether ``scan_id`` is a model scan of an archive run with the models pattern ``models``
    (a glob on scan ids). A pattern that starts with a folder (``models__*``, the default, or
    ``objects__*.pcd``) also takes that folder inside an archive or a folder given as the source
    (``site__objects__a.pcd`` from ``site.zip``); another (``milk*``) is matched as it is."""
    import fnmatch
    import re

    if fnmatch.fnmatchcase(scan_id, models):
        return True
    return bool(re.match(r"[^*?\[\]]+__", models)) and fnmatch.fnmatchcase(scan_id, "*__" + models)


def check_archive_models(source: str | None, store: str, models: str) -> None:
    """An archive whose models pattern picks no scan, refused before anything is ingested: the
    ids the source's files will get (a folder or a glob; archives and E57 files, whose ids are
    known once they are opened, are left to the check after the ingest) and the store's scans.
    It used to ingest the whole source, creating the store, and then say no scan matched."""
    import tempfile

    from scanforest.kernels.errors import InputError
    from scanforest.tasks.ingest import discover, is_archive, is_glob
    from scanforest.tasks.store import ScanStore

    if source is None:
        return
    src, dst = absolute_path(str(source)), absolute_path(str(store))
    if not (os.path.isdir(src) or is_glob(src)):
        return
    with tempfile.TemporaryDirectory() as staging:
        if os.path.isdir(src):
            for _, _, files in os.walk(src):
                if any(is_archive(f) for f in files):
                    return
        sources, _ = discover(src, staging)
    if any(is_archive(s.path) or s.path.lower().endswith(".e57") for s in sources):
        return
    ids = [s.scan_id for s in sources]
    if ScanStore.exists(dst):
        ids += ScanStore(dst, mode="r").scans()
    if ids and not any(is_model(i, models) for i in ids):
        raise InputError(f"no file of {source} becomes a model scan: the models pattern {models!r} matches none of "
                         f"the scan ids ({', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''}); put the models "
                         "under SOURCE/models/ (ids models__NAME) or give --models")
