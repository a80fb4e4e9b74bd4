"""The in-memory scan every reader returns (:class:`PointCloud`), and the colour rule the
readers share (:func:`to_uint8`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class PointCloud:
    """A scan in memory.

    Attributes
    ----------
    points : (N, 3) float32 or float64
        Finite coordinates only.
    normals : (N, 3) float32 or None
    colors : (N, 3) uint8 or None
    intensity : (N,) float32 or None
    pixel_index : (N,) int64 or None
        For organised clouds: the row-major index of each kept point in the WIDTH x HEIGHT image.
    meta : dict
        ``format``, ``encoding``, ``width``, ``height``, ``viewpoint``, ``n_source_points`` ...
    extra : dict
        Other per-point fields the file carried (e.g. ``curvature``), each (N,) or (N, k).
    """

    points: np.ndarray
    normals: np.ndarray | None = None
    colors: np.ndarray | None = None
    intensity: np.ndarray | None = None
    pixel_index: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        """The shapes, checked (not the values: a reader drops non-finite rows as it reads):
        ``points`` (N, 3) and every per-point array N rows long."""
        from scanforest.kernels.errors import InputError

        self.points = np.asarray(self.points)
        if self.points.ndim != 2 or self.points.shape[1] != 3:
            raise InputError(f"PointCloud points must be an (N, 3) array, got shape {self.points.shape}")
        n = self.points.shape[0]
        for name in ("normals", "colors", "intensity", "pixel_index"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise InputError(f"PointCloud {name} has {len(v)} rows for {n} points")

    def __len__(self) -> int:
        return int(self.points.shape[0])

    @property
    def bbox(self) -> tuple[list[float], list[float]]:
        return self.points.min(0).tolist(), self.points.max(0).tolist()

    def arrays(self) -> dict[str, np.ndarray]:
        """Every per-point array by store name (points first)."""
        out = {"points": self.points}
        for name in ("normals", "colors", "intensity", "pixel_index"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out.update({f"extra_{k}": v for k, v in self.extra.items()})
        return out


def to_uint8(c: np.ndarray) -> np.ndarray:
    if np.issubdtype(c.dtype, np.floating):
        scale = 255.0 if c.size and float(np.nanmax(c)) <= 1.0 else 1.0
        return np.clip(np.rint(c * scale), 0, 255).astype(np.uint8)
    if c.size and int(c.max()) > 255:  # 16-bit colour (LAS, some PLY)
        return (c.astype(np.uint32) >> 8).astype(np.uint8)
    return c.astype(np.uint8)
