"""What the reference backend answers: each prompt's greedy text computed in-process as the
workers compute it, and the text and finish reason of an answer of a given ``max_tokens``
(what every complete answer, interactive or a batch's line, must equal)."""

from __future__ import annotations


def expected_outputs(prompts: tuple[str, ...], max_tokens: int) -> list[tuple[str, int | None]]:
    """The reference backend's greedy answer to each prompt, computed in-process as the workers
    compute it (same backend, same context length): (text of up to ``max_tokens`` tokens, the
    number of tokens after which it stops on EOS, or None if it did not)."""
    from inference.engine.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(backend="reference", max_batch_size=len(prompts)))
    handles = [engine.submit(prompt=p, sampling=SamplingParams(max_tokens=max_tokens,
                                                               temperature=0.0))
               for p in prompts]
    while engine.has_work():
        engine.step()
    answers = []
    for handle in handles:
        text, tokens, final = handle.result(timeout=5)
        assert len(text) == len(tokens), "the reference backend writes one character a token"
        answers.append((text, len(tokens) if final.finish_reason.value == "stop" else None))
    return answers


def expected_for(answer: tuple[str, int | None], max_tokens: int) -> tuple[str, str]:
    """The expected (text, finish reason) of a complete request of ``max_tokens``."""
    text, stops_after = answer
    if stops_after is not None and stops_after < max_tokens:
        return text[:stops_after], "stop"
    return text[:max_tokens], "length"
