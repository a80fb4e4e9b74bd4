"""Input checks shared by every kernel family: one place that says what a point array is.

Every public kernel validates its inputs here before any work starts, and raises
:class:`~scanforest.kernels.errors.InputError` with a message that names the argument, the
rule and the offending value (never an ``assert``: the checks survive ``python -O``).
Arrays stay on their own device: a CuPy array is checked with CuPy, without a host copy.
"""
from __future__ import annotations

import math

import numpy as np

from .backend import array_module, to_numpy
from .errors import InputError

__all__ = ["integer", "points", "positive", "nonfinite_rows", "unit_normals"]


def points(a, name: str, *, dims=3, allow_empty: bool = False, finite: bool = True,
           dtype=np.float32, keep_half: bool = False, rows: int | None = None, xp=None):
    """Check an ``(N, d)`` point array and return it C-contiguous on its own device.

    Parameters
    ----------
    a : array-like (numpy, CuPy or anything ``np.asarray`` takes)
    name : str
        The argument's name in messages.
    dims : int, tuple of int or None
        Allowed numbers of columns (``None``: any d >= 1).
    allow_empty : bool
        Accept 0 rows.
    finite : bool
        Reject rows with NaN or inf (the message counts them and names the first).
    dtype : numpy dtype or None
        Cast to this dtype (``None`` keeps a float32 or float64 input's dtype; float16 becomes
        float32, integers float64).
    keep_half : bool
        A float16 input stays float16 (the GPU brute force reads half rows as they are).
    rows : int, optional
        The number of rows the array must have (e.g. normals beside their points).
    xp : module, optional
        The array module to check with (default: the one of ``a``).
    """
    if a is None:
        raise InputError(f"{name} is None")
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        try:
            a = np.asarray(a, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{name} is not a numeric array: {exc}") from None
    if xp is None:
        xp = array_module(a)
    if a.ndim != 2:
        raise InputError(f"{name} must be a 2-D array (n_points, n_dims), got shape {tuple(a.shape)}")
    n, d = a.shape
    if dims is not None:
        allowed = (int(dims),) if isinstance(dims, (int, np.integer)) else tuple(dims)
        if d not in allowed:
            want = " or ".join(f"(N, {k})" for k in allowed)
            raise InputError(f"{name} must have shape {want}, got {tuple(a.shape)}")
    elif d == 0:
        raise InputError(f"{name} has 0 dimensions (shape {tuple(a.shape)})")
    if n == 0 and not allow_empty:
        raise InputError(f"{name} is empty (0 points)")
    if rows is not None and n != rows:
        raise InputError(f"{name} has {n} rows, expected {rows}")
    if a.dtype.kind not in "fiub":
        raise InputError(f"{name} must hold real numbers, got dtype {a.dtype}")
    if keep_half and a.dtype == np.float16:
        a = xp.ascontiguousarray(a)
    elif dtype is not None:
        a = xp.ascontiguousarray(a, dtype=dtype)
    else:
        keep = a.dtype.kind == "f" and a.dtype.itemsize >= 4  # float16 (no kernel reads it): float32
        a = xp.ascontiguousarray(a, dtype=a.dtype if keep else xp.float32 if a.dtype.kind == "f" else xp.float64)
    if finite and n:
        bad = nonfinite_rows(a, xp)
        if bool(bad.any()):
            first = to_numpy(xp.nonzero(bad)[0][:5]).tolist()
            raise InputError(f"{name} has {int(bad.sum())} row(s) with NaN or inf values (first: {first}); "
                             f"drop them first (e.g. points[np.isfinite(points).all(1)])")
    return a


def nonfinite_rows(a, xp=None, nbytes: int = 1 << 28):
    """Boolean mask of the rows of ``a`` with a NaN or inf, computed in blocks of about
    ``nbytes`` (no temporary the size of ``a``: a 50M x 352 float16 shard is 35 GB);
    float16 is checked on its exponent bits."""
    if xp is None:
        xp = array_module(a)
    n, d = a.shape
    out = xp.zeros(n, dtype=bool)
    if n == 0:
        return out
    step = max(1, int(nbytes) // max(d * a.itemsize, 1))
    for s in range(0, n, step):
        blk = a[s:s + step]
        if blk.dtype == np.float16:  # exponent all ones = inf or NaN
            out[s:s + step] = ((blk.view(xp.uint16) & 0x7C00) == 0x7C00).any(axis=1)
        elif blk.dtype.kind == "f":
            out[s:s + step] = ~xp.isfinite(blk).all(axis=1)
    return out


def unit_normals(n, name: str, tol: float = 1e-3):
    """InputError unless every row of the (N, 3) ``n`` that is not NaN has length 1 within
    ``tol`` (NaN rows mark points without a normal; an infinite or zero row is refused): a
    descriptor's binning reads the normals as unit vectors, and longer or shorter ones changed
    SHOT's histograms silently."""
    xp = array_module(n)
    if int(n.shape[0]) == 0:
        return
    n2 = (n * n).sum(axis=1)  # squared lengths, in the array's own float type
    bad = ~xp.isnan(n2) & (xp.abs(n2 - 1) > 2 * tol)
    if bool(bad.any()):
        i = int(xp.flatnonzero(bad)[0])
        raise InputError(f"{name} must be unit vectors: row {i} has length {math.sqrt(float(n2[i])):.4g} "
                         f"(normalise them, n / |n|; NaN rows mark points without a normal)")


def integer(x, name: str, *, minimum: int = 1, none: bool = False):
    """``x`` as an int of at least ``minimum`` (None passes with ``none``); a bool, a float or a
    string is an InputError, not read as a count."""
    if x is None and none:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise InputError(f"{name} must be an integer >= {minimum}{' or None' if none else ''}, got {x!r}")
    if x < minimum:
        raise InputError(f"{name} must be >= {minimum} (an integer >= {minimum}{' or None' if none else ''}), got {x!r}")
    return int(x)


def positive(x, name: str, *, finite: bool = True, integer: bool = False):
    """``x`` as a positive float (or int with ``integer``); InputError otherwise."""
    try:
        v = int(x) if integer else float(x)
        if integer and v != float(x):
            raise ValueError
    except (TypeError, ValueError):
        kind = "integer" if integer else "number"
        raise InputError(f"{name} must be a positive {kind}, got {x!r}") from None
    if not (v > 0) or (finite and not math.isfinite(v)):
        raise InputError(f"{name} must be a positive{' finite' if finite else ''} number, got {x!r}")
    return v
