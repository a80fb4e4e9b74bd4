"""Shared fixtures: GPU skipping, the real PCL data folder, seeded randomness."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
PCL_DIR = Path(os.environ.get("SCANFOREST_PCL_DATA", REPO.parent / "shared" / "data" / "pcl"))


def pytest_configure(config):
    """Each test process (``-n 2`` runs two) gets its own Prefect home: the temporary Prefect APIs
    that flows start keep their SQLite database there, and two servers writing one file at once
    can fail with "database is locked"."""
    import tempfile

    if "PREFECT_API_URL" not in os.environ:
        os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="scanforest-test-prefect-")
    # ``--dist loadfile`` hands out files in the order of :func:`pytest_collection_modifyitems`
    # only without pytest-xdist's reordering by test count (on by default since xdist 3.6), which
    # put the one-test files that run the archive (minutes each) last, after every short file
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.fixture(scope="session")
def prefect_api() -> str:
    """This test process's Prefect API (the temporary local one its in-process flows use, started
    once), for the command-line tests whose subject is not the API's own start: a user with a
    Prefect server (``PREFECT_API_URL``) runs the same commands. The local API's start on a fresh
    machine is the user-path tests' (test_user_paths, test_noop_and_demo, test_prefect_server,
    test_user_errors); a command that starts its own costs CI's 2 cores 5-6 s of CPU, and 52 such
    starts were 13% of a CI run's CPU (2026-11-28)."""
    from scanforest.flows.prefect_api import ensure_prefect_api

    return ensure_prefect_api()


def _gpu() -> bool:
    from scanforest.kernels.backend import gpu_available

    return gpu_available()


#: the files that take longest on CI's 2 cores (subprocesses as a user runs them), longest first:
#: ``-n 2 --dist loadfile`` hands files to the workers in collection order, so these start first
#: and the short files fill in behind them instead of one long file running alone at the end
SLOW_FILES = ("test_user_paths.py", "test_prefect_server.py", "test_noop_and_demo.py",
              "test_store_integrity.py", "test_user_errors.py", "test_concurrent_stages.py", "test_motion.py",
              "test_deployments.py")

#: files that run the archive with the test run's numba cache (not a cold one): scheduled after the
#: in-process files that compile the same kernels (recognition, matching), so that they load them
#: instead of compiling them in three processes at once at the start (127 -> about 50 s on CI)
AFTER = {"test_archive_resume.py": "test_recognize_flow.py"}


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}

    def key(it):
        name = it.path.name
        return rank.get(name, len(SLOW_FILES)), (AFTER[name] + "~") if name in AFTER else name

    items.sort(key=key)  # stable: in-file order kept
    if _gpu():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: the reason of a real-data test skipped for want of the data (counted in the run's summary)
NO_PCL = "real data folder {} is absent"


@pytest.fixture(scope="session")
def pcl_dir() -> Path:
    """The PCL test clouds (../shared/data/pcl, or ``SCANFOREST_PCL_DATA``); tests using it skip
    when it is absent, and the run's summary says how many did. ``SCANFOREST_REQUIRE_PCL=1``
    (``.ci/gpu-check`` with ``.pcldata/``) makes the absence an error instead."""
    if not PCL_DIR.is_dir():
        if os.environ.get("SCANFOREST_REQUIRE_PCL") == "1":
            pytest.fail(f"SCANFOREST_REQUIRE_PCL=1 but the real data folder {PCL_DIR} is absent")
        pytest.skip(NO_PCL.format(PCL_DIR))
    return PCL_DIR


def pytest_terminal_summary(terminalreporter):
    """Tests that did not run for want of real data or of headless Chromium, said in one line
    each at the end of the run (a skip among hundreds is easy to miss)."""
    for what, needle in (("on real data", NO_PCL.split("{}")[0]), ("of the report in Chromium", "Chromium")):
        n = sum(needle in str(getattr(r, "longrepr", "")) for r in terminalreporter.stats.get("skipped", []))
        if n:
            terminalreporter.write_line(f"NOTE: {n} test(s) {what} did not run (see the skip reasons: pytest -rs)",
                                        yellow=True, bold=True)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)
