"""The baseline: plain transformers ``model.generate`` with a JSON-schema logits processor built
from llguidance as a user would write it (``llguidance.hf.from_tokenizer``, one ``LLMatcher`` per
row, ``llguidance.torch.fill_next_token_bitmask`` and ``apply_token_bitmask_inplace``, each
sampled token consumed on the next call). Static batches of ``batch`` requests, left-padded,
each run until its longest answer ends; the model in the dtype the worker's ``DTYPE=auto``
resolves to on this machine (:func:`inference.engine.backends.hf.loading.resolve_dtype`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.structured.schemas import Answer, Task

MODEL = Path(__file__).resolve().parents[2] / ".cache" / "models" / "SmolLM2-135M-Instruct"


def worker_dtype() -> Any:
    """The torch dtype the worker's ``DTYPE=auto`` picks on this machine's CPU."""
    import torch

    from inference.engine.backends.hf.loading import resolve_dtype

    return resolve_dtype("auto", torch.device("cpu"))


class Baseline:
    """The model, its tokenizer and llguidance's tokenizer, loaded once (offline).

    Attributes:
        mask_seconds, masks: wall seconds spent in ``fill_next_token_bitmask`` and the number of
            row masks computed, over every :meth:`run` (the mask cost per row and step).
        processor_seconds: wall seconds in the logits processor's calls altogether (consuming
            tokens, masks, ``apply_token_bitmask_inplace``).
    """

    def __init__(self, model_path: str | Path = MODEL):
        import llguidance.hf
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.dtype = worker_dtype()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).eval()
        self.lltok = llguidance.hf.from_tokenizer(self.tokenizer)
        self.eos = self.tokenizer.eos_token_id
        pad = self.model.generation_config.pad_token_id
        self.pad = pad if pad is not None else self.eos
        self.mask_seconds = 0.0
        self.masks = 0
        self.processor_seconds = 0.0
        self._torch = torch

    def processor(self, schemas: list[dict[str, Any]], prompt_width: int) -> Any:
        """A logits processor holding one llguidance matcher per row of the batch."""
        import json

        import llguidance
        import llguidance.torch as lltorch
        from transformers import LogitsProcessor

        baseline = self

        class JsonSchemaProcessor(LogitsProcessor):
            def __init__(self) -> None:
                self.matchers = [llguidance.LLMatcher(
                    baseline.lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s)))
                    for s in schemas]
                self.bitmask = lltorch.allocate_token_bitmask(len(schemas),
                                                              baseline.lltok.vocab_size)
                self.done = [False] * len(schemas)

            def __call__(self, input_ids, scores):  # noqa: ANN001 - transformers' signature
                entered = time.perf_counter()
                if input_ids.shape[1] > prompt_width:  # the token sampled last step
                    for row, token in enumerate(input_ids[:, -1].tolist()):
                        if not self.done[row]:  # a matcher that stopped still takes the EOS
                            self.matchers[row].consume_token(token)
                            self.done[row] = token == baseline.eos
                started = time.perf_counter()
                for row, matcher in enumerate(self.matchers):
                    if self.done[row]:  # ended: generate pads this row anyway
                        self.bitmask[row].fill_(-1)
                    else:
                        lltorch.fill_next_token_bitmask(matcher, self.bitmask, row)
                        baseline.masks += 1
                baseline.mask_seconds += time.perf_counter() - started
                lltorch.apply_token_bitmask_inplace(scores, self.bitmask)
                baseline.processor_seconds += time.perf_counter() - entered
                return scores

        return JsonSchemaProcessor()

    def run(self, tasks: list[Task], *, batch: int, max_tokens: int, temperature: float = 0.0,
            seed: int = 0) -> list[Answer]:
        """Every task in static batches of ``batch``; ``temperature`` 0 is greedy (else sampled
        with ``torch.manual_seed(seed + first row's index)`` per batch, no top-k or top-p)."""
        from transformers import LogitsProcessorList

        torch = self._torch
        answers: list[Answer] = []
        for first in range(0, len(tasks), batch):
            group = tasks[first:first + batch]
            prompts = [self._ids(t.messages) for t in group]
            width = max(map(len, prompts))
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            sampling: dict[str, Any] = {"do_sample": False}
            if temperature > 0:
                torch.manual_seed(seed + first)
                sampling = {"do_sample": True, "temperature": temperature, "top_k": 0,
                            "top_p": 1.0}
            procs = LogitsProcessorList([self.processor([t.schema_json for t in group], width)])
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask,
                                          max_new_tokens=max_tokens, pad_token_id=self.pad,
                                          eos_token_id=self.eos, logits_processor=procs,
                                          **sampling)
            for task, row in zip(group, out[:, width:].tolist(), strict=True):
                answers.append(self._answer(task, row, max_tokens))
        return answers

    def _ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _answer(self, task: Task, row: list[int], max_tokens: int) -> Answer:
        if self.eos in row:
            end = row.index(self.eos)
            text = self.tokenizer.decode(row[:end], skip_special_tokens=True)
            return Answer(task.schema, text, "stop", end + 1)  # the EOS counted, as usage does
        text = self.tokenizer.decode(row[:max_tokens], skip_special_tokens=True)
        return Answer(task.schema, text, "length", min(len(row), max_tokens))
