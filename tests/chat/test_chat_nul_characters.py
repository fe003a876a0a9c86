"""A NUL character (U+0000) in a chat message, a conversation's title or an admin search is
served, never a 500 (PostgreSQL keeps no NUL in text; the stored text holds U+FFFD instead)."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.contrib import admin
from django.urls import reverse

from chat.models import Conversation, Message
from tests.chat.test_chat_socket import frames_until
from tests.support.web import session_cookie, signed_in_client, socket_to_site

NUL = "\u0000"


@pytest.mark.django_db(transaction=True)
@pytest.mark.anyio
async def test_a_chat_message_holding_a_nul_is_answered_and_stored(make_member, worker,
                                                                    chat_conf):
    chat_conf(MAX_TOKENS=3)
    user = await sync_to_async(make_member)()
    client = await sync_to_async(signed_in_client)(user)
    ws = socket_to_site(session_cookie(client))
    connected, _ = await ws.connect(timeout=10)
    assert connected
    await ws.send_json_to({"type": "send", "conversation_id": None, "content": f"Hi{NUL} there"})
    frames = await frames_until(ws, "done")
    assert frames[-1]["status"] == "complete", frames[-1]
    await ws.disconnect()
    asked = await Message.objects.filter(role="user").alast()
    assert asked.content == "Hi\ufffd there"
    conversation = await Conversation.objects.aget(pk=asked.conversation_id)
    assert NUL not in conversation.title


@pytest.mark.django_db
def test_a_title_holding_a_nul_renames_the_conversation(client, make_member):
    user = make_member()
    conversation = Conversation.objects.create(user=user, tenant=user.membership.tenant, title="t")
    client.force_login(user)
    response = client.post(f"/chat/c/{conversation.pk}/rename", {"title": f"Trip{NUL}"})
    assert response.status_code == 302
    conversation.refresh_from_db()
    assert conversation.title == "Trip\ufffd"


@pytest.mark.django_db
@pytest.mark.parametrize("model", list(admin.site._registry), ids=lambda m: m._meta.label)
def test_every_admin_list_takes_a_search_or_filter_holding_a_nul(admin_client, model):
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    for query in ({"q": f"x{NUL}"}, {"id": NUL}, {f"x{NUL}": "1"}):
        response = admin_client.get(url, query)
        assert response.status_code < 500, (query, response.content[:300])
