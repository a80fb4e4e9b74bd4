"""``scanforest check``: find (and with ``--repair`` fix) scans that are not what their attrs say."""
from __future__ import annotations

import json

import typer


def print_problems(title: str, problems: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("scan", "problem", "detail", "action"):
        table.add_column(col)
    for p in problems:
        table.add_row(p["scan_id"], p["problem"], p["detail"], p.get("action", "-"))
    Console().print(table)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command()
    def check(
        store: str = typer.Argument(..., help="The Zarr scan store."),
        repair: bool = typer.Option(False, "--repair", help="Remove damaged scans and stages so the next "
                                    "ingest or stage rewrites them."),
        quick: bool = typer.Option(False, "--quick", help="Check the metadata and that every chunk file "
                                   "exists, without reading the chunks (a chunk cut short or altered "
                                   "is then not found)."),
        json_out: bool = typer.Option(False, "--json", help="Print the problems (and repairs) as JSON."),
    ):
        """Check every scan against its attrs: leftover or incomplete groups, missing or short arrays,
        chunks that do not read back (cut short or altered on disk), stages recorded without their
        arrays, and ids that an older version gave several files. Exit 0 when clean, 1 when
        problems remain."""
        from scanforest.tasks.store import ScanStore

        st = ScanStore(store, mode="a" if repair else "r")
        found = st.verify(read=not quick)
        fixed = st.repair(read=not quick) if repair and found else []
        remaining = st.verify(read=not quick) if repair else found
        if fixed:
            st.write_run(_run_id(), {"flow": "repair", "records": fixed})
        if json_out:
            typer.echo(json.dumps({"store": store, "problems": found, "repaired": fixed,
                                   "remaining": remaining}, indent=2))
        elif not found:
            typer.echo(f"{store}: {len(st.scans())} scans, no problems")
        else:
            print_problems(f"check {store}", fixed + remaining)
            collided = [p for p in remaining if p["problem"] == "collision"]
            if collided:
                typer.echo(f"{len(collided)} collision(s): an ingest run of an older version wrote several files as "
                           "one scan id (its run record lists the id once per file); only an ingest of that "
                           "source gives each file its own id")
            if remaining:
                repairable = not repair and len(remaining) > len(collided)
                typer.secho(f"{len(remaining)} problem(s) remain" + ("; fix with --repair" if repairable else ""),
                            fg=typer.colors.YELLOW)
        raise typer.Exit(1 if remaining else 0)


def _run_id() -> str:
    """A run id in the style of the flows' run manifests (``repair-<time>-<random>``)."""
    import time
    import uuid

    return f"repair-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
