"""The import rules of every folder (docs/architecture.md, "Layers"): what each may import of
plait, that the packages import each other without a cycle, and that `plait/environment.py`
imports only the standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder -> its import name
PACKAGES = {
    "lang": "plait.lang",
    "interpreter": "plait.interpreter",
    "runtime": "plait.runtime",
    "kernels": "plait.kernels",
    "radix_cache": "plait.radix_cache",
    "server": "plait.server",
    "benchmarks": "plait.benchmarks",
    "plait": "plait",
}
# folder -> the plait packages it may import besides itself ("plait" alone: the facade and CLI)
ALLOWED = {
    "lang": (),
    "interpreter": ("plait.lang",),
    "runtime": ("plait.kernels", "plait.radix_cache"),
    "kernels": ("plait.environment",),
    "radix_cache": (),
    "server": ("plait.runtime", "plait.interpreter", "plait.lang", "plait.radix_cache"),
}
# the one place a lower layer reaches up, inside a function: the in-process backend runs the engine
LAZY = {("interpreter/backends/local.py", "plait.runtime")}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def plait_imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at the top level of the file?) for every plait module `path` imports, relative
    imports resolved."""
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names = [f"plait.{a.name}" for a in node.names] if module == "plait" else [module]
        found += [(n, id(node) in top) for n in names if n == "plait" or n.startswith("plait.")]
    return found


def owner(module: str) -> str:
    """The package of `module` among `PACKAGES` (plait's facade modules are "plait.<name>")."""
    for folder, name in PACKAGES.items():
        if folder != "plait" and (module == name or module.startswith(name + ".")):
            return name
    return module if module.count(".") == 1 else "plait"


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_folder_imports_only_what_it_may(folder: str) -> None:
    own = PACKAGES[folder]
    wrong = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for module, at_top in plait_imports(path):
            target = owner(module)
            if target == own or target in ALLOWED[folder]:
                continue
            if (rel, target) in LAZY and not at_top:
                continue
            wrong.append(f"{rel} imports {module}")
    assert not wrong, wrong


def test_packages_import_each_other_without_a_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for folder, own in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if folder == "plait" and path.parent != ROOT / "plait":
                continue  # plait/deploy: deployments, above everything
            for module, at_top in plait_imports(path):
                target = owner(module)
                if target != own and at_top:
                    edges.setdefault(own, set()).add(target)
    visiting: list[str] = []

    def visit(node: str, seen: set[str]) -> None:
        assert node not in visiting, f"an import cycle: {' -> '.join([*visiting, node])}"
        if node in seen:
            return
        visiting.append(node)
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, seen)
        visiting.pop()
        seen.add(node)

    done: set[str] = set()
    for node in sorted(edges):
        visit(node, done)


def test_environment_imports_only_the_standard_library() -> None:
    tree = ast.parse((ROOT / "plait" / "environment.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            for name in names:
                assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__", name
