"""Frame arrays as the motion kernels take them (shared by :mod:`.optical_flow` and :mod:`.tracking`)."""
from __future__ import annotations

import numpy as np

from ..backend import array_module, is_cupy
from ..errors import InputError


def as_frames(a, name: str):
    """Array of frames with a channel axis: (N, H, W, C), plus whether it was a single frame."""
    if a is None:
        raise InputError(f"{name} is missing")
    if not is_cupy(a):
        a = np.asarray(a)
    if a.dtype == bool or a.dtype.kind not in "uif":
        raise InputError(f"{name} must be an integer or float image array, got dtype {a.dtype}")
    if a.ndim == 2:
        return a[None, :, :, None], True
    if a.ndim == 3:
        if a.shape[-1] in (1, 3):
            return a[None], True
        if a.shape[-1] in (2, 4):
            raise InputError(f"{name}: frames must have 1 (grey) or 3 (RGB) channels, got "
                             f"shape {tuple(a.shape)} (drop an alpha channel first)")
        return a[..., None], False          # (N, H, W) grey frames
    if a.ndim == 4:
        if a.shape[-1] not in (1, 3):
            raise InputError(f"{name}: frames must have 1 (grey) or 3 (RGB) channels, got "
                             f"shape {tuple(a.shape)} (drop an alpha channel first)")
        return a, False
    raise InputError(f"{name} must be (H, W), (H, W, C), (N, H, W) or (N, H, W, C); got shape "
                     f"{tuple(a.shape)}")


def check_finite(a, name: str) -> None:
    """One line naming ``name`` when float frames hold NaN or infinite values."""
    if a.dtype.kind == "f":
        xp = array_module(a)
        if not bool(xp.isfinite(a).all()):
            raise InputError(f"{name} contains NaN or infinite values")
