"""Tool calls read from an answer's text (``api.tool_calls``): the same content and calls
whatever the deltas the text streams in, and the shapes a model writes."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from api.tool_calls import ToolCallParser

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                               max_size=3), max_leaves=8)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON, max_size=4)
NAME = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)
# Content that never holds the call marker (a marker starts a call).
CONTENT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30).filter(
    lambda t: "<tool_call>" not in t)


def read(text: str, cuts: list[int],
         calls_only: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) of each call, reading ``text`` in the pieces ``cuts``
    make."""
    parser, pieces, start = ToolCallParser(calls_only), [], 0
    for cut in [*cuts, len(text)]:
        pieces += parser.feed(text[start:cut])
        start = cut
    pieces += parser.finish()
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if p.kind == "call":
            assert p.index == len(calls) and p.call_id.startswith("call_")
            calls[p.index] = [p.name, ""]
        elif p.kind == "arguments":
            calls[p.index][1] += p.text
    content = "".join(p.text for p in pieces if p.kind == "content")
    return content, [(name, arguments) for name, arguments in calls.values()]


def call_block(name: str, arguments: dict, spaced: bool) -> str:
    separators = (", ", ": ") if spaced else (",", ":")
    body = json.dumps({"name": name, "arguments": arguments}, separators=separators)
    return f"<tool_call>\n{body}\n</tool_call>"


@st.composite
def answers(draw):
    calls = draw(st.lists(st.tuples(NAME, ARGUMENTS, st.booleans()), max_size=3))
    before = draw(CONTENT)
    text = before + "\n".join(call_block(*c) for c in calls)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    return text, [c for c in cuts if 0 < c < len(text)], before, calls


@settings(max_examples=300, deadline=None)
@given(answer=answers())
def test_the_calls_are_the_same_whatever_the_deltas(answer):
    text, cuts, before, calls = answer
    whole = read(text, [])
    assert read(text, cuts) == whole
    assert read(text, list(range(1, len(text)))) == whole  # one character per delta
    content, made = whole
    assert content == before if calls else content == text
    assert [name for name, _ in made] == [name for name, _, _ in calls]
    for (_, arguments), (_, written, spaced) in zip(made, calls, strict=True):
        assert json.loads(arguments) == written
        # Arguments go out as the model wrote them, spacing included.
        assert arguments == json.dumps(written, separators=(", ", ": ") if spaced else (",", ":"))


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60) | st.sampled_from([
    "<tool_call>", "<tool_call>\n{", '<tool_call>\n{"name":"f","arguments":{"a":[1,{"b":"}"',
    "a <tool_call b", "<tool_call>\nnot json\n</tool_call>", "<tool_", "</tool_call>"]),
    data=st.data())
def test_any_text_reads_the_same_whatever_the_deltas(text, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=10)))
    assert read(text, [c for c in cuts if 0 < c < len(text)]) == read(text, [])


def test_the_shapes_a_model_writes():
    # Parameterless: exactly "{}", whether written as {}, null or not at all.
    assert read('<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>', [])[1] == [
        ("now", "{}")]
    assert read('<tool_call>\n{"name": "now", "arguments": null}\n</tool_call>', [])[1] == [
        ("now", "{}")]
    assert read('<tool_call>\n{"name": "now"}\n</tool_call>', [])[1] == [("now", "{}")]
    # Arguments written as JSON text inside a string go out as that text.
    assert read('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
                [])[1] == [("f", '{"x": 1}')]
    # Arguments before the name: read whole, re-written as JSON.
    assert read('<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', [])[1] == [
        ("f", '{"x": 1}')]
    # Not a call: content, markers included.
    assert read("<tool_call>\n[1, 2]\n</tool_call>", []) == (
        "<tool_call>\n[1, 2]\n</tool_call>", [])
    # Cut inside its arguments (max_tokens): the call keeps what was written; cut before its
    # name, nothing of it is left (no markup in the content).
    assert read('<tool_call>\n{"name":"f","arguments":{"x":[1,', [])[1] == [("f", '{"x":[1,')]
    assert read('<tool_call>\n{"name', []) == ("", [])
    assert read('<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>\n<tool_call>\n{"na',
                []) == ("", [("f", "{}")])
    assert read('<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>\n<tool_c', []) == (
        "", [("f", "{}")])
    # Cut inside the first marker: where only calls may come, nothing is left of it.
    assert read("<tool", [], calls_only=True) == ("", [])
    assert read("<tool", []) == ("<tool", [])
    # Arguments nested deeper than the JSON parser goes: not a call, never an error.
    deep = "<tool_call>\n" + "[" * 5000 + "]" * 5000 + "\n</tool_call>"
    assert read(deep, []) == (deep, [])
    # Text around calls: what comes before is content, blanks between and after are dropped.
    assert read('Sure.\n<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>\n\n', []) == (
        "Sure.\n", [("f", "{}")])
    assert read("a < b <tool_calls> c", []) == ("a < b <tool_calls> c", [])
