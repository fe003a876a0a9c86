"""``QUANTIZATION=q4_1`` against fp32 on the default model, a quality gate: ``python -m
benchmarks.kernels.quant_quality``.

Loads the transformers backend twice, in fp32 (the default model's folder) and with
``QUANTIZATION=q4_1`` (its wheel's GGUF as shipped), runs the bf16 gate's 64 chat prompts greedy
through an engine over each (all at once, ``--max-new-tokens`` each, EOS honoured) and prints
the share of identical outputs and, for those that differ, the mean position of the first
differing token; then the perplexity of both on the bf16 gate's text (teacher forcing: one
prefill pass with every position's logits, where the quantized model runs its projections dense
over the blocks' values, or over the blocks with int8 activations where the kernels have the
x16 products: AVX-512 VNNI) and through decode passes of one row, a token at a time (the single
stream's path, where the quantized model's kernels quantize activations to int8 as llama.cpp's
do), and their ratios. The greedy runs keep at most ``FUSED_MAX_ROWS`` rows in flight, so that
their decode passes take the same kernels. The gate: both quantized perplexities within 2 % of
fp32's. Prints the time of each run beside (not a speed figure: both run on this
machine, one after the other). Writes ``quant_quality.json`` under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch

from benchmarks.harness.common import cpu_info, machine, write_json
from benchmarks.kernels.bf16_quality import GATE_PPL_RATIO, PROMPTS, TEXT
from inference.engine.backends.hf.quantized import FUSED_MAX_ROWS


def backend(quantization: str):
    from inference.engine.backends.hf import TransformersBackend
    from inference.engine.model_store import default_gguf_path, resolve_model_path

    if quantization:
        return TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                                   quantization=quantization,
                                                   quantized_weights=default_gguf_path())
    return TransformersBackend.from_pretrained(resolve_model_path(""), device="cpu",
                                               dtype="float32")


def greedy_all(model: Any, prompts: tuple[str, ...], max_new_tokens: int) -> list[list[int]]:
    """Every prompt's greedy tokens through one engine over ``model``, all submitted at once."""
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.request import FinalEvent, SamplingParams, TokenEvent

    # At most FUSED_MAX_ROWS rows: the quantized model's decode passes take the kernel over its
    # blocks (int8 activations), as a server's do, not the dense product over their values.
    engine = LLMEngine(EngineConfig(max_batch_size=FUSED_MAX_ROWS, kv_num_blocks=1024,
                                    max_pending=1000), model)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        tokens[f"p{i}"] = []
        engine.submit(prompt_token_ids=ids, request_id=f"p{i}",
                      sampling=SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    done = 0
    while done < len(prompts):
        for event in engine.step():
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event.token_id)
            elif isinstance(event, FinalEvent):
                done += 1
    return [tokens[f"p{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def perplexity(model: Any, text: str) -> float:
    """Teacher-forced perplexity of ``text``: one prefill pass with every position's logits."""
    from inference.engine.backends.base import PrefillChunk

    ids = model.tokenizer.encode(text)
    model.allocate_kv_pool(-(-len(ids) // 16) + 1, 16)
    model.add_row("ppl")
    logits = model.prefill([PrefillChunk("ppl", ids, 0, tuple(range(-(-len(ids) // 16))),
                                         all_logits=True)])
    model.remove_row("ppl")
    # Row 0: the last token's logits; then the other tokens', in position order.
    loss = torch.nn.functional.cross_entropy(logits[1:].float(), torch.tensor(ids[1:]))
    return math.exp(loss.item())


@torch.inference_mode()
def decode_perplexity(model: Any, text: str) -> float:
    """Teacher-forced perplexity of ``text`` through decode passes of one row (a single
    stream's path: the quantized model's int8-activation kernels), its first token prefilled."""
    from inference.engine.backends.base import DecodeRow, PrefillChunk

    ids = model.tokenizer.encode(text)
    table = tuple(range(-(-len(ids) // 16)))
    model.allocate_kv_pool(len(table) + 1, 16)
    model.add_row("ppl")
    rows = [model.prefill([PrefillChunk("ppl", ids[:1], 0, table)])]
    rows += [model.decode([DecodeRow("ppl", ids[p], p, table)]) for p in range(1, len(ids) - 1)]
    model.remove_row("ppl")
    loss = torch.nn.functional.cross_entropy(torch.cat(rows).float(), torch.tensor(ids[1:]))
    return math.exp(loss.item())


def run(max_new_tokens: int, prompts: int) -> dict[str, Any]:
    outputs: dict[str, list[list[int]]] = {}
    ppl: dict[str, float] = {}
    decode_ppl: dict[str, float] = {}
    seconds: dict[str, float] = {}
    x16 = False
    for name, quantization in (("fp32", ""), ("q4_1", "q4_1")):
        model = backend(quantization)
        if quantization:  # every pass over the x16 products (AVX-512 VNNI), prompts included
            x16 = all(p.x16 is not None for layer in model._layers for p in layer.packed)
        started = time.perf_counter()
        outputs[name] = greedy_all(model, PROMPTS[:prompts], max_new_tokens)
        seconds[name] = time.perf_counter() - started
        ppl[name] = perplexity(model, TEXT)
        decode_ppl[name] = decode_perplexity(model, TEXT)
        print(f"{name}: {prompts} prompts in {seconds[name]:.1f} s, perplexity {ppl[name]:.4f} "
              f"(prefill), {decode_ppl[name]:.4f} (decode)", flush=True)
        del model
    firsts = []
    for a, b in zip(outputs["fp32"], outputs["q4_1"], strict=True):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                               min(len(a), len(b))))
    identical = prompts - len(firsts)
    ratio = ppl["q4_1"] / ppl["fp32"]
    decode_ratio = decode_ppl["q4_1"] / decode_ppl["fp32"]
    return {"machine": machine(), "cpu": cpu_info(), "prompts": prompts,
            "max_new_tokens": max_new_tokens, "identical_outputs": identical,
            "identical_share": identical / prompts,
            "mean_first_difference": (sum(firsts) / len(firsts)) if firsts else None,
            "perplexity": ppl, "perplexity_ratio": ratio,
            "decode_perplexity": decode_ppl, "decode_perplexity_ratio": decode_ratio,
            "gate": {"max_ratio": GATE_PPL_RATIO,
                     "passed": max(ratio, decode_ratio) <= GATE_PPL_RATIO},
            "x16": x16, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    """The gate from the command line; exit status 0 when it passes, 1 when it fails."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.quant_quality",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS),
                        choices=range(1, len(PROMPTS) + 1), metavar=f"1..{len(PROMPTS)}")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    report = run(args.max_new_tokens, args.prompts)
    print(f"CPU: {report['cpu']['label']}")
    print(f"identical outputs: {report['identical_outputs']} of {report['prompts']} "
          f"({report['identical_share']:.0%}); mean first difference at token "
          f"{report['mean_first_difference']}")
    print(f"perplexity fp32 {report['perplexity']['fp32']:.4f}, q4_1 "
          f"{report['perplexity']['q4_1']:.4f}: ratio {report['perplexity_ratio']:.5f} "
          f"(prefill: one pass{', int8 activations' if report.get('x16') else ', dense'})")
    print(f"perplexity fp32 {report['decode_perplexity']['fp32']:.4f}, q4_1 "
          f"{report['decode_perplexity']['q4_1']:.4f}: ratio "
          f"{report['decode_perplexity_ratio']:.5f} (decode: a token a pass, int8 activations)")
    print(f"gate: both ratios <= {GATE_PPL_RATIO}: "
          f"{'PASS' if report['gate']['passed'] else 'FAIL'}")
    path = write_json("quant_quality", report, args.out_dir)
    print(f"wrote {path}")
    return 0 if report["gate"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
