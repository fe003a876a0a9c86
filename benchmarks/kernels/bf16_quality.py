"""bf16 against fp32 on the default model, a quality gate: ``python -m
benchmarks.kernels.bf16_quality``.

Runs 64 fixed prompts greedy (plain transformers ``generate``, one prompt at a time, so no padding
is involved) with the model loaded in fp32 and in bf16, and prints the share of identical outputs
and, for those that differ, the mean position of the first differing token; then the perplexity of
both dtypes on a fixed text (teacher forcing, logits in fp32) and their ratio. The gate: bf16's
perplexity within 2 % of fp32's. Writes ``bf16_quality.json`` under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch

from benchmarks.harness.common import machine, write_json

TOPICS = ("the ocean", "a library", "mountains", "coffee", "trains", "the moon", "gardens",
          "winter")
FORMS = ("Write one sentence about {}.", "What is interesting about {}?",
         "Give three facts about {}.", "Describe {} to a child.", "Why do people like {}?",
         "Write a short poem about {}.", "List two words that go with {}.",
         "Explain {} in simple terms.")
PROMPTS = tuple(form.format(topic) for topic in TOPICS for form in FORMS)  # 64

TEXT = (
    "The history of the printing press begins long before Gutenberg. Carved wooden blocks were "
    "used to print patterns on cloth and, later, whole pages of text in East Asia. Movable type "
    "made of baked clay appeared in the eleventh century, and metal type followed in Korea. In "
    "Europe, the combination of an oil-based ink, a screw press adapted from wine making and type "
    "cast in a hand mould made printing fast and cheap enough to change how knowledge spread. "
    "Within fifty years, presses were running in hundreds of towns, and millions of books had "
    "been printed. Scholars could compare identical copies, errors could be corrected in the next "
    "edition, and ideas travelled further than any single scribe could carry them. The same "
    "pattern, a new way of copying information that becomes cheap very quickly, has repeated "
    "itself many times since, with the telegraph, the radio and the internet."
)
GATE_PPL_RATIO = 1.02


def load(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.engine.model_store import prepare_default_model
    from inference.protocol.models import model_cache_dir

    folder = prepare_default_model(model_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    return tokenizer, model


@torch.inference_mode()
def greedy(tokenizer, model, prompt: str, max_new_tokens: int) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # a BatchEncoding in recent transformers
        ids = ids["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def perplexity(tokenizer, model, text: str) -> float:
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    return math.exp(loss.item())


def run(max_new_tokens: int, prompts: int) -> dict[str, Any]:
    outputs: dict[str, list[list[int]]] = {}
    ppl: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        tokenizer, model = load(dtype)
        started = time.perf_counter()
        outputs[name] = [greedy(tokenizer, model, p, max_new_tokens) for p in PROMPTS[:prompts]]
        seconds[name] = time.perf_counter() - started
        ppl[name] = perplexity(tokenizer, model, TEXT)
        print(f"{name}: {prompts} prompts in {seconds[name]:.1f} s, perplexity {ppl[name]:.3f}",
              flush=True)
    firsts = []
    for a, b in zip(outputs["fp32"], outputs["bf16"], strict=True):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                               min(len(a), len(b))))
    identical = prompts - len(firsts)
    ratio = ppl["bf16"] / ppl["fp32"]
    return {"machine": machine(), "prompts": prompts, "max_new_tokens": max_new_tokens,
            "identical_outputs": identical, "identical_share": identical / prompts,
            "mean_first_difference": (sum(firsts) / len(firsts)) if firsts else None,
            "perplexity": ppl, "perplexity_ratio": ratio,
            "gate": {"max_ratio": GATE_PPL_RATIO, "passed": ratio <= GATE_PPL_RATIO},
            "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bf16_quality",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS),
                        choices=range(1, len(PROMPTS) + 1), metavar=f"1..{len(PROMPTS)}")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    report = run(args.max_new_tokens, args.prompts)
    print(f"identical outputs: {report['identical_outputs']} of {report['prompts']} "
          f"({report['identical_share']:.0%}); mean first difference at token "
          f"{report['mean_first_difference']}")
    print(f"perplexity fp32 {report['perplexity']['fp32']:.3f}, bf16 "
          f"{report['perplexity']['bf16']:.3f}: ratio {report['perplexity_ratio']:.4f} "
          f"(gate <= {GATE_PPL_RATIO}: {'PASS' if report['gate']['passed'] else 'FAIL'})")
    path = write_json("bf16_quality", report, args.out_dir)
    print(f"wrote {path}")
    return 0 if report["gate"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
