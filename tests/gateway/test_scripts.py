"""The web tier's Lua scripts run by their SHA1 and still run when Redis forgot them (a restart,
``SCRIPT FLUSH``): real Redis, real admission and settlement."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from gateway import admission, usage
from gateway.admission import Principal
from gateway.scripts import LuaScript
from inference.protocol.messages import RequestMessage
from tests.gateway.test_usage_ledger import budget_used, metered, run_to_end  # noqa: F401

pytestmark = pytest.mark.django_db

# A script no other test loads: each test starts with Redis not knowing it.
COUNT = "return redis.call('INCRBY', KEYS[1], ARGV[1]) -- {}"


def fresh_script() -> LuaScript:
    return LuaScript(COUNT.format(uuid.uuid4().hex))


def test_a_script_redis_does_not_know_runs_and_is_then_known(rclient):
    script, key = fresh_script(), f"test:{uuid.uuid4().hex}"
    assert rclient.script_exists(script.sha) == [False]
    assert script.run(rclient, 1, key, 2) == 2
    assert rclient.script_exists(script.sha) == [True]  # later calls send only the SHA1
    assert script.run(rclient, 1, key, 3) == 5
    rclient.delete(key)


def test_a_pipeline_of_calls_redis_does_not_know_runs_each_once(rclient):
    script, key = fresh_script(), f"test:{uuid.uuid4().hex}"
    pipe = rclient.pipeline(transaction=False)
    calls = [script.queue(pipe, 1, key, n) for n in (1, 10, 100)]
    replies = script.finish(rclient, calls, pipe.execute(raise_on_error=False))
    assert sorted(replies) == [1, 11, 111] and int(rclient.get(key)) == 111
    rclient.delete(key)


def test_an_asyncio_call_redis_does_not_know_runs(settings, rclient):
    script, key = fresh_script(), f"test:{uuid.uuid4().hex}"

    async def twice() -> list[int]:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            return [await script.arun(client, 1, key, 4), await script.arun(client, 1, key, 4)]
        finally:
            await client.aclose()

    assert asyncio.run(twice()) == [4, 8]
    rclient.delete(key)


def test_admission_and_settlement_go_on_after_redis_forgot_every_script(metered, rclient,  # noqa: F811
                                                                        keys):
    rclient.script_flush()
    message = RequestMessage(request_id=uuid.uuid4().hex, tenant=metered.tenant.slug,
                             fairness_key=metered.tenant.slug, prompt="hi",
                             meta={"tenant_id": metered.tenant.pk, "api_key_id": metered.pk})
    admitted = asyncio.run(admission.admit(Principal.for_api_key(metered), message, 300))
    assert budget_used(rclient, admitted) == 300
    run_to_end(rclient, keys, admitted, prompt=4, completion=6)
    rclient.script_flush()
    assert usage.record_many([admitted.request_id]) == 1
    assert budget_used(rclient, admitted) == 10
