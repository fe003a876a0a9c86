"""Where the weights come from: MODEL_PATH validation and the `prepare` command (no model load)."""

from __future__ import annotations

import pytest

from inference import model_store
from inference.model_store import ModelLoadError, resolve_model_path
from inference.protocol import REPO_ROOT, PlatformSettings


def make_model_dir(folder):
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_a_valid_model_path_is_used_as_it_is(tmp_path):
    folder = make_model_dir(tmp_path / "m")
    assert resolve_model_path(str(folder)) == folder.resolve()


def test_prepare_prints_the_configured_model_folder(tmp_path, monkeypatch, capsys):
    folder = make_model_dir(tmp_path / "m")
    monkeypatch.setenv("MODEL_PATH", str(folder))
    assert model_store.main(["prepare"]) == 0
    assert capsys.readouterr().out.strip() == str(folder.resolve())


def test_prepare_fails_clearly_for_a_broken_model_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MODEL_PATH", str(tmp_path / "missing"))
    assert model_store.main(["prepare"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_the_cache_dir_follows_llm_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_CACHE_DIR", str(tmp_path))
    assert PlatformSettings().model_cache_dir == tmp_path
    monkeypatch.delenv("LLM_CACHE_DIR")
    assert PlatformSettings().model_cache_dir == REPO_ROOT / ".cache" / "models"
    assert model_store.DEFAULT_CACHE_DIR == REPO_ROOT / ".cache" / "models"


def test_prepare_builds_the_default_model_under_llm_cache_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MODEL_PATH", raising=False)
    monkeypatch.setenv("LLM_CACHE_DIR", str(tmp_path))
    prepared = make_model_dir(tmp_path / model_store.DEFAULT_MODEL_DIRNAME)
    assert model_store.main(["prepare"]) == 0
    assert capsys.readouterr().out.strip() == str(prepared.resolve())


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
