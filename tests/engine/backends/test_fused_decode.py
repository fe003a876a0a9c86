"""A bf16 model's decode passes through one native call per layer
(:mod:`inference.engine.backends.native.decode`): the same K/V and logits as the PyTorch pass over
the same packed weights, refusals that write nothing, and where it runs.

Both paths round at the same points (see ``decode_layer.c``); they differ only in the order of
the fp32 sums inside a norm and in SiLU's ``exp`` (within 2 ulp), so a rare bf16 value lands on
its neighbour and spreads through later layers, as far as the packed kernel's own tolerances
(``test_bf16_gemm.py``).
"""

from __future__ import annotations

import sys

import pytest
import torch

from inference.engine.backends.base import DecodeRow, PrefillChunk
from inference.engine.backends.hf import TransformersBackend
from inference.engine.backends.native import decode as native_decode
from inference.engine.backends.native import gemm as native_gemm
from inference.engine.backends.native import quant as native_quant
from inference.engine.model_store import resolve_model_path
from tests.engine.backends.test_bf16 import assert_argmax_agrees_except_near_ties
from tests.engine.backends.test_bf16_gemm import (
    PLAIN_MAX_ABS,
    PLAIN_MEAN_ABS,
    tiny_bf16_backend,
)


@pytest.fixture(scope="module")
def bf16() -> TransformersBackend:
    b = TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                            dtype="bfloat16")
    if b._decode_layers is None:
        assert not b.packed_gemm, "the default model packs but its decode passes are not fused"
        pytest.skip("no packed bf16 kernel on this CPU (no AVX512-BF16 or no C compiler)")
    return b


def decode_run(b: TransformersBackend, corpus_ids: list[int], *, fused: bool,
               steps: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[steps * 5, vocab]`` of 5 rows (contexts 1 to 301 tokens) decoded ``steps``
    times, teacher-forced, and the KV pool afterwards."""
    b.allocate_kv_pool(130, 16)
    lengths = (1, 17, 64, 130, 301)
    tables = {r: list(range(1 + 25 * r, 26 + 25 * r)) for r in range(len(lengths))}
    b.fused_decode = True
    b.prefill([PrefillChunk(f"r{r}", corpus_ids[r * 50:r * 50 + n], 0, tables[r])
               for r, n in enumerate(lengths)])
    b.fused_decode = fused
    try:
        out = [b.decode([DecodeRow(f"r{r}", corpus_ids[r * 50 + n + step], n + step, tables[r])
                         for r, n in enumerate(lengths)]) for step in range(steps)]
    finally:
        b.fused_decode = True
    assert b._kv is not None
    return torch.cat(out), b._kv.clone()


def assert_same_as_the_pytorch_pass(fused_logits: torch.Tensor, fused_kv: torch.Tensor,
                                    torch_logits: torch.Tensor, torch_kv: torch.Tensor,
                                    what: str) -> None:
    """Layer 0's K/V equal (the same roundings of the same products) in all but a rare element,
    the logits within the packed kernel's tolerances, greedy agreement except near ties."""
    same = (fused_kv[0] == torch_kv[0]).float().mean().item()
    assert same > 0.999, f"layer 0's K/V equal in {same:.4%} of elements"
    diff = (fused_logits - torch_logits).abs()
    stats = f"max {diff.max().item():.3f}, mean {diff.mean().item():.3f}"
    assert diff.max().item() < PLAIN_MAX_ABS, stats
    assert diff.mean().item() < PLAIN_MEAN_ABS, stats
    assert_argmax_agrees_except_near_ties(torch_logits, fused_logits, f"fused vs PyTorch {what}")


@pytest.mark.model
def test_a_fused_decode_pass_writes_the_same_kv_and_gives_the_same_logits(bf16, corpus_ids):
    fused_logits, fused_kv = decode_run(bf16, corpus_ids, fused=True)
    torch_logits, torch_kv = decode_run(bf16, corpus_ids, fused=False)
    assert_same_as_the_pytorch_pass(fused_logits, fused_kv, torch_logits, torch_kv, "decode")


@pytest.mark.model
def test_a_bad_block_table_is_refused_before_anything_is_written(bf16, corpus_ids):
    bf16.allocate_kv_pool(8, 16)
    bf16.prefill([PrefillChunk("r", corpus_ids[:20], 0, [1, 2])])
    assert bf16._kv is not None
    before = bf16._kv.clone()
    # Position 40 needs a third block the table does not have; a block id outside the pool.
    for row, match in ((DecodeRow("r", 5, 40, [1, 2]), "block table"),
                       (DecodeRow("r", 5, 20, [1, 99]), "outside the pool")):
        with pytest.raises(ValueError, match=match):
            bf16.decode([row])
        assert torch.equal(bf16._kv, before)
    # The kernel's own checks, called directly: lengths past the table, the rotary tables or
    # below 1, and block ids outside the pool; the residual stream and the pool stay as they were.
    h = torch.randn(1, bf16._layers[0].ln1_w.shape[0]).bfloat16()
    h_before = h.clone()
    table = torch.tensor([[1, 2]])
    for lens, tables, match in (([41], table, "block table"), ([0], table, "block table"),
                                ([bf16.max_model_len + 1], torch.ones(1, 9000, dtype=torch.int64),
                                 "rotary"),
                                ([20], torch.tensor([[1, -1]]), "outside the pool"),
                                # the new token's block is good, an earlier one is not
                                ([20], torch.tensor([[-1, 2]]), "outside the pool"),
                                ([20], torch.tensor([[1, 2]], dtype=torch.int32), "int64"),
                                ([20, 20], table, "lens")):
        with pytest.raises(ValueError, match=match):
            bf16._decode_layers(0, h, tables, torch.tensor(lens))
        assert torch.equal(bf16._kv, before) and torch.equal(h, h_before)
    with pytest.raises(ValueError, match="h must be"):
        bf16._decode_layers(0, h[:, :64].contiguous(), table, torch.tensor([20]))
    # The engine keeps serving: a good row after the refusals decodes.
    logits = bf16.decode([DecodeRow("r", corpus_ids[20], 20, [1, 2])])
    assert logits.shape == (1, bf16.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.model
def test_projection_biases_and_a_single_kv_head_through_the_fused_pass():
    b = tiny_bf16_backend(128, 2, 64, 1024)
    if b._decode_layers is None:
        pytest.skip("no packed bf16 kernel on this CPU")
    for layer in b._layers:  # biases on every projection, as Qwen2's q/k/v have
        for p in layer.packed:
            p.bias = torch.randn(p.out_features) * 0.1
    b._decode_layers = native_decode.DecodeLayers(
        b._native, b._layers, n_heads=b.num_heads, kv_heads=b.num_kv_heads,
        head_dim=b.head_dim, scale=b.scale, cos=b._cos, sin=b._sin)
    b.allocate_kv_pool(16, 16)
    chunks = [PrefillChunk("r", list(range(5, 45)), 0, [0, 1, 2]),
              PrefillChunk("s", list(range(50, 60)), 0, [3])]
    b.fused_prefill = False
    plain_prefill = b.prefill(chunks)
    b.fused_prefill = True
    torch.testing.assert_close(b.prefill(chunks), plain_prefill, atol=0.05, rtol=0.02)
    kv0 = b._kv.clone()
    rows = [DecodeRow("r", 7, 40, [0, 1, 2])]
    fused = b.decode(rows)
    b._kv.copy_(kv0)
    b.fused_decode = False
    plain = b.decode(rows)
    torch.testing.assert_close(fused, plain, atol=0.05, rtol=0.02)


def test_models_the_fused_pass_does_not_take_keep_the_pytorch_pass():
    bf16_proj = type("Packed", (), {"packed": torch.empty(0)})()
    q4_proj = type("Quant", (), {"kind": "q4_1"})()

    class Layer:
        packed, q_norm, k_norm = (bf16_proj,) * 4, None, None

    class Q4Layer(Layer):
        packed = (q4_proj,) * 4

    lib = type("Lib", (), {"bf16_packed_matmul_available": staticmethod(lambda: 1)})()
    no_bf16 = type("Lib", (), {"bf16_packed_matmul_available": staticmethod(lambda: 0)})()
    silu = torch.nn.functional.silu
    assert native_decode.supported(lib, torch.bfloat16, [Layer()], silu, 64)
    assert native_decode.supported(no_bf16, torch.float32, [Q4Layer()], silu, 64)
    qk_norm = type("QKNorm", (Layer,), {"q_norm": (torch.ones(64), 1e-6)})()
    plain = type("Plain", (Layer,), {"packed": None})()
    q8 = type("Q8", (Layer,), {"packed": (type("Q", (), {"kind": "q8_0"})(),) * 4})()
    for args in ((None, torch.bfloat16, [Layer()], silu, 64),
                 (no_bf16, torch.bfloat16, [Layer()], silu, 64),
                 (lib, torch.float32, [Layer()], silu, 64),
                 (lib, torch.bfloat16, [Q4Layer()], silu, 64),
                 (lib, torch.float32, [q8], silu, 64),
                 (lib, torch.bfloat16, [qk_norm], silu, 64),
                 (lib, torch.bfloat16, [Layer(), plain], silu, 64),
                 (lib, torch.bfloat16, [Layer()], torch.nn.functional.gelu, 64),
                 (lib, torch.bfloat16, [Layer()], silu, 63),
                 (lib, torch.bfloat16, [], silu, 64)):
        assert not native_decode.supported(*args)


@pytest.mark.model
def test_q4_1_decode_passes_through_one_call_per_layer_match_the_layer_by_layer_pass(corpus_ids):
    from inference.engine.model_store import default_gguf_path

    q4 = TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                             quantization="q4_1",
                                             quantized_weights=default_gguf_path())
    # With AVX512-BF16 a pass of more rows than the Q4_1 products take (8) stays one call a
    # layer, over the values packed in bf16; elsewhere it is the PyTorch pass's.
    hybrid = native_gemm.packed_matmul_available(q4._native)
    # With AVX-512 VNNI every pass takes the x16 products over the blocks.
    x16 = q4._layers[0].packed[0].x16 is not None
    assert x16 == native_quant.x16_available(q4._native)
    assert q4._decode_layers is not None
    assert q4._decode_layers.max_rows == (sys.maxsize if hybrid or x16 else 8)
    fused_logits, fused_kv = decode_run(q4, corpus_ids, fused=True)
    torch_logits, torch_kv = decode_run(q4, corpus_ids, fused=False)
    # fp32 throughout: the same int8 codes but where a norm's order of sums moves a value
    # across a code's rounding boundary.
    assert (fused_kv[0] - torch_kv[0]).abs().max() < 0.05
    diff = (fused_logits - torch_logits).abs()
    stats = f"max {diff.max().item():.3f}, mean {diff.mean().item():.3f}"
    assert diff.max().item() < PLAIN_MAX_ABS and diff.mean().item() < PLAIN_MEAN_ABS, stats
    assert_argmax_agrees_except_near_ties(torch_logits, fused_logits, "q4_1 fused vs per layer")
    # More rows than the Q4_1 products take alone (8): the x16 products (AVX-512 VNNI), else the
    # packed bf16 products, in the fused call where they run, the same as the PyTorch pass's.
    rows = [DecodeRow(f"r{r}", corpus_ids[r], 0, [r]) for r in range(12)]
    calls = []
    real = native_decode.DecodeLayers.__call__
    native_decode.DecodeLayers.__call__ = lambda self, *a: calls.append(a) or real(self, *a)
    try:
        q4.allocate_kv_pool(40, 16)
        wide = q4.decode(rows)
        q4.decode(rows[:8])
    finally:
        native_decode.DecodeLayers.__call__ = real
    assert len(calls) == len(q4._layers) * (2 if hybrid or x16 else 1)
    q4.fused_decode = False
    try:
        q4.allocate_kv_pool(40, 16)
        plain = q4.decode(rows)
    finally:
        q4.fused_decode = True
    diff = (wide - plain).abs()
    stats = f"max {diff.max().item():.4f}, mean {diff.mean().item():.5f}"
    assert diff.max().item() < PLAIN_MAX_ABS and diff.mean().item() < PLAIN_MEAN_ABS, stats
    assert_argmax_agrees_except_near_ties(plain, wide, "q4_1 12 rows fused vs per layer")


# ----------------------------------------------------------------- passes with prompt chunks


def chunked_run(b: TransformersBackend, corpus_ids: list[int], *, fused: bool
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits of three passes (prompt chunks of four rows at offsets, then a mixed pass of a
    chunk and two decode rows), the KV pool afterwards, and how many layers ran one call each."""
    b.allocate_kv_pool(130, 16)
    tables = {r: list(range(1 + 25 * r, 26 + 25 * r)) for r in range(4)}
    calls = 0
    run_pass = b._decode_layers.run_pass

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return run_pass(*args, **kwargs)

    def chunk(r: int, start: int, end: int) -> PrefillChunk:
        return PrefillChunk(f"r{r}", corpus_ids[r * 60 + start:r * 60 + end], start, tables[r])

    b._decode_layers.run_pass = counted
    b.fused_prefill = fused
    try:
        out = [b.prefill([chunk(0, 0, 100), chunk(1, 0, 37), chunk(2, 0, 200)]),
               b.prefill([chunk(0, 100, 180), chunk(2, 200, 301), chunk(3, 0, 1)]),
               b.prefill_and_decode(
                   [chunk(1, 37, 90)],
                   [DecodeRow("r0", corpus_ids[180], 180, tables[0]),
                    DecodeRow("r2", corpus_ids[120 + 301], 301, tables[2])])]
    finally:
        b.fused_prefill = True
        del b._decode_layers.run_pass
    assert b._kv is not None
    return torch.cat(out), b._kv.clone(), calls


@pytest.mark.model
def test_prompt_chunks_and_mixed_passes_through_one_call_per_layer_match_the_pytorch_pass(
        bf16, corpus_ids):
    if not bf16._prefill_kernel_runs:
        pytest.skip("the native prefill attention kernel does not run here (AMX takes PyTorch's)")
    fused_logits, fused_kv, calls = chunked_run(bf16, corpus_ids, fused=True)
    torch_logits, torch_kv, none = chunked_run(bf16, corpus_ids, fused=False)
    assert calls == 3 * len(bf16._layers) and none == 0
    assert fused_logits.shape == (9, bf16.vocab_size)
    assert_same_as_the_pytorch_pass(fused_logits, fused_kv, torch_logits, torch_kv, "prefill")


@pytest.mark.model
def test_a_pass_with_a_slot_or_position_out_of_range_is_refused_before_anything_is_written(
        bf16, corpus_ids):
    if not bf16._prefill_kernel_runs:
        pytest.skip("the native prefill attention kernel does not run here")
    bf16.allocate_kv_pool(8, 16)
    assert bf16._kv is not None
    before = bf16._kv.clone()
    with pytest.raises(ValueError, match="outside the pool"):
        bf16.prefill([PrefillChunk("r", corpus_ids[:20], 0, [1, 99])])
    assert torch.equal(bf16._kv, before)
    layers = bf16._decode_layers
    hidden = bf16._layers[0].ln1_w.shape[0]
    h = torch.randn(2, hidden).bfloat16()
    h_before = h.clone()
    prefill = (torch.tensor([[1]]), torch.tensor([0, 2]), torch.tensor([0]))
    for positions, slots, match in (([0, 1], [16, 8 * 16], "outside the pool"),
                                    ([0, bf16.max_model_len], [16, 17], "rotary"),
                                    ([-1, 0], [16, 17], "rotary")):
        described = layers.begin_pass(torch.tensor(positions), torch.tensor(slots), prefill, None)
        with pytest.raises(ValueError, match=match):
            layers.run_pass(0, h, described)
        assert torch.equal(bf16._kv, before) and torch.equal(h, h_before)
    described = layers.begin_pass(torch.tensor([0, 1]), torch.tensor([16, 17]), prefill, None)
    with pytest.raises(ValueError, match="h must be"):
        layers.run_pass(0, h[:1].contiguous(), described)
    with pytest.raises(ValueError, match="int64"):
        layers.begin_pass(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([16, 17]),
                          prefill, None)
    # The engine keeps serving: a good chunk after the refusals.
    logits = bf16.prefill([PrefillChunk("r", corpus_ids[:20], 0, [1, 2])])
    assert logits.shape == (1, bf16.vocab_size) and torch.isfinite(logits).all()


def steps_run(b: TransformersBackend, corpus_ids: list[int], *,
              native: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`chunked_run` through the layer loop (no one-call-per-layer pass), its elementwise
    steps native (``native_steps``) or in PyTorch; also how many native RMSNorms ran."""
    calls = 0
    lib = b._native
    norm = lib.bf16_add_rms_norm

    def counted(*args):
        nonlocal calls
        calls += 1
        return norm(*args)

    b.native_steps = native
    b.fused_prefill = False
    lib.bf16_add_rms_norm = counted
    try:
        logits, kv, _ = chunked_run(b, corpus_ids, fused=False)
    finally:
        lib.bf16_add_rms_norm = norm
        b.native_steps = True
    return logits, kv, calls


@pytest.mark.model
def test_passes_through_the_layer_loop_take_native_elementwise_steps_with_the_same_results(
        bf16, corpus_ids):
    # Where the products run on PyTorch (AMX), a pass with prompt chunks keeps the layer loop;
    # its norms, rotary embedding, K/V writes and gating run natively, and give what the
    # PyTorch operations give.
    native_logits, native_kv, calls = steps_run(bf16, corpus_ids, native=True)
    torch_logits, torch_kv, none = steps_run(bf16, corpus_ids, native=False)
    assert calls == 3 * 2 * len(bf16._layers) and none == 0
    assert_same_as_the_pytorch_pass(native_logits, native_kv, torch_logits, torch_kv,
                                     "layer loop")


@pytest.mark.model
def test_a_native_rotary_step_with_a_position_or_slot_out_of_range_writes_nothing(bf16):
    from inference.engine.backends.native import elementwise as native_elementwise

    bf16.allocate_kv_pool(4, 16)
    assert bf16._kv is not None
    pool = bf16._kv[0]
    before = pool.clone()
    steps = native_elementwise.Elementwise(bf16._native, bf16._cos, bf16._sin, 2)
    heads, kv_heads, dim = bf16.num_heads, bf16.num_kv_heads, bf16.head_dim
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim).bfloat16()
    qkv_before = qkv.clone()
    for positions, slots in (([0, 1], [3, 4 * 16]), ([0, 1], [-1, 3]),
                             ([0, bf16.max_model_len], [3, 4]), ([-1, 0], [3, 4])):
        with pytest.raises(ValueError, match="rotary tables or a slot outside the pool"):
            steps.rope_kv_write(qkv, torch.tensor(positions), torch.tensor(slots), pool, heads,
                                kv_heads, dim)
        assert torch.equal(pool, before) and torch.equal(qkv, qkv_before)
    q = steps.rope_kv_write(qkv, torch.tensor([0, 5]), torch.tensor([3, 4]), pool, heads,
                            kv_heads, dim)
    # Position 0 rotates nothing: its queries and keys are the projection's.
    assert torch.equal(q[0].flatten(), qkv_before[0, :heads * dim])
    assert torch.equal(pool[:kv_heads, 0, 3].flatten(),
                       qkv_before[0, heads * dim:(heads + kv_heads) * dim])
    assert torch.equal(pool[kv_heads:, 0, 4].flatten(), qkv_before[1, (heads + kv_heads) * dim:])
