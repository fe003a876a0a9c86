"""Field types of the request bodies, and the rules every body object follows.

- Types are strict, as in the OpenAI API: integers must be JSON integers (not strings, booleans or
  decimal numbers), booleans JSON booleans, numbers JSON numbers.
- Text is valid Unicode: a lone surrogate escape such as ``"\\ud800"`` is refused.
- Unknown fields are refused, naming the field (``api.served_fields`` says which fields each
  endpoint knows).
- ``null`` means the default: an optional field sent as JSON ``null`` is the same as the field
  left out. The OpenAI API marks its optional request fields nullable and its clients send
  ``null`` for ``None`` (``temperature=None``, ``top_p=None``, ...). A required field sent as
  ``null`` is refused, naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

NOT_UNICODE = "invalid_unicode"
NOT_UNICODE_MESSAGE = (
    "not valid Unicode text (it contains a lone surrogate code point such as \\ud800)")
WRONG_TYPE = "wrong_type"


def unicode_text(value: str) -> str:
    """``value`` when it is valid Unicode text (encodable as UTF-8: no lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(NOT_UNICODE, NOT_UNICODE_MESSAGE) from exc
    return value


def wrong_type(expected: str) -> PydanticCustomError:
    """A type error whose message says what was ``expected`` (``"a string or null"``)."""
    return PydanticCustomError(WRONG_TYPE, "{expected}", {"expected": expected})


Text = Annotated[str, AfterValidator(unicode_text)]
# A short name (a user, a cache key, a message's author): at most 256 characters.
Name = Annotated[str, Field(max_length=256), AfterValidator(unicode_text)]


class BodyObject(BaseModel):
    """An object of a request body: strict types, unknown fields refused, null as the default."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {name: value for name, value in data.items()
                if value is not None or name not in fields or fields[name].is_required()}
