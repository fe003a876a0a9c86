"""LoRA adapters in the web tier (``gateway.adapters``, ``gateway.adapter_validation``): an
adapter's check recorded on its row, ``base:adapter`` resolved for the senders that may call it
and the same 404 as an unknown model for everyone else, the request message carrying its
``AdapterRef`` to the base model's queue, and its usage record naming it."""

from __future__ import annotations

import hashlib
import json

import pytest
from asgiref.sync import async_to_sync

from gateway import adapter_validation, adapters, lifecycle
from gateway.adapters import Target, find_target, read_target
from gateway.admission import Principal
from gateway.errors import APIError
from gateway.model_registry import Access, model_not_found, read_served_models
from gateway.tasks import record_usage, validate_adapter
from inference.protocol.messages import AdapterRef, RequestMessage, Sampling
from tenants.models import LoraAdapter, ServedModel, UsageRecord
from tests.gateway.test_usage_ledger import run_to_end
from tests.support.adapters import adapter_config, registered, write_adapter

pytestmark = pytest.mark.django_db

MODEL = "SmolLM2-135M-Instruct"


def test_a_valid_adapter_is_ready_with_what_its_check_found(adapter_root, make_tenant,
                                                              base_config):
    tenant, _, _ = make_tenant()
    row = registered(adapter_root, "support", tenant, rank=8)
    assert (row.state, row.refusal, row.rank, row.target_modules) == (
        "ready", "", 8, "q_proj,v_proj")
    weights = adapter_root / tenant.slug / MODEL / "support" / "adapter_model.safetensors"
    assert row.digest == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert row.size_bytes > weights.stat().st_size and row.validated_at is not None


def test_a_refused_adapter_says_why_and_a_fixed_one_is_ready_when_checked_again(
        adapter_root, base_config):
    row = registered(adapter_root, "dora", config=adapter_config(use_dora=True))
    assert (row.state, row.rank, row.digest) == ("refused", 0, "")
    assert row.refusal == "adapter_config.json: DoRA (use_dora) is not supported."
    write_adapter(adapter_root / "shared" / MODEL / "dora")
    assert validate_adapter(row.pk) == "ready"  # the Celery task, run here
    row.refresh_from_db()
    assert row.state == "ready" and row.refusal == ""


def test_an_adapter_over_a_base_model_not_served_is_refused(adapter_root, base_config):
    ServedModel.objects.create(name="org/off", model_path="/models/off", enabled=False)
    row = registered(adapter_root, "x", base="org/off")
    assert row.refusal == "the base model 'org/off' is not served."
    assert adapter_validation.validate(10**9) is None  # gone


def test_a_base_models_config_is_read_from_its_tokenizer_folder_when_its_folder_has_none(
        adapter_root, tmp_path, base_config):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "config.json").write_text(json.dumps(base_config))
    ServedModel.objects.create(name="org/web-only", model_path=str(tmp_path / "absent"),
                               tokenizer_path=str(tokenizer))
    assert registered(adapter_root, "y", base="org/web-only").state == "ready"


@pytest.fixture
def three(adapter_root, make_tenant, base_config):
    """Two tenants' own adapters and a shared one over the default model, and rows that are
    pending, refused or disabled."""
    owner, key, _ = make_tenant()
    other, other_key, _ = make_tenant()
    rows = {"own": registered(adapter_root, "own", owner),
            "theirs": registered(adapter_root, "theirs", other),
            "shared": registered(adapter_root, "shared")}
    rows["refused"] = registered(adapter_root, "refused", owner, rank=128)
    rows["pending"] = LoraAdapter.objects.create(
        name="pending", base_model=MODEL, owner=owner,
        folder=str(write_adapter(adapter_root / owner.slug / MODEL / "pending")))
    rows["off"] = registered(adapter_root, "off", owner)
    rows["off"].enabled = False
    rows["off"].save()
    return key, other_key, rows


def resolve(access: Access, name: str) -> Target | APIError:
    try:
        return read_target(access, name)
    except APIError as exc:
        return exc


def test_an_adapter_resolves_for_its_owner_and_shared_ones_for_all(three):
    key, other_key, rows = three
    mine, theirs = Access.of_key(key), Access.of_key(other_key)
    own = resolve(mine, f"{MODEL}:own")
    assert isinstance(own, Target) and own.model.name == MODEL and own.name == f"{MODEL}:own"
    assert own.adapter == AdapterRef(
        name=f"{MODEL}:own", path=rows["own"].folder, digest=rows["own"].digest, rank=4,
        revision=f"{rows['own'].pk}-{int(rows['own'].validated_at.timestamp())}")
    for access in (mine, theirs):
        shared = resolve(access, f"{MODEL}:shared")
        assert isinstance(shared, Target) and shared.owned_by == "system"
    assert resolve(mine, MODEL).adapter is None


def test_names_are_per_tenant_each_key_reaching_its_own_before_a_shared_one(three,
                                                                             adapter_root):
    # The other tenant registers "own" too, and the operator a shared "own": each key reaches
    # its own tenant's (its digest and revision), never the other's; /v1/models lists one.
    from gateway.adapters import callable_adapters

    key, other_key, rows = three
    other = rows["theirs"].owner
    theirs_own = registered(adapter_root, "own", other, rank=8)
    registered(adapter_root, "own")
    mine, theirs = Access.of_key(key), Access.of_key(other_key)
    assert resolve(mine, f"{MODEL}:own").adapter.revision.startswith(f"{rows['own'].pk}-")
    got = resolve(theirs, f"{MODEL}:own")
    assert got.adapter.revision.startswith(f"{theirs_own.pk}-") and got.adapter.rank == 8
    assert got.adapter.key != resolve(mine, f"{MODEL}:own").adapter.key
    listed = callable_adapters(read_served_models(), adapters.read_adapters(), theirs)
    assert [(a.name, a.owner_id) for a in listed if a.name.endswith(":own")] == [
        (f"{MODEL}:own", other.pk)]


@pytest.mark.parametrize("name", ["theirs", "refused", "pending", "off", "never"])
def test_what_a_sender_may_not_call_is_the_404_of_an_unknown_model(three, name):
    key, _, _ = three
    error = resolve(Access.of_key(key), f"{MODEL}:{name}")
    assert isinstance(error, APIError)
    assert error.body() == model_not_found(f"{MODEL}:{name}").body()
    assert error.status == 404


def test_an_adapter_over_a_base_model_the_key_may_not_call_is_404(three):
    key, _, _ = three
    key.allowed_models = "other-*"
    assert isinstance(resolve(Access.of_key(key), f"{MODEL}:own"), APIError)
    key.tenant.allowed_models = "other-*"
    key.allowed_models = ""
    assert isinstance(resolve(Access.of_key(key), f"{MODEL}:shared"), APIError)


def test_odd_names_are_the_same_404(three):
    key, _, _ = three
    models, ready = read_served_models(), adapters.read_adapters()
    for name in (f"{MODEL}:", f":{MODEL}", f"{MODEL}:own:own", f"{MODEL}::own", "x:own"):
        with pytest.raises(APIError) as caught:
            find_target(models, ready, Access.of_key(key), name)
        assert caught.value.body() == model_not_found(name).body()


def test_a_change_is_seen_at_once_in_the_process_that_saved_it(three):
    key, _, rows = three
    access = Access.of_key(key)
    assert isinstance(resolve(access, f"{MODEL}:own"), Target)
    rows["own"].enabled = False
    rows["own"].save()
    assert isinstance(resolve(access, f"{MODEL}:own"), APIError)
    rows["own"].delete()
    assert isinstance(resolve(access, f"{MODEL}:own"), APIError)


def test_the_request_message_carries_the_adapter_to_the_base_models_queue(
        three, live_worker, rclient, keys):
    key, _, rows = three
    target = read_target(Access.of_key(key), f"{MODEL}:own")

    async def start_and_look():
        generation = await lifecycle.start(
            Principal.for_api_key(key), sampling=Sampling(max_tokens=4), default_max_tokens=16,
            prompt="Hi", prompt_tokens=2, meta={"model": target.model.name},
            adapter=target.adapter)
        queued = [json.loads(raw) for raw in rclient.hvals(keys.fq("wait"))]
        await generation.close()
        return generation.message, queued

    message, queued = async_to_sync(start_and_look)()
    assert message.adapter == target.adapter
    assert (message.meta["model"], message.meta["adapter"]) == (MODEL, f"{MODEL}:own")
    [entry] = queued  # in the default model's own queue
    on_redis = RequestMessage.from_json(entry["body"])
    assert on_redis.adapter == AdapterRef(name=f"{MODEL}:own", path=rows["own"].folder,
                                          digest=rows["own"].digest, rank=4,
                                          revision=f"{rows['own'].pk}-{int(rows['own'].validated_at.timestamp())}")


def test_the_usage_record_names_the_adapter(three, live_worker, rclient, keys):
    key, _, _ = three
    target = read_target(Access.of_key(key), f"{MODEL}:shared")

    async def run():
        generation = await lifecycle.start(
            Principal.for_api_key(key), sampling=Sampling(max_tokens=4), default_max_tokens=16,
            prompt="Hi", prompt_tokens=2, meta={"model": target.model.name},
            adapter=target.adapter)
        run_to_end(rclient, keys, generation.message, prompt=2, completion=3)
        await generation.close()  # its web process's end: what its client got is written
        return generation.message

    message = async_to_sync(run)()
    record_usage(message.request_id)
    record = UsageRecord.objects.get(request_id=message.request_id)
    assert (record.model, record.adapter) == (MODEL, f"{MODEL}:shared")
