"""The set-up command ``python -m inference.worker.prepare_model``: it reads ``MODEL_PATH`` and
``LLM_CACHE_DIR`` as the worker does and prints the model folder, or says why it cannot."""

from __future__ import annotations

from inference.engine import model_store
from inference.protocol.models import REPO_ROOT
from inference.protocol.settings import PlatformSettings
from inference.worker import prepare_model
from tests.engine.test_model_store import make_model_dir


def test_prepare_prints_the_configured_model_folder(tmp_path, monkeypatch, capsys):
    folder = make_model_dir(tmp_path / "m")
    monkeypatch.setenv("MODEL_PATH", str(folder))
    assert prepare_model.main([]) == 0
    assert capsys.readouterr().out.strip() == str(folder.resolve())


def test_prepare_fails_clearly_for_a_broken_model_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MODEL_PATH", str(tmp_path / "missing"))
    assert prepare_model.main([]) == 1
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
    assert prepare_model.main([]) == 0
    assert capsys.readouterr().out.strip() == str(prepared.resolve())
