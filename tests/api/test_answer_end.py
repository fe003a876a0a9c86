"""An answer not streamed ends its request (the end note its usage record bills, its leases)
once its body was handed to the server, not before: a web process killed in between would have
billed an answer its client never got. Driven through Django's ASGI handler, as daphne runs it,
with a real Redis and an in-process worker."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync
from django.core.handlers.asgi import ASGIHandler

from gateway import delivery
from gateway.clients import aredis

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "SmolLM2-135M-Instruct"


def _scope(path: str, raw_key: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 40000),
            "server": ("testserver", 80),
            "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                        (b"authorization", f"Bearer {raw_key}".encode())]}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 5}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 5,
                              "messages": [{"role": "user", "content": "Hello"}]}),
    ("/v1/responses", {"model": MODEL, "input": "Hello", "max_output_tokens": 16}),
], ids=["completions", "chat", "responses"])
def test_an_answer_not_streamed_is_ended_once_its_body_was_sent(tenant_key, inproc_worker,
                                                                 path, body):
    seen: dict = {}

    async def go() -> None:
        asked = False
        never = asyncio.Event()

        async def receive() -> dict:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": json.dumps(body).encode(),
                        "more_body": False}
            await never.wait()  # the client stays connected
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and message.get("body"):
                public_id = json.loads(message["body"])["id"]
                seen["rid"] = public_id.rsplit("-", 1)[-1].rsplit("_", 1)[-1]
                # What a recorder reading now (the web process killed now) would find.
                seen["note_at_send"] = await aredis().hget(delivery.note_key(seen["rid"]), "note")

        await ASGIHandler()(_scope(path, tenant_key[2]), receive, send)
        seen["note_after"] = await aredis().hget(delivery.note_key(seen["rid"]), "note")

    async_to_sync(go)()
    assert seen["status"] == 200
    assert seen["note_at_send"] is None, "the request ended before its answer was sent"
    note = delivery.Delivery.from_json(seen["note_after"])
    assert (note.end, note.status) == (delivery.COMPLETE, 200)
