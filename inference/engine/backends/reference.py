"""A deterministic, model-free backend for tests and platform development.

Its "KV cache" is a pool of token ids laid out exactly like a real paged KV pool
(``[num_blocks, block_size]``); the next token is a hash of every token the row can *read back
through its block table*, position by position. So chunked, monolithic, batched, prefix-cached and
evicted-then-recomputed runs of a prompt all give the same output exactly when the block tables
and the KV writes are right, and a bookkeeping bug shows up as different tokens.

The tokenizer is byte-level UTF-8 (token id = byte value), so multi-byte characters span several
tokens, as with real BPE vocabularies.

Its logits make a distribution worth reading log-probabilities from: two letters stand out (the
greedy one by at least 3 over the rest), and every other token gets a value in [-2, 0) that
depends on the token and on the hash, so each position's distribution is its own
(:meth:`ReferenceBackend.logits_after` gives them for any token sequence, as a direct forward
pass would).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from inference.engine.backends.base import DecodeRow, ModelBackend, PassYielded, PrefillChunk
from inference.tokenization import chat_tools

# Letters and a few punctuation marks: what the backend "writes".
_ALPHABET = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz ,.!?"]
_MODULUS = 1_000_003


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0-255); id 256 is EOS and 257 BOS."""

    eos_token_id = 256
    bos_token_id = 257
    vocab_size = 258

    def __init__(self) -> None:
        self.eos_token_ids = frozenset({self.eos_token_id})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            tools: Sequence[Any] | None = None) -> list[int]:
        """A plain template with no tool support: tools get the Hermes fallback."""
        if chat_tools.uses_tools(messages, tools):
            messages = chat_tools.fallback_messages(messages, tools)
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return [self.bos_token_id, *self.encode(text)]

    @property
    def tokens(self) -> list[bytes]:
        """Every token's bytes, by id (what llguidance's ``TokenizerWrapper`` reads: structured
        outputs work on this backend too)."""
        return [self.token_bytes(i) for i in range(self.vocab_size)]

    special_token_ids = (eos_token_id, bos_token_id)

    def __call__(self, text: bytes) -> list[int]:  # llguidance's encode: bytes to ids
        return list(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token: its byte, or the name of EOS or BOS."""
        if token_id == self.eos_token_id:
            return b"<eos>"
        if token_id == self.bos_token_id:
            return b"<bos>"
        return bytes([token_id])


class ReferenceBackend(ModelBackend):
    """Deterministic next-token function over a paged token pool.

    Args:
        max_model_len: context length in tokens.
        eos_every: when > 0, a row emits EOS at the first position where the hash is divisible
            by ``eos_every`` (so about one answer in ``eos_every`` tokens ends); 0 never.
        step_delay_s: seconds each forward pass takes (emulates a real model's pace).
    """

    def __init__(self, max_model_len: int = 8192, eos_every: int = 0, step_delay_s: float = 0.0):
        self.tokenizer = ByteTokenizer()
        self.vocab_size = ByteTokenizer.vocab_size
        self.max_model_len = max_model_len
        self.eos_every = eos_every
        self.step_delay_s = step_delay_s
        self.fixed_pass_seconds = step_delay_s
        self._pool: torch.Tensor | None = None
        self._block_size = 0
        positions = torch.arange(max_model_len, dtype=torch.int64)
        self._weights = (positions * 2654435761 + 12345) % 65521
        self._vocab_ids = torch.arange(self.vocab_size, dtype=torch.int64)
        self.rows: set[str] = set()
        # Each row's LoRA adapter as a salt of what it writes (0: the bare model), see _write.
        self._salts: dict[str, int] = {}
        self.forward_calls = 0
        self.block_copies = 0

    def kv_bytes_per_token(self) -> int:
        return 8

    def allocate_kv_pool(self, num_blocks: int, block_size: int) -> None:
        self._pool = torch.full((num_blocks, block_size), -1, dtype=torch.int64)
        self._block_size = block_size

    def add_row(self, row_id: str) -> None:
        self.rows.add(row_id)

    def remove_row(self, row_id: str) -> None:
        self.rows.discard(row_id)
        self._salts.pop(row_id, None)

    # LoRA adapters: a row under one writes its tokens salted by the adapter's digest, so its
    # answers are its own, and a KV slot written under another adapter (or the bare model) reads
    # back as other values (a prefix cache that crossed adapters shows as different tokens).
    serves_adapters = True

    def build_adapter(self, files: Any, max_rank: int) -> Any:
        """A stand-in for an adapter's tensors: its config's rank checked, nothing laid out.

        Raises:
            inference.engine.lora.AdapterError: not a LoRA config, or a rank over ``max_rank``.
        """
        from inference.engine.lora import AdapterError, AdapterWeights

        rank = files.config.get("r")
        if files.config.get("peft_type") != "LORA" or not isinstance(rank, int) or not (
                0 < rank <= max_rank):
            raise AdapterError(f"not a LoRA adapter of rank 1..{max_rank}")
        return AdapterWeights(key=files.key or files.digest, rank=rank, layers=[],
                              nbytes=len(files.weights))

    def set_row_adapter(self, row_id: str, weights: Any) -> None:
        self._salts[row_id] = int(weights.key[:6], 16) + 1

    def copy_block(self, source: int, target: int) -> None:
        """Copy block ``source``'s token slots into block ``target`` (copy-on-write at a fork)."""
        assert self._pool is not None, "allocate_kv_pool first"
        self._pool[target] = self._pool[source]
        self.block_copies += 1

    def _forward(self) -> None:
        """One pass's time (``step_delay_s``), given up as soon as ``yield_check`` answers
        True (:class:`~inference.engine.backends.base.PassYielded`, before anything is
        written), as the real backend gives up between layers."""
        self.forward_calls += 1
        if not self.step_delay_s:
            return
        end, give_way = time.monotonic() + self.step_delay_s, self.yield_check
        while (left := end - time.monotonic()) > 0:
            if give_way is not None and give_way():
                raise PassYielded("an interactive request arrived")
            time.sleep(min(left, 0.002) if give_way is not None else left)

    def _write(self, block_table: Sequence[int], start: int, tokens: Sequence[int],
               row_id: str = "") -> None:
        assert self._pool is not None, "allocate_kv_pool first"
        bs = self._block_size
        salt = self._salts.get(row_id, 0) << 20
        for offset, token in enumerate(tokens):
            pos = start + offset
            self._pool[block_table[pos // bs], pos % bs] = token + salt

    def _read(self, block_table: Sequence[int], length: int) -> torch.Tensor:
        """The first ``length`` tokens the row holds, read back through its block table."""
        assert self._pool is not None
        table = torch.tensor(list(block_table), dtype=torch.int64)
        tokens = self._pool[table].reshape(-1)[:length]
        if bool((tokens < 0).any()):
            raise RuntimeError("read a KV slot that was never written")
        return tokens

    def _hash_logits(self, h: int) -> torch.Tensor:
        """``[vocab]`` logits of the hash ``h`` of a row's tokens."""
        # A value in [-2, 0) per (token, hash): every position's distribution is its own.
        x = ((self._vocab_ids + 1) * 40503 + h * 2654435761) % 2**31
        x = ((x ^ (x >> 13)) * 1274126177) % 2**20
        logits = x.float() / 2**19 - 2.0
        if self.eos_every and h % self.eos_every == 0:
            logits[ByteTokenizer.eos_token_id] = 10.0
        else:
            # EOS only where the hash says so, even when sampling: "0 never" must hold at any
            # temperature, or a test of length limits would flake on a sampled EOS.
            logits[ByteTokenizer.eos_token_id] = float("-inf")
            logits[_ALPHABET[h % len(_ALPHABET)]] += 10.0
            logits[_ALPHABET[(h // 7) % len(_ALPHABET)]] += 5.0
        return logits

    def _logits(self, block_table: Sequence[int], length: int) -> torch.Tensor:
        tokens = self._read(block_table, length)
        return self._hash_logits(int((tokens * self._weights[:length]).sum()) % _MODULUS)

    def _position_logits(self, block_table: Sequence[int], start: int,
                         end: int) -> torch.Tensor:
        """``[end - start, vocab]`` logits after each of the row's positions ``[start, end)``."""
        sums = (self._read(block_table, end) * self._weights[:end]).cumsum(0)
        return torch.stack([self._hash_logits(int(s) % _MODULUS) for s in sums[start:end]])

    def logits_after(self, token_ids: Sequence[int]) -> torch.Tensor:
        """``[vocab]`` next-token logits of a row holding ``token_ids`` (a direct forward pass:
        no pool, no block table)."""
        tokens = torch.tensor(list(token_ids), dtype=torch.int64)
        return self._hash_logits(int((tokens * self._weights[:len(tokens)]).sum()) % _MODULUS)

    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        self._forward()
        out, others = [], []
        for chunk in chunks:
            self._write(chunk.block_table, chunk.start_pos, chunk.token_ids, chunk.row_id)
            end = chunk.start_pos + len(chunk.token_ids)
            if chunk.all_logits:
                rows = self._position_logits(chunk.block_table, chunk.start_pos, end)
                out.append(rows[-1])
                others.append(rows[:-1])
            else:
                out.append(self._logits(chunk.block_table, end))
        return torch.cat([torch.stack(out), *others])

    def decode(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        self._forward()
        out = []
        for row in rows:
            self._write(row.block_table, row.position, [row.token_id], row.row_id)
            out.append(self._logits(row.block_table, row.position + 1))
        return torch.stack(out)

    def prefill_and_decode(self, chunks: Sequence[PrefillChunk],
                           rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Chunks and decode rows as one pass: :meth:`prefill` then :meth:`decode` (so a
        subclass that changes either changes this too), paying ``step_delay_s`` once."""
        self._forward()
        delay, self.step_delay_s = self.step_delay_s, 0.0
        calls = self.forward_calls
        try:
            prefill = self.prefill(chunks) if chunks else torch.empty(0, self.vocab_size)
            decode = self.decode(rows) if rows else torch.empty(0, self.vocab_size)
        finally:
            self.step_delay_s = delay
            self.forward_calls = calls
        # Each chunk's last token, the decode rows, then the chunks' other positions asked for.
        n = len(chunks)
        return torch.cat([prefill[:n], decode, prefill[n:]])
