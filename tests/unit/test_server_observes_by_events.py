"""The server observes the engine through `Engine.events` and its public methods: no module in
`server/` assigns to an attribute of an engine, its core, scheduler, cache or their parts
(`engine._submit = ...`, `engine.scheduler.schedule = ...`), calls `setattr`, or writes into an
object's `__dict__`."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
ENGINE_PARTS = {
    "engine",
    "core",
    "scheduler",
    "cache",
    "allocator",
    "runner",
    "kv_pool",
    "tokenizer",
    "processor",
    "events",
}


def _names(node: ast.expr) -> list[str]:
    """The identifiers of an attribute chain: `self.engine.cache` -> [self, engine, cache]."""
    out: list[str] = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def _offences(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and ENGINE_PARTS & set(_names(t.value)):
                    found.append((node.lineno, ast.unparse(t)))
                if isinstance(t, ast.Subscript) and "__dict__" in _names(t.value):
                    found.append((node.lineno, ast.unparse(t)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("setattr", "delattr"):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_patching():
    code = (
        "engine._submit = wrap\nself.engine.scheduler.schedule = f\n"
        "setattr(cache, 'evict', g)\nobj.__dict__['x'] = 1\nself.cache = cache\n"
    )
    assert sorted(line for line, _ in _offences(ast.parse(code))) == [1, 2, 3, 4]


def test_no_server_module_patches_the_engine():
    offences = []
    for path in sorted(SERVER.rglob("*.py")):
        for line, what in _offences(ast.parse(path.read_text(encoding="utf-8"))):
            offences.append(f"{path.relative_to(SERVER.parent)}:{line}: {what}")
    assert not offences, "the server changes engine objects:\n" + "\n".join(offences)
