"""A bf16 prompt chunk's attention, at offsets into its prompt: the native prefill kernel against
the gather path, side by side.

``python -m benchmarks.kernels.prefill_attention``: one layer of the default model's attention (3 KV
heads of 64, 3 query heads each) for one prompt chunk of ``tokens`` new tokens at ``offset`` (its
earlier K/V already in the pool, in blocks of 16 scattered through it), both in bf16:

* ``gather``: what the backend runs without the kernel (and in fp32): the row's K/V gathered
  from the pool by block table and ``scaled_dot_product_attention`` with the chunk's causal mask
  (``is_causal`` for a chunk at offset 0), index tensors built as the backend builds them (once,
  outside the timing: a pass builds them once for all its layers);
* ``kernel``: :func:`inference.engine.backends.native.prefill.prefill_attention`, K/V read in place.

Each figure is the median of ``--repeats`` calls after a warm-up (ms per layer; a pass of the
default model runs 30), with the ratio ``gather / kernel`` and the kernel's achieved GFLOPS
(``4 x heads x 64 x`` the (query, key) pairs it must score: each new token attends its position
plus one keys), and the largest |difference| between the two paths' outputs (both bf16, values
of order 1: a few bf16 steps at most). Prints the table only.

Usage::

    python -m benchmarks.kernels.prefill_attention                   # 8 cases: under a minute
    python -m benchmarks.kernels.prefill_attention --cases 0:1024,3840:256 --repeats 5
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.harness.cli import HelpFormatter, positive_int
from benchmarks.kernels.prefill_flops import median_time

KV_HEADS, GROUP, DIM, BLOCK = 3, 3, 64, 16
DEFAULT_CASES = "0:256,0:1024,1024:256,2048:256,3840:256,1024:64,3840:64,3840:16"


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"offset:tokens,..."`` as pairs; raises ``ValueError`` for anything else."""
    cases = []
    for item in text.split(","):
        offset, tokens = (int(v) for v in item.split(":"))
        if offset < 0 or tokens < 1:
            raise ValueError(item)
        cases.append((offset, tokens))
    if not cases:
        raise ValueError(text)
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help="comma-separated offset:tokens pairs (the chunk's first position "
                             "and its new tokens)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="calls per figure")
    args = parser.parse_args(argv)
    try:
        cases = parse_cases(args.cases)
    except ValueError:
        parser.error("--cases: offset:tokens pairs, offset >= 0, tokens >= 1, comma-separated")

    import torch

    from inference.engine.backends import native
    from inference.engine.backends.hf.attention import _attend
    from inference.engine.backends.hf.batch import _make_batch
    from inference.engine.backends.native import prefill

    lib = native.load()
    if not prefill.supported(lib, torch.bfloat16, DIM, GROUP):
        print("the prefill kernel does not run here (no C compiler, or a CPU without "
              "AVX512-BF16): nothing to compare")
        return 1
    gen = torch.Generator().manual_seed(0)
    heads = KV_HEADS * GROUP
    print(f"{'offset':>6} {'tokens':>6} {'gather':>10} {'kernel':>10} {'ratio':>6} {'GFLOPS':>7} "
          f"{'max |diff|':>10}")
    with torch.inference_mode():
        for offset, tokens in cases:
            ctx = offset + tokens
            blocks = -(-ctx // BLOCK)
            num_blocks = blocks + 8
            pool = torch.randn(2 * KV_HEADS, num_blocks, BLOCK, DIM, generator=gen).bfloat16()
            table = torch.randperm(num_blocks, generator=gen)[:blocks].tolist()
            q = torch.randn(tokens, heads, DIM, generator=gen).bfloat16()
            rows = [(list(range(tokens)), offset, table)]

            def build(native_prefill: bool, rows: list = rows, num_blocks: int = num_blocks) -> Any:
                return _make_batch(rows, block_size=BLOCK, num_blocks=num_blocks,
                                   num_kv_heads=KV_HEADS, group=GROUP, max_model_len=1 << 20,
                                   max_groups=1, device=torch.device("cpu"),
                                   native_prefill=native_prefill)

            def run(batch: Any, q: Any = q, pool: Any = pool) -> Any:
                return _attend(lib, batch, q, pool, heads, KV_HEADS, GROUP, DIM, BLOCK,
                               DIM ** -0.5)

            # Index tensors once, as a pass builds them once for all its layers.
            gathered, in_place = build(False), build(True)
            t_gather = 1e3 * median_time(lambda b=gathered: run(b), args.repeats)
            t_kernel = 1e3 * median_time(lambda b=in_place: run(b), args.repeats)
            pairs = tokens * offset + tokens * (tokens + 1) // 2
            diff = (run(gathered).float() - run(in_place).float()).abs().max().item()
            print(f"{offset:>6} {tokens:>6} {t_gather:>8.2f}ms {t_kernel:>8.2f}ms "
                  f"{t_gather / t_kernel:>6.2f} {4 * heads * DIM * pairs / t_kernel / 1e6:>7.0f} "
                  f"{diff:>10.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
