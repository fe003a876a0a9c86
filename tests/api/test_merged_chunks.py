"""A write's text chunks of one choice go out as one chunk (``api.responses.merged_text_chunks``):
what a client reassembles from the merged chunks is what it would from one chunk a token."""

from __future__ import annotations

from api.logprobs import CompletionLogprobs, chat_logprobs
from api.responses import (
    ResponseShape,
    finish_chunk,
    merged_text_chunks,
    text_chunk,
    tool_calls_chunk,
)
from inference.protocol.events import PositionLogprobs

CHAT = ResponseShape("chat", "chatcmpl-1", "m", 0, include_usage=True, logprobs=True)
TEXT = ResponseShape("text", "cmpl-1", "m", 0, logprobs=True)


def entry(token: str, logprob: float) -> PositionLogprobs:
    return PositionLogprobs(token_id=len(token), token=token, logprob=logprob)


def test_chat_text_chunks_of_a_choice_become_one_with_their_logprobs_entries_in_order():
    entries = [entry("Hel", -0.5), entry("lo", -0.25), entry("!", -1.0)]
    chunks = [text_chunk(CHAT, e.token, chat_logprobs([e])) for e in entries]
    merged = merged_text_chunks(chunks)
    assert len(merged) == 1
    choice = merged[0]["choices"][0]
    assert choice["delta"] == {"content": "Hello!"} and choice["finish_reason"] is None
    assert choice["logprobs"] == chat_logprobs(entries)
    assert merged[0]["usage"] is None and merged[0]["id"] == "chatcmpl-1"
    assert chunks[0]["choices"][0]["delta"] == {"content": "Hel"}  # the input is not changed


def test_completion_chunks_keep_their_text_offsets():
    entries = [entry("a", -0.1), entry("bc", -0.2), entry("d", -0.3)]
    renderer = CompletionLogprobs()
    chunks = [text_chunk(TEXT, e.token, renderer.render([e])) for e in entries]
    merged = merged_text_chunks(chunks)
    assert len(merged) == 1
    choice = merged[0]["choices"][0]
    assert choice["text"] == "abcd"
    assert choice["logprobs"] == CompletionLogprobs().render(entries)
    assert choice["logprobs"]["text_offset"] == [0, 1, 3]


def test_chunks_of_other_choices_tool_calls_and_finishes_stay_apart():
    plain = ResponseShape("chat", "c", "m", 0, n=2)
    a0, a1 = text_chunk(plain, "x", None, 0), text_chunk(plain, "y", None, 0)
    b0 = text_chunk(plain, "z", None, 1)
    call = tool_calls_chunk(plain, [{"index": 0, "function": {"arguments": "{"}}], 0)
    end = finish_chunk(plain, "stop", 0)
    merged = merged_text_chunks([a0, a1, b0, call, a0, end, a1])
    # Grouped by choice (choice 0's in their order, then choice 1's): a tool call or a finish
    # between two text chunks of a choice keeps them apart.
    assert [m["choices"][0].get("delta") for m in merged] == [
        {"content": "xy"}, call["choices"][0]["delta"], {"content": "x"}, {}, {"content": "y"},
        {"content": "z"}]
    assert [m["choices"][0]["index"] for m in merged] == [0, 0, 0, 0, 0, 1]


def test_several_choices_interleaved_become_one_chunk_each_in_order_of_first_appearance():
    plain = ResponseShape("chat", "c", "m", 0, n=3)
    chunks = [text_chunk(plain, t, None, i)
              for t, i in (("a", 1), ("x", 0), ("b", 1), ("y", 0), ("c", 1), ("z", 2))]
    merged = merged_text_chunks(chunks)
    assert [(m["choices"][0]["index"], m["choices"][0]["delta"]["content"])
            for m in merged] == [(1, "abc"), (0, "xy"), (2, "z")]


def test_a_chunk_with_logprobs_beside_one_without_is_not_merged():
    with_lp = text_chunk(CHAT, "a", chat_logprobs([entry("a", -0.1)]))
    without = text_chunk(CHAT, "b", None)
    assert merged_text_chunks([with_lp, without]) == [with_lp, without]
    assert merged_text_chunks([]) == []


def test_responses_deltas_of_one_item_become_one_event():
    from api.response_events import merged_deltas

    def text(item: str, delta: str) -> dict:
        return {"type": "response.output_text.delta", "item_id": item, "output_index": 0,
                "content_index": 0, "delta": delta, "logprobs": [delta]}

    def args(item: str, delta: str) -> dict:
        return {"type": "response.function_call_arguments.delta", "item_id": item,
                "output_index": 1, "delta": delta}

    added = {"type": "response.output_item.added", "item": {"id": "fc_1"}}
    events = [text("msg_1", "Hel"), text("msg_1", "lo"), added, args("fc_1", '{"a"'),
              args("fc_1", ": 1}"), text("msg_2", "x")]
    merged = merged_deltas(events)
    assert merged == [
        {**text("msg_1", "Hello"), "logprobs": ["Hel", "lo"]}, added, args("fc_1", '{"a": 1}'),
        text("msg_2", "x")]
