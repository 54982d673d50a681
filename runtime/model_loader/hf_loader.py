"""Reading a local Hugging Face checkpoint folder: config.json and *.safetensors."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from plait.runtime.models.llama import LlamaArgs


def read_hf_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def open_hf_dir(path: str) -> tuple[dict[str, Any], LlamaArgs]:
    config = read_hf_config(path)
    return config, LlamaArgs.from_hf_config(config)


def safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(path, "*.bin"))
        extra = " (found *.bin: convert it to safetensors)" if bins else ""
        raise FileNotFoundError(f"model_path: no *.safetensors files in {path}{extra}")
    return files


def iter_hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def has_lm_head(path: str) -> bool:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            if "lm_head.weight" in f.keys():
                return True
    return False
