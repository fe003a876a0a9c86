"""The torch-free tokenizer and chat template give what ``transformers`` gives for the same folder.

The worker builds its prompts with :mod:`inference.tokenization` and the web tier counts tokens
with it, so both count the same; these tests pin it to the model's own ``transformers`` tokenizer.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine.model_store import resolve_model_path
from inference.tokenization import Tokenizer, TokenizerLoadError

pytestmark = pytest.mark.model

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60) | st.sampled_from(
    ["", " ", "<|im_start|>user\nhi<|im_end|>", "naïve café 😀", "日本語のテキスト",
     "a\u0301\n\t x"])
TURN = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                              "content": TEXT})


@pytest.fixture(scope="module")
def folder():
    return resolve_model_path("")


@pytest.fixture(scope="module")
def ours(folder) -> Tokenizer:
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def theirs(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=st.lists(TURN, min_size=1, max_size=5))
def test_a_chat_prompt_is_the_same_tokens_as_transformers_makes(ours, theirs, conversation):
    expected = theirs.apply_chat_template(conversation, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
    assert ours.apply_chat_template(conversation) == list(expected)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_text_encodes_and_decodes_as_transformers_does(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    with_eos = ids + sorted(ours.eos_token_ids)
    assert ours.decode(with_eos) == theirs.decode(
        with_eos, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_the_default_system_prompt_is_counted(ours):
    """The model's template adds a system prompt to a conversation without one."""
    alone = len(ours.apply_chat_template([{"role": "user", "content": "Hi"}]))
    with_system = len(ours.apply_chat_template(
        [{"role": "system", "content": "x"}, {"role": "user", "content": "Hi"}]))
    assert alone > with_system + 10


def test_eos_ids_include_the_configs(ours, theirs):
    assert theirs.eos_token_id in ours.eos_token_ids


def test_a_folder_without_a_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_a_model_without_a_chat_template_refuses_chat(folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    bare = Tokenizer.from_folder(tmp_path)
    assert bare.encode("hello") and bare.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hello"}])
