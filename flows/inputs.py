"""A stage's input as every process must see it, checked in the flow process before any work is
submitted (and before a cluster starts): paths made absolute (:func:`absolute_path`), the store
opened (:func:`open_store`), the scans named found in it (:func:`require_scans`), a file's own name
taken for its scan's id (:func:`resolve_scan_names`)."""
from __future__ import annotations

import os


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
        hits = sorted(sid for sid, src in sources.items() if nfc(src) == key or nfc(src).endswith("/" + key))
        files = {sources[h] for h in hits}
        if len(files) > 1:
            raise InputError(f"{st.path}: {name!r} is the name of {len(files)} scanned files (scans "
                             f"{', '.join(hits[:3])}{', ...' if len(hits) > 3 else ''}): give a scan id "
                             f"(scanforest info {st.path} --scans lists them)")
        out.extend(hits or [name])
    return out
