"""One decode step of the transformers backend, with and without its CPU speed settings, in fp32
and in bf16.

The same rows (mixed context lengths, each a prefix of one real text whose K/V are prefilled once)
are decoded under four settings, interleaved so that machine noise hits them alike:

* ``baseline``: ``F.linear`` projections, attention over all rows gathered to the longest one;
* ``gemm``: projections by ``_linear_cpu`` (``W @ x^T`` where that orientation is faster for the
  dtype; ``TransformersBackend.small_batch_gemm``);
* ``gemm+groups``: also attention over groups of similar-length rows
  (``TransformersBackend.attention_groups``);
* ``gemm+native``: projections as ``gemm`` and attention read in place from the KV pool by the
  native kernel (``TransformersBackend.native_attention``), the default in fp32;
* ``packed+native``: also, in bf16 on a CPU with AVX512-BF16, the projections and LM head on the
  native packed kernel (``TransformersBackend.packed_gemm``), elsewhere the same as
  ``gemm+native``;
* ``fused``: also each layer one native call (``TransformersBackend.fused_decode``,
  :mod:`inference.engine.backends.native.decode`), the default in bf16 on a CPU with
  AVX512-BF16 (elsewhere the same as ``gemm+native``).

``--dtype both`` (the default) loads the model twice, in fp32 and in bf16, and interleaves the two
as well; it also counts the rows whose bf16 greedy token is fp32's.

For each batch size and dtype it prints milliseconds per step (the fastest of ``--repeats``
rounds of ``--steps`` steps each) and the ratio to that dtype's baseline, checks that the
settings pick the same greedy token for every row, and with both dtypes the bf16/fp32 time ratio
of each setting (below 1: bf16 is faster). It saves the figures as JSON. Last, per dtype, the
mixed tick's pass cost model: its start-up fit and its error on passes it never saw
(:mod:`benchmarks.kernels.pass_cost_fit`).

Usage::

    python -m benchmarks.kernels.decode_step                  # rows 2, 11, 24, 32; both dtypes
    python -m benchmarks.kernels.decode_step --dtype float32 --rows 1,8,16 --max-context 1024
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness.cli import positive_int  # noqa: E402 - after the path set-up above

SETTINGS = {
    "baseline": {"small_batch_gemm": False, "attention_groups": 1, "native_attention": False,
                 "packed_gemm": False},
    "gemm": {"small_batch_gemm": True, "attention_groups": 1, "native_attention": False,
             "packed_gemm": False},
    # None: the backend's default
    "gemm+groups": {"small_batch_gemm": True, "attention_groups": None,
                    "native_attention": False, "packed_gemm": False},
    "gemm+native": {"small_batch_gemm": True, "attention_groups": None,
                    "native_attention": True, "packed_gemm": False},
    "packed+native": {"small_batch_gemm": True, "attention_groups": None,
                      "native_attention": True, "packed_gemm": True},
    "fused": {"small_batch_gemm": True, "attention_groups": None, "native_attention": True,
              "packed_gemm": True, "fused_decode": True},
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


DTYPES = {"float32": ("float32",), "bfloat16": ("bfloat16",), "both": ("float32", "bfloat16")}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rows", type=_int_list, default=[2, 11, 24, 32], metavar="LIST",
                        help="batch sizes (rows per decode step), comma-separated")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="both",
                        help="the model's dtype; both: fp32 and bf16 side by side")
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

    from benchmarks.kernels.bf16_quality import TEXT
    from inference.engine.backends.base import DecodeRow, PrefillChunk
    from inference.engine.backends.hf import TransformersBackend
    from inference.engine.model_store import resolve_model_path

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    dtypes = DTYPES[args.dtype]
    backends = {d: TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                                       dtype=d) for d in dtypes}
    first = backends[dtypes[0]]
    default_groups = first.attention_groups
    if args.max_context >= first.max_model_len:
        parser.error(f"--max-context must be below the model's {first.max_model_len} tokens")
    block = 16
    per_row = -(-(args.max_context + 1) // block)
    # Every row reads a prefix of one real text: its K/V prefilled once per dtype into the last
    # blocks of the pool and copied into each row's blocks (random K/V would make the logits
    # flat and the bf16 model unstable, unlike any real context).
    text = first.tokenizer.encode(" ".join([TEXT] * (4 + args.max_context // 150)))
    text = text[:args.max_context + 1]
    source = list(range(per_row * max(args.rows) + 1, per_row * (max(args.rows) + 1) + 1))
    for backend in backends.values():
        backend.allocate_kv_pool(source[-1] + 1, block)
        backend.prefill([PrefillChunk("text", text, 0, source)])

    def make_rows(count: int) -> list[DecodeRow]:
        rows, next_block = [], 1
        for i in range(count):
            position = rng.randint(args.min_context, args.max_context)
            need = -(-(position + 1) // block)
            table = list(range(next_block, next_block + need))
            next_block += need
            for backend in backends.values():
                kv = backend._kv
                kv[:, :, table] = kv[:, :, source[:need]]
            rows.append(DecodeRow(row_id=f"r{i}", token_id=text[position],
                                  position=position, block_table=table))
        return rows

    def use(backend: TransformersBackend, name: str) -> None:
        setting = SETTINGS[name]
        backend.small_batch_gemm = setting["small_batch_gemm"]
        backend.attention_groups = setting["attention_groups"] or default_groups
        backend.native_attention = setting["native_attention"]
        # The packed weights exist only where the kernel is available (bf16, AVX512-BF16).
        backend.packed_gemm = setting["packed_gemm"] and any(
            layer.packed is not None for layer in backend._layers)
        backend.fused_decode = setting.get("fused_decode", False)

    results = []
    print(f"{'rows':>4} {'mean ctx':>8} {'dtype':>5} "
          + " ".join(f"{n:>14}" for n in SETTINGS) + "   same tokens")
    for count in args.rows:
        rows = make_rows(count)
        runs = [(d, n) for d in dtypes for n in SETTINGS]
        times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
        tokens = {}
        for d, name in runs:  # warm-up, and the greedy tokens of each setting
            use(backends[d], name)
            tokens[d, name] = backends[d].decode(rows).argmax(-1).tolist()
        for _ in range(args.repeats):
            for d, name in runs:
                use(backends[d], name)
                start = time.perf_counter()
                for _ in range(args.steps):
                    backends[d].decode(rows)
                times[d, name].append((time.perf_counter() - start) / args.steps * 1000)
        mean_ctx = sum(r.position + 1 for r in rows) / count
        best = {run: min(values) for run, values in times.items()}
        for d in dtypes:
            base = best[d, "baseline"]
            same = all(tokens[d, n] == tokens[d, "baseline"] for n in SETTINGS)
            cells = " ".join(f"{best[d, n]:7.1f} ms {base / best[d, n]:4.2f}x" for n in SETTINGS)
            print(f"{count:>4} {mean_ctx:>8.0f} {SHORT[d]:>5} {cells}   {'yes' if same else 'NO'}")
            results.append({"rows": count, "dtype": d, "mean_context": mean_ctx,
                            "ms_per_step": {n: best[d, n] for n in SETTINGS},
                            "all_rounds_ms": {n: times[d, n] for n in SETTINGS},
                            "speedup": {n: base / best[d, n] for n in SETTINGS},
                            "same_greedy_tokens": same})
        if len(dtypes) == 2:
            ratio = {n: best["bfloat16", n] / best["float32", n] for n in SETTINGS}
            agree = sum(a == b for a, b in zip(tokens["float32", "gemm+native"],
                                               tokens["bfloat16", "gemm+native"], strict=True))
            cells = " ".join(f"{ratio[n]:14.2f}" for n in SETTINGS)
            print(f"{count:>4} {'':>8} {'ratio':>5} {cells}   bf16 top-1 = fp32's in "
                  f"{agree}/{count} rows")
            results.append({"rows": count, "bf16_over_fp32": ratio,
                            "bf16_top1_equals_fp32_rows": agree})
    for backend in backends.values():
        use(backend, "fused")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                             for k, v in vars(args).items()},
                                    "torch_threads": torch.get_num_threads(),
                                    "results": results}, indent=2))
    print("ms per decode step (fastest round); Nx: speed-up over that dtype's baseline; ratio: "
          f"bf16 time / fp32 time (below 1: bf16 faster). saved {args.out}")
    # The mixed tick's pass cost model: its start-up fit against passes it never saw.
    from benchmarks.kernels.pass_cost_fit import measure, print_fit

    for d in dtypes:
        print_fit(d, measure(backends[d], repeats=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
