"""The commands' numeric options, checked as they are parsed (``tasks.options``), in-process: every
``int`` and ``float`` option of every command has a rule and its callback, a bad value is one
line naming the option as the user types it (before any flow, cluster or Prefect API: the rules
run while click parses the arguments), and the stages' own input checks name the options too.
Before, ``--rf-rad inf``, ``--model-ss inf``, ``library build --normal-k 2``, ``--random-dims 0``
and ``--seed -1`` failed on a Dask worker 5-15 s in, under the kernel's names (``rf_rad``, ``k``),
with a failed run recorded in the store; ``archive --rf-rad inf`` ingested the whole source
first. The commands as a user runs them: ``test_user_errors.py``."""
from __future__ import annotations

import math

import numpy as np
import pytest
import typer

from scanforest.deploy.cli import app
from scanforest.kernels.errors import InputError
from scanforest.tasks.options import OPTIONS, check_option


def _commands():
    """``(name, click command)`` of every command but the benchmarks (and ``flow``, ``motion``'s
    deprecated alias: the same functions)."""
    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                if name not in ("bench", "flow"):
                    yield from walk(sub, path + [name])
        else:
            yield " ".join(path), cmd
    return list(walk(typer.main.get_command(app), []))


def _numeric(cmd):
    return [p for p in cmd.params if p.type_descriptor.annotation in (int, float) and "--workers" not in p.opts]


def _bad_values(rule) -> list[str]:
    """Values the rule refuses, as typed."""
    bad = []
    if rule.minimum is not None:
        bad.append(str(int(rule.minimum) - 1) if rule.integer else str(rule.minimum - 0.5))
    if rule.maximum is not None:
        bad.append(str(int(rule.maximum) + 1))
    if rule.positive:
        bad.append("0")
    if rule.below is not None:
        bad.append(str(rule.below))
    if not rule.integer:
        bad += ["inf", "nan"]
    return bad


def test_every_numeric_option_is_checked_as_it_is_parsed():
    """Each ``int``/``float`` option of each command: its rule's bad values are refused while the
    arguments are parsed (click's ``make_context`` runs the callbacks, not the command), in one
    line starting with the option; its default passes."""
    seen = 0
    for name, cmd in _commands():
        for param in _numeric(cmd):
            flag = next((o for o in param.opts if o.startswith("--")), param.opts[0])
            assert flag in OPTIONS, f"{name} {flag}: no rule in tasks.options.OPTIONS"
            rule = OPTIONS[flag]
            check_option(flag, param.default)  # the default is a good value
            for bad in _bad_values(rule):
                with pytest.raises(InputError) as err:
                    cmd.make_context(name, [param.opts[0], bad])
                assert str(err.value).startswith(f"{flag} must be "), (name, flag, bad, str(err.value))
                seen += 1
    assert seen > 80


@pytest.mark.parametrize("flag,value,message", [
    ("--normal-k", 2, "--normal-k must be at least 3 (a plane needs 3 neighbours), got 2"),
    ("--normal-k", 2.5, "--normal-k must be an integer, got 2.5"),
    ("--rf-rad", math.inf, "--rf-rad must be a positive finite number, got inf"),
    ("--model-ss", "x", "--model-ss must be a positive finite number, got 'x'"),
    ("--random-dims", 0, "--random-dims must be in 1..32, got 0"),
    ("--keypoint-radius", -1.0, "--keypoint-radius must be a finite number >= 0 (0 = every point), got -1.0"),
    ("--recall", 1.0, "--recall must be in (0, 1)"),
    ("-k", 300, "-k must be in 1..256"),
    ("--normal-k", True, "--normal-k must be an integer, got True"),
])
def test_a_bad_value_is_one_line_naming_the_option(flag, value, message):
    with pytest.raises(InputError) as err:
        check_option(flag, value)
    assert str(err.value).startswith(message), str(err.value)


def test_bounds_are_the_kernels():
    from scanforest.kernels.knn.bruteforce import MAX_K
    from scanforest.kernels.knn.kdtree import MAX_RANDOM_DIMS

    assert OPTIONS["-k"].maximum == MAX_K and OPTIONS["--random-dims"].maximum == MAX_RANDOM_DIMS
    assert check_option("--keypoint-radius", 0.0) == 0.0 and check_option("--rf-rad", None) is None


@pytest.fixture
def store(tmp_path):
    from scanforest.tasks.store import ScanStore

    st = ScanStore(tmp_path / "s.zarr", create=True)
    st.write_scan("m.pcd", {"points": np.random.default_rng(0).random((50, 3)).astype(np.float32)}, {"sha256": "m"})
    return str(tmp_path / "s.zarr")


def test_the_stages_input_checks_name_the_options(store):
    """A run started another way (a deployment's parameters) is checked by the same rules, before
    any work, under the options' names."""
    from scanforest.flows.inputs import check_index_build, check_match, check_recognize_params
    from scanforest.flows.motion import check_motion
    from scanforest.tasks.library import check_library_build

    cases = [
        (lambda: check_library_build(store, ["m.pcd"], {"normal_k": 2}, None), "--normal-k must be at least 3"),
        (lambda: check_library_build(store, ["m.pcd"], {"rf_rad": math.inf}, None), "--rf-rad must be"),
        (lambda: check_recognize_params({"model_ss": math.inf}, {}), "--model-ss must be"),
        (lambda: check_recognize_params({}, {"method": "gc", "cg_thresh": 2}), "--cg-thresh must be at least 3"),
        (lambda: check_recognize_params({}, {"descr_rad": -1.0}), "--descr-rad must be"),
        (lambda: check_index_build(store, ["m.pcd"], 1, {"random_dims": 0}, "float32"), "--random-dims must be"),
        (lambda: check_index_build(store, ["m.pcd"], 1, {"seed": -1}, "float32"), "--seed must be"),
        (lambda: check_match(store, None, 0, "default"), "-k must be"),
        (lambda: check_motion(params={"sigma_c": 0}), "--sigma-c must be"),
        (lambda: check_motion(batch=0), "--batch must be"),
    ]
    for call, message in cases:
        with pytest.raises(InputError) as err:
            call()
        assert str(err.value).startswith(message), str(err.value)


def test_shot_outputs_share_one_name():
    """``shot -o X.pcd`` wrote ``X.pcd.npy`` beside ``X.frames.npy``: the three files share OUT's
    name without its ``.npy``."""
    from scanforest.deploy.cli.shot import outputs

    assert outputs("d/desc.npy") == ("d/desc.npy", "d/desc.frames.npy", "d/desc.keypoints.npy")
    assert outputs("desc") == ("desc.npy", "desc.frames.npy", "desc.keypoints.npy")
    assert outputs("X.pcd") == ("X.pcd.npy", "X.pcd.frames.npy", "X.pcd.keypoints.npy")


def test_shot_keypoint_radius_zero_is_every_point(tmp_path):
    """``shot --keypoint-radius 0`` describes every point, as ``describe``'s 0 does (it was
    refused: "radius must be a positive finite number")."""
    from typer.testing import CliRunner

    pts = np.random.default_rng(1).random((60, 3)).astype(np.float32)
    np.save(tmp_path / "c.npy", pts)
    res = CliRunner().invoke(app, ["shot", str(tmp_path / "c.npy"), "-o", str(tmp_path / "X.pcd"),
                                   "--keypoint-radius", "0", "--radius", "0.3", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.pcd.frames.npy", "X.pcd.keypoints.npy", "X.pcd.npy",
                                                          "c.npy"]
    assert np.load(tmp_path / "X.pcd.keypoints.npy").tolist() == list(range(60))
    assert np.load(tmp_path / "X.pcd.npy").shape == (60, 352)


def test_help_wraps_at_the_terminal_width():
    """``scanforest --help`` on an 80-column terminal: each command's summary fills its column's
    lines (typer's rich help kept the docstrings' 100-column breaks, and rows such as ``check``'s
    and ``archive``'s came out ragged: 'groups, missing or short arrays,' alone on a line), and
    a command's own help reads its docstring's paragraphs the same way."""
    from typer.testing import CliRunner

    runner = CliRunner()
    out = runner.invoke(app, ["--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"}).output
    panel = [line[1:-1] for line in out[out.index("Commands"):].splitlines()[1:] if line.startswith("│")]
    col = next(line.index("Check") for line in panel if line.split()[0] == "check")
    rows = [(line[:col].strip(), line[col:].rstrip()) for line in panel]
    assert {"check", "archive", "demo", "ingest"} <= {name for name, _ in rows}
    for (_, text), (next_name, _) in zip(rows, rows[1:]):
        if not next_name:  # a line followed by more of its summary is filled (less one word)
            assert len(text) >= len(panel[0]) - col - 16, (text, out)
    help_ = runner.invoke(app, ["check", "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"}).output
    assert "missing or short arrays, chunks that" in " ".join(help_.split())
    first = [line.strip() for line in help_.splitlines() if line.strip()][1:4]
    assert all(len(line) >= 60 for line in first), first


def test_the_no_detections_note_names_models_of_another_unit(tmp_path):
    """Models recorded in another unit than the scenes (``--units`` records and converts
    nothing), or models larger than the scenes they are looked for in (a CAD model in millimetres
    against scans in metres), are named in the note; models of the scenes' size are not. The
    scans are ingested as a user's are (a hint read their ``bbox`` in another form and crashed
    ``recognize`` after its work)."""
    from types import SimpleNamespace

    from scanforest.deploy.cli.core import scale_hint
    from scanforest.tasks.ingest import Source, ingest_file
    from scanforest.tasks.store import ScanStore

    rng = np.random.default_rng(0)
    store = tmp_path / "s.zarr"
    ScanStore(store, create=True)
    for name, size, units in (("m_mm.npy", 200.0, "m"), ("m_m.npy", 0.2, "m"), ("m_unit.npy", 0.2, "mm"),
                              ("s1.npy", 1.5, "m"), ("s2.npy", 1.5, "m")):
        np.save(tmp_path / name, (rng.random((300, 3)) * size).astype(np.float32))
        assert ingest_file(str(store), Source(str(tmp_path / name), name), units=units)["status"] == "ingested"
    st = ScanStore(store, mode="r")

    def lib(model):  # the store as it is, its library's models as given
        return SimpleNamespace(catalog=SimpleNamespace(library_attrs=lambda name: {"model_scans": [model]}),
                               attrs=st.attrs, scans=st.scans)

    scenes = ["s1.npy", "s2.npy"]
    assert scale_hint(lib("m_m.npy"), scenes, "default") is None
    hint = scale_hint(lib("m_mm.npy"), scenes, "default")
    assert hint.startswith("the models (199.") and "times the size of the scenes (1.4" in hint, hint
    assert "millimetres against metres" in hint
    hint = scale_hint(lib("m_unit.npy"), scenes, "default")
    assert "models were ingested in mm and the scenes in m" in hint and "converts nothing" in hint


def test_run_says_which_path_parameters_this_host_lacks(tmp_path):
    """``scanforest run ingest --param source=/typo`` started a run that failed on the serving
    host: the command says which path parameters do not exist here (it may be another host, so
    it is a note, not a refusal); globs, URLs and a new store in an existing folder pass."""
    from scanforest.deploy.cli.ops import missing_paths

    (tmp_path / "scans").mkdir()
    assert missing_paths({"source": str(tmp_path / "scans"), "store": str(tmp_path / "new.zarr"),
                          "workers": 2}) == []
    assert missing_paths({"source": str(tmp_path / "scans" / "*.pcd"), "store": "s3://bucket/s.zarr"}) == []
    lines = missing_paths({"source": str(tmp_path / "scnas"), "store": str(tmp_path / "no" / "s.zarr")})
    assert len(lines) == 2 and lines[0].startswith(f"--param source={tmp_path / 'scnas'}: no such path on this host")
    assert "no such folder" in lines[1]
