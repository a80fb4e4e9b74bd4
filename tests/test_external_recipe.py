"""deploy/recipes/external-cluster.sh (issue 39): an external `dask scheduler` and `dask worker`
processes started from the shell, `scanforest match --scheduler` run twice, one worker SIGKILLed
mid-match in the second run; the stored matches must be identical.

The whole recipe is five scanforest commands and a Prefect server on a 2-core machine: about
60 s there while other tests run (CI's `-n 2`), too long for CI's budget, so it runs only with
SF_SLOW_RECIPE=1. Its input checks (exit 2, one line) are quick and always run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "recipes" / "external-cluster.sh"
BIN = Path(sys.executable).parent


def _env(**kw) -> dict[str, str]:
    """This test's Python environment for the recipe: its `scanforest` and `dask` (the scripts
    beside this Python, else `python -m`), on CPU workers."""
    sf = BIN / "scanforest"
    dask = BIN / "dask"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHON": sys.executable,
           "SF": str(sf) if sf.exists() else f"{sys.executable} -m scanforest.deploy.cli",
           "DASK": str(dask) if dask.exists() else f"{sys.executable} -m dask", "DEVICE": "cpu"}
    env.update(kw)
    return env


def _run(args, env, cwd, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_recipe_without_dask_says_so_in_one_line(tmp_path):
    env = _env(DASK="no-such-dask-command")
    r = _run([str(tmp_path / "w")], env, tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "no-such-dask-command" in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()  # refused before anything was made


def test_recipe_refuses_ucx_without_ucxx_and_a_foreign_folder(tmp_path):
    try:
        import distributed_ucxx  # noqa: F401
        import ucxx  # noqa: F401
    except ImportError:
        r = _run([str(tmp_path / "w")], _env(PROTOCOL="ucx"), tmp_path)
        assert r.returncode == 2 and "ucx" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    r = _run([str(tmp_path / "mine")], _env(), tmp_path)
    assert r.returncode == 2 and "not empty" in r.stderr, r.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SF_SLOW_RECIPE") != "1",
                    reason="the whole recipe takes about a minute on 2 cores: set SF_SLOW_RECIPE=1")
def test_recipe_on_cpu_workers_passes_with_a_worker_killed_mid_match(tmp_path):
    """Run from another folder, with a relative WORKDIR: exit 0 and the PASS line, the kill mid-match."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _env(WORKERS="2", SCANS="6", POINTS="4000")
    r = _run(["work"], env, elsewhere, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    m = re.search(r"^PASS: (\d+) scans matched .* run A undisturbed ([\d.]+) s, run B ([\d.]+) s with worker w1 "
                  r"\(pid \d+, under its Nanny\) SIGKILLed at \+([\d.]+) s, when (\d+) of 6 scans", r.stdout, re.M)
    assert m, out
    assert int(m.group(1)) == 6 and float(m.group(4)) < float(m.group(3)) and int(m.group(5)) < 6, m.group(0)
    assert (elsewhere / "work" / "b.zarr").is_dir()
    # nothing the recipe started is left running: the workers' processes (the first ones, and the one
    # the Nanny started after the kill), the Nannies and the scheduler
    pids = [int(p) for p in re.findall(r"^   w\d+ (\d+) ", r.stdout, re.M)]
    pids += [int(p) for p in re.findall(r"came back as pid (\d+)", r.stdout)]
    assert len(pids) == 3, r.stdout
    port = re.search(r"at tcp://127\.0\.0\.1:(\d+)", r.stdout).group(1)
    for pattern in (f"tcp://127.0.0.1:{port}", f"--port {port}"):
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        assert not found, f"left running: {pattern}: {found}"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
