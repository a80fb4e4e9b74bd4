"""The import contract of the package layout (issue 23).

* ``scanforest.kernels`` is pure array compute: none of its modules imports the tasks, the flows,
  the command line and benchmarks (``deploy``) or the orchestration and storage stack (Prefect,
  Dask, distributed, zarr), at module level or inside a function.
* No import cycles among scanforest modules: the graph of every ``import`` (module-level and
  inside functions, relative imports resolved; a package's ``__init__`` re-export is an edge from
  the package) has no strongly connected component of more than one module. Imports under
  ``if TYPE_CHECKING:`` are for annotations only and are not edges.
* ``kernels/`` has one subpackage per family, each listed in ``pyproject.toml`` (the GPU machine
  installs with setuptools from that list).
* No module of ``kernels/``, ``tasks/``, ``flows/`` or ``deploy/`` is over 1,000 lines (issue 40):
  CUDA sources of that size are ``.cu`` files beside their module, shipped as package data
  (``pyproject.toml``) and read with :mod:`importlib.resources`.
* One family per folder: ``flows/`` holds Prefect flows, the runner, the deployment table and the
  helpers the flows use (distributed matching, the report), and nothing else: no CLI or bench
  module, nothing that imports typer, and no import of :mod:`scanforest.deploy`. The command line
  is ``deploy/cli/`` and the benchmarks ``deploy/bench/`` (one module per bench); every public
  module there registers its commands with ``register(app, bench)`` (the one way, discovered by
  :mod:`scanforest.deploy.cli`), and a bench imports neither the command line nor another bench.
* Families use one another through public names only (issue 40): no module imports a private
  name (``_x``) or a private module of another family (:func:`_family`: each ``kernels``
  subpackage of :data:`FAMILIES`, the rest of ``kernels``, ``tasks``, ``flows``, ``deploy.cli``,
  ``deploy.bench``, the rest of ``deploy``); ``tasks/`` imports no Prefect (its Prefect tasks are
  ``flows/prefect_tasks.py``).
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"scanforest.kernels": REPO / "kernels", "scanforest.tasks": REPO / "tasks",
            "scanforest.flows": REPO / "flows", "scanforest.deploy": REPO / "deploy"}
FAMILIES = ("neighbors", "descriptors", "knn", "recognition", "align", "motion", "synthetic")
FORBIDDEN = ("scanforest.tasks", "scanforest.flows", "scanforest.deploy", "prefect", "prefect_dask", "dask",
             "distributed", "dask_cuda", "zarr")


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its ``__init__.py``)."""
    mods = {"scanforest": REPO / "__init__.py"}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            if any(part.startswith(".") or part == "__pycache__" for part in rel):
                continue
            if rel[-1] == "__init__":
                rel = rel[:-1]
            mods[".".join((pkg, *rel))] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks (annotations only)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for sub in node.body:
                    skip.update(id(n) for n in ast.walk(sub))
    return skip


def _imports(name: str, path: Path, source: str | None = None, *,
             annotations: bool = False) -> list[tuple[str, list[str], int]]:
    """Every import of a module, anywhere in it: (absolute module, imported names, line).
    ``source``: the module's text (default: read from ``path``); ``annotations``: also the
    imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    skip = set() if annotations else _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append((target, [alias.name for alias in node.names], node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, names, _ in _imports(name, path):
            if not (target == "scanforest" or target.startswith("scanforest.")):
                continue
            hit = False
            for n in names:  # `from pkg import module` is an edge to the module
                if f"{target}.{n}" in mods:
                    graph[name].add(f"{target}.{n}")
                    hit = True
            if not hit:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target in mods and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _forbidden(mod: str) -> bool:
    return any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN)


def test_kernels_import_nothing_from_tasks_flows_or_orchestration_in_source():
    bad = []
    for name, path in _modules().items():
        if name == "scanforest.kernels" or name.startswith("scanforest.kernels."):
            for target, _, line in _imports(name, path):
                if _forbidden(target):
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def _loaded_after_importing(names: list[str]) -> list[str]:
    """Every module a fresh interpreter holds after importing ``names``."""
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_importing_every_kernels_module_pulls_no_orchestration():
    names = sorted(m for m in _modules() if m.startswith("scanforest.kernels"))
    loaded = _loaded_after_importing(names)
    assert not [m for m in loaded if _forbidden(m)]


def test_no_import_cycles():
    graph = _graph()
    assert "scanforest.kernels" in graph and len(graph) > 40
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the detector detects
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_every_kernels_family_is_a_listed_subpackage():
    for family in FAMILIES:
        assert (REPO / "kernels" / family / "__init__.py").is_file(), family
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for init in (REPO / "kernels").rglob("__init__.py"):
        rel = init.parent.relative_to(REPO / "kernels").parts
        assert ".".join(("scanforest.kernels", *rel)) in listed, init


#: the most lines a module may have (issue 40: a longer one is split by concern)
MAX_MODULE_LINES = 1000


def test_no_module_over_max_lines_and_cuda_sources_are_package_resources():
    long = [f"{path.relative_to(REPO)}: {n} lines" for path in _modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)
    # every .cu file under kernels/ is package data of its package and found through importlib.resources
    from fnmatch import fnmatch
    from importlib.resources import files

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted((REPO / "kernels").rglob("*.cu"))
    assert sources
    for cu in sources:
        pkg_dir = cu.parent
        while not (pkg_dir / "__init__.py").is_file():
            pkg_dir = pkg_dir.parent
        pkg = ".".join(("scanforest.kernels", *pkg_dir.relative_to(REPO / "kernels").parts))
        rel = cu.relative_to(pkg_dir).as_posix()
        assert any(fnmatch(rel, pat) for pat in data.get(pkg, [])), f"{rel} is not package data of {pkg}"
        res = files(pkg).joinpath(*rel.split("/"))
        assert res.is_file() and res.read_text(encoding="utf-8") == cu.read_text(encoding="utf-8"), rel
    # the KD-tree kernels' source is assembled from its file (no CUDA needed to read it)
    from scanforest.kernels.knn import _kdtree_gpu

    src = _kdtree_gpu._source()
    assert _kdtree_gpu._HALF_ROWS_MARK not in src and "__KP__" in src and "#define HCAP 256" in src
    assert src.startswith(_kdtree_gpu._CUDA_COMMON) and 'extern "C" __global__' in src


#: what ``flows/`` holds besides the flows themselves: the runner (Prefect's API, the Dask cluster
#: and its workers' setup, batching, the stages' inputs and the run records), the deployment table
#: and the helpers the flows use (distributed matching for the match flow, the report of their
#: runs, the runs' watchdog, the checks that answer a run with nothing to do before it starts, the
#: runs' summaries) and
#: the Prefect tasks around the units of work (tasks import no Prefect)
FLOW_HELPERS = {"__init__", "_watchdog", "batching", "cluster", "deployments", "distributed", "inputs", "noop",
                "prefect_api", "prefect_tasks", "records", "report", "summaries", "worker_setup"}


def _defines_flow(path: Path) -> bool:
    """Whether a module defines a Prefect flow: a function decorated ``@flow`` or ``@flow(...)``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                fn = dec.func if isinstance(dec, ast.Call) else dec
                if getattr(fn, "id", None) == "flow" or getattr(fn, "attr", None) == "flow":
                    return True
    return False


def test_flows_holds_no_cli_or_bench_module():
    """``flows/`` holds Prefect flows, the runner, the deployment table and the flows' helpers:
    no ``cli*``/``bench*``/``_bench*`` module, no module importing typer, no subpackage."""
    folder = REPO / "flows"
    bad = []
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder)
        if "__pycache__" in rel.parts:
            continue
        if len(rel.parts) > 1:
            bad.append(f"flows/{rel}: flows/ has no subpackages")
            continue
        name = path.stem
        if name.lstrip("_").startswith(("cli", "bench")):
            bad.append(f"flows/{rel}: a CLI or bench module (they live in deploy/cli/ and deploy/bench/)")
        for target, _, line in _imports(f"scanforest.flows.{name}", path):
            if target.split(".")[0] in ("typer", "click"):
                bad.append(f"flows/{rel}:{line} imports {target} (command-line code lives in deploy/cli/)")
        if name not in FLOW_HELPERS and not _defines_flow(path):
            bad.append(f"flows/{rel}: not a Prefect flow, nor the runner, the deployment table or a helper "
                       f"of the flows ({', '.join(sorted(FLOW_HELPERS))})")
    assert not bad, "\n".join(bad)


def test_flows_and_tasks_never_import_the_command_line_or_the_benches():
    bad = [f"{path.relative_to(REPO)}:{line} imports {target}"
           for name, path in _modules().items() if name.startswith(("scanforest.flows", "scanforest.tasks"))
           for target, _, line in _imports(name, path)
           if target == "scanforest.deploy" or target.startswith("scanforest.deploy.")]
    assert not bad, "\n".join(bad)


#: what no module under tasks/ imports (issue 40): the Prefect tasks around the units of work are
#: ``flows/prefect_tasks.py``; Dask workers (and the GPU machine, which has no Prefect) import tasks
TASKS_FORBIDDEN = ("prefect", "prefect_dask")


def test_tasks_import_no_prefect():
    """No module of ``tasks/`` imports Prefect, at module level or inside a function, and importing
    them all loads none of it."""
    names = sorted(m for m in _modules() if m == "scanforest.tasks" or m.startswith("scanforest.tasks."))
    assert "scanforest.tasks.store.scans" in names and len(names) > 10
    bad = [f"{_modules()[name].relative_to(REPO)}:{line} imports {target}"
           for name in names for target, _, line in _imports(name, _modules()[name])
           if target.split(".")[0] in TASKS_FORBIDDEN]
    assert not bad, "\n".join(bad)
    loaded = _loaded_after_importing(names)
    assert not [m for m in loaded if m.split(".")[0] in TASKS_FORBIDDEN]


def test_one_way_to_register_a_command():
    """Every public module of deploy/cli and deploy/bench defines ``register(app, bench)`` and the
    discovery finds exactly those modules; a bench imports neither the command line nor another
    bench (what benches share is in the ``_`` modules)."""
    import scanforest.deploy.cli as cli

    expected, bad = [], []
    for sub in ("cli", "bench"):
        folder = REPO / "deploy" / sub
        assert (folder / "__init__.py").is_file()
        for path in sorted(folder.glob("*.py")):
            if path.stem.startswith("_"):
                continue
            name = f"scanforest.deploy.{sub}.{path.stem}"
            expected.append(name)
            tree = ast.parse(path.read_text(), filename=str(path))
            regs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "register"]
            if not regs or [a.arg for a in regs[0].args.args] != ["app", "bench"]:
                bad.append(f"deploy/{sub}/{path.name}: no top-level register(app, bench)")
            if sub == "bench":
                for target, names, line in _imports(name, path):
                    mods = [target] + [f"{target}.{n}" for n in names]
                    if any(m.startswith("scanforest.deploy.cli") or
                           (m.startswith("scanforest.deploy.bench.") and not m.split(".")[3].startswith("_"))
                           for m in mods):
                        bad.append(f"deploy/bench/{path.name}:{line} imports {target} {names}")
    assert not bad, "\n".join(bad)
    assert sorted(cli.command_modules()) == sorted(expected)
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {"scanforest.deploy", "scanforest.deploy.cli", "scanforest.deploy.bench"} <= listed


#: the packages whose subpackages are families of their own (issue 40); every other module belongs
#: to the family of its top-level package (``scanforest.tasks``, with ``tasks/store/``; ``scanforest.flows``)
SUBFAMILIES = {"scanforest.kernels": FAMILIES, "scanforest.deploy": ("cli", "bench")}


def _family(module: str) -> str:
    """The family of a scanforest module: ``scanforest.kernels.<family>`` for a kernels subpackage
    listed in :data:`FAMILIES` (the modules directly in ``kernels/`` are the family
    ``scanforest.kernels``), ``scanforest.deploy.cli`` and ``scanforest.deploy.bench`` (the rest of
    ``deploy/`` is ``scanforest.deploy``), and otherwise the top-level package: ``scanforest.tasks``
    (``tasks/store/`` included), ``scanforest.flows``."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    if len(parts) > 2 and parts[2] in SUBFAMILIES.get(top, ()):
        return ".".join(parts[:3])
    return top


def _private(name: str) -> bool:
    """A private name: one leading underscore, not a dunder."""
    return name.startswith("_") and not name.startswith("__")


def _cross_family_private_imports(modules: dict[str, Path], sources: dict[str, str] | None = None) -> list[str]:
    """Every import, module-level or in a function (relative imports resolved, ``TYPE_CHECKING``
    ones included), of a private name or a private module of another family: ``file:line:
    importer imports name from source``. ``sources``: module texts to scan instead of the files."""
    bad = []
    for name, path in modules.items():
        text = (sources or {}).get(name)
        for target, names, line in _imports(name, path, text, annotations=True):
            if not (target == "scanforest" or target.startswith("scanforest.")):
                continue
            family = _family(name)
            # ``import a._b`` and ``from a._b import c``: the private module a._b
            parts = target.split(".")
            hidden = next((i for i, part in enumerate(parts) if _private(part)), None)
            if hidden is not None and _family(target) != family:
                bad.append(f"{path.relative_to(REPO)}:{line}: {name} imports {', '.join(names) or target} "
                           f"from the private module {'.'.join(parts[:hidden + 1])} (family {_family(target)})")
                continue
            for n in names:  # ``from a import _b``: a private name, or the private module a._b
                if _private(n) and _family(f"{target}.{n}") != family:
                    bad.append(f"{path.relative_to(REPO)}:{line}: {name} imports the private name {n} from "
                               f"{target} (family {_family(f'{target}.{n}')})")
    return bad


def test_no_private_import_across_families():
    """A family uses another one only through its public names (issue 40): no module imports a
    private name (``_x``) or a private module of another family; within a family they are free."""
    assert _family("scanforest.kernels.neighbors._search_cpu") == "scanforest.kernels.neighbors"
    assert _family("scanforest.kernels._geom_cpu") == _family("scanforest.kernels.backend") == "scanforest.kernels"
    assert _family("scanforest.tasks.store.scans") == _family("scanforest.tasks.index") == "scanforest.tasks"
    assert _family("scanforest.deploy.bench._common") == "scanforest.deploy.bench"
    assert _family("scanforest.deploy.cli") != _family("scanforest.deploy") != _family("scanforest.deploy.bench")
    bad = _cross_family_private_imports(_modules())
    assert not bad, "private names imported across families:\n" + "\n".join(bad)


def test_the_private_import_scan_finds_cross_family_imports():
    """The scan of :func:`test_no_private_import_across_families` reports each kind of violation
    (a private name, a private module imported by name or by path, relative, in a function, under
    ``TYPE_CHECKING``) and leaves private imports within a family alone."""
    source = ("from typing import TYPE_CHECKING\n"
              "from scanforest.tasks.store import _jsonable, ScanStore\n"   # 2: private name, another family
              "from ..kernels.neighbors import _search_cpu\n"               # 3: private module, relative
              "from ._watchdog import _stop\n"                              # 4: same family: allowed
              "if TYPE_CHECKING:\n"
              "    from scanforest.kernels.recognition.library import _Hidden\n"  # 6
              "\n"
              "def f():\n"
              "    import scanforest.kernels.motion._optical_flow_gpu\n"   # 9: private module by path
              "    from scanforest.tasks.store.scans import __doc__, utc_now\n"   # 10: dunder, public: allowed
              "    from scanforest.kernels._geom_cpu import eig3\n"         # 11: kernels' own family is another one
              "    from .prefect_api import _private_helper\n")             # 12: same family: allowed
    fake = REPO / "flows" / "_fake_for_the_scan.py"
    bad = _cross_family_private_imports({"scanforest.flows._fake_for_the_scan": fake},
                                        {"scanforest.flows._fake_for_the_scan": source})
    lines = sorted(int(b.split(":")[1]) for b in bad)
    assert lines == [2, 3, 6, 9, 11], "\n".join(bad)
    assert "_jsonable" in bad[0] and "ScanStore" not in bad[0] and "scanforest.tasks.store" in bad[0]
    # the same imports from inside the families they name are allowed
    assert not _cross_family_private_imports(
        {"scanforest.tasks.fake": REPO / "tasks" / "fake.py"},
        {"scanforest.tasks.fake": "from .store import _jsonable\nfrom .store.scans import _x\n"})
    assert not _cross_family_private_imports(
        {"scanforest.kernels.hypotheses": REPO / "kernels" / "hypotheses.py"},
        {"scanforest.kernels.hypotheses": "from ._geom_cpu import eig3\nfrom .backend import _apply_cuda_schedule\n"})
