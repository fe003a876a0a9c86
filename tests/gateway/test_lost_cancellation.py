"""The web tier's background loops end when cancelled, also when a Redis call swallowed the
cancellation (Python 3.11's ``asyncio.wait_for``, inside redis-py, loses one that arrives as
the call completes): otherwise an event loop's shutdown waits for them forever (a web process
that never exits; a test whose request never returns)."""

from __future__ import annotations

import asyncio
import contextlib

from gateway import event_reader, monitor


async def swallowing(delay_s: float = 0.05):
    """An await that loses a cancellation arriving during it, as redis-py's can."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(delay_s)


def run(coro):
    """Run ``coro`` on a loop of its own, closed without waiting for the tasks left (a loop
    that never ends would hold ``asyncio.run`` forever: the test fails instead)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def cancel_and_wait(task: asyncio.Task) -> bool:
    await asyncio.sleep(0.01)  # inside the swallowing await
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2.0)
    return task in done


def test_the_web_monitor_ends_when_a_round_swallowed_its_cancellation(monkeypatch):
    async def beat(self):
        await swallowing()

    monkeypatch.setattr(monitor.Monitor, "beat", beat)

    async def go():
        watcher = monitor.Monitor()
        watcher.start()
        return await cancel_and_wait(watcher._task), watcher._task

    ended, task = run(go())
    assert ended and task.cancelled()


def test_the_event_reader_ends_when_a_read_swallowed_its_cancellation(monkeypatch):
    async def xread(self, client, reads):
        await swallowing()
        return []

    monkeypatch.setattr(event_reader.EventReader, "_xread", xread)
    monkeypatch.setattr(event_reader.EventReader, "_dispatch", lambda self, reads, replies: None)

    async def go():
        reader = event_reader.EventReader()
        sub = reader.subscribe("test:events:x")
        ended = await cancel_and_wait(reader._task)
        sub.close()
        return ended, reader._task

    ended, task = run(go())
    assert ended and task.cancelled()

