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
    logits once they have generated two tokens (their prefill logits stay valid)."""

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
            generated = row.position + 1 - self.prompt_len[row.row_id]
            if int(row.row_id[1:]) % 5 == 0 and generated >= 2:
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
        for rid in self.engine.backend.poisoned:  # its NaN step ended it, and only it
            final = self.log.final(rid)
            assert final.error is not None and final.error.details["reason"] == "nan_logits", (
                rid, final)


class FaultyVTCMachine(FaultyFCFSMachine):
    policy = "vtc"


TestFaultyFCFSScheduler = FaultyFCFSMachine.TestCase
TestFaultyFCFSScheduler.settings = settings(**_settings)
TestFaultyVTCScheduler = FaultyVTCMachine.TestCase
TestFaultyVTCScheduler.settings = settings(**_settings)
