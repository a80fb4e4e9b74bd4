"""numba's ``njit`` and ``prange`` for the CPU kernels, with one compilation per cached function
across processes.

A fresh machine's first run compiles every kernel it uses (the README demo: about 30 s of CPU a
process, 2026-12-07). The archive flow's workers reach the same kernels at the same moment, and
numba's on-disk cache lets each of them compile its own copy and write it over the others':
the demo's two workers on CI's 2 cores spent 28 s each compiling the same 40 functions
side by side (the matching, ICP and verification kernels), and a laptop's eight workers
compile the same thing eight times over, with the flow process and a second command beside
them. Worse, numba rewrites a function's cache index by read-modify-write, so two processes
compiling two signatures of one function at once can drop one of them (and it is compiled again
by the next run).

Importing this module makes numba take, for a function whose cache is on disk, an exclusive
lock on a file beside that function's cache index (``NAME.nbi.lock``) before it looks in the
cache and compiles: the first process compiles and writes the cache; the others wait for it
and then load what it wrote (milliseconds). Functions already compiled in the process, and
functions without ``cache=True``, take no lock. Nested compilations (a kernel calling another
kernel) take the callee's lock inside the caller's, in call order, so the locks cannot form a
cycle; each process takes each lock once (numba compiles one function at a time per process,
under its global compiler lock, which this holds first). Where the lock cannot be had (no
``fcntl``, a read-only cache folder, a file system without ``flock``), numba compiles as it
always did.
"""
from __future__ import annotations

import contextlib
import os


from numba import njit, prange

__all__ = ["njit", "prange", "install_compile_lock"]

_held: set[str] = set()  # the lock files this process holds (taken under numba's compiler lock)


def _index_path(dispatcher) -> str | None:
    """The cache index file of a dispatcher whose cache is on disk (``cache=True``), else None."""
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    path = getattr(cache_file, "_index_path", None)
    return path if isinstance(path, str) else None


@contextlib.contextmanager
def _first_compiler(index: str):
    """Hold the lock of the cached function whose index is ``index`` (see the module's doc)."""
    import fcntl

    if index in _held:
        yield
        return
    try:
        os.makedirs(os.path.dirname(index), exist_ok=True)
        fd = os.open(index + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        _held.add(index)
        try:
            yield
        finally:
            _held.discard(index)
    finally:
        os.close(fd)  # releases the lock


def install_compile_lock() -> bool:
    """Make numba's dispatchers compile each cached function once across processes (the
    module's doc). Idempotent; False where it cannot be installed (no ``fcntl``, or a numba
    whose dispatcher lacks what it wraps)."""
    try:
        import fcntl  # noqa: F401 - POSIX only
        from numba.core import sigutils
        from numba.core.compiler_lock import global_compiler_lock
        from numba.core.dispatcher import Dispatcher
    except ImportError:
        return False
    compile_ = Dispatcher.compile
    if getattr(compile_, "_scanforest_lock", False):
        return True

    def compile(self, sig):
        index = _index_path(self)
        if index is None:
            return compile_(self, sig)
        with global_compiler_lock:
            args, _ = sigutils.normalize_signature(sig)
            existing = self.overloads.get(tuple(args))
            if existing is not None:
                return existing.entry_point
            with _first_compiler(index):
                return compile_(self, sig)

    compile._scanforest_lock = True
    compile.__doc__ = compile_.__doc__
    Dispatcher.compile = compile
    return True


install_compile_lock()
