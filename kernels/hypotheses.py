"""Hypothesis selection shared by recognition verification and dense motion: masked argmax.

Both stages follow the pattern of Kim, Hwangbo & Kanade's Algorithm 3 ("test every hypothesis,
take the best among those that pass, no sort"): every hypothesis gets a score and a pass/fail
test, and the winner is the highest-scoring hypothesis that passed. Sorting the hypotheses and
testing them in order (their Algorithm 2) gives the same winner when all hypotheses are tested,
at the price of a data-dependent loop; the argmax is single-path.

What is shared is exactly this selection rule, :func:`masked_argmax`:

* ``recognition.verification.verify`` scores pose hypotheses by their inlier fraction and tests them against
  the acceptance thresholds; each greedy round takes the masked argmax over hypotheses.
* ``motion.optical_flow.hypothesis_flow`` (CPU backend) scores every flow label of a pixel by likelihood
  voting and tests it by change detection; the masked argmax over labels gives the pixel's flow.

The scoring itself is *not* shared: recognition counts inliers of transformed model points in a
3-D scene and rescoring after each acceptance (occupancy claims), flow sums 7-D Gaussian votes
of tracked features per pixel; the two have nothing in common beyond the selection. The CUDA
flow kernel applies the same rule inline (strictly greater replaces, so ties keep the lowest
index) instead of calling this function, because materialising the (labels x pixels) score
array would cost far more memory traffic than the scoring; the tests check both agree.
"""
from __future__ import annotations

import numpy as np

from .backend import array_module

__all__ = ["masked_argmax"]


def masked_argmax(scores, ok, axis: int = -1):
    """Index and score of the best hypothesis among those that passed their test.

    Parameters
    ----------
    scores : array (..., H, ...)
        Hypothesis scores (numpy or CuPy; NaN scores never win).
    ok : bool array, same shape
        Which hypotheses passed their test.
    axis : int
        The hypothesis axis.

    Returns
    -------
    index : int64 array (the input shape without ``axis``; a Python int for 1-D input)
        The first (lowest-index) hypothesis with the largest score among the passing ones, or
        ``-1`` where none passed.
    best : float array (same shape as ``index``)
        Its score, ``-inf`` where none passed.
    """
    xp = array_module(scores, ok)
    s = xp.asarray(scores)
    ok = xp.asarray(ok, dtype=bool)
    if s.shape != ok.shape:
        raise ValueError(f"scores {s.shape} and ok {ok.shape} differ in shape")
    fdt = s.dtype if s.dtype.kind == "f" else xp.float64
    cand = xp.where(ok & ~xp.isnan(s), s.astype(fdt, copy=False), -xp.inf)
    idx = xp.argmax(cand, axis=axis)
    best = xp.take_along_axis(cand, xp.expand_dims(idx, axis), axis=axis).squeeze(axis)
    idx = xp.where(best != -xp.inf, idx, -1).astype(xp.int64)
    if s.ndim == 1:
        return int(idx), float(best)
    return idx, best


