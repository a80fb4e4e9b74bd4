"""``scanforest library build``: the model library and the index over it, as a stage of its own."""
from __future__ import annotations

from typing import Optional

import typer

from .core import DeviceOpt, JsonOpt, StoreArg, choose_device, number, print_summary

LIBRARY_KEYS = ("library", "status", "library_status", "models", "reference_descriptors", "index", "index_status",
                "method", "seconds")


def register(app: typer.Typer, bench: typer.Typer) -> None:
    library_app = typer.Typer(help="Model libraries: the models described once, and the index over them.",
                              no_args_is_help=True)
    app.add_typer(library_app, name="library")

    @library_app.command("build")
    def library_build(
        store: str = StoreArg,
        models: list[str] = typer.Option(..., "--models", "-m", help="Model scan ids or glob patterns (repeatable)."),
        name: str = typer.Option("default", "--name", "--library", help="Library name in the store "
                                 "(`match --library NAME` and `recognize --library NAME` use it)."),
        model_ss: float = typer.Option(0.01, callback=number, help="Model keypoint sampling (PCL tutorial 0.01)."),
        descr_rad: float = typer.Option(0.02, callback=number,
                                        help="SHOT radius (0.02); scenes are described with it."),
        rf_rad: float = typer.Option(0.015, callback=number, help="Hough reference-frame radius (0.015)."),
        normal_k: Optional[int] = typer.Option(None, callback=number, help="Model normals from the k nearest points "
                                               "(default 10; used where a model scan has no normals)."),
        normal_radius: Optional[float] = typer.Option(None, callback=number,
                                                      help="Model normals from a radius instead of k."),
        views: Optional[int] = typer.Option(None, callback=number,
                                            help="Describe each model through N rendered partial views "
                                            "(for full 360-degree models; default: the model as it is)."),
        voxel: Optional[float] = typer.Option(None, callback=number,
                                              help="Thin each model to one point per voxel of this edge (m) "
                                              "before describing it; `recognize` then thins the scenes the same "
                                              "way (scale --model-ss, --descr-rad, --rf-rad with it)."),
        method: str = typer.Option("exact", help="Search of the library's index: exact | banns | anns."),
        backtracks: Optional[int] = typer.Option(None, callback=number,
                                                 help="Leaf visits per query for banns/anns (None = exact)."),
        device: str = DeviceOpt,
        as_json: bool = JsonOpt,
    ):
        """Describe the model scans into the library NAME and build the index over it (both kept when
        the models and parameters are unchanged). Then `scanforest match STORE --library NAME` matches
        the described scenes against it and `scanforest recognize STORE --library NAME` recognises
        them from those stored matches."""
        from scanforest.deploy.cli.pipeline import _pick
        from scanforest.flows.inputs import absolute_path
        from scanforest.tasks.library import check_library_build, library_unchanged

        model_ids = _pick(store, models, "--models")
        params = {"model_ss": model_ss, "descr_rad": descr_rad, "rf_rad": rf_rad, "normal_k": normal_k,
                  "normal_radius": normal_radius, "views": views, "voxel": voxel}
        params = {k: v for k, v in params.items() if v is not None}
        index_params = {"method": method, "backtracks": backtracks}
        check_library_build(absolute_path(store), model_ids, params, index_params)
        done = library_unchanged(absolute_path(store), model_ids, name, params, index_params)
        if done is None:
            from scanforest.flows.library import run_library_build

            dev = choose_device(device)
            res = run_library_build(store, model_ids, name=name, params=params, index_params=index_params, device=dev)
        else:  # nothing to do: said at once, no device, API or run record
            res = done
        print_summary(f"library {name!r} in {store}", res, as_json=as_json, keys=LIBRARY_KEYS)
