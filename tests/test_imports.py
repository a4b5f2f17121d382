"""The package's import structure: no cycles, counting every import statement (function-level ones too), and
function-level imports only for optional dependencies, each saying so."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Installed as specdraft.kernels (pyproject's package-dir); they need triton, so callers import them lazily.
PACKAGES = {"specdraft": ROOT / "specdraft", "specdraft.kernels": ROOT / "kernels"}
# What specdraft runs without: the extras (triton, deepspeed, gguf) and what a GPU image often lacks
# (datasets and its pyarrow, wandb, matplotlib); a function may import these, with a comment saying so.
OPTIONAL = {"triton", "deepspeed", "gguf", "datasets", "pyarrow", "wandb", "matplotlib", "specdraft.kernels"}


def package_modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    modules = {}
    for prefix, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = path
    return modules


def imported_names(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Every dotted name an import statement may load: ``from .a import b`` may be module a or a.b."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules its import statements (anywhere in the file) name."""
    graph = {}
    for module, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported_names(module, path, node):
                    while name and name not in modules:
                        name = name.rpartition(".")[0]
                    if name and name != module:
                        edges.add(name)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path a -> ... -> a, or None (depth-first search, colouring modules on the stack)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                return stack[stack.index(other):] + [other]
            if other not in state and (cycle := visit(other)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def function_level_imports(modules: dict[str, Path]) -> list[tuple[str, int, str, str]]:
    """(file, line, imported module, the line's text) for each import inside a def or class."""
    found = []
    for module, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        for scope in ast.walk(tree):
            if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(scope):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    name = imported_names(module, path, node)[0]
                    found.append((str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), node.lineno, name, lines[node.lineno - 1]))
    return sorted(set(found))


def test_the_package_has_no_import_cycle():
    modules = package_modules()
    assert len(modules) > 60 and "specdraft.kernels.tree_sampler" in modules  # the walk found the package
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_function_level_imports_are_only_of_optional_dependencies_and_say_so():
    offenders = [f"{file}:{line}: {text.strip()}" for file, line, name, text in function_level_imports(package_modules())
                 if not (any(name == o or name.startswith(o + ".") for o in OPTIONAL) and "# optional" in text)]
    assert not offenders, "move these imports to the module's top (or mark an optional dependency):\n" + \
        "\n".join(offenders)


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function(tmp_path):
    """The checks read what they claim to: a two-module cycle through a function-level import, and that import."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import g\n\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from .a import f  # a cycle, hidden in a function\n    return f\n")
    (package / "c.py").write_text("from . import a\n")
    modules = package_modules({"pkg": package})
    graph = import_graph(modules)
    assert graph["pkg.c"] == {"pkg", "pkg.a"}
    assert find_cycle(graph) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])
    assert [(name, line) for _, line, name, _ in function_level_imports(modules)] == [("pkg.a", 2)]
    (package / "b.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(package_modules({"pkg": package}))) is None


@pytest.mark.parametrize("module", ["specdraft.drafters", "specdraft.export", "specdraft.train", "specdraft.selftest"])
def test_modules_import_on_their_own(module):
    """Each imports in a fresh interpreter, first (no cycle through the order of imports hides behind another)."""
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
