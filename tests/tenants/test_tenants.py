"""Tenants, keys, the management commands and the admin."""

from __future__ import annotations

import io
import re
import stat

import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.urls import reverse

from tenants.models import ApiKey, PriorityTier, Tenant, UsageRecord
from tenants.selectors import aauthenticate_key
from tenants.services import ensure_demo_tenant, ensure_demo_user, revoke_api_key

pytestmark = pytest.mark.django_db


def authenticate(raw: str) -> ApiKey | None:
    return async_to_sync(aauthenticate_key)(raw)


def test_default_priority_tiers_exist():
    assert list(PriorityTier.objects.values_list("name", "priority")) == [
        ("premium", 10), ("standard", 0), ("batch", -10)]


def test_create_tenant_command_prints_a_key_that_authenticates():
    out = io.StringIO()
    call_command("create_tenant", "Acme", "--tier", "premium", "--rpm", "7", stdout=out,
                 stderr=io.StringIO())
    raw = out.getvalue().strip()
    tenant = Tenant.objects.get(slug="acme")
    assert tenant.tier.name == "premium" and tenant.requests_per_minute == 7
    key = authenticate(raw)
    assert key is not None and key.tenant == tenant
    assert key.last_used_at is not None


def test_create_tenant_command_sets_the_models_its_keys_may_call(client, db):
    out = io.StringIO()
    call_command("create_tenant", "Narrow", "--allowed-models", "other-model, team/*",
                 stdout=out, stderr=io.StringIO())
    tenant = Tenant.objects.get(slug="narrow")
    assert tenant.allowed_models == "other-model, team/*"
    # The default model is not among its rules: its keys get the 404 of a model not served.
    response = client.post("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct",
                                                    "messages": [{"role": "user",
                                                                  "content": "hi"}]},
                           content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {out.getvalue().strip()}")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_keys_are_stored_hashed_with_a_visible_prefix(tenant_key):
    _, key, raw = tenant_key
    key.refresh_from_db()
    assert raw.startswith("sk-") and key.prefix == raw[:10]
    assert raw not in key.hashed_key and len(key.hashed_key) == 64


def test_revoked_key_and_inactive_tenant_do_not_authenticate(make_tenant):
    _, key, raw = make_tenant()
    revoke_api_key(key)
    assert authenticate(raw) is None
    tenant, _, raw2 = make_tenant()
    Tenant.objects.filter(pk=tenant.pk).update(is_active=False)
    assert authenticate(raw2) is None
    assert authenticate("sk-not-a-key") is None


def test_demo_tenant_is_created_once_and_its_key_kept(settings, tmp_path):
    settings.BASE_DIR = tmp_path
    tenant, raw = ensure_demo_tenant()
    again, raw_again = ensure_demo_tenant()
    assert tenant == again and raw == raw_again
    assert (tmp_path / "var" / "demo_api_key").read_text().strip() == raw
    assert authenticate(raw).is_operator
    # Readable by the owner only, in a folder of the owner's only.
    assert stat.S_IMODE((tmp_path / "var" / "demo_api_key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "var").stat().st_mode) == 0o700


def test_the_demo_user_signs_in_to_the_chat_as_a_member_of_the_demo_tenant(client, settings,
                                                                            tmp_path):
    settings.BASE_DIR = tmp_path
    tenant, _ = ensure_demo_tenant()
    username, password = ensure_demo_user(tenant)
    assert ensure_demo_user(tenant) == (username, password)
    assert (tmp_path / "var" / "demo_password").read_text().strip() == password
    assert stat.S_IMODE((tmp_path / "var" / "demo_password").stat().st_mode) == 0o600
    assert client.login(username=username, password=password)
    assert client.get("/chat/").status_code == 200
    assert client.get("/admin/scheduler/").status_code == 200


def test_the_demo_command_prints_the_key_to_its_output_only(settings, tmp_path):
    """The run script reads the key from standard output (and drops standard error): what the
    command says besides names the file the key is kept in, not the key."""
    settings.BASE_DIR = tmp_path
    out, err = io.StringIO(), io.StringIO()
    call_command("ensure_demo_tenant", "--user", stdout=out, stderr=err)
    raw, login = out.getvalue().splitlines()
    password = login.split()[1]
    assert authenticate(raw).is_operator
    assert raw[10:] not in err.getvalue() and password not in err.getvalue()
    assert str(tmp_path / "var" / "demo_api_key") in err.getvalue()


@pytest.mark.parametrize("model", ["prioritytier", "tenant", "membership", "apikey",
                                   "usagerecord"])
def test_admin_lists_every_model(admin_client, tenant_key, model):
    tenant, key, _ = tenant_key
    UsageRecord.objects.create(request_id="r1", tenant=tenant, api_key=key, model="m")
    response = admin_client.get(reverse(f"admin:tenants_{model}_changelist"))
    assert response.status_code == 200


def test_admin_usage_shows_the_tokens_charged_and_tells_batch_work_apart(admin_client,
                                                                         tenant_key):
    tenant, key, _ = tenant_key
    UsageRecord.objects.create(request_id="interactive-1", tenant=tenant, api_key=key,
                               model="m", prompt_tokens=30, completion_tokens=11)
    UsageRecord.objects.create(request_id="line-1", tenant=tenant, api_key=key, model="m",
                               prompt_tokens=30, completion_tokens=11, billed_tokens=21,
                               batch_id="batch_abc")
    page = reverse("admin:tenants_usagerecord_changelist")
    shown = admin_client.get(page).content.decode()
    assert "Billed tokens" in shown and "Batch id" in shown
    assert '<td class="field-billed_tokens">41</td>' in shown
    assert '<td class="field-billed_tokens">21</td>' in shown
    batch = admin_client.get(page, {"service_class": "batch"}).content.decode()
    assert "line-1" in batch and "batch_abc" in batch and "interactive-1" not in batch
    interactive = admin_client.get(page, {"service_class": "interactive"}).content.decode()
    assert "interactive-1" in interactive and "line-1" not in interactive


def test_admin_shows_a_new_key_once(admin_client, tenant_key):
    tenant, _, _ = tenant_key
    response = admin_client.post(reverse("admin:tenants_apikey_add"), {
        "tenant": tenant.pk, "name": "ci", "requests_per_minute": 0, "tokens_per_minute": 0,
    })
    assert response.status_code == 200
    raw = re.search(r'<code id="new-api-key">(sk-[\w-]+)</code>', response.content.decode())[1]
    assert "no-store" in response["Cache-Control"]
    key = authenticate(raw)
    assert key is not None and key.name == "ci"
    page = admin_client.get(reverse("admin:tenants_apikey_change", args=[key.pk]))
    assert raw not in page.content.decode()
    assert raw not in admin_client.get(reverse("admin:tenants_apikey_changelist")).content.decode()


@pytest.mark.parametrize(("args", "complaint"), [
    (["Acme"], "already exists"),                # taken (created first below)
    (["Other", "--rpm", "-5"], "requests_per_minute"),
    (["   "], "name"),
    (["Weightless", "--fairness-weight", "0"], "fairness_weight"),
    (["Picky", "--allowed-models", "SmolLM2-135M-Instruct, gpt 4"], "allowed_models: 'gpt 4'"),
])
def test_create_tenant_command_refuses_bad_input_with_a_clear_message(args, complaint, db):
    from django.core.management.base import CommandError

    call_command("create_tenant", "Acme", stdout=io.StringIO(), stderr=io.StringIO())
    before = Tenant.objects.count()
    with pytest.raises(CommandError, match=complaint):
        call_command("create_tenant", *args, stdout=io.StringIO(), stderr=io.StringIO())
    assert Tenant.objects.count() == before
