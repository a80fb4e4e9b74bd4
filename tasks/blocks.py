"""A scan read block by block (:class:`BlockScan`): what the readers of large files give
(:func:`scanforest.tasks.readers.open_blocks`) and ingest writes block by block
(:meth:`scanforest.tasks.store.ScanStore.write_scan_blocks`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class BlockScan:
    """A scan read block by block (:func:`open_blocks`): ``columns`` (``{name: (dtype, trailing
    shape)}``, store names), ``n_points`` (rows, or an upper bound on them where ``exact`` is
    false: COPC bounds crop the nodes' points), ``meta`` as :class:`PointCloud`'s, and ``blocks``:
    an iterator of ``{name: rows}`` blocks (and ``(start, {name: rows})`` corrections, see
    :meth:`~scanforest.tasks.store.ScanStore.write_scan_blocks`). Once ``blocks`` is exhausted,
    ``n_kept`` and ``bbox`` hold the figures of the whole scan. A problem of the file is raised
    from the iteration as a :class:`~scanforest.kernels.errors.ScanReadError`."""

    n_points: int
    columns: dict[str, tuple[Any, tuple[int, ...]]]
    meta: dict[str, Any]
    blocks: Any = None
    exact: bool = True
    optional: set[str] = field(default_factory=set)
    n_kept: int = 0
    bbox: tuple[list[float], list[float]] | None = None


def gather_blocks(scan: BlockScan) -> dict[str, np.ndarray]:
    """A :class:`BlockScan`'s blocks as whole arrays (its corrections applied), as
    :meth:`~scanforest.tasks.store.ScanStore.write_scan_blocks` stores them."""
    parts: dict[str, list[np.ndarray]] = {k: [] for k in scan.columns}
    fixes = []
    for b in scan.blocks:
        if isinstance(b, tuple):
            fixes.append(b)
            continue
        for k, v in b.items():
            parts[k].append(v)
    out = {k: np.concatenate(v) if v else np.empty((0, *scan.columns[k][1]), scan.columns[k][0])
           for k, v in parts.items()}
    for start, cols in fixes:
        for k, v in cols.items():
            out[k][start:start + len(v)] = v
    return out
