"""Parametric chamfer alignment over an exact Euclidean distance transform.

``pcha`` is the Levenberg-Marquardt alignment (GPU evaluator in ``_pcha_gpu``, the parameter
object ``PChAParams`` in ``_pcha_common``), ``edt`` the exact distance transform it reads,
``transforms`` the parametric transformation models (rigid to projective; its helpers stay in
``align.transforms``).
"""
from . import transforms
from .edt import DistanceGrid, available_bytes, distance_transform, estimate_bytes, exact_edt, grid_spec
from .pcha import (AlignResult, PChAParams, align, align_batch, cpu_evaluate, point_error, random_transform,
                   reference_evaluate, synthetic_problem)
from .transforms import MODEL_NAMES, Model, get_model

__all__ = [
    "AlignResult",
    "DistanceGrid",
    "MODEL_NAMES",
    "Model",
    "PChAParams",
    "align",
    "align_batch",
    "available_bytes",
    "cpu_evaluate",
    "distance_transform",
    "estimate_bytes",
    "exact_edt",
    "get_model",
    "grid_spec",
    "point_error",
    "random_transform",
    "reference_evaluate",
    "synthetic_problem",
    "transforms",
]
