"""The hard limits of the KV gates: a request that no amount of waiting would let in.

Gate 2 (the active-KV budget) and gate 3 (the KV block pool) soft-hold a request that fits but
not now; a request that alone exceeds the budget or the whole pool can never be served and is
hard-rejected on arrival with the numbers (``docs/design.md``, backpressure). The hard check runs
when a request enters ``_pending``
(:meth:`~inference.engine.sched.lifecycle.RowLifecycle.enqueue`), the soft ones in the admission
phase (:class:`~inference.engine.sched.admission.Admission`).
"""

from __future__ import annotations

from inference.engine.kv_cache import KVCacheManager
from inference.engine.request import ErrorCode, ErrorInfo, Request

# The three gates (``docs/design.md``, backpressure): 1 queue capacity, 2 the active-KV budget,
# 3 the KV block pool; the keys of the per-gate soft-hold and hard-reject counters.
GATES = (1, 2, 3)


def never_fits(request: Request, kv: KVCacheManager,
               active_kv_budget: int) -> tuple[int, ErrorInfo] | None:
    """Gates 2 and 3, hard: does ``request`` alone exceed the whole pool or the budget?

    Args:
        request: a request whose ``prompt_len + max_tokens`` (tokens) is its KV demand.
        kv: the block pool's manager (its size in blocks of ``block_size`` tokens).
        active_kv_budget: gate 2's budget, in tokens.

    Returns:
        ``(gate, error)`` for a request that can never be served, else None. Gate 3 is checked
        first: the pool is the more fundamental limit (the budget fits inside it).
    """
    demand = request.kv_demand
    numbers = {"prompt_len": request.prompt_len, "max_tokens": request.max_tokens,
               "kv_demand": demand}
    if request.sampling.n > 1:
        numbers["n"] = request.sampling.n
    if not kv.can_ever_fit(request):
        blocks = kv.blocks_demand(request)
        what = "prompt_len + max_tokens" if request.sampling.n == 1 else (
            f"prompt_len + {request.sampling.n} * max_tokens")
        return 3, ErrorInfo(
            code=ErrorCode.KV_POOL_EXCEEDED,
            message=(f"{what} = {demand} tokens needs {blocks} KV blocks "
                     f"of {kv.block_size} tokens; the pool has {kv.num_blocks}; "
                     "it can never be served"),
            gate=3, retryable=False,
            details={**numbers, "blocks_needed": blocks, "kv_blocks_total": kv.num_blocks})
    if demand > active_kv_budget:
        return 2, ErrorInfo(
            code=ErrorCode.KV_BUDGET_EXCEEDED,
            message=(f"{_terms(request)} = {demand} tokens exceeds the active-KV budget of "
                     f"{active_kv_budget} tokens; it can never be served"),
            gate=2, retryable=False,
            details={**numbers, "active_kv_budget": active_kv_budget})
    return None


def _terms(request: Request) -> str:
    """The sum a request's KV demand is: ``prompt_len + max_tokens`` in numbers (``n`` times
    ``max_tokens`` for a request of ``n`` choices)."""
    n = request.sampling.n
    times = f"{n} * " if n > 1 else ""
    return f"prompt_len + {times}max_tokens = {request.prompt_len} + {times}{request.max_tokens}"
