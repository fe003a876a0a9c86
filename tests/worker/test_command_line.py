"""The worker's commands take no arguments: ``--help`` prints what they do and where their settings
come from, and any other argument is refused, before anything is loaded or joined."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inference.worker import prepare_model

REPO = Path(__file__).resolve().parents[2]


def run_worker(*args: str) -> subprocess.CompletedProcess:
    # An unreachable Redis: a worker that started anyway would fail to register, not join one.
    env = {"REDIS_URL": "redis://127.0.0.1:9/0", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "inference.worker", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_worker_prints_its_help_and_exits_without_starting():
    done = run_worker("--help")
    assert done.returncode == 0
    assert "usage: python -m inference.worker" in done.stdout
    assert "REDIS_URL" in done.stdout
    assert "loading backend" not in done.stderr


def test_the_worker_refuses_an_argument_it_does_not_know():
    done = run_worker("--bogus-flag")
    assert done.returncode == 2
    assert "unrecognized arguments: --bogus-flag" in done.stderr
    assert "loading backend" not in done.stderr


def test_prepare_model_prints_its_help_and_refuses_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as helped:
        prepare_model.main(["--help"])
    assert helped.value.code == 0
    assert "MODEL_PATH" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        prepare_model.main(["prepare"])
    assert refused.value.code == 2


def test_the_worker_refuses_a_bad_model_name_or_another_model_without_its_folder():
    env = {"REDIS_URL": "redis://127.0.0.1:9/0", "PATH": "/usr/bin:/bin"}

    def worker(**more: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "inference.worker"], cwd=REPO,
                              env={**env, **more}, capture_output=True, text=True, timeout=120)

    bad = worker(MODEL_NAME="base:adapter")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("inference.worker: MODEL_NAME: ")
    assert "MODEL_NAME='base:adapter' is not a model name" in bad.stderr
    missing = worker(MODEL_NAME="other/model", MODEL_PATH="/nonexistent/model")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "cannot load the model: model path '/nonexistent/model' does not exist" in \
        missing.stderr
    homeless = worker(MODEL_NAME="other/model")  # no MODEL_PATH: it would serve the default's
    assert homeless.returncode == 2
    assert "MODEL_NAME=other/model is not the default model" in homeless.stderr
    assert "loading backend" not in homeless.stderr
