"""Grammar libraries for JSON-schema-constrained decoding, side by side, on the default tokenizer.

Per library (llguidance, outlines_core, xgrammar when importable): import, tokenizer set-up,
compile of six schemas (a new state plus its first mask: llguidance's lexer is lazy) and mask per
token along a valid answer; then llguidance's batched masks, forced tokens and hostile schemas
under default and small lexer fuel. Wall-clock ms; compile and set-up are medians of ``--runs``::

    python -m benchmarks.structured.grammar_libraries
    PYTHONPATH=/tmp/xgr python -m benchmarks.structured.grammar_libraries   # with xgrammar
    timeout 150 python -m benchmarks.structured.grammar_libraries --hostile-only outlines_core
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from benchmarks.harness.cli import HelpFormatter, positive_int

MODEL = Path(__file__).resolve().parents[2] / ".cache" / "models" / "SmolLM2-135M-Instruct"


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": list(props) if required is None else required}


def _str(**keywords: str) -> dict:
    return {"type": "string", **keywords}


_S, _I, _B, _N = _str(), {"type": "integer"}, {"type": "boolean"}, {"type": "number"}
_ITEM = _obj({"sku": _str(pattern="^[A-Z]{2}[0-9]{4}$"), "qty": {"type": "integer", "minimum": 1},
              "price": _N})
SCHEMAS: list[tuple[str, dict, object]] = [
    ("flat-3", _obj({"name": _S, "age": _I, "active": _B}),
     {"name": "Ada Lovelace", "age": 36, "active": True}),
    ("wide-12", _obj({
        "id": {"type": "integer", "minimum": 1}, "title": _S,
        "status": {"enum": ["open", "closed", "pending", "archived"]},
        "priority": {"type": "integer", "minimum": 0, "maximum": 5}, "owner": _S,
        "tags": {"type": "array", "items": _S}, "score": _N, "public": _B,
        "lang": {"enum": ["en", "fr", "de"]}, "notes": _S,
        "retries": {"type": "integer", "minimum": 0}, "due": _S,
    }, required=["id", "title", "status", "priority", "owner", "score", "public"]),
     {"id": 4821, "title": "Fix login timeout", "status": "pending", "priority": 2,
      "owner": "m.chen", "tags": ["auth", "web"], "score": 0.75, "public": False,
      "lang": "en", "retries": 3}),
    ("nested", _obj({"user": _obj({"name": _S, "address": _obj({
        "street": _S, "city": _S, "zip": _str(pattern="^[0-9]{5}$")})}),
        "meta": _obj({"source": {"enum": ["web", "api"]}, "version": _I})}),
     {"user": {"name": "Lin", "address": {"street": "1 Main St", "city": "Springfield",
      "zip": "12345"}}, "meta": {"source": "api", "version": 3}}),
    ("array-of-objects", _obj({"order": _I, "items": {"type": "array", "items": _ITEM,
                                                      "minItems": 1, "maxItems": 10}}),
     {"order": 77, "items": [{"sku": "AB1234", "qty": 2, "price": 9.99},
                             {"sku": "CD5678", "qty": 1, "price": 120.5},
                             {"sku": "EF0001", "qty": 10, "price": 0.25}]}),
    ("anyOf", _obj({"result": {"anyOf": [_obj({"ok": {"const": True}, "value": _N}),
                                         _obj({"ok": {"const": False}, "error": _S, "code": _I})]},
                    "id": {"anyOf": [_S, _I, {"type": "null"}]}}),
     {"result": {"ok": False, "error": "not found", "code": 404}, "id": None}),
    ("date-pattern", _obj({"date": _str(format="date"), "email": _str(format="email"),
                           "code": _str(pattern="^[A-Z]{3}-[0-9]{4}$")}),
     {"date": "2024-02-29", "email": "ops@example.com", "code": "XYZ-0042"}),
]


def _deep(depth: int) -> tuple[dict, object]:
    schema, value = _obj({"leaf": _I}), {"leaf": 1}
    for _ in range(depth - 1):
        schema, value = _obj({"c": schema}), {"c": value}
    return schema, value


HOSTILE: list[tuple[str, dict, object]] = [
    ("nested depth 50", *_deep(50)),
    ("enum of 5,000 strings", {"enum": [f"item-{i:05d}-{i * 7919 % 10007}" for i in range(5000)]},
     f"item-04321-{4321 * 7919 % 10007}"),
    *((f"pattern {regex}", _str(pattern=regex), value) for regex, value in [
        ("^(a|aa)*b$", "a" * 40 + "b"), ("^(x+x+)+y$", "x" * 40 + "y"),
        ("^(.*a){25}$", "xa" * 25), ("^[ab]*a[ab]{40}$", "b" * 10 + "a" + "ab" * 20)]),
]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), CPU count, avx512_bf16 and the 1-minute load."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("model name")), "unknown CPU")
    bf16 = "present" if "avx512_bf16" in text.split() else "absent"
    return f"{name}, {os.cpu_count()} CPUs, avx512_bf16 {bf16}, load {os.getloadavg()[0]:.2f}"


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def median_ms(fn, runs: int) -> tuple[float, object]:
    """Median wall time of ``fn()`` over ``runs`` calls (ms) and the last call's result."""
    times, out = [], None
    for _ in range(runs):
        start, out = time.perf_counter(), fn()
        times.append(_ms(start))
    return float(np.median(times)), out


def import_cost(module: str, runs: int = 3) -> list:
    """Median time to import ``module`` in a fresh interpreter (ms); whether torch got loaded."""
    code = (f"import sys,time;t=time.perf_counter();import {module};"
            "print((time.perf_counter()-t)*1000,'torch' in sys.modules)")
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True).stdout.split() for _ in range(runs)]
    if not all(out):
        return ["import failed", "-"]
    return [float(np.median([float(o[0]) for o in out])), out[-1][1] == "True"]


def _encode(tok, value: object) -> list[int]:
    return tok.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False)


class LLGuidance:
    """llguidance: ``LLMatcher`` over a JSON-schema grammar, masks via ``llguidance.numpy``."""

    def __init__(self, tok, runs: int) -> None:
        import llguidance.hf
        import llguidance.numpy as lln

        self.ll, self.lln = llguidance, lln
        self.name = f"llguidance {metadata.version('llguidance')}"
        self.setup_ms, self.lltok = median_ms(lambda: llguidance.hf.from_tokenizer(tok), runs)
        raw = (Path(tok.name_or_path) / "tokenizer.json").read_text()
        self.raw_setup_ms, _ = median_ms(
            lambda: llguidance.LLTokenizer(raw, eos_token=tok.eos_token_id), runs)
        self.bitmask = lln.allocate_token_bitmask(1, self.lltok.vocab_size)

    def new(self, schema: dict, limits=None, options: dict | None = None):
        """A new matcher (never raises: a grammar error shows in ``is_error()``)."""
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        return self.ll.LLMatcher(self.lltok, grammar, log_level=0, limits=limits)

    def mask(self, matcher) -> np.ndarray:
        """Fill the next-token bitmask (int32 words, one bit per token id)."""
        self.lln.fill_next_token_bitmask(matcher, self.bitmask)
        return self.bitmask[0]

    def consume(self, matcher, token: int) -> bool:
        """Advance by one token; False when rejected."""
        return matcher.consume_token(token)


class OutlinesCore:
    """outlines_core: a regex from the schema, an ``Index`` over the vocabulary, a ``Guide``."""

    def __init__(self, tok, runs: int) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.to_regex = outlines_core, build_regex_from_schema
        self.name = f"outlines_core {metadata.version('outlines_core')}"
        self.setup_ms, self.vocab = median_ms(lambda: self._vocabulary(tok), runs)
        self.bitmask = np.zeros((1, (len(tok) + 31) // 32), dtype=np.int32)

    def _vocabulary(self, tok):
        # GPT-2 byte-level BPE: each character of a token's string stands for one byte.
        shown = [*range(33, 127), *range(161, 173), *range(174, 256)]
        hidden = [b for b in range(256) if b not in shown]
        byte_of = {chr(b): b for b in shown} | {chr(256 + i): b for i, b in enumerate(hidden)}
        tokens: dict[bytes, list[int]] = {}
        for text, token_id in tok.get_vocab().items():
            if token_id not in tok.added_tokens_decoder:
                tokens.setdefault(bytes(byte_of[c] for c in text), []).append(token_id)
        return self.oc.Vocabulary(tok.eos_token_id, tokens)

    def new(self, schema: dict):
        """The schema's regex, its ``Index`` and a ``Guide``."""
        return self.oc.Guide(self.oc.Index(self.to_regex(json.dumps(schema)), self.vocab))

    def mask(self, guide) -> np.ndarray:
        """Write the guide's allowed tokens into the bitmask."""
        guide.write_mask_into(self.bitmask.ctypes.data, self.bitmask.size, 4)
        return self.bitmask[0]

    def consume(self, guide, token: int) -> bool:
        """Advance by one token (raises when rejected)."""
        guide.advance(token, return_tokens=False)
        return True


class XGrammar:
    """xgrammar: ``GrammarCompiler.compile_json_schema`` and a ``GrammarMatcher``."""

    def __init__(self, tok, runs: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.name = f"xgrammar {metadata.version('xgrammar')}"
        self.setup_ms, self.compiler = median_ms(lambda: xgrammar.GrammarCompiler(
            xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))), runs)
        self.bitmask = xgrammar.allocate_token_bitmask(1, len(tok))

    def new(self, schema: dict):
        """A new matcher, compiled with the compiler's cache cleared."""
        self.compiler.clear_cache()
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(schema))

    def mask(self, matcher) -> np.ndarray:
        """Fill the next-token bitmask (a torch tensor, viewed as numpy)."""
        matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask.numpy()[0]

    def consume(self, matcher, token: int) -> bool:
        """Advance by one token; False when rejected."""
        return matcher.accept_token(token)


LIBRARIES = {"llguidance": LLGuidance, "outlines_core": OutlinesCore, "xgrammar": XGrammar}


def compile_schema(lib, schema: dict):
    """``lib``'s new state for ``schema`` and its first mask; raises on a grammar error."""
    state = lib.new(schema)
    row = lib.mask(state)
    if getattr(state, "is_error", lambda: False)():
        raise RuntimeError(state.get_error())
    return state, row


def walk(lib, schema: dict, ids: list[int], eos: int) -> list[float]:
    """Mask times (ms) along ``ids`` then EOS after a fresh compile; raises on a refused token."""
    state, row = compile_schema(lib, schema)
    times = []
    for step, token in enumerate([*ids, eos]):
        if step:
            start = time.perf_counter()
            row = lib.mask(state)
            times.append(_ms(start))
        if not (int(row[token // 32]) >> (token % 32)) & 1:
            raise RuntimeError(f"mask refuses token {token} at step {step}")
        if token != eos and not lib.consume(state, token):
            raise RuntimeError(f"token {token} rejected at step {step}")
    return times


def _table(title: str, headers: list[str], rows: list[list]) -> None:
    rows = [[c.replace("|", "\\|") if isinstance(c, str) else c for c in r] for r in rows]
    try:
        from tabulate import tabulate
        text = tabulate(rows, headers=headers, tablefmt="github", floatfmt=".3f")
    except ImportError:
        cells = [headers, *([f"{c:.3f}" if isinstance(c, float) else str(c) for c in r]
                            for r in rows)]
        widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        cells.insert(1, ["-" * w for w in widths])
        text = "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                         + " |" for r in cells)
    print(f"\n### {title}\n\n{text}", flush=True)


def batch_steps(ll: LLGuidance, answers: list[tuple[dict, list[int]]], threads: int) -> list[list]:
    """Each step's masks for all rows (ms): batched vs row by row, each on its own matchers."""
    executor = ll.ll.LLExecutor(num_threads=threads)
    mask = ll.lln.allocate_token_bitmask(len(answers), ll.lltok.vocab_size)
    ways = {"fill_next_token_bitmask_par": lambda ms: ll.lln.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in ms], mask),
            "fill_next_token_bitmask, row by row": lambda ms: [
                ll.lln.fill_next_token_bitmask(m, mask, i) for i, m in ms]}
    rows = {k: [ll.new(schema) for schema, _ in answers] for k in ways}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for step in range(max(len(ids) for _, ids in answers)):
        active = [i for i, (_, ids) in enumerate(answers) if step < len(ids)]
        for k in list(ways)[:: 1 if step % 2 else -1]:
            start = time.perf_counter()
            ways[k]([(i, rows[k][i]) for i in active])
            times[k].append(_ms(start))
            for i in active:
                m, token = rows[k][i], answers[i][1][step]
                if not m.consume_token(token):
                    raise RuntimeError(f"{k}: row {i} rejected token {token} at step {step}")
    return [[k, len(t), float(np.median(t)), float(np.percentile(t, 95)), float(np.sum(t))]
            for k, t in times.items()]


def jump_forward(ll: LLGuidance, schema: dict, text: bytes, options: dict | None) -> list[int]:
    """Decode ``text`` taking forced tokens when offered: [sampled, forced tokens, forced runs]."""
    m, pos, steps, forced, runs = ll.new(schema, options=options), 0, 0, 0, 0
    while pos < len(text):
        tokens = m.compute_ff_tokens()
        if tokens:
            forced, runs = forced + len(tokens), runs + 1
        else:
            tokens, steps = ll.lltok.tokenize_bytes(text[pos:])[:1], steps + 1
        chunk = ll.lltok.decode_bytes(tokens)
        if not text.startswith(chunk, pos) or not m.consume_tokens(tokens):
            raise RuntimeError(f"{chunk!r} off the answer at byte {pos}: {m.get_error()}")
        pos += len(chunk)
    return [steps, forced, runs]


def hostile_llguidance(ll: LLGuidance, tok, small) -> list[list]:
    """Per hostile schema and limits: construction, first and worst mask (ms), error if any."""
    rows = []
    for name, schema, value in HOSTILE:
        for label, limits in (("default", ll.ll.LLParserLimits()), ("small fuel", small)):
            built, m = median_ms(lambda s=schema, lim=limits: ll.new(s, lim), 1)
            first, _ = median_ms(lambda m=m: ll.mask(m), 1)
            worst, where = 0.0, "construction/first mask" if m.is_error() else "walk"
            for token in [] if m.is_error() else _encode(tok, value):
                if not m.consume_token(token):
                    break
                worst = max(worst, median_ms(lambda m=m: ll.mask(m), 1)[0])
            error = f"{where}: {m.get_error().splitlines()[0][:80]}" if m.is_error() else "none"
            rows.append([name, label, built, first, worst, error])
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run every measure and print the tables (times in ms)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default=str(MODEL), help="model folder with the tokenizer")
    parser.add_argument("--runs", type=positive_int, default=5, help="compile runs (medians)")
    parser.add_argument("--walks", type=positive_int, default=3, help="answer walks per schema")
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1,
                        help="LLExecutor threads")
    parser.add_argument("--fuel", type=positive_int, nargs=2, default=[20_000, 5_000],
                        help="small initial_lexer_fuel and step_lexer_fuel (library: 1e6, 2e5)")
    parser.add_argument("--hostile-only", choices=sorted(LIBRARIES), default=None,
                        help="only compile the hostile schemas with this library (bound it with "
                             "`timeout`: outlines_core's index of the last grows exponentially)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    if args.hostile_only:
        lib = LIBRARIES[args.hostile_only](AutoTokenizer.from_pretrained(args.model), 1)
        for name, schema, _ in HOSTILE:
            print(f"{name}: {median_ms(lambda s=schema: compile_schema(lib, s), 1)[0]:.1f} ms",
                  flush=True)
        return
    print(f"CPU: {cpu_name()}; Python {sys.version.split()[0]}; tokenizer {args.model}")
    modules = ["llguidance, llguidance.numpy", "outlines_core", "xgrammar",
               "transformers; transformers.AutoTokenizer"]
    _table("Import in a fresh interpreter (median of 3)", ["import", "ms", "loads torch"],
           [[module, *import_cost(module)] for module in modules])

    tok = AutoTokenizer.from_pretrained(args.model)
    ll = LLGuidance(tok, args.runs)
    libs: list = [ll, OutlinesCore(tok, args.runs)]
    try:
        libs.append(XGrammar(tok, args.runs))
    except Exception as exc:  # noqa: BLE001 - a missing or broken optional library is reported
        print(f"\nxgrammar skipped: {type(exc).__name__}: {exc}")
    setup = [[lib.name, lib.setup_ms] for lib in libs]
    setup.insert(1, ["llguidance LLTokenizer(tokenizer.json text)", ll.raw_setup_ms])
    _table(f"Tokenizer set-up ({len(tok):,} tokens, median of {args.runs})", ["how", "ms"], setup)

    answers = [(name, schema, _encode(tok, value)) for name, schema, value in SCHEMAS]
    compiles, masks = [], []
    for name, schema, ids in answers:
        for lib in libs:
            try:
                ms, _ = median_ms(lambda lib=lib, s=schema: compile_schema(lib, s), args.runs)
                walks = [walk(lib, schema, ids, tok.eos_token_id) for _ in range(args.walks)]
            except Exception as exc:  # noqa: BLE001 - one library's failure is a result
                compiles.append([name, lib.name, f"failed: {exc}"[:80]])
                continue
            compiles.append([name, lib.name, ms])
            masks.append([name, lib.name, len(ids), float(np.median(walks)),
                          float(np.percentile(walks, 95)), float(np.max(walks))])
    _table(f"Compile (median of {args.runs}), ms", ["schema", "library", "ms"], compiles)
    _table(f"Mask per token along the answer and EOS ({args.walks} walks, fresh compile each)",
           ["schema", "library", "answer tokens", "median ms", "p95 ms", "max ms"], masks)

    batch = [(schema, ids) for _, schema, ids in (answers * 2)[:8]]
    _table(f"8 rows (the six schemas, then flat-3 and wide-12 again), {args.threads} threads: "
           "one decode step's masks, ms", ["how", "steps", "median", "p95", "total"],
           batch_steps(ll, batch, args.threads))
    _table("llguidance jump-forward along the answer: sampled steps, compute_ff_tokens() tokens",
           ["schema", "answer tokens", "sampled", "forced", "forced runs", "sampled (no ws)",
            "forced (no ws)", "forced runs (no ws)"],
           [[name, len(ids), *jump_forward(ll, schema, ll.lltok.decode_bytes(ids), None),
             *jump_forward(ll, schema, ll.lltok.decode_bytes(ids), {"whitespace_flexible": False})]
            for name, schema, ids in answers])
    small = ll.ll.LLParserLimits(initial_lexer_fuel=args.fuel[0], step_lexer_fuel=args.fuel[1])
    _table(f"llguidance hostile schemas (small fuel: initial {args.fuel[0]:,}, step "
           f"{args.fuel[1]:,})", ["schema", "limits", "construct ms", "first mask ms",
                                  "worst mask ms", "error"], hostile_llguidance(ll, tok, small))


if __name__ == "__main__":
    main()
