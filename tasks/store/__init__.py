"""The scan store: a Zarr v3 hierarchy that every stage reads from and writes to.

Layout (``STORE`` is a directory on a POSIX file system)::

    STORE/
      zarr.json                      root group; attrs: scanforest_store (layout version), created
      scans/<scan_id>/               one group per scan
          points        (N, 3) float32|float64, chunks of CHUNK_ROWS rows
          normals       (N, 3) float32          (when the source had them)
          colors        (N, 3) uint8
          intensity     (N,)   float32
          pixel_index   (N,)   int64           (organised clouds: index into WIDTH x HEIGHT)
          extra_<name>  other per-point fields
          <stage arrays>  written later by describe/match/recognize (keypoints, descriptors, ...)
        attrs: source, sha256, format, encoding, n_points, units, bbox, origin (the local frame's
               origin [x, y, z] the stages compute in; absent: [0, 0, 0]), ingested_at,
               ground_truth (synthetic scenes), arrays {name: {shape, dtype}}, complete (bool),
               and per-stage records (each with the arrays it wrote)
      quarantine/<id>/               one group per rejected file; attrs: source, reason, sha256, time
      libraries/<name>/              model libraries (:mod:`scanforest.tasks.recognize`)
      indexes/<name>/                sharded KD-forest indexes (:mod:`scanforest.tasks.index`)
      sequences/<seq_id>/            image sequences and their flow (:mod:`scanforest.tasks.motion`)
      runs/<run_id>/                 run manifests (what ran, versions, parameters, timings)
      .locks/scans/<scan_id>.lock    claim files (empty; not Zarr nodes)
      .locks/stages/<stage>/<scan_id>.lock   a stage's work claims (:meth:`ScanStore.claim_stage`)

The package: :mod:`.scans` (:class:`ScanStore`: the store opened once, its scans, stages,
quarantine; scan ids), :mod:`.catalog` (``store.catalog``: libraries, indexes, sequences and
runs; each new library, index or sequence replaces the old one only when whole),
:mod:`.integrity` (``verify``/``repair``), :mod:`.locks` (claims), :mod:`.errors` (a store that
cannot be written, an array that does not read back).

Writers of one scan exclude each other with a claim: an exclusive ``flock`` on
``.locks/scans/<scan_id>.lock``, held while the group is (re)created, written and flipped
complete, and while a stage is added. Two ingests of the same archive at once therefore never
replace a group the other is writing; the second one waits, finds the scan current and skips it.
The OS drops the lock when its process dies, so a killed writer never blocks the next one, and
writers of different scans never wait for each other. The lock files live outside ``scans/``
so they are never listed as scans; they stay (one empty file per scan id) because removing a
lock file that another process may be about to lock would let two writers hold "the" claim.
"""
from __future__ import annotations

from .catalog import Catalog
from .locks import LOCKS, file_lock
from .scans import (CHUNK_ROWS, ID_HASH_HEX, ID_HASH_MARK, LAYOUT_VERSION, MAX_ID_BYTES, WHERE_ERRNOS, ScanStore,
                    StoreReadError, StoreWriteError, _jsonable, iter_chunks, legacy_scan_id, local_points, scan_id_for,
                    scan_grid, scan_origin, sha256_bytes, sha256_file, stage_digest, stage_matches, utc_now)

__all__ = ["CHUNK_ROWS", "ID_HASH_HEX", "ID_HASH_MARK", "LAYOUT_VERSION", "LOCKS", "MAX_ID_BYTES", "WHERE_ERRNOS",
           "Catalog", "ScanStore", "StoreReadError", "StoreWriteError", "_jsonable", "file_lock", "iter_chunks",
           "legacy_scan_id", "local_points", "scan_grid", "scan_id_for", "scan_origin", "sha256_bytes", "sha256_file",
           "stage_digest", "stage_matches", "utc_now"]
