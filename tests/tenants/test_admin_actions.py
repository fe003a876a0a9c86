"""Admin actions run only for staff with the permission they need, in every ModelAdmin."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission
from django.urls import reverse

from tenants.models import ApiKey

pytestmark = pytest.mark.django_db


def staff_with(django_user_model, *codenames: str):
    user = django_user_model.objects.create_user(f"staff-{'-'.join(codenames)}",
                                                 password="pw-pw-pw-1", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return user


def revoke(client, key: ApiKey):
    return client.post(reverse("admin:tenants_apikey_changelist"),
                       {"action": "revoke", "_selected_action": [key.pk]}, follow=True)


def test_a_user_who_may_only_view_keys_can_neither_see_nor_run_revoke(client, make_tenant,
                                                                      django_user_model):
    _, key, _ = make_tenant()  # another tenant's key: staff are not in tenants
    client.force_login(staff_with(django_user_model, "view_apikey"))
    page = client.get(reverse("admin:tenants_apikey_changelist"))
    assert page.status_code == 200 and b'value="revoke"' not in page.content
    revoke(client, key)
    key.refresh_from_db()
    assert key.revoked_at is None


def test_a_user_who_may_change_keys_revokes_them(client, make_tenant, django_user_model):
    _, key, _ = make_tenant()
    client.force_login(staff_with(django_user_model, "view_apikey", "change_apikey"))
    assert b'value="revoke"' in client.get(reverse("admin:tenants_apikey_changelist")).content
    response = revoke(client, key)
    key.refresh_from_db()
    assert key.revoked_at is not None and b"Revoked 1 key(s)." in response.content


def test_every_admin_action_declares_the_permissions_it_needs():
    unguarded = [f"site.{name}" for name, func in admin.site.actions
                 if not getattr(func, "allowed_permissions", None)]
    for model, model_admin in admin.site._registry.items():
        for action in model_admin.actions or []:
            func, name, _ = model_admin.get_action(action)
            if not getattr(func, "allowed_permissions", None):
                unguarded.append(f"{model._meta.label}.{name}")
    assert not unguarded, f"admin actions without permissions=[...]: {unguarded}"


def test_a_keys_tenant_cannot_be_changed_after_it_is_made(admin_client, make_tenant):
    tenant, key, _ = make_tenant()
    other, _, _ = make_tenant()
    url = reverse("admin:tenants_apikey_change", args=[key.pk])
    admin_client.post(url, {"tenant": other.pk, "name": "moved", "requests_per_minute": 0,
                            "tokens_per_minute": 0})
    key.refresh_from_db()
    assert key.tenant_id == tenant.pk
