"""Imports of third-party packages whose names meet plait's own folders.

plait's subpackages live in top-level folders of the repository (`kernels/` is `plait.kernels`).
Where the repository root is on `sys.path` (pytest's rootdir, `python -m` from a clone), a bare
`import kernels` finds that folder instead of the Hugging Face `kernels` distribution, which
transformers (5.x) imports as soon as a model class loads, and the import fails. Before
transformers is first imported, `import_transformers` imports the installed `kernels`
distribution with the repository root off the path, so that the name is taken by the right
package for the rest of the process.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_ROOT = Path(__file__).resolve().parent.parent
_SHADOWED = ("kernels",)  # top-level names of plait folders that are also installed distributions


def _shadows(name: str) -> bool:
    """Whether `import name` would find plait's own folder."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    origin = spec.origin if spec is not None else None
    return origin is not None and Path(origin).resolve().parent == _ROOT / name


def unshadow() -> None:
    """Imports each installed distribution that one of plait's folders shadows, with the
    repository root off `sys.path` for the duration; a name not installed stays unimported."""
    for name in _SHADOWED:
        if name in sys.modules or not _shadows(name):
            continue
        saved = list(sys.path)
        sys.path[:] = [p for p in saved if Path(p or ".").resolve() != _ROOT]
        importlib.invalidate_caches()
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not installed: transformers finds no version of it and does without
        finally:
            sys.path[:] = saved
            importlib.invalidate_caches()


def import_transformers() -> ModuleType:
    """`import transformers`, safe from plait's folder names (see the module docstring)."""
    unshadow()
    import transformers

    return transformers
