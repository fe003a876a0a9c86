"""The structured workload's tables, ratios and targets: printed, and as a markdown section
(figures table, CPU, command) for ``docs/benchmarks.md``."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

TARGET_RATIO = 3.0  # platform output tokens/s over transformers'
ITL_AIM = 0.10  # constrained neighbours' ITL p50 within this share of unconstrained ones'


def _num(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.{digits}g}"
    return str(value)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def mask_ms(counters: dict[str, Any] | None) -> float | None:
    """ms per constrained row per step: mask seconds over masks (None without any)."""
    if not counters or not counters.get("masks"):
        return None
    return 1000 * counters["mask_seconds"] / counters["masks"]


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """The ratios and targets: platform (and engine) over transformers, validity, the ITL cost
    of constrained neighbours, jump-forward and mask overlap on against off."""
    wl = results["workload"]
    rest, hf = wl.get("platform (REST)", {}), wl.get("transformers generate", {})
    out: dict[str, Any] = {
        "platform_over_transformers": _ratio(rest.get("tok_s"), hf.get("tok_s")),
        "engine_over_transformers": _ratio(wl.get("engine in-process", {}).get("tok_s"),
                                           hf.get("tok_s")),
        "all_valid": {k: v.get("valid_share") == 1.0 for k, v in wl.items() if "error" not in v},
    }
    ratio = out["platform_over_transformers"]
    out["ratio_pass"] = None if ratio is None else ratio >= TARGET_RATIO
    itl = {r["run"]: r for r in results.get("itl", [])}
    base = itl.get("unconstrained neighbours")
    for key, run in (("itl_cost", "constrained neighbours"), ("itl_cost_vs_alone", "alone"),
                     ("itl_cost_flipped", _flipped_itl(itl))):
        other = itl.get(run) if run else None
        if other is None or base is None:
            continue
        if key == "itl_cost_vs_alone":  # constrained neighbours against the streams alone
            ratio = paired(itl.get("constrained neighbours"), other, "itl_p50_ms")
        else:
            ratio = paired(other, base, "itl_p50_ms")
        if ratio is not None:
            out[key] = {**ratio, "median": ratio["median"] - 1,
                        "rounds": [r - 1 for r in ratio["rounds"]]}
    if "itl_cost" in out:
        out["itl_pass"] = out["itl_cost"]["median"] <= ITL_AIM
    for key, field, label in (("jump", "structured_jump_forward", "jump-forward"),
                              ("overlap", "structured_mask_overlap", "mask overlap")):
        on, off = switch_runs(results, field, label)
        ratio = paired(on, off, "tok_s")
        if ratio is not None:
            out[f"{key}_speedup"] = ratio
    return out


def _flipped_itl(itl: dict[str, Any]) -> str | None:
    return next((name for name in itl if name.startswith("constrained, jump-forward")), None)


def paired(a: dict[str, Any] | None, b: dict[str, Any] | None,
           key: str) -> dict[str, Any] | None:
    """``a``'s figure over ``b``'s, round by round (``<key>_runs``: both ran once per round,
    one after the other), and the median of those ratios; the medians' ratio with one round."""
    if not a or not b or a.get(key) is None or not b.get(key):
        return None
    xs, ys = a.get(f"{key}_runs") or [a[key]], b.get(f"{key}_runs") or [b[key]]
    rounds = [x / y for x, y in zip(xs, ys, strict=False) if x is not None and y]
    if not rounds:
        return None
    return {"median": statistics.median(rounds), "rounds": rounds}


def switch_runs(results: dict[str, Any], field: str,
                label: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the run with the switch on, the run with it off): the defaults' run and the run that
    flipped it, whichever way the default is."""
    st = results["settings"]
    default = results.get("defaults", {}).get(field, True)
    flipped = st.get(f"{label} {'off' if default else 'on'}")
    base = st.get("engine")
    return (base, flipped) if default else (flipped, base)


def _fmt_rounds(ratio: dict[str, Any], pct: bool = False) -> str:
    shown = [f"{100 * r:+.1f} %" if pct else f"{r:.2f}x" for r in ratio["rounds"]]
    return f" (rounds: {', '.join(shown)})" if len(shown) > 1 else ""


def workload_rows(results: dict[str, Any]) -> list[list[str]]:
    """Part 1's table: one row per system."""
    rows = []
    for name, r in results["workload"].items():
        if "error" in r:
            rows.append([name, "failed", "", "", "", "", "", r["error"][:60]])
            continue
        rows.append([name, _num(r["tok_s"]), _num(r["wall_s"]), str(r["completion_tokens"]),
                     f"{r['stop']}/{r['requests']}", str(r["length"]),
                     f"{r['valid']}/{r['stop']} ({_pct(r['valid_share'])})", _num(r["busy"], 2)])
    return rows


WORKLOAD_COLS = ["system", "tok/s", "wall s", "tokens", "stop", "length", "valid of stop", "busy"]
ITL_COLS = ["streams beside", "ITL p50 ms", "ITL p90 ms", "stream tok/s", "neighbour tok/s",
            "neighbours done", "busy"]
SETTINGS_COLS = ["engine setting", "tok/s", "forced share", "mask ms/row", "mask wait s",
                 "mask s on path", "masks", "valid of stop", "busy"]


def itl_rows(results: dict[str, Any]) -> list[list[str]]:
    """Part 3's table: the streams alone, beside unconstrained and constrained neighbours."""
    return [[f"{r['run']} ({r['neighbours']})" if r["neighbours"] else r["run"],
             _num(r["itl_p50_ms"]), _num(r["itl_p90_ms"]), _num(r["stream_tok_s"]),
             _num(r["neighbour_tok_s"]) if r["neighbours"] else "",
             str(r["neighbours_done"]), _num(r["busy"], 2)] for r in results.get("itl", [])]


def on_path_s(run: dict[str, Any]) -> float:
    """Seconds the compute thread spent on masks: its waits for masks computed ahead (overlap
    on), or every mask's own time (overlap off: it computes them itself)."""
    if run.get("settings", {}).get("structured_mask_overlap", True):
        return run["mask_wait_seconds"]
    return run["mask_seconds"]


def settings_rows(results: dict[str, Any]) -> list[list[str]]:
    """Parts 2, 4 and 5: the engine's defaults and each switch flipped."""
    return [[name, _num(r["tok_s"]), _pct(r["forced_share"]), _num(mask_ms(r)),
             _num(r["mask_wait_seconds"]), _num(on_path_s(r)), str(r["masks"]),
             f"{r['valid']}/{r['stop']}", _num(r["busy"], 2)]
            for name, r in results["settings"].items()]


def _table(columns: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _md_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The ratios, targets and mask costs as sentences (each names the CPU)."""
    v, cpu, wl, st = verdicts(results), results["cpu"]["label"], results["workload"], \
        results["settings"]
    lines = []
    if v["platform_over_transformers"] is not None:
        lines.append(f"platform / transformers output tok/s: {v['platform_over_transformers']:.2f}x"
                     f" (target >= {TARGET_RATIO:g}x): {'PASS' if v['ratio_pass'] else 'MISS'}"
                     f" [{cpu}]")
    if v["engine_over_transformers"] is not None:
        lines.append(f"engine in-process / transformers output tok/s: "
                     f"{v['engine_over_transformers']:.2f}x [{cpu}]")
    for name, ok in v["all_valid"].items():
        lines.append(f"{name}: {_pct(wl[name]['valid_share'])} of stop answers valid "
                     f"(target 100 %): {'PASS' if ok else 'MISS'}; {wl[name]['length']} ended "
                     f"with length")
    engine_ms = mask_ms(st.get("engine"))
    if engine_ms is not None:
        lines.append(f"mask cost, engine: {engine_ms:.3f} ms per constrained row per step "
                     f"({st['engine']['masks']} masks) [{cpu}]")
    rest_ms = mask_ms(wl.get("platform (REST)", {}).get("structured"))
    if rest_ms is not None:
        lines.append(f"mask cost, platform worker: {rest_ms:.3f} ms per row per step [{cpu}]")
    hf_ms = mask_ms(wl.get("transformers generate"))
    if hf_ms is not None:
        hf = wl["transformers generate"]
        lines.append(f"mask cost, transformers processor (fill_next_token_bitmask only): "
                     f"{hf_ms:.3f} ms per row per step; the whole processor (consume, masks, "
                     f"apply_token_bitmask_inplace) {hf['processor_seconds']:.1f} s of its "
                     f"{hf['wall_s']:.1f} s [{cpu}]")
    if "itl_cost" in v:
        c = v["itl_cost"]
        lines.append(f"ITL p50 of unconstrained streams, constrained vs unconstrained "
                     f"neighbours: {100 * c['median']:+.1f} %{_fmt_rounds(c, True)} (aim within "
                     f"{100 * ITL_AIM:.0f} %): {'PASS' if v['itl_pass'] else 'MISS'} [{cpu}]")
    if "itl_cost_flipped" in v:
        c = v["itl_cost_flipped"]
        name = _flipped_itl({r["run"]: r for r in results["itl"]}) or ""
        name = name.replace("constrained, ", "constrained neighbours with ")
        lines.append(f"ITL p50, {name} vs unconstrained neighbours: {100 * c['median']:+.1f} %"
                     f"{_fmt_rounds(c, True)} [{cpu}]")
    if "itl_cost_vs_alone" in v:
        c = v["itl_cost_vs_alone"]
        lines.append(f"ITL p50, constrained neighbours vs streams alone: "
                     f"{100 * c['median']:+.1f} % (more rows per step too) [{cpu}]")
    jump_on, jump_off = switch_runs(results, "structured_jump_forward", "jump-forward")
    if v.get("jump_speedup") is not None and jump_on and jump_off:
        lines.append(f"jump-forward on / off tok/s: {v['jump_speedup']['median']:.2f}x"
                     f"{_fmt_rounds(v['jump_speedup'])}; forced share "
                     f"{_pct(jump_on['forced_share'])} on, {_pct(jump_off['forced_share'])} off"
                     f" [{cpu}]")
    ov_on, ov_off = switch_runs(results, "structured_mask_overlap", "mask overlap")
    if v.get("overlap_speedup") is not None and ov_on and ov_off:
        lines.append(f"mask overlap on / off tok/s: {v['overlap_speedup']['median']:.2f}x"
                     f"{_fmt_rounds(v['overlap_speedup'])}; compute thread on masks "
                     f"{on_path_s(ov_on):.3f} s on (waits), {on_path_s(ov_off):.3f} s off "
                     f"(computing them), {_pct(on_path_s(ov_off) / ov_off['wall_s'])} of that "
                     f"run's {ov_off['wall_s']:.1f} s [{cpu}]")
    return lines


def _header(results: dict[str, Any]) -> str:
    a, dtype = results["args"], results.get("dtype")
    how = f"temperature {a['temperature']:g}, seeded" if a["temperature"] else "greedy"
    return (f"{a['requests']} requests, 5 JSON schemas, {a['concurrency']} in flight, {how}, "
            f"max_tokens {a['max_tokens']}, {dtype} (the worker's DTYPE=auto here)")


def _rounds(results: dict[str, Any]) -> str:
    n = results["args"]["repeats"]
    return "one run each" if n == 1 else f"the median run of {n} rounds"


def print_report(results: dict[str, Any]) -> None:
    """Print every table and the summary lines."""
    cpu = results["cpu"]["label"]
    print(f"\n1. structured workload: {_header(results)}; the engine row: {_rounds(results)} "
          f"[{cpu}]")
    if results["workload"]:
        print(_table(WORKLOAD_COLS, workload_rows(results)))
    rounds = _rounds(results)
    if results.get("itl"):
        print(f"\n3. unconstrained streams' ITL, in-process (engine event sink), {rounds} "
              f"[{cpu}]")
        print(_table(ITL_COLS, itl_rows(results)))
    if results["settings"]:
        print(f"\n2, 4, 5. engine in-process, jump-forward and mask overlap, {rounds} [{cpu}]")
        print(_table(SETTINGS_COLS, settings_rows(results)))
    print()
    for line in summary_lines(results):
        print(line)


def write_markdown(results: dict[str, Any], path: str | Path) -> None:
    """The results as a markdown section: CPU, command, tables, ratios and targets."""
    cpu = results["cpu"]
    parts = [
        "## Structured outputs under load (`benchmarks/structured/workload.py`)", "",
        f"CPU: {cpu['model']}, {cpu['cores']} cores, avx512_bf16 "
        f"{'yes' if cpu['avx512_bf16'] else 'no'}. Each system ran alone, one after another "
        f"(never two at once on the 2 cores); `busy` is the cores other processes kept busy "
        f"during a run.", "",
        f"Command: `{results['command']}`", "",
        f"Workload: {_header(results)}. Tokens: completion tokens, the stop token counted "
        f"(transformers: up to each row's EOS, never the padding after it); tok/s: over the "
        f"run's wall time, after a warm-up.", "",
    ]
    label, rounds = cpu["label"], _rounds(results)
    if results["workload"]:
        parts += [f"Structured workload (the engine row: {rounds}) [{label}]:", "",
                  _md_table(WORKLOAD_COLS, workload_rows(results)), ""]
    if results.get("itl"):
        parts += [f"Unconstrained streams' ITL (in-process, stamped in the engine's event sink; "
                  f"each unconstrained neighbour runs as many tokens as its prompt's constrained "
                  f"answer, EOS ignored; {rounds}) [{label}]:", "",
                  _md_table(ITL_COLS, itl_rows(results)), ""]
    if results["settings"]:
        defaults = ", ".join(f"{k.removeprefix('structured_')} {'on' if v else 'off'}"
                             for k, v in results.get("defaults", {}).items())
        parts += [f"Engine in-process: `engine` has the defaults ({defaults}), each other row "
                  f"one switch flipped (mask ms/row: `mask_seconds / masks`, per constrained row "
                  f"per step; {rounds}) [{label}]:", "",
                  _md_table(SETTINGS_COLS, settings_rows(results)), ""]
    parts += [f"- {line}" for line in summary_lines(results)]
    Path(path).write_text("\n".join(parts) + "\n")
