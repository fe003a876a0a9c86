"""The prefill experiment's modes (``--modes``): the grammar of one entry (``default``,
``control``, ``monolithic``, ``chunked[:N]``, ``mixed_batch[:N]``, ``itl:MS``, terms joined with
``+``), the engine settings each gives, and which of them the engine refuses."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

PREFILL_TERMS = ("monolithic", "chunked", "mixed_batch")


@dataclass(frozen=True)
class Mode:
    """One parsed ``--modes`` entry.

    Attributes:
        name: the canonical name (``chunked`` alone becomes ``chunked:<--chunk>``).
        settings: EngineConfig fields it sets (none for ``default`` and ``control``).
        control: whether its workload leaves the long prompts out.
    """

    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    control: bool = False


def parse_mode(text: str, chunk: int = 256) -> Mode:
    """A ``--modes`` entry as a :class:`Mode` (``chunk``: tokens of ``chunked`` alone).

    Raises:
        ValueError: for an unknown term, a bad number, two prefill terms or two ``itl`` terms,
            or ``default`` combined with anything.
    """
    terms = [t.strip() for t in text.split("+")]
    if not text.strip() or not all(terms):
        raise ValueError(f"empty mode in {text!r}")
    if "default" in terms:
        if terms != ["default"]:
            raise ValueError(f"{text!r}: default takes no other term")
        return Mode("default")
    settings: dict[str, Any] = {}
    names: list[str] = []
    control = False
    for term in terms:
        word, sep, value = term.partition(":")
        if word == "control" and not sep:
            if control:
                raise ValueError(f"{text!r}: control twice")
            control = True
        elif word in PREFILL_TERMS:
            if "prefill_mode" in settings:
                raise ValueError(f"{text!r}: more than one prefill mode")
            settings["prefill_mode"] = word
            if word == "monolithic":
                if sep:
                    raise ValueError(f"{text!r}: monolithic takes no chunk size")
                names.append(word)
                continue
            if sep or word == "chunked":
                size = _number(value, int, term) if sep else chunk
                settings["prefill_chunk_size"] = size
                names.append(f"{word}:{size}")
            else:
                names.append(word)
        elif word == "itl" and sep:
            if "target_itl_ms" in settings:
                raise ValueError(f"{text!r}: more than one itl term")
            ms = _number(value, float, term, allow_zero=True)
            settings["target_itl_ms"] = ms
            names.append(f"itl:{ms:g}")
        else:
            raise ValueError(
                f"unknown mode term {term!r}; use default, control, monolithic, chunked[:N], "
                "mixed_batch[:N] or itl:MS, joined with +")
    # Canonical order: control, the prefill mode, the ITL target.
    names.sort(key=lambda n: n.startswith("itl:"))
    return Mode("+".join((["control"] if control else []) + names), settings, control)


def _number(text: str, kind: type, term: str, allow_zero: bool = False) -> Any:
    """``text`` as a finite ``kind`` above 0 (or at least 0 with ``allow_zero``)."""
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{term!r}: {text!r} is not a number") from None
    low_ok = value >= 0 if allow_zero else value > 0
    if not low_ok or value == float("inf"):  # NaN fails both comparisons
        least = "at least 0" if allow_zero else "greater than 0"
        raise ValueError(f"{term!r}: {text} must be {least}")
    return value


def mode_list(chunk: int) -> Any:
    """argparse ``type`` of ``--modes``: comma-separated :func:`parse_mode` entries (not empty;
    duplicates by canonical name merged, order kept)."""

    def parse(text: str) -> list[Mode]:
        modes: dict[str, Mode] = {}
        for item in text.split(","):
            if item.strip():
                try:
                    mode = parse_mode(item, chunk)
                except ValueError as exc:
                    raise argparse.ArgumentTypeError(str(exc)) from None
                modes.setdefault(mode.name, mode)
        if not modes:
            raise argparse.ArgumentTypeError("empty list of modes")
        return list(modes.values())

    parse.__name__ = "mode list"
    return parse


def engine_settings(mode: Mode, args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields of a mode's engine: the run's sizes, ``--dtype`` and the mode's."""
    return {"max_batch_size": args.batch, "kv_num_blocks": 1024, "max_pending": 1000,
            "dtype": args.dtype, **mode.settings}


def check_modes(modes: list[Mode], args: argparse.Namespace) -> list[str]:
    """Each mode whose settings EngineConfig refuses, with the reason (checked without loading a
    model)."""
    from pydantic import ValidationError

    from inference.engine.config import EngineConfig

    refused = []
    for mode in modes:
        try:
            EngineConfig(backend="transformers", **engine_settings(mode, args))
        except ValidationError as exc:
            reason = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}"
                               for e in exc.errors())
            refused.append(f"{mode.name}: {reason}")
    return refused
