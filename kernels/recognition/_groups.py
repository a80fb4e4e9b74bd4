"""Per-hypothesis correspondence groups held flat (:class:`GroupList`), apart from
:mod:`.grouping` so that its GPU backend (:mod:`._grouping_gpu`) can build them without importing
the module that imports it."""
from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

__all__ = ["GroupList", "take_groups"]


class GroupList(Sequence):
    """Per-hypothesis correspondence indices held as one flat array and offsets: group ``h`` is
    ``flat[offsets[h]:offsets[h + 1]]``. The GPU grouping's form (a list of arrays costs a slice
    per hypothesis, thousands per batch of scenes); it reads as a sequence of arrays."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"group {i} of {len(self)}")
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    def take(self, keep: np.ndarray) -> "GroupList":
        """The groups where the boolean ``keep`` holds, in order."""
        sizes = np.diff(self.offsets)
        return GroupList(self.flat[np.repeat(keep, sizes)],
                         np.concatenate([[0], np.cumsum(sizes[keep])]).astype(np.int64))


def take_groups(groups, keep: np.ndarray):
    """``[g for g, k in zip(groups, keep) if k]`` for a list or a :class:`GroupList`."""
    if isinstance(groups, GroupList):
        return groups.take(np.asarray(keep, bool))
    return [g for g, k in zip(groups, keep) if k]
