"""Command-line helpers every benchmark script shares: the help formatter, the ``--out-dir``
flag and argparse ``type`` functions (positive and non-negative numbers, name lists,
``TENANT=KEY`` and ``NAME=MS`` pairs)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, except where the default is None (the help
    says what that means) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_out_dir_flag(parser: Any, what: str = "the JSON and PNG files") -> None:
    """``--out-dir``: where an experiment writes its JSON and PNGs."""
    parser.add_argument("--out-dir", default=None, metavar="DIR",
                        help=f"folder for {what} (default: benchmarks/results/)")


def name_list(known: Sequence[str], flag: str = "") -> Callable[[str], list[str]]:
    """argparse ``type``: a comma-separated list of names out of ``known`` (not empty;
    duplicates merged, order kept)."""

    def parse(text: str) -> list[str]:
        names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        valid = ", ".join(known)
        if not names:
            raise argparse.ArgumentTypeError(f"empty list; choose from {valid}")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(repr(n) for n in unknown)}; choose from {valid}")
        return names

    parse.__name__ = flag or "name list"  # what argparse calls the type in its errors
    return parse


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    """argparse ``type``: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must not be negative")
    return value


def positive_float(text: str) -> float:
    """argparse ``type``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number greater than 0")
    return value


def non_negative_float(text: str) -> float:
    """argparse ``type``: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number of at least 0")
    return value


def tenant_key(text: str) -> tuple[str, str]:
    """argparse ``type``: ``TENANT=KEY`` (both non-empty)."""
    tenant, sep, key = text.partition("=")
    if not sep or not tenant.strip() or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not TENANT=KEY (e.g. alice=sk-...)")
    return tenant.strip(), key.strip()


def slo(text: str) -> tuple[str, float]:
    """argparse ``type``: ``NAME=MS`` with NAME one of ttft, tpot, e2el and MS > 0."""
    name, sep, ms = text.partition("=")
    name = name.strip().lower()
    if not sep or name not in ("ttft", "tpot", "e2el"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=MS with NAME one of ttft, tpot, e2el (e.g. ttft=500)")
    try:
        value = float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {ms!r} is not a number of ms") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the limit must be greater than 0 ms")
    return name, value
