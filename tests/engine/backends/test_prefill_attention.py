"""The native prefill attention kernel (:mod:`inference.engine.backends.native.prefill`): its output
against fp32 attention over the same bf16 K/V scattered through a paged pool, rows at any offset
and of any length; what it refuses; and a bf16 model's logits with it against the gather path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.engine.backends import native
from inference.engine.backends.hf import TransformersBackend
from inference.engine.backends.native import gemm
from inference.engine.backends.native import prefill as kernel
from inference.engine.model_store import resolve_model_path
from tests.engine.backends.test_bf16 import (
    assert_argmax_agrees_except_near_ties,
    teacher_forced_logits,
)
from tests.engine.backends.test_bf16_gemm import HAS_COMPILER, NATIVE_BF16

# Against fp32 attention over the same bf16 q, K and V: the kernel rounds the softmax weights and
# the output to bf16. Measured over the cases below: largest |difference| 0.0078 on outputs of
# magnitude up to about 1.
MAX_ABS = 0.03
# The same bf16 model with the kernel and with the gather path (scaled_dot_product_attention
# over gathered K/V), 4 rows of real text through chunked prefill and 16 decode steps.
# Measured on the default model: largest |logit difference| 0.54, mean 0.088.
LOGIT_MAX_ABS = 1.5
LOGIT_MEAN_ABS = 0.2


@pytest.fixture(scope="module")
def lib():
    if not HAS_COMPILER:
        pytest.skip("no C compiler on this machine: the backend uses its gather path")
    loaded = native.load()
    assert loaded is not None, "a C compiler is present but the kernels did not build"
    if not kernel.supported(loaded, torch.bfloat16, 64, 3):
        assert not NATIVE_BF16, "this CPU has AVX512-BF16 but the kernel does not run"
        pytest.skip("this CPU has no AVX512-BF16: the prefill kernel is not built for it")
    return loaded


def paged_case(rows: list[tuple[int, int]], kv_heads: int, group: int, seed: int,
               block: int = 16):
    """A pool with each row's K/V in scattered blocks, and the kernel's inputs for ``rows``
    (``(position of the first new token, new tokens)`` each)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(start + n) // block) for start, n in rows]
    num_blocks = sum(need) + 3
    pool = torch.randn(2 * kv_heads, num_blocks, block, 64, generator=gen).bfloat16()
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n])
        used += n
    width = max(need)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    offsets = [0]
    for _, n in rows:
        offsets.append(offsets[-1] + n)
    q = torch.randn(offsets[-1], kv_heads, group, 64, generator=gen).bfloat16()
    return (q, pool, table_t, torch.tensor(offsets, dtype=torch.int64),
            torch.tensor([s for s, _ in rows], dtype=torch.int64), tables)


def reference(q, pool, tables, offsets, rows, kv_heads, group, block=16):
    """fp32 causal attention of each row's new tokens over its K/V, ``[tokens, KV, G, 64]``."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for r, (start, n) in enumerate(rows):
        ctx = start + n
        blocks = torch.tensor(tables[r])
        k = pool[:kv_heads, blocks].reshape(kv_heads, -1, 64)[:, :ctx].float()
        v = pool[kv_heads:, blocks].reshape(kv_heads, -1, 64)[:, :ctx].float()
        qr = q[offsets[r]:offsets[r + 1]].float().permute(1, 2, 0, 3)  # [KV, G, n, 64]
        mask = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(
            qr, k[:, None].expand(kv_heads, group, ctx, 64),
            v[:, None].expand(kv_heads, group, ctx, 64), attn_mask=mask, scale=0.125)
        out[offsets[r]:offsets[r + 1]] = o.permute(2, 0, 1, 3)
    return out


@pytest.mark.parametrize("rows, kv_heads, group", [
    ([(0, 1)], 3, 3),
    ([(0, 7)], 3, 3),
    ([(0, 64)], 1, 1),
    ([(5, 9)], 2, 8),
    ([(63, 2), (64, 1), (65, 70)], 3, 3),
    ([(100, 1), (0, 33), (500, 64), (17, 200)], 3, 3),
    ([(1000, 130)], 1, 4),
    ([(0, 300)], 3, 24),
])
def test_the_kernel_is_causal_attention_over_the_rows_own_blocks(lib, rows, kv_heads, group):
    q, pool, tables, offsets, starts, lists = paged_case(rows, kv_heads, group, len(rows) + group)
    got = kernel.prefill_attention(lib, q, pool, tables, offsets, starts, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    ref = reference(q, pool, lists, offsets.tolist(), rows, kv_heads, group)
    assert (got.float() - ref).abs().max().item() < MAX_ABS


@pytest.mark.parametrize("block", [1, 8, 32, 48])
def test_the_kernel_reads_blocks_of_any_size(lib, block):
    # The keys of one 64-key chunk span several blocks (or part of one), each found by its row's
    # table: contexts that end inside a chunk and inside a block.
    rows = [(70, 5), (0, 129), (190, 3)]
    q, pool, tables, offsets, starts, lists = paged_case(rows, 3, 3, block, block=block)
    got = kernel.prefill_attention(lib, q, pool, tables, offsets, starts, 0.125)
    ref = reference(q, pool, lists, offsets.tolist(), rows, 3, 3, block=block)
    assert (got.float() - ref).abs().max().item() < MAX_ABS


def test_rows_and_block_ids_outside_the_pool_are_refused(lib):
    q, pool, tables, offsets, starts, _ = paged_case([(10, 6)], 3, 3, 1)
    with pytest.raises(ValueError, match="past its block table"):  # 20 + 6 > one block's 16
        kernel.prefill_attention(lib, q, pool, tables[:, :1], offsets, starts + 10, 0.125)
    bad = tables.clone()
    bad[0, 0] = pool.shape[1]
    with pytest.raises(ValueError, match="outside the pool"):
        kernel.prefill_attention(lib, q, pool, bad, offsets, starts, 0.125)
    with pytest.raises(ValueError, match="no new tokens"):
        kernel.prefill_attention(lib, q, pool, torch.cat([tables, tables]),
                                 torch.tensor([0, 0, 6]), torch.tensor([0, 0]), 0.125)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "q": a["q"].float()}, "q must be"),
    (lambda a: {**a, "q": a["q"].transpose(1, 2)}, "q must be"),
    (lambda a: {**a, "pool": a["pool"][:2]}, "shapes do not match"),
    (lambda a: {**a, "tables": a["tables"].int()}, "tables must be"),
    (lambda a: {**a, "token_start": torch.tensor([0, 5])}, "shapes do not match"),
    (lambda a: {**a, "pos_start": torch.tensor([0, 0])}, "shapes do not match"),
])
def test_tensors_of_the_wrong_kind_are_refused(lib, change, message):
    q, pool, tables, offsets, starts, _ = paged_case([(3, 6)], 3, 3, 2)
    args = change({"q": q, "pool": pool, "tables": tables, "token_start": offsets,
                   "pos_start": starts})
    with pytest.raises(ValueError, match=message):
        kernel.prefill_attention(lib, scale=0.125, **args)


def test_the_kernel_runs_only_where_it_can():
    lib = native.load() if HAS_COMPILER else None
    assert not kernel.supported(None, torch.bfloat16, 64, 3)
    assert not kernel.supported(lib, torch.float32, 64, 3)
    assert not kernel.supported(lib, torch.bfloat16, 128, 3)
    assert not kernel.supported(lib, torch.bfloat16, 64, 25)
    assert kernel.supported(lib, torch.bfloat16, 64, 3) is gemm.packed_matmul_available(lib)


@pytest.fixture(scope="module")
def bf16() -> TransformersBackend:
    return TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                               dtype="bfloat16")


@pytest.mark.model
@pytest.mark.slow
def test_bf16_logits_alike_with_the_prefill_kernel_and_with_gathers(lib, bf16, corpus_ids):
    assert bf16.native_prefill_attention
    try:
        with_kernel = teacher_forced_logits(bf16, corpus_ids)
        bf16.native_prefill_attention = False
        gathered = teacher_forced_logits(bf16, corpus_ids)
    finally:
        bf16.native_prefill_attention = True
    diff = (with_kernel - gathered).abs()
    stats = f"max {diff.max().item():.3f}, mean {diff.mean().item():.3f}"
    print(stats)
    assert diff.max().item() < LOGIT_MAX_ABS, stats
    assert diff.mean().item() < LOGIT_MEAN_ABS, stats
    assert_argmax_agrees_except_near_ties(gathered, with_kernel, "prefill kernel vs gathers")
