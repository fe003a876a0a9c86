"""The registry of base models and the access rules in the admin: add, list, change, and the
form errors that name what is wrong."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.core.exceptions import ValidationError
from django.urls import reverse

from tenants.models import ServedModel, Tenant
from tenants.services import create_tenant

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client, django_user_model):
    """A staff user who may manage the registry (not a superuser)."""
    user = django_user_model.objects.create_user("registry-staff", password="pw-pw-pw-1",
                                                 is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__endswith="_servedmodel"))
    client.force_login(user)
    return client


def model_form(**fields):
    return {"name": "org/model-2", "model_path": "/models/model-2", "tokenizer_path": "",
            "enabled": "on", "description": "", **fields}


def test_a_model_is_added_listed_searched_filtered_and_changed(staff_client):
    response = staff_client.post(reverse("admin:tenants_servedmodel_add"),
                                 model_form(description="second base model"), follow=True)
    assert response.status_code == 200
    added = ServedModel.objects.get(name="org/model-2")
    assert (added.model_path, added.tokenizer_path, added.enabled) == (
        "/models/model-2", "", True)
    ServedModel.objects.create(name="other", model_path="/models/other", enabled=False)

    changelist = reverse("admin:tenants_servedmodel_changelist")
    page = staff_client.get(changelist)
    assert page.status_code == 200
    assert b"Base models" in page.content or b"base models" in page.content
    assert b"org/model-2" in page.content and b"/models/other" in page.content
    found = staff_client.get(changelist, {"q": "second"})
    assert b"org/model-2" in found.content and b"/models/other" not in found.content
    enabled = staff_client.get(changelist, {"enabled__exact": "1"})
    assert b"org/model-2" in enabled.content and b"/models/other" not in enabled.content

    change = reverse("admin:tenants_servedmodel_change", args=[added.pk])
    assert staff_client.get(change).status_code == 200
    staff_client.post(change, model_form(enabled="", tokenizer_path="/tok/model-2"))
    added.refresh_from_db()
    assert not added.enabled and added.tokenizer_path == "/tok/model-2"


@pytest.mark.parametrize("name", ["base:adapter", "model@2", "gpt*", "two words", "-dash",
                                  "/slash", "caf\u00e9"])
def test_a_name_that_breaks_the_naming_rules_is_a_form_error(staff_client, name):
    response = staff_client.post(reverse("admin:tenants_servedmodel_add"), model_form(name=name))
    assert response.status_code == 200  # the form again, with its error
    assert b"A model name is one or more" in response.content
    assert not ServedModel.objects.exists()


def test_a_taken_name_and_a_missing_folder_are_form_errors(staff_client):
    ServedModel.objects.create(name="org/model-2", model_path="/models/model-2")
    add = reverse("admin:tenants_servedmodel_add")
    taken = staff_client.post(add, model_form())
    assert b"already exists" in taken.content
    missing = staff_client.post(add, model_form(name="fresh", model_path=""))
    assert b"This field is required" in missing.content
    assert ServedModel.objects.count() == 1


def tenant_form(tenant: Tenant, **fields):
    return {"name": tenant.name, "slug": tenant.slug, "tier": tenant.tier_id,
            "fairness_weight": "1.0", "is_active": "on", "requests_per_minute": 0,
            "tokens_per_minute": 0, "max_concurrent_requests": 0, "token_budget": 0,
            "budget_period": "month", "allowed_models": "",
            "memberships-TOTAL_FORMS": 0, "memberships-INITIAL_FORMS": 0,
            "api_keys-TOTAL_FORMS": 0, "api_keys-INITIAL_FORMS": 0, **fields}


def test_a_tenants_rules_are_saved_and_a_bad_entry_is_named(admin_client, make_tenant):
    tenant, _, _ = make_tenant()
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    bad = admin_client.post(url, tenant_form(tenant, allowed_models="bedrock/*\ngpt 4o"))
    assert bad.status_code == 200 and b"&#x27;gpt 4o&#x27; is not a model name" in bad.content
    tenant.refresh_from_db()
    assert tenant.allowed_models == ""
    good = admin_client.post(url, tenant_form(tenant, allowed_models="bedrock/*, SmolLM2*"))
    assert good.status_code == 302
    tenant.refresh_from_db()
    assert tenant.allowed_models == "bedrock/*, SmolLM2*"


def test_a_keys_rules_are_saved_and_a_bad_entry_is_named(admin_client, make_tenant):
    _, key, _ = make_tenant()
    url = reverse("admin:tenants_apikey_change", args=[key.pk])
    form = {"name": "k", "requests_per_minute": 0, "tokens_per_minute": 0}
    bad = admin_client.post(url, {**form, "allowed_models": "a,b:c"})
    assert bad.status_code == 200 and b"&#x27;b:c&#x27; is not a model name" in bad.content
    stars = admin_client.post(url, {**form, "allowed_models": "bedrock/**"})
    assert b"&#x27;**&#x27; is not supported" in stars.content
    assert admin_client.post(url, {**form, "allowed_models": "a\nbedrock/*"}).status_code == 302
    key.refresh_from_db()
    assert key.allowed_models == "a\nbedrock/*"


def test_full_clean_checks_the_rules_and_the_name(make_tenant):
    tenant, key, _ = make_tenant()
    tenant.allowed_models = "ok, not ok"
    with pytest.raises(ValidationError) as error:
        tenant.full_clean()
    assert "'not ok'" in str(error.value.message_dict["allowed_models"])
    key.allowed_models = "x@y"
    with pytest.raises(ValidationError) as error:
        key.full_clean()
    assert "'x@y'" in str(error.value.message_dict["allowed_models"])
    with pytest.raises(ValidationError) as error:
        ServedModel(name="base:adapter", model_path="/m").full_clean()
    assert "name" in error.value.message_dict
    ServedModel(name="org/base-1.5_x", model_path="/m").full_clean()


def test_create_tenant_takes_the_rules_and_refuses_a_bad_entry():
    tenant, _, _ = create_tenant("Limited", allowed_models="bedrock/*")
    assert tenant.allowed_models == "bedrock/*"
    with pytest.raises(ValidationError):
        create_tenant("Wrong", allowed_models="bedrock/*, two words")
    assert not Tenant.objects.filter(name="Wrong").exists()
