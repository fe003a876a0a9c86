"""The scheduler as a state machine: random arrivals, sizes, tenants, priorities and aborts,
with priority preemption on or off (preempted requests wait again in the engine, or leave it and
are submitted again from their resume state, as a worker's shared queue does).

After every step the engine's own debug snapshot and stats must show: every live request in
exactly one queue (or handed out after a preemption); ``active_kv_reserved`` equal to the sum of
``prompt_len + max_tokens`` over admitted rows; KV blocks held + free + evictable equal to the
total; no request preempted more than ``max_preemptions`` times. When arrivals stop, every
request ends with exactly one final event after a gap-free run of token events (however often
it was preempted), its usage counts each of its tokens once, and the reservation returns to 0.

Some requests ask ``n`` > 1 choices: prefilled once, forked into ``n`` rows that share the
prompt's full blocks. Then ``active_kv_reserved`` is the sum of every admitted row's part
(``prompt_len + n * max_tokens`` before the fork; ``prompt_len + max_tokens`` for choice 0 and
``max_tokens`` for each other choice after it), a forked request's rows are all in ``active``, it
takes ``n`` rows of the batch, each choice ends exactly once (one final event with one entry per
choice), its token events count on one ``seq``, and no block is left held; it is preempted as a
whole (every choice at once) and resumed as a whole, in the engine or from its resume state.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inference.engine.backends.reference import ReferenceBackend
from inference.engine.llm_engine import InvalidRequestError, QueueFullError
from inference.engine.request import (
    AdapterSpec,
    FinalEvent,
    FinishReason,
    ResumeState,
    SamplingParams,
)
from tests.support.engine import EventLog, make_engine

# A few shared prompt heads so that prefix-cache hits, shared blocks and evictions happen.
HEADS = [list(range(1, 13)), list(range(20, 29)), [7] * 16]


def _adapters() -> list[AdapterSpec]:
    """Five LoRA adapters on disk for the reference backend (config and weights files): four
    that load, and one whose weights changed since their digest was taken (its loads fail)."""
    root = Path(tempfile.mkdtemp(prefix="sm-adapters-"))
    specs = []
    for i in range(5):
        folder = root / f"a{i}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        weights = f"weights of adapter {i}".encode()
        (folder / "adapter_model.safetensors").write_bytes(weights)
        digest = hashlib.sha256(weights if i < 4 else b"before").hexdigest()
        specs.append(AdapterSpec(name=f"base:a{i}", path=str(folder), digest=digest, rank=8))
    return specs


# The run's adapters (None: the bare model, drawn more often); the last one never loads.
ADAPTERS = _adapters()
BROKEN = ADAPTERS[-1].name


class SchedulerMachine(RuleBasedStateMachine):
    policy = "fcfs"
    # A subclass whose backend fails passes or rows (test_fault_state_machine.py) sets this:
    # then a request may also end with engine_error, after any number of its tokens.
    injects_faults = False

    @initialize(chunk=st.sampled_from([0, 1, 3, 8]), blocks=st.integers(12, 40),
                batch=st.integers(1, 5), queue=st.integers(2, 12),
                caching=st.booleans(), preemptions=st.sampled_from([0, 1, 2, 3]),
                hand_out=st.booleans(), loras=st.sampled_from([1, 2, 8]))
    def setup(self, chunk: int, blocks: int, batch: int, queue: int, caching: bool,
              preemptions: int, hand_out: bool, loras: int = 8) -> None:
        self.engine = make_engine(
            self.make_backend(), kv_num_blocks=blocks, kv_block_size=4, max_batch_size=batch,
            prefill_chunk_size=chunk, max_pending=queue, scheduling_policy=self.policy,
            enable_prefix_caching=caching, preemption=preemptions > 0,
            max_preemptions=max(preemptions, 1), max_loras=loras)
        self.adapter_of: dict[str, AdapterSpec | None] = {}
        # Adapters read at once: each run's ticks repeat exactly (hypothesis replays them).
        self.engine.scheduler.state.adapters.read_inline = True
        self.log = EventLog()
        self.submitted: dict[str, tuple[int, int, int]] = {}
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
          priority=st.integers(0, 2), huge=st.integers(0, 9),
          n=st.sampled_from([1, 1, 1, 2, 3]),
          adapter=st.sampled_from([None, None, None, *ADAPTERS]))
    def submit(self, head: int, tail: int, max_tokens: int, tenant: str, priority: int,
               huge: int, n: int = 1, batch: bool = False,
               adapter: AdapterSpec | None = None) -> None:
        prompt = HEADS[head] + [(self.counter * 31 + i) % 250 for i in range(tail)]
        if huge == 0:  # sometimes a request that can never fit
            max_tokens += 400
        self.counter += 1
        rid = f"r{self.counter}"
        sampling = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0 if n > 1 else 0.0,
                                  seed=self.counter)
        key = f"{tenant}:batch" if batch else tenant
        try:
            self.engine.submit(prompt_token_ids=prompt, request_id=rid, tenant=tenant,
                               fairness_key=key, priority=priority, sampling=sampling,
                               batch=batch, adapter=adapter)
        except QueueFullError:
            assert self.engine.num_queued() >= self.engine.config.max_pending
            return
        except InvalidRequestError as exc:  # more choices than rows
            assert n > self.engine.config.max_batch_size
            assert exc.error.details["param"] == "n"
            return
        self.submitted[rid] = (len(prompt), max_tokens, n)
        self.adapter_of[rid] = adapter
        self.prompts[rid] = (prompt, tenant, priority, key, sampling, batch)

    @rule(tail=st.integers(0, 30), max_tokens=st.integers(1, 40), tenant=st.sampled_from("ab"),
          priority=st.integers(0, 3), n=st.sampled_from([1, 1, 2]))
    def submit_batch(self, tail: int, max_tokens: int, tenant: str, priority: int,
                     n: int) -> None:
        """A batch request (any tier: it sorts after every interactive one, and any
        interactive request may preempt it in any phase, however often)."""
        self.submit(head=1, tail=tail, max_tokens=max_tokens, tenant=tenant, priority=priority,
                    huge=1, n=n, batch=True)

    @rule(tail=st.integers(0, 6), max_tokens=st.integers(1, 6), tenant=st.sampled_from("abc"),
          n=st.sampled_from([1, 1, 2]))
    def submit_urgent(self, tail: int, max_tokens: int, tenant: str, n: int) -> None:
        """A request of a tier above every other: it preempts whatever lower rows it needs."""
        self.submit(head=0, tail=tail, max_tokens=max_tokens, tenant=tenant, priority=3, huge=1,
                    n=n)

    def resubmit(self) -> None:
        """Submit the handed-out requests again from their resume state (as a worker that
        takes them from the shared queue does); those the pending queue has no room for wait."""
        for rid, state in list(self.handed_out.items()):
            prompt, tenant, priority, key, sampling, batch = self.prompts[rid]
            # A batch row preempted before its first token starts again from its message.
            again = {} if state.generated or state.choices else {"sampling": sampling}
            try:
                self.engine.submit(prompt_token_ids=prompt, request_id=rid, tenant=tenant,
                                   fairness_key=key, priority=priority, batch=batch,
                                   resume=None if again else state,
                                   adapter=self.adapter_of[rid], **again)
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
        # A forked request's rows (its choices) are all in ``active``: it counts there once.
        queues = {name: list(dict.fromkeys(r["event_id"] for r in snap[name]))
                  for name in ("pending", "prefilling", "active")}
        everywhere = [rid for ids in queues.values() for rid in ids] + list(self.handed_out)
        assert len(everywhere) == len(set(everywhere)), f"a request in two queues: {queues}"
        assert set(everywhere) == self.live_ids(), "live requests and queue contents differ"
        admitted = snap["prefilling"] + snap["active"]
        rows = snap["pending"] + admitted
        # Batch rows have no bound (docs/design.md, "The batch service class").
        assert all(r["preemptions"] <= self.max_preemptions for r in rows if not r["batch"])
        assert all(s.preemptions <= self.max_preemptions for rid, s in self.handed_out.items()
                   if not self.prompts[rid][5])
        # Each request's rows reserve its prompt once and each live choice's whole growth
        # (one row with n choices before its fork; a row per live choice after it).
        reserved: dict[str, int] = {}
        choices: dict[str, int] = {}
        for r in admitted:
            rid = r["event_id"]
            reserved[rid] = reserved.get(rid, 0) + r["reserved_kv_tokens"]
            choices[rid] = choices.get(rid, 0) + r["n"]
            if r["event_id"] != r["request_id"] or r["choice_index"]:
                assert r["n"] == 1, r
        for rid, tokens in reserved.items():
            prompt_len, max_tokens, _ = self.submitted[rid]
            assert tokens == prompt_len + choices[rid] * max_tokens, (rid, admitted)
        assert snap["active_kv_reserved"] == sum(r["reserved_kv_tokens"] for r in admitted)
        assert (sum(r["n"] for r in snap["prefilling"]) + len(snap["active"])
                <= self.engine.config.max_batch_size)
        assert (snap["kv_blocks_held"] + snap["kv_blocks_free"] + snap["kv_blocks_evictable"]
                == snap["kv_blocks_total"])
        held = {b for r in admitted for b in r["blocks"]}
        assert snap["kv_blocks_held"] == len(held)
        assert snap["active_kv_reserved"] <= self.engine.scheduler.active_kv_budget
        stats = self.engine.stats()
        assert stats["num_pending"] == len(queues["pending"])
        assert stats["num_active"] == len(snap["active"])  # rows: a choice each
        assert stats["num_prefilling"] == len(snap["prefilling"])
        if any(r["preemptions"] and (r["n"] > 1 or r["event_id"] != r["request_id"]
                                     or r["choice_index"]) for r in rows) or any(
                s.choices for s in self.handed_out.values()):
            self.choices_preempted = True
        assert stats["active_kv_reserved"] == snap["active_kv_reserved"]
        # LoRA adapters: the pool's bound holds, and every admitted row's adapter is loaded.
        pool = self.engine.scheduler.state.adapters
        assert len(pool.stats()["loaded"]) <= pool.capacity
        for row in self.engine.scheduler.state.prefilling + self.engine.scheduler.state.active:
            assert row.adapter is None or pool.is_loaded(row.adapter.key), row.request_id

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
        event("forked" if self.engine.debug_snapshot()["forked_requests"] else "not forked")
        choices_preempted = getattr(self, "choices_preempted", False)
        event("n choices preempted" if choices_preempted else "no n choices preempted")
        target(float(choices_preempted), label="n choices preempted")
        target(float(preemptions), label="preemptions")  # steer towards runs that preempt
        for rid, (prompt_len, max_tokens, n) in self.submitted.items():
            events = self.log.by_request[rid]
            finals = [e for e in events if isinstance(e, FinalEvent)]
            assert len(finals) == 1, f"{rid} has {len(finals)} final events"
            final = finals[0]
            tokens = len(events) - 1
            if n > 1:
                self.check_choices(rid, events, final, prompt_len, max_tokens, n)
                continue
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
            elif final.finish_reason is FinishReason.ERROR and final.error.code == (
                    "adapter_unavailable"):
                assert final.error.details["adapter"] == BROKEN == self.adapter_of[rid].name
                assert tokens == 0
            elif final.finish_reason is FinishReason.ERROR:
                assert final.error is not None and final.error.code in (
                    "kv_budget_exceeded", "kv_pool_exceeded")
                assert tokens == 0
            else:
                assert final.finish_reason is FinishReason.ABORT and rid in self.aborted
        stats = self.engine.stats()
        assert self.engine.debug_snapshot()["forked_choices"] == sum(
            n for rid, (_, _, n) in self.submitted.items()
            if n > 1 and any(e.type == "token" for e in self.log.by_request[rid]))
        if not self.max_preemptions:  # batch rows are preempted whatever the setting
            assert stats["preemptions"] == stats["batch_preemptions"]
        event("batch preempted" if stats["batch_preemptions"] else "no batch preempted")
        event("adapter evicted" if stats["adapters"]["evictions"] else "no adapter evicted")
        assert stats["active_kv_reserved"] == 0
        assert stats["kv_blocks_held"] == 0
        assert stats["kv_blocks_reserved"] == 0
        assert stats["num_queued"] == 0
        assert all(v["in_flight"] == 0 for v in stats["per_key"].values())

    def check_choices(self, rid: str, events: list, final: FinalEvent, prompt_len: int,
                      max_tokens: int, n: int) -> None:
        """A request of ``n`` choices: one entry per choice in its final event, each choice's
        tokens on its own index, billed once, its end as its tokens say."""
        assert [c.index for c in final.choices] == list(range(n))
        per_choice = [sum(1 for e in events[:-1] if e.index == i) for i in range(n)]
        assert final.usage.completion_tokens == sum(per_choice) == len(events) - 1
        assert final.usage.prompt_tokens <= prompt_len
        if len(events) > 1:  # forked: every choice had its first token
            assert final.usage.prompt_tokens == prompt_len
        for choice, tokens in zip(final.choices, per_choice, strict=True):
            assert choice.completion_tokens == tokens
            if choice.finish_reason is FinishReason.LENGTH:
                assert tokens == max_tokens
            elif choice.finish_reason is FinishReason.ERROR:
                assert choice.error is not None
                if choice.error.code == "adapter_unavailable":
                    assert self.adapter_of[rid].name == BROKEN and tokens == 0
                elif not (self.injects_faults and choice.error.code == "engine_error"):
                    assert choice.error.code in ("kv_budget_exceeded", "kv_pool_exceeded")
                    assert tokens == 0
            else:
                assert choice.finish_reason is FinishReason.ABORT and rid in self.aborted
        if rid in self.aborted and final.finish_reason is FinishReason.ABORT:
            return
        assert final.finish_reason is final.choices[0].finish_reason


class VTCSchedulerMachine(SchedulerMachine):
    policy = "vtc"


_settings = dict(max_examples=60, stateful_step_count=40, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
TestFCFSScheduler = SchedulerMachine.TestCase
TestFCFSScheduler.settings = settings(**_settings)
TestVTCScheduler = VTCSchedulerMachine.TestCase
TestVTCScheduler.settings = settings(**_settings)
