"""A bf16 model's LM head with fp32 logits, three ways side by side.

``python -m benchmarks.kernels.lm_head``: the default model's head (49,152 x 576, bf16) over
``rows`` fp32 hidden states, per call:

* ``native``: :func:`inference.engine.backends.native.bf16_weight_matmul`, the bf16 weight read as
  is (VDPBF16PS with the input split in two bf16 parts where the CPU has AVX512-BF16, else widened
  to fp32 in the kernel); what the backend uses up to ``bf16_weight_matmul_max_rows`` rows;
* ``fp32 copy``: the backend's fp32 projection (``_linear_cpu``: ``W·xᵀ`` up to 512 rows, else
  ``F.linear``) over an fp32 copy of the weight (twice the bytes); what the backend uses beyond
  that;
* ``bf16 F.linear``: the input rounded to bf16, a bf16 product, then ``.float()``: logits
  rounded to bf16 (shown for its speed; its error is why it is not used).

Each figure is the fastest of ``--repeats`` calls after a warm-up (ms), with the largest error
against a float64 product over the same bf16 weight. Prints the table only.

Usage::

    python -m benchmarks.kernels.lm_head                       # rows 1 to 128: under a minute
    python -m benchmarks.kernels.lm_head --rows 1,32 --repeats 50
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.cli import HelpFormatter, positive_int


def fastest_ms(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` after one warm-up, in milliseconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128",
                        help="comma-separated numbers of hidden states per call")
    parser.add_argument("--repeats", type=positive_int, default=20, help="calls per figure")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    if not rows_list or min(rows_list) < 1:
        parser.error("--rows: positive integers, comma-separated")

    import torch
    import torch.nn.functional as F

    from inference.engine.backends import native
    from inference.engine.backends.hf.forward import _linear_cpu

    lib = native.load()
    if lib is None:
        print("the native kernels did not build here (no C compiler?): nothing to compare")
        return 1
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(49152, 576, generator=generator) * 0.05).bfloat16()
    weight32 = weight.float()
    path = "VDPBF16PS" if lib.bf16_weight_matmul_uses_dpbf16() else "widened fp32"
    print(f"native kernel: {path}; used up to {native.bf16_weight_matmul_max_rows(lib)} rows")
    print(f"{'rows':>5} {'native':>10} {'fp32 copy':>10} {'bf16 F.linear':>14}   "
          f"largest |error|: native, fp32 copy, bf16")
    with torch.inference_mode():
        for rows in rows_list:
            x = torch.randn(rows, 576, generator=generator) * 3
            ref = F.linear(x.double(), weight.double())
            ways = {
                "native": lambda x=x: native.bf16_weight_matmul(lib, x, weight),
                "fp32": lambda x=x: _linear_cpu(x, weight32, None),
                "bf16": lambda x=x: F.linear(x.bfloat16(), weight).float(),
            }
            times = {name: fastest_ms(fn, args.repeats) for name, fn in ways.items()}
            errors = {name: (fn().double() - ref).abs().max().item() for name, fn in ways.items()}
            print(f"{rows:>5} {times['native']:>8.2f}ms {times['fp32']:>8.2f}ms "
                  f"{times['bf16']:>12.2f}ms   {errors['native']:.1e}, {errors['fp32']:.1e}, "
                  f"{errors['bf16']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
