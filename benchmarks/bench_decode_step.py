"""One decode step of the transformers backend, with and without its CPU speed settings.

The same rows (mixed context lengths, the KV pool filled with random values) are decoded under
four settings, interleaved so that machine noise hits them alike:

* ``baseline``: ``F.linear`` projections, attention over all rows gathered to the longest one;
* ``gemm``: projections as ``W @ x^T`` (``TransformersBackend.small_batch_gemm``);
* ``gemm+groups``: also attention over groups of similar-length rows
  (``TransformersBackend.attention_groups``);
* ``gemm+native``: projections as ``W @ x^T`` and attention read in place from the KV pool by the
  native kernel (``TransformersBackend.native_attention``), the default.

For each batch size it prints milliseconds per step (the fastest of ``--repeats`` rounds of
``--steps`` steps each) and the ratio to the baseline, checks that the settings pick the same
greedy token for every row, and saves the figures as JSON.

Usage::

    python benchmarks/bench_decode_step.py                  # rows 2, 11, 24, 32; ~1 min
    python benchmarks/bench_decode_step.py --rows 1,8,16 --max-context 1024
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.cli import positive_int  # noqa: E402 - after the path set-up above

SETTINGS = {
    "baseline": {"small_batch_gemm": False, "attention_groups": 1, "native_attention": False},
    "gemm": {"small_batch_gemm": True, "attention_groups": 1, "native_attention": False},
    # None: the backend's default
    "gemm+groups": {"small_batch_gemm": True, "attention_groups": None,
                    "native_attention": False},
    "gemm+native": {"small_batch_gemm": True, "attention_groups": None,
                    "native_attention": True},
}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("every value must be a positive integer")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rows", type=_int_list, default=[2, 11, 24, 32], metavar="LIST",
                        help="batch sizes (rows per decode step), comma-separated")
    parser.add_argument("--min-context", type=positive_int, default=16,
                        help="shortest row (tokens)")
    parser.add_argument("--max-context", type=positive_int, default=576,
                        help="longest row (tokens)")
    parser.add_argument("--steps", type=positive_int, default=5, help="decode steps per round")
    parser.add_argument("--repeats", type=positive_int, default=4, help="rounds per setting")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the rows' context lengths and token ids")
    parser.add_argument("--out", type=Path, metavar="FILE",
                        default=REPO / "benchmarks" / "results" / "decode_step.json",
                        help="JSON file to write")
    args = parser.parse_args(argv)
    if args.min_context > args.max_context:
        parser.error("need --min-context <= --max-context")

    import torch

    from inference.backends.base import DecodeRow
    from inference.backends.hf import TransformersBackend
    from inference.model_store import resolve_model_path

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    backend = TransformersBackend.from_pretrained(resolve_model_path(""))
    default_groups = backend.attention_groups
    if args.max_context >= backend.max_model_len:
        parser.error(f"--max-context must be below the model's {backend.max_model_len} tokens")
    block = 16
    per_row = -(-(args.max_context + 1) // block)
    backend.allocate_kv_pool(per_row * max(args.rows) + 1, block)
    backend._kv.normal_()  # attention over non-trivial values

    def make_rows(count: int) -> list[DecodeRow]:
        rows, next_block = [], 1
        for i in range(count):
            position = rng.randint(args.min_context, args.max_context)
            need = -(-(position + 1) // block)
            table = list(range(next_block, next_block + need))
            next_block += need
            rows.append(DecodeRow(row_id=f"r{i}", token_id=rng.randrange(1000),
                                  position=position, block_table=table))
        return rows

    def use(name: str) -> None:
        setting = SETTINGS[name]
        backend.small_batch_gemm = setting["small_batch_gemm"]
        backend.attention_groups = setting["attention_groups"] or default_groups
        backend.native_attention = setting["native_attention"]

    results = []
    print(f"{'rows':>4} {'mean ctx':>8} " + " ".join(f"{n:>14}" for n in SETTINGS)
          + "   same tokens")
    for count in args.rows:
        rows = make_rows(count)
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        tokens = {}
        for name in SETTINGS:  # warm-up, and the greedy tokens of each setting
            use(name)
            tokens[name] = backend.decode(rows).argmax(-1).tolist()
        for _ in range(args.repeats):
            for name in SETTINGS:
                use(name)
                start = time.perf_counter()
                for _ in range(args.steps):
                    backend.decode(rows)
                times[name].append((time.perf_counter() - start) / args.steps * 1000)
        best = {name: min(values) for name, values in times.items()}
        same = all(t == tokens["baseline"] for t in tokens.values())
        mean_ctx = sum(r.position + 1 for r in rows) / count
        cells = " ".join(f"{best[n]:7.1f} ms {best['baseline'] / best[n]:4.2f}x" for n in SETTINGS)
        print(f"{count:>4} {mean_ctx:>8.0f} {cells}   {'yes' if same else 'NO'}")
        results.append({"rows": count, "mean_context": mean_ctx, "ms_per_step": best,
                        "all_rounds_ms": times, "speedup": {n: best["baseline"] / best[n]
                                                            for n in SETTINGS},
                        "same_greedy_tokens": same})
    use("gemm+groups")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                             for k, v in vars(args).items()},
                                    "torch_threads": torch.get_num_threads(),
                                    "results": results}, indent=2))
    print(f"ms per decode step (fastest round); Nx: speed-up over baseline. saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
