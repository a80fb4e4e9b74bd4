"""3-D object recognition: model library, correspondences, grouping, verification, refinement.

* ``library`` - :class:`ModelLibrary` (every model described once, stacked) and :func:`describe`;
* ``correspondences`` - :func:`match` (scene to library descriptors, exact) and :func:`from_neighbours` (a search done elsewhere);
* ``rigid`` - least-squares rigid fits (SVD, Horn's quaternions in numba) and RANSAC;
* ``grouping`` - :class:`Hypotheses` from Hough voting or geometric consistency (PCL), fitted by ``rigid``;
* ``verification`` - :func:`verify`: all hypotheses scored at once, greedy acceptance with occupancy;
* ``refinement`` - the ICP / chamfer refinement of the promising hypotheses between two verifications;
* ``evaluation`` - :func:`pose_errors` and :func:`evaluate` against ground truth;
* ``pipeline`` - :func:`recognize` (the whole pipeline), :func:`recognize_described` (from a stored description and matches; ``_many``: a batch of scenes), :class:`RecognizeParams`;
* ``icp`` - point-to-plane ICP, one source or many in lockstep;
* ``_scene_index`` - the scene as verification and ICP search it;
* ``_verification_gpu`` - the CUDA kernels of that search; ``_grouping_gpu`` - GC sweeps and RANSAC on the GPU.
"""
from .correspondences import Correspondences, from_neighbours, match
from .evaluation import evaluate, pose_errors
from .grouping import Hypotheses, group_gc, group_hough
from .icp import IcpResult, icp_point_to_plane, icp_point_to_plane_batch
from .library import ModelLibrary, describe, render_view, resolution
from .pipeline import (Detection, Detections, RecognizeParams, recognize, recognize_described,
                       recognize_described_many, recognize_many)
from .rigid import ransac_rigid, rigid_transform
from .verification import verify

__all__ = [
    "Correspondences",
    "Detection",
    "Detections",
    "Hypotheses",
    "IcpResult",
    "ModelLibrary",
    "RecognizeParams",
    "describe",
    "evaluate",
    "from_neighbours",
    "group_gc",
    "group_hough",
    "icp_point_to_plane",
    "icp_point_to_plane_batch",
    "match",
    "pose_errors",
    "ransac_rigid",
    "recognize",
    "recognize_described",
    "recognize_described_many",
    "recognize_many",
    "render_view",
    "resolution",
    "rigid_transform",
    "verify",
]
