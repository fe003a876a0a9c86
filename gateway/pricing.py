"""What a token costs a tenant: batch work is charged ``BATCH_TOKEN_PRICE`` of a token.

A request of the batch service class (a Batch API line) is charged, wherever a tenant is
charged in tokens (its token budget, the ``billed_tokens`` of its usage record), that share of
each token it reserves and uses: ``ceil(price * tokens)``, rounded up once per request. An
interactive request is charged its tokens in full (price 1). Rate limits (tokens per minute)
protect capacity, not money: they count every request's tokens in full.

The price in force when a request is admitted travels in its message's ``meta``
(:data:`META_KEY` under ``meta["admission"]``, :func:`price_of`), so that its settlement and its
usage record charge it at the price it reserved at, whatever the settings say by then.

This module imports no model: the settings module validates the setting with
:func:`parse_token_price` while it loads.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from gateway.conf import platform_settings

SETTING = "BATCH_TOKEN_PRICE"
DEFAULT_BATCH_TOKEN_PRICE = 0.5
# Where an admitted request's price is kept, in ``meta["admission"]``.
META_KEY = "token_price"
FULL_PRICE = 1.0


def parse_token_price(raw: object, name: str = SETTING) -> float:
    """``raw`` (a number, or its text as the environment gives it) as a price share of a token.

    Returns:
        The price, a float with 0 < price <= 1.

    Raises:
        ImproperlyConfigured: ``raw`` is not a finite number, or is 0 or less, or more than 1;
            the message names the setting ``name``.
    """
    try:
        price = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        price = math.nan
    if isinstance(raw, bool) or not (0 < price <= 1):  # NaN fails the comparison too
        raise ImproperlyConfigured(
            f"{name} must be a number greater than 0 and at most 1 (the share of a token one "
            f"token of batch work is charged, e.g. 0.5), not {raw!r}.")
    return price


def batch_token_price() -> float:
    """The price of a batch token now (``BATCH_TOKEN_PRICE``; 0 < price <= 1).

    Raises:
        ImproperlyConfigured: the setting is not a valid price (:func:`parse_token_price`).
    """
    return parse_token_price(platform_settings().get(SETTING, DEFAULT_BATCH_TOKEN_PRICE))


def priced(tokens: int, price: float) -> int:
    """What ``tokens`` tokens cost at ``price`` (a share of a token), in whole tokens:
    ``ceil(price * tokens)``, the price taken as the decimal it is written as (0.1 * 30 is 3,
    not 4), so every place that charges the same request gets the same figure."""
    if price == FULL_PRICE:
        return int(tokens)
    return math.ceil(Decimal(repr(float(price))) * int(tokens))


def price_of(meta: dict[str, Any]) -> float:
    """The price a request was admitted at, from its message's ``meta`` (1: an interactive
    request, or one admitted before prices were kept)."""
    admission = meta.get("admission")
    price = admission.get(META_KEY) if isinstance(admission, dict) else None
    if isinstance(price, int | float) and not isinstance(price, bool) and 0 < price <= 1:
        return float(price)
    return FULL_PRICE
