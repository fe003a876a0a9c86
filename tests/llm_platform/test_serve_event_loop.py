"""The web process's event loop (``WEB_EVENT_LOOP``): uvloop when installed, asyncio on request,
an unknown choice refused at start; a SIGTERM drains and stops it on either loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.harness.stack import REPO
from tests.support.web_process import WebProcess

pytestmark = pytest.mark.process


@pytest.mark.parametrize("choice, loop", [(None, "uvloop"), ("", "uvloop"),
                                          ("AsyncIO", "asyncio")])
def test_the_web_process_runs_on_the_chosen_loop_and_drains_on_sigterm(tmp_path, settings,
                                                                        choice, loop):
    env = {"REDIS_URL": settings.REDIS_URL, "WEB_DRAIN_S": "5"}
    if choice is not None:  # empty: as unset (a `.env` line `WEB_EVENT_LOOP=`)
        env["WEB_EVENT_LOOP"] = choice
    web = WebProcess(f"sqlite:///{tmp_path}/db.sqlite3", tmp_path / "daphne.log", **env)
    try:
        web.wait_up()
        assert httpx.get(f"{web.url}/readyz", timeout=10).status_code in (200, 503)
        maps = Path(f"/proc/{web.proc.pid}/maps").read_text()
        assert ("uvloop" in maps) == (loop == "uvloop")
        web.proc.send_signal(signal.SIGTERM)
        assert web.proc.wait(20) == 0, web.output()[-3000:]
        assert f"event loop: {loop}" in web.output()
        assert "drained after" in web.output()
    finally:
        if web.proc.poll() is None:
            web.stop(settings.REDIS_URL)


def test_an_unknown_event_loop_is_refused_at_start():
    done = subprocess.run([sys.executable, "-m", "llm_platform.serve", "-p", "0",
                           "llm_platform.asgi:application"], cwd=REPO, capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "WEB_EVENT_LOOP": "trio"})
    assert done.returncode != 0
    assert "WEB_EVENT_LOOP must be auto, uvloop or asyncio, not 'trio'" in done.stderr
