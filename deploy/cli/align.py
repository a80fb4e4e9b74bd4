"""``scanforest align OBSERVED REFERENCE``: parametric chamfer alignment (PChA) of two point files.

It aligns two point files (``.npy`` arrays or any scan format
:func:`scanforest.tasks.readers.read_cloud` reads) and prints a short summary (model, outcome,
chamfer rmse, the pose, time, device); ``--json`` prints the full result (transform, parameters,
objective history, stages) instead, ``-o OUT.json`` writes it beside the summary.

``scanforest bench align`` is :mod:`scanforest.deploy.bench.align`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import typer

from .core import number


def load_points(path: str) -> np.ndarray:
    """``(N, d)`` finite points from a ``.npy`` file or any scan file ``read_cloud`` reads.

    Every problem is a :class:`~scanforest.kernels.errors.ScanReadError` naming the file, so the
    command line prints one line and exits 2 instead of failing later inside the kernel (whose
    messages say "observed"/"reference", not which file).
    """
    from scanforest.kernels.errors import ScanReadError

    p = Path(path)
    if p.suffix.lower() != ".npy":
        from scanforest.tasks.readers import read_cloud

        return np.asarray(read_cloud(p).points)
    try:
        arr = np.load(p, allow_pickle=False)
    except OSError as exc:
        raise ScanReadError(path, f"cannot read file: {exc.strerror or exc}") from None
    except ValueError:
        raise ScanReadError(path, "not a .npy array (bad header, or pickled objects)") from None
    if arr.ndim != 2 or arr.shape[1] not in (2, 3) or arr.dtype.kind not in "fiu":
        raise ScanReadError(path, f"expected an (N, 2) or (N, 3) numeric array, got {arr.dtype} "
                                  f"shape {arr.shape}")
    if len(arr) == 0:
        raise ScanReadError(path, "zero points")
    if not np.all(np.isfinite(arr)):
        raise ScanReadError(path, "NaN or inf coordinates")
    return arr


def load_init(path: str) -> np.ndarray:
    """An initial transform from a ``.npy`` file or a JSON list of rows."""
    from scanforest.kernels.errors import ScanReadError

    try:
        if path.lower().endswith(".npy"):
            return np.load(path, allow_pickle=False)
        return np.asarray(json.loads(Path(path).read_text()), dtype=np.float64)
    except OSError as exc:
        raise ScanReadError(path, f"cannot read file: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ScanReadError(path, f"not a matrix (.npy, or JSON rows): {str(exc).splitlines()[0]}") from None


def _rotation(A: np.ndarray):
    """``(scale, angle in degrees, unit axis or None)`` of ``A = s R`` (2-D: no axis)."""
    d = A.shape[0]
    s = float(abs(np.linalg.det(A)) ** (1.0 / d))
    R = A / s
    if d == 2:
        return s, float(np.degrees(np.arctan2(R[1, 0], R[0, 0]))), None
    angle = float(np.degrees(np.arccos(np.clip((np.trace(R) - 1) / 2, -1.0, 1.0))))
    w = np.array([R[2, 1] - R[1, 2], R[0, 2] - R[2, 0], R[1, 0] - R[0, 1]])
    n = np.linalg.norm(w)
    return s, angle, (w / n if n > 1e-12 else None)


def format_summary(res, observed: str, reference: str, seconds: float) -> str:
    """A few lines for a person: model, outcome, residual, the pose, time and device."""
    from scanforest.kernels.backend import describe_device

    d = res.transform.shape[0] - 1
    state = "converged" if res.converged else f"NOT converged ({res.status})"
    lines = [f"{res.model} alignment of {observed} onto {reference}: {state} after "
             f"{res.iterations} iterations ({res.accepted} accepted)",
             f"chamfer rmse {res.rmse:.4g} (input units) over {res.n_points:,} points, "
             f"{res.n_inliers:,} inside the distance-transform grid"]
    if res.model in ("rigid", "euclidean", "similarity"):
        s, angle, axis = _rotation(res.transform[:d, :d])
        t = ", ".join(f"{v:.4g}" for v in res.transform[:d, d])
        rot = f"rotation {angle:.3f} deg" + (
            "" if axis is None else " about (" + ", ".join(f"{v:.3f}" for v in axis) + ")")
        lines.append(rot + f", translation ({t})" + (f", scale {s:.5g}" if res.model == "similarity" else ""))
    rows = [" ".join(f"{v:11.5g}" for v in row) for row in res.transform]
    lines.append("transform (observed -> reference): " + rows[0])
    lines += [" " * 35 + r for r in rows[1:]]
    lines.append(f"{seconds:.2f} s on {describe_device(res.device)}")
    return "\n".join(lines)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command("align")
    def align_cmd(
        observed: str = typer.Argument(..., help="points to move (.npy or a scan file)"),
        reference: str = typer.Argument(..., help="reference points (.npy or a scan file)"),
        model: str = typer.Option("rigid", "--model", "-m",
                                  help="2-D: euclidean|similarity|affine|projective; "
                                       "3-D: rigid|similarity|affine"),
        out: str = typer.Option(None, "-o", "--out", help="also write the full result as JSON"),
        as_json: bool = typer.Option(False, "--json", help="print the full result as JSON "
                                     "(transform, parameters, objective history, stages)"),
        init: str = typer.Option("centroids", "--init",
                                 help="centroids (observed centroid onto the reference's) | "
                                      "identity | a (d+1)x(d+1) matrix file (.npy or JSON)"),
        chain: bool = typer.Option(False, "--chain", help="coarse-to-fine chain of models"),
        loss: str = typer.Option("l2", "--loss", help="l2 | huber"),
        huber_delta: float = typer.Option(None, "--huber-delta", callback=number),
        outside: str = typer.Option("clamp", "--outside", help="clamp | drop"),
        max_iter: int = typer.Option(300, "--max-iter", callback=number, help="LM iterations per model stage"),
        resolution: int = typer.Option(None, "--resolution", callback=number, help="DT cells along the largest side"),
        device: str = typer.Option("auto", "--device", help="auto | cpu | gpu"),
    ):
        """Align OBSERVED onto REFERENCE (parametric chamfer alignment): print a summary.

        The transform maps OBSERVED onto REFERENCE. LM starts from the translation
        between the centroids: give --init identity (or a matrix) when OBSERVED
        covers only part of REFERENCE.
        """
        # --max-iter is 300, not the kernel's 100: flat scans (a wall, a turtle shell) slide
        # slowly along their surface; PCL's cturtle.pcd turned by 30 degrees needs 140-210.
        from scanforest.kernels.align import transforms as T
        from scanforest.kernels.align.pcha import INITS, align
        from scanforest.kernels.backend import resolve_device
        from scanforest.kernels.errors import InputError

        t0 = time.perf_counter()
        names = {n for names in T.MODEL_NAMES.values() for n in names}
        if model.lower() not in names:
            raise InputError(f"--model {model!r} is not a model; choose one of "
                             f"{', '.join(sorted(names))}")
        dev = resolve_device(device)
        if out:  # a folder, a path inside a store or one that cannot be written: said before the work
            from scanforest.tasks.preflight import check_output_file

            check_output_file(out, "-o")
        M0 = init if init in INITS else load_init(init)  # before reading clouds: fail fast
        obs = load_points(observed)
        ref = load_points(reference)
        res = align(obs, ref, model, init=M0, chain=chain, loss=loss, huber_delta=huber_delta,
                    outside=outside, max_iter=max_iter, resolution=resolution, device=dev)
        seconds = time.perf_counter() - t0
        full = dict(res.to_dict(), observed=observed, reference=reference,
                    init=M0 if init in INITS else np.asarray(M0).tolist(), total_seconds=seconds)
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(full, indent=2))
        if as_json:
            typer.echo(json.dumps(full, indent=2))
        else:
            typer.echo(format_summary(res, observed, reference, seconds)
                       + (f"\nwrote {out}" if out else ""))
