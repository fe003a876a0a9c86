"""The native paged decode-attention kernel: its math against the gather path (fp32) and against
fp32 attention over the same bf16 values (bf16), its errors, and the backend's fallback where it
cannot be built."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from inference.engine.backends import native
from inference.engine.backends.base import DecodeRow, PrefillChunk

REPO = Path(__file__).resolve().parents[2]
HAS_COMPILER = any(shutil.which(cc) for cc in ("cc", "gcc"))


@pytest.fixture(scope="module")
def lib():
    if not HAS_COMPILER:
        pytest.skip("no C compiler on this machine: the backend uses its gather path")
    loaded = native.load()
    assert loaded is not None, "a C compiler is present but the kernel did not build"
    return loaded


def reference(q, pool, tables, lens, scale):
    """Gather each row's K/V by block table and run scaled_dot_product_attention row by row."""
    rows, kv_heads, group, dim = q.shape
    block = pool.shape[2]
    out = torch.empty_like(q)
    for r in range(rows):
        n = int(lens[r])
        blocks = tables[r, : -(-n // block)]
        kv = pool[:, blocks].reshape(2 * kv_heads, -1, dim)[:, :n]  # [2 KV, n, D]
        k = kv[:kv_heads].repeat_interleave(group, 0)
        v = kv[kv_heads:].repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(q[r].reshape(kv_heads * group, 1, dim), k, v,
                                           scale=scale)
        out[r] = o.reshape(kv_heads, group, dim)
    return out


SHAPES = [(3, 3, 64, 16), (2, 4, 128, 32), (4, 1, 32, 1), (1, 8, 64, 16)]


def scattered_case(kv_heads, group, dim, block, dtype=torch.float32):
    """q, pool, tables, lens and scale of rows of 1 token, a block boundary, one past it, and
    longer rows, their blocks out of order and not contiguous."""
    rng = random.Random(kv_heads * 100 + group)
    torch.manual_seed(kv_heads * 100 + group)
    lens = [1, block, block + 1, 3 * block, 700, rng.randint(2, 300), rng.randint(2, 300)]
    need = [-(-n // block) for n in lens]
    num_blocks = sum(need) + 5
    pool = torch.randn(2 * kv_heads, num_blocks, block, dim).to(dtype)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(need)
    tables, used = [], 0
    for n in need:
        tables.append(ids[used:used + n] + [0] * (width - n))
        used += n
    q = torch.randn(len(lens), kv_heads, group, dim).to(dtype)
    return q, pool, torch.tensor(tables), torch.tensor(lens), dim ** -0.5


@pytest.mark.parametrize("kv_heads, group, dim, block", SHAPES)
def test_kernel_equals_gathered_attention_over_scattered_blocks(lib, kv_heads, group, dim, block):
    q, pool, tables, lens, scale = scattered_case(kv_heads, group, dim, block)
    got = native.paged_decode_attention(lib, q, pool, tables, lens, scale)
    torch.testing.assert_close(got, reference(q, pool, tables, lens, scale),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads, group, dim, block", SHAPES)
def test_bf16_kernel_is_the_fp32_result_rounded_once_to_bf16(lib, kv_heads, group, dim, block):
    # Reference: the same bf16 q and pool, widened to fp32, attention in fp32.
    q, pool, tables, lens, scale = scattered_case(kv_heads, group, dim, block, torch.bfloat16)
    got = native.paged_decode_attention(lib, q, pool, tables, lens, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    ref = reference(q.float(), pool.float(), tables, lens, scale)
    # Within half a bf16 step (2**-8 relative) of the fp32 result, plus fp32 summation-order
    # noise; measured: max relative error 0.00386, 99.96 % to 100 % of the outputs equal to the
    # fp32 result rounded to bf16, the others one bf16 step away (fp32 results on a midpoint).
    err = (got.float() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-5).all(), f"max error {err.max().item():.2e}"
    assert (got == ref.bfloat16()).float().mean().item() > 0.995


@pytest.mark.parametrize("kv_heads, group, dim, block", SHAPES)
def test_fp32_queries_over_a_bf16_pool_attend_to_the_pools_values_in_fp32(lib, kv_heads, group,
                                                                       dim, block):
    # A Q4_1 model's KV cache in bf16: its fp32 queries over the bf16 K/V, widened exactly, give
    # the fp32 attention over those values, in fp32 (no rounding of the output).
    q, pool, tables, lens, scale = scattered_case(kv_heads, group, dim, block)
    low = pool.bfloat16()
    got = native.paged_decode_attention(lib, q, low, tables, lens, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, reference(q, low.float(), tables, lens, scale),
                               atol=1e-5, rtol=1e-5)
    # Split over the threads (one short row) too.
    q1, pool1, tables1, lens1, scale1 = few_rows_case([1500], kv_heads, group, dim, block)
    got = native.paged_decode_attention(lib, q1, pool1.bfloat16(), tables1, lens1, scale1)
    torch.testing.assert_close(got, reference(q1, pool1.bfloat16().float(), tables1, lens1,
                                              scale1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no kernel"):
        native.paged_decode_attention(lib, q.bfloat16(), pool, tables, lens, scale)


def few_rows_case(lens, kv_heads, group, dim, block, dtype=torch.float32):
    """q, pool, tables, lens and scale of the rows ``lens``, their blocks shuffled."""
    torch.manual_seed(sum(lens) + kv_heads)
    need = [-(-n // block) for n in lens]
    pool = torch.randn(2 * kv_heads, sum(need) + 3, block, dim).to(dtype)
    ids = torch.randperm(pool.shape[1]).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(ids[used:used + n] + [0] * (max(need) - n))
        used += n
    q = torch.randn(len(lens), kv_heads, group, dim).to(dtype)
    return q, pool, torch.tensor(tables), torch.tensor(lens), dim ** -0.5


# Rows too few to keep the threads busy: each row's context is split into parts merged at the
# end. Long rows of many parts, a row shorter than one part beside a long one (its other parts
# empty), lengths on and beside a block boundary, one token.
FEW_ROWS = [([2000], 1, 3, 64, 16), ([1, 700], 1, 3, 64, 16), ([1031], 3, 3, 64, 16),
            ([64, 65, 63], 1, 4, 32, 16), ([1], 1, 1, 64, 16), ([4096], 2, 2, 128, 32)]


@pytest.mark.parametrize("lens, kv_heads, group, dim, block", FEW_ROWS)
def test_a_few_rows_split_over_the_threads_give_the_same_attention(lib, lens, kv_heads, group,
                                                                  dim, block):
    q, pool, tables, lens, scale = few_rows_case(lens, kv_heads, group, dim, block)
    got = native.paged_decode_attention(lib, q, pool, tables, lens, scale)
    torch.testing.assert_close(got, reference(q, pool, tables, lens, scale),
                               atol=1e-5, rtol=1e-5)
    qb, poolb = q.bfloat16(), pool.bfloat16()
    got = native.paged_decode_attention(lib, qb, poolb, tables, lens, scale)
    ref = reference(qb.float(), poolb.float(), tables, lens, scale)
    err = (got.float() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-5).all(), f"max error {err.max().item():.2e}"


def test_kernel_refuses_lengths_and_block_ids_outside_the_pool(lib):
    pool = torch.zeros(2, 4, 16, 8)
    q = torch.zeros(1, 1, 1, 8)
    with pytest.raises(ValueError, match="beyond its block table"):
        native.paged_decode_attention(lib, q, pool, torch.tensor([[1]]), torch.tensor([17]), 1.0)
    with pytest.raises(ValueError, match="below 1"):
        native.paged_decode_attention(lib, q, pool, torch.tensor([[1]]), torch.tensor([0]), 1.0)
    with pytest.raises(ValueError, match="outside the pool"):
        native.paged_decode_attention(lib, q, pool, torch.tensor([[4]]), torch.tensor([3]), 1.0)


def ragged_decode_logits(backend, corpus_ids):
    backend.allocate_kv_pool(96, 16)
    prompts = {"a": corpus_ids[:5], "b": corpus_ids[100:148], "c": corpus_ids[300:333],
               "d": corpus_ids[400:900]}
    tables = {"a": [3], "b": [10, 11, 12, 13], "c": [20, 5, 21], "d": list(range(60, 92))}
    backend.prefill([PrefillChunk(r, ids, 0, tables[r]) for r, ids in prompts.items()])
    rows = [DecodeRow(r, 42 + i, len(ids), tables[r]) for i, (r, ids) in enumerate(prompts.items())]
    return backend.decode(rows)


@pytest.mark.model
@pytest.mark.slow
def test_backend_decodes_alike_with_the_kernel_and_with_gathers(backend, corpus_ids, lib):
    try:
        backend.native_attention = True
        with_kernel = ragged_decode_logits(backend, corpus_ids)
        backend.native_attention = False
        gathered = ragged_decode_logits(backend, corpus_ids)
    finally:
        backend.native_attention = True
    torch.testing.assert_close(with_kernel, gathered, atol=1e-3, rtol=0)
    assert torch.equal(with_kernel.argmax(-1), gathered.argmax(-1))


@pytest.mark.model
@pytest.mark.slow
def test_without_a_compiler_the_backend_falls_back_to_gathers(backend, corpus_ids, tmp_path,
                                                               monkeypatch):
    expected = ragged_decode_logits(backend, corpus_ids)
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    monkeypatch.setattr(native, "_loaded", {})
    saved, saved_dir = backend._native, backend._kernel_dir
    try:
        backend._native, backend.native_attention = None, True
        backend._kernel_dir = str(tmp_path)
        logits = ragged_decode_logits(backend, corpus_ids)
        assert backend.native_attention is False  # switched itself off
    finally:
        backend._native, backend.native_attention = saved, saved is not False
        backend._kernel_dir = saved_dir
    assert list(tmp_path.iterdir()) == []
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)


def test_kernel_refuses_tensors_of_the_wrong_kind(lib):
    pool = torch.zeros(2, 4, 16, 8)
    q = torch.zeros(1, 1, 1, 8)
    tables, lens = torch.tensor([[1]]), torch.tensor([3])
    with pytest.raises(ValueError, match="q must be a contiguous 4-d torch.float32"):
        native.paged_decode_attention(lib, q.double(), pool, tables, lens, 1.0)
    with pytest.raises(ValueError, match="tables must be"):
        native.paged_decode_attention(lib, q, pool, tables.int(), lens, 1.0)
    with pytest.raises(ValueError, match="pool must be"):
        native.paged_decode_attention(lib, q, pool.transpose(2, 3), tables, lens, 1.0)
    with pytest.raises(ValueError, match="shapes do not match"):
        native.paged_decode_attention(lib, torch.zeros(1, 2, 1, 8), pool, tables, lens, 1.0)
    with pytest.raises(ValueError, match="q must be a contiguous 4-d torch.float32 or "
                                         "torch.bfloat16"):
        native.paged_decode_attention(lib, q.half(), pool.half(), tables, lens, 1.0)


def test_kernel_refuses_bf16_queries_over_an_fp32_pool(lib):
    pool = torch.zeros(2, 4, 16, 8)
    q = torch.zeros(1, 1, 1, 8)
    tables, lens = torch.tensor([[1]]), torch.tensor([3])
    with pytest.raises(ValueError, match="no kernel for q torch.bfloat16 over a pool "
                                         "torch.float32"):
        native.paged_decode_attention(lib, q.bfloat16(), pool, tables, lens, 1.0)
    # The bf16 kernel checks lengths and block ids as the fp32 one does.
    with pytest.raises(ValueError, match="outside the pool"):
        native.paged_decode_attention(lib, q.bfloat16(), pool.bfloat16(), torch.tensor([[4]]),
                                      lens, 1.0)


@pytest.mark.process
def test_a_damaged_cached_kernel_is_rebuilt(tmp_path):
    if not HAS_COMPILER:
        pytest.skip("no C compiler on this machine")
    # Each load in a process of its own: a process that loaded a library keeps using its mapping.
    load = [sys.executable, "-c", "import sys; from inference.engine.backends import native; "
            "raise SystemExit(0 if native.load(sys.argv[1]) is not None else 3)", str(tmp_path)]
    env = dict(os.environ)
    subprocess.run(load, env=env, cwd=REPO, check=True, timeout=120)
    (built,) = tmp_path.glob("*.so")
    assert built.stat().st_mode & 0o755 == 0o755  # other users of a shared cache can load it
    good = built.read_bytes()
    # Truncated (mapping such a file kills the process with SIGBUS), then not a library at all.
    for damaged in (good[: len(good) // 2], b"not a shared library"):
        built.write_bytes(damaged)
        done = subprocess.run(load, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert "rebuilding it" in done.stderr
        assert built.read_bytes()[:4] == b"\x7fELF"


def test_loading_the_kernel_leaves_subnormal_floats_alone(lib):
    # -ffast-math's start-up code would set flush-to-zero for the whole process.
    assert (torch.tensor([1e-39]) * 1).item() != 0.0


def test_a_compiler_that_writes_garbage_leaves_no_cache_entry(tmp_path, monkeypatch):
    fake = tmp_path / "fakecc"
    # Answers --version, and "builds" by writing a file that is not a library.
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo fake 1.0; exit 0; }\n'
                    'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo garbage > "$2"; shift; done\n')
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load(cache) is None
    assert list(cache.iterdir()) == []


# -- the bf16 LM head kernel -------------------------------------------------------------------


@pytest.mark.parametrize("rows, in_features, with_bias", [
    (0, 576, False), (1, 576, True), (5, 576, False), (64, 576, True), (3, 70, True)])
def test_the_bf16_weight_matmul_is_the_fp32_product_of_the_widened_weight(lib, rows, in_features,
                                                                         with_bias):
    # 70 inputs: not a multiple of 32, the widening path even where VDPBF16PS is used.
    g = torch.Generator().manual_seed(rows + in_features)
    weight = (torch.randn(1000, in_features, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=g) * 3
    bias = torch.randn(1000, generator=g) if with_bias else None
    out = native.bf16_weight_matmul(lib, x, weight, bias)
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == torch.float32 and out.shape == (rows, 1000)
    # fp32 summation noise plus, on VDPBF16PS, x carried in 16 significant bits (2^-17).
    scale = F.linear(x.abs().double(), weight.abs().double()).clamp_min(1.0)
    relative = (out.double() - ref).abs() / scale
    assert rows == 0 or relative.max().item() < 2e-5


@pytest.mark.parametrize("x, weight, message", [
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16), "x must"),
    (torch.zeros(2, 8), torch.zeros(4, 8), "weight must"),
    (torch.zeros(2, 8), torch.zeros(4, 9, dtype=torch.bfloat16), "shapes do not match"),
    (torch.zeros(8, 2).t(), torch.zeros(4, 8, dtype=torch.bfloat16), "x must"),
])
def test_the_bf16_weight_matmul_refuses_what_it_cannot_read(lib, x, weight, message):
    with pytest.raises(ValueError, match=message):
        native.bf16_weight_matmul(lib, x, weight)
