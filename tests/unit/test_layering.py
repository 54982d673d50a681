"""The import rules of the lowest layers: `plait/environment.py` imports only the standard
library, `kernels/` only itself and `plait.environment` (besides torch, triton, numpy), and
`radix_cache/` only itself."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def plait_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "plait":  # from plait import x
            names.update(f"plait.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder,allowed", [
    ("kernels", ("plait.kernels", "plait.environment")),
    ("radix_cache", ("plait.radix_cache",)),
])  # fmt: skip
def test_low_layers_import_only_what_they_may(folder: str, allowed: tuple[str, ...]) -> None:
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in plait_imports(path):
            if name == "plait" or name.startswith("plait."):
                assert name.startswith(allowed), f"{path.relative_to(ROOT)} imports {name}"


def test_environment_imports_only_the_standard_library() -> None:
    for name in plait_imports(ROOT / "plait" / "environment.py"):
        assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__", name
