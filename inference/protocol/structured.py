"""Structured outputs on the wire: what a constrained answer must match, and the checks both
tiers make of it (``docs/engine.md``, "Structured outputs").

A request that asks for structured output carries one :class:`StructuredOutput` in its sampling
settings: a ``kind`` (``json_schema``, ``json_object``, ``regex``, ``choice``, ``grammar``) and
its ``spec`` as text. :func:`to_grammar` turns it into the grammar text of the grammar library,
llguidance (``guidance-ai/llguidance``; JSON Schema support per its ``docs/json_schema.md``, its
Lark dialect per ``docs/syntax.md``, GBNF converted to Lark by ``llguidance.gbnf_to_lark``).
llguidance is torch-free, so the web tier runs :func:`check` (size, JSON parsing, the library's
own validation without a tokenizer: a keyword it does not implement is refused here, never
silently dropped) and the worker compiles the same grammar against the model's tokenizer.

Raises (:func:`check`, :func:`to_grammar`): :class:`StructuredOutputError`, naming the request
field and the limit or keyword at fault.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

import llguidance
from pydantic import Field

from inference.protocol.events import Message

__all__ = ["DEFAULT_MAX_SPEC_BYTES", "KINDS", "StructuredOutput", "StructuredOutputError",
           "canonical_json", "check", "is_library_panic", "to_grammar"]

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# The largest spec (schema JSON, regex, grammar text, or choice list) in UTF-8 bytes; the
# setting STRUCTURED_MAX_SPEC_BYTES. A 12-field schema is about 1 KB; OpenAI's own limit for a
# strict schema is 100 properties and 5 levels of nesting.
DEFAULT_MAX_SPEC_BYTES = 64 * 1024
# How JSON answers are written: compact, as OpenAI's strict mode writes them (`{"a":1,"b":[2]}`),
# so a model cannot fill its answer with blanks (llguidance's default allows any run of
# whitespace) and every key and separator is a forced token (docs/engine.md, jump-forward). A
# schema's own "x-guidance" options (llguidance's) come after these.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
# What any JSON object means (``response_format: {"type": "json_object"}``).
ANY_OBJECT_SCHEMA = '{"type":"object"}'


class StructuredOutputError(ValueError):
    """A structured-output spec this server cannot serve.

    Attributes:
        param: the request field at fault (``response_format.json_schema.schema``, ...).
        message: what is wrong, naming the keyword or the limit.
    """

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


class StructuredOutput(Message):
    """What a constrained answer must match.

    Attributes:
        kind: ``json_schema`` (``spec``: the schema as compact JSON, :func:`canonical_json`),
            ``json_object`` (any JSON object; ``spec`` empty), ``regex`` (a Rust ``regex``
            pattern the whole answer matches), ``choice`` (``spec``: a JSON list of strings; the
            answer is exactly one of them), ``grammar`` (a Lark grammar in llguidance's dialect,
            or GBNF as llama.cpp writes it).
        spec: the text above.
        param: the request field that asked for it; errors name it.
    """

    kind: Kind
    spec: str = ""
    param: str = Field("response_format", min_length=1)

    def cache_key(self) -> str:
        """The compiled grammar's cache key: a hash of the kind and the canonical spec."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()


def canonical_json(value: Any) -> str:
    """``value`` as compact JSON text: the same schema written with other spacing gives the same
    text (and cache key). Key order is kept: the answer lists properties in the schema's order."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def to_grammar(out: StructuredOutput) -> str:
    """The llguidance grammar text of ``out`` (not yet validated: see :func:`check`).

    Raises:
        StructuredOutputError: a spec that is not of its kind's form (a choice that is not a
            non-empty list of strings, a grammar that is neither Lark nor GBNF).
    """
    if out.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT_SCHEMA,
                                                             defaults=JSON_OPTIONS)
    if out.kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(out.spec, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise StructuredOutputError(out.param, f"'{out.param}' is not a JSON Schema object: "
                                                   f"{exc}") from exc
    if out.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(out.spec)
    if out.kind == "choice":
        choices = _choices(out)
        return llguidance.grammar_from("choice", json.dumps(choices))
    try:
        return llguidance.grammar_from("grammar", out.spec)
    except ValueError as exc:
        raise StructuredOutputError(out.param, f"'{out.param}' is neither a Lark grammar nor "
                                               f"GBNF: {exc}") from exc


def _choices(out: StructuredOutput) -> list[str]:
    try:
        choices = json.loads(out.spec)
    except ValueError:
        choices = None
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise StructuredOutputError(out.param, f"'{out.param}' must be a non-empty list of "
                                               f"non-empty strings.")
    return choices


# What a spec of each kind is, in the words of an error.
_WHAT = {"json_schema": "schema", "json_object": "schema", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(?P<keys>[^\]]*)\]")


def check(out: StructuredOutput, max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES) -> str:
    """Check ``out`` without a tokenizer and return its grammar text (:func:`to_grammar`).

    Cheap (microseconds to a few milliseconds: no lexer is built); the worker's compile against
    the tokenizer, under its fuel limits, may still refuse a grammar this passes.

    Raises:
        StructuredOutputError: the spec is over ``max_spec_bytes`` (UTF-8), not valid Unicode
            text (a lone surrogate), not of its kind's form, or not valid for the grammar
            library; a JSON Schema keyword the library does not implement is named
            (``'if', 'then'``), as is an unknown string ``format``.
    """
    size = len(out.spec.encode("utf-8", "surrogatepass"))
    if size > max_spec_bytes:
        raise StructuredOutputError(out.param, (
            f"'{out.param}' is {size} bytes, over this server's limit of {max_spec_bytes} bytes "
            f"for a structured-output spec."))
    try:  # the grammar library takes UTF-8 text only: a lone surrogate would escape as is
        out.spec.encode("utf-8")
    except UnicodeEncodeError:
        raise StructuredOutputError(out.param, (
            f"'{out.param}' is not valid Unicode text (it contains a lone surrogate code point "
            f"such as \\ud800).")) from None
    if out.kind == "json_schema" and _has_options(out.spec):
        raise StructuredOutputError(out.param, (
            f"'{out.param}' has an 'x-guidance' key: this server sets how answers are written "
            f"itself (compact JSON, every keyword applied); remove it."))
    try:
        grammar = to_grammar(out)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except BaseException as exc:  # a panic of the library is pyo3's PanicException, no Exception
        if not is_library_panic(exc):
            raise
        raise StructuredOutputError(out.param, (
            f"'{out.param}' is not a {_WHAT[out.kind]} this server can apply: the grammar "
            f"library failed on it ({str(exc)[:200]}).")) from None
    if failed:
        raise StructuredOutputError(out.param, _explain(out, messages[0] if messages else ""))
    return grammar


def _has_options(spec: str) -> bool:
    """Whether a schema carries llguidance's own options (``x-guidance``, read at its root)."""
    try:
        schema = json.loads(spec)
    except ValueError:
        return False  # to_grammar names the error
    return isinstance(schema, dict) and "x-guidance" in schema


def is_library_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a Rust panic of the grammar library, as pyo3 raises it (llguidance
    1.9.1 panics on some schemas: a keyword of the wrong type whose value, shown in its error
    message, is cut inside a multi-byte character)."""
    return type(exc).__name__ == "PanicException"


def _explain(out: StructuredOutput, error: str) -> str:
    """The 400's message for the library's ``error`` about ``out``."""
    error = error.strip()
    found = _UNIMPLEMENTED.search(error)
    if found:
        keys = ", ".join(f"'{k.strip().strip(chr(34))}'" for k in found["keys"].split(","))
        return (f"'{out.param}' uses JSON Schema keywords this server does not support: {keys}. "
                f"Remove them (or express the constraint with supported keywords); the schema "
                f"is not applied in part.")
    if error.startswith("Unknown format"):
        return (f"'{out.param}' uses a string format this server does not support "
                f"({error.removeprefix('Unknown format:').strip()!r}).")
    return f"'{out.param}' is not a {_WHAT[out.kind]} this server can apply: {error}"
