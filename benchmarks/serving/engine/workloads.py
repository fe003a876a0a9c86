"""The workloads (the same deterministic requests for every system) and the measurement of one
run: per-request token times, summarised as output tokens/s, TTFT and ITL."""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("a", "b", "c")
SEED = 1234

# Prompts are slices of real prose (flat random token ids would make an atypical workload).
CORPUS = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
    "and a cloth to polish the great lens. Photosynthesis converts light energy into chemical "
    "energy: plants absorb carbon dioxide through their leaves and water through their roots. "
    "In 1869 the first transcontinental railroad in the United States was completed at "
    "Promontory Summit in Utah. To bake bread, mix flour, water, yeast and salt, knead the dough, "
    "let it rise, shape it and bake it until the crust is golden. The Python standard library "
    "has modules for files, dates, regular expressions, networking, JSON and CSV. "
)


@dataclass
class Spec:
    """One request of a workload: its prompt and how many tokens it generates."""

    prompt: list[int]
    max_tokens: int


@dataclass
class Workload:
    """A workload: its requests and how many the closed-loop client keeps in flight."""

    name: str
    description: str
    requests: list[Spec]
    concurrency: int


def build_workload(name: str, quick: bool, corpus_ids: list[int]) -> Workload:
    """The deterministic requests of workload ``name`` (the same for every system)."""
    rng = random.Random(f"{SEED}-{name}-{quick}")

    def prompt(length: int) -> list[int]:
        start = rng.randrange(0, len(corpus_ids) - length)
        return corpus_ids[start:start + length]

    if name == "a":
        n_new = 32 if quick else 64
        reqs = [Spec(prompt(40), n_new) for _ in range(32)]
        return Workload(name, f"fixed: 32 x (40 prompt + {n_new} new), 32 concurrent", reqs, 32)
    if name == "b":
        count, conc, top = (24, 12, 96) if quick else (64, 32, 192)
        reqs = [Spec(prompt(rng.randint(16, 384)), rng.randint(16, top)) for _ in range(count)]
        return Workload(name, f"mixed: {count} reqs, prompts 16-384, max_tokens 16-{top}, "
                              f"{conc} concurrent", reqs, conc)
    if name == "c":
        count, n_new = (2, 32) if quick else (4, 64)
        reqs = [Spec(prompt(40), n_new) for _ in range(count)]
        return Workload(name, f"batch 1: {count} x (40 prompt + {n_new} new), 1 at a time",
                        reqs, 1)
    raise ValueError(f"unknown workload {name!r}")


# --------------------------------------------------------------------------- measurement


@dataclass
class Trace:
    """Per-request submission time and token times (``time.perf_counter`` seconds)."""

    submitted: float
    token_times: list[float]


def summarize(traces: list[Trace], started: float, ended: float) -> dict[str, float]:
    """Output tokens/s, TTFT and ITL percentiles (seconds) of one run."""
    tokens = sum(len(t.token_times) for t in traces)
    ttft = [t.token_times[0] - t.submitted for t in traces if t.token_times]
    itl = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    return {
        "output_tokens": tokens,
        "wall_s": ended - started,
        "output_tok_s": tokens / (ended - started),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
