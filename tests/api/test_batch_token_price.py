"""A Batch API line is charged ``BATCH_TOKEN_PRICE`` (0.5 by default) of each of its tokens in
the tenant's token budget and its usage record's ``billed_tokens``; the same request sent to its
endpoint is charged in full. The real ``openai`` client, an in-process worker and the batch step
run as beat runs it (``tests/api/test_batches_api.py``); committed, since a budget rebuild reads
the records from another thread."""

from __future__ import annotations

import asyncio
import math
import time

import openai
import pytest
from openai.types.chat import ChatCompletion

from gateway import budgets, usage
from gateway.clients import aredis
from tenants.models import UsageRecord
from tests.api.test_batches_api import create_batch, line, outputs, run_until_ended
from tests.api.test_files_api import files_root  # noqa: F401 - the test's own files folder
from tests.api.test_nullable_fields import in_process

pytestmark = pytest.mark.django_db(transaction=True)


def record_all(timeout_s: float = 10.0) -> None:
    """Write every usage record still in the ledger, as the Celery task does."""
    deadline = time.monotonic() + timeout_s
    while usage.pending():
        assert time.monotonic() < deadline, "usage left unrecorded"
        usage.reconcile(older_than_s=0)
        time.sleep(0.05)


def counter(rclient, tenant, prefix: str) -> int:
    return int(rclient.get(budgets.budget_period(tenant, prefix, time.time()).key) or 0)


def test_a_batch_is_charged_half_its_tokens_and_its_endpoint_all_of_them(
        make_tenant, inproc_worker, rclient, redis_prefix):
    tenant, key, raw = make_tenant(token_budget=1_000_000)
    # Prompts of one to four characters more: some lines use an odd number of tokens.
    lines = [line(f"q{i}", "Say something" + "!" * i, max_tokens=5 + i) for i in range(4)]
    made = in_process(raw, lambda client: create_batch(client, lines))
    row = run_until_ended(made.id)
    out, err = outputs(raw, row)
    assert err == [] and len(out) == 4
    record_all()
    by_line = {o["custom_id"]: UsageRecord.objects.get(request_id=o["response"]["request_id"])
               for o in out}
    used = {cid: ChatCompletion.model_validate(o["response"]["body"]).usage.total_tokens
            for cid, o in zip(by_line, out, strict=True)}
    assert any(n % 2 for n in used.values())  # the rounding up is exercised
    for cid, record in by_line.items():
        # The answer's usage is the tokens processed; the record marks the batch and the charge.
        assert record.batch_id == made.id and record.total_tokens == used[cid]
        assert record.billed_tokens == math.ceil(used[cid] / 2)
    batch_charge = sum(math.ceil(n / 2) for n in used.values())
    assert counter(rclient, tenant, redis_prefix) == batch_charge

    async def interactively(client):
        return [await client.chat.completions.create(**item["body"]) for item in lines]

    answers = in_process(raw, interactively)
    record_all()
    # The same requests, the same tokens, charged in full.
    assert [a.usage.total_tokens for a in answers] == [used[item["custom_id"]] for item in lines]
    interactive = UsageRecord.objects.filter(tenant=tenant, batch_id="")
    assert sorted(r.billed_tokens for r in interactive) == sorted(used.values())
    live = counter(rclient, tenant, redis_prefix)
    assert live == batch_charge + sum(used.values())

    # Redis lost the counter: rebuilt from the usage records, it is the same.
    period = budgets.budget_period(tenant, redis_prefix, time.time())
    rclient.delete(period.key)

    async def rebuild() -> bool:
        return await budgets.ensure_counter(aredis(), period)

    assert asyncio.run(rebuild()) is True
    assert counter(rclient, tenant, redis_prefix) == live


def test_a_line_a_budget_holds_only_at_half_price_is_answered_its_endpoint_refused(
        make_tenant, inproc_worker):
    tenant, key, raw = make_tenant(token_budget=1)
    body = line("big", "Tell me a story", max_tokens=40)

    async def send(client):
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(**body["body"])
        return caught.value.body

    cost = in_process(raw, send)["details"]["requested"]  # prompt + max_tokens, in full
    assert cost > 40
    tenant.token_budget = math.ceil(cost / 2)  # it fits at half its tokens, not in full
    tenant.save(update_fields=["token_budget"])
    refused = in_process(raw, send)
    assert refused["code"] == "token_budget_exhausted" and refused["details"]["requested"] == cost

    made = in_process(raw, lambda client: create_batch(client, [body]))
    out, err = outputs(raw, run_until_ended(made.id))
    assert err == [] and out[0]["response"]["status_code"] == 200

    # A budget one token short: the line is refused at its price, which the error line says.
    _, _, other_raw = make_tenant(token_budget=math.ceil(cost / 2) - 1)
    made = in_process(other_raw, lambda client: create_batch(client, [body]))
    out, err = outputs(other_raw, run_until_ended(made.id))
    [error] = [e["response"]["body"]["error"] for e in err]
    assert out == [] and error["code"] == "token_budget_exhausted"
    assert error["details"]["requested"] == math.ceil(cost / 2)
    assert error["details"]["token_price"] == 0.5 and "batch price of 0.5" in error["message"]
