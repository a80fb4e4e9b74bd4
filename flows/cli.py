"""The ``scanforest`` command line.

Commands live beside the flows they start. Each module ``scanforest.flows.cli_<area>`` and
``scanforest.flows.bench_<name>`` defines ``register(app, bench)`` and adds its commands to the
main app or to the ``bench`` sub-app; this module discovers them (the one way a command is
registered), so areas never edit one shared file.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

import typer

app = typer.Typer(
    name="scanforest",
    help="Find known objects in large archives of 3-D scans, on CPUs or GPU clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench = typer.Typer(help="Benchmarks: print a table (figure, device, ratio to the baseline "
                         "measured in the same run) and write JSON.", no_args_is_help=True)
app.add_typer(bench, name="bench")


def _register_all() -> None:
    import scanforest.flows as flows_pkg

    for info in sorted(pkgutil.iter_modules(flows_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith(("cli_", "bench_")):
            module = importlib.import_module(f"scanforest.flows.{info.name}")
            if hasattr(module, "register"):  # bench_flow is a library of `bench flow` (cli_flow)
                module.register(app, bench)


_register_all()


#: commands that run Prefect flows: their local Prefect API starts with the command, and boots
#: while the command imports its flow and checks its input (a user error still ends at once)
FLOW_COMMANDS = {"ingest", "describe", "index", "match", "recognize", "align-store", "demo"}


def main() -> None:
    """Console entry point: user errors print one clear line and exit 2, not a traceback."""
    from scanforest.kernels.errors import ScanforestError

    args = sys.argv[1:]
    if args and args[0] in FLOW_COMMANDS and not {"--help", "-h"} & set(args):
        from ._runner import start_prefect_api

        start_prefect_api()
    try:
        app()
    except ScanforestError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
