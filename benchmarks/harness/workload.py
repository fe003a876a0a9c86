"""The workload of a serving benchmark: what to send and when.

:class:`RequestSpec` is one request (a prompt, ``max_tokens``, a tenant, an arrival time);
:class:`PromptMaker` cuts prompt texts of a given number of tokens from a seeded corpus of words;
:func:`poisson_arrivals` gives open-loop arrival times; :func:`random_requests` (vLLM's random
dataset) and :func:`shared_prefix_requests` (its prefix-repetition dataset) build workloads, and
:func:`merge` puts several together in order of arrival.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class RequestSpec:
    """One request of a workload.

    Attributes:
        prompt: the prompt text (sent as ``/v1/completions``' ``prompt``).
        max_tokens: tokens to generate; with ``ignore_eos`` exactly this many.
        tenant: who sends it (its API key on the REST API, its fairness key in-process).
        arrival_s: when to send it, seconds after the run starts.
        prompt_len: prompt tokens as built (the server's count is in the result).
        tag: a label for grouping results (e.g. ``long`` or ``short``).
        adapter: the LoRA adapter it runs under in-process (an engine ``AdapterSpec``; None:
            the bare model).
    """

    prompt: str
    max_tokens: int
    tenant: str = "default"
    arrival_s: float = 0.0
    prompt_len: int = 0
    tag: str = ""
    ignore_eos: bool = True
    adapter: Any = None


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


# Plain words for prompt text (random token ids would make an atypical workload).
_WORD_LIST = (
    "the of and to in is was for on that with as by at from this be are or an it his which "
    "have not but were had they one all their has been more when there who will would so "
    "time city river system model light water energy people history market music school "
    "garden winter engine signal memory station island letter summer forest bridge harbour "
    "theory planet library kitchen question number morning village country mountain story "
    "measure process protein network journey language picture weather surface problem "
    "careful quiet bright ancient simple rapid distant gentle narrow modern silent golden "
    "walks builds carries finds opens writes reads follows changes reaches holds turns"
)
_WORDS = _WORD_LIST.split()


class PromptMaker:
    """Prompt texts of (about) a given number of tokens, cut from a seeded corpus of words.

    Args:
        tokenizer: the served model's tokenizer (``encode`` and ``decode``).
        seed: the corpus and the cuts depend only on it.
        corpus_words: words in the corpus (enough for the longest prompt).
    """

    def __init__(self, tokenizer: Tokenizer, seed: int = 0, corpus_words: int = 20_000):
        rng = random.Random(seed)
        words = []
        for i in range(corpus_words):
            word = rng.choice(_WORDS)
            words.append(word.capitalize() + "." if i % 13 == 12 else word)
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(" ".join(words))

    def make(self, num_tokens: int, rng: random.Random) -> str:
        """A text of ``num_tokens`` corpus tokens from a random offset (re-encoding it may
        differ by a token or two at the edges)."""
        if num_tokens > len(self.ids):
            raise ValueError(f"corpus has {len(self.ids)} tokens, {num_tokens} asked")
        start = rng.randrange(0, len(self.ids) - num_tokens + 1)
        return self.tokenizer.decode(self.ids[start:start + num_tokens])


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random,
                     windows: Sequence[tuple[float, float]] | None = None,
                     start_s: float = 0.0) -> list[float]:
    """Arrival times (seconds) of a Poisson process of ``rate`` requests/s in
    ``[start_s, start_s + duration_s)``; with ``windows``, only those falling inside one of the
    ``(begin, end)`` windows are kept (a tenant switching on and off)."""
    times, t = [], start_s
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= start_s + duration_s:
            break
        if windows is None or any(b <= t < e for b, e in windows):
            times.append(t)
    return times


def random_requests(maker: PromptMaker, arrivals: Iterable[float], input_len: tuple[int, int],
                    output_len: tuple[int, int], rng: random.Random, *, tenant: str = "default",
                    tag: str = "") -> list[RequestSpec]:
    """One request per arrival time, prompt and output lengths uniform in the inclusive ranges
    (tokens), like vLLM's random dataset."""
    specs = []
    for t in arrivals:
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        specs.append(RequestSpec(maker.make(n_in, rng), n_out, tenant, t, n_in, tag))
    return specs


def shared_prefix_requests(maker: PromptMaker, arrivals: Iterable[float], num_prefixes: int,
                           prefix_len: int, suffix_len: int, output_len: int,
                           rng: random.Random, *, tenant: str = "default") -> list[RequestSpec]:
    """Requests whose prompts are one of ``num_prefixes`` shared prefixes (``prefix_len``
    tokens, e.g. a system prompt or a document) followed by a unique suffix (``suffix_len``
    tokens), like vLLM's prefix-repetition dataset. ``tag`` is the prefix's index."""
    prefixes = [maker.make(prefix_len, rng) for _ in range(num_prefixes)]
    specs = []
    for i, t in enumerate(arrivals):
        k = i % num_prefixes
        prompt = prefixes[k] + " " + maker.make(suffix_len, rng)
        specs.append(RequestSpec(prompt, output_len, tenant, t, prefix_len + suffix_len,
                                 f"prefix{k}"))
    return specs


def merge(*workloads: Iterable[RequestSpec]) -> list[RequestSpec]:
    """All requests of several workloads, in order of arrival."""
    return sorted((s for w in workloads for s in w), key=lambda s: s.arrival_s)
