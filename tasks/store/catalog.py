"""The named things the store keeps beside its scans, read and written through one opened
:class:`~scanforest.tasks.store.scans.ScanStore` (``store.catalog``):

* ``libraries/<name>/``: model libraries (:func:`scanforest.tasks.recognize.build_library`);
* ``indexes/<name>/``: sharded KD-forest indexes (:func:`scanforest.tasks.index.build_index`);
* ``sequences/<seq_id>/``: image sequences and their optical flow (:mod:`scanforest.tasks.motion`);
* ``runs/<run_id>/``: run manifests (the flows' records).

Each is a group whose attributes describe it; a library, an index or a sequence counts only once
its ``complete`` attribute is true (it is written last). What lies inside each group is its
writer's: this module knows where the groups are and when they count. :func:`warm` caches what
a worker loads from them (a library, an index's shards) by the store's path and content hash.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import uuid
from collections import OrderedDict
from typing import Any, Callable, Protocol

import numpy as np

from scanforest.kernels.errors import InputError


class OpenedStore(Protocol):
    """What the catalog needs of the store that owns it (a
    :class:`~scanforest.tasks.store.scans.ScanStore`; named structurally so that the catalog
    imports nothing from the scans module, which imports it)."""

    path: str
    root: Any

def plain_name(name) -> bool:
    """Whether ``name`` can be one node of the store (no path separator, no leading ``.``: the
    store's own hidden entries, such as a library being written, start with one)."""
    return isinstance(name, str) and bool(name) and not name.startswith(".") and "/" not in name \
        and os.sep not in name


def check_name(kind: str, name) -> str:
    """``name`` of a library, an index or a sequence, refused unless it is one node of the store:
    an empty name named the ``libraries`` (``indexes``) group itself, and writing it removed every
    library (index) of the store; ``a/b`` nests one inside another, ``..`` leaves the store, and
    a leading ``.`` is the store's own (:meth:`Catalog._new`'s groups being written)."""
    if not plain_name(name):
        raise InputError(f"{kind} name {name!r} cannot name {'an' if kind[0] in 'aeiou' else 'a'} {kind} of the "
                         "store: give a non-empty name without '/' that does not start with '.'")
    return name


#: the hidden group a new library, index or sequence is written in (``.NAME.partial-PID-RANDOM``)
PARTIAL = ".{name}.partial-"


def _drop_dead_partials(folder: str, name: str) -> None:
    """Remove the hidden groups of ``name`` that a writer on this host left when it was killed
    (its process is gone), and the old groups a replacement did not get to remove."""
    if not os.path.isdir(folder):
        return
    head = PARTIAL.format(name=name)
    for entry in os.listdir(folder):
        if entry.startswith(f".{name}.old-"):
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
        elif entry.startswith(head):
            pid = entry[len(head):].split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (another user's counts: signal 0 is refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


LIBRARIES = "libraries"
_KIND_NOUN = {"libraries": "library", "indexes": "index", "sequences": "sequence", "runs": "run"}
INDEXES = "indexes"
SEQUENCES = "sequences"
RUNS = "runs"


class Catalog:
    """Typed access to a store's libraries, indexes, sequences and runs (see the module)."""

    def __init__(self, store: OpenedStore):
        self.store = store

    @property
    def path(self) -> str:
        return self.store.path

    def _kind(self, kind: str):
        root = self.store.root
        return root[kind] if kind in root else None

    def _member(self, kind: str, name: str, *, complete: bool = True):
        """The group ``kind/name`` (only when complete, by default), or None."""
        check_name(_KIND_NOUN[kind], name)
        g = self._kind(kind)
        if g is None or name not in g:
            return None
        m = g[name]
        return m if not complete or m.attrs.get("complete") else None

    def _names(self, kind: str, *, include_incomplete: bool = True) -> list[str]:
        g = self._kind(kind)
        if g is None:
            return []
        return sorted(n for n, c in g.groups()
                      if not n.startswith(".") and (include_incomplete or c.attrs.get("complete", False)))

    def _new(self, kind: str, name: str):
        """``with``: a new group for ``kind/name``, not yet complete, written under a hidden name
        beside the one it replaces; when the block ends without an error it takes that one's
        place (two renames: the old one is removed after), and an error (or a killed writer)
        leaves the old one as it was. A build that failed (a bad parameter, a GPU out of memory,
        Ctrl-C) used to remove the library or index it was replacing first. The name is checked
        at once."""
        check_name(_KIND_NOUN[kind], name)
        return self._replacing(kind, name)

    @contextlib.contextmanager
    def _replacing(self, kind: str, name: str):
        g = self.store.root.require_group(kind)
        folder = os.path.join(self.path, kind)
        _drop_dead_partials(folder, name)
        part = f"{PARTIAL.format(name=name)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        m = g.create_group(part)
        m.attrs.update({"complete": False})
        try:
            yield m
        except BaseException:
            shutil.rmtree(os.path.join(folder, part), ignore_errors=True)
            raise
        final, old = os.path.join(folder, name), os.path.join(folder, f".{name}.old-{uuid.uuid4().hex[:8]}")
        if os.path.exists(final):
            os.rename(final, old)
        os.rename(os.path.join(folder, part), final)
        shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ libraries
    def libraries(self) -> list[str]:
        """Names of the stored libraries, complete or not, sorted."""
        return self._names(LIBRARIES)

    def find_library(self, name: str, *, complete: bool = True) -> dict[str, Any] | None:
        """The attributes of library ``name`` (names, params, model_scans, content_hash,
        build_params), or None when there is no such library (or it is incomplete)."""
        g = self._member(LIBRARIES, name, complete=complete)
        return None if g is None else dict(g.attrs)

    def library_attrs(self, name: str) -> dict[str, Any]:
        """The attributes of the complete library ``name``; a user error when there is none."""
        a = self.find_library(name)
        if a is None:
            raise InputError(f"{self.path}: no complete model library {name!r} (build it: "
                             f"scanforest library build STORE -m PATTERN --name {name})")
        return a

    def library_arrays(self, name: str, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Arrays of library ``name`` (all of them by default), read whole."""
        g = self._member(LIBRARIES, name, complete=False)
        if g is None:
            raise InputError(f"{self.path}: no model library {name!r}")
        return {k: g[k][...] for k in (g.array_keys() if names is None else names)}

    def new_library(self, name: str):
        """``with catalog.new_library(name) as g``: a fresh, incomplete group for library ``name``
        (:meth:`_new`): its writer fills it and sets ``complete`` last; it replaces the old one
        when the block ends."""
        return self._new(LIBRARIES, name)

    # ------------------------------------------------------------------ indexes
    def indexes(self) -> list[str]:
        """Names of the stored indexes, complete or not, sorted."""
        return self._names(INDEXES)

    def find_index(self, name: str) -> dict[str, Any] | None:
        """The attributes of the complete index ``name`` (params, shards, n, d, dtype,
        content_hash, scans, library), or None."""
        g = self._member(INDEXES, name)
        return None if g is None else dict(g.attrs)

    def index_attrs(self, name: str) -> dict[str, Any]:
        """The attributes of the complete index ``name``; a user error when there is none."""
        return dict(self.index_group(name).attrs)

    def index_group(self, name: str):
        """The group of the complete index ``name`` (its reference rows and shard trees, read
        lazily); a user error when there is none."""
        g = self._member(INDEXES, name)
        if g is None:
            raise InputError(f"{self.path}: no complete index {name!r} (build it with `scanforest index build`)")
        return g

    def new_index(self, name: str):
        """``with catalog.new_index(name) as g``: a fresh, incomplete group for index ``name``,
        in place of the old one when the block ends (:meth:`_new`)."""
        return self._new(INDEXES, name)

    def update_index(self, name: str, attrs: dict[str, Any]) -> None:
        """Add ``attrs`` to the attributes of the complete index ``name``."""
        self.index_group(name).attrs.update(attrs)

    # ------------------------------------------------------------------ sequences
    def sequences(self, *, include_incomplete: bool = False) -> list[str]:
        """Ids of the (completely written) sequences, sorted."""
        return self._names(SEQUENCES, include_incomplete=include_incomplete)

    def find_sequence(self, seq_id: str) -> dict[str, Any] | None:
        """The attributes of the complete sequence ``seq_id``, or None."""
        g = self._member(SEQUENCES, seq_id)
        return None if g is None else dict(g.attrs)

    def sequence(self, seq_id: str):
        """The group of the complete sequence ``seq_id`` (its frames, tracks and flow); a user
        error when it is missing or incomplete."""
        g = self._member(SEQUENCES, seq_id, complete=False)
        if g is None:
            raise InputError(f"{self.path}: no sequence {seq_id!r} (have: {self.sequences()})")
        if not g.attrs.get("complete", False):
            raise InputError(f"{self.path}: sequence {seq_id!r} is incomplete (an interrupted write); "
                             "ingest it again")
        return g

    def new_sequence(self, seq_id: str):
        """``with catalog.new_sequence(seq_id) as g``: a fresh, incomplete group for sequence
        ``seq_id``, in place of the old one when the block ends (:meth:`_new`)."""
        return self._new(SEQUENCES, seq_id)

    # ------------------------------------------------------------------ runs
    def runs(self) -> list[dict[str, Any]]:
        """Every run manifest (its attributes and ``id``), sorted by id."""
        g = self._kind(RUNS)
        if g is None:
            return []
        return sorted((dict(child.attrs, id=name) for name, child in g.groups()), key=lambda d: d["id"])

    def run(self, run_id: str) -> dict[str, Any] | None:
        """The manifest of run ``run_id`` (without its ``id``), or None. (They are written by
        :meth:`ScanStore.write_run <scanforest.tasks.store.scans.ScanStore.write_run>`.)"""
        g = self._member(RUNS, run_id, complete=False)
        return None if g is None else dict(g.attrs)


def warm(maxsize: int) -> Callable:
    """A per-process cache of what ``fn(store, *key)`` loads from the store, keyed by the store's
    path and ``key`` (a name and a content hash: the thing loaded, as it is now): a warm call
    neither opens nor reads the store. The ``maxsize`` most recently used are kept;
    ``fn.cache_clear()`` empties it."""

    def deco(fn):
        cache: OrderedDict = OrderedDict()
        lock = threading.Lock()

        @functools.wraps(fn)
        def cached(store: OpenedStore, *key):
            k = (store.path, *key)
            with lock:
                if k in cache:
                    cache.move_to_end(k)
                    return cache[k]
            value = fn(store, *key)
            with lock:
                cache[k] = value
                cache.move_to_end(k)
                while len(cache) > maxsize:
                    cache.popitem(last=False)
            return value

        cached.cache_clear = cache.clear
        return cached

    return deco
