"""Structured outputs in a request body: OpenAI's ``response_format`` and vLLM's
``structured_outputs``, their shapes, and the :class:`StructuredOutput` each asks the worker for
(``docs/platform.md``, "Structured outputs").

Both endpoints take both fields (``response_format`` on completions is an extension, as in vLLM):

- ``response_format``: ``{"type": "text"}`` (no constraint, as leaving it out),
  ``{"type": "json_object"}`` (any JSON object), or ``{"type": "json_schema", "json_schema":
  {"name", "description", "schema", "strict"}}`` (the answer matches the schema). ``name`` is
  required, as OpenAI's rule writes it (1 to 64 of a-z, A-Z, 0-9, underscores and dashes);
  ``description`` is checked, not used (vLLM does not give it to the model either); ``strict``
  is checked, not used: every schema is applied exactly, as with ``strict: true``, and without
  the extra rules OpenAI's strict mode puts on a schema. A ``json_schema`` without ``schema``
  (optional in OpenAI's types) means any JSON object, as ``{"type": "json_object"}``: vLLM then
  applies no constraint at all (``guided_json`` left None), or in newer releases refuses the
  request; the client asked for JSON, and an answer silently unconstrained would ignore that.
- ``structured_outputs`` (vLLM's): exactly one of ``json`` (a JSON Schema object, or its JSON
  text), ``regex`` (a pattern the whole answer matches), ``choice`` (a non-empty array of
  non-empty strings: the answer is one of them) and ``grammar`` (Lark in llguidance's dialect,
  or GBNF). Its other vLLM keys, where they ask for something, are refused by
  :mod:`api.served_fields` (``unsupported_parameter``); any other key is unknown. It cannot be
  sent with a ``response_format`` other than text.

Every spec then goes through :func:`inference.protocol.structured.check` (:func:`check`), within
``STRUCTURED_MAX_SPEC_BYTES``: what the grammar library cannot apply is a 400 naming the field,
``invalid_json_schema`` for a JSON schema, ``invalid_structured_output`` for the others.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from api import field_errors
from api.fields import BodyObject, Text, unicode_text, wrong_type
from gateway.errors import APIError
from inference.protocol.structured import (
    StructuredOutput,
    StructuredOutputError,
    canonical_json,
)
from inference.protocol.structured import check as check_spec

# OpenAI's rule for a response format's name.
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The keys of ``structured_outputs`` served: exactly one of them asks.
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar")


def _schema_name(value: str) -> str:
    if not SCHEMA_NAME.fullmatch(value):
        raise ValueError("expected 1 to 64 characters of a-z, A-Z, 0-9, underscores and dashes")
    return value


class JsonSchemaFormat(BodyObject):
    """``response_format.json_schema``: OpenAI's ``name``, ``description``, ``schema``,
    ``strict``."""

    name: Annotated[str, AfterValidator(_schema_name)]
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BodyObject):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (with its
    ``json_schema`` object, which only that type has)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _only_with_its_type(cls, value: JsonSchemaFormat | None,
                            info: ValidationInfo) -> JsonSchemaFormat | None:
        kind = info.data.get("type")
        if kind == "json_schema" and value is None:
            raise PydanticCustomError("missing", "Field required")
        if kind in ("text", "json_object") and value is not None:
            # As OpenAI's types have it: the other formats have no such field.
            raise PydanticCustomError(field_errors.UNKNOWN_FIELD, "Extra inputs are not permitted")
        return value

    def output(self) -> StructuredOutput | None:
        """What it asks the worker for (None: nothing)."""
        if self.type == "json_object":
            return StructuredOutput(kind="json_object", param="response_format")
        if self.json_schema is None:
            return None
        if self.json_schema.schema_ is None:  # any JSON object (module docstring)
            return StructuredOutput(kind="json_object", param="response_format.json_schema")
        param = "response_format.json_schema.schema"
        return StructuredOutput(kind="json_schema", spec=_compact(self.json_schema.schema_, param),
                                param=param)


Choice = Annotated[str, Field(min_length=1), AfterValidator(unicode_text)]


class StructuredOutputs(BodyObject):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``,
    ``grammar`` (its other keys are taken out, or refused, by :mod:`api.served_fields`)."""

    json_: Any = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Choice], Field(min_length=1)] | None = None
    grammar: Text | None = None

    @field_validator("json_", mode="before")
    @classmethod
    def _schema_or_its_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            return unicode_text(value)
        if value is not None and not isinstance(value, dict):
            raise wrong_type("an object (a JSON Schema) or a string (its JSON text)")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [key for key in CONSTRAINT_KEYS
                 if getattr(self, "json_" if key == "json" else key) is not None]
        if len(given) != 1:
            keys = ", ".join(f"'{key}'" for key in CONSTRAINT_KEYS)
            got = ", ".join(f"'{key}'" for key in given) or "none"
            raise ValueError(f"give exactly one of {keys} (got {got})")
        return self

    def output(self) -> StructuredOutput:
        """What it asks the worker for.

        Raises:
            APIError: 400 ``invalid_json_schema`` for ``json`` text that is not a JSON object.
        """
        if self.regex is not None:
            return StructuredOutput(kind="regex", spec=self.regex, param="structured_outputs.regex")
        if self.choice is not None:
            return StructuredOutput(kind="choice", spec=canonical_json(self.choice),
                                    param="structured_outputs.choice")
        if self.grammar is not None:
            return StructuredOutput(kind="grammar", spec=self.grammar,
                                    param="structured_outputs.grammar")
        param, schema = "structured_outputs.json", self.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema, parse_constant=_not_json)
            except ValueError as exc:
                raise _refusal(StructuredOutputError(
                    param, f"'{param}' is a string that is not JSON text: {exc}"),
                    "json_schema") from exc
        if not isinstance(schema, dict):
            raise _refusal(StructuredOutputError(
                param, f"'{param}' must be a JSON Schema object (or its JSON text), not "
                       f"{field_errors.json_type(schema)}."), "json_schema")
        return StructuredOutput(kind="json_schema", spec=_compact(schema, param), param=param)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _compact(schema: dict[str, Any], param: str) -> str:
    """The schema as compact JSON text; a number JSON cannot write (``1e400`` read as
    infinity) is a 400 naming the field."""
    try:
        return canonical_json(schema)
    except ValueError as exc:
        raise _refusal(StructuredOutputError(
            param, f"'{param}' holds a number out of range (it reads as infinity): {exc}."),
            "json_schema") from exc


# Fields a constrained answer cannot honour together with its grammar: a stop string would cut
# the answer short of it and still say "stop"; min_tokens and ignore_eos would go on past its end.
CONFLICTS = {"stop": "a stop sequence would cut the answer short of its grammar",
             "min_tokens": "the answer ends where its grammar does",
             "ignore_eos": "the answer ends where its grammar does"}


def check_request(req: Any, max_spec_bytes: int) -> None:
    """:func:`check` of ``req.structured``, and the fields it cannot go with (:data:`CONFLICTS`).

    Raises:
        APIError: as :func:`check`; 400 ``unsupported_parameter`` naming ``stop``,
            ``min_tokens`` or ``ignore_eos`` when one asks for something beside a structured
            output.
    """
    out = req.structured
    if out is None:
        return
    for name, why in CONFLICTS.items():
        if getattr(req, name, None):
            what = ("tools (their calls follow a grammar)" if out.param == "tools"
                    else f"a structured output ('{out.param}')")
            raise APIError(400, f"'{name}' is not supported together with {what}: {why}.",
                           param=name, code="unsupported_parameter")
    check(out, max_spec_bytes)


def requested(response_format: ResponseFormat | None,
              structured_outputs: StructuredOutputs | None) -> StructuredOutput | None:
    """What a request's fields ask the worker for (None: an unconstrained answer).

    Raises:
        APIError: 400 ``invalid_value`` naming ``structured_outputs`` when a ``response_format``
            other than text asks too; 400 ``invalid_json_schema`` for ``structured_outputs.json``
            text that is not a JSON object.
    """
    if structured_outputs is None:
        return response_format.output() if response_format is not None else None
    if response_format is not None and response_format.type != "text":
        raise APIError(400, (
            "Invalid value for 'structured_outputs': 'response_format' asks for structured "
            "output too; give one of them."), param="structured_outputs", code="invalid_value")
    return structured_outputs.output()


def _refusal(exc: StructuredOutputError, kind: str) -> APIError:
    code = "invalid_json_schema" if kind == "json_schema" else "invalid_structured_output"
    return APIError(400, exc.message, param=exc.param, code=code)


def check(out: StructuredOutput | None, max_spec_bytes: int) -> None:
    """Check ``out`` as the worker will compile it (:func:`inference.protocol.structured.check`).

    Raises:
        APIError: 400 naming the field, ``invalid_json_schema`` for a JSON schema,
            ``invalid_structured_output`` for a regex, a choice list or a grammar: a spec over
            ``max_spec_bytes``, or one the grammar library cannot apply (a JSON Schema keyword
            it does not implement, an unknown string format, an invalid regex or grammar).
    """
    if out is None:
        return
    try:
        check_spec(out, max_spec_bytes)
    except StructuredOutputError as exc:
        raise _refusal(exc, out.kind) from exc
