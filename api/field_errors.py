"""A validation error, told to the client: the field as the client wrote it, and what it accepts.

Errors name the field as the client wrote it (``messages[0].content``) and, for numbers, the
accepted range. They never echo the value itself, which may be huge: only what kind of JSON value
it was.
"""

from __future__ import annotations

import re
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic_core import ErrorDetails

from api.fields import NOT_UNICODE, NOT_UNICODE_MESSAGE, WRONG_TYPE

# What a type error expected, by pydantic's error type.
EXPECTED_BY_ERROR = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Longest value shown in a range error; a longer one is described, not shown.
MAX_SHOWN_VALUE = 24
# Longest field name shown in an unknown field's path; a longer one is cut.
MAX_SHOWN_NAME = 64
UNKNOWN_FIELD = "extra_forbidden"  # pydantic's error type for a field a body object lacks


def param(loc: tuple[int | str, ...]) -> str | None:
    """A field's location as the client wrote it: ``messages[0].content``.

    Segments that are not field names (pydantic's tags of union members and validators, such as
    ``str`` or ``function-after[...]``) are left out.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part) and part not in ("str", "int", "float", "bool"):
            out += f".{part}" if out else part
    return out or None


def written_path(loc: tuple[int | str, ...]) -> str:
    """Every segment of ``loc`` as the client wrote it (``messages[0].tool_call_id``), for a
    field the client made up: a name with a lone surrogate is shown escaped, a long one cut."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        name = part[:MAX_SHOWN_NAME].encode("utf-8", "backslashreplace").decode("utf-8")
        name = (name or '""') + ("..." if len(part) > MAX_SHOWN_NAME else "")
        out += f".{name}" if out else name
    return out


def unknown_field_message(path: str, why: str = "") -> str:
    """OpenAI's words for a field it does not know, with ``why`` after them."""
    return f"Unrecognized request argument supplied: {path}{f' ({why})' if why else ''}."


def json_type(value: Any) -> str:
    """What a JSON value is, in words (never the value itself, which may be huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def number_range(model: type[BaseModel], loc: tuple[int | str, ...]) -> str | None:
    """What a top-level numeric field accepts, in words (``an integer from 1 to 2147483647``)."""
    if len(loc) != 1 or not isinstance(loc[0], str) or loc[0] not in model.model_fields:
        return None
    field = model.model_fields[loc[0]]
    annotation = str(field.annotation)
    if "int" in annotation:
        number = "an integer"
    elif "float" in annotation:
        number = "a number"
    else:
        return None
    bounds: dict[str, Any] = {}
    for item in field.metadata:
        for cls, key in ((Ge, "ge"), (Gt, "gt"), (Le, "le"), (Lt, "lt")):
            if isinstance(item, cls):
                bounds[key] = getattr(item, key)
    if "ge" in bounds and "le" in bounds:
        return f"{number} from {bounds['ge']} to {bounds['le']}"
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{words[key]} {value}" for key, value in bounds.items()]
    return " ".join([number, " and ".join(parts)]) if parts else number


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        return "a number out of that range"
    return text if len(text) <= MAX_SHOWN_VALUE else "a number out of that range"


def message(model: type[BaseModel], error: ErrorDetails, name: str | None) -> str:
    """The client's message for pydantic's ``error`` in ``model``, about the field ``name``."""
    kind, value = error["type"], error.get("input")
    if kind == UNKNOWN_FIELD:
        return unknown_field_message(written_path(error["loc"]))
    if kind == "missing":
        return f"'{name}' is required."
    if kind in (NOT_UNICODE, "string_unicode"):  # the latter: pydantic's, with str constraints
        return f"Invalid value for '{name}': {NOT_UNICODE_MESSAGE}."
    if kind == WRONG_TYPE or kind in EXPECTED_BY_ERROR:
        expected = error["msg"] if kind == WRONG_TYPE else EXPECTED_BY_ERROR[kind]
        if kind in EXPECTED_BY_ERROR and expected in ("an integer", "a number"):
            expected = number_range(model, error["loc"]) or expected
        return f"Invalid type for '{name}': expected {expected}, but got {json_type(value)}."
    if kind in ("too_short", "too_long") and isinstance(value, list):
        bound = (error.get("ctx") or {}).get("min_length" if kind == "too_short" else
                                             "max_length")
        least = "at least" if kind == "too_short" else "at most"
        return (f"Invalid value for '{name}': expected {least} {bound} "
                f"item{'' if bound == 1 else 's'}, but got {len(value)}.")
    if kind in RANGE_ERRORS and (expected := number_range(model, error["loc"])):
        return f"Invalid value for '{name}': expected {expected}, but got {_shown(value)}."
    text = error["msg"].removeprefix("Value error, ")
    return f"Invalid value for '{name}': {text}."
