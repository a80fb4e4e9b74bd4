"""Synthetic data with exact ground truth, for tests, benchmarks and the demo.

``scenes``: object models and cluttered, occluded scenes at known poses (``scanforest.synthetic``
is this module); ``sequences``: image sequences with known dense optical flow.
"""
from .scenes import (SYNTHETIC_LIBRARY, SYNTHETIC_RECOGNIZE, Model, Scene, make_scene,
                     model_library, pose_matrix, random_rotation, recognition_presets)
from .sequences import KINDS, FlowSequence, sequence, tracks_from_flow

__all__ = [
    "FlowSequence",
    "KINDS",
    "Model",
    "SYNTHETIC_LIBRARY",
    "SYNTHETIC_RECOGNIZE",
    "Scene",
    "make_scene",
    "model_library",
    "pose_matrix",
    "random_rotation",
    "recognition_presets",
    "sequence",
    "tracks_from_flow",
]
