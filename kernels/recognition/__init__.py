"""3-D object recognition: model library, correspondences, grouping, verification, ICP.

``pipeline`` is PCL's correspondence-grouping pipeline (GPU verification kernels in
``_pipeline_gpu``), ``icp`` the point-to-plane ICP refinement, and ``_scene_index`` the scene
structure both search.
"""
from .icp import IcpResult, icp_point_to_plane, icp_point_to_plane_batch
from .pipeline import (Correspondences, Detection, Detections, Hypotheses, ModelLibrary, describe,
                       evaluate, group_gc, group_hough, match, pose_errors, ransac_rigid, recognize,
                       render_view, resolution, rigid_transform, verify)

__all__ = [
    "Correspondences",
    "Detection",
    "Detections",
    "Hypotheses",
    "IcpResult",
    "ModelLibrary",
    "describe",
    "evaluate",
    "group_gc",
    "group_hough",
    "icp_point_to_plane",
    "icp_point_to_plane_batch",
    "match",
    "pose_errors",
    "ransac_rigid",
    "recognize",
    "render_view",
    "resolution",
    "rigid_transform",
    "verify",
]
