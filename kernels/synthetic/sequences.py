"""Synthetic image sequences with known dense optical flow (for tests and benchmarks).

Each sequence renders analytic colour textures (sums of oriented sinusoids and products of
sinusoids, so every sub-pixel location has an exact colour and KLT finds corners) through a
known motion, so the ground-truth flow of every pixel, and of any sub-pixel track, is exact:

``translation``
    the whole image moves by ``(dx, dy)`` pixels per frame;
``rotation``
    the image rotates by ``degrees`` per frame about the image centre;
``zoom``
    the image scales by ``scale`` per frame about the image centre;
``layers``
    two independently moving layers: a background translating by ``background`` and a
    foreground disc (radius ``radius`` x the shorter image side, with its own texture and a
    different palette) translating by ``foreground``. ``pole=True`` adds the paper's hard case
    (Kim et al., Fig. 4-5): a thin vertical bar moving with the foreground, in a grey palette
    that no tracked feature shares (closer in colour to the background than to the
    foreground), on which :func:`tracks_from_flow` puts no track.

Conventions: pixel ``(x, y)`` is column ``x``, row ``y`` (OpenCV's order), flow ``[..., 0]`` is
``u`` along x and ``[..., 1]`` is ``v`` along y, from frame ``t`` to frame ``t + 1``. Frames are
``uint8`` RGB (colour 0..255).

The layers carry different palettes (cool background, warm foreground): the flow paper's
colour-coherence assumption ("pixels of the same object have similar colours") holds by
construction, as it does for most real objects; the featureless pole is the case where the
tracked features do not sample every object.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError

__all__ = ["FlowSequence", "sequence", "tracks_from_flow", "KINDS"]

KINDS = ("translation", "rotation", "zoom", "layers")

_PALETTES = {
    "cool": (np.array([70.0, 115.0, 150.0]), np.array([0.9, 1.0, 1.0])),
    "warm": (np.array([195.0, 95.0, 55.0]), np.array([1.0, 0.8, 0.6])),
    "grey": (np.array([128.0, 128.0, 128.0]), np.array([1.0, 1.0, 1.0])),
}


class _Texture:
    """An analytic colour texture: base + luminance pattern + weak chroma pattern."""

    def __init__(self, rng: np.random.Generator, palette: str, wavelength: tuple[float, float],
                 n_waves: int = 10):
        self.base, self.lum = _PALETTES[palette]
        lo, hi = wavelength
        ang = rng.uniform(0, np.pi, n_waves)
        lam = np.exp(rng.uniform(np.log(lo), np.log(hi), n_waves))
        self.k = np.stack([np.cos(ang), np.sin(ang)], 1) * (2 * np.pi / lam)[:, None]
        self.phase = rng.uniform(0, 2 * np.pi, n_waves)
        # products sin(a x) sin(b y) give corners (KLT features) at every scale of the texture
        lam2 = np.exp(rng.uniform(np.log(lo), np.log(hi), (3, 2)))
        self.k2 = 2 * np.pi / lam2
        self.phase2 = rng.uniform(0, 2 * np.pi, (3, 2))
        lam3 = np.exp(rng.uniform(np.log(2 * lo), np.log(2 * hi), (3, 2)))
        self.kc = 2 * np.pi / lam3                       # chroma: one slow wave per channel
        self.phasec = rng.uniform(0, 2 * np.pi, (3, 2))

    def __call__(self, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
        # float32 phases: |phase| < ~2e3 rad at 1080p, error ~1e-4 rad, far below a colour level
        X = np.asarray(X, np.float32)
        Y = np.asarray(Y, np.float32)
        f = np.float32
        lum = np.zeros(X.shape, np.float32)
        for (kx, ky), ph in zip(self.k, self.phase):
            lum += np.sin(f(kx) * X + f(ky) * Y + f(ph))
        lum *= f(1.0 / np.sqrt(len(self.k) / 2.0))
        for (a, b), (pa, pb) in zip(self.k2, self.phase2):
            lum += f(0.8) * np.sin(f(a) * X + f(pa)) * np.sin(f(b) * Y + f(pb))
        lum = np.tanh(f(0.8) * lum)                      # -1..1, sharpened edges
        out = np.empty(X.shape + (3,), np.float32)
        for c in range(3):
            chroma = (np.sin(f(self.kc[c, 0]) * X + f(self.phasec[c, 0]))
                      * np.sin(f(self.kc[c, 1]) * Y + f(self.phasec[c, 1])))
            out[..., c] = f(self.base[c]) + f(60.0 * self.lum[c]) * lum + f(18.0) * chroma
        return out


@dataclass
class FlowSequence:
    """A rendered sequence with its ground truth.

    Attributes
    ----------
    frames : (T, H, W, 3) uint8
    flows : (T - 1, H, W, 2) float32
        Exact flow of every pixel of frame ``t`` to frame ``t + 1``.
    layers : (T - 1, H, W) int8
        Which layer a pixel of frame ``t`` belongs to (0 background, 1 foreground, 2 pole).
    kind : str
    params : dict
    """

    frames: np.ndarray
    flows: np.ndarray
    layers: np.ndarray
    kind: str
    params: dict = field(default_factory=dict)
    _motion: object = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.frames.shape[1], self.frames.shape[2]

    def flow_at(self, t: int, x, y) -> tuple[np.ndarray, np.ndarray]:
        """Exact flow (u, v) of sub-pixel points ``(x, y)`` of frame ``t``."""
        return self._motion.flow(t, np.asarray(x, np.float64), np.asarray(y, np.float64))

    def layer_at(self, t: int, x, y) -> np.ndarray:
        return self._motion.layer(t, np.asarray(x, np.float64), np.asarray(y, np.float64))

    def pair(self, t: int = 0):
        """``(frame_t, frame_t+1, flow_t)``."""
        return self.frames[t], self.frames[t + 1], self.flows[t]


class _Global:
    """Translation, rotation or zoom about the centre: x_{t+1} = A (x_t - c) + c + d."""

    def __init__(self, A, d, c, tex):
        self.A = np.asarray(A, np.float64)
        self.d = np.asarray(d, np.float64)
        self.c = np.asarray(c, np.float64)
        self.tex = tex

    def render(self, t, X, Y):
        # world point seen at pixel x of frame t: invert x = A^t (X - c) + c + sum_k A^k d
        Ai = np.linalg.inv(np.linalg.matrix_power(self.A, t))
        off = sum((np.linalg.matrix_power(self.A, k) @ self.d for k in range(t)), np.zeros(2))
        px, py = X - self.c[0] - off[0], Y - self.c[1] - off[1]
        wx = Ai[0, 0] * px + Ai[0, 1] * py + self.c[0]
        wy = Ai[1, 0] * px + Ai[1, 1] * py + self.c[1]
        return self.tex(wx, wy)

    def flow(self, t, x, y):
        px, py = x - self.c[0], y - self.c[1]
        nx = self.A[0, 0] * px + self.A[0, 1] * py + self.c[0] + self.d[0]
        ny = self.A[1, 0] * px + self.A[1, 1] * py + self.c[1] + self.d[1]
        return nx - x, ny - y

    def layer(self, t, x, y):
        return np.zeros(np.broadcast(x, y).shape, np.int8)


class _Layers:
    """Background translating by ``db``; foreground disc (and optional pole) by ``df``."""

    def __init__(self, db, df, centre, radius, pole, bg, fg, pole_tex):
        self.db = np.asarray(db, np.float64)
        self.df = np.asarray(df, np.float64)
        self.centre = np.asarray(centre, np.float64)
        self.radius = float(radius)
        self.pole = pole          # (x0, x1) columns of the pole at t = 0, or None
        self.bg, self.fg, self.pole_tex = bg, fg, pole_tex

    def layer(self, t, x, y):
        cx, cy = self.centre + t * self.df
        lay = np.zeros(np.broadcast(x, y).shape, np.int8)
        lay[(x - cx) ** 2 + (y - cy) ** 2 < self.radius ** 2] = 1
        if self.pole is not None:
            x0, x1 = self.pole[0] + t * self.df[0], self.pole[1] + t * self.df[0]
            lay[(x >= x0) & (x < x1) & np.ones_like(y, bool)] = 2
        return lay

    def render(self, t, X, Y):
        out = self.bg(X - t * self.db[0], Y - t * self.db[1])
        lay = self.layer(t, X, Y)
        for k, tex in ((1, self.fg), (2, self.pole_tex)):
            m = lay == k
            if m.any():
                out[m] = tex(X[m] - t * self.df[0], Y[m] - t * self.df[1])
        return out

    def flow(self, t, x, y):
        lay = self.layer(t, x, y)
        u = np.where(lay > 0, self.df[0], self.db[0])
        v = np.where(lay > 0, self.df[1], self.db[1])
        return u + 0.0 * x, v + 0.0 * y


def sequence(kind: str = "translation", *, height: int = 240, width: int = 320, n_frames: int = 2,
             seed: int = 0, noise: float = 0.0, wavelength: tuple[float, float] | None = None,
             shift=(2.3, -1.4), degrees: float = 2.0, scale: float = 1.03,
             background=(-1.2, 0.3), foreground=(2.1, 0.8), radius: float = 0.28,
             pole: bool = False) -> FlowSequence:
    """Render a synthetic sequence with exact dense flow.

    Parameters
    ----------
    kind : {"translation", "rotation", "zoom", "layers"}
    height, width, n_frames : int
    seed : int
        Textures and noise.
    noise : float
        Standard deviation of Gaussian noise added to every frame (colour levels).
    wavelength : (min, max), optional
        Texture wavelengths in pixels (default ``(8, 48)`` x the shorter side / 240).
    shift : (dx, dy)
        ``translation``: pixels per frame.
    degrees : float
        ``rotation``: degrees per frame (about the image centre).
    scale : float
        ``zoom``: scale factor per frame (about the image centre).
    background, foreground : (dx, dy)
        ``layers``: per-frame translation of the background and of the foreground disc.
    radius : float
        ``layers``: disc radius as a fraction of the shorter image side.
    pole : bool
        ``layers``: add a featureless-by-construction pole (see the module docstring).
    """
    if kind not in KINDS:
        raise InputError(f"kind must be one of {KINDS}, got {kind!r}")
    if height < 8 or width < 8 or n_frames < 2:
        raise InputError(f"need height, width >= 8 and n_frames >= 2; got {height}x{width}, {n_frames}")
    rng = np.random.default_rng(seed)
    s = min(height, width) / 240.0
    wl = wavelength or (8.0 * max(s, 0.4), 48.0 * max(s, 0.4))
    bg = _Texture(rng, "cool", wl)
    c = ((width - 1) / 2.0, (height - 1) / 2.0)
    params = dict(kind=kind, height=height, width=width, n_frames=n_frames, seed=seed, noise=noise)
    if kind == "translation":
        motion = _Global(np.eye(2), shift, c, bg)
        params["shift"] = list(shift)
    elif kind == "rotation":
        a = np.radians(degrees)
        motion = _Global([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], (0, 0), c, bg)
        params["degrees"] = degrees
    elif kind == "zoom":
        motion = _Global(np.eye(2) * scale, (0, 0), c, bg)
        params["scale"] = scale
    else:
        fg = _Texture(rng, "warm", wl)
        pole_tex = _Texture(rng, "grey", wl) if pole else None
        r = radius * min(height, width)
        centre = (0.62 * width, 0.5 * height)
        pole_cols = (0.2 * width, 0.2 * width + max(3.0, 0.025 * width)) if pole else None
        motion = _Layers(background, foreground, centre, r, pole_cols, bg, fg, pole_tex)
        params.update(background=list(background), foreground=list(foreground), radius=radius,
                      pole=pole)
    Y, X = np.mgrid[0:height, 0:width].astype(np.float64)
    frames = np.empty((n_frames, height, width, 3), np.uint8)
    for t in range(n_frames):
        img = motion.render(t, X, Y)
        if noise > 0:
            img = img + rng.normal(0.0, noise, img.shape)
        frames[t] = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    flows = np.empty((n_frames - 1, height, width, 2), np.float32)
    layers = np.empty((n_frames - 1, height, width), np.int8)
    for t in range(n_frames - 1):
        u, v = motion.flow(t, X, Y)
        flows[t, ..., 0] = u
        flows[t, ..., 1] = v
        layers[t] = motion.layer(t, X, Y)
    return FlowSequence(frames, flows, layers, kind, params, motion)


def tracks_from_flow(seq: FlowSequence, t: int = 0, n: int = 156, *, seed: int = 0,
                     noise: float = 0.0, margin: float = 4.0, avoid_pole: bool = True) -> np.ndarray:
    """``n`` exact sparse tracks ``(x0, y0, x1, y1)`` of pair ``t``, float32 (M, 4).

    Start points are uniform in frame ``t`` (``margin`` pixels from the border); tracks whose
    end leaves the frame are dropped, as a tracker would lose them, and none starts on the
    pole. ``noise`` adds Gaussian noise (pixels) to the end points, like tracker jitter.
    The default ``n = 156`` is the feature count of the paper's timed 320x240 runs (Fig. 4-5).
    """
    h, w = seq.shape
    rng = np.random.default_rng(seed)
    out = np.empty((0, 4))
    tries = 0
    while len(out) < n and tries < 20:
        m = max(4 * n, 64)
        x = rng.uniform(margin, w - 1 - margin, m)
        y = rng.uniform(margin, h - 1 - margin, m)
        u, v = seq.flow_at(t, x, y)
        x1, y1 = x + u, y + v
        keep = (x1 >= 0) & (x1 <= w - 1) & (y1 >= 0) & (y1 <= h - 1)
        if avoid_pole:
            keep &= seq.layer_at(t, x, y) != 2
        out = np.concatenate([out, np.stack([x, y, x1, y1], 1)[keep]])
        tries += 1
    out = out[:n]
    if noise > 0:
        out[:, 2:] += rng.normal(0.0, noise, (len(out), 2))
    return out.astype(np.float32)
