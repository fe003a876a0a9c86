"""Whatever a client sends on the chat socket, the socket answers with frames of its protocol and
stays open: a frame it cannot act on gets an ``error`` frame (JSON, with a readable message),
never a server error close (1011)."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chat.frames import MAX_FRAME_CHARS, MAX_MESSAGE_CHARS
from chat.models import Message
from tests.support.web import session_cookie, signed_in_client, socket_to_site

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]

# Sent after every frame: answered with an error no other frame here gets, so the frames
# before it in the answer are those of the frame sent before it.
PROBE = "x" * (MAX_FRAME_CHARS + 1)


@pytest.fixture
async def cookie(make_member):
    user = await sync_to_async(make_member)()
    return session_cookie(await sync_to_async(signed_in_client)(user))


async def exchange(cookie: str, frames: list[str | bytes]) -> list[list[dict]]:
    """Send each of ``frames`` on one socket, each followed by :data:`PROBE`; the frames the
    socket sent back for each. Fails on a close, a binary or non-JSON frame, an error frame
    without a readable message, an exception in the consumer."""
    ws = socket_to_site(cookie)
    connected, _ = await ws.connect(timeout=10)
    assert connected
    answers = []
    try:
        for sent in frames:
            # As the server hands frames over (send_to refuses empty ones).
            kind = "bytes" if isinstance(sent, bytes) else "text"
            await ws.send_input({"type": "websocket.receive", kind: sent})
            await ws.send_to(text_data=PROBE)
            probes = 2 if isinstance(sent, str) and len(sent) > MAX_FRAME_CHARS else 1
            received = []
            while True:
                message = await ws.receive_output(5)
                assert message["type"] == "websocket.send", f"the socket closed: {message!r}"
                assert message.get("text") is not None, "a binary frame"
                frame = json.loads(message["text"])
                assert isinstance(frame, dict) and isinstance(frame.get("type"), str)
                if frame["type"] == "error":
                    assert isinstance(frame["message"], str) and len(frame["message"]) > 10
                    assert not frame.get("closing")
                received.append(frame)
                if frame["message" if frame["type"] == "error" else "type"].startswith(
                        "The frame is too long"):
                    probes -= 1
                    if not probes:
                        received.pop()  # the probe's
                        break
            answers.append(received)
    finally:
        await ws.disconnect()
    return answers


@pytest.mark.parametrize("frame, says", [
    (b"\x00\x01binary", "not binary"),
    (b"", "not binary"),
    ("", "not valid JSON"),
    ("not json", "not valid JSON"),
    ("{", "not valid JSON"),
    ("[]", "JSON object"),
    ("42", "JSON object"),
    ('"send"', "JSON object"),
    ("null", "JSON object"),
    ("NaN", "not valid JSON"),
    ('{"type": "send", "conversation_id": Infinity, "content": "x"}', "not valid JSON"),
    ("[" * 200_000, "nested too deeply"),
    ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ('{"type": "send", "content": 5}', "Type a message"),
    ('{"type": "send", "content": ["a"]}', "Type a message"),
    ('{"type": "send", "content": "x", "conversation_id": 1e400}', "conversation_id"),
    ('{"type": "send", "content": "x", "conversation_id": 1.5}', "conversation_id"),
    ('{"type": "send", "content": "x", "conversation_id": 99999999999999999999999}',
     "conversation_id"),
    ('{"type": "send", "content": "x", "conversation_id": "9" }', "conversation_id"),
    ('{"type": ["send"]}', "Unknown request"),
    ('{"type": 1}', "Unknown request"),
    ("{}", "Unknown request"),
    (json.dumps({"type": "send", "content": "x" * (MAX_MESSAGE_CHARS + 1)}),
     "message is too long"),
    (json.dumps({"type": "send", "content": "x" * MAX_FRAME_CHARS}), "frame is too long"),
])
async def test_a_frame_it_cannot_act_on_gets_an_error_and_the_socket_stays(frame, says, cookie):
    [received] = await exchange(cookie, [frame])
    assert [f["type"] for f in received] == ["error"] and says in received[0]["message"]
    assert await Message.objects.acount() == 0


# Any JSON value, frames shaped like the protocol's with fields of any type, any text, bytes.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=3),
    max_leaves=8)
shaped = st.fixed_dictionaries(
    {"type": st.sampled_from(["send", "stop", "SEND", "", "probe"]) | json_values},
    optional={"conversation_id": json_values | st.integers(min_value=-2, max_value=2**70),
              "content": json_values | st.text(max_size=40), "extra": json_values})
raw_json_texts = st.sampled_from(["NaN", "-Infinity", '{"type": "send", "content": "\\ud800"}',
                                  '{"type": "stop"', "[" * 3000, '{"a": 1} trailing', "\ufeff{}",
                                  '{"type": "send", "content": "hi", "conversation_id": 1e999}'])
frames = st.one_of(
    json_values.map(json.dumps),
    shaped.map(json.dumps),
    st.text(max_size=60),
    st.binary(max_size=60),
    raw_json_texts,
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sent=st.lists(frames, min_size=1, max_size=6))
async def test_any_frames_get_protocol_frames_back_and_never_close_the_socket(sent, cookie):
    answers = await exchange(cookie, sent)
    kinds = {f["type"] for answer in answers for f in answer}
    # No worker runs: a well-formed turn is stored and refused readably, nothing streams.
    assert kinds <= {"error", "conversation", "user_message"}, kinds
