"""How well the mixed tick's pass cost model predicts real passes
(``inference/engine/sched/tick_budget.py``).

Fits the model as the engine does at start-up
(:func:`inference.engine.sched.tick_budget.calibrate`), then times passes the fit never saw: decode
batches, prompt chunks early and deep in a context, and mixed passes, and prints the measured and
the predicted time of each side by side with the error.
``benchmarks/kernels/decode_step.py`` prints this table after its own; alone::

    python -m benchmarks.kernels.pass_cost_fit          # fp32 and, where native, bf16: ~1 min
    python -m benchmarks.kernels.pass_cost_fit --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.harness.cli import HelpFormatter

# (label, decode rows, decode context per row, prompt tokens, prompt start position)
CASES = (
    ("decode 4 rows @ 256", 4, 256, 0, 0),
    ("decode 16 rows @ 256", 16, 256, 0, 0),
    ("decode 32 rows @ 512", 32, 512, 0, 0),
    ("prefill 64 @ 0", 0, 0, 64, 0),
    ("prefill 256 @ 0", 0, 0, 256, 0),
    ("prefill 256 @ 2048", 0, 0, 256, 2048),
    ("mixed 4 rows + 48 @ 0", 4, 256, 48, 0),
    ("mixed 4 rows + 96 @ 3000", 4, 256, 96, 3000),
    ("mixed 16 rows + 128 @ 1024", 16, 256, 128, 1024),
)


def measure(backend: Any, repeats: int) -> list[dict[str, Any]]:
    """Fit the cost model on ``backend`` and time each of :data:`CASES` (median of
    ``repeats``); returns one row per case: measured and predicted ms, error %."""
    from inference.engine.backends.base import DecodeRow, PrefillChunk
    from inference.engine.sched.tick_budget import PassShape, calibrate, chunk_attention

    block = 16
    per_row = 4096 // block  # blocks of a prompt row: room for 4,096 tokens
    decode_blocks = 512 // block + 1
    num_blocks = per_row + 32 * decode_blocks + 8
    backend.allocate_kv_pool(num_blocks, block)
    model = calibrate(backend, list(range(128)), block)
    rows_out = []
    for label, rows, context, tokens, start in CASES:
        table = tuple(range(per_row))
        chunks = ([PrefillChunk("p", [11] * tokens, start, table)] if tokens else [])
        decode = [DecodeRow(f"d{i}", 11, context - 1,
                            tuple(range(per_row + i * decode_blocks,
                                        per_row + (i + 1) * decode_blocks)))
                  for i in range(rows)]
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            backend.prefill_and_decode(chunks, decode)
            times.append(time.perf_counter() - started)
        measured = statistics.median(times[1:])
        shape = PassShape(rows, rows * context, tokens,
                          chunk_attention(start, tokens) if tokens else 0)
        predicted = model.raw(shape)
        rows_out.append({"case": label, "measured_ms": measured * 1e3,
                         "predicted_ms": predicted * 1e3,
                         "error_pct": (predicted - measured) / measured * 100})
    return [{"fit_ms_per_unit": model.to_dict()}, *rows_out]


def print_fit(dtype: str, rows: list[dict[str, Any]]) -> None:
    fit, cases = rows[0]["fit_ms_per_unit"], rows[1:]
    print(f"\npass cost model, {dtype}: fit (ms per unit) " + ", ".join(
        f"{k}={v}" for k, v in fit.items() if k not in ("correction", "refits")))
    print(f"{'pass':<28} {'measured':>10} {'predicted':>10} {'error':>8}")
    for row in cases:
        print(f"{row['case']:<28} {row['measured_ms']:>8.1f}ms {row['predicted_ms']:>8.1f}ms "
              f"{row['error_pct']:>+7.0f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, or auto (what DTYPE=auto picks here)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case")
    args = parser.parse_args(argv)
    from inference.engine.backends.hf import TransformersBackend
    from inference.engine.model_store import resolve_model_path

    backend = TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                                  dtype=args.dtype)
    dtype = str(backend.dtype).removeprefix("torch.")
    print_fit(dtype, measure(backend, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
