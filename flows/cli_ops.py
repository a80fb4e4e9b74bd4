"""Operation commands: serve deployments, trigger one."""
from __future__ import annotations

import json
from typing import Optional

import typer


def _parse_params(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise typer.BadParameter(f"--param takes KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command()
    def serve(
        only: Optional[list[str]] = typer.Option(None, "--only", help="Serve only these deployments (repeatable)."),
        param: Optional[list[str]] = typer.Option(None, "--param", help="Default parameter KEY=VALUE (JSON values)."),
        no_schedules: bool = typer.Option(False, help="Serve for on-demand runs only (no cron schedules)."),
        limit: Optional[int] = typer.Option(None, help="Maximum concurrent flow runs."),
    ):
        """Serve the deployments from this process (Prefect's serve): schedules fire with no other
        infrastructure. Needs a Prefect API (PREFECT_API_URL) that outlives this process."""
        import os

        from prefect import serve as prefect_serve

        from .deployments import runner_deployments

        if not os.environ.get("PREFECT_API_URL"):
            typer.secho("note: PREFECT_API_URL is not set; serving against a temporary local API that "
                        "stops with this process (start one with `prefect server start`).", err=True,
                        fg=typer.colors.YELLOW)
        deps = runner_deployments(only, parameters=_parse_params(param), schedules=not no_schedules)
        prefect_serve(*deps, limit=limit)

    @app.command()
    def report(
        store: str = typer.Argument(..., help="The Zarr scan store."),
        out: str = typer.Option("scanforest-report.html", "--out", "-o", help="HTML file to write."),
        bench_dir: str = typer.Option("bench-results", help="Folder of `scanforest bench` JSON files."),
    ):
        """Write an HTML report: runs, throughput over time, benchmark curves, detections, failures."""
        from .report import write_report

        typer.echo(f"wrote {write_report(store, out, bench_dir=bench_dir)}")

    @app.command("run")
    def run_(
        deployment: str = typer.Argument(..., help="Deployment name (ingest, describe, ...) or FLOW/NAME."),
        param: Optional[list[str]] = typer.Option(None, "--param", help="Parameter KEY=VALUE (JSON values)."),
        wait: bool = typer.Option(True, help="Wait for the run to finish and print its final state."),
        timeout: float = typer.Option(3600, help="Seconds to wait."),
    ):
        """Trigger one run of a served deployment through the Prefect API."""
        from prefect.deployments import run_deployment

        from .deployments import get

        spec = get(deployment)
        run = run_deployment(spec.full_name, parameters=_parse_params(param), timeout=timeout if wait else 0)
        state = run.state
        typer.echo(json.dumps({"flow_run_id": str(run.id), "name": run.name,
                               "state": state.type.value if state else None}))
        if wait and state is not None and not state.is_completed():
            raise typer.Exit(1)
