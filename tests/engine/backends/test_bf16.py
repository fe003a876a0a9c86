"""The bf16 path of the transformers backend on CPU: what ``DTYPE=auto`` picks, the KV pool's size,
fp32 logits from a bf16 model, and how far its logits and greedy tokens are from fp32 and from
transformers' own bf16 forward pass.

A bf16 model differs from its fp32 original by bf16 rounding in every layer, so its logits are
compared within tolerances measured on the default model (stated beside each constant), and a
different greedy token is accepted only where the reference's two best logits are closer than
those tolerances (a near-tie at bf16 precision).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from inference.engine.backends.base import DecodeRow, PrefillChunk
from inference.engine.backends.hf import TransformersBackend, loading
from inference.engine.backends.hf.forward import _linear_cpu
from inference.engine.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.model_store import resolve_model_path
from inference.engine.request import SamplingParams, TokenEvent

# Tolerances, each measured on the default model (SmolLM2-135M-Instruct) on an x86 CPU with
# AVX-512 and set at about twice the measured value (bf16 kernels of other CPUs round elsewhere).
# bf16 backend against the fp32 backend over the same tokens: 4 rows of real text through
# chunked prefill and 16 batched decode steps. Measured (24 steps, 100 positions): max |logit
# diff| 1.18, mean 0.084, top-1 agreement 100 %.
FP32_MAX_ABS = 2.5
FP32_MEAN_ABS = 0.2
# A bf16 top-1 token may differ from the reference's only where the reference's two best logits
# are closer than this (a near-tie at bf16 precision; measured differences were at gaps of 0 to
# 0.04).
BF16_TIE = 1.0
# The native kernel against the gather path, both in bf16 (the kernel keeps the softmax weights
# in fp32, scaled_dot_product_attention rounds them to bf16 for the product with V). Measured:
# max 0.67, mean 0.082; each of them against fp32: mean 0.084 (kernel), 0.085 (gather).
KERNEL_MAX_ABS = 1.5
KERNEL_MEAN_ABS = 0.2
# The engine's bf16 logits against transformers' bf16 forward pass over the same tokens
# (transformers rounds its logits to bf16, and its RMSNorm rounds twice where ``F.rms_norm``
# rounds once). Measured over 3 prompts x 20 tokens: max 0.87, mean 0.10 to 0.14.
HF_MAX_ABS = 2.0
HF_MEAN_ABS = 0.3


@pytest.fixture(scope="module")
def bf16() -> TransformersBackend:
    """The default model on CPU in bf16."""
    return TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                               dtype="bfloat16")


# -- DTYPE=auto -------------------------------------------------------------------------------


@pytest.mark.parametrize("family, flags, expected", [
    ("x86", {"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ("x86", {"avx2", "avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
    ("x86", {"avx2", "avx512f", "avx512bw", "avx512vl"}, torch.float32),
    ("arm", {"fp", "asimd", "bf16"}, torch.bfloat16),
    ("arm", {"fp", "asimd", "sve"}, torch.float32),
    ("riscv64", {"bf16"}, torch.float32),
])
def test_auto_dtype_on_cpu_is_bf16_exactly_where_the_cpu_has_bf16_dot_products(
        monkeypatch, caplog, family, flags, expected):
    monkeypatch.setattr(loading, "_cpu_flags", lambda: (family, frozenset(flags)))
    with caplog.at_level(logging.INFO, logger=loading.__name__):
        assert loading.resolve_dtype("auto", torch.device("cpu")) is expected
    (message,) = [r.getMessage() for r in caplog.records if "DTYPE=auto" in r.getMessage()]
    assert message.startswith(f"DTYPE=auto: {str(expected).removeprefix('torch.')} (")
    assert loading.cpu_has_native_bf16()[0] is (expected is torch.bfloat16)
    # An explicit dtype is taken as given, and MPS keeps fp16.
    assert loading.resolve_dtype("float32", torch.device("cpu")) is torch.float32
    assert loading.resolve_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    assert loading.resolve_dtype("auto", torch.device("mps")) is torch.float16


def test_the_flag_reader_reads_this_cpu():
    family, flags = loading._cpu_flags()
    native, reason = loading.cpu_has_native_bf16()
    if family == "x86":
        assert "sse2" in flags  # the flags line was found
        assert native is bool({"avx512_bf16", "amx_bf16"} & flags), reason
    assert reason.startswith("CPU has") or "no native bf16 flag" in reason


# -- the model in bf16 ------------------------------------------------------------------------


@pytest.mark.model
def test_a_bf16_kv_pool_takes_half_the_bytes_of_fp32(backend, bf16):
    assert backend.dtype == torch.float32
    assert bf16.kv_bytes_per_token() * 2 == backend.kv_bytes_per_token()
    bf16.allocate_kv_pool(10, 16)
    assert bf16._kv is not None and bf16._kv.dtype == torch.bfloat16
    assert bf16._kv.numel() * bf16._kv.element_size() == 10 * 16 * bf16.kv_bytes_per_token()
    assert bf16.native_attention, "the native kernel is on for bf16 on CPU"


def teacher_forced_logits(b: TransformersBackend, corpus_ids: list[int],
                          steps: int = 16) -> torch.Tensor:
    """``[4 + 4 * steps, vocab]`` logits: 4 rows of real text prefilled (one in two chunks),
    then ``steps`` batched decode steps fed the text's next tokens."""
    b.allocate_kv_pool(160, 16)
    starts, lengths = (0, 200, 400, 700), (40, 97, 130, 17)
    tables = {r: list(range(40 * r, 40 * r + 40)) for r in range(4)}
    chunks = [PrefillChunk(f"r{r}", corpus_ids[s:s + n], 0, tables[r])
              for r, (s, n) in enumerate(zip(starts, lengths, strict=True))]
    b.prefill([PrefillChunk("r2", chunks[2].token_ids[:64], 0, tables[2])])
    chunks[2] = PrefillChunk("r2", chunks[2].token_ids[64:], 64, tables[2])
    out = [b.prefill(chunks)]
    for step in range(steps):
        out.append(b.decode([
            DecodeRow(f"r{r}", corpus_ids[s + n + step], n + step, tables[r])
            for r, (s, n) in enumerate(zip(starts, lengths, strict=True))]))
    return torch.cat(out)


def assert_argmax_agrees_except_near_ties(reference: torch.Tensor, got: torch.Tensor,
                                          label: str) -> None:
    top = torch.topk(reference, 2, dim=-1).values
    gaps = top[:, 0] - top[:, 1]
    differ = reference.argmax(-1) != got.argmax(-1)
    assert not (differ & (gaps >= BF16_TIE)).any(), (
        f"{label}: a different top-1 token where the reference's top-2 gap is "
        f"{gaps[differ].max().item():.3f} (>= {BF16_TIE})")


@pytest.mark.model
@pytest.mark.slow
def test_bf16_logits_track_the_fp32_model(backend, bf16, corpus_ids):
    ours = teacher_forced_logits(bf16, corpus_ids)
    ref = teacher_forced_logits(backend, corpus_ids)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours - ref).abs()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    stats = f"max {diff.max().item():.3f}, mean {diff.mean().item():.3f}, top-1 {agree:.1%}"
    assert diff.max().item() < FP32_MAX_ABS, stats
    assert diff.mean().item() < FP32_MEAN_ABS, stats
    assert agree >= 0.95, stats
    assert_argmax_agrees_except_near_ties(ref, ours, "bf16 vs fp32")


@pytest.mark.model
@pytest.mark.slow
def test_bf16_decode_alike_with_the_kernel_and_with_gathers(bf16, corpus_ids):
    assert bf16.native_attention
    try:
        with_kernel = teacher_forced_logits(bf16, corpus_ids, steps=6)
        bf16.native_attention = False
        gathered = teacher_forced_logits(bf16, corpus_ids, steps=6)
    finally:
        bf16.native_attention = True
    diff = (with_kernel - gathered).abs()
    stats = f"max {diff.max().item():.3f}, mean {diff.mean().item():.3f}"
    assert diff.max().item() < KERNEL_MAX_ABS, stats
    assert diff.mean().item() < KERNEL_MEAN_ABS, stats
    assert_argmax_agrees_except_near_ties(gathered, with_kernel, "kernel vs gathers")


@pytest.mark.model
@pytest.mark.parametrize("rows", [1, 3, 32, 100])
def test_logits_of_a_bf16_model_are_fp32_from_an_fp32_lm_head(bf16, corpus_ids, rows):
    # The final norm and LM head over bf16 hidden states: those of fp32 weights, to fp32 rounding.
    with torch.inference_mode():
        h = bf16._embed[torch.tensor(corpus_ids[:rows])]  # [rows, hidden] bf16
        logits = bf16._logits(h, _linear_cpu)
        norm_w, eps = bf16._norm
        ref = F.linear(F.rms_norm(h.float(), (h.shape[-1],), norm_w.float(), eps),
                       bf16._lm_head_w.float())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-5)
    # What prefill returns is not rounded to bf16 on the way (bf16 logits would be off by up to
    # half a bf16 step, 0.06 at a logit of 16, with many exact ties): almost no logit is a bf16
    # value.
    bf16.allocate_kv_pool(8, 16)
    out = bf16.prefill([PrefillChunk("r", corpus_ids[:40], 0, [0, 1, 2])])
    assert out.dtype == torch.float32
    assert (out.bfloat16().float() != out).float().mean().item() > 0.9


@pytest.mark.model
def test_a_bf16_model_without_native_kernels_gets_the_same_logits(bf16, corpus_ids, monkeypatch):
    # No C compiler: the head runs over the fp32 copy of its weight.
    with torch.inference_mode():
        h = bf16._embed[torch.tensor(corpus_ids[:3])]
        with_kernel = bf16._logits(h, _linear_cpu)
        monkeypatch.setattr(bf16, "_native", False)
        without = bf16._logits(h, _linear_cpu)
    torch.testing.assert_close(without, with_kernel, atol=1e-4, rtol=1e-5)


def greedy_through_the_engine(b: TransformersBackend, prompts: dict[str, list[int]],
                              max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, the prompts batched in one engine over ``b``."""
    engine = LLMEngine(EngineConfig(kv_num_blocks=128, kv_block_size=16, max_batch_size=8,
                                    prefill_chunk_size=64, max_pending=10), b)
    for rid, prompt in prompts.items():
        engine.submit(prompt_token_ids=prompt, request_id=rid,
                      sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(10 * max_tokens * len(prompts)):
        if not engine.has_work():
            break
        for event in engine.step():
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event.token_id)
    assert not engine.has_work()
    return tokens


def teacher_forced_rows(b: TransformersBackend, prompts: dict[str, list[int]],
                        tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Per row ``[len(tokens), vocab]``: the logits behind each of its tokens, the rows prefilled
    and then decoded together, fed ``tokens``."""
    b.allocate_kv_pool(128, 16)
    tables = {rid: list(range(40 * i, 40 * i + 40)) for i, rid in enumerate(prompts)}
    first = b.prefill([PrefillChunk(rid, p, 0, tables[rid]) for rid, p in prompts.items()])
    out = {rid: [first[i]] for i, rid in enumerate(prompts)}
    steps = min(len(t) for t in tokens.values())
    for step in range(steps - 1):
        logits = b.decode([DecodeRow(rid, tokens[rid][step], len(p) + step, tables[rid])
                           for rid, p in prompts.items()])
        for i, rid in enumerate(prompts):
            out[rid].append(logits[i])
    return {rid: torch.stack(rows) for rid, rows in out.items()}


@pytest.mark.model
@pytest.mark.slow
def test_bf16_engine_greedy_output_follows_transformers_bf16_forward(bf16, corpus_ids,
                                                                      chat_prompt):
    prompts = {"chat": chat_prompt, "a": corpus_ids[:50], "b": corpus_ids[500:620]}
    tokens = greedy_through_the_engine(bf16, prompts, max_tokens=20)
    ours = teacher_forced_rows(bf16, prompts, tokens)
    for rid, prompt in prompts.items():
        assert len(tokens[rid]) == 20
        with torch.inference_mode():
            hf = bf16.hf_model(torch.tensor([prompt + tokens[rid][:-1]])).logits[0].float()
        hf = hf[len(prompt) - 1:]  # [20, vocab]: the logits behind each generated token
        # What a user gets: the engine's greedy tokens are transformers' own bf16 argmax.
        hf_choice = hf.argmax(-1)
        top = torch.topk(hf, 2, dim=-1).values
        for i, token in enumerate(tokens[rid]):
            gap = (top[i, 0] - top[i, 1]).item()
            assert token == hf_choice[i].item() or gap < BF16_TIE, (
                f"{rid}: token {i} is {token}, transformers bf16 picks {hf_choice[i].item()} "
                f"by a margin of {gap:.3f}")
        diff = (ours[rid] - hf).abs()
        stats = f"{rid}: max {diff.max().item():.3f}, mean {diff.mean().item():.3f}"
        assert diff.max().item() < HF_MAX_ABS, stats
        assert diff.mean().item() < HF_MEAN_ABS, stats
