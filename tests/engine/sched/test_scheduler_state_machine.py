"""The scheduler as a state machine: random arrivals, sizes, tenants, priorities and aborts,
with priority preemption on or off (preempted requests wait again in the engine, or leave it and
are submitted again from their resume state, as a worker's shared queue does).

After every step the engine's own debug snapshot and stats must show: every live request in
exactly one queue (or handed out after a preemption); ``active_kv_reserved`` equal to the sum of
``prompt_len + max_tokens`` over admitted rows; KV blocks held + free + evictable equal to the
total; no request preempted more than ``max_preemptions`` times. When arrivals stop, every
request ends with exactly one final event after a gap-free run of token events (however often
it was preempted), its usage counts each of its tokens once, and the reservation returns to 0.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.llm_engine import QueueFullError
from inference.engine.request import FinalEvent, FinishReason, ResumeState, SamplingParams
from tests.support.engine import EventLog, make_engine

# A few shared prompt heads so that prefix-cache hits, shared blocks and evictions happen.
HEADS = [list(range(1, 13)), list(range(20, 29)), [7] * 16]


class SchedulerMachine(RuleBasedStateMachine):
    policy = "fcfs"
    # A subclass whose backend fails passes or rows (test_fault_state_machine.py) sets this:
    # then a request may also end with engine_error, after any number of its tokens.
    injects_faults = False

    @initialize(chunk=st.sampled_from([0, 1, 3, 8]), blocks=st.integers(12, 40),
                batch=st.integers(1, 5), queue=st.integers(2, 12),
                caching=st.booleans(), preemptions=st.sampled_from([0, 1, 2, 3]),
                hand_out=st.booleans())
    def setup(self, chunk: int, blocks: int, batch: int, queue: int, caching: bool,
              preemptions: int, hand_out: bool) -> None:
        self.engine = make_engine(
            self.make_backend(), kv_num_blocks=blocks, kv_block_size=4, max_batch_size=batch,
            prefill_chunk_size=chunk, max_pending=queue, scheduling_policy=self.policy,
            enable_prefix_caching=caching, preemption=preemptions > 0,
            max_preemptions=max(preemptions, 1))
        self.log = EventLog()
        self.submitted: dict[str, tuple[int, int]] = {}
        self.prompts: dict[str, tuple[list[int], str, int]] = {}
        self.aborted: set[str] = set()
        self.counter = 0
        # Preempted requests handed out by the engine, not yet submitted again (a worker's
        # shared queue); with hand_out False they wait again in the engine itself.
        self.handed_out: dict[str, ResumeState] = {}
        if hand_out:
            self.engine.preempt_sink = self.collect
        self.max_preemptions = preemptions

    def collect(self, states: list[ResumeState]) -> None:
        for state in states:
            assert state.request_id not in self.handed_out
            self.handed_out[state.request_id] = state

    def make_backend(self) -> ReferenceBackend | None:
        """The engine's backend (None: the plain reference backend)."""
        return None

    def live_ids(self) -> set[str]:
        return {rid for rid in self.submitted if self.log.final(rid) is None}

    @rule(head=st.sampled_from(range(len(HEADS))), tail=st.integers(0, 30),
          max_tokens=st.integers(1, 40), tenant=st.sampled_from("abc"),
          priority=st.integers(0, 2), huge=st.integers(0, 9))
    def submit(self, head: int, tail: int, max_tokens: int, tenant: str, priority: int,
               huge: int) -> None:
        prompt = HEADS[head] + [(self.counter * 31 + i) % 250 for i in range(tail)]
        if huge == 0:  # sometimes a request that can never fit
            max_tokens += 400
        self.counter += 1
        rid = f"r{self.counter}"
        try:
            self.engine.submit(prompt_token_ids=prompt, request_id=rid, tenant=tenant,
                               priority=priority, sampling=SamplingParams(max_tokens=max_tokens))
        except QueueFullError:
            assert self.engine.num_queued() >= self.engine.config.max_pending
            return
        self.submitted[rid] = (len(prompt), max_tokens)
        self.prompts[rid] = (prompt, tenant, priority)

    @rule(tail=st.integers(0, 6), max_tokens=st.integers(1, 6), tenant=st.sampled_from("abc"))
    def submit_urgent(self, tail: int, max_tokens: int, tenant: str) -> None:
        """A request of a tier above every other: it preempts whatever lower rows it needs."""
        self.submit(head=0, tail=tail, max_tokens=max_tokens, tenant=tenant, priority=3, huge=1)

    def resubmit(self) -> None:
        """Submit the handed-out requests again from their resume state (as a worker that
        takes them from the shared queue does); those the pending queue has no room for wait."""
        for rid, state in list(self.handed_out.items()):
            prompt, tenant, priority = self.prompts[rid]
            try:
                self.engine.submit(prompt_token_ids=prompt, request_id=rid, tenant=tenant,
                                   priority=priority, resume=state)
            except QueueFullError:
                return
            del self.handed_out[rid]

    @precondition(lambda self: self.submitted)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.submitted)))
        self.aborted.add(rid)
        self.engine.abort(rid)

    @rule(n=st.integers(1, 8))
    def tick(self, n: int) -> None:
        for _ in range(n):
            self.log.add(self.engine.step())
            self.check_snapshot()
            self.resubmit()

    def check_snapshot(self) -> None:
        snap = self.engine.debug_snapshot()
        queues = {name: [r["request_id"] for r in snap[name]]
                  for name in ("pending", "prefilling", "active")}
        everywhere = [rid for ids in queues.values() for rid in ids] + list(self.handed_out)
        assert len(everywhere) == len(set(everywhere)), f"a request in two queues: {queues}"
        assert set(everywhere) == self.live_ids(), "live requests and queue contents differ"
        admitted = snap["prefilling"] + snap["active"]
        rows = snap["pending"] + admitted
        assert all(r["preemptions"] <= self.max_preemptions for r in rows)
        assert all(s.preemptions <= self.max_preemptions for s in self.handed_out.values())
        assert snap["active_kv_reserved"] == sum(r["prompt_len"] + r["max_tokens"]
                                                 for r in admitted)
        assert len(admitted) <= self.engine.config.max_batch_size
        assert (snap["kv_blocks_held"] + snap["kv_blocks_free"] + snap["kv_blocks_evictable"]
                == snap["kv_blocks_total"])
        held = {b for r in admitted for b in r["blocks"]}
        assert snap["kv_blocks_held"] == len(held)
        assert snap["active_kv_reserved"] <= self.engine.scheduler.active_kv_budget
        stats = self.engine.stats()
        assert stats["num_pending"] == len(queues["pending"])
        assert stats["num_active"] == len(queues["active"])
        assert stats["num_prefilling"] == len(queues["prefilling"])
        assert stats["active_kv_reserved"] == snap["active_kv_reserved"]

    @invariant()
    def gate_one_bound(self) -> None:
        if hasattr(self, "engine"):
            # A preempted request waiting again in the engine counts as queued, beyond the
            # bound that submissions respect.
            resumed = sum(1 for r in self.engine.debug_snapshot()["pending"]
                          if r["preemptions"] > 0)
            assert self.engine.num_queued() <= self.engine.config.max_pending + resumed

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for _ in range(5000):
            self.resubmit()
            if not self.engine.has_work() and not self.handed_out:
                break
            self.log.add(self.engine.step())
            self.check_snapshot()
        assert not self.engine.has_work(), f"hang: {self.engine.stats()}"
        preemptions = self.engine.stats()["preemptions"]
        event("preempted" if preemptions else "not preempted")
        target(float(preemptions), label="preemptions")  # steer towards runs that preempt
        for rid, (prompt_len, max_tokens) in self.submitted.items():
            events = self.log.by_request[rid]
            finals = [e for e in events if isinstance(e, FinalEvent)]
            assert len(finals) == 1, f"{rid} has {len(finals)} final events"
            final = finals[0]
            tokens = len(events) - 1
            if tokens:
                assert final.usage.prompt_tokens == prompt_len
            else:  # stopped before its first token: the prompt tokens computed by then
                assert 0 <= final.usage.prompt_tokens <= prompt_len
            assert final.usage.completion_tokens == tokens, "each token billed once"
            if final.finish_reason is FinishReason.LENGTH:
                assert tokens == max_tokens
            elif (final.finish_reason is FinishReason.ERROR and self.injects_faults
                  and final.error is not None and final.error.code == "engine_error"):
                assert tokens <= max_tokens
            elif final.finish_reason is FinishReason.ERROR:
                assert final.error is not None and final.error.code in (
                    "kv_budget_exceeded", "kv_pool_exceeded")
                assert tokens == 0
            else:
                assert final.finish_reason is FinishReason.ABORT and rid in self.aborted
        stats = self.engine.stats()
        if not self.max_preemptions:
            assert stats["preemptions"] == 0
        assert stats["active_kv_reserved"] == 0
        assert stats["kv_blocks_held"] == 0
        assert stats["kv_blocks_reserved"] == 0
        assert stats["num_queued"] == 0
        assert all(v["in_flight"] == 0 for v in stats["per_key"].values())


class VTCSchedulerMachine(SchedulerMachine):
    policy = "vtc"


_settings = dict(max_examples=60, stateful_step_count=40, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
TestFCFSScheduler = SchedulerMachine.TestCase
TestFCFSScheduler.settings = settings(**_settings)
TestVTCScheduler = VTCSchedulerMachine.TestCase
TestVTCScheduler.settings = settings(**_settings)
