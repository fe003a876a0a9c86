"""What the experiments share: the results folder, run metadata, engines, tokenizers, plots."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the Agg backend

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"


def machine() -> dict[str, Any]:
    """Where and when a run happened: CPUs, load averages (1, 5, 15 min), time, commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"cpus": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit}


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` with the machine's state added."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {**payload, "machine_after": machine()}
    path.write_text(json.dumps(finite(payload), indent=1, default=float))
    return path


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


_finite = finite  # the former private name


def save_figure(fig: plt.Figure, name: str) -> Path:
    """Save ``benchmarks/results/<name>.png`` (small: 100 dpi) and close the figure."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def reference_tokenizer():
    """The reference backend's byte-level tokenizer (one token per byte)."""
    from inference.backends.reference import ByteTokenizer

    return ByteTokenizer()


def model_tokenizer():
    """The default model's tokenizer (without loading the model)."""
    from inference.backends.hf import HFTokenizer
    from inference.model_store import resolve_model_path

    return HFTokenizer.from_pretrained(resolve_model_path(os.environ.get("MODEL_PATH", "")))


def make_engine(*, real_model: bool, step_delay_s: float = 0.0, **settings: Any):
    """An :class:`~inference.engine.LLMEngine` on the real default model or on the reference
    backend with ``step_delay_s`` seconds per forward pass; ``settings`` are EngineConfig fields.
    """
    from inference.config import EngineConfig
    from inference.engine import LLMEngine

    if real_model:
        return LLMEngine(EngineConfig(backend="transformers", **settings))
    return LLMEngine(EngineConfig(backend="reference", reference_step_delay_s=step_delay_s,
                                  **settings))


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Print rows as a plain aligned table (numbers to 3 significant figures)."""

    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
