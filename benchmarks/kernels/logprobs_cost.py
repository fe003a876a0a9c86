"""What log-probabilities cost on the transformers backend (docs/engine.md, "Log-probabilities").

Times, interleaved and as medians, on the default model:

- a prompt chunk's forward pass with every position's logits (``PrefillChunk.all_logits``, what a
  request asking for prompt logprobs runs) against the usual pass (the last position's only), and
  the engine's work on those logits (fp32 log-softmax, the chosen and top-k tokens, their texts);
- choosing the next token of a batch of decode rows (:func:`inference.engine.sampling.sample`) with
  and without ``logprobs=20`` on every row.

::

    python -m benchmarks.kernels.logprobs_cost                  # fp32, about 30 s on 2 cores
    python -m benchmarks.kernels.logprobs_cost --tokens 128 --rows 16 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from benchmarks.harness.cli import HelpFormatter


def _median_ms(run: Callable[[], object], times: list[float]) -> None:
    started = time.perf_counter()
    run()
    times.append((time.perf_counter() - started) * 1000)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--dtype", default="float32", help="the model's dtype")
    parser.add_argument("--tokens", type=int, default=256, help="prompt tokens in the chunk")
    parser.add_argument("--rows", type=int, default=8, help="decode rows sampled at once")
    parser.add_argument("--top", type=int, default=5, help="prompt_logprobs (likeliest tokens)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (medians)")
    args = parser.parse_args(argv)

    import torch

    from inference.engine.backends.base import PrefillChunk
    from inference.engine.backends.hf import TransformersBackend
    from inference.engine.logprobs import keep_prompt_logprobs, new_logprob_state
    from inference.engine.model_store import resolve_model_path
    from inference.engine.request import Request, SamplingParams
    from inference.engine.sampling import sample

    backend = TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                                  dtype=args.dtype)
    tokenizer = backend.tokenizer
    text = "The lighthouse keeper climbed the spiral stairs every evening at dusk. " * 64
    prompt = tokenizer.encode(text)[:args.tokens + 1]
    block = 16
    blocks = -(-len(prompt) // block)
    backend.allocate_kv_pool(blocks, block)
    table = tuple(range(blocks))
    plain = [PrefillChunk("p", prompt[:args.tokens], 0, table)]
    asking = [PrefillChunk("p", prompt[:args.tokens], 0, table, all_logits=True)]

    def scoring_request() -> Request:
        request = Request("p", list(prompt), SamplingParams(prompt_logprobs=args.top))
        request.logprobs = new_logprob_state(request, tokenizer)
        return request

    logits_all = backend.prefill(asking)  # warm-up, and the logits the engine's work reads
    rows = [Request(f"r{i}", [1], SamplingParams()) for i in range(args.rows)]
    asked = [Request(f"a{i}", [1], SamplingParams(logprobs=20)) for i in range(args.rows)]
    for request in asked:
        request.logprobs = new_logprob_state(request, tokenizer)
    batch = torch.randn(args.rows, backend.vocab_size) * 4
    eos = frozenset(tokenizer.eos_token_ids)
    times: dict[str, list[float]] = {k: [] for k in ("pass", "pass_all", "record", "sample",
                                                      "sample_lp")}
    for _ in range(args.repeats):
        _median_ms(lambda: backend.prefill(plain), times["pass"])
        _median_ms(lambda: backend.prefill(asking), times["pass_all"])
        _median_ms(lambda: keep_prompt_logprobs(logits_all, asking, [scoring_request()], 1),
                   times["record"])
        _median_ms(lambda: sample(batch, rows, eos), times["sample"])
        _median_ms(lambda: sample(batch, asked, eos), times["sample_lp"])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"prompt chunk of {args.tokens} tokens ({args.dtype}), median of {args.repeats}:")
    print(f"  forward pass, last position's logits: {med['pass']:8.1f} ms")
    print(f"  forward pass, every position's logits: {med['pass_all']:7.1f} ms "
          f"({med['pass_all'] / med['pass']:.2f}x)")
    print(f"  prompt logprobs from them (top {args.top}): {med['record']:8.1f} ms")
    print(f"next token of {args.rows} decode rows:")
    print(f"  sample, no logprobs:      {med['sample']:6.2f} ms")
    print(f"  sample, logprobs=20 each: {med['sample_lp']:6.2f} ms")


if __name__ == "__main__":
    main()
