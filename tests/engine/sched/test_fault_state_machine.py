"""The scheduler's state machine with a backend that fails: whole passes, and single rows.

Every invariant of ``test_scheduler_state_machine.py`` must still hold after every tick (one
queue per live request, the reservation sum, held + free + evictable blocks = total, gate 1),
every request must still end with exactly one final event (``engine_error`` allowed now, after
any number of its tokens), everything must be released when the engine runs dry, and each row
handed NaN logits must have ended right there with its own error.
"""

from __future__ import annotations

from hypothesis import settings

from inference.engine.backends.reference import ReferenceBackend
from tests.engine.sched.test_scheduler_state_machine import SchedulerMachine, _settings


class ChaosBackend(ReferenceBackend):
    """Every ``fail_every``-th forward pass raises; rows ``r<n>`` with ``n % 5 == 0`` get NaN
    logits once they have generated two tokens (their prefill logits stay valid); each choice
    ``r<n>#<i>`` of a request of ``n`` > 1 choices as its request."""

    def __init__(self, fail_every: int = 7):
        super().__init__()
        self.fail_every = fail_every
        self.passes = 0
        self.prompt_len: dict[str, int] = {}
        self.poisoned: set[str] = set()  # rows that were handed NaN logits

    def _pass(self) -> None:
        self.passes += 1
        if self.passes % self.fail_every == 0:
            raise RuntimeError("injected: the forward pass failed")

    def prefill(self, chunks):
        self._pass()
        for chunk in chunks:
            self.prompt_len[chunk.row_id] = chunk.start_pos + len(chunk.token_ids)
        return super().prefill(chunks)

    def decode(self, rows):
        self._pass()
        logits = super().decode(rows)
        for i, row in enumerate(rows):
            # A forked choice was never prefilled: its request's prompt (the row of choice 0).
            generated = row.position + 1 - self.prompt_len.get(
                row.row_id, self.prompt_len.get(row.row_id.partition("#")[0], 0))
            if int(row.row_id[1:].split("#")[0]) % 5 == 0 and generated >= 2:
                logits[i] = float("nan")
                self.poisoned.add(row.row_id)
        return logits


class FaultyFCFSMachine(SchedulerMachine):
    policy = "fcfs"
    injects_faults = True

    def make_backend(self) -> ReferenceBackend:
        return ChaosBackend()

    def teardown(self) -> None:
        super().teardown()  # the invariants, one final event each, everything released
        if not hasattr(self, "engine"):
            return
        for row in self.engine.backend.poisoned:  # its NaN step ended it, and only it
            rid, _, index = row.partition("#")
            final = self.log.final(rid)
            error = final.choices[int(index or 0)].error if final.choices else final.error
            assert error is not None and error.details["reason"] == "nan_logits", (row, final)


class FaultyVTCMachine(FaultyFCFSMachine):
    policy = "vtc"


TestFaultyFCFSScheduler = FaultyFCFSMachine.TestCase
TestFaultyFCFSScheduler.settings = settings(**_settings)
TestFaultyVTCScheduler = FaultyVTCMachine.TestCase
TestFaultyVTCScheduler.settings = settings(**_settings)


def test_the_choices_of_a_resumed_batch_request_are_never_preempted_one_at_a_time(monkeypatch):
    """A batch request of two choices, preempted while it decodes, resumes: its choices replay
    their tokens as prefilling rows of one group. An interactive request arriving then waits
    for them instead of preempting one alone (which left its other choice running beside the
    resumed request: one request in two queues, its tokens streamed twice)."""
    import tests.engine.sched.test_scheduler_state_machine as machine

    monkeypatch.setattr(machine, "event", lambda *args, **kwargs: None)
    monkeypatch.setattr(machine, "target", lambda *args, **kwargs: None)
    run = FaultyFCFSMachine()
    run.setup(chunk=3, blocks=12, batch=2, queue=2, caching=False, preemptions=0,
              hand_out=False)
    run.tick(2)
    run.submit_batch(max_tokens=5, n=2, priority=0, tail=0, tenant="a")
    run.tick(6)  # both choices decode
    for _ in range(3):
        run.submit_urgent(max_tokens=1, n=1, tail=0, tenant="a")
    run.tick(2)  # the batch request is preempted, resumed, replays its choices
    run.submit_urgent(max_tokens=1, n=1, tail=0, tenant="a")
    run.teardown()  # one queue per request after every tick, one final event each
    assert run.engine.stats()["batch_preemptions"] >= 1
