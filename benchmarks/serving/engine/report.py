"""What a run's figures say: throughput ratios to the peers, the targets (PASS or MISS, printed,
never asserted), the table, and the JSON file."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.serving.engine.systems import DTYPES


@dataclass(frozen=True)
class Target:
    """Engine throughput at least ``factor`` times ``peer``'s on workload ``workload``; ``peer``
    is ``KIND:DTYPE``, or ``KIND:same`` for the peer in the dtype the engine ran in."""

    workload: str
    peer: str
    factor: float


TARGETS = (
    Target("b", "generate:float32", 4.0),
    Target("b", "generate:bfloat16", 2.5),
    Target("b", "generate_batch:bfloat16", 3.0),
    Target("a", "generate:same", 1.2),
    Target("c", "generate:same", 1.2),
)


def _tok_s(row: dict | None) -> float | None:
    value = ((row or {}).get("median") or {}).get("output_tok_s")
    return value if value else None


def peer_label(kind: str, dtype: str | None) -> str | None:
    """The label of peer ``kind`` in ``dtype`` (a resolved dtype name); None without one."""
    return f"{kind}:{dtype}" if dtype in DTYPES else None


def ratios(rows: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Throughput ratios of every row of one workload.

    Args:
        rows: label -> ``{"dtype": resolved dtype name, "median": {"output_tok_s": ...}}``.

    Returns:
        label -> ``x_gen`` and ``x_gb`` (to ``generate`` and ``generate_batch`` in the row's own
        dtype) and ``x_gen_fp32`` (to ``generate:float32``); None where that peer is missing or
        failed.
    """
    out: dict[str, dict[str, float | None]] = {}
    for label, row in rows.items():
        mine, dtype = _tok_s(row), row.get("dtype")

        def to(peer: str | None, mine: float | None = mine) -> float | None:
            base = _tok_s(rows.get(peer)) if peer else None
            return mine / base if mine and base else None

        out[label] = {"x_gen": to(peer_label("generate", dtype)),
                      "x_gb": to(peer_label("generate_batch", dtype)),
                      "x_gen_fp32": to("generate:float32")}
    return out


def check_targets(results: dict[str, dict[str, dict]]) -> list[dict]:
    """Each engine row's :data:`TARGETS` against the results (workload -> label -> row).

    Returns:
        One dict per engine row and target of a workload in the results: ``engine``,
        ``workload``, ``peer`` (the label compared with), ``factor`` (needed), ``measured`` (the
        ratio, None where either side is missing or failed) and ``verdict`` (``PASS``, ``MISS``,
        or ``n/a`` without a measurement).
    """
    engines = list(dict.fromkeys(label for rows in results.values() for label in rows
                                 if label.split(":")[0] == "engine"))
    checks = []
    for engine in engines:
        for target in TARGETS:
            if target.workload not in results:
                continue
            rows = results[target.workload]
            dtype = (rows.get(engine) or {}).get("dtype")
            kind, _, want = target.peer.partition(":")
            peer = peer_label(kind, dtype) if want == "same" else target.peer
            mine, base = _tok_s(rows.get(engine)), _tok_s(rows.get(peer)) if peer else None
            measured = mine / base if mine and base else None
            verdict = "n/a" if measured is None else (
                "PASS" if measured >= target.factor else "MISS")
            checks.append({"engine": engine, "workload": target.workload,
                           "peer": peer or f"{kind} in {dtype or 'its dtype'}",
                           "factor": target.factor, "measured": measured, "verdict": verdict})
    return checks


def format_targets(checks: list[dict]) -> str:
    """The targets summary: one line per check, e.g.
    ``b  engine >= 4.00x generate:float32: 4.31x  PASS``."""
    lines = []
    for c in checks:
        got = "not measured" if c["measured"] is None else f"{c['measured']:.2f}x"
        lines.append(f"{c['workload']}  {c['engine']} >= {c['factor']:.2f}x {c['peer']}: "
                     f"{got}  {c['verdict']}")
    return "\n".join(lines)


DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def format_table(results: dict[str, dict[str, dict]]) -> str:
    """The results (workload -> system label -> row) as a table, with :func:`ratios`."""
    head = (f"{'wl':<3}{'system':<24}{'dtype':>6}{'tok/s':>8}{'x gen':>7}{'x gb':>7}"
            f"{'x gen32':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
            f"{'RSS MB':>8}{'runs':>5}{'busy':>6}")
    lines = [head, "-" * len(head)]
    for wl, systems in results.items():
        by_label = ratios(systems)
        for system, r in systems.items():
            if "error" in r:
                lines.append(f"{wl:<3}{system:<24}  failed: {r['error'].splitlines()[-1][:80]}")
                continue
            m, x = r["median"], by_label[system]

            def fmt(value: float | None) -> str:
                return "-" if value is None else f"{value:.2f}"

            dtype = r.get("dtype", "")
            lines.append(
                f"{wl:<3}{system:<24}{DTYPE_SHORT.get(dtype, dtype):>6}"
                f"{m['output_tok_s']:>8.1f}{fmt(x['x_gen']):>7}{fmt(x['x_gb']):>7}"
                f"{fmt(x['x_gen_fp32']):>8}{m['ttft_p50_s']:>9.2f}s{m['ttft_p99_s']:>9.2f}s"
                f"{m['itl_p50_s'] * 1000:>7.0f}ms{m['itl_p99_s'] * 1000:>7.0f}ms"
                f"{r['peak_rss_bytes'] / 2**20:>8.0f}{len(r['runs']):>5}"
                f"{m.get('foreign_cores', 0):>6.2f}")
    return "\n".join(lines)


def engine_dtypes(results: dict[str, dict[str, dict]]) -> dict[str, str]:
    """Engine label -> the dtype it ran in (what ``auto`` resolved to, for plain ``engine``)."""
    found: dict[str, str] = {}
    for rows in results.values():
        for label, row in rows.items():
            if label.split(":")[0] == "engine" and row.get("dtype"):
                found.setdefault(label, row["dtype"])
    return found


def save(out: Path, quick: bool, descriptions: dict[str, str],
         results: dict[str, dict[str, dict]]) -> None:
    """Write the figures so far, with their ratios, targets and table, as JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "mode": "quick" if quick else "full",
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        "workloads": descriptions,
        "engine_dtypes": engine_dtypes(results),
        "results": results,
        "ratios": {wl: ratios(rows) for wl, rows in results.items()},
        "targets": check_targets(results),
        "table": format_table(results),
    }, indent=2, default=lambda o: asdict(o)))
