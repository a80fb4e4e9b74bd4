"""Repository contracts: CI runs README's test command; the package maps the fixed folders."""
from __future__ import annotations

import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    cmd = next(ln.strip() for ln in ci.splitlines() if "pytest" in ln)
    assert cmd in readme


def test_namespace_maps_the_top_level_folders():
    for sub, folder in (("kernels", "kernels"), ("tasks", "tasks"), ("flows", "flows"), ("deploy", "deploy"),
                        ("deploy.cli", "deploy/cli"), ("deploy.bench", "deploy/bench")):
        mod = importlib.import_module(f"scanforest.{sub}")
        assert Path(mod.__file__).resolve().parent == REPO / folder
    import scanforest

    assert scanforest.read.__module__ == "scanforest.tasks.readers"
    for name in scanforest.__all__:
        assert getattr(scanforest, name) is not None  # every advertised name resolves


def test_cli_help_for_every_command():
    from typer.testing import CliRunner

    from scanforest.deploy.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("ingest", "info", "demo", "bench"):
        assert cmd in res.stdout
        assert runner.invoke(app, [cmd, "--help"]).exit_code == 0
