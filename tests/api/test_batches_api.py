"""The Batch API served end to end on the reference backend (fast lane): the real ``openai``
client against the REST API, an in-process worker, and the Celery step
(:func:`api.batch_runner.advance_all`) run by the test as beat runs it; shapes read back with the
SDK's own types."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import openai
import pytest
from django.utils import timezone
from openai.types import Batch as SDKBatch
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from api import batch_feed, batch_pace, batch_runner
from api.models import Batch, BatchLine
from gateway import usage
from gateway.clients import sync_redis
from gateway.conf import redis_keys
from inference.protocol.events import ErrorCode, ErrorInfo, FinalEvent, FinishReason, encode_event
from inference.protocol.messages import batch_fairness_key
from tenants.models import UsageRecord
from tests.api.test_api import MODEL
from tests.api.test_files_api import files_root  # noqa: F401 - the test's own files folder
from tests.api.test_nullable_fields import in_process

pytestmark = pytest.mark.django_db

CHAT = "/v1/chat/completions"


def line(custom_id: str, content: str, *, url: str = CHAT, max_tokens: int = 6,
         **body) -> dict:
    if url == "/v1/completions":
        request = {"model": MODEL, "prompt": content, "max_tokens": max_tokens,
                   "temperature": 0, **body}
    else:
        request = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                   "max_tokens": max_tokens, "temperature": 0, **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": request}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in lines)


def run_until_ended(batch_id: str, timeout_s: float = 30.0) -> Batch:
    """Step the batch as Celery beat does until it has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch_runner.advance_all()
        row = Batch.objects.get(pk=batch_id)
        if row.status in ("completed", "failed", "expired", "cancelled"):
            return row
        time.sleep(0.02)
    raise AssertionError(f"batch {batch_id} still {Batch.objects.get(pk=batch_id).status}")


def step_until(batch_id: str, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        batch_runner.advance_all()
        time.sleep(0.02)


def read_jsonl(data: bytes) -> list[dict]:
    return [json.loads(raw) for raw in data.splitlines() if raw.strip()]


async def create_batch(client: openai.AsyncOpenAI, lines: list[dict], endpoint: str = CHAT,
                       **extra) -> SDKBatch:
    made = await client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return await client.batches.create(input_file_id=made.id, endpoint=endpoint,
                                       completion_window="24h", **extra)


def outputs(raw_key: str, row: Batch) -> tuple[list[dict], list[dict]]:
    async def calls(client):
        out = (await client.files.content(row.output_file_id)).content if row.output_file_id \
            else b""
        err = (await client.files.content(row.error_file_id)).content if row.error_file_id \
            else b""
        return read_jsonl(out), read_jsonl(err)

    return in_process(raw_key, calls)


def test_a_batch_answers_every_line_once_as_its_endpoint_would(tenant_key, inproc_worker):
    tenant, key, raw = tenant_key
    good = [line(f"ok-{i}", f"Question number {i}?") for i in range(5)]
    bad = [line("wrong-url", "Hi", url="/v1/completions"),
           line("bad-body", "Hi", n=99),
           {"custom_id": "no-body", "method": "POST", "url": CHAT},
           {"custom_id": 7, "method": "POST", "url": CHAT, "body": {}}]

    async def create(client):
        return await create_batch(client, good + bad, metadata={"job": "eval-7"})

    made = in_process(raw, create)
    assert made.status == "validating" and made.metadata == {"job": "eval-7"} and made.usage is None
    row = run_until_ended(made.id)

    async def calls(client):
        shown = await client.batches.with_raw_response.retrieve(made.id)
        direct = [await client.chat.completions.create(**item["body"]) for item in good]
        return json.loads(shown.content), direct

    shown, direct = in_process(raw, calls)
    SDKBatch.model_validate(shown, strict=True)  # the SDK's own type, as the server wrote it
    assert shown["status"] == "completed"
    assert shown["request_counts"] == {"total": 9, "completed": 5, "failed": 4}
    assert shown["in_progress_at"] and shown["finalizing_at"] and shown["completed_at"]
    out, err = outputs(raw, row)
    # Its usage: the sums of its answered lines' (the refused ones ran nothing).
    used = [o["response"]["body"]["usage"] for o in out]
    assert shown["usage"] == {
        "input_tokens": sum(u["prompt_tokens"] for u in used),
        "input_tokens_details": {"cached_tokens": sum(
            u["prompt_tokens_details"]["cached_tokens"] for u in used)},
        "output_tokens": sum(u["completion_tokens"] for u in used),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": sum(u["total_tokens"] for u in used)}
    assert shown["usage"]["output_tokens"] > 0
    assert [o["custom_id"] for o in out] == [g["custom_id"] for g in good]
    for got, answer in zip(out, direct, strict=True):
        assert got["response"]["status_code"] == 200 and got["error"] is None
        body = ChatCompletion.model_validate(got["response"]["body"])
        # The endpoint's own answer to the same body (temperature 0): the same text.
        assert body.choices[0].message.content == answer.choices[0].message.content
        assert body.usage.completion_tokens == answer.usage.completion_tokens
    by_id = {e["custom_id"]: e for e in err}
    assert set(by_id) == {"wrong-url", "bad-body", "no-body", None}
    untyped = by_id[None]["response"]["body"]["error"]
    assert untyped["param"] == "custom_id" and "Line 9" in untyped["message"]
    assert "number" in untyped["message"]
    # Refused before any request ran: no request id.
    assert by_id["bad-body"]["response"]["request_id"] is None
    assert by_id["wrong-url"]["response"]["body"]["error"]["param"] == "url"
    assert by_id["bad-body"]["response"]["body"]["error"]["param"] == "n"
    assert by_id["no-body"]["response"]["body"]["error"]["param"] == "body"
    assert all(e["response"]["status_code"] == 400 for e in err)


def test_completions_lines_and_the_usage_they_are_billed(tenant_key, inproc_worker):
    tenant, key, raw = tenant_key
    lines = [line(f"c{i}", f"Once upon a time {i}", url="/v1/completions") for i in range(3)]
    made = in_process(raw, lambda client: create_batch(client, lines,
                                                       endpoint="/v1/completions"))
    row = run_until_ended(made.id)
    assert row.status == "completed" and (row.completed, row.failed) == (3, 0)
    out, err = outputs(raw, row)
    assert err == [] and row.error_file_id == ""
    bodies = [Completion.model_validate(o["response"]["body"]) for o in out]
    request_ids = [o["response"]["request_id"] for o in out]
    for request_id in request_ids:
        deadline = time.monotonic() + 10
        while not UsageRecord.objects.filter(request_id=request_id).exists():
            assert time.monotonic() < deadline
            usage.record(request_id)
            time.sleep(0.05)
    records = {r.request_id: r for r in UsageRecord.objects.filter(request_id__in=request_ids)}
    for body, request_id in zip(bodies, request_ids, strict=True):
        record = records[request_id]
        assert record.batch_id == made.id  # marked as batch work
        assert record.completion_tokens == body.usage.completion_tokens
        assert record.prompt_tokens == body.usage.prompt_tokens


def test_batch_lines_are_batch_work_with_their_own_fairness_key(tenant_key, inproc_worker,
                                                                monkeypatch):
    tenant, key, raw = tenant_key
    sent = []
    real = batch_runner.lifecycle.start

    async def spy(*args, **kwargs):
        generation = await real(*args, **kwargs)
        sent.append(generation.message)
        return generation

    monkeypatch.setattr(batch_runner.lifecycle, "start", spy)
    made = in_process(raw, lambda client: create_batch(client, [line("a", "Hi")]))
    row = run_until_ended(made.id)
    [message] = sent
    assert message.batch and message.fairness_key == batch_fairness_key(tenant.slug)
    assert message.batch_deadline_at == pytest.approx(row.expires_at.timestamp())
    assert message.queue_deadline_s == 0 and message.origin == ""


@pytest.mark.parametrize("steps_before", [0, 1])
def test_a_batch_cancelled_while_validating_ends_every_line_in_the_error_file(
        settings, tenant_key, steps_before):
    # Cancelled before its first step, or after a step read part of its file: the rest of the
    # file is read, a line that fails validation keeps its own error, every other line is
    # cancelled; nothing ran.
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_VALIDATE_LINES": 4}
    tenant, key, raw = tenant_key
    lines = [line(f"r{i}", f"Tell me about {i}") for i in range(10)]
    lines.insert(5, {"custom_id": "no-body", "method": "POST", "url": CHAT})
    made = in_process(raw, lambda client: create_batch(client, lines))
    for _ in range(steps_before):
        batch_runner.advance_all()
    assert Batch.objects.get(pk=made.id).status == "validating"

    async def cancel(client):
        return await client.batches.cancel(made.id)

    assert in_process(raw, cancel).status == "cancelling"
    row = run_until_ended(made.id)
    assert row.status == "cancelled" and row.in_progress_at is None
    out, err = outputs(raw, row)
    assert out == []
    assert sorted(e["custom_id"] for e in err) == sorted(g["custom_id"] for g in lines)
    refused = [e for e in err if e["error"] is None]  # its validation's 400, as an endpoint's
    assert [(e["custom_id"], e["response"]["status_code"]) for e in refused] == [("no-body", 400)]
    assert {e["error"]["code"] for e in err if e["error"]} == {"batch_cancelled"}
    assert (row.completed, row.failed, row.total) == (0, 11, 11)
    assert not BatchLine.objects.filter(batch_id=made.id).exclude(request_id="").exists()


def test_a_batch_cancelled_while_validating_whose_file_is_then_deleted_ends_cancelled(
        settings, tenant_key):
    # The lines read before the file went end in the error file; the batch is cancelled, not
    # failed (a batch still validating whose file is deleted fails: nobody cancelled it).
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_VALIDATE_LINES": 4}
    tenant, key, raw = tenant_key
    lines = [line(f"r{i}", f"Tell me about {i}") for i in range(10)]
    made = in_process(raw, lambda client: create_batch(client, lines))
    batch_runner.advance_all()  # 4 lines read

    async def cancel_then_delete(client):
        await client.batches.cancel(made.id)
        return await client.files.delete(made.input_file_id)

    assert in_process(raw, cancel_then_delete).deleted is True
    row = run_until_ended(made.id)
    assert (row.status, row.completed, row.failed, row.total) == ("cancelled", 0, 4, 4)
    out, err = outputs(raw, row)
    assert [e["custom_id"] for e in err] == ["r0", "r1", "r2", "r3"] and out == []
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}


def test_metadata_holding_a_nul_is_stored_with_u_fffd(tenant_key):
    tenant, key, raw = tenant_key

    async def calls(client):
        made = await create_batch(client, [line("a", "Hi")], metadata={"k\x00": "v\x00"})
        return await client.batches.retrieve(made.id)

    assert in_process(raw, calls).metadata == {"k\ufffd": "v\ufffd"}


def test_a_deactivated_tenants_batch_feeds_no_line_until_it_is_active_again(
        settings, tenant_key, inproc_worker):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_LINES_IN_FLIGHT": 2}
    tenant, key, raw = tenant_key
    lines = [line(f"r{i}", f"Tell me about {i}") for i in range(8)]
    made = in_process(raw, lambda client: create_batch(client, lines))
    step_until(made.id, lambda: BatchLine.objects.filter(batch_id=made.id,
                                                         state="done").count() >= 2)
    tenant.is_active = False
    tenant.save(update_fields=["is_active"])
    # What it had admitted finishes; nothing more is sent while it is deactivated.
    step_until(made.id, lambda: not BatchLine.objects.filter(batch_id=made.id,
                                                             state="running").exists())
    sent = BatchLine.objects.filter(batch_id=made.id).exclude(request_id="").count()
    for _ in range(10):
        batch_runner.advance_all()
        time.sleep(0.02)
    assert BatchLine.objects.filter(batch_id=made.id).exclude(request_id="").count() == sent < 8
    assert Batch.objects.get(pk=made.id).status == "in_progress"
    tenant.is_active = True
    tenant.save(update_fields=["is_active"])
    row = run_until_ended(made.id)
    assert (row.status, row.completed, row.failed) == ("completed", 8, 0)


def test_a_batch_whose_key_is_revoked_runs_on_as_its_tenants(tenant_key, inproc_worker):
    # A batch is its tenant's (every key of the tenant sees it): revoking the key that created
    # it does not stop it; its remaining lines are admitted as the tenant.
    tenant, key, raw = tenant_key
    lines = [line(f"r{i}", f"Tell me about {i}") for i in range(4)]
    made = in_process(raw, lambda client: create_batch(client, lines))
    key.revoked_at = timezone.now()
    key.save(update_fields=["revoked_at"])
    row = run_until_ended(made.id)
    assert (row.status, row.completed) == ("completed", 4)


def test_ids_and_bodies_that_cannot_be_stored_exactly_are_refused_by_line(tenant_key,
                                                                         inproc_worker):
    # A NUL would be stored as U+FFFD (its answer's custom_id then not the one sent, and
    # "a\x00" the duplicate of "a\ufffd"); a lone surrogate cannot be stored at all (PostgreSQL's
    # jsonb refuses the escape: the step failed on it, every step, and the batch never ended).
    tenant, key, raw = tenant_key
    lines = [line("nul\x00", "x"), line("lone\ud800", "x"), line("body", "Hi \udfff there"),
             line("nul\ufffd", "y"), {"method": "POST", "url": CHAT, "body": {}}]
    made = in_process(raw, lambda client: create_batch(client, lines))
    row = run_until_ended(made.id)
    assert (row.status, row.completed, row.failed) == ("completed", 1, 4)
    out, err = outputs(raw, row)
    assert [o["custom_id"] for o in out] == ["nul\ufffd"]
    refused = [(e["custom_id"], e["response"]["status_code"], e["response"]["body"]["error"])
               for e in err]
    assert [(cid, status, error["param"], error["code"]) for cid, status, error in refused] == [
        (None, 400, "custom_id", "invalid_value"), (None, 400, "custom_id", "invalid_value"),
        ("body", 400, "body", "invalid_value"),
        (None, 400, "custom_id", "missing_required_parameter")]
    assert "U+0000" in refused[0][2]["message"] and "surrogate" in refused[2][2]["message"]


def test_cancel_mid_run_keeps_finished_lines_and_ends_the_rest(settings, tenant_key,
                                                               inproc_worker):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_LINES_IN_FLIGHT": 2}
    tenant, key, raw = tenant_key
    lines = [line(f"r{i}", f"Tell me about {i}", max_tokens=30) for i in range(12)]
    made = in_process(raw, lambda client: create_batch(client, lines))
    step_until(made.id, lambda: BatchLine.objects.filter(batch_id=made.id,
                                                         state="done").count() >= 2)

    async def cancel(client):
        return await client.batches.cancel(made.id)

    assert in_process(raw, cancel).status == "cancelling"
    row = run_until_ended(made.id)
    assert row.status == "cancelled" and row.cancelled_at is not None
    out, err = outputs(raw, row)
    ids = [o["custom_id"] for o in out] + [e["custom_id"] for e in err]
    assert sorted(ids) == sorted(g["custom_id"] for g in lines)  # every line once
    assert len(out) >= 2 and all(o["response"]["status_code"] == 200 for o in out)
    assert err and all(e["error"]["code"] == "batch_cancelled" for e in err)
    assert (row.completed, row.failed, row.total) == (len(out), len(err), 12)
    # Every line that ran is billed by the steps, the aborted ones too (no reconciliation ran).
    ran = list(BatchLine.objects.filter(batch_id=made.id).exclude(request_id="")
               .values_list("request_id", flat=True))
    assert UsageRecord.objects.filter(request_id__in=ran).count() == len(ran)

    async def again(client):
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(made.id)

    in_process(raw, again)


def test_an_expired_window_ends_expired_with_the_unfinished_lines_in_the_error_file(
        settings, tenant_key, inproc_worker):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_LINES_IN_FLIGHT": 1}
    tenant, key, raw = tenant_key
    lines = [line(f"r{i}", f"Tell me about {i}", max_tokens=20) for i in range(6)]
    made = in_process(raw, lambda client: create_batch(client, lines))
    step_until(made.id, lambda: BatchLine.objects.filter(batch_id=made.id,
                                                         state="done").exists())
    Batch.objects.filter(pk=made.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    row = run_until_ended(made.id)
    assert row.status == "expired" and row.expired_at is not None
    out, err = outputs(raw, row)
    assert sorted([o["custom_id"] for o in out] + [e["custom_id"] for e in err]) == sorted(
        g["custom_id"] for g in lines)
    assert out and err and all(e["error"]["code"] == "batch_expired" for e in err)


def test_another_tenant_cannot_see_or_fetch_any_of_it(make_tenant, tenant_key, inproc_worker):
    tenant, key, raw = tenant_key
    _, _, other = make_tenant()
    made = in_process(raw, lambda client: create_batch(client, [line("a", "Hi")]))
    row = run_until_ended(made.id)

    async def calls(client):
        refused = []
        for call in (lambda: client.batches.retrieve(made.id),
                     lambda: client.batches.cancel(made.id),
                     lambda: client.files.content(row.output_file_id),
                     lambda: client.batches.create(input_file_id=made.input_file_id,
                                                   endpoint=CHAT, completion_window="24h")):
            with pytest.raises(openai.NotFoundError) as caught:
                await call()
            refused.append(caught.value.body)
        listed = await client.batches.list()
        return refused, listed

    refused, listed = in_process(other, calls)
    assert listed.data == []
    assert refused[3]["param"] == "input_file_id"


def test_creating_a_batch_refuses_what_it_cannot_serve_naming_the_field(tenant_key):
    tenant, key, raw = tenant_key

    async def calls(client):
        made = await client.files.create(file=("in.jsonl", jsonl([line("a", "Hi")])),
                                         purpose="batch")
        good = {"input_file_id": made.id, "endpoint": CHAT, "completion_window": "24h"}
        cases = [({"endpoint": "/v1/embeddings"}, "endpoint"),
                 ({"completion_window": "1h"}, "completion_window"),
                 ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                 ({"input_file_id": "file-nope"}, "input_file_id"),
                 ({"output_expires_after": {"anchor": "created_at", "seconds": 3600}},
                  "output_expires_after")]
        params = []
        for change, param in cases:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.batches.create(**{**good, **change})
            assert caught.value.status_code in (400, 404), caught.value
            params.append((caught.value.body["param"], param))
        return params

    for got, want in in_process(raw, calls):
        assert got == want


def test_a_file_with_a_repeated_custom_id_fails_the_batch_with_its_reason(tenant_key,
                                                                           inproc_worker):
    tenant, key, raw = tenant_key
    made = in_process(raw, lambda client: create_batch(
        client, [line("same", "Hi"), line("other", "Hi"), line("same", "Bye")]))
    row = run_until_ended(made.id)
    assert row.status == "failed" and row.failed_at is not None
    [error] = row.errors["data"]
    assert error["code"] == "duplicate_custom_id" and error["line"] == 3
    assert not BatchLine.objects.filter(batch_id=made.id).exists()


def test_validation_reads_a_large_file_in_steps(settings, tenant_key):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_VALIDATE_LINES": 7}
    tenant, key, raw = tenant_key
    made = in_process(raw, lambda client: create_batch(
        client, [line(f"r{i}", "Hi") for i in range(20)]))
    reads = []
    for _ in range(5):
        batch_runner.advance_all()
        reads.append(Batch.objects.get(pk=made.id).read_lines)
    row = Batch.objects.get(pk=made.id)
    assert reads[:3] == [7, 14, 20] and row.total == 20 and row.status == "in_progress"
    assert list(BatchLine.objects.filter(batch_id=made.id).values_list("index", flat=True)) == \
        list(range(20))


def test_lines_a_rate_limit_refuses_wait_and_a_budget_refusal_is_an_error_line(
        make_tenant, inproc_worker):
    tenant, key, raw = make_tenant(requests_per_minute=2)
    made = in_process(raw, lambda client: create_batch(
        client, [line(f"r{i}", "Hi") for i in range(4)]))
    for _ in range(10):
        batch_runner.advance_all()
        time.sleep(0.02)
    states = sorted(BatchLine.objects.filter(batch_id=made.id).values_list("state", flat=True))
    # Two were admitted; the rest wait for the window instead of failing.
    assert states.count("waiting") == 2 and "failed" not in states

    tenant2, key2, raw2 = make_tenant(token_budget=10)
    made2 = in_process(raw2, lambda client: create_batch(client, [line("big", "Hi")]))
    row = run_until_ended(made2.id)
    _, err = outputs(raw2, row)
    [refused] = err
    assert refused["response"]["status_code"] == 429
    assert refused["response"]["body"]["error"]["code"] == "token_budget_exhausted"


def test_lines_of_a_model_without_a_worker_wait_and_the_other_models_lines_are_answered(
        tenant_key, inproc_worker, settings):
    from tenants.models import ServedModel

    # A registered model no worker serves: its lines wait (no_worker_available), without
    # holding back the lines after them of the model the worker serves.
    ServedModel.objects.create(name="idle/model", model_path=str(settings.BASE_DIR))
    _, _, raw = tenant_key
    idle = [{**line(f"idle-{i}", "Hi"), "body": {**line("x", "Hi")["body"],
                                                  "model": "idle/model"}} for i in range(3)]
    served = [line(f"ok-{i}", "Hi") for i in range(3)]
    made = in_process(raw, lambda client: create_batch(
        client, [idle[0], served[0], idle[1], served[1], idle[2], served[2]]))
    step_until(made.id, lambda: BatchLine.objects.filter(
        batch_id=made.id, state="done").count() == 3)
    lines = {item.custom_id: item.state
             for item in BatchLine.objects.filter(batch_id=made.id)}
    assert lines == {**{f"idle-{i}": "waiting" for i in range(3)},
                     **{f"ok-{i}": "done" for i in range(3)}}
    assert Batch.objects.get(pk=made.id).status == "in_progress"


def test_batches_list_in_pages_newest_first(tenant_key):
    tenant, key, raw = tenant_key

    async def calls(client):
        made = [await create_batch(client, [line("a", "Hi")]) for _ in range(3)]
        first = await client.batches.list(limit=2)
        rest = await client.batches.list(limit=2, after=first.data[-1].id)
        return made, first, rest

    made, first, rest = in_process(raw, calls)
    assert [b.id for b in first.data] == [made[2].id, made[1].id] and first.has_more
    assert [b.id for b in rest.data] == [made[0].id] and not rest.has_more


def test_a_nul_character_in_a_lines_body_is_kept_as_u_fffd_never_a_stuck_batch(
        tenant_key, inproc_worker):
    # A NUL in a request's text is kept as U+FFFD, as its endpoint keeps it (one in a custom_id
    # is refused: the test above).
    tenant, key, raw = tenant_key
    lines = [line("nul-in-body", "Hello\u0000there"),
             {"custom_id": "odd", "method": "POST", "url": CHAT, "body": {}, "x\u0000": 1}]
    made = in_process(raw, lambda client: create_batch(client, lines))
    row = run_until_ended(made.id)
    assert row.status == "completed" and (row.completed, row.failed) == (1, 1)
    out, err = outputs(raw, row)
    assert [o["custom_id"] for o in out] == ["nul-in-body"]
    assert err[0]["response"]["body"]["error"]["param"] == "x\ufffd"


def test_the_dashboard_shows_batches_in_progress_and_metrics_count_lines_by_outcome(
        settings, admin_client, tenant_key, inproc_worker, django_capture_on_commit_callbacks):
    from prometheus_client.parser import text_string_to_metric_families

    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_LINES_IN_FLIGHT": 1}
    tenant, key, raw = tenant_key
    made = in_process(raw, lambda client: create_batch(
        client, [line(f"r{i}", "Hi") for i in range(3)] + [line("bad", "Hi", url="/v1/x")]))
    with django_capture_on_commit_callbacks(execute=True):
        batch_runner.advance_all()  # read: in progress, one line failed at validation
    [shown] = admin_client.get("/admin/scheduler/data").json()["live"]["batches"]["active"]
    assert shown["id"] == made.id and shown["tenant"] == tenant.slug
    assert shown["status"] == "in_progress" and shown["total"] == 4 and shown["failed"] == 1
    with django_capture_on_commit_callbacks(execute=True):
        run_until_ended(made.id)
    batches = admin_client.get("/admin/scheduler/data").json()["live"]["batches"]
    assert batches == {"lines": {"completed": 3, "failed": 1}, "active": []}
    families = {f.name: f for f in text_string_to_metric_families(
        admin_client.get("/metrics").content.decode())}
    lines = {s.labels["outcome"]: s.value for s in families["llm_batch_lines"].samples
             if s.name == "llm_batch_lines_total"}
    assert lines == {"completed": 3, "failed": 1}
    assert {s.labels["status"]: s.value for s in families["llm_batches_active"].samples} == {
        "validating": 0, "in_progress": 0, "finalizing": 0, "cancelling": 0}


def test_a_line_whose_request_failed_retryably_is_sent_again_and_answered_once(
        request, settings, tenant_key, redis_prefix):
    # Its end is written below without the announcement an end writes: the scan finds it.
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_SCAN_INTERVAL_S": 1.0}
    tenant, key, raw = tenant_key
    lines = [line(f"r{i}", f"Question {i}?") for i in range(3)]
    made = in_process(raw, lambda client: create_batch(client, lines))
    # No worker yet: validation ends and every line waits (no live worker holds them back).
    step_until(made.id, lambda: Batch.objects.get(pk=made.id).status == "in_progress")
    batch_runner.advance_all()
    assert set(BatchLine.objects.filter(batch_id=made.id)
               .values_list("state", flat=True)) == {"waiting"}
    # Line 0 ran once and its worker died under it: its stream ends with a retryable error.
    first = BatchLine.objects.get(batch_id=made.id, index=0)
    first.state, first.request_id = BatchLine.State.RUNNING, f"{made.id}-0-0"
    first.save(update_fields=["state", "request_id"])
    lost = FinalEvent(request_id=first.request_id, finish_reason=FinishReason.ERROR,
                      error=ErrorInfo(code=ErrorCode.WORKER_LOST, retryable=True,
                                      message="its worker died"))
    sync_redis().xadd(redis_keys().events(first.request_id), encode_event(lost))
    request.getfixturevalue("inproc_worker")
    row = run_until_ended(made.id)
    out, err = outputs(raw, row)
    assert not err and sorted(o["custom_id"] for o in out) == ["r0", "r1", "r2"]
    assert (row.completed, row.failed, row.total) == (3, 0, 3)
    # Sent again under its next attempt, and answered by that request.
    again = BatchLine.objects.get(batch_id=made.id, index=0)
    assert (again.attempt, again.state) == (1, "done")
    assert next(o for o in out if o["custom_id"] == "r0")["response"]["request_id"] == (
        f"{made.id}-0-1")


def test_a_batch_in_progress_is_stepped_once_enough_lines_ended_and_scanned_at_its_interval(
        settings, tenant_key, redis_prefix):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_LINES_IN_FLIGHT": 16}
    assert batch_pace.min_ended() == 2  # an eighth of the lines in flight
    tenant, key, raw = tenant_key
    made = in_process(raw, lambda client: create_batch(
        client, [line(f"r{i}", f"Question {i}?") for i in range(3)]))
    step_until(made.id, lambda: Batch.objects.get(pk=made.id).status == "in_progress")
    # Its three lines run (no worker here: the test plays one) and each one's answer is in.
    client = sync_redis()
    for i in range(3):
        BatchLine.objects.filter(batch_id=made.id, index=i).update(
            state=BatchLine.State.RUNNING, request_id=f"{made.id}-{i}-0")
        client.xadd(redis_keys().events(f"{made.id}-{i}-0"), encode_event(FinalEvent(
            request_id=f"{made.id}-{i}-0", finish_reason=FinishReason.LENGTH)))
    batch_pace.settled(made.id, [], full=True, fed_all=True, running=3,
                       client=client)  # scanned now, three lines running

    def states() -> list[str]:
        return list(BatchLine.objects.filter(batch_id=made.id).order_by("index")
                    .values_list("state", flat=True))

    ended = redis_keys().fq("batch_ended", made.id)
    batch_runner.advance_all()
    assert states() == ["running"] * 3  # no end announced: not stepped
    client.sadd(ended, f"{made.id}-0-0")  # as the end of its request writes it
    batch_runner.advance_all()
    assert states() == ["running"] * 3  # one of the two that make a step due
    client.sadd(ended, f"{made.id}-1-0")
    batch_runner.advance_all()
    assert states() == ["done", "done", "running"]  # those announced, and only those
    assert client.scard(ended) == 0 and Batch.objects.get(pk=made.id).completed == 2
    # Its scan is due (BATCH_SCAN_INTERVAL_S passed): every running line is looked at.
    client.delete(batch_pace.scanned_key(made.id))
    row = run_until_ended(made.id)
    assert (row.status, row.completed, row.total) == ("completed", 3, 3)


def test_a_batch_s_last_lines_are_stepped_as_they_end_not_at_its_scan(settings, tenant_key,
                                                                      inproc_worker):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_SCAN_INTERVAL_S": 600.0}
    tenant, key, raw = tenant_key
    made = in_process(raw, lambda client: create_batch(  # fewer lines than make a step due
        client, [line(f"r{i}", f"Question {i}?") for i in range(3)]))
    assert batch_pace.min_ended() == 8
    row = run_until_ended(made.id, timeout_s=20)
    assert (row.status, row.completed) == ("completed", 3)


def test_a_batch_whose_validation_spent_its_step_is_fed_by_the_next_one(settings, monkeypatch,
                                                                        tenant_key):
    tenant, key, raw = tenant_key
    made = in_process(raw, lambda client: create_batch(
        client, [line(f"r{i}", f"Question {i}?") for i in range(3)]))
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_STEP_BUDGET_S": 0.0}
    monkeypatch.setattr(batch_runner, "MIN_SHARE_S", 0.0)
    batch_runner.advance_all()  # its lines read; no time left to feed any in the same step

    def waiting() -> int:
        return BatchLine.objects.filter(batch_id=made.id, state="waiting").count()

    assert Batch.objects.get(pk=made.id).status == "in_progress" and waiting() == 3
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_STEP_BUDGET_S": 0.5}
    monkeypatch.setattr(batch_runner, "MIN_SHARE_S", 0.05)
    # Each line held back as a tenant's limit holds it (fed means tried, not sent).
    sent = []
    monkeypatch.setattr(batch_feed, "send", lambda step, line, principal, access, held:
                        sent.append(line.index) or False)
    batch_runner.advance_all()
    assert sent == [0]  # the next step fed it, without waiting for an end or the scan


def test_lines_refused_at_once_free_their_slots_for_the_next_step(settings, tenant_key):
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_LINES_IN_FLIGHT": 2}
    tenant, key, raw = tenant_key
    made = in_process(raw, lambda client: create_batch(  # each answered 404 as it is sent
        client, [line(f"r{i}", "Hi", model="no-such-model") for i in range(6)]))
    row = run_until_ended(made.id, timeout_s=5)  # two a step, never a wait for the scan
    assert (row.status, row.failed, row.total) == ("completed", 6, 6)


def test_batches_not_in_progress_step_while_the_pace_cannot_be_read(monkeypatch, tenant_key):
    import redis

    tenant, key, raw = tenant_key
    made = in_process(raw, lambda client: create_batch(client, [line("r0", "Hi")]))

    def unreachable(*args, **kwargs):
        raise redis.ConnectionError("Redis is unreachable")

    monkeypatch.setattr(batch_pace, "plan", unreachable)
    assert batch_runner.advance_all() == 1  # validating: stepped all the same
    assert Batch.objects.get(pk=made.id).status == "in_progress"
    assert batch_runner.advance_all() == 0  # in progress: it waits for the pace
