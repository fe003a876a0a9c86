"""The models served (the registry and the implicit default), who may call which, the one 404
for a model forbidden or unknown, and each model's prompts counted with its own tokenizer
(gateway.model_registry, gateway.tokens, gateway.tokenizer_folders)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from gateway import model_registry, tokens
from gateway.errors import APIError
from gateway.model_registry import Access, ModelEntry
from gateway.tokenizer_folders import tokenizer_folder, use_tokenizer
from inference.protocol.models import model_folder
from tenants.models import ApiKey, ServedModel

pytestmark = pytest.mark.django_db

DEFAULT = "SmolLM2-135M-Instruct"
# Bytes of "hello world": a byte-level tokenizer without merges counts one token a byte.
HELLO = "hello world"


def byte_tokenizer_folder(folder: Path, *, chat_template: bool = True) -> Path:
    """A model folder whose tokenizer has no merges: one token per byte of the text (its chat
    template, if any, renders ``role: content`` lines)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config: dict = {}
    if chat_template:
        config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                   "{% endfor %}{% if add_generation_prompt %}assistant:"
                                   "{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def served() -> list[ModelEntry]:
    return async_to_sync(model_registry.served_models)()


def test_the_default_model_is_served_without_an_entry(settings):
    [default] = served()
    conf = settings.LLM_PLATFORM
    assert default == ModelEntry(DEFAULT, model_folder(conf["MODEL_PATH"], conf["LLM_CACHE_DIR"]),
                                 tokenizer_folder(), is_default=True)
    assert default.name == conf["SERVED_MODEL_NAME"]


def test_registered_models_follow_the_default_by_name_and_disabled_ones_are_not_served():
    ServedModel.objects.create(name="zeta", model_path="/models/zeta")
    ServedModel.objects.create(name="alpha/b", model_path="~/models/b", tokenizer_path="/tok/b")
    ServedModel.objects.create(name="off", model_path="/models/off", enabled=False)
    models = served()
    assert [m.name for m in models] == [DEFAULT, "alpha/b", "zeta"]
    alpha = models[1]
    assert alpha.folder == Path("~/models/b").expanduser()
    assert alpha.tokenizer_folder == Path("/tok/b") and not alpha.is_default
    assert models[2].tokenizer_folder == Path("/models/zeta") and alpha.created > 0


def test_an_entry_of_the_default_models_name_rules_it():
    entry = ServedModel.objects.create(name=DEFAULT, model_path="/models/smol-v2",
                                       tokenizer_path="/tok/smol-v2")
    ServedModel.objects.create(name="other", model_path="/models/other")
    default = served()[0]
    assert (default.name, default.folder, default.tokenizer_folder, default.is_default) == (
        DEFAULT, Path("/models/smol-v2"), Path("/tok/smol-v2"), True)
    entry.enabled = False
    entry.save()  # seen at once in this process (its copy is dropped)
    assert [m.name for m in served()] == ["other"]


def test_the_registry_is_read_once_per_ttl_and_a_save_here_shows_at_once(
        django_assert_num_queries, monkeypatch):
    ServedModel.objects.create(name="m1", model_path="/models/m1")
    with django_assert_num_queries(1):
        assert len(served()) == 2
        assert len(served()) == 2
    # A change made elsewhere (no signal here) shows once the copy is older than the TTL.
    ServedModel.objects.filter(name="m1").update(enabled=False)
    assert len(served()) == 2
    monkeypatch.setattr(model_registry, "CACHE_TTL_S", 0.0)
    assert [m.name for m in served()] == [DEFAULT]
    monkeypatch.setattr(model_registry, "CACHE_TTL_S", 60.0)
    ServedModel.objects.create(name="m2", model_path="/models/m2")
    assert [m.name for m in served()] == [DEFAULT, "m2"]


@pytest.fixture
def three_models():
    for name in ("bedrock/claude", "bedrockz/claude", "bedrock/a/b", "llama"):
        ServedModel.objects.create(name=name, model_path=f"/models/{name}")
    ServedModel.objects.create(name="bedrock/off", model_path="/models/off", enabled=False)


def loaded(key: ApiKey) -> ApiKey:
    """``key`` read again with its tenant, as authentication returns it."""
    return ApiKey.objects.select_related("tenant").get(pk=key.pk)


def callable_names(key: ApiKey) -> list[str]:
    return [m.name for m in async_to_sync(model_registry.callable_models)(key)]


def test_a_key_calls_what_its_tenant_and_its_own_rules_both_allow(make_tenant, three_models):
    tenant, key, _ = make_tenant()
    everything = [DEFAULT, "bedrock/a/b", "bedrock/claude", "bedrockz/claude", "llama"]
    assert callable_names(key) == everything
    tenant.allowed_models = "bedrock/*, " + DEFAULT
    tenant.save()
    assert callable_names(loaded(key)) == [DEFAULT, "bedrock/claude"]
    key.allowed_models = "bedrock/*\nllama"  # llama: its tenant does not allow it
    key.save()
    key = loaded(key)
    assert callable_names(key) == ["bedrock/claude"]
    key.allowed_models = "*"
    assert callable_names(key) == [DEFAULT]


def test_a_forbidden_an_unknown_and_a_disabled_model_get_the_same_404(make_tenant,
                                                                      three_models):
    tenant, key, _ = make_tenant(allowed_models="bedrock/*")
    key = loaded(key)

    def refusal(name: str) -> APIError:
        with pytest.raises(APIError) as error:
            async_to_sync(model_registry.resolve_model)(key, name)
        return error.value

    assert async_to_sync(model_registry.resolve_model)(key, "bedrock/claude").name == (
        "bedrock/claude")
    for forbidden, unknown in [("llama", "llamb"), ("bedrock/off", "bedrock/of"),
                               ("bedrockz/claude", "bedrockz/claudf"),
                               (DEFAULT, DEFAULT[:-1] + "X")]:
        a, b = refusal(forbidden), refusal(unknown)
        assert (a.status, a.code, a.param) == (b.status, b.code, b.param) == (
            404, "model_not_found", "model")
        assert a.body() == model_registry.model_not_found(forbidden).body()
        assert a.body()["error"]["message"].replace(forbidden, unknown) == (
            b.body()["error"]["message"])
        assert "bedrock/claude" not in a.message + b.message  # nothing served is listed
    long = "x" * 200
    assert refusal(long).message == (f"The model '{'x' * 64}...' does not exist or you do not "
                                     "have access to it.")


def test_rules_stored_without_validation_allow_nothing(make_tenant):
    tenant, key, _ = make_tenant()
    assert not Access("ok, not ok").permits(DEFAULT)
    assert not Access("", "a:b").permits(DEFAULT)
    assert Access("", "").permits(DEFAULT)
    assert model_registry.allowed(served(), Access.of_tenant(tenant)) == served()


def test_a_models_prompts_are_counted_with_its_own_tokenizer(tmp_path):
    folder = byte_tokenizer_folder(tmp_path / "bytes")
    assert tokens.measure_here(None, HELLO, folder=folder).tokens == len(HELLO)
    chat = [{"role": "user", "content": HELLO}]
    rendered = f"user: {HELLO}\nassistant:"
    assert tokens.prompt_text(chat, None, folder=folder) == rendered
    assert tokens.measure_here(chat, None, folder=folder).tokens == len(rendered)
    assert tokens.measure_here(None, HELLO).tokens != len(HELLO)  # the default model's

    async def counts():
        own = await tokens.count_text_tokens(HELLO, folder=folder)
        default = await tokens.count_text_tokens(HELLO)
        with use_tokenizer(folder):  # as a request of that model is counted
            scoped = await tokens.count_chat_tokens(chat)
        after = await tokens.count_chat_tokens(chat)
        return own, default, scoped, after

    own, default, scoped, after = async_to_sync(counts)()
    assert own.exact and not own.estimated and own.tokens == len(HELLO)
    assert default.tokens != len(HELLO)
    assert scoped.tokens == len(rendered) and after.tokens != len(rendered)


def test_a_model_folder_without_a_tokenizer_counts_by_estimate(tmp_path):
    count = tokens.measure_here(None, "word " * 30, folder=tmp_path)
    assert count.estimated and count.tokens == 50  # 150 bytes at 3 a token


def test_entries_saved_by_the_admin_have_their_created_time():
    before = int(timezone.now().timestamp())
    ServedModel.objects.create(name="m", model_path="/m")
    assert served()[1].created >= before


@pytest.mark.parametrize("name", ["bad name", "x@y", "a:b", "tiny/*", "*", "ünï", "-dash",
                                  "tiny/", "a//b", "tiny/..", ""])
def test_a_name_that_is_not_a_model_name_is_refused_whoever_saves_it(name):
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match="model name"):
        ServedModel.objects.create(name=name, model_path="/models/x")
    assert not ServedModel.objects.exists()


def test_an_entry_written_past_its_checks_is_not_served():
    ServedModel.objects.create(name="good/model", model_path="/models/x")
    ServedModel.objects.filter(name="good/model").update(name="bad:model")  # no save()
    model_registry.forget()
    assert [m.name for m in served()] == [DEFAULT]
