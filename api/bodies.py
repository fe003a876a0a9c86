"""A request body: its JSON object, and that object validated as a body model."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from api import field_errors, served_fields
from api.fields import BodyObject
from gateway.errors import APIError


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def too_deep() -> APIError:
    return APIError(400, "The request body is nested too deeply to be a request.",
                    code="invalid_json")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in a request body.

    Raises:
        APIError: 400 ``invalid_json`` for a body that is not a JSON object (not JSON, not
            UTF-8, ``NaN`` or ``Infinity``, nested deeper than the parser goes, an integer of
            more than 4300 digits).
    """
    try:  # UTF-8 only (RFC 8259; a leading BOM is ignored): json.loads would take UTF-16 and 32
        text = (raw or b"").decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The request body is not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                            f"offset {exc.start}); a JSON body is UTF-8.",
                       code="invalid_json") from exc
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise too_deep() from exc
    except ValueError as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}",
                       code="invalid_json") from exc
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def parse_model(model: type[BodyObject], body: dict[str, Any]) -> Any:
    """``body`` validated as ``model``.

    Raises:
        APIError: 400 naming the first offending field as the client wrote it:
            ``unknown_parameter`` for a field ``model`` does not have, else ``invalid_value``.
    """
    try:
        return model.model_validate(body)
    except RecursionError as exc:
        raise too_deep() from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == field_errors.UNKNOWN_FIELD:
            raise served_fields.unknown(first["loc"]) from exc
        if first["type"] == "string_unicode" and (
                key := served_fields.key_not_unicode(body, first["loc"])):
            raise served_fields.unknown(key) from exc  # no field's name is a lone surrogate
        param = field_errors.param(first["loc"])
        raise APIError(400, field_errors.message(model, first, param), param=param,
                       code="invalid_value") from exc
