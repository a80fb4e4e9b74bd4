"""Local frames for georeferenced coordinates: every float32 stage computes near the origin.

A survey scan holds coordinates of 10^5-10^6 m (UTM): float32 spaces them 0.03-0.5 m apart,
more than a SHOT radius, so normals, keypoints, SHOT, ICP and verification would compute on
noise. Each scan (or scene given to :func:`~scanforest.kernels.recognition.recognize`) gets an
*origin*, chosen in float64 (:func:`choose_origin`), and the stages compute on ``points -
origin``, subtracted in float64 before the cast to float32 (:func:`to_local`); poses go back to
the caller's coordinates by adding the origin to their translation (:func:`pose_to_global`).

Rule: coordinates whose largest magnitude is below :data:`LOCAL_LIMIT` (float32 spacing at most
2^-14 m, 0.06 mm) keep the origin ``[0, 0, 0]``, so small scans compute exactly as before; others
take the file's own offset where it has one and it lies within :data:`LOCAL_LIMIT` of every
point (LAS header offsets), else the bounding-box centre rounded to 1 m.

:func:`check_spacing` refuses coordinates that stay too coarse after the shift (a scan many
kilometres across) for the radii in use: float32 spacing above :data:`SPACING_FRACTION` of the
smallest radius.
"""
from __future__ import annotations

import numpy as np

from .errors import InputError

__all__ = ["GRID_FRACTION", "GRID_HINT_FRACTION", "LOCAL_LIMIT", "SAMPLING", "SPACING_FRACTION", "ZERO", "check_spacing", "grid_hint", "choose_origin", "is_zero", "localize",
           "pose_to_global", "spacing", "to_local"]

#: coordinates below this magnitude (m) keep origin 0: float32 spacing there is <= 2^-14 m
LOCAL_LIMIT = 1024.0
#: the float32 spacing of the coordinates a stage uses must be at most this fraction of its
#: smallest radius
SPACING_FRACTION = 0.01
#: a file's coordinate grid (a LAS/LAZ scale: its points are integers times it) must be at most
#: this fraction of the smallest radius a stage measures shapes with (:data:`SAMPLING` excepted).
#: PCL's tutorial scene (points 1.4 mm apart) snapped to a 1 mm grid still gave its detection with
#: the default radii (descriptor 2 cm, frame 1.5 cm); on 1.2, 1.5, 2, 3, 4, 6 and 10 mm grids it
#: gave none, with no word (2026-12-07). A grid as coarse as the points' spacing loses the shapes
#: too; this refuses only the grids coarse against the radii, which fail whatever the data
GRID_FRACTION = 0.1
#: a grid from this fraction of the smallest shape radius up (and under :data:`GRID_FRACTION`) is
#: named where recognition found nothing (:func:`grid_hint`): PCL's scene on a 1 mm grid (1/15 of
#: its 1.5 cm frame radius) kept its detection, on 1.2 mm (1/12.5) it lost it
GRID_HINT_FRACTION = 0.05
#: the radii that are sampling leaves, not the size of a shape measured: a grid does not disturb them
SAMPLING = frozenset({"keypoint_radius", "model_ss", "scene_ss", "cg_size"})
ZERO = (0.0, 0.0, 0.0)


def is_zero(origin) -> bool:
    return origin is None or not np.any(np.asarray(origin, np.float64))


def choose_origin(lo, hi, offset=None, radii: dict | None = None) -> np.ndarray:
    """The origin (float64, (3,)) of coordinates with bounding box ``lo``..``hi`` (float64).

    ``[0, 0, 0]`` where every coordinate is below :data:`LOCAL_LIMIT` in magnitude (with
    ``radii``, name -> length, when they also pass :func:`check_spacing` there, or would not about
    the box's centre either: a scene a few hundred metres out is moved); else ``offset`` (the
    file's own, e.g. LAS header offsets) where it is within :data:`LOCAL_LIMIT` of the whole box;
    else the box's centre rounded to 1 m."""
    lo = np.asarray(lo, np.float64).reshape(3)
    hi = np.asarray(hi, np.float64).reshape(3)
    far = max(np.abs(lo).max(), np.abs(hi).max())
    if far < LOCAL_LIMIT and (radii is None or _fits(far, radii) or not _fits((hi - lo).max() / 2.0, radii)):
        return np.zeros(3)
    if offset is not None:
        off = np.asarray(offset, np.float64).reshape(3)
        if np.isfinite(off).all() and max(np.abs(lo - off).max(), np.abs(hi - off).max()) < LOCAL_LIMIT:
            return off + 0.0  # no -0.0
    return np.round((lo + hi) / 2.0) + 0.0


def to_local(points, origin, xp=np):
    """``points - origin`` as float32, subtracted in float64 (numpy or CuPy ``xp``); the points
    as float32, unshifted, when ``origin`` is zero (exactly what the stages took before)."""
    if is_zero(origin):
        return xp.ascontiguousarray(points, dtype=xp.float32)
    o = xp.asarray(np.asarray(origin, np.float64).reshape(1, 3))
    return xp.ascontiguousarray(xp.asarray(points, dtype=xp.float64) - o, dtype=xp.float32)


def localize(*arrays):
    """The kernels' own local frame for float64 input (``normals``, ``keypoints``, ``shot``):
    ``(arrays, origin)``. When any of ``arrays`` (None skipped) is a float64 (N, 3) array whose
    coordinates reach :data:`LOCAL_LIMIT`, all of them are shifted by :func:`choose_origin` of
    their common bounding box, in float64, before the kernels cast them to float32 (which spaces
    coordinates of 10^6 m 0.06 m apart: normals, keypoints and SHOT of such clouds were NaN or
    noise); ``origin`` is then that shift (the caller moves anything else in the same frame,
    e.g. a viewpoint), else None and the arrays are returned as given. Results that do not
    depend on where the cloud lies (normals, descriptors, indices) need no shift back. float32
    input is taken as given: its precision was lost before the call."""
    arrays = tuple(_as_array(a) for a in arrays)
    wide = [a for a in arrays if a is not None and getattr(a, "dtype", None) == np.float64
            and getattr(a, "ndim", 0) == 2 and a.shape[0] and a.shape[1] == 3]
    if not wide:
        return arrays, None
    from .backend import array_module, to_numpy

    lo = np.min([to_numpy(a.min(axis=0)) for a in wide], axis=0)
    hi = np.max([to_numpy(a.max(axis=0)) for a in wide], axis=0)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        return arrays, None  # NaN / inf rows: the kernels' own checks name them
    origin = choose_origin(lo, hi)
    if is_zero(origin):
        return arrays, None
    shifted = tuple(None if a is None or getattr(a, "ndim", 0) != 2 or a.shape[-1] != 3
                    else to_local(a, origin, array_module(a)) for a in arrays)
    return shifted, origin


def _as_array(a):
    """A list or tuple of coordinates as a float64 array (as the kernels' checks would read it);
    anything else, or what numpy cannot read as numbers, as given (the checks then name it)."""
    if isinstance(a, (list, tuple)):
        try:
            return np.asarray(a, np.float64)
        except (TypeError, ValueError):
            return a
    return a


def pose_to_global(pose, origin) -> np.ndarray:
    """A model -> local-frame pose (4x4) as a model -> caller-coordinates pose (float64): its
    translation plus the origin."""
    out = np.array(pose, np.float64)
    if not is_zero(origin):
        out[:3, 3] += np.asarray(origin, np.float64).reshape(3)
    return out


def spacing(max_abs: float) -> float:
    """The float32 spacing (m) of coordinates up to ``max_abs`` in magnitude."""
    return float(np.spacing(np.float32(abs(max_abs))))


def _fits(max_abs: float, radii: dict) -> bool:
    """Whether float32 spacing at ``max_abs`` is within :data:`SPACING_FRACTION` of the smallest
    of ``radii`` (None values skipped; no radius: it fits)."""
    given = [float(v) for v in radii.values() if v is not None]
    return not given or spacing(max_abs) <= SPACING_FRACTION * min(given)


def grid_hint(grid: float | None, radii: dict) -> str | None:
    """Where a run found nothing: a phrase naming the file grid ``grid`` (a LAS scale) when it is
    at least :data:`GRID_HINT_FRACTION` of the smallest shape radius of ``radii`` (a grid that
    :func:`check_spacing` lets pass can still be as coarse as the points' spacing); else None."""
    shapes = {k: float(v) for k, v in radii.items()
              if v is not None and k.lstrip("-").replace("-", "_") not in SAMPLING}
    if grid is None or not shapes or not np.isfinite(grid):
        return None
    name = min(shapes, key=shapes.get)
    if grid < GRID_HINT_FRACTION * shapes[name]:
        return None
    return (f"their coordinates lie on a {grid:g} m grid (the file's scale), 1/{shapes[name] / grid:.0f} of the "
            f"smallest radius ({name} {shapes[name]:g} m): a grid as coarse as the points' spacing loses the shapes "
            f"the descriptors measure")


def check_spacing(max_abs: float, radii: dict, what: str, span=None, grid: float | None = None) -> None:
    """Refuse coordinates (``max_abs``: their largest magnitude in the frame a stage computes
    in) whose float32 spacing exceeds :data:`SPACING_FRACTION` of the smallest of ``radii``
    (name -> length; None values are skipped): :class:`InputError`, one line naming ``what``
    and the numbers. ``span`` (a float, or a function giving it, called only then): half the
    largest side of the points' box; where the box itself would be fine about its own centre,
    the line says the coordinates lie far from their origin (give one near them) instead of
    asking to split the scan. ``grid``: the file's own coordinate step (a LAS scale), refused
    above :data:`GRID_FRACTION` of the smallest radius outside :data:`SAMPLING`."""
    given = {k: float(v) for k, v in radii.items() if v is not None}
    shapes = {k: v for k, v in given.items() if k.lstrip("-").replace("-", "_") not in SAMPLING}  # or as options
    if grid is not None and shapes and np.isfinite(grid):
        name = min(shapes, key=shapes.get)
        if grid > GRID_FRACTION * shapes[name]:
            raise InputError(f"{what}: its coordinates are stored on a {grid:g} m grid (the file's scale), more than "
                             f"1/{round(1 / GRID_FRACTION)} of the smallest radius ({name} {shapes[name]:g} m): the "
                             f"points cannot carry the shapes its descriptors measure; use radii of at least "
                             f"{grid / GRID_FRACTION:g} m, or a file written with a finer scale")
    if not given or not np.isfinite(max_abs):
        return
    name = min(given, key=given.get)
    step = spacing(max_abs)
    if step > SPACING_FRACTION * given[name]:
        half = span() if callable(span) else span
        if half is not None and _fits(half, given):
            advice = (f"the points lie far from the origin they are computed about (their box is {2 * half:.3g} m "
                      f"across): give them an origin near them (recognize's origin=, a sidecar origin, a LAS offset) "
                      f"or float64 coordinates")
        else:
            advice = ("the scan is too large in extent for these radii (split it into tiles), or in another unit "
                      "than the radii and the models (millimetres against metres?)")
        raise InputError(f"{what}: coordinates up to {max_abs:.6g} m from the local origin have float32 spacing "
                         f"{step:.3g} m, more than 1/{round(1 / SPACING_FRACTION)} of the smallest radius "
                         f"({name} {given[name]:g} m); {advice}")
