"""Access rules of tenants and keys: parsing, patterns that never cross a '/', both lists."""

from __future__ import annotations

import pytest

from tenants.model_access import allows, matches, parse_rules, permitted, valid_name


@pytest.mark.parametrize(("text", "rules"), [
    ("", ()),
    ("   \n\n , ,", ()),
    ("a", ("a",)),
    ("a,b", ("a", "b")),
    (" a ,\tb\n c \r\n", ("a", "b", "c")),
    ("bedrock/*\nSmolLM2-135M-Instruct, org/model.v1_2", (
        "bedrock/*", "SmolLM2-135M-Instruct", "org/model.v1_2")),
    ("*", ("*",)),
    ("a,a", ("a", "a")),
])
def test_entries_are_split_at_newlines_and_commas_and_stripped(text, rules):
    assert parse_rules(text) == rules


@pytest.mark.parametrize(("text", "entry"), [
    ("gpt 4", "gpt 4"),
    ("ok, base:adapter", "base:adapter"),
    ("model@2", "model@2"),
    ("a\nmodel?", "model?"),
    ("caf\u00e9", "caf\u00e9"),
    ("a;b", "a;b"),
    ("bedrock/**", "bedrock/**"),
    ("**", "**"),
])
def test_an_entry_with_other_characters_is_refused_naming_it(text, entry):
    with pytest.raises(ValueError) as error:
        parse_rules(text)
    assert f"'{entry}'" in str(error.value)


@pytest.mark.parametrize(("rule", "name", "expected"), [
    # LiteLLM issue #33030: a prefix pattern must stop at the segment's end.
    ("bedrock/*", "bedrock/claude", True),
    ("bedrock/*", "bedrockz/claude", False),
    ("bedrock/*", "bedrock/a/b", False),
    ("bedrock/*", "bedrock", False),
    ("bedrock*", "bedrock/claude", False),
    ("bedrock*", "bedrockz", True),
    ("*", "SmolLM2-135M-Instruct", True),
    ("*", "org/model", False),
    ("*/*", "org/model", True),
    ("*/*", "org/model/v2", False),
    ("org/*/*", "org/family/model", True),
    ("org/*/*", "org/model", False),
    ("*/claude", "bedrock/claude", True),
    ("*/claude", "x/y/claude", False),
    ("Smol*-Instruct", "SmolLM2-135M-Instruct", True),
    ("Smol*-Instruct", "SmolLM2-135M-Base", False),
    ("a.b", "axb", False),  # '.' is a literal, not a regex
    ("a-*", "a-", True),
    # Names are case-sensitive, exact names too.
    ("SmolLM2-135M-Instruct", "smollm2-135m-instruct", False),
    ("smol*", "SmolLM2", False),
    ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", True),
    ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct2", False),
])
def test_a_wildcard_matches_within_one_segment_only(rule, name, expected):
    assert matches(rule, name) is expected


def test_an_empty_list_sets_no_limit_and_a_key_narrows_its_tenant():
    assert allows((), "anything")
    assert permitted((), (), "m")
    assert permitted(("m", "n"), (), "n")
    assert not permitted(("m",), (), "n")
    assert permitted((), ("n",), "n") and not permitted((), ("n",), "m")
    # Both must allow: a key cannot widen what its tenant allows.
    assert not permitted(("bedrock/*",), ("openai/*", "bedrock/claude"), "openai/gpt")
    assert permitted(("bedrock/*",), ("openai/*", "bedrock/claude"), "bedrock/claude")
    assert not permitted(("bedrock/*",), ("bedrock/claude",), "bedrock/titan")


def test_parsed_lists_from_text_with_blank_entries_and_whitespace():
    tenant = parse_rules("  bedrock/* ,\n\n SmolLM2-135M-Instruct \n")
    key = parse_rules("\n")
    assert permitted(tenant, key, "SmolLM2-135M-Instruct")
    assert permitted(tenant, key, "bedrock/claude")
    assert not permitted(tenant, key, "bedrock/a/b")
    assert not permitted(tenant, key, " SmolLM2-135M-Instruct")


@pytest.mark.parametrize(("name", "valid"), [
    ("SmolLM2-135M-Instruct", True), ("org/model.v1_2", True), ("a", True),
    ("-a", False), ("/a", False), ("a:b", False), ("a@b", False), ("a*", False),
    ("a b", False), ("a\n", False), ("", False), ("a" * 128, True), ("a" * 129, False),
    # Every '/'-separated part starts with a letter or digit: no empty, '.' or '..' part.
    ("tiny/", False), ("a//b", False), ("tiny/.", False), ("tiny/../x", False),
    ("a/.b", False), ("a/b.", True), ("a/b/c", True),
])
def test_model_names(name, valid):
    assert valid_name(name) is valid
