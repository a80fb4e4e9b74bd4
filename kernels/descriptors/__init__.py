"""Local surface descriptors: normals, keypoints and SHOT352 with its local reference frames.

``normals``, ``keypoints`` and ``shot`` are the public modules; SHOT's backends are ``_shot_cpu``
(numba) and ``shot_gpu`` (CUDA; it also computes normals on the GPU; public too, as the SHOT bench
times its stages), ``_shot_common`` what ``shot`` and ``shot_gpu`` share. The functions
re-exported here have the names of their modules, so ``scanforest.kernels.descriptors.shot`` is
the function: import the module itself with ``from scanforest.kernels.descriptors.shot import ...``.
"""
from .keypoints import keypoints
from .normals import normals
from .shot import DESCRIPTOR_LENGTH, shot

__all__ = [
    "DESCRIPTOR_LENGTH",
    "keypoints",
    "normals",
    "shot",
]
