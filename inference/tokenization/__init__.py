"""Text <-> token ids for one model, torch-free: its tokenizer and its chat template.

Both processes use this module. The worker turns a request into prompt token ids with it; the web
tier counts a request's prompt tokens with it for rate limits and budgets. Since both render the
same chat template (default system prompt included) and run the same tokenizer, the web tier's
count is the worker's count. It needs the ``tokenizers`` and ``jinja2`` packages only: no torch,
no transformers.

A model folder holds ``tokenizer.json`` (the tokenizer), ``tokenizer_config.json`` (special
tokens, and the chat template in older folders), optionally ``chat_template.jinja``, and
``config.json`` / ``generation_config.json`` (more EOS ids). The chat template is rendered the
way Hugging Face ``transformers`` renders it (a sandboxed Jinja environment with ``trim_blocks``
and ``lstrip_blocks``, the ``raise_exception`` and ``strftime_now`` globals, a ``tojson`` filter
that does not escape HTML, the special tokens as variables) and the text is then tokenized
without adding special tokens; ``tests/test_tokenization.py`` checks the result against
``transformers``.

**Message contents are plain text.** Only the template's own markers become special (control)
tokens: the text of a special token (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ...)
inside a message's content is tokenized as ordinary text, several tokens, so a message cannot
close its own turn and forge another (a system or assistant turn). A chat whose contents hold no
such text gets exactly the ids of tokenizing the rendered text as one text (as ``transformers``
does); for one that does, :meth:`Tokenizer.chat_ids` finds each content's place in the rendered
text (the template is rendered a second time with each content between two Unicode
noncharacters) and keeps as special only the special tokens outside the contents. A template
that changes a content holding such text (trims it, tests its length, ...) refuses the chat
(``ValueError``) rather than letting it through. A completion's raw prompt is the client's own
text, given to the model as is: special-token text in it stays a control token
(:meth:`Tokenizer.encode`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from inference.tokenization import chat_tools

# Around each content in the second rendering (noncharacters: never in interchange text).
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class TokenizerLoadError(ValueError):
    """A model folder without a usable tokenizer (the message names the folder and the file)."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"{path}: not readable JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as written in ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if isinstance(v, int)]


def _chat_template_source(folder: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: ``chat_template.jinja``, else the tokenizer config's."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:  # -> jinja2.Template
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


@functools.cache
def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE map, character -> byte (the inverse of its ``bytes_to_unicode``):
    printable Latin-1 bytes stand for themselves, the others for ``chr(256 + n)``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


class Tokenizer:
    """One model's tokenizer and chat template (see the module docstring).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        chat_template: the Jinja source of the chat template, or None.
        special_tokens: special token texts by name (``bos_token``, ``eos_token``, ...), given to
            the template as variables.
        eos_token_ids: ids that end an answer.

    Attributes:
        eos_token_ids: ids that end an answer: the tokenizer's EOS plus the model config's and
            generation config's ``eos_token_id`` values.
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._byte_level: bool | None = None  # whether its decoder is byte-level (found once)
        self._plain: Any = None  # a copy that encodes special-token text as ordinary text
        self._special: dict[str, int] | None = None  # special token text -> id (found once)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in eos_token_ids)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load the tokenizer of the model folder ``folder`` (offline; no weights are read).

        Raises:
            TokenizerLoadError: the folder has no ``tokenizer.json``, or a file is unreadable.
        """
        from tokenizers import Tokenizer as RustTokenizer

        folder = Path(folder).expanduser()
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerLoadError(f"model folder {str(folder)!r} has no tokenizer.json")
        try:
            tok = RustTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the Rust library raises its own types
            raise TokenizerLoadError(f"{path}: cannot load the tokenizer: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        special = {name: text for name in SPECIAL_TOKEN_NAMES
                   if (text := _token_text(config.get(name))) is not None}
        eos: list[int] = []
        if "eos_token" in special and tok.token_to_id(special["eos_token"]) is not None:
            eos.append(tok.token_to_id(special["eos_token"]))
        for name in ("config.json", "generation_config.json"):
            eos += _id_list(_read_json(folder / name).get("eos_token_id"))
        return cls(tok, chat_template=_chat_template_source(folder, config),
                   special_tokens=special, eos_token_ids=eos)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added.

        Special-token text in ``text`` becomes its control token: this is how a completion's raw
        prompt is tokenized (the client's own text, given to the model as is, as OpenAI and vLLM
        parse it; a client writing its own chat format needs its markers). Chat contents never
        go through here alone (:meth:`chat_ids`).
        """
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``, special tokens skipped (by default), no clean-up of spaces.

        A character whose bytes are split across tokens shows as U+FFFD until it is complete.
        """
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def json_text(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (``tokenizers.Tokenizer.to_str``): what
        llguidance builds its own tokenizer from (structured outputs)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary (e.g. a special token), or None."""
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token of the vocabulary, which may be part of a character.

        A byte-level BPE vocabulary (GPT-2's map of bytes to characters): the token's own
        bytes; a byte-fallback piece (``<0xNN>``): that byte; else the piece's text, with
        SentencePiece's ``▁`` as a space. A special token gives its text.

        Raises:
            ValueError: an id outside the vocabulary.
        """
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if self._byte_level is None:
            from tokenizers import decoders

            self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        table = byte_level_table()
        if self._byte_level and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tool definitions (it reads the variable ``tools``);
        else a chat with tools gets :func:`inference.tokenization.chat_tools.fallback_messages`."""
        if not self.chat_template:
            return False
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            ast = ImmutableSandboxedEnvironment().parse(self.chat_template)
        except Exception:  # noqa: BLE001 - a template that does not parse renders nothing
            return False
        return "tools" in meta.find_undeclared_variables(ast)

    def _prepared(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None,
                  ) -> tuple[list[dict[str, Any]], list[Any] | None]:
        """The messages and tools the template is given (:mod:`.chat_tools`)."""
        if not chat_tools.uses_tools(messages, tools):
            return [dict(m) for m in messages], None
        if self.renders_tools:
            return chat_tools.template_messages(messages), list(tools) if tools else None
        return chat_tools.fallback_messages(messages, tools), None

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        from jinja2.exceptions import TemplateError

        extra = {"tools": tools} if tools else {}
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=True, **extra, **self.special_tokens)
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from exc

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Any] | None = None) -> str:
        """The prompt text of chat ``messages`` (``role``/``content``; a tool call's or a tool
        result's fields too), with the ``tools`` offered (OpenAI's function tools, or None),
        generation prompt added. A template that does not render tools gets them in the
        fallback format (:mod:`inference.tokenization.chat_tools`).

        Raises:
            ValueError: the model has no chat template, or the template refuses the messages
                (``jinja2.TemplateError`` is a subclass of nothing here, so it is wrapped).
        """
        return self._render(*self._prepared(messages, tools))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Any] | None = None) -> list[int]:
        """Prompt ids of chat ``messages`` (with ``tools``) by the model's own template,
        generation prompt added.

        Special-token text inside a content is ordinary text (see :meth:`chat_ids`).

        Raises:
            ValueError: as :meth:`render_chat` and :meth:`chat_ids`.
        """
        return self.chat_ids(self.render_chat(messages, tools), messages, tools)

    def special_token_ids(self) -> dict[str, int]:
        """The text -> id of each special token of the vocabulary (added tokens marked special)."""
        if self._special is None:
            decoder = getattr(self._tok, "get_added_tokens_decoder", dict)()
            self._special = {t.content: int(i) for i, t in decoder.items() if t.special}
        return self._special

    def chat_ids(self, text: str, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Any] | None = None) -> list[int]:
        """Prompt ids of ``text``, the rendering of ``messages`` and ``tools``
        (:meth:`render_chat`), with special-token text inside a content tokenized as ordinary
        text (several tokens).

        Only the special tokens the template wrote are control tokens. Without special-token
        text in any content, the ids are :meth:`encode` of ``text``. The fallback's tool
        definitions are part of a content; a template that renders tools itself writes them
        outside every content, so special-token text in them is refused.

        Raises:
            ValueError: a content holds special-token text and the template changes that
                content (its place in ``text`` cannot be found), a tool definition the template
                renders holds special-token text, or the template refuses the messages.
        """
        special = self.special_token_ids()
        prepared, shown_tools = self._prepared(messages, tools)
        if shown_tools and any(s in json.dumps(shown_tools, ensure_ascii=False) for s in special):
            raise ValueError("a tool definition holds the text of a special token; remove that "
                             "text from it")
        contents = [m.get("content") for m in prepared]
        if not any(isinstance(c, str) and any(s in c for s in special) for c in contents):
            return self.encode(text)
        spans = self._content_spans(text, prepared, shown_tools)
        encoding = self._tok.encode(text, add_special_tokens=False)
        ids: list[int] = []
        cut = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in special.values() and not any(a < end and start < b for a, b in spans):
                ids += self._plain_encode(text[cut:start])
                ids.append(token_id)
                cut = end
        return ids + self._plain_encode(text[cut:])

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary (added tokens included)."""
        return self._tok.get_vocab_size()

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token text as ordinary text (several tokens), as a
        message content is tokenized (the grammar library's tokenization of forced text)."""
        return self._plain_encode(text)

    def _plain_encode(self, text: str) -> list[int]:
        """Ids of ``text`` with special-token text as ordinary text."""
        if not text:
            return []
        if self._plain is None:
            from tokenizers import Tokenizer as RustTokenizer

            plain = RustTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def _content_spans(self, text: str, messages: list[dict[str, Any]],
                       tools: list[Any] | None) -> list[tuple[int, int]]:
        """``[start, end)`` (characters of ``text``) of each message content, in order.

        Raises:
            ValueError: the places cannot be found (the template changes the contents).
        """
        refused = ValueError("the chat template changes a message content that holds the text "
                             "of a special token; remove that text from the message")
        if any(_OPEN in str(m.get("content")) or _CLOSE in str(m.get("content"))
               for m in messages):
            raise refused
        marked = self._render([{**m, "content": f"{_OPEN}{m['content']}{_CLOSE}"}
                               if isinstance(m.get("content"), str) else m for m in messages],
                              tools)
        spans: list[tuple[int, int]] = []
        plain_len, start = 0, None
        for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
            if piece == _OPEN and start is None:
                start = plain_len
            elif piece == _CLOSE and start is not None:
                spans.append((start, plain_len))
                start = None
            elif piece in (_OPEN, _CLOSE):
                raise refused
            else:
                plain_len += len(piece)
        if start is not None or marked.replace(_OPEN, "").replace(_CLOSE, "") != text:
            raise refused
        return spans
