"""KV block pool bookkeeping with prefix caching.

The pool has a fixed number of blocks of ``block_size`` token slots each. A row's block table
lists the physical blocks that hold its tokens in order. Full blocks are content-addressed by a
hash chain over the tokens before and in them, seeded by the tenant, so a prompt that starts with
the same full blocks as an earlier one *of the same tenant* reuses their KV (a prefix hit) instead
of recomputing it; one tenant's prompts are never a hit for another's.

Every block is in exactly one state:

* held: referenced by at least one live row;
* evictable: unreferenced but still holding cached, hash-addressed KV (reused on a hit, or
  reclaimed least recently used first when a fresh block is needed);
* free: unreferenced and holding nothing worth keeping.

Admission reserves the blocks a row can grow into (``ceil((prompt_len + max_tokens) / block_size)``
minus its prefix hits), so decode never runs out of blocks and no workload can deadlock
(``docs/design.md``, backpressure: gate 3). A request of ``n`` choices reserves that for choice 0
and, for each other choice, its own growth past the prompt's full blocks, which it shares (a
reference on each) from its fork on (:meth:`KVCacheManager.fork`): the last, partial prompt
block copied (copy-on-write at the fork) and every block it decodes into. The design follows
vLLM's block manager (Kwon et al., SOSP 2023) and nano-vllm's hashed prefix blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from inference.engine.request import Request


def _tenant_seed(tenant: str, adapter: str = "") -> int:
    """The hash chain's seed: per tenant, so tenants never share cached blocks, and per LoRA
    adapter (its digest; empty: the bare base model), so a prefix computed under one adapter
    is never a hit for another adapter or for the base model."""
    return hash(("tenant", tenant, adapter)) if adapter else hash(("tenant", tenant))


def cache_salt(request: Request) -> tuple[str, str]:
    """What seeds ``request``'s hash chain: its tenant and its adapter's digest (or "")."""
    return request.tenant, request.adapter.key if request.adapter is not None else ""


@dataclass
class KVBlock:
    """One physical block: its reference count and, once full and registered, its content hash."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PrefixMatch:
    """The cached prefix of a prompt: hit block ids, in order, and how many tokens they cover."""

    block_ids: tuple[int, ...]
    num_tokens: int


class KVCacheManager:
    """Block allocation, reference counts, prefix-cache lookup and LRU eviction.

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).
        enable_prefix_caching: look up and register full blocks by content hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._hash_to_block: dict[int, int] = {}
        self._num_held = 0
        # Blocks promised to admitted rows and not allocated yet.
        self.outstanding_reserved = 0
        self.prefix_hit_tokens = 0
        self.prefix_queried_tokens = 0
        self.evictions = 0

    # -- figures -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_held(self) -> int:
        return self._num_held

    @property
    def kv_pressure(self) -> float:
        """Blocks held by live rows / total blocks, in [0, 1]; evictable blocks count as free."""
        return self._num_held / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def available_blocks(self) -> int:
        """Blocks a new row may take: free + evictable - promised to admitted rows."""
        return len(self._free) + len(self._evictable) - self.outstanding_reserved

    # -- prefix cache ------------------------------------------------------------------------

    @staticmethod
    def _chain_hash(parent: int, tokens: Sequence[int]) -> int:
        return hash((parent, tuple(tokens)))

    def block_hashes(self, tenant: str, token_ids: Sequence[int], num_blocks: int,
                     adapter: str = "") -> list[int]:
        """Hash chain of the first ``num_blocks`` full blocks of ``token_ids`` for ``tenant``."""
        bs = self.block_size
        parent = _tenant_seed(tenant, adapter)
        hashes = []
        for i in range(num_blocks):
            parent = self._chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, request: Request) -> PrefixMatch:
        """The prompt's longest cached prefix of full blocks (the prefix hit).

        At least the prompt's last token is always left to compute, since its logits give the
        first generated token; so at most ``(prompt_len - 1) // block_size`` blocks can hit.
        A request that owes prompt logprobs gets no hit: each of its positions is computed (its
        blocks are still published for others).
        """
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return PrefixMatch((), 0)
        max_blocks = (request.prompt_len - 1) // self.block_size
        hits: list[int] = []
        tenant, adapter = cache_salt(request)
        hashes = self.block_hashes(tenant, request.prompt_token_ids, max_blocks, adapter=adapter)
        for i, h in enumerate(hashes):
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            tokens = tuple(request.prompt_token_ids[i * self.block_size:(i + 1) * self.block_size])
            if self.blocks[block_id].token_ids != tokens:  # a hash collision: treat as a miss
                break
            hits.append(block_id)
        return PrefixMatch(tuple(hits), len(hits) * self.block_size)

    def blocks_demand(self, request: Request) -> int:
        """Blocks a request holds at most over its life, prefix hits included.

        ``ceil((prompt_len + max_tokens) / block_size)`` for one choice; a request of ``n``
        choices adds, per choice after the first, that minus the prompt's full blocks (shared
        by every choice): its copy of the partial prompt block and its own decode blocks.
        """
        per_row = self.blocks_for_tokens(request.prompt_len + request.max_tokens)
        shared = request.prompt_len // self.block_size
        return per_row + (request.sampling.n - 1) * (per_row - shared)

    def blocks_needed(self, request: Request, match: PrefixMatch) -> int:
        """Blocks admission takes out of :meth:`available_blocks` (gate 3).

        The row's whole growth (:meth:`blocks_demand`) minus the hit blocks, plus the hit blocks
        that are now evictable (taking a reference moves them out of that count).
        """
        total = self.blocks_demand(request)
        revived = sum(1 for b in match.block_ids if self.blocks[b].ref_count == 0)
        return total - len(match.block_ids) + revived

    def can_ever_fit(self, request: Request) -> bool:
        """Whether the row's whole growth (:meth:`blocks_demand`) fits in the whole pool."""
        return self.blocks_demand(request) <= self.num_blocks

    # -- row lifecycle -----------------------------------------------------------------------

    def admit(self, request: Request, match: PrefixMatch) -> None:
        """Take references on the hit blocks and reserve the rest of the row's growth."""
        for block_id in match.block_ids:
            self._take_ref(block_id)
        request.block_table = list(match.block_ids)
        request.block_hashes = []
        if match.block_ids:
            request.block_hashes = self.block_hashes(
                request.tenant, request.prompt_token_ids, len(match.block_ids),
                adapter=cache_salt(request)[1])
        request.num_cached_tokens = match.num_tokens
        request.num_computed_tokens = match.num_tokens
        request.reserved_blocks = self.blocks_demand(request) - len(match.block_ids)
        self.outstanding_reserved += request.reserved_blocks
        self.prefix_queried_tokens += request.prompt_len
        self.prefix_hit_tokens += match.num_tokens

    def ensure_slots(self, request: Request, num_tokens: int) -> None:
        """Grow the row's block table to cover ``num_tokens`` token slots, from its reservation.

        Raises:
            RuntimeError: if the row asks for more blocks than it reserved (a scheduler bug).
        """
        while len(request.block_table) * self.block_size < num_tokens:
            if request.reserved_blocks <= 0:
                raise RuntimeError(
                    f"request {request.request_id} needs more KV blocks than it reserved")
            request.reserved_blocks -= 1
            self.outstanding_reserved -= 1
            request.block_table.append(self._allocate())

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give ``child`` (a new choice of ``parent``, whose prompt is all computed) the
        parent's prompt KV: a reference on each full prompt block, and a block of its own for
        the last, partial one, taken from the reservation the parent moves to it (its whole
        growth: ``blocks_for_tokens(prompt_len + max_tokens)`` minus the shared full blocks).

        Returns:
            ``(source, copy)`` block ids whose KV the backend must copy (copy-on-write of the
            partial prompt block), or None when the prompt ends on a block boundary.

        Raises:
            RuntimeError: the parent's reservation does not cover the child (a scheduler bug).
        """
        shared = parent.prompt_len // self.block_size
        growth = self.blocks_for_tokens(child.prompt_len + child.max_tokens) - shared
        if parent.reserved_blocks < growth:
            raise RuntimeError(f"request {parent.request_id} reserved too few KV blocks to fork")
        parent.reserved_blocks -= growth
        child.reserved_blocks = growth
        child.block_table = list(parent.block_table[:shared])
        for block_id in child.block_table:
            self._take_ref(block_id)
        child.block_hashes = list(parent.block_hashes[:shared])
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_computed_tokens = parent.num_computed_tokens
        if len(parent.block_table) == shared:
            return None
        child.reserved_blocks -= 1
        self.outstanding_reserved -= 1
        copy = self._allocate()
        child.block_table.append(copy)
        return parent.block_table[shared], copy

    def commit_full_blocks(self, request: Request) -> None:
        """Register the row's newly completed full blocks in the prefix cache.

        Call after ``num_computed_tokens`` advanced. A block whose content is already cached in
        another block stays private to this row (and is freed, not cached, when the row ends).
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = request.num_computed_tokens // bs
        if len(request.block_hashes) >= full:
            return
        tokens = request.all_token_ids
        parent = (request.block_hashes[-1] if request.block_hashes
                  else _tenant_seed(*cache_salt(request)))
        for i in range(len(request.block_hashes), full):
            content = tuple(tokens[i * bs:(i + 1) * bs])
            parent = self._chain_hash(parent, content)
            request.block_hashes.append(parent)
            if parent not in self._hash_to_block:
                block = self.blocks[request.block_table[i]]
                block.block_hash = parent
                block.token_ids = content
                self._hash_to_block[parent] = block.block_id

    def free(self, request: Request) -> None:
        """Drop the row's references and its unused reservation; safe to call twice."""
        # Tail blocks first, so that they are evicted before the shared head of a prompt.
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._num_held -= 1
                if block.block_hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        request.block_table = []
        self.outstanding_reserved -= request.reserved_blocks
        request.reserved_blocks = 0

    # -- internals ---------------------------------------------------------------------------

    def _take_ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._num_held += 1
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _allocate(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self._hash_to_block[block.block_hash]  # type: ignore[arg-type]
            block.block_hash = None
            block.token_ids = None
            self.evictions += 1
        else:
            raise RuntimeError("KV block pool exhausted (reservation accounting is broken)")
        self._take_ref(block_id)
        return block_id

    def snapshot(self) -> dict[str, int | float]:
        """Block counts: held + free + evictable == total."""
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_held": self._num_held,
            "kv_blocks_free": len(self._free),
            "kv_blocks_evictable": len(self._evictable),
            "kv_blocks_reserved": self.outstanding_reserved,
            "kv_block_size": self.block_size,
            "kv_pressure": self.kv_pressure,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_queried_tokens": self.prefix_queried_tokens,
            "prefix_hit_rate": (self.prefix_hit_tokens / self.prefix_queried_tokens
                                if self.prefix_queried_tokens else 0.0),
            "kv_block_evictions": self.evictions,
        }
