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


def _gpu() -> bool:
    from scanforest.kernels.backend import gpu_available

    return gpu_available()


def pytest_collection_modifyitems(config, items):
    if _gpu():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pcl_dir() -> Path:
    """The PCL test clouds (../shared/data/pcl); tests using it skip when it is absent."""
    if not PCL_DIR.is_dir():
        pytest.skip(f"real data folder {PCL_DIR} is absent")
    return PCL_DIR


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)
