"""Dense optical flow of image sequences (Kim, Hwangbo & Kanade) and its accuracy metrics.

``optical_flow`` is the public module (interpolation and hypothesis flow from sparse KLT tracks;
backends ``_optical_flow_cpu``, numba, and ``_optical_flow_gpu``, CUDA), ``tracking`` the KLT
tracker that feeds it (Shi-Tomasi corners + pyramidal Lucas-Kanade; backends ``_tracking_cpu``
and ``_tracking_gpu``), ``metrics`` the
endpoint / angular errors and the colour coding. The hypothesis selection rule is shared with
recognition and lives in :mod:`scanforest.kernels.hypotheses`.
"""
from .metrics import (FlowErrors, angular_error, colour_wheel, endpoint_error, flow_errors,
                      flow_to_rgb, png_bytes)
from .optical_flow import (ALPHA_OVER_BETA, METHODS, SIGMA_C, SIGMA_F, TAU, TRACKERS, FlowResult,
                           MissingDependency, dense_flow, flow_labels, hypothesis_flow,
                           interpolate_flow, klt_tracks)
from .tracking import good_features, lk_track, sparse_tracks

__all__ = [
    "ALPHA_OVER_BETA",
    "FlowErrors",
    "FlowResult",
    "METHODS",
    "MissingDependency",
    "SIGMA_C",
    "SIGMA_F",
    "TAU",
    "TRACKERS",
    "angular_error",
    "colour_wheel",
    "dense_flow",
    "endpoint_error",
    "flow_errors",
    "flow_labels",
    "flow_to_rgb",
    "good_features",
    "hypothesis_flow",
    "interpolate_flow",
    "klt_tracks",
    "lk_track",
    "png_bytes",
    "sparse_tracks",
]
