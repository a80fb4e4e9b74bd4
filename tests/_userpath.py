"""What the user-path tests share: the installed command run as a user runs it, in a fresh
environment (an empty numba cache, no Prefect API, no thread settings), and the checks that its
output is a result or exactly one error line."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SCANFOREST = str(Path(sys.executable).with_name("scanforest"))


def fresh_env(tmp_path_factory, *, cold: bool = True, api: str | None = None) -> dict[str, str]:
    """The environment of a fresh machine: an empty numba cache, an empty Prefect home, no Prefect
    API set, no thread settings of ours, nothing but what a user's shell has. ``cold=False``: a
    user's second run instead: the numba cache of the test run (the kernels compiled once serve
    every such test) and a Prefect home whose database is migrated (a copy of one migrated once
    per test process: a new one costs the first command 6-7 s of CI's 2 cores). ``api``: a user
    with a Prefect server instead (``PREFECT_API_URL``; conftest's ``prefect_api``)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_API_URL", "NUMBA_NUM_THREADS", "SCANFOREST_"))}
    home = tmp_path_factory.mktemp("prefect-home")
    if cold:
        env["NUMBA_CACHE_DIR"] = str(tmp_path_factory.mktemp("numba-cache-cold"))
    elif api is None:
        shutil.copy(_migrated_db(tmp_path_factory, env), home / "prefect.db")
    env.update(PREFECT_HOME=str(home), PYTHONUNBUFFERED="1", COLUMNS="120")
    if api is not None:
        env["PREFECT_API_URL"] = api
    return env


_MIGRATED: list[Path] = []


def _migrated_db(tmp_path_factory, env: dict[str, str]) -> Path:
    """A Prefect database migrated to this Prefect's schema, made once per test process."""
    if not _MIGRATED:
        home = tmp_path_factory.mktemp("prefect-home-migrated")
        subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                       env={**env, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
                       check=True, capture_output=True, timeout=300)
        _MIGRATED.append(home / "prefect.db")
    return _MIGRATED[0]


def sf(*args: str, env: dict, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``scanforest ARGS`` as a user types it, from the environment's own installation."""
    return subprocess.run([SCANFOREST, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess, code: int = 0) -> str:
    """The command succeeded (exit ``code``: 1 for a batch with failed scans) with no traceback
    anywhere in its output; its stdout."""
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    return proc.stdout


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, no traceback, and exactly one ``error:`` line, naming each of ``needles``."""
    lines = [ln for ln in proc.stderr.splitlines()
             if ln.strip() and not ln.startswith(("device:", "note:"))]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
