"""Which model the chat calls for a tenant (the default one when it may, else the first it may
call by name), its prompt counted with that model's tokenizer, and a readable error when the
tenant may call none."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from chat import generation
from chat.models import Message
from gateway import tokens
from gateway.errors import APIError
from gateway.tokenizer_folders import counting_folder
from tenants.models import ServedModel
from tests.chat.test_chat_socket import frames_until, open_socket
from tests.gateway.test_model_registry import byte_tokenizer_folder

DEFAULT = "SmolLM2-135M-Instruct"


def chat_model_name(tenant) -> str:
    return async_to_sync(generation.chat_model)(tenant).name


@pytest.mark.django_db
def test_the_default_model_when_allowed_else_the_first_allowed_by_name(make_tenant):
    for name in ("zeta", "beta/b", "alpha/a"):
        ServedModel.objects.create(name=name, model_path=f"/models/{name}")
    tenant, _, _ = make_tenant()
    assert chat_model_name(tenant) == DEFAULT
    tenant.allowed_models = "zeta, beta/*, " + DEFAULT
    assert chat_model_name(tenant) == DEFAULT
    tenant.allowed_models = "zeta, beta/*"
    assert chat_model_name(tenant) == "beta/b"
    ServedModel.objects.create(name=DEFAULT, model_path="/models/smol", enabled=False)
    tenant.allowed_models = ""
    assert chat_model_name(tenant) == "alpha/a"
    tenant.allowed_models = "gpt-*"
    with pytest.raises(APIError) as error:
        chat_model_name(tenant)
    assert (error.value.status, error.value.code) == (403, "no_model_available")


@pytest.mark.django_db(transaction=True)
@pytest.mark.anyio
async def test_a_tenant_that_may_call_no_model_gets_a_readable_error(make_member, make_tenant,
                                                                     chat_conf):
    tenant, _, _ = await sync_to_async(make_tenant)(allowed_models="nothing-served")
    user = await sync_to_async(make_member)(tenant)
    ws = await open_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "Anyone?"})
    frames = await frames_until(ws, "error")
    assert "No model is available to your organization" in frames[-1]["message"]
    message = await Message.objects.aget(pk=frames[-1]["message_id"])
    assert message.status == "error" and "No model is available" in message.error
    await ws.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.anyio
async def test_the_chats_prompt_is_counted_with_its_models_tokenizer(make_member, make_tenant,
                                                                     chat_conf, tmp_path,
                                                                     monkeypatch):
    folder = byte_tokenizer_folder(tmp_path / "second")
    await ServedModel.objects.acreate(name="org/second", model_path=str(folder))
    tenant, _, _ = await sync_to_async(make_tenant)(allowed_models="org/*")
    seen: list[str] = []
    real = tokens.run

    async def spy(fn, *args, folder=None):
        seen.append(counting_folder(folder))
        return await real(fn, *args, folder=folder)

    monkeypatch.setattr(tokens, "run", spy)
    user = await sync_to_async(make_member)(tenant)
    ws = await open_socket(user)
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": "Anyone?"})
    frames = await frames_until(ws, "error")  # no worker runs
    assert "No model is available" not in frames[-1]["message"]
    assert seen == [str(folder)]
    await ws.disconnect()
