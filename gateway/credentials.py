"""The bearer token of a request's ``Authorization`` header, for the REST API and ``/metrics``.

Only a token that could be a credential is looked up: printable ASCII (what the platform issues,
and all an HTTP header carries unmangled) of at most :data:`MAX_TOKEN_LENGTH` characters. Anything
else (control characters, NUL, text that is not ASCII, a megabyte of header) is refused as a wrong
token before it reaches the database, whose text columns do not all take it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
