"""Scheduling policies: the order in which pending requests are admitted.

``docs/design.md`` (scheduling policies) states the design.

Both policies implement the same five hooks: ``on_request_arrived``, ``peek_next``, ``pick_next``,
``on_tokens_processed`` and ``on_request_finished``; plus ``remove`` for a request that leaves
the pending queue without being admitted (abort, timeout, shutdown).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass

from inference.engine.request import Request


@dataclass
class KeyStats:
    """Per fairness key: the VTC counter, live requests and the service received.

    ``weighted_service`` is the VTC charge actually received (input weight x computed prompt
    tokens + output weight x generated tokens, divided by the key's weight), without the
    counter lifts, so two keys' service can be compared.
    """

    vtc_counter: float = 0.0
    in_flight: int = 0
    pending: int = 0
    prompt_tokens_served: int = 0
    completion_tokens_served: int = 0
    weighted_service: float = 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "vtc_counter": self.vtc_counter,
            "in_flight": self.in_flight,
            "pending": self.pending,
            "tokens_served": self.prompt_tokens_served + self.completion_tokens_served,
            "prompt_tokens_served": self.prompt_tokens_served,
            "completion_tokens_served": self.completion_tokens_served,
            "weighted_service": self.weighted_service,
        }


class SchedulingPolicy(ABC):
    """Orders the pending queue and keeps per-fairness-key accounting.

    Args:
        input_weight: cost of one computed (not prefix-cached) prompt token.
        output_weight: cost of one generated token.
    """

    name = "base"

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0):
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.keys: dict[str, KeyStats] = defaultdict(KeyStats)

    # Hooks -------------------------------------------------------------------------------

    def on_request_arrived(self, request: Request) -> None:
        """``request`` enters the pending queue."""
        stats = self.keys[request.fairness_key]
        if stats.in_flight == 0:
            self._on_key_backlogged(request.fairness_key)
        stats.in_flight += 1
        stats.pending += 1
        self._push(request)

    @abstractmethod
    def peek_next(self) -> Request | None:
        """The request that would be admitted next, without removing it; None if empty."""

    def pick_next(self) -> Request:
        """Remove and return the head of the pending queue.

        Raises:
            IndexError: if the queue is empty.
        """
        request = self.peek_next()
        if request is None:
            raise IndexError("pick_next from an empty pending queue")
        self._pop(request)
        self.keys[request.fairness_key].pending -= 1
        return request

    def on_tokens_processed(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        """Charge ``request``'s key for computed prompt tokens and generated tokens."""
        stats = self.keys[request.fairness_key]
        cost = (self.input_weight * prompt_tokens + self.output_weight * output_tokens)
        cost /= request.fairness_weight
        stats.vtc_counter += cost
        stats.weighted_service += cost
        stats.prompt_tokens_served += prompt_tokens
        stats.completion_tokens_served += output_tokens

    def on_request_finished(self, request: Request) -> None:
        """An admitted request left the batch (finished, aborted or failed)."""
        self._release(request)

    def remove(self, request: Request) -> None:
        """Take a pending request out of the queue without admitting it (parked or not)."""
        if request.parked:
            request.parked = False
        else:
            self._pop(request)
        self.keys[request.fairness_key].pending -= 1
        self._release(request)

    def park(self, request: Request) -> None:
        """Take a pending request out of the order while it cannot be admitted (its LoRA
        adapter loads): it keeps its arrival, its key stays backlogged (no VTC lift when it
        comes back) and it still counts as pending."""
        if not request.parked:
            self._pop(request)
            request.parked = True

    def unpark(self, request: Request) -> None:
        """Put a parked request back in its place in the order (its arrival and rank)."""
        if request.parked:
            request.parked = False
            self._push(request)

    # Internals -----------------------------------------------------------------------------

    def _release(self, request: Request) -> None:
        stats = self.keys[request.fairness_key]
        stats.in_flight -= 1
        if stats.in_flight == 0:
            self._on_key_idle(request.fairness_key)

    def _on_key_backlogged(self, key: str) -> None:  # noqa: B027 - optional hook
        pass

    def _on_key_idle(self, key: str) -> None:  # noqa: B027 - optional hook
        pass

    @abstractmethod
    def _push(self, request: Request) -> None: ...

    @abstractmethod
    def _pop(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...


class _LazyHeap:
    """A min-heap of (key, request) with removal by marking."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Request]] = []
        self._live: set[int] = set()

    def push(self, key: tuple, request: Request) -> None:
        heapq.heappush(self._heap, (key, id(request), request))
        self._live.add(id(request))

    def remove(self, request: Request) -> None:
        self._live.discard(id(request))

    def peek(self) -> tuple[tuple, Request] | None:
        heap = self._heap
        while heap and heap[0][1] not in self._live:
            heapq.heappop(heap)
        return (heap[0][0], heap[0][2]) if heap else None

    def __len__(self) -> int:
        return len(self._live)


def service_rank(request: Request) -> tuple[int, int]:
    """The part of a sort key before fairness and arrival: interactive requests by tier,
    ``(0, -priority)``, then every batch request, ``(1, 0)``, whatever its tier
    (``docs/design.md``, "The batch service class")."""
    return (1, 0) if request.batch else (0, -request.priority)


class FCFSPolicy(SchedulingPolicy):
    """First come, first served within priority tiers: sort key ``(-priority, arrival_seq)``,
    after :func:`service_rank` (batch requests after every interactive one)."""

    name = "fcfs"

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0):
        super().__init__(input_weight, output_weight)
        self._heap = _LazyHeap()

    def peek_next(self) -> Request | None:
        head = self._heap.peek()
        return head[1] if head else None

    def _push(self, request: Request) -> None:
        self._heap.push((*service_rank(request), request.arrival_seq), request)

    def _pop(self, request: Request) -> None:
        self._heap.remove(request)

    def __len__(self) -> int:
        return len(self._heap)


class VTCPolicy(SchedulingPolicy):
    """Virtual Token Counter fair scheduling (Sheng et al., "Fairness in Serving Large Language
    Models", OSDI 2024), with priority tiers in front.

    Sort key ``(-priority, counter[key], arrival_seq)``: the highest tier first, then the key that
    has been served least, then its oldest request; batch requests after every interactive one
    (:func:`service_rank`), fair among their own keys. A key that becomes backlogged (nothing queued
    or running) is lifted to the minimum counter of the backlogged keys, or, when none is
    backlogged, to the counter of the key that went idle last; so it neither starves others nor
    gets a catch-up burst for the time it was away.
    """

    name = "vtc"

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0):
        super().__init__(input_weight, output_weight)
        # Each key's own pending requests, ordered by (service_rank, arrival_seq).
        self._per_key: dict[str, _LazyHeap] = defaultdict(_LazyHeap)
        self._backlogged: set[str] = set()
        self._last_idle_counter = 0.0
        self._size = 0

    def peek_next(self) -> Request | None:
        best_key: tuple | None = None
        best: Request | None = None
        for key, heap in self._per_key.items():
            head = heap.peek()
            if head is None:
                continue
            (batch, neg_priority, arrival), request = head
            sort_key = (batch, neg_priority, self.keys[key].vtc_counter, arrival)
            if best_key is None or sort_key < best_key:
                best_key, best = sort_key, request
        return best

    def _on_key_backlogged(self, key: str) -> None:
        stats = self.keys[key]
        if self._backlogged:
            floor = min(self.keys[k].vtc_counter for k in self._backlogged)
        else:
            floor = self._last_idle_counter
        stats.vtc_counter = max(stats.vtc_counter, floor)
        self._backlogged.add(key)

    def _on_key_idle(self, key: str) -> None:
        self._backlogged.discard(key)
        self._last_idle_counter = self.keys[key].vtc_counter

    def _push(self, request: Request) -> None:
        self._per_key[request.fairness_key].push(
            (*service_rank(request), request.arrival_seq), request)
        self._size += 1

    def _pop(self, request: Request) -> None:
        heap = self._per_key[request.fairness_key]
        heap.remove(request)
        self._size -= 1
        if len(heap) == 0:
            del self._per_key[request.fairness_key]

    def __len__(self) -> int:
        return self._size


def make_policy(name: str, input_weight: float, output_weight: float) -> SchedulingPolicy:
    """The policy named ``fcfs`` or ``vtc``.

    Raises:
        ValueError: for another name.
    """
    policies = {"fcfs": FCFSPolicy, "vtc": VTCPolicy}
    try:
        return policies[str(name)](input_weight, output_weight)
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {name!r}; use one of {sorted(policies)}") from None
