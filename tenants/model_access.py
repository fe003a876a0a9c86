"""Which models a tenant and an API key may call: their access rules, parsed and matched.

Pure functions of their arguments (no database, no settings), for the tenants' validation and
the web tier's resolution of a request's model (:mod:`gateway.model_registry`).

A rule list is the text of ``Tenant.allowed_models`` or ``ApiKey.allowed_models``: entries
separated by newlines or commas, each an exact model name or a pattern. An empty list sets no
limit (a tenant's: every enabled model; a key's: whatever its tenant allows). A key may call a
model only when both its tenant's rules and its own allow it (:func:`permitted`).

Names are case-sensitive. ``*`` is the only wildcard, and it matches within ONE ``/``-separated
segment, never across a ``/``: ``bedrock/*`` matches ``bedrock/claude`` but neither
``bedrockz/claude`` nor ``bedrock/a/b``; a bare ``*`` matches every name without a ``/``;
``org/*/*`` matches the names of exactly three segments under ``org``. ``**`` is refused rather
than read as a glob's "any depth": a rule never reaches further than it reads.
"""

from __future__ import annotations

import functools
import re

from inference.protocol.settings import MODEL_NAME_MAX, MODEL_NAME_PATTERN

# A model name (the registry's, the API's ``model``): '/'-separated segments each starting with
# a letter or digit; no ':' (kept for ``base:adapter``), '@' (Redis key names), '*' (the
# wildcard below) nor whitespace; MODEL_NAME_MAX characters at most.
NAME_RE = re.compile(MODEL_NAME_PATTERN)
# What an entry of a rule list may hold: the characters of a name, and the wildcard.
_RULE_RE = re.compile(r"^[A-Za-z0-9._/*-]+$")
_SEPARATORS = re.compile(r"[,\n\r]")


def valid_name(name: str) -> bool:
    """Whether ``name`` is a valid model name (:data:`NAME_RE`)."""
    return len(name) <= MODEL_NAME_MAX and NAME_RE.fullmatch(name) is not None


@functools.lru_cache(maxsize=1024)
def parse_rules(text: str) -> tuple[str, ...]:
    """The entries of a rule list, in order: split at newlines and commas, each stripped of
    whitespace; blank entries are dropped (an empty tuple: no limit).

    Raises:
        ValueError: an entry holds a character other than a name's and ``*``, or ``**``; the
            message names the entry.
    """
    rules = []
    for raw in _SEPARATORS.split(text):
        entry = raw.strip()
        if not entry:
            continue
        if _RULE_RE.fullmatch(entry) is None:
            raise ValueError(
                f"'{entry}' is not a model name or pattern: use letters, digits, '.', '_', '-', "
                "'/' and the wildcard '*' (separate entries with commas or new lines).")
        if "**" in entry:
            raise ValueError(
                f"'{entry}': '**' is not supported; '*' matches within one '/'-separated "
                "segment (write 'a/*/*' for names of three segments under 'a').")
        rules.append(entry)
    return tuple(rules)


@functools.lru_cache(maxsize=1024)
def _compiled(rule: str) -> re.Pattern[str]:
    return re.compile("".join("[^/]*" if c == "*" else re.escape(c) for c in rule))


def matches(rule: str, name: str) -> bool:
    """Whether the entry ``rule`` (an exact name, or a pattern whose ``*`` matches any run of
    characters other than ``/``) matches the whole of ``name``, case-sensitively."""
    if "*" not in rule:
        return rule == name
    return _compiled(rule).fullmatch(name) is not None


def allows(rules: tuple[str, ...], name: str) -> bool:
    """Whether a rule list allows ``name``: it is empty (no limit), or an entry matches."""
    return not rules or any(matches(rule, name) for rule in rules)


def permitted(tenant_rules: tuple[str, ...], key_rules: tuple[str, ...], name: str) -> bool:
    """Whether a key may call the model ``name``: both its tenant's rules and its own allow it
    (each as parsed by :func:`parse_rules`; an empty one sets no limit)."""
    return allows(tenant_rules, name) and allows(key_rules, name)
