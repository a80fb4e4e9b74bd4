"""Parametric transformation models for chamfer alignment (PChA), 2-D and 3-D.

Models (``L`` = number of parameters; every function takes a leading batch of parameter
vectors, shape ``(..., L)``):

=============  ===  ==================================================  ======================
model          dim  parameters                                          update
=============  ===  ==================================================  ======================
euclidean       2   ``[theta, tx, ty]``                                 additive
similarity      2   ``[s, theta, tx, ty]``                              additive
affine          2   ``[a11, a12, tx, a21, a22, ty]``                    additive
projective      2   ``[h11, h12, h13, h21, h22, h23, h31, h32]``        composition
rigid           3   ``[ax, ay, az, tx, ty, tz]`` (angles in radians)    additive
similarity      3   ``[s, ax, ay, az, tx, ty, tz]``                     additive
affine          3   ``[a11, a12, a13, tx, a21, ..., a33, tz]``          additive
=============  ===  ==================================================  ======================

* 2-D models follow Table 1 of Elliethy & Sharma (PChA): ``x' = s R(theta) x + t`` etc.
* 3-D rotations use the Z-Y-X Euler convention ``R = Rz(az) @ Ry(ay) @ Rx(ax)`` (the paper
  says "three rotation angles" without a convention). It has a singularity at ``|ay| = 90 deg``;
  alignment needs small to moderate rotations, where it is well conditioned.
* ``"rigid"`` and ``"euclidean"`` are aliases (2-D euclidean == 3-D rigid).
* Projective is updated by composition as in the paper's appendix (eq. 12-14): the increment
  ``delta`` is taken about the identity, at the points already warped by the current estimate,
  and the new matrix is ``M_delta @ M_t`` ("current estimate first, then the increment").

Every non-projective model maps ``x' = A(alpha) x + t(alpha)``; its parameter Jacobian is
``d x'/d alpha_k = D_k [x; 1]`` with constant ``D_k = d[A | t]/d alpha_k`` (:func:`derivatives`).
The chamfer kernels exploit that: per-point sufficient statistics (``sum w q q^T``, ``sum w r q^T``
with ``q = [x; 1]``) are model-independent, and ``g``/``H`` follow by contracting them with ``D``
(:func:`contract_gradient`, :func:`contract_hessian`) -- a generalisation of the paper's reduced
per-point Hessians (Table 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError

__all__ = [
    "Model", "get_model", "MODEL_NAMES", "identity", "to_matrix", "from_matrix", "apply",
    "jacobian", "increment_jacobian", "derivatives", "update", "chain", "promote",
    "contract_gradient", "contract_hessian", "conjugate",
]


@dataclass(frozen=True)
class Model:
    """A transformation model: ``name``, spatial ``dim``, ``n_params`` and update rule."""

    name: str
    dim: int
    n_params: int
    compositional: bool
    param_names: tuple[str, ...]

    def __repr__(self) -> str:
        return f"Model({self.name!r}, dim={self.dim}, L={self.n_params})"


_MODELS = {
    ("euclidean", 2): Model("euclidean", 2, 3, False, ("theta", "tx", "ty")),
    ("similarity", 2): Model("similarity", 2, 4, False, ("s", "theta", "tx", "ty")),
    ("affine", 2): Model("affine", 2, 6, False, ("a11", "a12", "tx", "a21", "a22", "ty")),
    ("projective", 2): Model("projective", 2, 8, True,
                             ("h11", "h12", "h13", "h21", "h22", "h23", "h31", "h32")),
    ("rigid", 3): Model("rigid", 3, 6, False, ("ax", "ay", "az", "tx", "ty", "tz")),
    ("similarity", 3): Model("similarity", 3, 7, False, ("s", "ax", "ay", "az", "tx", "ty", "tz")),
    ("affine", 3): Model("affine", 3, 12, False,
                         ("a11", "a12", "a13", "tx", "a21", "a22", "a23", "ty",
                          "a31", "a32", "a33", "tz")),
}
MODEL_NAMES = {2: ("euclidean", "similarity", "affine", "projective"),
               3: ("rigid", "similarity", "affine")}
_ALIASES = {"rigid": "euclidean", "euclidean": "rigid"}


def get_model(model: str | Model, dim: int) -> Model:
    """Look a model up by name for ``dim`` (2 or 3); ``rigid``/``euclidean`` are aliases."""
    if isinstance(model, Model):
        if model.dim != dim:
            raise InputError(f"model {model.name!r} is {model.dim}-D but the points are {dim}-D")
        return model
    if dim not in (2, 3):
        raise InputError(f"points must be 2-D or 3-D, got dimension {dim}")
    name = str(model).lower()
    key = (name, dim)
    if key not in _MODELS and (_ALIASES.get(name), dim) in _MODELS:
        key = (_ALIASES[name], dim)
    if key not in _MODELS:
        raise InputError(f"unknown model {model!r} for {dim}-D points; choose one of "
                         f"{MODEL_NAMES[dim]} ('rigid' and 'euclidean' are aliases)")
    return _MODELS[key]


def chain(model: str | Model, dim: int) -> list[Model]:
    """The coarse-to-fine chain ending at ``model`` (paper P:466): e.g. 2-D projective ->
    ``[euclidean, similarity, affine, projective]``."""
    m = get_model(model, dim)
    names = MODEL_NAMES[dim]
    return [get_model(n, dim) for n in names[: names.index(m.name) + 1]]


# ----------------------------------------------------------------------------- rotations
def _rot2(theta):
    c, s = np.cos(theta), np.sin(theta)
    R = np.empty(np.shape(theta) + (2, 2))
    R[..., 0, 0], R[..., 0, 1], R[..., 1, 0], R[..., 1, 1] = c, -s, s, c
    return R


def _drot2(theta):
    c, s = np.cos(theta), np.sin(theta)
    R = np.empty(np.shape(theta) + (2, 2))
    R[..., 0, 0], R[..., 0, 1], R[..., 1, 0], R[..., 1, 1] = -s, -c, c, -s
    return R


def _rot3(ang):
    """``Rz(az) @ Ry(ay) @ Rx(ax)`` for angles ``(..., 3)``, written out (fast for small batches)."""
    ca, cb, cc = np.cos(ang[..., 0]), np.cos(ang[..., 1]), np.cos(ang[..., 2])
    sa, sb, sc = np.sin(ang[..., 0]), np.sin(ang[..., 1]), np.sin(ang[..., 2])
    R = np.empty(ang.shape[:-1] + (3, 3))
    R[..., 0, 0] = cc * cb
    R[..., 0, 1] = cc * sb * sa - sc * ca
    R[..., 0, 2] = cc * sb * ca + sc * sa
    R[..., 1, 0] = sc * cb
    R[..., 1, 1] = sc * sb * sa + cc * ca
    R[..., 1, 2] = sc * sb * ca - cc * sa
    R[..., 2, 0] = -sb
    R[..., 2, 1] = cb * sa
    R[..., 2, 2] = cb * ca
    return R


def _drot3(ang):
    """``dR/d(ax, ay, az)``, shape ``(..., 3, 3, 3)``."""
    ca, cb, cc = np.cos(ang[..., 0]), np.cos(ang[..., 1]), np.cos(ang[..., 2])
    sa, sb, sc = np.sin(ang[..., 0]), np.sin(ang[..., 1]), np.sin(ang[..., 2])
    D = np.zeros(ang.shape[:-1] + (3, 3, 3))
    D[..., 0, 0, 1] = cc * sb * ca + sc * sa
    D[..., 0, 0, 2] = -cc * sb * sa + sc * ca
    D[..., 0, 1, 1] = sc * sb * ca - cc * sa
    D[..., 0, 1, 2] = -sc * sb * sa - cc * ca
    D[..., 0, 2, 1] = cb * ca
    D[..., 0, 2, 2] = -cb * sa
    D[..., 1, 0, 0] = -cc * sb
    D[..., 1, 0, 1] = cc * cb * sa
    D[..., 1, 0, 2] = cc * cb * ca
    D[..., 1, 1, 0] = -sc * sb
    D[..., 1, 1, 1] = sc * cb * sa
    D[..., 1, 1, 2] = sc * cb * ca
    D[..., 1, 2, 0] = -cb
    D[..., 1, 2, 1] = -sb * sa
    D[..., 1, 2, 2] = -sb * ca
    D[..., 2, 0, 0] = -sc * cb
    D[..., 2, 0, 1] = -sc * sb * sa - cc * ca
    D[..., 2, 0, 2] = -sc * sb * ca + cc * sa
    D[..., 2, 1, 0] = cc * cb
    D[..., 2, 1, 1] = cc * sb * sa - sc * ca
    D[..., 2, 1, 2] = cc * sb * ca + sc * sa
    return D


def _angles3(R):
    ay = np.arcsin(np.clip(-R[..., 2, 0], -1.0, 1.0))
    ax = np.arctan2(R[..., 2, 1], R[..., 2, 2])
    az = np.arctan2(R[..., 1, 0], R[..., 0, 0])
    return np.stack([ax, ay, az], -1)


def _nearest_rotation(A):
    U, _, Vt = np.linalg.svd(A)
    D = np.ones(A.shape[:-1])
    D[..., -1] = np.sign(np.linalg.det(U @ Vt))
    return (U * D[..., None, :]) @ Vt


# ----------------------------------------------------------------------------- params <-> matrix
def _params(model: Model, params) -> np.ndarray:
    p = np.asarray(params, dtype=np.float64)
    if p.shape[-1:] != (model.n_params,):
        raise InputError(f"model {model.name!r} ({model.dim}-D) takes {model.n_params} parameters "
                         f"{model.param_names}, got an array of shape {p.shape}")
    if not np.all(np.isfinite(p)):
        raise InputError("transform parameters contain NaN or inf")
    return p


def identity(model: Model) -> np.ndarray:
    """The identity parameter vector of ``model``."""
    return from_matrix(model, np.eye(model.dim + 1))


def to_matrix(model: Model, params) -> np.ndarray:
    """Homogeneous ``(..., d+1, d+1)`` matrix of parameter vectors ``(..., L)``."""
    p = _params(model, params)
    d = model.dim
    M = np.zeros(p.shape[:-1] + (d + 1, d + 1))
    M[..., d, d] = 1.0
    if model.name == "projective":
        M[..., 0, :] = p[..., 0:3]
        M[..., 1, :] = p[..., 3:6]
        M[..., 2, :2] = p[..., 6:8]
        return M
    if model.name == "affine":
        M[..., :d, :] = p.reshape(p.shape[:-1] + (d, d + 1))
        return M
    s = p[..., 0:1, None] if model.name == "similarity" else 1.0
    off = 1 if model.name == "similarity" else 0
    if d == 2:
        R = _rot2(p[..., off])
        t = p[..., off + 1: off + 3]
    else:
        R = _rot3(p[..., off: off + 3])
        t = p[..., off + 3: off + 6]
    M[..., :d, :d] = s * R
    M[..., :d, d] = t
    return M


def from_matrix(model: Model, M) -> np.ndarray:
    """Parameters of ``model`` closest to the homogeneous matrix ``M`` (exact when ``M`` is of
    that model; rotations are projected onto SO(d) first)."""
    M = np.asarray(M, dtype=np.float64)
    d = model.dim
    if M.shape[-2:] != (d + 1, d + 1):
        raise InputError(f"a {d}-D transform matrix must be ({d + 1}, {d + 1}), got {M.shape}")
    if model.name == "projective":
        M = M / M[..., 2:3, 2:3]
        return np.concatenate([M[..., 0, :], M[..., 1, :], M[..., 2, :2]], -1)
    A = M[..., :d, :d]
    t = M[..., :d, d]
    if model.name == "affine":
        return M[..., :d, :].reshape(M.shape[:-2] + (d * (d + 1),)).copy()
    det = np.linalg.det(A)
    s = np.abs(det) ** (1.0 / d)
    R = _nearest_rotation(A / s[..., None, None])
    ang = np.arctan2(R[..., 1, 0], R[..., 0, 0])[..., None] if d == 2 else _angles3(R)
    parts = ([s[..., None]] if model.name == "similarity" else []) + [ang, t]
    return np.concatenate(parts, -1)


def apply(M, points) -> np.ndarray:
    """Apply homogeneous matrix ``M`` ``(d+1, d+1)`` to ``points`` ``(N, d)`` (with the
    projective division)."""
    M = np.asarray(M, dtype=np.float64)
    P = np.asarray(points, dtype=np.float64)
    d = P.shape[-1]
    y = P @ M[:d, :d].T + M[:d, d]
    w = P @ M[d, :d] + M[d, d]
    if np.any(M[d, :d] != 0) or M[d, d] != 1:
        y = y / w[:, None]
    return y


def conjugate(M, center, scale) -> np.ndarray:
    """``S @ M @ S^-1`` with ``S(x) = (x - center) / scale``: a raw-frame transform expressed in
    the normalised frame (inverse: :func:`unconjugate`). Conjugation by a similarity keeps every
    model's class (rigid stays rigid, projective stays projective)."""
    d = M.shape[-1] - 1
    S = np.eye(d + 1)
    S[:d, :d] /= scale
    S[:d, d] = -np.asarray(center) / scale
    Si = np.eye(d + 1)
    Si[:d, :d] *= scale
    Si[:d, d] = center
    return S @ M @ Si


def unconjugate(Mn, center, scale) -> np.ndarray:
    """Inverse of :func:`conjugate`: normalised-frame matrix back to the raw frame."""
    d = Mn.shape[-1] - 1
    S = np.eye(d + 1)
    S[:d, :d] /= scale
    S[:d, d] = -np.asarray(center) / scale
    Si = np.eye(d + 1)
    Si[:d, :d] *= scale
    Si[:d, d] = center
    return Si @ Mn @ S


# ----------------------------------------------------------------------------- derivatives
def matrix_and_derivatives(model: Model, params):
    """``(to_matrix(params), derivatives(params))`` for a batch ``(B, L)``; small batches of the
    rotation models take a scalar path (the LM host step calls this every iteration)."""
    p = np.asarray(params, dtype=np.float64)
    if model.compositional:
        return to_matrix(model, p), None
    if model.name == "affine" or p.shape[0] > 4:
        return to_matrix(model, p), derivatives(model, p)
    Ms, Ds = [], []
    for row in p.tolist():
        M, D = _scalar_terms(model, row)
        Ms.append(M)
        Ds.append(D)
    return np.array(Ms), np.array(Ds)


def _scalar_terms(model: Model, p):
    import math

    d = model.dim
    sim = model.name == "similarity"
    s = p[0] if sim else 1.0
    off = 1 if sim else 0
    L = model.n_params
    D = np.zeros((L, d, d + 1))
    if d == 2:
        c, sn = math.cos(p[off]), math.sin(p[off])
        R = ((c, -sn), (sn, c))
        dR = [((-sn, -c), (c, -sn))]
        t = p[off + 1: off + 3]
    else:
        ca, cb, cc = math.cos(p[off]), math.cos(p[off + 1]), math.cos(p[off + 2])
        sa, sb, sc = math.sin(p[off]), math.sin(p[off + 1]), math.sin(p[off + 2])
        R = ((cc * cb, cc * sb * sa - sc * ca, cc * sb * ca + sc * sa),
             (sc * cb, sc * sb * sa + cc * ca, sc * sb * ca - cc * sa),
             (-sb, cb * sa, cb * ca))
        dR = [((0.0, cc * sb * ca + sc * sa, -cc * sb * sa + sc * ca),
               (0.0, sc * sb * ca - cc * sa, -sc * sb * sa - cc * ca),
               (0.0, cb * ca, -cb * sa)),
              ((-cc * sb, cc * cb * sa, cc * cb * ca),
               (-sc * sb, sc * cb * sa, sc * cb * ca),
               (-cb, -sb * sa, -sb * ca)),
              ((-sc * cb, -sc * sb * sa - cc * ca, -sc * sb * ca + cc * sa),
               (cc * cb, cc * sb * sa - sc * ca, cc * sb * ca + sc * sa),
               (0.0, 0.0, 0.0))]
        t = p[off + 3: off + 6]
    M = np.eye(d + 1)
    Rm = np.array(R)
    M[:d, :d] = s * Rm
    M[:d, d] = t
    if sim:
        D[0, :, :d] = Rm
    D[off: off + len(dR), :, :d] = s * np.array(dR)
    for c in range(d):
        D[off + len(dR) + c, c, d] = 1.0
    return M, D


def derivatives(model: Model, params) -> np.ndarray:
    """``D`` of shape ``(..., L, d, d+1)``: ``D_k = d[A | t] / d alpha_k`` (additive models).

    For the projective model (compositional) the increment Jacobian depends on the warped point
    itself, not linearly on ``[x; 1]``; use :func:`increment_jacobian` instead.
    """
    p = _params(model, params)
    d, L = model.dim, model.n_params
    if model.compositional:
        raise InputError("the projective model has no constant derivative stack; "
                         "use increment_jacobian()")
    D = np.zeros(p.shape[:-1] + (L, d, d + 1))
    if model.name == "affine":
        for k in range(L):
            D[..., k, k // (d + 1), k % (d + 1)] = 1.0
        return D
    sim = model.name == "similarity"
    off = 1 if sim else 0
    s = p[..., 0, None, None] if sim else 1.0
    if d == 2:
        R = _rot2(p[..., off])
        dR = _drot2(p[..., off])[..., None, :, :]
        nang = 1
    else:
        R = _rot3(p[..., off: off + 3])
        dR = _drot3(p[..., off: off + 3])
        nang = 3
    if sim:
        D[..., 0, :, :d] = R
    D[..., off: off + nang, :, :d] = (s[..., None, :, :] if sim else 1.0) * dR
    for c in range(d):
        D[..., off + nang + c, c, d] = 1.0
    return D


def jacobian(model: Model, params, points) -> np.ndarray:
    """``dT_alpha(x)/d alpha`` per point, ``(N, d, L)``, float64 (Table 1 of the paper)."""
    p = _params(model, params)
    X = np.asarray(points, dtype=np.float64)
    if model.name != "projective":
        D = derivatives(model, p)
        q = np.concatenate([X, np.ones((len(X), 1))], 1)
        return np.einsum("kcm,nm->nck", D, q)
    x, y = X[:, 0], X[:, 1]
    M = to_matrix(model, p)
    w = M[2, 0] * x + M[2, 1] * y + 1.0
    xp = (M[0, 0] * x + M[0, 1] * y + M[0, 2]) / w
    yp = (M[1, 0] * x + M[1, 1] * y + M[1, 2]) / w
    J = np.zeros((len(X), 2, 8))
    z = np.zeros_like(x)
    J[:, 0] = np.stack([x / w, y / w, 1 / w, z, z, z, -xp * x / w, -xp * y / w], 1)
    J[:, 1] = np.stack([z, z, z, x / w, y / w, 1 / w, -yp * x / w, -yp * y / w], 1)
    return J


def increment_jacobian(model: Model, params, points) -> np.ndarray:
    """The Jacobian the LM step uses, ``(N, d, L)``: :func:`jacobian` for additive models; for the
    compositional projective model ``d T_{delta o alpha}(x) / d delta`` at the identity increment,
    which depends only on the warped point ``x' = T_alpha(x)`` (paper eq. 14)."""
    if not model.compositional:
        return jacobian(model, params, points)
    Xp = apply(to_matrix(model, params), points)
    return jacobian(model, identity(model), Xp)


def update(model: Model, params, delta) -> np.ndarray:
    """Candidate parameters: ``params + delta`` (additive) or ``M_delta @ M_t`` (projective)."""
    p = _params(model, params)
    dl = np.asarray(delta, dtype=np.float64)
    if not model.compositional:
        return p + dl
    Md = to_matrix(model, identity(model) + dl)
    M = Md @ to_matrix(model, p)
    return from_matrix(model, M)


def promote(params, from_model: Model, to_model: Model) -> np.ndarray:
    """Re-express parameters of a simpler model in a richer one (exact; used by chaining)."""
    return from_matrix(to_model, to_matrix(from_model, params))


# ----------------------------------------------------------------------------- reduced stats
def contract_gradient(D, S) -> np.ndarray:
    """``g = -2 sum_j J_j^T w_j r_j`` from ``S = sum_j w_j r_j q_j^T`` (``(B, d, d+1)``);
    ``D``: ``(B, L, d, d+1)``."""
    B, L = D.shape[:2]
    return -2.0 * (D.reshape(B, L, -1) @ S.reshape(B, -1, 1))[..., 0]


def contract_hessian(D, Q) -> np.ndarray:
    """``H = sum_j w_j J_j^T J_j`` from ``Q = sum_j w_j q_j q_j^T`` (``(B, d+1, d+1)``);
    ``H_kl = sum_c D_k[c] Q D_l[c]^T``."""
    B, L, d, d1 = D.shape
    DQ = (D.reshape(B, L * d, d1) @ Q).reshape(B, L, d * d1)
    return DQ @ D.reshape(B, L, d * d1).transpose(0, 2, 1)
