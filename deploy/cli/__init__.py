"""The ``scanforest`` command line.

Every public module of :mod:`scanforest.deploy.cli` (one per command group: ``core``, ``align``,
``check``, ``motion``, ``ops``, ``pipeline``, ``shot``) and of :mod:`scanforest.deploy.bench`
(one per benchmark) defines ``register(app, bench)`` and adds its commands to the main app or to
the ``bench`` sub-app; this module discovers them (the one way a command is registered), so
command groups never edit one shared file. ``_``-prefixed modules are shared helpers, not
commands. The commands start the Prefect flows of :mod:`scanforest.flows`; the flows never import
the command line.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
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

#: the packages whose public modules hold commands (each module: ``register(app, bench)``)
COMMAND_PACKAGES = ("scanforest.deploy.cli", "scanforest.deploy.bench")


def command_modules() -> list[str]:
    """Dotted names of every module that registers commands, in registration order."""
    names = []
    for pkg_name in COMMAND_PACKAGES:
        pkg = importlib.import_module(pkg_name)
        names += [f"{pkg_name}.{info.name}"
                  for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)
                  if not info.name.startswith("_") and not info.ispkg]
    return names


def _register_all() -> None:
    for name in command_modules():
        importlib.import_module(name).register(app, bench)


def _reflow(doc: str) -> str:
    """A command's docstring as its help: the lines of each prose paragraph joined, so the
    terminal wraps them at its own width (typer's rich help kept the docstring's breaks, and an
    80-column terminal showed every wrapped line ragged); paragraphs with indented, bulleted or
    numbered lines are kept as written."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    keep = re.compile(r"^(\s|[-*] |\d+[.)] )")
    return "\n\n".join(p if any(keep.match(line) for line in p.splitlines()[1:]) or p.startswith("\x08")
                       else " ".join(p.split()) for p in paragraphs)


def _reflow_help(group: typer.Typer) -> None:
    """Every command's help reflowed (:func:`_reflow`) and its one-line summary in the command
    list: the first sentence of its first paragraph."""
    for info in group.registered_commands:
        doc = info.help or inspect.getdoc(info.callback) or ""
        if doc:
            info.help = _reflow(doc)
            if info.short_help is None:
                first = info.help.split("\n\n")[0]
                info.short_help = re.split(r"(?<=[.;:])\s(?=[A-Z`])", first)[0]
    for sub in group.registered_groups:
        _reflow_help(sub.typer_instance)


_register_all()
_reflow_help(app)


#: commands that run Prefect flows: their local Prefect API starts with the command, and boots
#: while the command imports its flow and checks its input (a user error still ends at once)
FLOW_COMMANDS = {"ingest", "describe", "index", "match", "recognize", "align-store", "demo"}
#: flow commands that first ask the store whether there is anything to do (a no-op answers in
#: well under 2 s with no API or cluster: :mod:`scanforest.flows.noop`); they start the API then
CHECK_FIRST = {"describe", "match"}


#: seconds a command gets, after a Ctrl-C, to stop on its own (its run marked crashed, its local
#: cluster and API closed) before it exits anyway
INTERRUPT_GRACE = 6.0


def _give_up() -> None:
    """The grace after a Ctrl-C is over: exit now, said (its clean-up did not finish)."""
    import os

    sys.__stderr__.write(f"interrupted: not stopped within {INTERRUPT_GRACE:g} s; quitting without its clean-up "
                         "(a rerun resumes)\n")
    sys.__stderr__.flush()
    os._exit(130)


def _quiet_exit() -> None:
    """Exit 130 after a Ctrl-C, saying nothing more: the command said it stops, and what its
    libraries print as they are cut short is noise (a local cluster stopped while it started:
    distributed's exit hooks printed four tracebacks)."""
    import logging
    import os

    logging.disable(logging.CRITICAL)
    sys.stderr.flush()
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the exit hooks, until the process ends
    sys.exit(130)


def _stop_on_interrupt() -> None:
    """Ctrl-C stops the command: the first one raises KeyboardInterrupt in it and exits after
    :data:`INTERRUPT_GRACE` seconds at the latest, a second one at once (exit 130 either way).
    Without this, a Ctrl-C also killed the local cluster's workers, and the flow's threads waited
    for their results for good. What is written stays; the run is marked interrupted (in Prefect
    by the command's watchdog, in the store by the next run) and a rerun resumes."""
    import os
    import signal
    import threading

    def handler(signum, frame):
        if getattr(handler, "fired", False):
            os._exit(130)
        handler.fired = True
        sys.stderr.write("interrupted: stopping (what is written stays, a rerun resumes; Ctrl-C again quits "
                         "at once)\n")
        records = sys.modules.get("scanforest.flows.records")  # imported where a run is watched: nothing to import
        if records is not None:
            records.note_interrupt()  # its watchdog records a Ctrl-C, should the grace timer end the command
        cluster = sys.modules.get("scanforest.flows.cluster")
        if cluster is not None:  # the flow's threads waiting on the cluster stop waiting: it ends on its own
            cluster.stop_waiting()
        timer = threading.Timer(INTERRUPT_GRACE, _give_up)
        timer.daemon = True
        timer.start()
        shown = sys.unraisablehook

        def unraisable(u):  # the interrupt raised inside a finaliser or a gc callback: swallowed there,
            if not isinstance(u.exc_value, KeyboardInterrupt):  # and printed as a traceback; the stop
                shown(u)  # goes on (the flow's tasks end it)

        sys.unraisablehook = unraisable
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)


def main() -> None:
    """Console entry point: user errors print one clear line and exit 2, not a traceback; so does
    a write that fails during a run because of where it writes (a full disk: ``_store``). Ctrl-C
    stops the command within seconds, exit 130 (:func:`_stop_on_interrupt`)."""
    from scanforest.kernels.errors import ScanforestError

    from ._store import write_failure

    _stop_on_interrupt()
    args = sys.argv[1:]
    if args and args[0] in FLOW_COMMANDS - CHECK_FIRST and not {"--help", "-h"} & set(args):
        from scanforest.flows.prefect_api import start_prefect_api

        start_prefect_api()
    try:
        app()
    except KeyboardInterrupt:
        _quiet_exit()
    except SystemExit as exc:
        if exc.code == 130:  # typer's answer to a KeyboardInterrupt
            _quiet_exit()
        raise
    except ScanforestError as exc:
        if type(exc).__name__ == "Interrupted":  # a task's stop after a Ctrl-C (flows.cluster): not an error
            _quiet_exit()
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except OSError as exc:
        line = write_failure(exc)
        if line is None:
            raise
        typer.secho(f"error: {line}", fg=typer.colors.RED, err=True)
        sys.exit(2)

