"""The deployment table as operators meet it: `scanforest serve` and `scanforest run` refuse
wrong or missing parameters and a dead API in one line (exit 2, no traceback) before anything is
registered, `deploy/prefect.yaml` is the table's output, and the archive chain runs every stage."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from scanforest.flows.deployments import DEPLOYMENTS, prefect_yaml, runner_deployments
from scanforest.kernels.errors import InputError

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "scanforest.deploy.cli"]


def _cli(*args, api=None):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    if api:
        env["PREFECT_API_URL"] = api
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True, timeout=120)


def _one_line_error(res, *words):
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("args, words", [
    (["serve", "--param", "store=/s.zarr", "--param", "colour=red"], ["takes --param colour"]),
    (["serve", "--only", "describe", "--param", "store=/s.zarr", "--param", "source=/in"], ["(describe)", "source"]),
    (["serve", "--only", "ingest", "--param", "store=/s.zarr"], ["deployment ingest", "source"]),
    (["serve", "--only", "ingest", "--only", "describe"], ["deployment ingest needs parameter source, store",
                                                           "deployment describe needs parameter store"]),
    (["serve", "--only", "recognize", "--cron", "0 * * * *", "--param", "store=/s.zarr"],
     ["deployment recognize", "models"]),
    (["run", "ingest", "--param", "colour=red"], ["ingest takes no parameter colour"]),
    (["run", "ingest", "--param", "colour"], ["--param takes KEY=VALUE"]),
    (["run", "ingest"], ["no Prefect API", "PREFECT_API_URL"]),
])
def test_operator_mistakes_are_one_line(args, words):
    _one_line_error(_cli(*args), *words)


def test_run_without_a_reachable_api_is_one_line():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _one_line_error(_cli("run", "ingest", api=f"http://127.0.0.1:{port}/api"), "no Prefect API answers at")


def test_params_go_only_to_the_flows_that_take_them():
    deps = {d.name: d for d in runner_deployments(
        parameters={"store": "/s.zarr", "source": "/in", "workers": 2}, schedules=True)}
    assert set(deps) == set(DEPLOYMENTS)
    assert deps["ingest"].parameters == {"store": "/s.zarr", "source": "/in", "workers": 2}
    assert deps["describe"].parameters == {"store": "/s.zarr", "workers": 2}
    assert deps["index-build"].parameters == {"store": "/s.zarr"}  # takes no workers
    assert deps["archive"].parameters == {"store": "/s.zarr", "source": "/in", "workers": 2}
    # schedules from the table; on-demand deployments leave their per-run parameters to each run
    assert [s.schedule.cron for s in deps["ingest"].schedules] == ["*/30 * * * *"]
    assert deps["recognize"].schedules == [] and "models" not in deps["recognize"].parameters
    with pytest.raises(InputError, match="deployment archive needs parameter store"):
        runner_deployments(["archive"], schedules=False)


def test_cron_replaces_the_schedules_and_a_bad_one_is_one_line():
    """serve's documented `--cron '*/5 * * * *'` with every deployment was refused (it scheduled
    the on-demand ones, whose per-run parameters then were missing); an invalid cron string was a
    65-line pydantic traceback, exit 1."""
    deps = {d.name: d for d in runner_deployments(parameters={"store": "/s.zarr", "source": "/in"},
                                                  cron="*/5 * * * *")}
    assert [s.schedule.cron for s in deps["ingest"].schedules] == ["*/5 * * * *"]
    assert deps["recognize"].schedules == [] and deps["align"].schedules == []
    only = runner_deployments(["recognize"], parameters={"store": "/s.zarr", "models": ["m"]}, cron="0 * * * *")
    assert [s.schedule.cron for s in only[0].schedules] == ["0 * * * *"]  # named: scheduled
    for bad in ("not a cron", "61 * * * *"):
        with pytest.raises(InputError, match="is not a cron schedule"):
            runner_deployments(["ingest"], parameters={"store": "/s.zarr", "source": "/in"}, cron=bad)
    r = _cli("serve", "--only", "ingest", "--param", "store=/tmp/x.zarr", "--param", "source=/tmp", "--cron", "61 * * * *")
    _one_line_error(r, "is not a cron schedule")


def test_serve_checks_the_runs_inputs_before_it_serves(tmp_path):
    """serve registered and served deployments whose every run then failed (a store in a folder
    that does not exist, an ingest source that does not exist, a scheduler nobody listens at):
    one line, exit 2, before anything is registered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _one_line_error(_cli("serve", "--only", "describe", "--param", f"store={tmp_path}/no/such/dir/s.zarr"),
                    "its folder", "does not exist")
    _one_line_error(_cli("serve", "--only", "ingest", "--param", f"store={tmp_path}/s.zarr",
                         "--param", f"source={tmp_path}/nothing"), "ingest source", "does not exist")
    _one_line_error(_cli("serve", "--only", "describe", "--param", f"store={tmp_path}/s.zarr",
                         "--param", f"scheduler=tcp://127.0.0.1:{port}"), "cannot reach the Dask scheduler")


def test_committed_prefect_yaml_is_generated_from_the_table():
    committed = (REPO / "deploy" / "prefect.yaml").read_text()
    assert committed == prefect_yaml(), "regenerate: scanforest deployments --yaml > deploy/prefect.yaml"
    doc = yaml.safe_load(committed)
    by_name = {d["name"]: d for d in doc["deployments"]}
    assert list(by_name) == list(DEPLOYMENTS)
    for name, spec in DEPLOYMENTS.items():
        d = by_name[name]
        assert d["entrypoint"] == spec.entrypoint
        assert [s["cron"] for s in d["schedules"]] == ([spec.cron] if spec.cron else [])
        assert set(d["parameters"]) <= set(spec.accepts())  # a key the flow lacks fails every run
        assert d["work_pool"]["name"] == "scanforest"


def _forget(store: str, sid: str, stages) -> None:
    """Drop stage records of a scan, as a run killed before writing them leaves it."""
    from scanforest.tasks.store import ScanStore

    grp = ScanStore(store).root["scans"][sid]
    grp.attrs["stages"] = {k: v for k, v in grp.attrs.get("stages", {}).items() if k not in stages}


def test_archive_flow_runs_every_stage_and_resumes(tmp_path, monkeypatch):
    """One pipeline: the library is built first, the scenes are described as recognition describes
    them and matched against an index over the library, and recognition takes both from the store.
    The one pass (the default) and the staged passes write the same stages and detections. Every
    stage of one run uses the same local cluster, started once."""
    import shutil

    import scanforest.flows.cluster as cluster
    from scanforest.flows.archive import archive_flow
    from scanforest.flows.prefect_api import ensure_prefect_api
    from scanforest.kernels.synthetic.scenes import recognition_presets
    from scanforest.tasks.recognize import library_hash, recognize_scan
    from scanforest.tasks.store import ScanStore, stage_digest
    from scanforest.tasks.synth import write_archive

    write_archive(tmp_path / "arch", n_models=2, n_scenes=2, points_per_scene=12_000, points_per_model=3_000)
    store = str(tmp_path / "s.zarr")
    lib_params, rec_params = recognition_presets("cpu", 12_000)
    kw = dict(store=store, index_params={"method": "exact"}, library_params=lib_params, recognize=rec_params,
              device="cpu", workers=1, progress=False)
    ensure_prefect_api()
    started = []
    real_cluster = cluster._local_cluster
    monkeypatch.setattr(cluster, "_local_cluster", lambda *a, **k: started.append(a) or real_cluster(*a, **k))
    first = archive_flow(source=str(tmp_path / "arch"), pipeline="staged", **kw)
    assert len(started) == 1 and cluster._scope is None  # four stages, one cluster, closed at the end
    assert first["ingest"]["ingested"] == 4 and first["library"]["status"] == "built"
    assert first["describe"]["described"] == 2  # the scenes: the library describes the models
    assert first["match"]["matched"] == 2 and first["recognize"]["recognized"] == 2
    assert first["recognize"]["from_stored"] == 2 and first["recognize"]["recomputed"] == 0
    assert ScanStore(store, mode="r").catalog.index_attrs("models")["library"] == {"name": "default",
                                                       "content_hash": library_hash(store, "default")}
    st = ScanStore(store, mode="r")
    scenes = ("scenes__scene_0000.pcd", "scenes__scene_0001.pcd")
    for sid in scenes:
        assert st.has_stage(sid, "match") and st.stage(sid, "recognize")["source"] == "stored"
        assert st.stage(sid, "describe")["keypoint_radius"] == rec_params["scene_ss"]
    again = archive_flow(**kw)  # nothing new: the one pass finds the staged passes' work done
    assert "ingest" not in again and again["library"]["status"] == "unchanged"
    assert again["process"]["skipped"] == 2 and again["process"]["described"] == 0

    # the one pass on a fresh copy of the ingested store: the same stages, records and detections
    one = str(tmp_path / "one.zarr")
    shutil.copytree(store, one)
    for sid in scenes:
        _forget(one, sid, ("describe", "match", "recognize"))
    res = archive_flow(**{**kw, "store": one})
    assert set(res) == {"library", "index-build", "process"}
    p = res["process"]
    assert (p["recognized"], p["described"], p["matched"], p["failed"]) == (2, 2, 2, 0)
    # the busy time is the tasks' wall time on the workers: never more than the workers had
    assert 0 < p["task_seconds"] <= p["scenes_seconds"] * p["workers"]
    assert p["cpu_seconds"] > 0  # the workers' CPU while their batches ran (the host's share of a scene)
    o = ScanStore(one, mode="r")
    for sid in scenes:
        for name in ("kp_index", "kp_shot", "match_ids", "match_dist", "det_model", "det_pose"):
            np.testing.assert_array_equal(o.read(sid, name), st.read(sid, name), err_msg=f"{sid} {name}")
        d, m, r = (o.stage(sid, x) for x in ("describe", "match", "recognize"))
        assert m["describe"] == stage_digest(d)  # the chain of records as the stages write it
        assert r["inputs"] == {"describe": stage_digest(d), "match": stage_digest(m)}
        assert r["source"] == "stored" and r["detections"] == st.stage(sid, "recognize")["detections"]
    # the staged recognize finds the one pass's work done; a scene whose recognition was lost
    # (a killed run) is recognised again from its stored description and matches
    for sid in scenes:
        assert recognize_scan(one, sid, "default", rec_params, device="cpu")["status"] == "skipped"
    _forget(one, scenes[0], ("recognize",))
    p = archive_flow(**{**kw, "store": one})["process"]
    assert (p["recognized"], p["skipped"], p["described"], p["matched"]) == (1, 1, 0, 0)
    np.testing.assert_array_equal(o.read(scenes[0], "det_pose"), st.read(scenes[0], "det_pose"))

    with pytest.raises(InputError, match="describes scenes as recognition does; describe= asks for keypoint_radius"):
        archive_flow(**{**kw, "describe": {"keypoint_radius": 0.05}})
    with pytest.raises(InputError, match="fewer than recognition uses"):
        archive_flow(**{**kw, "k": 1})
    with pytest.raises(InputError, match="matches the models pattern"):
        archive_flow(**{**kw, "models": "nothing__*"})
    # every scan a model (--models '*'): the library is built and the summary says why no scene ran
    plain = {k: v for k, v in lib_params.items() if k != "views"}  # (the scenes have no given normals)
    p = archive_flow(**{**kw, "store": one, "models": "*", "library": "all", "index": "all",
                        "library_params": plain})["process"]
    assert p["scenes"] == 0 and p["note"] == (f"no scene to recognise: all 4 scans of {one} are models (the models "
                                              "pattern '*'); scenes added outside the models are recognised by "
                                              "the next run")
    with pytest.raises(InputError, match="pipeline must be one of"):
        archive_flow(**{**kw, "pipeline": "fast"})
