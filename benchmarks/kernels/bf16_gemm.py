"""A bf16 model's projections: the native packed kernel against ``F.linear`` (oneDNN), side by side.

``python -m benchmarks.kernels.bf16_gemm``: the default model's four projections per layer (q/k/v
fused 960 x 576, o 576 x 576, gate/up fused 3,072 x 576, down 576 x 1,536) for 30 layers, each layer
with weights of its own, as one forward pass reads them (212 MB in bf16: the weights stream from
memory, not from cache), at each number of rows (tokens in the pass):

* ``F.linear``: bf16 ``F.linear`` over the plain ``[out, in]`` weights (oneDNN), what the
  backend runs without the kernel;
* ``reordered``: oneDNN's product over the weights reordered once into its blocked layout
  (:func:`inference.engine.backends.native.gemm.onednn_weight`), where this PyTorch has it;
* ``kernel``: the native packed kernel (``bf16_packed_matmul``) over the weights packed at load
  time, its AVX512-BF16 path; ``tiles``: the same kernel's AMX path, where it has one (from 4
  rows times parts; below that the vector path runs);
* ``backend``: :class:`inference.engine.backends.native.gemm.PackedLinear`, what the backend runs
  on a CPU with AVX512-BF16: the kernel, or on a CPU with AMX ``reordered`` for passes of
  ``AMX_MIN_ROWS`` rows or more.

Beside them, the LM head (49,152 x 576) at the same rows with fp32 input and output: the packed
kernel over the input split in bf16 hi and lo parts, against
:func:`inference.engine.backends.native.bf16_weight_matmul` (the plain layout, 4 by 4 blocks).

Each figure is the median of ``--repeats`` passes after a warm-up (ms per pass of all 30 layers;
ms per call for the head), with the ratio ``F.linear / backend`` and the achieved GFLOPS of the
backend's projections (``2 x rows x 106,168,320``), and the largest |difference| between the
backend's and ``F.linear``'s gate/up outputs relative to their largest value (bf16 results: up to
about 2^-8 where the order of the sums makes them round apart). Prints the table only.

Usage::

    python -m benchmarks.kernels.bf16_gemm                     # rows 1 to 1,024: about a minute
    python -m benchmarks.kernels.bf16_gemm --rows 1,16 --repeats 5
"""

from __future__ import annotations

import argparse

from benchmarks.harness.cli import HelpFormatter, positive_int
from benchmarks.kernels.prefill_flops import median_time

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of one layer
LAYERS = 30
HEAD = (49152, 576)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,1024",
                        help="comma-separated numbers of rows (tokens) per pass")
    parser.add_argument("--repeats", type=positive_int, default=7, help="passes per figure")
    args = parser.parse_args(argv)
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows_list = []
    if not rows_list or min(rows_list) < 1:
        parser.error("--rows: positive integers, comma-separated")

    import torch
    import torch.nn.functional as F

    from inference.engine.backends import native
    from inference.engine.backends.native import gemm

    lib = native.load()
    if not gemm.packed_matmul_available(lib):
        print("the packed bf16 kernel is not available here (no C compiler, or a CPU without "
              "AVX512-BF16): nothing to compare")
        return 1
    gen = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(out, inp, generator=gen) * inp**-0.5).bfloat16()
                for out, inp in SHAPES] for _ in range(LAYERS)]
    packed = [[gemm.PackedLinear(lib, w) for w in layer] for layer in weights]
    head_w = (torch.randn(*HEAD, generator=gen) * 0.05).bfloat16()
    head_packed = gemm.PackedLinear(lib, head_w)
    reordered = [[gemm.onednn_weight(w) for w in layer] for layer in weights]
    if any(w is None for layer in reordered for w in layer):
        reordered = []
    params = sum(out * inp for out, inp in SHAPES) * LAYERS
    amx = gemm.amx_kernel(lib)
    print(f"{'rows':>5} {'F.linear':>10} {'reordered':>10} {'kernel':>10} {'tiles':>10} "
          f"{'backend':>10} {'ratio':>6} {'GFLOPS':>7}   {'head: plain':>12} {'packed':>8} "
          f"{'ratio':>6} {'rel |diff|':>10}")
    with torch.inference_mode():
        for rows in rows_list:
            xs = [torch.randn(rows, inp, generator=gen).bfloat16() for _, inp in SHAPES]

            def plain(xs: list = xs) -> None:
                for layer in weights:
                    for w, x in zip(layer, xs, strict=True):
                        F.linear(x, w)

            def onednn(xs: list = xs) -> None:
                for layer in reordered:
                    for w, x in zip(layer, xs, strict=True):
                        gemm.onednn_linear(x, w, None)

            def kernel(xs: list = xs) -> None:
                for layer in packed:
                    for p, x in zip(layer, xs, strict=True):
                        gemm.bf16_packed_matmul(lib, x, p.packed)

            def fast(xs: list = xs) -> None:
                for layer in packed:
                    for p, x in zip(layer, xs, strict=True):
                        p(x)

            t_plain = 1e3 * median_time(plain, args.repeats)
            t_reordered = (f"{1e3 * median_time(onednn, args.repeats):>8.1f}ms" if reordered
                           else f"{'-':>10}")
            before = gemm.amx_kernel_min_rows(lib, 0)  # the vector path alone (-1: no AMX)
            t_kernel = 1e3 * median_time(kernel, args.repeats)
            gemm.amx_kernel_min_rows(lib, before)
            t_tiles = (f"{1e3 * median_time(kernel, args.repeats):>8.1f}ms" if amx
                       else f"{'-':>10}")
            t_fast = 1e3 * median_time(fast, args.repeats)
            h = torch.randn(rows, HEAD[1], generator=gen)
            t_head = 1e3 * median_time(
                lambda h=h: native.bf16_weight_matmul(lib, h, head_w), args.repeats)
            t_head_p = 1e3 * median_time(
                lambda h=h: head_packed(gemm.split_fp32(h), out_fp32=True), args.repeats)
            ref = F.linear(xs[2], weights[0][2]).float()
            diff = ((packed[0][2](xs[2]).float() - ref).abs().max() / ref.abs().max()).item()
            print(f"{rows:>5} {t_plain:>8.1f}ms {t_reordered} {t_kernel:>8.1f}ms {t_tiles} "
                  f"{t_fast:>8.1f}ms {t_plain / t_fast:>6.2f} "
                  f"{2 * rows * params / t_fast / 1e6:>7.0f}   {t_head:>10.2f}ms "
                  f"{t_head_p:>6.2f}ms {t_head / t_head_p:>6.2f} {diff:>10.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
