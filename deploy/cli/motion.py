"""``scanforest motion ...``: dense motion from sparse tracks.

``scanforest motion run STORE --frames DIR`` ingests a folder of frames (PNG/TIFF/JPEG/NPY) as a
sequence of the store and writes the (H, W, 2) flow of every consecutive pair with both methods
(or ``--method``), plus a colour-wheel PNG per pair under ``--png-dir``; without ``--frames`` it
works on the sequences already in the store. Pairs already written with the same parameters
are skipped.

``scanforest motion pair FRAME0 FRAME1 -o FLOW.npy`` computes one pair without a store or Prefect
(``--tracks T.npy``: caller-given ``(M, 4)`` tracks; otherwise KLT through OpenCV).

``scanforest bench motion`` (both methods timed on the GPU against the CPU backend) is
:mod:`scanforest.deploy.bench.motion`.

``scanforest flow ...``, the group's name before issue 40, is a deprecated alias for one release:
the same commands, after one line on stderr that names the new one (:data:`RENAMED`).

Prefect, OpenCV and CuPy are imported only inside the commands that need them.
"""
from __future__ import annotations

import json
from pathlib import Path

import typer
import typer.core

from scanforest.flows.cluster import check_workers

from ._store import new_or_existing_store
from .core import number

#: the line the deprecated ``scanforest flow`` prints (on stderr) before it runs as ``motion``
RENAMED = "`scanforest flow` is renamed `scanforest motion`; the old name goes in the next release"


class _RenamedGroup(typer.core.TyperGroup):
    """The ``flow`` alias: ``motion``'s commands, after the rename line (before the arguments are
    parsed, so ``--help`` and a usage error print it too)."""

    def parse_args(self, ctx, args):
        typer.echo(RENAMED, err=True)
        return super().parse_args(ctx, args)


def _params(sigma_c, sigma_x, sigma_f, tau, no_test, max_labels) -> dict:
    p = {}
    if sigma_c is not None:
        p["sigma_c"] = sigma_c
    if sigma_x is not None:
        p["sigma_x"] = sigma_x
    if sigma_f is not None:
        p["sigma_f"] = sigma_f
    if no_test:
        p["tau"] = None
    elif tau is not None:
        p["tau"] = tau
    if max_labels is not None:
        p["max_labels"] = max_labels
    return p


def register(app: typer.Typer, bench: typer.Typer) -> None:
    help_text = ("Dense optical flow from sparse tracks (interpolation and multiple hypotheses, "
                 "Kim/Hwangbo/Kanade), CPU or GPU.")
    motion_app = typer.Typer(help=help_text, no_args_is_help=True)
    flow_alias = typer.Typer(cls=_RenamedGroup, no_args_is_help=True,
                             help="Deprecated: renamed `scanforest motion`. " + help_text)
    app.add_typer(motion_app, name="motion")
    app.add_typer(flow_alias, name="flow", hidden=True)

    def command(name: str):
        """Register one command under ``motion`` and under its deprecated alias ``flow``."""
        def deco(fn):
            flow_alias.command(name)(fn)
            return motion_app.command(name)(fn)
        return deco

    @command("run")
    def motion_run(
        store: str = typer.Argument(..., callback=new_or_existing_store, help="scan store (created if missing)"),
        frames: str = typer.Option(None, "--frames", help="folder of frames to ingest first"),
        seq: str = typer.Option(None, "--seq", help="sequence id (default: the folder name; "
                                                    "without --frames: every sequence)"),
        tracks: str = typer.Option(None, "--tracks", help="folder of (M, 4) .npy tracks, one per "
                                                          "pair (default: KLT, see --tracker)"),
        tracker: str = typer.Option("builtin", "--tracker", help="KLT for pairs without stored "
                                    "tracks: builtin (on --device) | opencv (host reference)"),
        method: str = typer.Option("both", "--method", help="interpolation | hypotheses | both"),
        png_dir: str = typer.Option(None, "--png-dir", help="colour-wheel PNGs go to "
                                    "DIR/<seq>/<method>/<pair>.png (default: STORE.flow-png)"),
        png: bool = typer.Option(True, "--png/--no-png"),
        sigma_c: float = typer.Option(None, "--sigma-c", callback=number, help="colour sigma (levels; default 10)"),
        sigma_x: float = typer.Option(None, "--sigma-x", callback=number,
                                      help="position sigma (px; default 4 sigma_c)"),
        sigma_f: float = typer.Option(None, "--sigma-f", callback=number,
                                      help="flow sigma of the 7-D vote (px; default 1)"),
        tau: float = typer.Option(None, "--tau", callback=number, help="change-test threshold (levels; default 20)"),
        no_test: bool = typer.Option(False, "--no-test", help="switch the change test off"),
        max_labels: int = typer.Option(None, "--max-labels", callback=number),
        batch: int = typer.Option(None, "--batch", callback=number, help="pairs per task and kernel launch"),
        device: str = typer.Option("auto", "--device", help="auto | cpu | gpu"),
        scheduler: str = typer.Option(None, "--scheduler", help="existing Dask scheduler"),
        workers: int = typer.Option(None, "--workers", callback=check_workers),
        force: bool = typer.Option(False, "--force", help="recompute pairs already written"),
    ):
        """Flow of every consecutive frame pair of the store's sequences (idempotent)."""
        from scanforest.flows.motion import run_motion
        from scanforest.kernels.errors import InputError
        from scanforest.kernels.motion.optical_flow import METHODS

        methods = list(METHODS) if method == "both" else [method]
        if any(m not in METHODS for m in methods):
            raise InputError(f"--method must be interpolation, hypotheses or both; got {method!r}")
        if tracks and not frames:
            raise InputError("--tracks goes with --frames (tracks are stored with the frames)")
        pd = (png_dir or f"{str(store).rstrip('/')}.flow-png") if png else None
        res = run_motion(store, sequences=None if (frames or not seq) else [seq], source=frames,
                         seq_id=seq, tracks_dir=tracks, methods=methods,
                         params=_params(sigma_c, sigma_x, sigma_f, tau, no_test, max_labels),
                         tracker=tracker, device=device, png_dir=pd, scheduler=scheduler,
                         workers=workers, batch=batch, force=force)
        cov = res["mean_coverage"]
        typer.echo(f"motion: {res['sequences']} sequence(s), {res['written']} pair flows written, "
                   f"{res['skipped']} already done, methods {', '.join(res['methods'])}"
                   + (f", mean coverage {cov:.3f}" if cov is not None else "")
                   + f", {res['seconds']:.1f} s on {res['workers']} workers"
                   + (f"; PNGs in {pd}" if pd and res["written"] else ""))  # none written: none there

    @command("pair")
    def motion_pair(
        frame0: str = typer.Argument(..., help="first frame (PNG/TIFF/JPEG/NPY)"),
        frame1: str = typer.Argument(..., help="second frame"),
        out: str = typer.Option(..., "-o", "--out", help="output .npy: (H, W, 2) float32 flow"),
        method: str = typer.Option("hypotheses", "--method", help="interpolation | hypotheses"),
        tracks: str = typer.Option(None, "--tracks", help="(M, 4) .npy x0,y0,x1,y1 (default: KLT)"),
        tracker: str = typer.Option("builtin", "--tracker", help="KLT without --tracks: builtin "
                                    "(on --device, GPU or CPU) | opencv (host reference)"),
        png: str = typer.Option(None, "--png", help="colour-wheel PNG of the flow"),
        sigma_c: float = typer.Option(None, "--sigma-c", callback=number),
        sigma_x: float = typer.Option(None, "--sigma-x", callback=number),
        sigma_f: float = typer.Option(None, "--sigma-f", callback=number),
        tau: float = typer.Option(None, "--tau", callback=number),
        no_test: bool = typer.Option(False, "--no-test"),
        device: str = typer.Option("auto", "--device"),
    ):
        """Flow of one frame pair; writes FLOW.npy and FLOW.valid.npy (and --png)."""
        import numpy as np

        from scanforest.kernels.backend import resolve_device, to_numpy
        from scanforest.kernels.motion.metrics import flow_to_rgb, png_bytes
        from scanforest.kernels.motion.optical_flow import dense_flow
        from scanforest.tasks.motion import read_frame

        a, b = read_frame(frame0), read_frame(frame1)
        tr = None
        if tracks:
            tr = np.load(tracks, allow_pickle=False)
        dev = resolve_device(device)
        if dev == "gpu":
            import cupy as cp

            a, b = cp.asarray(a), cp.asarray(b)
        p = _params(sigma_c, sigma_x, sigma_f, tau, no_test, None)
        r = dense_flow(a, b, tr, method=method, device=dev, tracker=tracker, **p)
        flow, valid = to_numpy(r.flow), to_numpy(r.valid)
        np.save(out, flow)
        vpath = str(Path(out).with_suffix("")) + ".valid.npy"
        np.save(vpath, valid)
        if png:
            Path(png).write_bytes(png_bytes(flow_to_rgb(flow, valid)))
        typer.echo(json.dumps({"out": out, "valid": vpath, "png": png, "method": method,
                               "device": dev, "features": r.n_features[0],
                               "coverage": float(valid.mean()), "params": r.params}))
