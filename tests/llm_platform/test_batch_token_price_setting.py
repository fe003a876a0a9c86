"""``BATCH_TOKEN_PRICE``: the share of a token one token of batch work is charged, 0 < x <= 1
(default 0.5); anything else stops every process at start with an error naming the setting."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

from gateway.pricing import batch_token_price, parse_token_price
from tests.llm_platform.test_secret_key import REPO, _environment

SHOW = [sys.executable, "-c", "import django; django.setup(); from django.conf import settings;"
        " print(settings.LLM_PLATFORM['BATCH_TOKEN_PRICE'])"]


@pytest.mark.parametrize(("raw", "price"), [("0.5", 0.5), ("1", 1.0), ("0.01", 0.01),
                                            (" 0.25 ", 0.25), (0.75, 0.75), ("1e-3", 0.001)])
def test_a_share_of_a_token_is_a_price(raw, price):
    assert parse_token_price(raw) == price


@pytest.mark.parametrize("raw", ["0", "-0.5", "1.01", "2", "half", "", "nan", "inf", None,
                                 True])
def test_anything_else_is_refused_naming_the_setting(raw):
    with pytest.raises(ImproperlyConfigured, match=r"BATCH_TOKEN_PRICE must be a number greater "
                                                   r"than 0 and at most 1"):
        parse_token_price(raw)


def test_the_default_is_half_and_a_bad_override_is_refused_where_it_is_read(settings):
    assert settings.LLM_PLATFORM["BATCH_TOKEN_PRICE"] == 0.5 == batch_token_price()
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_TOKEN_PRICE": 0}
    with pytest.raises(ImproperlyConfigured, match="BATCH_TOKEN_PRICE"):
        batch_token_price()


@pytest.mark.process
@pytest.mark.parametrize("raw", ["0", "1.5", "half"])
def test_a_bad_price_stops_the_process_at_start_naming_it(raw):
    refused = subprocess.run(SHOW, cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=_environment(BATCH_TOKEN_PRICE=raw))
    assert refused.returncode != 0
    assert "ImproperlyConfigured: BATCH_TOKEN_PRICE must be a number" in refused.stderr
    assert repr(raw) in refused.stderr


@pytest.mark.process
def test_a_good_price_starts():
    started = subprocess.run(SHOW, cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=_environment(BATCH_TOKEN_PRICE="0.3"))
    assert started.returncode == 0, started.stderr[-2000:]
    assert started.stdout.strip().splitlines()[-1] == "0.3"
