"""Batch building: the index tensors of one forward pass over rows of a paged KV pool.

:func:`_make_batch` packs the rows' new tokens and positions, the pool slots their K/V are written
to, and what attention reads: per group of similar-length rows (:func:`_attention_groups`, a
dynamic programme over the rows sorted by length) the gather index and mask of a
:class:`_AttnGroup`, or the block tables and lengths the native kernel reads. All of it comes back
as one :class:`_Batch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _AttnGroup:
    """Rows ``[start, end)`` of a pass whose K/V are gathered to one length ``L`` (whole blocks)."""

    start: int
    end: int
    gather_index: torch.Tensor  # [2 KV * rows * nb] rows of the layer's [2 KV * blocks, bs * D]
    mask: torch.Tensor  # [1, rows, G * T, L] bool, True = attend
    ctx_len: int
    # One row whose T new tokens start its context (no earlier keys, no query padding): the mask
    # is plain causal, so attention may take ``is_causal`` instead of reading it.
    causal: bool = False
    # ``mask`` as the additive mask (0 or -inf) in the queries' dtype, made on the first layer's
    # use: from a bool mask scaled_dot_product_attention makes it again in every layer (about a
    # tenth of a bf16 256-token chunk's pass at an offset on a 2-core Xeon with AMX)
    additive: torch.Tensor | None = None

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as ``[1, rows, G * T, L]`` 0 (attend) or -inf in ``dtype``, made once."""
        if self.additive is None or self.additive.dtype != dtype:
            self.additive = torch.zeros(self.mask.shape, dtype=dtype,
                                        device=self.mask.device).masked_fill_(
                                            ~self.mask, float("-inf"))
        return self.additive


@dataclass
class _AttnPart:
    """The attention of one run of rows of a pass: packed tokens ``[token_start, token_end)``.

    A pass has one part, or two in a mixed pass (prefill rows first, then decode rows). ``T`` is
    the most new tokens of any row of the part; attention runs per group of rows (see
    :func:`_attention_groups`), or through the native kernel from block tables.
    """

    token_start: int
    token_end: int
    rows: int
    max_new: int
    groups: list[_AttnGroup]
    tables: torch.Tensor | None  # [rows, max blocks] int64: decode through the native kernel
    lengths: torch.Tensor | None  # [rows] int64 tokens each row attends to (native kernel)
    pad_index: torch.Tensor | None  # [rows * T] part-packed index of each padded query
    unpad_index: torch.Tensor | None  # [tokens] padded index of each part-packed token
    # Prefill through the native kernel (no groups): [rows + 1] int64 offsets of each row's
    # tokens in the part, and [rows] int64 position of each row's first new token; ``tables``
    # holds the block tables.
    row_offsets: torch.Tensor | None = None
    row_positions: torch.Tensor | None = None


@dataclass
class _Batch:
    """Index tensors of one forward pass over ``R`` rows and ``N`` new tokens (packed)."""

    tokens: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N] absolute positions
    write_index: torch.Tensor  # [2 KV * N] rows of the layer's [2 KV * blocks * bs, D] view
    parts: list[_AttnPart]
    # [R + extra] packed index of each row's last new token, then of the other new tokens of
    # the rows that asked for every position's logits (in row, then position order)
    logit_index: torch.Tensor
    rows: int
    # Each LoRA adapter's tokens of the pass (inference.engine.lora), and each token's adapter
    # (None: the bare model); both empty when no row runs under one
    lora: list[Any] = field(default_factory=list)
    lora_tokens: list[Any] = field(default_factory=list)


# A further attention group costs about as much as gathering this many more K/V slots per row
# set (a gather and an attention call per layer, each ~20 us, against ~6 us of copying and
# reading per 100 slots), measured with the default model on a 2-core CPU.
GROUP_OVERHEAD_SLOTS = 256
MAX_ATTENTION_GROUPS = 4


def _attention_groups(blocks: Sequence[int], block_size: int,
                      max_groups: int = MAX_ATTENTION_GROUPS) -> list[tuple[int, int]]:
    """Split rows sorted by context length into at most ``max_groups`` runs.

    Each group's K/V are gathered to its longest row's length, so one group over rows of very
    different lengths copies and reads mostly padding. This picks the split that minimises
    ``sum(rows_in_group * longest_in_group) + GROUP_OVERHEAD_SLOTS * groups`` (dynamic
    programming over the sorted rows; ``O(K R^2)``).

    Args:
        blocks: KV blocks each row reads, ascending.
        block_size: tokens per block.
        max_groups: most groups (1: one group, as a prefill pass).

    Returns:
        ``[(start, end), ...]`` half-open row ranges covering ``range(len(blocks))`` in order.
    """
    n = len(blocks)
    inf = float("inf")
    # best[k][i]: cost of the first i rows in k groups; cut[k][i]: where the last group starts.
    max_groups = max(1, max_groups)
    best = [[inf] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0.0
    for k in range(1, max_groups + 1):
        for i in range(1, n + 1):
            width = blocks[i - 1] * block_size  # sorted: the group's last row is its longest
            for j in range(k - 1, i):
                cost = best[k - 1][j] + (i - j) * width + GROUP_OVERHEAD_SLOTS
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    k = min(range(1, max_groups + 1), key=lambda kk: best[kk][n])
    ranges: list[tuple[int, int]] = []
    end = n
    while k > 0:
        start = cut[k][end]
        ranges.append((start, end))
        end, k = start, k - 1
    return ranges[::-1]


# A further prefill part costs about as much as this many more (query, key) pairs of padded
# attention: a gather, an attention call and the output's reordering per layer.
PART_OVERHEAD_PAIRS = 4096


def _prefill_parts(new_tokens: Sequence[int], ctx_tokens: Sequence[int],
                   overhead: int = PART_OVERHEAD_PAIRS) -> list[tuple[int, int]]:
    """Split consecutive prefill rows into runs whose attention is gathered together.

    A run pads every row's queries to its most new tokens ``T`` and its keys to its longest
    context ``L``, so its attention computes ``rows * T * L`` (query, key) pairs: a deep chunk
    of a long prompt in one run with a new short prompt would give the short one the long one's
    context, and the long one the short one's tokens. This picks the split into runs of rows,
    in their order, that minimises ``sum(rows * T * L) + overhead * runs`` (dynamic programming
    over the rows, ``O(R^2)``).

    Args:
        new_tokens: each row's new tokens (``T`` of the row alone).
        ctx_tokens: each row's context after the pass (its keys, whole blocks).
        overhead: the cost of one more run, in (query, key) pairs.

    Returns:
        ``[(start, end), ...]`` half-open row ranges covering ``range(len(new_tokens))``.
    """
    n = len(new_tokens)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        t_max = l_max = 0
        for j in range(i - 1, -1, -1):  # the last run is rows [j, i)
            t_max, l_max = max(t_max, new_tokens[j]), max(l_max, ctx_tokens[j])
            cost = best[j] + (i - j) * t_max * l_max + overhead
            if cost < best[i]:
                best[i], cut[i] = cost, j
    ranges: list[tuple[int, int]] = []
    end = n
    while end > 0:
        ranges.append((cut[end], end))
        end = cut[end]
    return ranges[::-1]


def _make_batch(rows: list[tuple[list[int], int, Sequence[int]]], *, block_size: int,
                num_blocks: int, num_kv_heads: int, group: int, max_model_len: int,
                max_groups: int, device: torch.device, grouped: bool = False,
                native: bool = False, decode_from: int | None = None,
                all_logits: Sequence[bool] = (), native_prefill: bool = False) -> _Batch:
    """Index tensors for ``rows``.

    Rows ``[0, decode_from)`` are prefill rows: their attention is gathered per run of
    consecutive rows (:func:`_prefill_parts`; one part each), each query attending causally to
    its own row. Rows ``[decode_from, R)`` are decode rows (one new
    token each): ``native``, their attention is the native kernel's, read from block tables;
    ``grouped``, gathered per group of similar-length rows (the caller sorted them by length);
    else gathered in one group. ``decode_from`` None: every row is a prefill row unless all have
    one token and ``native`` or ``grouped`` is set (a decode pass).

    Args:
        rows: ``(new token ids, position of the first, block table)`` of each row.
        block_size, num_blocks: the KV pool's tokens per block and blocks per layer.
        num_kv_heads, group: KV heads, and query heads per KV head.
        max_model_len: the first position no row may reach.
        max_groups: most attention groups of a ``grouped`` decode part.
        device: where the index tensors go.
        all_logits: per row (rows past its length: False), whether the pass returns the logits
            of every new token of the row, not only of its last (``logit_index``).
        native_prefill: the prefill rows' attention is the native prefill kernel's, read from
            block tables (``_AttnPart.row_offsets``, ``row_positions``), not gathered.

    Raises:
        ValueError: for an empty row, a block table too short for its positions, or a
            position at or past ``max_model_len``.
    """
    bs = block_size
    if decode_from is None:
        decode_from = len(rows) if not (native or grouped) else 0
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    need_blocks: list[int] = []
    last: list[int] = []
    others: list[int] = []
    for r, (toks, start, table) in enumerate(rows):
        n = len(toks)
        end = start + n
        if n == 0:
            raise ValueError("empty prefill chunk")
        if end > max_model_len:
            raise ValueError(f"position {end - 1} is past max_model_len={max_model_len}")
        need = -(-end // bs)
        if len(table) < need:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
        tokens.extend(toks)
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        need_blocks.append(need)
        last.append(len(tokens) - 1)
        if r < len(all_logits) and all_logits[r]:
            others.extend(range(len(tokens) - n, len(tokens) - 1))
    dev = device
    heads = torch.arange(2 * num_kv_heads)[:, None]
    parts = []
    token_start = 0
    runs = [(0, decode_from, "prefill")]
    if decode_from > 1 and not native_prefill:  # gathered: similar rows share a run
        runs = [(r0, r1, "prefill") for r0, r1 in _prefill_parts(
            [len(rows[r][0]) for r in range(decode_from)],
            [need_blocks[r] * bs for r in range(decode_from)])]
    for r0, r1, kind in (*runs, (decode_from, len(rows), "decode")):
        if r1 <= r0:
            continue
        if kind == "decode" and any(len(rows[r][0]) != 1 for r in range(r0, r1)):
            raise ValueError("a decode row has more than one new token")
        token_end = token_start + sum(len(rows[r][0]) for r in range(r0, r1))
        parts.append(_make_part(
            rows[r0:r1], need_blocks[r0:r1], token_start, token_end, bs=bs,
            num_blocks=num_blocks, heads=heads, group=group, device=dev,
            native=native and kind == "decode",
            max_groups=max_groups if grouped and kind == "decode" else 1,
            native_prefill=native_prefill and kind == "prefill"))
        token_start = token_end
    write_index = heads * (num_blocks * bs) + torch.tensor(slots)[None, :]
    return _Batch(
        tokens=torch.tensor(tokens, device=dev),
        positions=torch.tensor(positions, device=dev),
        write_index=write_index.reshape(-1).to(dev),
        parts=parts,
        logit_index=torch.tensor(last + others, device=dev),
        rows=len(rows),
    )


def _make_part(rows: list[tuple[list[int], int, Sequence[int]]], need_blocks: list[int],
               token_start: int, token_end: int, *, bs: int, num_blocks: int,
               heads: torch.Tensor, group: int, device: torch.device, native: bool,
               max_groups: int, native_prefill: bool = False) -> _AttnPart:
    """The :class:`_AttnPart` of ``rows`` (checked by :func:`_make_batch`)."""
    num_rows = len(rows)
    max_new = max(len(t) for t, _, _ in rows)
    starts = [start for _, start, _ in rows]
    lengths = [start + len(t) for t, start, _ in rows]
    if native_prefill:
        width = max(need_blocks)
        offsets = [0]
        for toks, _, _ in rows:
            offsets.append(offsets[-1] + len(toks))
        return _AttnPart(
            token_start=token_start, token_end=token_end, rows=num_rows, max_new=max_new,
            groups=[], tables=_tables(rows, need_blocks, width), lengths=None, pad_index=None,
            unpad_index=None, row_offsets=torch.tensor(offsets, dtype=torch.int64),
            row_positions=torch.tensor(starts, dtype=torch.int64))
    uneven = any(len(t) != max_new for t, _, _ in rows)
    pad_index: list[int] = []
    unpad_index: list[int] = []
    if uneven:
        base = 0
        for r, (toks, _, _) in enumerate(rows):
            n = len(toks)
            pad_index.extend(base + min(i, n - 1) for i in range(max_new))
            unpad_index.extend(r * max_new + i for i in range(n))
            base += n
    groups = []
    table_t = length_t = None
    if native:
        ranges: list[tuple[int, int]] = []
        table_t = _tables(rows, need_blocks, max(need_blocks))
        length_t = torch.tensor(lengths, dtype=torch.int64)
    else:
        ranges = (_attention_groups(need_blocks, bs, max_groups) if max_groups > 1
                  else [(0, num_rows)])
    for g_start, g_end in ranges:
        max_blocks = max(need_blocks[g_start:g_end])
        block_ids: list[int] = []
        for r in range(g_start, g_end):
            block_ids.extend(rows[r][2][:need_blocks[r]])
            block_ids.extend([0] * (max_blocks - need_blocks[r]))
        g_rows = g_end - g_start
        ctx_len = max_blocks * bs
        key_pos = torch.arange(ctx_len)
        len_t = torch.tensor(lengths[g_start:g_end])
        if max_new == 1:
            mask = (key_pos[None, :] < len_t[:, None])[None, :, None, :]  # [1, R, 1, L]
        else:
            start_t = torch.tensor(starts[g_start:g_end])
            query_pos = start_t[:, None] + torch.arange(max_new)[None, :]  # [R, T]
            query_pos = torch.minimum(query_pos, (len_t - 1)[:, None])
            mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [R, T, L]
            mask = mask[:, None].expand(g_rows, group, max_new, ctx_len)
            mask = mask.reshape(1, g_rows, group * max_new, ctx_len)
        # Dim-0 gathers over flat views (a gather along an inner dim is ~2x slower): K/V head
        # h of block b is row h * num_blocks + b of the [2 KV * blocks, bs * D] view.
        gather_index = heads * num_blocks + torch.tensor(block_ids)[None, :]
        groups.append(_AttnGroup(start=g_start, end=g_end,
                                 gather_index=gather_index.reshape(-1).to(device),
                                 mask=mask.to(device), ctx_len=ctx_len,
                                 causal=(g_rows == 1 and max_new > 1 and starts[g_start] == 0
                                         and lengths[g_start] == max_new)))
    return _AttnPart(
        token_start=token_start, token_end=token_end, rows=num_rows, max_new=max_new,
        groups=groups, tables=table_t, lengths=length_t,
        pad_index=torch.tensor(pad_index, device=device) if uneven else None,
        unpad_index=torch.tensor(unpad_index, device=device) if uneven else None,
    )


def _tables(rows: list[tuple[list[int], int, Sequence[int]]], need_blocks: list[int],
            width: int) -> torch.Tensor:
    """``[rows, width]`` int64: each row's first ``need_blocks`` block ids, then zeros."""
    return torch.tensor([list(t[:n]) + [0] * (width - n)
                         for (_, _, t), n in zip(rows, need_blocks, strict=True)],
                        dtype=torch.int64)
