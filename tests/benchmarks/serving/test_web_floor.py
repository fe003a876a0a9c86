"""The web-floor benchmark: each application on each loop streams every chunk to every client,
and the figures are daphne's CPU time per write (a short run)."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import web_floor

pytestmark = pytest.mark.process


def test_each_app_on_each_loop_delivers_every_write_and_reports_its_cpu(tmp_path, capsys):
    assert web_floor.main(["--streams", "3", "--writes", "5", "--gap-ms", "5",
                           "--out-dir", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "web_floor.json").read_text())["runs"]
    assert [(r["app"], r["loop"]) for r in runs] == [
        ("asgi", "asyncio"), ("asgi", "uvloop"), ("django", "asyncio"), ("django", "uvloop")]
    for r in runs:
        assert r["writes"] == 15  # every chunk of every stream, once
        # (psutil counts CPU in 10 ms steps: a run this short may read 0)
        assert r["cpu_s"] >= 0 and r["us_per_write"] == pytest.approx(1e6 * r["cpu_s"] / 15)
    assert "daphne CPU us/write" in capsys.readouterr().out


def test_an_unknown_app_or_loop_is_an_argparse_error(capsys):
    for argv in (["--apps", "flask"], ["--loops", "trio"]):
        with pytest.raises(SystemExit) as exc:
            web_floor.main(argv)
        assert exc.value.code == 2
