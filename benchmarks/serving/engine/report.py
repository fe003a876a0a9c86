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
    is ``KIND:DTYPE``, or ``KIND:same`` for the peer in the dtype the engine ran in.
    ``engine_dtype``: the target holds only for an engine row in that dtype (same-dtype
    comparisons with llama.cpp's bf16 GGUF), and only on a CPU with native bf16 dot products
    (``avx512_bf16``); elsewhere its ratio is printed as ``report`` only."""

    workload: str
    peer: str
    factor: float
    engine_dtype: str | None = None


TARGETS = (
    Target("b", "generate:float32", 4.0),
    Target("b", "generate:bfloat16", 2.5),
    Target("b", "generate_batch:bfloat16", 3.0),
    Target("a", "generate:same", 1.2),
    Target("c", "generate:same", 1.2),
    Target("c", "llama_server:bfloat16", 0.95, engine_dtype="bfloat16"),
    Target("c", "llama_server:q4_1", 1.2, engine_dtype="q4_1"),
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
        dtype), ``x_gen_fp32`` (to ``generate:float32``) and ``x_lcpp`` and ``x_lcpp_q4`` (to
        llama.cpp's server on the bf16 and the Q4_1 GGUF); None where that peer is missing or
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
                      "x_gen_fp32": to("generate:float32"),
                      "x_lcpp": to("llama_server:bfloat16"),
                      "x_lcpp_q4": to("llama_server:q4_1")}
    return out


def check_targets(results: dict[str, dict[str, dict]], bf16_cpu: bool = True) -> list[dict]:
    """Each engine row's :data:`TARGETS` against the results (workload -> label -> row);
    ``bf16_cpu``: whether this CPU has native bf16 dot products (``avx512_bf16``).

    Returns:
        One dict per engine row and target of a workload in the results: ``engine``,
        ``workload``, ``peer`` (the label compared with), ``factor`` (needed), ``measured`` (the
        ratio, None where either side is missing or failed) and ``verdict`` (``PASS``, ``MISS``,
        ``n/a`` without a measurement, ``report`` for a bf16 target on a CPU without native
        bf16). A target for another ``engine_dtype`` than the row's is left out (a q4_1 row has
        only its own), and one against llama.cpp when the run had no such row.
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
            if target.engine_dtype != dtype and (target.engine_dtype or dtype == "q4_1"):
                continue  # another dtype's target (transformers has no q4_1 peer)
            if target.peer.startswith("llama_server") and target.peer not in rows:
                continue  # llama.cpp was not part of this run
            kind, _, want = target.peer.partition(":")
            peer = peer_label(kind, dtype) if want == "same" else target.peer
            mine, base = _tok_s(rows.get(engine)), _tok_s(rows.get(peer)) if peer else None
            measured = mine / base if mine and base else None
            verdict = "n/a" if measured is None else (
                "report" if target.engine_dtype == "bfloat16" and not bf16_cpu else
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


DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "q4_1": "q4_1"}


def format_table(results: dict[str, dict[str, dict]]) -> str:
    """The results (workload -> system label -> row) as a table, with :func:`ratios`."""
    head = (f"{'wl':<3}{'system':<24}{'dtype':>6}{'tok/s':>8}{'x gen':>7}{'x gb':>7}"
            f"{'x gen32':>8}{'x lcpp':>7}{'x lq4':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'ITL p50':>9}{'ITL p99':>9}"
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
                f"{fmt(x['x_gen_fp32']):>8}{fmt(x['x_lcpp']):>7}{fmt(x['x_lcpp_q4']):>7}"
                f"{m['ttft_p50_s']:>9.2f}s{m['ttft_p99_s']:>9.2f}s"
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


def bandwidth_rows(rows: dict[str, dict], weight_bytes: dict[str, int],
                   read_gbs: float | None) -> list[dict]:
    """What a single stream's decode achieves in memory traffic (workload c's rows).

    Args:
        rows: label -> row of workload c.
        weight_bytes: label -> bytes of weights one decode step reads (every projection and the
            LM head once: the parameters times the dtype's size; a GGUF's file size).
        read_gbs: the machine's read bandwidth measured in the same run (GB/s), or None.

    Returns:
        One dict per row with a figure: ``system``, ``weight_mb``, ``itl_p50_ms``, ``gbs`` (the
        weights over the ITL p50) and ``share`` (of ``read_gbs``; None without it).
    """
    out = []
    for label, row in rows.items():
        itl = ((row or {}).get("median") or {}).get("itl_p50_s")
        if not itl or label not in weight_bytes:
            continue
        gbs = weight_bytes[label] / itl / 1e9
        out.append({"system": label, "weight_mb": weight_bytes[label] / 1e6,
                    "itl_p50_ms": itl * 1000, "gbs": gbs,
                    "share": gbs / read_gbs if read_gbs else None})
    return out


def format_bandwidth(table: list[dict], read_gbs: float | None) -> str:
    """:func:`bandwidth_rows` as lines, the measured read bandwidth first."""
    lines = [f"read bandwidth (this run, torch sum over 1 GiB): "
             f"{read_gbs:.1f} GB/s" if read_gbs else "read bandwidth: not measured"]
    for r in table:
        share = "" if r["share"] is None else f" = {r['share']:.0%} of it"
        lines.append(f"  {r['system']:<24}{r['weight_mb']:>7.0f} MB / ITL p50 "
                     f"{r['itl_p50_ms']:.1f} ms = {r['gbs']:.1f} GB/s{share}")
    return "\n".join(lines)


def save(out: Path, quick: bool, descriptions: dict[str, str],
         results: dict[str, dict[str, dict]], extra: dict | None = None) -> None:
    """Write the figures so far, with their ratios, targets and table, as JSON (``extra``: more
    top-level entries, e.g. the CPU and the bandwidth table)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        **(extra or {}),
        "mode": "quick" if quick else "full",
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        "workloads": descriptions,
        "engine_dtypes": engine_dtypes(results),
        "results": results,
        "ratios": {wl: ratios(rows) for wl, rows in results.items()},
        "targets": check_targets(results, (extra or {}).get("cpu", {}).get("avx512_bf16", True)),
        "table": format_table(results),
    }, indent=2, default=lambda o: asdict(o)))
