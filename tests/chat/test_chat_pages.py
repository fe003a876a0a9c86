"""The chat pages: sign-in, a user's own conversations only, rename and delete."""

from __future__ import annotations

import pytest

from chat.models import Conversation, Message
from tests.support.web import PASSWORD

pytestmark = pytest.mark.django_db


def conversation_of(user, title="t") -> Conversation:
    return Conversation.objects.create(user=user, tenant=user.membership.tenant, title=title)


def test_the_chat_needs_a_signed_in_user(client, make_member):
    response = client.get("/chat/")
    assert response.status_code == 302 and response["Location"].startswith("/chat/login/")
    assert client.get("/").status_code == 302
    user = make_member()
    response = client.post("/chat/login/", {"username": user.username, "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == "/chat/"
    assert client.get("/chat/").status_code == 200


def test_a_user_sees_their_history_and_never_anothers(client, make_member):
    owner, other = make_member(), make_member()
    mine = conversation_of(owner, "mine")
    Message.objects.create(conversation=mine, role="user", content="hello")
    Message.objects.create(conversation=mine, role="assistant", content="partial",
                           status="stopped", finish_reason="abort")
    theirs = conversation_of(other, "theirs")
    client.force_login(owner)
    page = client.get(f"/chat/c/{mine.pk}/")
    assert page.status_code == 200
    state = page.context["chat_state"]
    assert [(m["role"], m["status"]) for m in state["messages"]] == [
        ("user", "complete"), ("assistant", "stopped")]
    assert b"theirs" not in client.get("/chat/").content
    assert client.get(f"/chat/c/{theirs.pk}/").status_code == 404
    assert client.post(f"/chat/c/{theirs.pk}/rename", {"title": "x"}).status_code == 404
    assert client.post(f"/chat/c/{theirs.pk}/delete").status_code == 404
    assert Conversation.objects.filter(pk=theirs.pk, title="theirs").exists()


def test_conversations_can_be_renamed_and_deleted(client, make_member):
    user = make_member()
    conversation = conversation_of(user)
    client.force_login(user)
    client.post(f"/chat/c/{conversation.pk}/rename", {"title": "Trip plans"})
    conversation.refresh_from_db()
    assert conversation.title == "Trip plans"
    response = client.post(f"/chat/c/{conversation.pk}/delete")
    assert response.status_code == 302
    assert not Conversation.objects.filter(pk=conversation.pk).exists()


def test_a_user_without_a_tenant_is_told_so(client, django_user_model):
    user = django_user_model.objects.create_user("loner", password=PASSWORD)
    client.force_login(user)
    response = client.get("/chat/")
    assert response.status_code == 403 and b"does not belong to an active tenant" in \
        response.content


RAW_HTML = "Look: <svg> <template> <!-- <textarea> and the rest **after** them."


def test_raw_html_in_a_conversation_reaches_the_page_as_data_and_the_admin_as_text(
        client, admin_client, make_member):
    user = make_member()
    conversation = conversation_of(user, "<svg> in a title")
    Message.objects.create(conversation=conversation, role="user", content="show tags")
    Message.objects.create(conversation=conversation, role="assistant", content=RAW_HTML)
    client.force_login(user)
    page = client.get(f"/chat/c/{conversation.pk}/")
    # The chat page carries the stored text as JSON data for its script, unchanged.
    assert page.context["chat_state"]["messages"][-1]["content"] == RAW_HTML
    assert b"<svg>" not in page.content and b"<template>" not in page.content
    # The admin shows a conversation's messages as text, escaped, all of it.
    shown = admin_client.get(f"/admin/chat/conversation/{conversation.pk}/change/")
    html = shown.content.decode()
    assert shown.status_code == 200
    assert ("Look: &lt;svg&gt; &lt;template&gt; &lt;!-- &lt;textarea&gt; and the rest "
            "**after** them.") in html
    assert "<svg>" not in html and "<template>" not in html and "<textarea>" not in html
