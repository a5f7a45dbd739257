"""The library's import rules, read from the source (nothing is imported), and a check that
the reader finds a violation planted in a copy of the tree.

The rules: no import cycles anywhere in the library (imports inside functions and under
TYPE_CHECKING count: they are dependencies all the same), and none between packages either,
each package one node (`jaxllm.engine` with all its modules and subpackages; a loose module
such as `jaxllm.llm` is its own): two packages that need each other are one package in two
folders, even when no two of their modules form a cycle. The worker (`jaxllm.worker`) never
imports the engine, and the engine and everything else import the worker's public names only
(`from jaxllm.worker import Name`, never a module of it); the draft proposer never imports the
runner module; the scheduler shares only the step data with the worker; the engine never
imports the `LLM` front end; `pallas_kernels` never imports `jaxllm`, nor `jaxllm` the server
(which registers its `serve` subcommand with the CLI as an entry point).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGES = ("jaxllm", "pallas_kernels", "server")


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the library's packages under `root` (a
    package's `__init__.py` is the package's name)."""
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _lazy_homes(path: Path) -> dict[str, str]:
    """A package's names that load on first use (its `_HOMES = {name: module}` literal)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_HOMES" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return {}


def read_imports(root: Path) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """(module -> the library modules it imports, resolved: a package's lazy name counts as
    its home module; module -> the import statements' targets as written)."""
    modules = _modules(root)
    homes = {
        name: _lazy_homes(path) for name, path in modules.items() if path.name == "__init__.py"
    }
    graph: dict[str, set[str]] = {}
    written: dict[str, list[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps, raw = set(), []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    raw.append(f"{base}.{alias.name}")
                    target = f"{base}.{alias.name}"
                    if target not in modules:
                        target = homes.get(base, {}).get(alias.name, base)
                    deps.add(target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    raw.append(alias.name)
                    deps.add(alias.name)
        if homes.get(module):  # a lazy package: what it imports, it imports on first use
            deps = set()
        graph[module] = {d for d in deps if d in modules and d != module}
        written[module] = raw
    return graph, written


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _packages(root: Path) -> set[str]:
    return {name for name, path in _modules(root).items() if path.name == "__init__.py"}


def package_graph(root: Path) -> dict[str, set[str]]:
    """`read_imports`' graph with each package merged into one node: a module of a package
    under a top-level one (`jaxllm.worker.spec_decode.proposer`) becomes that package
    (`jaxllm.worker`), a loose module (`jaxllm.llm`, `server.api`) stays itself."""
    graph, _ = read_imports(root)
    packages = _packages(root)

    def node(module: str) -> str:
        top_two = ".".join(module.split(".")[:2])
        return top_two if top_two != module.split(".")[0] and top_two in packages else module

    out: dict[str, set[str]] = {node(m): set() for m in graph}
    for module, deps in graph.items():
        out[node(module)] |= {node(d) for d in deps} - {node(module)}
    return out


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(root: Path) -> list[str]:
    """Every break of the rules in the module docstring, one line each."""
    graph, written = read_imports(root)
    found = [f"import cycle: {' <-> '.join(c)}" for c in _cycles(graph)]
    packages = _packages(root)
    found += [
        f"import cycle between packages: {' <-> '.join(c)}"
        for c in _cycles(package_graph(root))
        # one of loose modules only is a cycle of those modules, named above already
        if any(node in packages for node in c)
    ]
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if _within(module, "jaxllm.worker") and _within(dep, "jaxllm.engine"):
                found.append(f"{module} imports the engine ({dep})")
            if _within(module, "jaxllm.worker.spec_decode") and dep == "jaxllm.worker.model_runner":
                found.append(f"{module} imports the runner module")
            if _within(module, "jaxllm.engine") and dep == "jaxllm.llm":
                found.append(f"{module} imports the LLM front end")
            if _within(module, "pallas_kernels") and _within(dep, "jaxllm"):
                found.append(f"{module} imports {dep}")
            if _within(module, "jaxllm") and _within(dep, "server"):
                found.append(f"{module} imports the server ({dep})")
            if (
                module == "jaxllm.engine.scheduler"
                and _within(dep, "jaxllm.worker")
                and dep != "jaxllm.worker.step_data"
            ):
                found.append(f"the scheduler imports {dep}, beyond the step data")
        if not _within(module, "jaxllm.worker"):
            for target in written[module]:
                parent = target.rpartition(".")[0]
                if _within(parent, "jaxllm.worker") and parent != "jaxllm.worker":
                    found.append(f"{module} imports {target}, not a public name of the worker")
    return found


def test_the_library_keeps_its_import_rules():
    graph, _ = read_imports(ROOT)
    assert len(graph) > 60 and "jaxllm.worker.model_runner" in graph  # the tree was read
    assert {"jaxllm.engine", "jaxllm.worker", "jaxllm.multimodal"} <= package_graph(ROOT).keys()
    assert violations(ROOT) == []


def _copy_with(tmp_path: Path, plant: dict[str, str]) -> Path:
    """A copy of the library under `tmp_path` that keeps the rules, with `plant`'s files
    (path -> text) added."""
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.so", "__pycache__")
        )
    assert violations(tmp_path) == []
    for path, text in plant.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


def test_a_planted_violation_is_found(tmp_path):
    plant = {
        "jaxllm/worker/planted.py": "from jaxllm.engine.core import EngineCore\n",
        "jaxllm/worker/spec_decode/planted.py": (
            "def f():\n    from jaxllm.worker.model_runner import ModelRunner\n"
        ),
        "jaxllm/engine/planted.py": "from jaxllm.worker.sampler import sample\n",
        "jaxllm/planted_a.py": "import jaxllm.planted_b\n",
        "jaxllm/planted_b.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxllm import planted_a\n"
        ),
        "pallas_kernels/planted.py": "from jaxllm import LLM\n",
        "jaxllm/engine/planted_cli.py": "import server.api\n",
    }
    found = violations(_copy_with(tmp_path, plant))
    assert "jaxllm.worker.planted imports the engine (jaxllm.engine.core)" in found
    assert "jaxllm.worker.spec_decode.planted imports the runner module" in found
    assert (
        "jaxllm.engine.planted imports jaxllm.worker.sampler.sample, not a public name of the "
        "worker"
    ) in found
    assert "import cycle: jaxllm.planted_a <-> jaxllm.planted_b" in found
    assert "pallas_kernels.planted imports jaxllm.llm" in found  # through the lazy name
    assert "jaxllm.engine.planted_cli imports the server (server.api)" in found
    # the worker and the engine now need each other, and the engine the server: cycles
    # between packages too (their members depend on the rest of the tree), counted apart
    by_module = [f for f in found if not f.startswith("import cycle between packages")]
    assert len(by_module) == 6, found
    assert any("jaxllm.engine <-> " in f and "jaxllm.worker" in f for f in found), found


def test_a_planted_cycle_between_packages_is_found(tmp_path):
    """Two packages that need each other through different modules (one of the imports inside
    a function): no cycle among modules, one between the packages."""
    plant = {
        "jaxllm/planted_p/__init__.py": "",
        "jaxllm/planted_p/one.py": "from jaxllm.planted_q.two import g\n",
        "jaxllm/planted_p/three.py": "",
        "jaxllm/planted_q/__init__.py": "",
        "jaxllm/planted_q/two.py": "def g():\n    from jaxllm.planted_p import three\n",
    }
    found = violations(_copy_with(tmp_path, plant))
    assert found == ["import cycle between packages: jaxllm.planted_p <-> jaxllm.planted_q"]
