"""The transformers backend on the real default model: its math, its tokenizer, its start-up errors.

The paged forward pass is checked against the plain Hugging Face forward (logits) and against
``model.generate`` (greedy tokens, with the tie rule of :mod:`tests.support.greedy`).
"""

from __future__ import annotations

import json

import pytest
import torch

from inference.engine.backends.base import DecodeRow, PassYielded, PrefillChunk
from inference.engine.backends.hf import TransformersBackend
from inference.engine.backends.hf.batch import _make_batch
from inference.engine.config import EngineConfig
from inference.engine.model_store import ModelLoadError, resolve_model_path, validate_model_dir
from inference.engine.request import SamplingParams
from tests.support.greedy import Run, assert_same_greedy, run_alone

pytestmark = pytest.mark.model

LOGIT_ATOL = 2e-3


def hf_logits(backend: TransformersBackend, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of the plain transformers forward pass (no cache)."""
    with torch.inference_mode():
        return backend.hf_model(torch.tensor([ids])).logits[0].float()


def test_prefill_through_scattered_blocks_matches_the_plain_forward(backend, corpus_ids):
    backend.allocate_kv_pool(64, 16)
    ids = corpus_ids[:70]
    table = [9, 2, 31, 7, 40]  # out of order, not contiguous
    logits = backend.prefill([PrefillChunk("r", ids, 0, table)])
    assert logits.shape == (1, backend.vocab_size)
    torch.testing.assert_close(logits[0], hf_logits(backend, ids)[-1], atol=LOGIT_ATOL, rtol=0)


def test_uneven_prefill_chunks_and_ragged_decode_rows_match_the_plain_forward(backend, corpus_ids):
    backend.allocate_kv_pool(64, 16)
    a, b, c = corpus_ids[:5], corpus_ids[100:147], corpus_ids[300:333]
    tables = {"a": [3], "b": [10, 11, 12], "c": [20, 5, 21]}
    # b and c in two chunks each; the second round batches chunks of 3 different lengths.
    backend.prefill([PrefillChunk("b", b[:16], 0, tables["b"]),
                     PrefillChunk("c", c[:7], 0, tables["c"])])
    logits = backend.prefill([PrefillChunk("a", a, 0, tables["a"]),
                              PrefillChunk("b", b[16:], 16, tables["b"]),
                              PrefillChunk("c", c[7:], 7, tables["c"])])
    for i, ids in enumerate((a, b, c)):
        torch.testing.assert_close(logits[i], hf_logits(backend, ids)[-1], atol=LOGIT_ATOL, rtol=0)
    # One decode pass over three rows of lengths 6, 48 (a block boundary) and 34.
    nxt = {"a": 11, "b": 22, "c": 33}
    rows = [DecodeRow(r, nxt[r], len(ids), tables[r]) for r, ids in zip("abc", (a, b, c),
                                                                        strict=True)]
    logits = backend.decode(rows)
    for i, (r, ids) in enumerate(zip("abc", (a, b, c), strict=True)):
        expected = hf_logits(backend, [*ids, nxt[r]])[-1]
        torch.testing.assert_close(logits[i], expected, atol=LOGIT_ATOL, rtol=0)


def test_greedy_output_equals_transformers_generate(backend, chat_prompt):
    max_new = 32
    with torch.inference_mode():
        out = backend.hf_model.generate(
            torch.tensor([chat_prompt]), max_new_tokens=max_new, do_sample=False,
            output_logits=True, return_dict_in_generate=True)
    hf_tokens = out.sequences[0, len(chat_prompt):].tolist()
    top2 = [torch.topk(step[0].float(), 2).values for step in out.logits]
    hf_gaps = [float(t[0] - t[1]) for t in top2]
    eos = backend.tokenizer.eos_token_ids
    cut = next((i for i, t in enumerate(hf_tokens) if t in eos), len(hf_tokens))
    reference = Run(hf_tokens[:cut], hf_gaps, "", None)  # type: ignore[arg-type]

    ours = run_alone(backend, chat_prompt, SamplingParams(max_tokens=max_new))
    assert ours.tokens, "no tokens generated"
    assert_same_greedy(reference, ours.tokens, "engine vs transformers generate")


def test_a_deep_chunk_a_new_prompt_and_a_decode_row_in_one_pass_match_the_plain_forward(
        backend, corpus_ids):
    # A long prompt's late chunk (its keys: 600 positions) beside a new 40-token prompt: gathered
    # together, the short prompt would attend over 600 padded keys and the chunk be padded to 40
    # queries; they are gathered apart, and the logits are the plain forward's either way.
    backend.allocate_kv_pool(128, 16)
    long, short, other = corpus_ids[:600], corpus_ids[700:740], corpus_ids[800:830]
    tables = {"L": list(range(40, 78)), "s": [90, 3, 91], "o": [100, 101]}
    backend.prefill([PrefillChunk("L", long[:570], 0, tables["L"])])
    backend.prefill([PrefillChunk("o", other, 0, tables["o"])])
    chunks = [PrefillChunk("L", long[570:], 570, tables["L"]),
              PrefillChunk("s", short, 0, tables["s"])]
    rows = [(list(c.token_ids), c.start_pos, c.block_table) for c in chunks]
    batch = _make_batch(rows + [([7], 30, tables["o"])], block_size=16, num_blocks=128,
                        num_kv_heads=backend.num_kv_heads, group=backend.group,
                        max_model_len=backend.max_model_len, max_groups=1,
                        device=torch.device("cpu"), decode_from=2)
    assert [(p.token_start, p.token_end) for p in batch.parts] == [(0, 30), (30, 70), (70, 71)]
    logits = backend.prefill_and_decode(chunks, [DecodeRow("o", 7, 30, tables["o"])])
    for i, ids in enumerate((long, short, [*other, 7])):
        torch.testing.assert_close(logits[i], hf_logits(backend, ids)[-1], atol=LOGIT_ATOL, rtol=0)


def test_a_pass_stopped_between_layers_and_done_again_matches_the_plain_forward(backend,
                                                                                corpus_ids):
    # A pass of a prompt chunk and a decode row gives way before its 10th layer (its first nine
    # layers' K/V written), then the same pass runs whole: the logits are the plain forward's,
    # and so are the next pass's, which reads the K/V the stopped pass wrote over.
    backend.allocate_kv_pool(64, 16)
    a, b = corpus_ids[:40], corpus_ids[100:121]
    tables = {"a": [5, 6, 7], "b": [9, 10]}
    backend.prefill([PrefillChunk("b", b[:20], 0, tables["b"])])
    chunks, rows = [PrefillChunk("a", a, 0, tables["a"])], [DecodeRow("b", b[20], 20, tables["b"])]
    asked = []
    backend.yield_check = lambda: asked.append(1) or len(asked) > 9
    try:
        with pytest.raises(PassYielded, match="layer 9"):
            backend.prefill_and_decode(chunks, rows)
    finally:
        backend.yield_check = None
    logits = backend.prefill_and_decode(chunks, rows)
    torch.testing.assert_close(logits[0], hf_logits(backend, a)[-1], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(backend, b)[-1], atol=LOGIT_ATOL, rtol=0)
    after = backend.decode([DecodeRow("a", 11, 40, tables["a"])])
    torch.testing.assert_close(after[0], hf_logits(backend, [*a, 11])[-1], atol=LOGIT_ATOL,
                               rtol=0)


def test_pool_is_one_tensor_sized_by_blocks(backend):
    backend.allocate_kv_pool(10, 8)
    pool = backend._kv
    assert pool is not None
    assert pool.numel() * pool.element_size() == 10 * 8 * backend.kv_bytes_per_token()
    backend.prefill([PrefillChunk("r", [1, 2, 3], 0, [4])])
    assert backend._kv is pool  # writes go into the pool, it never grows


def test_a_block_table_too_short_is_refused(backend):
    backend.allocate_kv_pool(8, 4)
    with pytest.raises(ValueError, match="block table"):
        backend.prefill([PrefillChunk("r", [1, 2, 3, 4, 5], 0, [0])])


# -- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_encodes_without_and_decodes_skipping_special_tokens(backend):
    tok = backend.tokenizer
    ids = tok.encode("Hello world")
    assert tok.decode(ids) == "Hello world"
    im_start = tok.token_to_id("<|im_start|>")
    assert im_start not in ids
    assert tok.decode([im_start, *ids, *tok.eos_token_ids]) == "Hello world"


def test_chat_template_is_the_models_own_with_a_generation_prompt(backend):
    tok = backend.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_eos_ids_include_the_generation_configs(backend):
    eos = backend.tokenizer.eos_token_ids
    assert isinstance(eos, frozenset)
    assert backend.hf_model.generation_config.eos_token_id in eos
    assert backend.tokenizer.token_to_id("<|im_end|>") in eos


# -- start-up errors (no model weights needed) -----------------------------------------------


@pytest.mark.parametrize("layout, missing", [
    ("none", "does not exist"),
    ("empty", "no config.json"),
    ("config_only", "no weights"),
])
def test_a_broken_model_path_is_a_clear_error(tmp_path, layout, missing):
    folder = tmp_path / "model"
    if layout != "none":
        folder.mkdir()
    if layout == "config_only":
        (folder / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=missing) as info:
        validate_model_dir(folder)
    assert str(folder) in str(info.value)
    with pytest.raises(ModelLoadError, match=missing):
        TransformersBackend.from_config(EngineConfig(model_path=str(folder)))


def test_an_unsupported_architecture_is_refused_at_start_up(tmp_path):
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'gpt2'"):
        TransformersBackend.from_config(EngineConfig(model_path=str(folder)))


def test_corrupt_weights_are_a_clear_error(tmp_path):
    source = resolve_model_path("")
    folder = tmp_path / "corrupt"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        (folder / name).write_bytes((source / name).read_bytes())
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot load the weights"):
        TransformersBackend.from_config(EngineConfig(model_path=str(folder)))


def test_an_unavailable_device_or_unknown_dtype_is_refused(backend):
    path = str(resolve_model_path(""))
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            TransformersBackend.from_pretrained(path, device="cuda")
    with pytest.raises(ModelLoadError, match="unknown DTYPE"):
        TransformersBackend.from_pretrained(path, dtype="float8")
