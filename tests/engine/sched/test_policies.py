"""Admission order: FCFS with priority tiers, and VTC fairness (Sheng et al., OSDI 2024)."""

from __future__ import annotations

import itertools

from inference.engine.request import SamplingParams, TokenEvent
from tests.support.engine import EventLog, make_engine, run_until_idle

W_IN, W_OUT = 1.0, 2.0


def test_fcfs_admits_by_priority_then_arrival():
    engine = make_engine(max_batch_size=1, scheduling_policy="fcfs")
    log = EventLog()
    order = [("a", 0), ("b", 2), ("c", 1), ("d", 2), ("e", 0), ("f", 1)]
    for rid, priority in order:
        engine.submit(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2),
                      request_id=rid, priority=priority)
    run_until_idle(engine, log)
    started = [e.request_id for e in log.order if isinstance(e, TokenEvent) and e.seq == 0]
    assert started == ["b", "d", "c", "f", "a", "e"]


class TwoTenantLoad:
    """Two tenants kept backlogged: B's requests are four times longer than A's.

    Each tenant always has ``depth`` requests pending: when one of its requests is admitted,
    it sends another.
    """

    def __init__(self, policy: str, depth: int = 4):
        self.engine = make_engine(scheduling_policy=policy, kv_num_blocks=128, kv_block_size=4,
                                  active_kv_budget=240, max_batch_size=8, prefill_chunk_size=16,
                                  vtc_input_weight=W_IN, vtc_output_weight=W_OUT)
        self.shapes = {"A": (8, 8), "B": (32, 32)}   # (prompt_len, max_tokens)
        self.depth = depth
        self.counter = itertools.count()
        for tenant in self.shapes:
            for _ in range(depth):
                self.send(tenant)

    def send(self, tenant: str) -> None:
        prompt_len, max_tokens = self.shapes[tenant]
        n = next(self.counter)
        # Distinct prompts: no prefix hits, so every prompt token is computed and charged.
        prompt = [(n * 7 + i) % 250 + 1 for i in range(prompt_len)]
        self.engine.submit(prompt_token_ids=prompt, tenant=tenant, request_id=f"{tenant}{n}",
                           sampling=SamplingParams(max_tokens=max_tokens))

    def run(self, ticks: int) -> list[float]:
        """Tick, topping up; return |service(A) - service(B)| after every tick."""
        diffs = []
        for _ in range(ticks):
            self.engine.step()
            stats = self.engine.stats()
            for tenant in self.shapes:
                for _ in range(self.depth - stats["per_key"][tenant]["pending"]):
                    self.send(tenant)
            service = {k: v["weighted_service"] for k, v in stats["per_key"].items()}
            diffs.append(abs(service["A"] - service["B"]))
        return diffs

    def bound(self) -> float:
        """VTC's bound: 2 x max(w_in x longest prompt, w_out x tokens the batch can hold)."""
        longest_prompt = max(p for p, _ in self.shapes.values())
        batch_tokens = self.engine.scheduler.active_kv_budget
        return 2 * max(W_IN * longest_prompt, W_OUT * batch_tokens)


def test_vtc_keeps_the_service_difference_within_its_bound_over_a_long_run():
    load = TwoTenantLoad("vtc")
    diffs = load.run(3000)
    per_key = load.engine.stats()["per_key"]
    served = per_key["A"]["weighted_service"] + per_key["B"]["weighted_service"]
    assert served > 20 * load.bound(), "the run must be long compared with the bound"
    assert max(diffs) <= load.bound()
    half = len(diffs) // 2
    assert max(diffs[half:]) <= max(diffs[:half])


def test_fcfs_lets_the_difference_grow_on_the_same_workload():
    load = TwoTenantLoad("fcfs")
    diffs = load.run(3000)
    half = len(diffs) // 2
    assert diffs[-1] > 3 * load.bound()
    assert max(diffs[half:]) > 1.5 * max(diffs[:half])


def ticks_to_first_token(policy: str, backlog: int) -> int:
    engine = make_engine(scheduling_policy=policy, max_batch_size=2, prefill_chunk_size=16,
                         max_pending=1000)
    for i in range(backlog):
        engine.submit(prompt_token_ids=[i % 200 + 1] * 16, tenant="busy", request_id=f"b{i}",
                      sampling=SamplingParams(max_tokens=16))
    for _ in range(20):  # the busy tenant is being served
        engine.step()
    engine.submit(prompt_token_ids=[5] * 16, tenant="newcomer", request_id="new",
                  sampling=SamplingParams(max_tokens=4))
    for tick in range(1, 10_000):
        events = engine.step()
        if any(isinstance(e, TokenEvent) and e.request_id == "new" for e in events):
            return tick
    raise AssertionError("the newcomer never got a token")


def test_vtc_first_token_of_a_newcomer_does_not_grow_with_the_backlog_ahead():
    small, large = ticks_to_first_token("vtc", 10), ticks_to_first_token("vtc", 50)
    assert large <= small
    # Under FCFS the newcomer waits for the whole backlog.
    assert ticks_to_first_token("fcfs", 50) > 5 * large


def test_vtc_lifts_a_returning_tenant_to_the_minimum_counter_without_a_catch_up_burst():
    engine = make_engine(scheduling_policy="vtc", max_batch_size=2, prefill_chunk_size=16,
                         max_pending=1000)
    log = EventLog()
    for i in range(40):
        engine.submit(prompt_token_ids=[i % 200 + 1] * 8, tenant="steady", request_id=f"s{i}",
                      sampling=SamplingParams(max_tokens=8))
    engine.submit(prompt_token_ids=[9] * 8, tenant="returning", request_id="r-early",
                  sampling=SamplingParams(max_tokens=4))
    while log.final("r-early") is None:
        log.add(engine.step())
    for _ in range(60):  # "returning" is idle while "steady" keeps being served
        log.add(engine.step())
    before = engine.stats()["per_key"]
    assert before["returning"]["in_flight"] == 0
    assert before["steady"]["vtc_counter"] > before["returning"]["vtc_counter"] + 100

    for i in range(20):
        engine.submit(prompt_token_ids=[i + 30] * 8, tenant="returning", request_id=f"r{i}",
                      sampling=SamplingParams(max_tokens=8))
    log.add(engine.step())
    after = engine.stats()["per_key"]
    # Lifted to the backlogged minimum: it owns no credit for the time it was away.
    assert after["returning"]["vtc_counter"] >= before["steady"]["vtc_counter"]

    service_before = {k: v["weighted_service"] for k, v in after.items()}
    for _ in range(80):
        log.add(engine.step())
    final = engine.stats()["per_key"]
    gained = {k: final[k]["weighted_service"] - service_before[k] for k in final}
    # Shared about evenly from then on (no burst for the returning tenant).
    bound = 2 * max(W_IN * 8, W_OUT * engine.scheduler.active_kv_budget)
    assert gained["steady"] > 0 and gained["returning"] > 0
    assert abs(gained["returning"] - gained["steady"]) <= min(bound, 0.5 * sum(gained.values()))
    run_until_idle(engine, log)
