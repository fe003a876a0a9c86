"""The rerun of every experiment (``python -m benchmarks.run_all``, ``scripts/benchmarks.sh``): each
command it lists names a module that ``python -m`` runs and flags that module's parser accepts,
every experiment and micro-benchmark is in it, and a run keeps what each step printed and a
summary (no benchmark is run)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from benchmarks import run_all

REPO = Path(__file__).resolve().parents[2]


class Parsed(BaseException):
    """Raised by the patched ``parse_args`` once a module's parser accepted its flags (a
    BaseException, so that no ``except Exception`` of the module swallows it)."""

    def __init__(self, namespace: argparse.Namespace):
        super().__init__()
        self.namespace = namespace


def parse_as_python_m(module: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """Run ``module`` as ``python -m`` does, with ``args``, up to its parser's verdict: the
    namespace when the parser accepts them, each flag spelled out in full (nothing after the
    parser runs).

    Raises:
        AssertionError: when the parser refuses them, with its message.
    """
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, argv=None, namespace=None):
        self.allow_abbrev = False  # a flag renamed to a longer one must not pass as its prefix
        try:
            parsed = original(self, argv, namespace)
        except SystemExit as exc:
            raise AssertionError(f"python -m {module} refuses {shlex.join(args)}") from exc
        raise Parsed(parsed)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [module, *args])
    with warnings.catch_warnings():
        # The module may be imported already (by another test): runpy warns, and runs it anyway.
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except Parsed as done:
            return done.namespace
    raise AssertionError(f"python -m {module} ended without parsing its flags")


def listed(argv: list[str], capsys) -> list[tuple[str, list[str]]]:
    """(module, flags) of every ``python -m`` command ``run_all --list`` prints."""
    assert run_all.main(["--list", *argv]) == 0
    commands = []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("#"):
            continue
        words = shlex.split(line)
        assert words[:2] == ["python", "-m"], line
        commands.append((words[2], words[3:]))
    return commands


def entry_points() -> set[str]:
    """Every experiment and micro-benchmark: each module of ``benchmarks/serving/``,
    ``benchmarks/structured/`` and ``benchmarks/kernels/`` with a ``main``, and each package
    there with a ``__main__``."""
    found = set()
    for folder in ("serving", "structured", "kernels"):
        for path in (REPO / "benchmarks" / folder).iterdir():
            package = (path / "__main__.py").is_file()
            if package or (path.suffix == ".py" and "\ndef main(" in path.read_text()):
                found.add(f"benchmarks.{folder}.{path.stem}")
    return found


@pytest.mark.parametrize("mode", [[], ["--quick"]], ids=["full", "quick"])
def test_every_listed_command_is_a_module_whose_parser_takes_its_flags(mode, tmp_path, capsys,
                                                                       monkeypatch):
    commands = listed([*mode, "--out-dir", str(tmp_path)], capsys)
    assert len(commands) == len(run_all.STEPS)
    for module, flags in commands:
        spec = importlib.util.find_spec(module)
        assert spec is not None, module
        if spec.submodule_search_locations is not None:  # a package: python -m runs __main__
            assert importlib.util.find_spec(f"{module}.__main__") is not None, module
        parse_as_python_m(module, flags, monkeypatch)


def test_the_rerun_holds_every_experiment_and_micro_benchmark(tmp_path, capsys):
    modules = {module for module, _ in listed(["--out-dir", str(tmp_path)], capsys)}
    assert modules == entry_points()
    assert "benchmarks.serving.chaos" in modules and "benchmarks.kernels.lm_head" in modules


@pytest.mark.parametrize("module, good, renamed, attribute, value", [
    ("benchmarks.serving.prefill", ["--long-lens", "96"], ["--long-lenz", "96"], "long_lens", "96"),
    ("benchmarks.serving.chaos", ["--duration-s", "5"], ["--duration", "5"], "duration_s", 5.0),
    ("benchmarks.serving.engine", ["--quick"], ["--quik"], "quick", True),
])
def test_the_checker_catches_a_renamed_flag(module, good, renamed, attribute, value,
                                            monkeypatch):
    with pytest.raises(AssertionError, match=f"refuses {shlex.join(renamed)}"):
        parse_as_python_m(module, renamed, monkeypatch)
    assert getattr(parse_as_python_m(module, good, monkeypatch), attribute) == value


def test_each_step_writes_into_its_own_folder_under_out_dir(tmp_path, capsys):
    commands = listed(["--out-dir", str(tmp_path), "--only", "engine,fairness,chaos,lm_head"],
                      capsys)
    # --only keeps the usual order.
    assert [m for m, _ in commands] == ["benchmarks.serving.fairness", "benchmarks.serving.chaos",
                                        "benchmarks.serving.engine", "benchmarks.kernels.lm_head"]
    fairness, chaos, engine, lm_head = (flags for _, flags in commands)
    assert fairness[-2:] == ["--out-dir", str(tmp_path / "fairness")]
    assert chaos[-4:] == ["--out", str(tmp_path / "chaos" / "report.json"), "--log-dir",
                          str(tmp_path / "chaos" / "logs")]
    assert engine[-2:] == ["--out", str(tmp_path / "engine" / "engine.json")]
    assert "--out" not in lm_head and "--out-dir" not in lm_head


def test_quick_runs_the_same_steps_smaller(tmp_path, capsys):
    full = listed(["--out-dir", str(tmp_path)], capsys)
    quick = listed(["--quick", "--out-dir", str(tmp_path)], capsys)
    assert [m for m, _ in quick] == [m for m, _ in full]
    by_name = dict(zip(run_all.STEP_NAMES, quick, strict=True))
    assert "--quick" in by_name["engine"][1]
    assert by_name["chaos"][1][:2] == ["--duration-s", "20"]


def test_unknown_steps_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        run_all.main(["--list", "--only", "fairness,nope"])
    assert exc.value.code == 2
    assert "unknown 'nope'" in capsys.readouterr().err


def test_a_run_keeps_each_steps_output_its_status_and_a_summary(tmp_path, capsys):
    # Two steps that run no benchmark: this command's own listing, and a refused flag.
    steps = [run_all.Step("listing", "benchmarks.run_all", ("--list", "--only", "lm_head"),
                          ("--list",), run_all.PRINTED, "the listing"),
             run_all.Step("refused", "benchmarks.run_all", ("--only", "nope"), (),
                          run_all.PRINTED, "a refused flag")]
    done = run_all.run_steps(steps, quick=False, out_dir=tmp_path)
    assert [(r["name"], r["returncode"]) for r in done] == [("listing", 0), ("refused", 2)]
    printed = (tmp_path / "listing" / "output.txt").read_text()
    assert "python -m benchmarks.kernels.lm_head" in printed
    assert "unknown 'nope'" in (tmp_path / "refused" / "output.txt").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mode"] == "full" and [s["name"] for s in summary["steps"]] == [
        "listing", "refused"]
    assert summary["steps"][0]["files"] == ["output.txt"]
    out = capsys.readouterr().out
    assert f"results in {tmp_path / 'listing'}/" in out
    assert "refused" in run_all.format_summary(done)


def test_the_script_lists_the_same_commands(tmp_path):
    script = REPO / "scripts" / "benchmarks.sh"
    got = subprocess.run([str(script), "--list", "--out-dir", str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert got.returncode == 0, got.stderr
    lines = [line for line in got.stdout.splitlines() if line.startswith("python -m")]
    assert len(lines) == len(run_all.STEPS)
    assert lines[0].startswith("python -m benchmarks.serving.fairness")
