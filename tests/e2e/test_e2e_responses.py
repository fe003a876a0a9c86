"""Stored responses of the Responses API when their relay ends early (real daphne, worker, Celery
worker and beat): the web process killed mid-stream, and a client that leaves.

Heartbeats are short (3 s) and the reference backend takes ``STEP_S`` per forward pass, so a
long answer is still running when the test acts on it.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from api.models import StoredResponse
from tenants.models import UsageRecord
from tests.support.e2e import start_stack, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEP_S = 0.05
TTL_S = 3


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1, beat=True,
                       REFERENCE_STEP_DELAY_S=STEP_S, WORKER_HEARTBEAT_TTL_S=TTL_S,
                       WEB_HEARTBEAT_TTL_S=TTL_S, HEARTBEAT_INTERVAL_S=0.5,
                       SWEEP_INTERVAL_S=1, STREAM_DECISION_TIMEOUT_S=5)


@dataclass
class Reader:
    """One streamed response read on a thread: its id, the text its client got, its events."""

    url: str
    key: str
    max_output_tokens: int = 1000
    leave_after: int | None = None  # deltas read before the client closes the connection
    response_id: str = ""
    text: str = ""
    deltas: int = 0
    types: list[str] = field(default_factory=list)
    ended: bool = False

    def start(self) -> Reader:
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "input": "once upon a time", "stream": True,
                "max_output_tokens": self.max_output_tokens, "temperature": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/responses", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {self.key}"}) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    self.types.append(event["type"])
                    if event["type"] == "response.created":
                        self.response_id = event["response"]["id"]
                    elif event["type"] == "response.output_text.delta":
                        self.text += event["delta"]
                        self.deltas += 1
                        if self.leave_after is not None and self.deltas >= self.leave_after:
                            return
        except httpx.HTTPError:
            pass
        finally:
            self.ended = True


def stored(response_id: str) -> StoredResponse | None:
    row = StoredResponse.objects.filter(pk=response_id).first()
    return row if row is not None and row.status != StoredResponse.Status.IN_PROGRESS else None


def ready(stack) -> bool:
    try:
        return httpx.get(f"{stack.url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_response_whose_web_process_dies_mid_stream_ends_failed_as_billed(
        stack, make_tenant, transactional_db):
    _, _, raw = make_tenant()
    reader = Reader(stack.url, raw).start()
    assert wait_for(lambda: reader.deltas >= 5, 30), reader
    stack.kill("daphne", signal.SIGKILL)
    stack.restart("daphne")
    assert wait_for(lambda: ready(stack), 30)
    row = wait_for(lambda: stored(reader.response_id), TTL_S + 20)
    assert row is not None, "the orphaned response was never ended"
    assert row.status == "failed" and row.body["error"]["code"] == "server_error"
    record = UsageRecord.objects.get(request_id=row.request_id)
    assert record.finish_reason == "abort" and record.completion_tokens < 1000
    # Stored as billed: the output tokens the client was billed for, and their text.
    assert row.body["usage"]["output_tokens"] == record.completion_tokens
    text = "".join(p["text"] for item in row.body["output"] if item["type"] == "message"
                   for p in item["content"])
    assert text and (reader.text.startswith(text) or text.startswith(reader.text))
    # The API reads it back the same after the restart.
    got = httpx.get(f"{stack.url}/v1/responses/{row.pk}", timeout=10,
                    headers={"Authorization": f"Bearer {raw}"}).json()
    assert got["status"] == "failed" and got["output"] == row.body["output"]


def test_a_client_that_leaves_a_stream_gets_it_cancelled_and_stopped(stack, make_tenant,
                                                                      transactional_db):
    _, _, raw = make_tenant()
    reader = Reader(stack.url, raw, leave_after=5).start()
    assert wait_for(lambda: reader.ended, 30) and reader.response_id
    left_at = time.monotonic()
    row = wait_for(lambda: stored(reader.response_id), 20)
    assert row is not None and row.status == "cancelled"
    record = wait_for(lambda: UsageRecord.objects.filter(request_id=row.request_id).first(), 20)
    assert record.finish_reason == "abort" and record.status == 499
    ran_for = time.monotonic() - left_at + reader.deltas * STEP_S
    assert record.completion_tokens * STEP_S <= ran_for + 2  # it stopped when the client left
    text = "".join(p["text"] for item in row.body["output"] if item["type"] == "message"
                   for p in item["content"])
    assert text.startswith(reader.text)
    assert "response.completed" not in reader.types
    # Its usage, once recorded, is what was billed.
    assert wait_for(lambda: StoredResponse.objects.get(pk=row.pk).body["usage"], 10)
    usage = StoredResponse.objects.get(pk=row.pk).body["usage"]
    assert usage["output_tokens"] == record.completion_tokens
    assert usage["input_tokens"] == record.prompt_tokens


def test_a_response_streamed_whole_is_stored_as_its_client_got_it(stack, make_tenant,
                                                                  transactional_db):
    _, _, raw = make_tenant()
    reader = Reader(stack.url, raw, max_output_tokens=12).start()
    assert wait_for(lambda: reader.ended, 30)
    assert reader.types[-1] == "response.incomplete"
    row = wait_for(lambda: stored(reader.response_id), 10)
    record = wait_for(lambda: UsageRecord.objects.filter(request_id=row.request_id).first(), 20)
    assert row.body["usage"]["output_tokens"] == record.completion_tokens == 12
    assert row.body["output"][0]["content"][0]["text"] == reader.text


def test_a_client_that_leaves_before_a_whole_answer_gets_it_cancelled_with_nothing(
        stack, make_tenant, transactional_db):
    tenant, _, raw = make_tenant()
    body = {"model": "SmolLM2-135M-Instruct", "input": "once upon a time",
            "max_output_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{stack.url}/v1/responses", json=body, timeout=1.5,
                   headers={"Authorization": f"Bearer {raw}"})
    row = wait_for(lambda: StoredResponse.objects.filter(
        tenant=tenant).exclude(status="in_progress").first(), 20)
    assert row is not None and row.status == "cancelled" and row.body["output"] == []
    record = wait_for(lambda: UsageRecord.objects.filter(request_id=row.request_id).first(), 20)
    assert record.finish_reason == "abort" and record.completion_tokens < 1000
    assert wait_for(lambda: StoredResponse.objects.get(pk=row.pk).body["usage"], 10)
    usage = StoredResponse.objects.get(pk=row.pk).body["usage"]
    assert usage["output_tokens"] == record.completion_tokens == 0  # it got nothing
