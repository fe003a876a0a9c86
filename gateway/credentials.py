"""The bearer token of a request's ``Authorization`` header, for the REST API and ``/metrics``,
and the API key it names (:func:`authenticate_headers`).

Only a token that could be a credential is looked up: printable ASCII (what the platform issues,
and all an HTTP header carries unmangled) of at most :data:`MAX_TOKEN_LENGTH` characters. Anything
else (control characters, NUL, text that is not ASCII, a megabyte of header) is refused as a wrong
token before it reaches the database, whose text columns do not all take it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.errors import APIError
from tenants.models import ApiKey
from tenants.selectors import aauthenticate_key

# Far above an API key's length (``sk-`` and 43 characters) and any sensible scrape token.
MAX_TOKEN_LENGTH = 512


@dataclass(frozen=True)
class Credentials:
    """What the ``Authorization`` header holds: ``present`` is False without a bearer token;
    ``token`` is empty when the token sent cannot be a credential."""

    token: str
    present: bool


def bearer_token(headers: Mapping[str, str]) -> Credentials:
    """The ``Authorization: Bearer <token>`` of ``headers`` (see :class:`Credentials`)."""
    header = headers.get("Authorization", "") or ""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return Credentials("", False)
    if (len(token) > MAX_TOKEN_LENGTH or not token.isascii() or not token.isprintable()
            or " " in token):
        return Credentials("", True)
    return Credentials(token, True)


async def authenticate_headers(headers: Mapping[str, str]) -> ApiKey:
    """The live API key of ``Authorization: Bearer`` in ``headers`` (a mapping that finds the
    header under ``"Authorization"``: a request's ``headers``, or the headers alone, which the
    web process checks before it reads a large body).

    Raises:
        APIError: 401 ``missing_api_key`` without a bearer token, ``invalid_api_key`` for a
            malformed, unknown or revoked key.
        django.db.DatabaseError: the key could not be read (the database is unavailable).
    """
    credentials = bearer_token(headers)
    if not credentials.present:
        raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                       code="missing_api_key")
    key = await aauthenticate_key(credentials.token) if credentials.token else None
    if key is None:
        raise APIError(401, "Incorrect or revoked API key.", code="invalid_api_key")
    return key
