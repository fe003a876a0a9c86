"""Every valid sampling value gives a valid token, following each field's usual rule.

A temperature below ``SAMPLING_EPS`` is greedy (vLLM's rule), top-p keeps at least the most
likely token, a top-k at or above the vocabulary filters nothing, and a huge temperature still
samples (towards the uniform choice among allowed tokens). A row whose logits are unusable gets
an error in place of its token, and the other rows' tokens do not change.
"""

from __future__ import annotations

import pytest
import torch

from inference.engine.backends.reference import ByteTokenizer
from inference.engine.request import SAMPLING_EPS, ErrorInfo, FinishReason, Request, SamplingParams
from inference.engine.sampling import sample
from tests.support.engine import EventLog, make_engine, run_until_idle

PROMPTS = {"a": "hello there", "b": "another prompt", "c": "x"}


def run(sampling: SamplingParams, neighbour: SamplingParams | None = None
        ) -> dict[str, tuple[list[int], FinishReason]]:
    """Each of ``PROMPTS`` with ``sampling``, in one engine (with a neighbour if given)."""
    engine, log = make_engine(), EventLog()
    for rid, prompt in PROMPTS.items():
        engine.submit(prompt=prompt, request_id=rid, sampling=sampling)
    if neighbour is not None:
        engine.submit(prompt="the neighbour", request_id="n", sampling=neighbour)
    run_until_idle(engine, log)
    return {rid: (log.tokens(rid), log.final(rid).finish_reason) for rid in log.by_request}


@pytest.mark.parametrize("max_tokens", [1, 9])
@pytest.mark.parametrize("temperature,top_p", [
    (1e-40, 1.0), (1.0, 1e-300), (1e-40, 1e-300), (5e-324, 5e-324)])
def test_tiny_temperature_or_top_p_gives_the_greedy_tokens(temperature, top_p, max_tokens):
    greedy = run(SamplingParams(max_tokens=max_tokens))
    got = run(SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             seed=5))
    assert got == greedy
    assert all(reason is FinishReason.LENGTH and len(tokens) == max_tokens
               for tokens, reason in got.values())


def test_hostile_values_leave_a_neighbour_s_tokens_unchanged():
    neighbour = SamplingParams(max_tokens=9, temperature=0.8, top_k=5, seed=11)
    calm = run(SamplingParams(max_tokens=9), neighbour)["n"]
    for hostile in (SamplingParams(max_tokens=9, temperature=1e-40, top_p=1e-300),
                    SamplingParams(max_tokens=9, temperature=1e308, seed=2)):
        assert run(hostile, neighbour)["n"] == calm


def test_a_huge_temperature_samples_valid_allowed_tokens():
    for temperature in (3.0, 1e6, 1e30, 1e300, 1.7e308):
        for top_k in (0, 10**9):
            got = run(SamplingParams(max_tokens=24, temperature=temperature, top_k=top_k, seed=3))
            tokens = [t for toks, _ in got.values() for t in toks]
            assert all(reason is FinishReason.LENGTH for _, reason in got.values())
            # The reference backend masks EOS with -inf: even the uniform limit never picks it.
            assert all(0 <= t < ByteTokenizer.eos_token_id for t in tokens), temperature
            if temperature >= 1e6:  # flat: far more than the backend's two likely letters
                assert len(set(tokens)) > 10, temperature


def test_below_sampling_eps_is_greedy_even_at_a_near_tie():
    logits = torch.tensor([[1.0, 1.0 - 2e-6, -3.0]])
    for temperature in (SAMPLING_EPS * 0.999, 1e-7, 1e-40):
        assert {sample(logits, [_request(temperature=temperature, seed=s)], frozenset())[0]
                for s in range(40)} == {0}, temperature
    # Just above it, the near-tie is sampled (both tokens come up).
    assert {sample(logits, [_request(temperature=SAMPLING_EPS * 1.001, seed=s)], frozenset())[0]
            for s in range(40)} == {0, 1}


def _request(**params) -> Request:
    return Request("r", [1], SamplingParams(**params))


def test_extreme_logits_and_temperatures_sample_valid_tokens():
    big = torch.tensor([[3e38, -3e38, 1e38, float("-inf")], [-1e30, -2e30, -3e30, -3e38]])
    for temperature in (SAMPLING_EPS, 2e-5, 1.0, 1e30, 1e308):
        out = sample(big, [_request(temperature=temperature, seed=s) for s in range(2)],
                     frozenset())
        assert all(isinstance(t, int) and t != 3 for t in out), (temperature, out)
    torch.manual_seed(0)
    logits = torch.randn(1, 40)
    for temperature in (2.0, 1e308):  # top-k at or above the vocabulary filters nothing
        for top_k in (40, 41, 10**9):
            assert ([sample(logits, [_request(temperature=temperature, top_k=top_k, seed=s)],
                            frozenset()) for s in range(30)]
                    == [sample(logits, [_request(temperature=temperature, seed=s)], frozenset())
                        for s in range(30)])
    assert sample(big, [_request(temperature=1e-6), _request(temperature=2e-5, seed=1)],
                  frozenset()) == [0, 0]


def test_an_unusable_row_gets_an_error_and_the_others_their_same_tokens():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    rows = [dict(temperature=0.9, seed=4), dict(), dict(temperature=0.7, top_p=0.8, seed=9),
            dict(temperature=1.2, top_k=3, seed=2)]
    clean = sample(logits, [_request(**p) for p in rows], frozenset())
    for bad_row, value, where in ((0, float("nan"), slice(None)), (1, float("nan"), 17),
                                  (3, float("inf"), 4), (2, float("-inf"), slice(None))):
        poisoned = logits.clone()
        poisoned[bad_row, where] = value  # a single NaN or +inf logit is enough
        out = sample(poisoned, [_request(**p) for p in rows], frozenset())
        assert isinstance(out[bad_row], ErrorInfo)
        assert out[bad_row].code == "engine_error" and out[bad_row].details["phase"] == "sampling"
        assert [t for i, t in enumerate(out) if i != bad_row] == [
            t for i, t in enumerate(clean) if i != bad_row]


def test_min_tokens_with_only_eos_allowed_fails_that_row_only():
    logits = torch.tensor([[float("-inf"), float("-inf"), 5.0], [0.0, 1.0, 5.0]])
    out = sample(logits, [_request(min_tokens=2), _request()], frozenset({2}))
    assert isinstance(out[0], ErrorInfo) and out[0].details["reason"] == "no_allowed_token"
    assert out[1] == 2


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_the_generator_cannot_take_is_refused_up_front(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-(2**63))


def test_seeds_past_32_bits_draw_apart():
    """torch's generator keeps 32 bits of a seed: seeds that share them still draw apart."""
    import torch

    from inference.engine.sampling import generator_seed

    def draw(seed: int) -> float:
        gen = torch.Generator()
        gen.manual_seed(generator_seed(seed))
        return torch.rand(1, generator=gen).item()

    assert generator_seed(5) == 5 and draw(5) == draw(5)
    assert len({draw(s) for s in (5, 2**32 + 5, 2**63 + 5, -(2**63) + 5, -1, 2**64 - 1)}) == 6
