"""The tuning parameters of PChA, shared by :mod:`.pcha` and its GPU backend :mod:`._pcha_gpu`.

They live apart from :mod:`.pcha` so that :mod:`._pcha_gpu`, which :mod:`.pcha` imports, can take
a :class:`PChAParams` without importing :mod:`.pcha` back. Their meaning is documented in
:mod:`.pcha` (module docstring and :func:`.pcha.align`); the values are checked there.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["PChAParams", "resolve_params"]


@dataclass(frozen=True)
class PChAParams:
    """How :func:`.pcha.align` / :func:`.pcha.align_batch` run, with their defaults.

    Attributes
    ----------
    chain : bool
        Run the coarse-to-fine chain of models ending at the requested one.
    max_iter, xtol, ftol, lambda0, scaling :
        Levenberg-Marquardt controls: iterations per model stage, step and relative-decrease
        tolerances, initial damping (times the mean Hessian diagonal), ``"paper"`` or
        ``"consistent"`` right-hand side.
    loss : {"l2", "huber"}
    huber_delta : float, optional
        Huber threshold in input units (default: the median residual at the initial transform,
        at least 2 grid cells).
    outside : {"clamp", "drop"}
        Points that leave the distance-transform grid.
    resolution : int, optional
        Cells along the longest side of the distance transform built when no grid is given.
    form : {"fused", "two_kernel"}
        GPU kernel form (the CPU has one).
    hessian : {"reduced", "full"}
        GPU Hessian of the fused kernel: sufficient statistics or per-point Jacobians.
    lookup : {"corners", "cell"}
        Nearest entry of the 2^d surrounding cells, or the paper's single cell.
    """

    chain: bool = False
    max_iter: int = 100
    xtol: float = 1e-6
    ftol: float = 1e-5
    lambda0: float = 1e-3
    loss: str = "l2"
    huber_delta: float | None = None
    outside: str = "clamp"
    scaling: str = "paper"
    resolution: int | None = None
    form: str = "fused"
    hessian: str = "reduced"
    lookup: str = "corners"


_FIELDS = frozenset(f.name for f in dataclasses.fields(PChAParams))


def resolve_params(params: PChAParams | None, overrides: dict, caller: str) -> PChAParams:
    """``params`` (default :class:`PChAParams()`) with the keyword ``overrides`` of ``caller``
    applied; a keyword that is not a parameter is a TypeError, as for any function."""
    if isinstance(params, dict):  # the same fields as a dict: taken as keywords
        params, overrides = None, {**params, **overrides}
    if params is None:
        params = PChAParams()
    elif not isinstance(params, PChAParams):
        raise TypeError(f"{caller}() params must be a PChAParams or a dict of its fields, got {type(params).__name__}")
    for name in overrides:
        if name not in _FIELDS:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    return dataclasses.replace(params, **overrides) if overrides else params
