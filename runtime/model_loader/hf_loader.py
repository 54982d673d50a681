"""Reading a local Hugging Face checkpoint folder: config.json and *.safetensors."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from plait.runtime.models.args import ModelArgs
from plait.runtime.models.registry import Family, family_for_hf


@dataclass(frozen=True)
class HfCheckpoint:
    path: str
    config: dict[str, Any]
    family: Family
    args: ModelArgs

    def hf_names(self) -> list[str]:
        """The names of the folder's weights as the family's model calls them (headers only)."""
        return [
            n for n in (self.family.hf_name(name) for name, _ in _keys(self.path)) if n is not None
        ]


def read_hf_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def open_hf_dir(path: str) -> HfCheckpoint:
    config = read_hf_config(path)
    family, arch = family_for_hf(config, f"{os.path.join(path, 'config.json')}")
    args = family.args_from_hf(config, arch)
    ckpt = HfCheckpoint(path, config, family, args)
    if not args.tie_word_embeddings and "lm_head.weight" not in ckpt.hf_names():
        ckpt = replace(ckpt, args=replace(args, tie_word_embeddings=True))
    return ckpt


def safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(path, "*.bin"))
        extra = " (found *.bin: convert it to safetensors)" if bins else ""
        raise FileNotFoundError(f"model_path: no *.safetensors files in {path}{extra}")
    return files


def _keys(path: str) -> Iterator[tuple[str, str]]:
    """(name, file) of every tensor in the folder's safetensors files."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, file


def iter_hf_weights(
    ckpt: HfCheckpoint, sources: list[tuple[str, str, bool]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name as the family's model calls it, tensor) for every weight; `sources`, if given, gets
    (name, the file's dtype, False) for each."""
    from safetensors import safe_open

    for file in safetensors_files(ckpt.path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                hf_name = ckpt.family.hf_name(name)
                if hf_name is None:
                    continue
                tensor = ckpt.family.hf_tensor(hf_name, f.get_tensor(name))
                if sources is not None:
                    sources.append((hf_name, str(tensor.dtype).removeprefix("torch."), False))
                yield hf_name, tensor
