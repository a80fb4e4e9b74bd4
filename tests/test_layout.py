"""The import contract of the package layout (issue 23).

* ``scanforest.kernels`` is pure array compute: none of its modules imports the tasks, the flows
  or the orchestration and storage stack (Prefect, Dask, distributed, zarr), at module level or
  inside a function.
* No import cycles among scanforest modules: the graph of every ``import`` (module-level and
  inside functions, relative imports resolved; a package's ``__init__`` re-export is an edge from
  the package) has no strongly connected component of more than one module. Imports under
  ``if TYPE_CHECKING:`` are for annotations only and are not edges.
* ``kernels/`` has one subpackage per family, each listed in ``pyproject.toml`` (the GPU machine
  installs with setuptools from that list).
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
            "scanforest.flows": REPO / "flows"}
FAMILIES = ("neighbors", "descriptors", "knn", "recognition", "align", "motion", "synthetic")
FORBIDDEN = ("scanforest.tasks", "scanforest.flows", "prefect", "prefect_dask", "dask", "distributed",
             "dask_cuda", "zarr")


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


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """Every import of a module, anywhere in it: (absolute module, imported names, line)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
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


def test_importing_every_kernels_module_pulls_no_orchestration():
    names = sorted(m for m in _modules() if m.startswith("scanforest.kernels"))
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
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
