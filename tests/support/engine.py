"""Small builders shared by the engine tests."""

from __future__ import annotations

from collections import defaultdict

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.request import Event, FinalEvent, TokenEvent


def make_engine(backend: ReferenceBackend | None = None, **settings) -> LLMEngine:
    """An engine on the deterministic reference backend with small, test-sized defaults."""
    defaults = dict(backend="reference", kv_num_blocks=256, kv_block_size=4, max_batch_size=8,
                    prefill_chunk_size=8, max_pending=1000)
    defaults.update(settings)
    return LLMEngine(EngineConfig(**defaults), backend or ReferenceBackend())


class EventLog:
    """Collects events per request and checks their order as they arrive."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[Event]] = defaultdict(list)
        self.order: list[Event] = []

    def add(self, events: list[Event]) -> None:
        for event in events:
            seen = self.by_request[event.request_id]
            assert not seen or not isinstance(seen[-1], FinalEvent), (
                f"event after the final event of {event.request_id}")
            assert event.seq == len(seen), f"{event.request_id}: seq {event.seq} after {len(seen)}"
            seen.append(event)
            self.order.append(event)

    def final(self, request_id: str) -> FinalEvent | None:
        seen = self.by_request.get(request_id)
        return seen[-1] if seen and isinstance(seen[-1], FinalEvent) else None

    def tokens(self, request_id: str) -> list[int]:
        return [e.token_id for e in self.by_request[request_id] if isinstance(e, TokenEvent)]

    def text(self, request_id: str) -> str:
        return "".join(e.text for e in self.by_request[request_id])


def run_until_idle(engine: LLMEngine, log: EventLog | None = None, max_ticks: int = 10_000) -> int:
    """Tick until nothing is live; return the number of ticks. Fails on a hang."""
    for tick in range(max_ticks):
        if not engine.has_work():
            return tick
        events = engine.step()
        if log is not None:
            log.add(events)
    raise AssertionError(f"engine still busy after {max_ticks} ticks: {engine.stats()}")
