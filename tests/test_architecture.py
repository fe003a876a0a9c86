"""The code's layout rules: the import contracts (import-linter) and the size of a module."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# The engine's modules the web tier may import; every other one is forbidden to it.
WEB_VISIBLE = {"inference.protocol", "inference.tokenization"}
# Packages whose modules stay readable in one sitting.
SIZE_CHECKED = ("inference", "gateway", "api")
MAX_MODULE_LINES = 400


def test_the_import_contracts_hold():
    result = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_the_web_tier_contract_names_every_engine_module_but_the_protocol_and_tokenizer():
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    contract = config["importlinter:contract:web-sees-only-the-protocol"]
    forbidden = set(contract["forbidden_modules"].split())
    modules = {f"inference.{p.stem}" for p in (REPO / "inference").glob("*.py")
               if p.stem != "__init__"}
    modules |= {f"inference.{p.name}" for p in (REPO / "inference").iterdir()
                if (p / "__init__.py").is_file()}
    assert modules - WEB_VISIBLE - forbidden == set(), "a new engine module is not forbidden"
    assert modules >= WEB_VISIBLE and not WEB_VISIBLE & forbidden


@pytest.mark.parametrize("package", SIZE_CHECKED)
def test_no_module_is_longer_than_one_sitting(package):
    long = {str(p.relative_to(REPO)): n for p in (REPO / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these along their concepts: {long}"
