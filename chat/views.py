"""The chat pages: the conversation list and one conversation, sign-in, rename and delete."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required as _login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from chat import selectors, services
from chat.models import Conversation
from tenants.models import Tenant

login_required = _login_required(login_url="chat:login")


def _tenant_or_page(request: HttpRequest) -> Tenant | HttpResponse:
    """The signed-in user's active tenant, checked at every request, or the 403 page that says
    the account has none."""
    tenant = selectors.user_tenant(request.user)
    if tenant is None:
        return render(request, "chat/no_tenant.html", status=403)
    return tenant


def _conversation(request: HttpRequest, tenant: Tenant, pk: int) -> Conversation:
    """The user's conversation ``pk`` under ``tenant``; 404 for anyone else's."""
    conversation = selectors.conversation_of(request.user, tenant, pk)
    if conversation is None:
        raise Http404("No such conversation.")
    return conversation


@login_required
def chat_page(request: HttpRequest, pk: int | None = None) -> HttpResponse:
    """GET: the chat page, the user's conversations and, with ``pk``, that conversation's
    messages (for the page's script, as JSON in the page). 404 for another user's
    conversation, 403 without an active tenant."""
    tenant = _tenant_or_page(request)
    if isinstance(tenant, HttpResponse):
        return tenant
    conversation = _conversation(request, tenant, pk) if pk is not None else None
    messages = [m.to_dict() for m in selectors.history(conversation)] if conversation else []
    return render(request, "chat/chat.html", {
        "tenant": tenant,
        "conversations": selectors.conversations_of(request.user, tenant),
        "conversation": conversation,
        "chat_state": {
            "conversation_id": conversation.pk if conversation else None,
            "messages": messages,
            "conversation_url": reverse("chat:conversation", args=[0]),
        },
    })


@login_required
@require_POST
def rename(request: HttpRequest, pk: int) -> HttpResponse:
    """POST ``title``: rename the user's conversation ``pk`` (a blank title changes nothing);
    redirects to it. 404 for another user's, 403 without an active tenant."""
    tenant = _tenant_or_page(request)
    if isinstance(tenant, HttpResponse):
        return tenant
    conversation = _conversation(request, tenant, pk)
    title = request.POST.get("title", "").strip()
    if title:
        services.rename_conversation(conversation, title)
    return redirect("chat:conversation", pk=conversation.pk)


@login_required
@require_POST
def delete(request: HttpRequest, pk: int) -> HttpResponse:
    """POST: delete the user's conversation ``pk``; redirects to the chat. 404 for another
    user's, 403 without an active tenant."""
    tenant = _tenant_or_page(request)
    if isinstance(tenant, HttpResponse):
        return tenant
    services.delete_conversation(_conversation(request, tenant, pk))
    return redirect("chat:index")
