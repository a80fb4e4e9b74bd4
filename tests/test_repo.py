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


def test_the_package_docstrings_example_runs(tmp_path, monkeypatch):
    """``help(scanforest)``'s example, run as written on a synthetic scene written as scene.pcd (its
    other inputs given): it once passed sf.normals' (normals, curvature) pair on to sf.shot."""
    import numpy as np

    import scanforest as sf
    from scanforest.kernels import synthetic
    from scanforest.tasks.readers import write_cloud

    block = sf.__doc__.split("::\n", 1)[1].split("\n\n", 1)[0]
    code = "\n".join(line[4:] for line in block.splitlines() if line.strip())
    assert "sf.shot(" in code and "sf.recognize(" in code, code
    monkeypatch.chdir(tmp_path)
    model = synthetic.model_library(1, 2_000, seed=0)[0]
    scene = synthetic.make_scene([model], n_instances=1, n_points=6_000, seed=1)
    write_cloud("scene.pcd", scene.points.astype(np.float32))
    rng = np.random.default_rng(0)
    ns = {"model_desc": rng.random((500, 352), dtype=np.float32), "scene_points": scene.points,
          "model_points": model.points, "observed": model.points[:500], "reference": model.points[:500] + 0.001}
    exec(compile(code, "scanforest.__doc__", "exec"), ns)
    assert ns["ids"].shape == (len(ns["desc"]), 4) and len(ns["desc"]) > 0
    assert ns["result"].status == "converged"
