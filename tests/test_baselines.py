"""The external PCL baselines of the benchmarks: their output is parsed and reported, failures noted.

The binaries themselves (deploy/baselines/*.cpp) need PCL and are not built here; a stand-in
script prints lines in their format, so what is tested is scanforest's side of the contract.
"""
import json
import stat

import numpy as np
import pytest

from scanforest.deploy.bench._common import BenchReport
from scanforest.deploy.bench.recognize import _pcl_tutorial


def _fake(tmp_path, lines, rc=0):
    script = tmp_path / "fake_pcl"
    body = "\n".join(f"echo '{json.dumps(x)}'" for x in lines)
    script.write_text(f"#!/bin/sh\necho 'some PCL warning' >&2\n{body}\nexit {rc}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _run(total, pose):
    return {"threads": 2, "model_points": 10, "scene_points": 20, "model_keypoints": 3, "scene_keypoints": 5,
            "correspondences": 7, "instances": 1, "normals_s": 0.1, "sampling_s": 0.01, "shot_s": 0.2,
            "matching_s": 0.3, "grouping_s": 0.05, "total_s": total, "group_sizes": [7],
            "poses": [list(np.asarray(pose, float).ravel())]}


def test_pcl_tutorial_takes_the_median_run_and_its_poses(tmp_path):
    pose = np.eye(4)
    pose[:3, 3] = (0.1, -0.2, 0.3)
    binary = _fake(tmp_path, [_run(1.5, pose), _run(1.1, pose), _run(1.3, pose)])
    rep = BenchReport("recognize", {})
    pcl = _pcl_tutorial(rep, binary, tmp_path, 2, 3)
    assert pcl["total_s"] == pytest.approx(1.3)
    np.testing.assert_array_equal(pcl["poses"][0], pose)
    (row,) = rep.rows
    assert row.value == pytest.approx(1.3) and row.unit == "s" and not row.higher_is_better
    assert "1 instance(s)" in rep.notes[0]


@pytest.mark.parametrize("lines,rc", [([], 0), ([_run(1.0, np.eye(4))], 3)])
def test_pcl_tutorial_failure_is_a_note_not_a_crash(tmp_path, lines, rc):
    rep = BenchReport("recognize", {})
    assert _pcl_tutorial(rep, _fake(tmp_path, lines, rc), tmp_path, 2, 1) is None
    assert rep.rows == [] and "failed" in rep.notes[0]
    assert _pcl_tutorial(rep, tmp_path / "missing", tmp_path, 2, 1) is None


def test_utilization_sampler_sees_a_busy_core():
    """The stage sampler of ``bench archive``: a busy thread shows as host CPU load; the GPU
    figure is absent without nvidia-smi and a percentage with it."""
    import shutil
    import time

    from scanforest.deploy.bench._common import Utilization

    with Utilization(period=0.1) as u:
        t = time.perf_counter()
        x = 0
        while time.perf_counter() - t < 1.0:
            x += 1
    assert u.cpu is not None and 0 < u.cpu <= 100
    if shutil.which("nvidia-smi") is None:
        assert u.gpu is None and "gpu_busy_pct" not in u.extra()
    else:
        assert u.gpu is not None and 0 <= u.gpu <= 100
    assert u.extra()["host_cpu_busy_pct"] == round(u.cpu, 1)
