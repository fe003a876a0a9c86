"""Where the weights come from: a model folder's validation and the default model prepared once
(no model load)."""

from __future__ import annotations

import pytest

from inference.engine import model_store
from inference.engine.model_store import ModelLoadError, resolve_model_path


def make_model_dir(folder):
    """A folder that passes validation (a config and an empty weights file)."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_a_valid_model_path_is_used_as_it_is(tmp_path):
    folder = make_model_dir(tmp_path / "m")
    assert resolve_model_path(str(folder)) == folder.resolve()


def test_an_already_prepared_default_model_is_not_converted_again(tmp_path, monkeypatch):
    prepared = make_model_dir(tmp_path / model_store.DEFAULT_MODEL_DIRNAME)

    def fail(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_store, "_convert_gguf", fail)
    assert resolve_model_path("", tmp_path) == prepared.resolve()


def test_a_missing_default_model_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(model_store, "DEFAULT_MODEL_PACKAGE", "no_such_package_here")
    with pytest.raises(ModelLoadError, match="not installed"):
        resolve_model_path("", tmp_path)
