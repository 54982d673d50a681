"""docs/architecture.md names the file and function behind each step of a `gen` and each choice
of execution path; every one it names exists, so the map cannot drift from the code silently."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ["", "plait/", "lang/", "interpreter/", "runtime/", "runtime/constrained/", "server/"]


def _defined(path: Path) -> set[str]:
    """Top-level functions, classes and assignments; a class's methods and nested classes as
    `Class.member` and as `member` (the page often names a method by itself); its annotated
    attributes as `Class.member`."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.update((sub.name, f"{node.name}.{sub.name}"))
                if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                    names.add(f"{node.name}.{sub.target.id}")
    return names


def _resolve(name: str) -> Path | None:
    """A path as the page writes it: from the root, or (a short form beside a longer one) from
    one of the package folders."""
    for folder in FOLDERS:
        if (ROOT / folder / name).is_file():
            return ROOT / folder / name
    return None


def test_every_file_and_function_the_architecture_page_names_exists():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    refs: list[tuple[str, list[str]]] = []
    for m in re.finditer(r"`([\w/]+\.py)`(?: \(([^)]*)\))?", doc):  # `file.py` (`fn`, `Cls.fn`)
        refs.append((m.group(1), re.findall(r"`([\w.]+)`", m.group(2) or "")))
    for m in re.finditer(r"`([\w/]+\.py): ([\w.]+)`", doc):  # `file.py: fn`
        refs.append((m.group(1), [m.group(2)]))
    assert len(refs) > 50  # the step table and the decision table were both read
    problems = []
    for name, functions in refs:
        path = _resolve(name)
        if path is None:
            problems.append(f"{name}: no such file")
            continue
        defined = _defined(path)
        problems += [
            f"{name}: no {fn}" for fn in functions if not fn.endswith(".py") and fn not in defined
        ]
    assert not problems, "\n".join(problems)
