"""Operation commands: serve deployments, trigger one, list them (or print their prefect.yaml)."""
from __future__ import annotations

import json
from typing import Optional

import typer

from .core import number


def _parse_params(items: list[str] | None) -> dict:
    from scanforest.kernels.errors import InputError

    out = {}
    for item in items or []:
        if "=" not in item:
            raise InputError(f"--param takes KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def _check_served(params: dict) -> None:
    """The served runs' own inputs checked where they will run, before anything is registered: an
    ingest source that does not exist, a store whose folder does not exist, a scheduler nobody
    listens at (each run failed on them, one after another, while serve went on)."""
    source, store, sched = params.get("source"), params.get("store"), params.get("scheduler")
    if isinstance(source, str):
        from scanforest.tasks.ingest import check_source

        check_source(source, allow_empty=True)  # a drop folder may be empty between deliveries
    if isinstance(store, str) and "://" not in store:  # the commands' own check (ingest creates it)
        from scanforest.flows.inputs import absolute_path
        from scanforest.tasks.preflight import check_store_location

        check_store_location(absolute_path(store), create=True)
    if sched:
        from scanforest.flows.cluster import check_scheduler

        check_scheduler(str(sched))


def report_path(store: str) -> str:
    """Where ``report STORE`` writes without ``-o``: beside the store (``scans.zarr`` ->
    ``scans-report.html``), never into the current folder; where the store's folder cannot be
    written (a read-only mount, a URL), in ``$XDG_CACHE_HOME/scanforest/reports``."""
    import os

    from scanforest.flows.inputs import absolute_path

    path = absolute_path(store).rstrip("/")
    name = os.path.basename(path) or "store"
    stem = name[:-5] if name.endswith(".zarr") and len(name) > 5 else name
    folder = os.path.dirname(path)
    if "://" not in path and os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
        return os.path.join(folder, f"{stem}-report.html")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.makedirs(os.path.join(cache, "scanforest", "reports"), exist_ok=True)
    return os.path.join(cache, "scanforest", "reports", f"{stem}-report.html")


#: the deployments' parameters that name a path on the host that serves them
PATH_PARAMS = ("source", "store")


def missing_paths(parameters: dict) -> list[str]:
    """One line for each path parameter (:data:`PATH_PARAMS`) that does not exist on this host
    (for a store: nor its folder): the run reads it where its deployment is served, which may be
    another host, so it is said, not refused (a typo started a run that failed there)."""
    import os

    out = []
    for key in PATH_PARAMS:
        value = parameters.get(key)
        if not isinstance(value, str) or "://" in value or any(c in value for c in "*?["):
            continue
        there = os.path.exists(value) or (key == "store" and os.path.isdir(os.path.dirname(os.path.abspath(value))))
        if not there:
            out.append(f"--param {key}={value}: no such {'folder' if key == 'store' else 'path'} on this host "
                       "(the run reads it on the host that serves the deployment)")
    return out


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command()
    def serve(
        only: Optional[list[str]] = typer.Option(None, "--only", help="Serve only these deployments (repeatable)."),
        param: Optional[list[str]] = typer.Option(None, "--param", help="Parameter KEY=VALUE (JSON values) for "
                                                  "every served deployment whose flow takes KEY."),
        no_schedules: bool = typer.Option(False, help="Serve for on-demand runs only (no cron schedules)."),
        cron: Optional[str] = typer.Option(None, help="Cron schedule (UTC) for every served deployment instead "
                                           "of its own, e.g. '*/5 * * * *'."),
        limit: Optional[int] = typer.Option(None, callback=number, help="Maximum concurrent flow runs."),
    ):
        """Serve the deployments from this process (Prefect's serve): schedules fire with no other
        infrastructure. Needs a Prefect API (PREFECT_API_URL) that outlives this process."""
        import os

        from prefect import serve as prefect_serve

        from scanforest.flows.deployments import api_url, runner_deployments

        # parameters are checked before anything is registered: a wrong one fails here, not every run
        params = _parse_params(param)
        deps = runner_deployments(only, parameters=params, schedules=not no_schedules, cron=cron)
        _check_served(params)
        if os.environ.get("PREFECT_API_URL"):
            api_url()
        else:
            typer.secho("note: PREFECT_API_URL is not set; serving against a temporary local API that "
                        "stops with this process (start one with `prefect server start`).", err=True,
                        fg=typer.colors.YELLOW)
        prefect_serve(*deps, limit=limit)

    @app.command()
    def deployments(
        yaml: bool = typer.Option(False, "--yaml", help="Print deploy/prefect.yaml as generated from the table."),
    ):
        """List the deployments (name, schedule, required parameters), or print their prefect.yaml."""
        from scanforest.flows.deployments import DEPLOYMENTS, prefect_yaml

        if yaml:
            typer.echo(prefect_yaml(), nl=False)
            return
        for spec in DEPLOYMENTS.values():
            typer.echo(f"{spec.name:<12} {spec.cron or 'on demand':<14} needs: {', '.join(spec.required())}"
                       f"\t{spec.description}")

    @app.command()
    def report(
        store: str = typer.Argument(..., help="The Zarr scan store."),
        out: Optional[str] = typer.Option(None, "--out", "-o", help="HTML file to write (default: beside the "
                                          "store, STORE's name + '-report.html'; in ~/.cache/scanforest/reports "
                                          "where the store's folder cannot be written)."),
        bench_dir: str = typer.Option("bench-results", help="Folder of `scanforest bench` JSON files."),
    ):
        """Write an HTML report: runs, throughput over time, benchmark curves, detections, failures."""
        from scanforest.flows.report import write_report
        from scanforest.tasks.preflight import check_output_file

        if out is not None:  # a folder or a path inside a store (its zarr.json!) is refused before the work
            out = check_output_file(out, "--out")
        typer.echo(f"wrote {write_report(store, out or report_path(store), bench_dir=bench_dir)}")

    @app.command("run")
    def run_(
        deployment: str = typer.Argument(..., help="Deployment name (ingest, describe, ...) or FLOW/NAME."),
        param: Optional[list[str]] = typer.Option(None, "--param", help="Parameter KEY=VALUE (JSON values)."),
        wait: bool = typer.Option(True, help="Wait for the run to finish and print its final state."),
        timeout: float = typer.Option(3600, callback=number, help="Seconds to wait."),
    ):
        """Trigger one run of a served deployment through the Prefect API.

        Says so in one line, before waiting, when no Prefect API answers, the deployment is not
        registered or no process serves it, or the run would lack a required parameter."""
        from prefect.deployments import run_deployment

        from scanforest.flows.deployments import await_run, check_run, get

        spec = get(deployment)
        parameters = _parse_params(param)
        check_run(spec, parameters)
        for line in missing_paths(parameters):
            typer.echo(f"note: {line}", err=True)
        run = run_deployment(spec.full_name, parameters=parameters, timeout=0)
        if wait:  # a serve that died after the check is said within a minute, not after --timeout
            run = await_run(spec, run.id, timeout)
        state = run.state
        typer.echo(json.dumps({"flow_run_id": str(run.id), "name": run.name,
                               "state": state.type.value if state else None}))
        if wait and state is not None and not state.is_completed():
            typer.secho(f"{state.type.value}: {state.message}", err=True, fg=typer.colors.RED)
            raise typer.Exit(1)
