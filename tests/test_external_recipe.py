"""deploy/recipes/external-cluster.sh (issue 39): an external `dask scheduler` and `dask worker`
processes started from the shell, `scanforest match --scheduler` run twice, one worker SIGKILLed
mid-match in the second run; the stored matches must be identical.

The whole recipe is five scanforest commands and a Prefect server: about 40 s on an idle 2-core
machine. It runs in CI: skipped there (``SF_SLOW_RECIPE``) it broke on 2026-11-27 and nobody saw it
for ten days (its last step called a store function that the one-store-object change removed).
Its input checks (exit 2, one line) and its comparison of the two runs' stores
(`deploy/recipes/compare_matches.py`, on stores written here) are quick tests of their own."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "recipes" / "external-cluster.sh"
COMPARE = SCRIPT.with_name("compare_matches.py")
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


def _matched_stores(tmp_path):
    """A store with a model scan under the index "default" and two query scans, and its copies A
    and B as the recipe's two runs leave them (each query scan's match stage written)."""
    import shutil

    from scanforest.tasks.store import ScanStore

    rng = np.random.default_rng(5)
    st = ScanStore(tmp_path / "s.zarr", create=True)
    for sid in ("models__m", "scene_0", "scene_1"):
        st.write_scan(sid, {"points": rng.random((50, 3), dtype=np.float32)}, {"source": sid})
    with st.catalog.new_index("default") as g:
        g.attrs.update({"scans": ["models__m"], "complete": True})
    paths = {}
    for name in ("a", "b"):
        paths[name] = str(tmp_path / f"{name}.zarr")
        shutil.copytree(st.path, paths[name])
        run = ScanStore(paths[name])
        for i, sid in enumerate(("scene_0", "scene_1")):
            ids = np.arange(40, dtype=np.int64).reshape(10, 4) + i
            dist = np.linspace(0, 1, 40, dtype=np.float32).reshape(10, 4)
            run.write_stage(sid, "match", {"match_ids": ids, "match_dist": dist},
                            {"index": "default", "content_hash": "h", "k": 4, "queries": 10})
    (tmp_path / "match-a.json").write_text('{"matched": 2, "k": 4, "shards": 1, "workers": 2}')
    (tmp_path / "match-b.json").write_text('{"matched": 2, "k": 4, "shards": 1, "workers": 2}')
    return st.path, paths


def _compare(store, paths, work, n_scans="2"):
    args = [store, paths["a"], paths["b"], str(work), "tcp://127.0.0.1:9", "w1", "123", n_scans, "cpu", "tcp",
            "1", "1.0", "2.0", "0.5", "1"]
    return subprocess.run([sys.executable, str(COMPARE), *args], capture_output=True, text=True, timeout=120)


def test_the_recipes_comparison_passes_equal_runs_and_names_what_differs(tmp_path):
    """The recipe's last step as the recipe runs it (a script beside it, the store's API of today):
    equal stores PASS; a flipped bit of one query's match_dist, a missing stage or a query scan too
    few are each a FAIL naming the scan and what differs, exit 1."""
    import importlib.util

    from scanforest.tasks.store import ScanStore

    store, paths = _matched_stores(tmp_path)
    r = _compare(store, paths, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("PASS: 2 scans matched (20 descriptors, k=4, 1 shards on 2 cpu workers over tcp)"), r.stdout
    assert "the cluster could not be asked afterwards" in r.stdout  # no scheduler at that address
    assert _compare(store, paths, tmp_path, n_scans="3").returncode == 1

    spec = importlib.util.spec_from_file_location("compare_matches", COMPARE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    b = ScanStore(paths["b"])
    dist = b.read("scene_1", "match_dist").copy()
    dist.view(np.uint32)[3, 2] ^= 1  # one bit of one row
    b.write_stage("scene_1", "match", {"match_ids": b.read("scene_1", "match_ids"), "match_dist": dist},
                  {"index": "default", "content_hash": "h", "k": 4, "queries": 10})
    queries, bad, rows = mod.differences(store, paths["a"], paths["b"])
    assert queries == ["scene_0", "scene_1"] and rows == 20
    assert bad == [("scene_1", "match_dist: 1 of 10 rows differ")]
    r = _compare(store, paths, tmp_path)
    assert r.returncode == 1 and "FAIL" in r.stdout and "scene_1: match_dist: 1 of 10 rows differ" in r.stdout, r.stdout


@pytest.mark.slow
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
