"""Optical-flow accuracy measures and the colour-wheel visualisation (pure compute, numpy).

Definitions follow Baker, Scharstein, Lewis, Roth, Black & Szeliski, "A Database and Evaluation
Methodology for Optical Flow" (IJCV 92, 2011), the Middlebury benchmark:

* **endpoint error** ``EE = sqrt((u - u_GT)^2 + (v - v_GT)^2)`` (pixels), averaged over the
  evaluated pixels: the *average endpoint error* (EPE);
* **angular error** ``AE = arccos((1 + u u_GT + v v_GT) / (sqrt(1 + u^2 + v^2) sqrt(1 + u_GT^2 +
  v_GT^2)))`` (degrees): the angle between the space-time vectors ``(u, v, 1)`` and
  ``(u_GT, v_GT, 1)``, averaged the same way;
* the **colour coding** of their ``flowToColor.m``/``computeColor.m``: hue from the flow
  direction on a 55-colour Munsell-like wheel (RY 15, YG 6, GC 4, CB 11, BM 13, MR 6),
  saturation from the magnitude normalised by the largest magnitude of the field (or a given
  ``max_flow``), magnitudes beyond the normalisation darkened to 75 %. Unknown pixels (NaN, or
  ``valid == False``) are black.

:func:`png_bytes` encodes an RGB/grey ``uint8`` image as PNG with the standard library only
(zlib), so the visualisation needs no imaging package.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import asdict, dataclass

import numpy as np

from ..backend import to_numpy
from ..errors import InputError

__all__ = ["FlowErrors", "endpoint_error", "angular_error", "flow_errors", "colour_wheel",
           "flow_to_rgb", "png_bytes"]


@dataclass
class FlowErrors:
    """Accuracy of one estimated flow field against the ground truth."""

    epe: float            # average endpoint error over the evaluated pixels (px)
    ae: float             # average angular error over the evaluated pixels (degrees)
    epe_all: float        # EPE over every pixel with ground truth, unclassified ones included
    ae_all: float
    coverage: float       # fraction of the ground-truth pixels that are classified (valid)
    n: int                # evaluated (valid) pixels
    outliers_3px: float   # fraction of valid pixels with EE > 3 px

    def as_dict(self) -> dict:
        return asdict(self)


def _pair(flow, gt):
    f = np.asarray(to_numpy(flow), np.float64)
    g = np.asarray(to_numpy(gt), np.float64)
    if f.shape != g.shape or f.shape[-1] != 2:
        raise InputError(f"flow {f.shape} and ground truth {g.shape} must both be (..., 2) "
                         "and of equal shape")
    return f, g


def endpoint_error(flow, gt) -> np.ndarray:
    """Per-pixel endpoint error ``|flow - gt|`` (float64, shape without the last axis)."""
    f, g = _pair(flow, gt)
    return np.hypot(f[..., 0] - g[..., 0], f[..., 1] - g[..., 1])


def angular_error(flow, gt) -> np.ndarray:
    """Per-pixel angular error in degrees (Baker et al. 2011, eq. 1)."""
    f, g = _pair(flow, gt)
    num = 1.0 + f[..., 0] * g[..., 0] + f[..., 1] * g[..., 1]
    den = np.sqrt(1.0 + f[..., 0] ** 2 + f[..., 1] ** 2) * np.sqrt(1.0 + g[..., 0] ** 2 + g[..., 1] ** 2)
    return np.degrees(np.arccos(np.clip(num / den, -1.0, 1.0)))


def flow_errors(flow, gt, valid=None, mask=None) -> FlowErrors:
    """EPE / AE of ``flow`` against ``gt`` on the valid pixels, and on all of them.

    Parameters
    ----------
    flow, gt : (..., H, W, 2)
    valid : (..., H, W) bool, optional
        Pixels the method classified (passed its change test); default: all finite ones.
    mask : (..., H, W) bool, optional
        Pixels to evaluate at all (default: every pixel whose ground truth is finite).
    """
    f, g = _pair(flow, gt)
    known = np.isfinite(g).all(axis=-1)
    if mask is not None:
        known &= np.asarray(to_numpy(mask), bool)
    fin = np.isfinite(f).all(axis=-1)
    v = fin if valid is None else (np.asarray(to_numpy(valid), bool) & fin)
    ev = known & v
    ee = endpoint_error(np.where(fin[..., None], f, 0.0), g)
    ae = angular_error(np.where(fin[..., None], f, 0.0), g)
    n_known = int(known.sum())
    n = int(ev.sum())
    if n_known == 0:
        raise InputError("no pixel with a finite ground truth to evaluate")
    nan = float("nan")
    return FlowErrors(
        epe=float(ee[ev].mean()) if n else nan,
        ae=float(ae[ev].mean()) if n else nan,
        epe_all=float(ee[known].mean()),
        ae_all=float(ae[known].mean()),
        coverage=n / n_known,
        n=n,
        outliers_3px=float((ee[ev] > 3.0).mean()) if n else nan,
    )


def colour_wheel() -> np.ndarray:
    """The (55, 3) float64 colour wheel of Baker et al. (0..255), RY YG GC CB BM MR."""
    RY, YG, GC, CB, BM, MR = 15, 6, 4, 11, 13, 6
    wheel = np.zeros((RY + YG + GC + CB + BM + MR, 3))
    c = 0
    wheel[c:c + RY, 0] = 255
    wheel[c:c + RY, 1] = np.floor(255 * np.arange(RY) / RY)
    c += RY
    wheel[c:c + YG, 0] = 255 - np.floor(255 * np.arange(YG) / YG)
    wheel[c:c + YG, 1] = 255
    c += YG
    wheel[c:c + GC, 1] = 255
    wheel[c:c + GC, 2] = np.floor(255 * np.arange(GC) / GC)
    c += GC
    wheel[c:c + CB, 1] = 255 - np.floor(255 * np.arange(CB) / CB)
    wheel[c:c + CB, 2] = 255
    c += CB
    wheel[c:c + BM, 2] = 255
    wheel[c:c + BM, 0] = np.floor(255 * np.arange(BM) / BM)
    c += BM
    wheel[c:c + MR, 2] = 255 - np.floor(255 * np.arange(MR) / MR)
    wheel[c:c + MR, 0] = 255
    return wheel


def flow_to_rgb(flow, valid=None, max_flow: float | None = None) -> np.ndarray:
    """Colour-wheel image (H, W, 3) uint8 of a flow field (H, W, 2).

    ``max_flow`` fixes the magnitude normalisation (e.g. to compare fields); by default the
    largest magnitude among the known pixels. Pixels with ``valid == False`` or a NaN flow are
    black.
    """
    f = np.asarray(to_numpy(flow), np.float64)
    if f.ndim != 3 or f.shape[-1] != 2:
        raise InputError(f"flow must have shape (H, W, 2), got {f.shape}")
    unknown = ~np.isfinite(f).all(axis=-1)
    if valid is not None:
        vm = np.asarray(to_numpy(valid), bool)
        if vm.shape != f.shape[:2]:
            raise InputError(f"valid {vm.shape} does not match the flow {f.shape[:2]}")
        unknown |= ~vm
    u = np.where(unknown, 0.0, f[..., 0])
    v = np.where(unknown, 0.0, f[..., 1])
    rad = np.hypot(u, v)
    if max_flow is None:
        max_flow = float(rad[~unknown].max()) if (~unknown).any() else 0.0
    scale = 1.0 / (max_flow + np.finfo(float).eps)
    u, v, rad = u * scale, v * scale, rad * scale
    wheel = colour_wheel()
    ncols = len(wheel)
    a = np.arctan2(-v, -u) / np.pi
    fk = (a + 1.0) / 2.0 * (ncols - 1)
    k0 = np.floor(fk).astype(np.int64)
    k1 = k0 + 1
    k1[k1 == ncols] = 0
    frac = (fk - k0)[..., None]
    col = ((1.0 - frac) * wheel[k0] + frac * wheel[k1]) / 255.0
    inside = (rad <= 1.0)[..., None]
    col = np.where(inside, 1.0 - rad[..., None] * (1.0 - col), col * 0.75)
    img = np.floor(255.0 * col * (~unknown)[..., None])
    return np.clip(img, 0, 255).astype(np.uint8)


def png_bytes(image) -> bytes:
    """PNG encoding of a (H, W, 3) RGB or (H, W) grey uint8 image (zlib only, no imaging package)."""
    img = np.asarray(to_numpy(image))
    if img.dtype != np.uint8 or img.ndim not in (2, 3) or (img.ndim == 3 and img.shape[2] != 3):
        raise InputError(f"png_bytes needs a (H, W, 3) or (H, W) uint8 image, got {img.shape} {img.dtype}")
    h, w = img.shape[:2]
    if h == 0 or w == 0:
        raise InputError("cannot encode an empty image")
    colour_type = 2 if img.ndim == 3 else 0
    rows = img.reshape(h, -1)
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rows], axis=1).tobytes()  # filter 0 per row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b""))
