"""Where the benchmarks write: ``benchmarks/results/`` at the repository's root, whichever folder
the writing module sits in."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["benchmarks.harness.common", "benchmarks.serving.engine.cli",
                                    "benchmarks.kernels.decode_step"])
def test_results_go_under_the_repositorys_benchmarks_folder(module):
    assert (REPO / "manage.py").is_file()
    assert importlib.import_module(module).REPO == REPO


def test_the_experiments_results_folder():
    from benchmarks.harness.common import RESULTS_DIR

    assert REPO / "benchmarks" / "results" == RESULTS_DIR
