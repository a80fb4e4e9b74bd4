"""Dense motion for image sequences in the store: frames in, (H, W, 2) flow per pair out.

Layout, beside ``scans/`` in the same Zarr v3 store (``ScanStore`` leaves other top-level
groups alone)::

    STORE/sequences/<seq_id>/           attrs: source, files, sha256, n_frames, height, width,
                                               channels, dtype, ingested_at, complete (set last)
        frames        (T, H, W, C) uint8 | uint16 | float32, one chunk per frame
        tracks/<t>    (M, 4) float32 caller-given tracks of pair t (x0, y0, x1, y1), optional
        flow/<method>/<t>/              one group per frame pair t -> t + 1 (t zero-padded, 6
                                        digits); attrs: params, n_features, coverage, device,
                                        seconds, written, complete (set last)
            flow      (H, W, 2) float32 u, v (the method's estimate everywhere)
            valid     (H, W) bool       pixels that passed the change test
            label     (H, W) int32      Method 2: index into ``labels``
            labels    (L, 2) int32      Method 2: the discretised flow space of the pair

The ``flow`` groups and arrays hold flow *fields* (the standard term) and keep that name: a store
written before the subsystem was called motion reads as it is.

Idempotency: a pair is done when its group is complete with the same parameters; the work
unit :func:`motion_pairs` skips those, writes each remaining pair into its own group (so Dask
workers never share a group) and marks it complete after the arrays and its colour-wheel PNG
are written. Frames come from a folder of PNG/TIFF/JPEG (Pillow) or NPY files, sorted in
natural order (``f2`` before ``f10``).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from scanforest.kernels.errors import InputError, ScanforestError, ScanReadError

from .store import ScanStore, _jsonable, scan_id_for

FRAME_EXTS = (".png", ".tif", ".tiff", ".jpg", ".jpeg", ".bmp", ".npy")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _natural_key(p: Path):
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", p.name)]


def list_frames(folder: str | Path) -> list[Path]:
    """Frame files of a folder (by extension), in natural order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder of frames")
    files = sorted((p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in FRAME_EXTS),
                   key=_natural_key)
    return files


def check_frame(path: str | Path) -> None:
    """A frame's header is readable (an ``.npy`` array's, an image's through Pillow, which reads
    the header only): the cheap look a run takes at every frame before a cluster starts, so that
    a file that is not an image is one line at once instead of a failed task."""
    path = Path(path)
    if path.suffix.lower() == ".npy":
        try:
            np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as exc:
            raise ScanReadError(path, f"not a readable .npy array: {exc}") from exc
        return
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - the read says it, as it always did
        return
    try:
        with Image.open(path):
            pass
    except Exception as exc:
        raise ScanReadError(path, f"not a readable image: {exc}") from exc


def read_frame(path: str | Path) -> np.ndarray:
    """One frame as (H, W) or (H, W, 3): NPY via numpy, images via Pillow (RGBA -> RGB)."""
    path = Path(path)
    if not path.is_file():
        raise ScanReadError(path, "file not found")
    if path.suffix.lower() == ".npy":
        try:
            a = np.load(path, allow_pickle=False)
        except Exception as exc:
            raise ScanReadError(path, f"not a readable .npy array: {exc}") from exc
    else:
        try:
            from PIL import Image
        except ImportError as exc:  # pragma: no cover - Pillow comes with matplotlib
            raise ScanReadError(path, "reading images needs Pillow (pip install pillow)") from exc
        try:
            with Image.open(path) as im:
                if im.mode in ("RGBA", "LA", "P", "CMYK", "YCbCr", "HSV", "LAB"):
                    im = im.convert("RGB")
                a = np.asarray(im)
        except Exception as exc:
            raise ScanReadError(path, f"not a readable image: {exc}") from exc
    if a.ndim == 3 and a.shape[2] == 4:
        a = a[..., :3]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (1, 3)) or a.size == 0:
        raise ScanReadError(path, f"expected an (H, W) or (H, W, 3) image, got shape {a.shape}")
    if a.dtype.kind not in "uif" or a.dtype == bool:
        raise ScanReadError(path, f"unsupported pixel type {a.dtype}")
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[..., 0]
    return a


class UserError:
    """A user error (:class:`ScanforestError`) raised by a unit of work on a Dask worker,
    returned as a value by :func:`catching_user_errors` so that the worker does not log it as a
    failed computation (with its traceback, on the command's terminal) and the caller re-raises
    it (:meth:`reraise`) as one line. Carries the class, ``args`` and attributes, so exceptions
    whose ``__init__`` takes other arguments than ``args`` (:class:`ScanReadError`) come back
    whole."""

    def __init__(self, exc: ScanforestError):
        self.cls, self.args, self.state = type(exc), exc.args, dict(exc.__dict__)

    def exception(self) -> ScanforestError:
        exc = self.cls.__new__(self.cls)
        exc.args = self.args
        exc.__dict__.update(self.state)
        return exc

    def reraise(self):
        raise self.exception()


def catching_user_errors(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or a :class:`UserError` when it raises a user error."""
    try:
        return fn(*args, **kwargs)
    except ScanforestError as exc:
        return UserError(exc)


def sequences(store: str | ScanStore, *, include_incomplete: bool = False) -> list[str]:
    """Ids of the (completely written) sequences of a store."""
    st = store if isinstance(store, ScanStore) else ScanStore(store, mode="r")
    return st.catalog.sequences(include_incomplete=include_incomplete)


def write_sequence(store: str | ScanStore, seq_id: str, frames, *, tracks=None,
                   attrs: dict | None = None) -> dict[str, Any]:
    """Write frames ``(T, H, W[, C])`` (and optional per-pair tracks) as sequence ``seq_id``.

    Replaces an existing sequence of that id; ``complete`` is set after every array.
    """
    st = store if isinstance(store, ScanStore) else ScanStore(store, create=True)
    fr = np.asarray(frames)
    if fr.ndim == 3:
        fr = fr[..., None]
    if fr.ndim != 4 or fr.shape[-1] not in (1, 3):
        raise InputError(f"frames must be (T, H, W) or (T, H, W, 1|3), got {fr.shape}")
    if fr.shape[0] < 2:
        raise InputError(f"a sequence needs at least 2 frames, got {fr.shape[0]}")
    if fr.dtype.kind == "f":
        if not np.isfinite(fr).all():
            raise InputError(f"sequence {seq_id!r}: frames contain NaN or infinite values")
        fr = fr.astype(np.float32)
    elif fr.dtype not in (np.uint8, np.uint16):
        fr = fr.astype(np.float32)
    if tracks is not None and len(tracks) != fr.shape[0] - 1:
        raise InputError(f"{fr.shape[0]} frames make {fr.shape[0] - 1} pairs but {len(tracks)} "
                         "track arrays were given")
    with st.catalog.new_sequence(seq_id) as g:  # in place of the old one once whole
        t, h, w, c = fr.shape
        g.attrs.update(_jsonable({**(attrs or {}), "n_frames": t, "height": h, "width": w,
                                  "channels": c, "dtype": str(fr.dtype), "ingested_at": _now(),
                                  "complete": False}))
        z = g.create_array("frames", shape=fr.shape, dtype=fr.dtype, chunks=(1, h, w, c))
        z[...] = fr
        if tracks is not None:
            tg = g.create_group("tracks")
            for i, tr in enumerate(tracks):
                a = np.asarray(tr, np.float32)
                if a.ndim != 2 or a.shape[1] != 4:
                    raise InputError(f"tracks of pair {i} must be (M, 4), got {a.shape}")
                tg.create_array(f"{i:06d}", shape=a.shape, dtype=np.float32,
                                chunks=(max(1, a.shape[0]), 4))[...] = a
        g.attrs["complete"] = True
    return {"seq_id": seq_id, "frames": t, "height": h, "width": w, "channels": c}


def ingest_sequence(store: str, source: str, seq_id: str | None = None, *,
                    tracks_dir: str | None = None, force: bool = False) -> dict[str, Any]:
    """A folder of frames (PNG/TIFF/JPEG/NPY) -> sequence ``seq_id`` (default: the folder name).

    Skipped when the sequence exists, is complete and came from the same bytes (sha256 over
    the files in order). ``tracks_dir``: a folder of ``.npy`` (M, 4) tracks, one per pair, in
    natural order.
    """
    t0 = time.perf_counter()
    files = list_frames(source)
    if len(files) < 2:
        raise InputError(f"{source}: a sequence needs at least 2 frames, found {len(files)} "
                         f"(extensions {', '.join(FRAME_EXTS)})")
    sid = seq_id or scan_id_for(Path(source).resolve().name)
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    sha = h.hexdigest()
    st = ScanStore(store, create=True)  # frames are ingested: this creates the store
    if not force and (st.catalog.find_sequence(sid) or {}).get("sha256") == sha:
        return {"seq_id": sid, "status": "skipped", "frames": len(files),
                "seconds": time.perf_counter() - t0}
    frames = [read_frame(f) for f in files]
    shapes = {f.shape for f in frames}
    if len(shapes) != 1:
        first = frames[0].shape
        i = next(i for i, f in enumerate(frames) if f.shape != first)
        raise InputError(f"{source}: frames differ in size ({files[0].name} {first} vs "
                         f"{files[i].name} {frames[i].shape})")
    dtypes = {f.dtype for f in frames}
    if len(dtypes) != 1:
        raise InputError(f"{source}: frames differ in pixel type ({sorted(map(str, dtypes))})")
    tracks = None
    if tracks_dir:
        tf = sorted((p for p in Path(tracks_dir).iterdir() if p.suffix.lower() == ".npy"),
                    key=_natural_key)
        tracks = [np.load(p, allow_pickle=False) for p in tf]
    info = write_sequence(st, sid, np.stack(frames), tracks=tracks,
                          attrs={"source": str(Path(source).resolve()),
                                 "files": [f.name for f in files], "sha256": sha})
    return {**info, "status": "ingested", "seconds": time.perf_counter() - t0}


def read_frames(store: str | ScanStore, seq_id: str, start: int = 0, stop: int | None = None):
    st = store if isinstance(store, ScanStore) else ScanStore(store, mode="r")
    return st.catalog.sequence(seq_id)["frames"][start:stop]


def _pair_name(t: int) -> str:
    return f"{t:06d}"


def _params_key(method: str, params: dict, tracks: str, klt: dict | None = None) -> dict:
    """What a written pair was computed with; ``klt`` (tracker options, KLT pairs only) joins
    the key only when given, so keys of runs with the default tracker options are unchanged."""
    key = {"method": method, "tracks": tracks, **{k: params[k] for k in sorted(params)}}
    if klt:
        key["klt"] = {k: klt[k] for k in sorted(klt)}
    return _jsonable(key)


def pair_done(store: str | ScanStore, seq_id: str, t: int, method: str, key: dict | None = None) -> bool:
    st = store if isinstance(store, ScanStore) else ScanStore(store, mode="r")
    try:
        g = st.catalog.sequence(seq_id)
        pg = g["flow"][method][_pair_name(t)]
    except (KeyError, InputError):
        return False
    a = pg.attrs
    return bool(a.get("complete", False)) and (key is None or a.get("key") == key)


def check_trackable(store: str | ScanStore, seq_id: str, klt: dict | None = None) -> None:
    """Raise :class:`InputError` when pairs of ``seq_id`` without stored tracks cannot be tracked
    by the built-in tracker (frames smaller than its window, unknown ``klt`` options)."""
    from scanforest.kernels.motion.optical_flow import check_trackable as _check

    st = store if isinstance(store, ScanStore) else ScanStore(store, mode="r")
    g = st.catalog.sequence(seq_id)
    n_pairs = int(g.attrs["n_frames"]) - 1
    stored = g["tracks"] if "tracks" in g else None
    if stored is not None and all(_pair_name(t) in stored for t in range(n_pairs)):
        return
    try:
        _check(int(g.attrs["height"]), int(g.attrs["width"]), klt)
    except InputError as exc:
        raise InputError(f"sequence {seq_id!r}: {exc}") from None


def prepare_outputs(store: str, seq_id: str, methods) -> int:
    """Create the ``flow/<method>`` groups once (before parallel writers); returns T - 1."""
    st = ScanStore(store)
    g = st.catalog.sequence(seq_id)
    fg = g.require_group("flow")
    for m in methods:
        fg.require_group(m)
    return int(g.attrs["n_frames"]) - 1


def motion_pairs(store: str, seq_id: str, pairs: list[int], *, method: str = "hypotheses",
                 params: dict | None = None, klt: dict | None = None, device: str = "auto",
                 png_dir: str | None = None, force: bool = False,
                 tracker: str = "builtin") -> list[dict[str, Any]]:
    """The (H, W, 2) flow fields of the pairs ``t -> t + 1`` for ``t`` in ``pairs`` of one
    sequence (idempotent).

    All pending pairs of the call run in one batched kernel launch. Tracks: the sequence's
    stored tracks for a pair when present, else KLT by ``tracker`` inside the flow call
    (``"builtin"``: :mod:`scanforest.kernels.motion.tracking` on the flow's device, the GPU
    tracker on a GPU; ``"opencv"``: the host reference). ``params``: keyword arguments of
    :func:`scanforest.kernels.motion.optical_flow.dense_flow` (sigma_c, sigma_x, sigma_f, tau, max_labels).
    One record per pair: status ``"written"`` or ``"skipped"``.
    """
    from scanforest.kernels.backend import resolve_device, to_numpy
    from scanforest.kernels.motion.metrics import flow_to_rgb, png_bytes
    from scanforest.kernels.motion.optical_flow import METHODS, TRACKERS, dense_flow

    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    if tracker not in TRACKERS:
        raise InputError(f"tracker must be one of {TRACKERS}, got {tracker!r}")
    t_start = time.perf_counter()
    params = dict(params or {})
    st = ScanStore(store)
    g = st.catalog.sequence(seq_id)
    n_pairs = int(g.attrs["n_frames"]) - 1
    bad = [t for t in pairs if not (0 <= int(t) < n_pairs)]
    if bad:
        raise InputError(f"sequence {seq_id!r} has pairs 0..{n_pairs - 1}; got {bad[:5]}")
    stored = g["tracks"] if "tracks" in g else None
    src = {t: ("stored" if stored is not None and _pair_name(t) in stored else f"klt-{tracker}")
           for t in pairs}
    keys = {t: _params_key(method, params, src[t], None if src[t] == "stored" else klt)
            for t in pairs}
    todo = [int(t) for t in pairs if force or not pair_done(st, seq_id, t, method, keys[t])]
    recs = [{"seq_id": seq_id, "pair": int(t), "method": method, "status": "skipped"}
            for t in pairs if int(t) not in todo]
    if not todo:
        return recs
    dev = resolve_device(device)
    frames = g["frames"]
    f0 = np.stack([frames[t] for t in todo])
    f1 = np.stack([frames[t + 1] for t in todo])
    tracks = [np.asarray(stored[_pair_name(t)][...], np.float32) if src[t] == "stored" else None
              for t in todo]                    # None: tracked inside dense_flow, on dev
    if dev == "gpu":
        import cupy as cp

        f0, f1 = cp.asarray(f0), cp.asarray(f1)
    t_flow = time.perf_counter()
    res = dense_flow(f0, f1, tracks, method=method, device=dev, klt=klt, tracker=tracker,
                     **params)
    flow, valid = to_numpy(res.flow), to_numpy(res.valid)
    label = None if res.label is None else to_numpy(res.label)
    t_flow = time.perf_counter() - t_flow
    fg = g.require_group("flow").require_group(method)
    for i, t in enumerate(todo):
        name = _pair_name(t)
        if name in fg:
            del fg[name]
        pg = fg.create_group(name)
        pg.attrs.update({"complete": False})
        h, w = flow.shape[1:3]
        pg.create_array("flow", shape=(h, w, 2), dtype=np.float32, chunks=(h, w, 2))[...] = flow[i]
        pg.create_array("valid", shape=(h, w), dtype=bool, chunks=(h, w))[...] = valid[i]
        if label is not None:
            pg.create_array("label", shape=(h, w), dtype=np.int32, chunks=(h, w))[...] = label[i]
            lab = np.asarray(res.labels[i], np.int32)
            pg.create_array("labels", shape=lab.shape, dtype=np.int32, chunks=lab.shape)[...] = lab
        png = None
        if png_dir:
            out = Path(png_dir) / seq_id / method
            out.mkdir(parents=True, exist_ok=True)
            png = out / f"{name}.png"
            tmp = png.with_suffix(".png.tmp")
            tmp.write_bytes(png_bytes(flow_to_rgb(flow[i], valid[i])))
            tmp.replace(png)
        cov = float(valid[i].mean())
        pg.attrs.update(_jsonable({"key": keys[t], "pair": [t, t + 1],
                                   "n_features": res.n_features[i], "coverage": cov,
                                   "device": dev, "seconds": t_flow / len(todo),
                                   "png": None if png is None else str(png),
                                   "params": res.params, "written": _now()}))
        pg.attrs["complete"] = True
        recs.append({"seq_id": seq_id, "pair": t, "method": method, "status": "written",
                     "n_features": res.n_features[i], "coverage": cov,
                     "seconds": (time.perf_counter() - t_start) / len(todo)})
    return sorted(recs, key=lambda r: r["pair"])


def read_flow(store: str | ScanStore, seq_id: str, t: int, method: str = "hypotheses"):
    """``(flow (H, W, 2) float32, valid (H, W) bool)`` of pair ``t``."""
    st = store if isinstance(store, ScanStore) else ScanStore(store, mode="r")
    if not pair_done(st, seq_id, t, method):
        raise InputError(f"{st.path}: no complete {method} flow for pair {t} of {seq_id!r}")
    pg = st.catalog.sequence(seq_id)["flow"][method][_pair_name(t)]
    return pg["flow"][...], pg["valid"][...]
