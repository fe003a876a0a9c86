"""The prompt budget of a mixed tick and the pass cost model (pure functions)."""

from __future__ import annotations

import pytest

from inference.engine.sched.tick_budget import (
    PassCostModel,
    PassShape,
    _nonnegative_fit,
    chunk_attention,
    plan_prefill,
)

STREAMS = PassShape(decode_rows=4, decode_context=400)
# 10 ms a pass, 2 ms a decode row, 1 ms per prompt token, 0.5 ms per 1,000 attention pairs.
MODEL = PassCostModel([0.010, 0.002, 0.0, 0.001, 0.5])


def test_no_stream_running_gives_the_prompt_the_whole_cap():
    assert plan_prefill([(0, 1000)], PassShape(), MODEL, 0.030, cap=256) == [256]


def test_the_budget_is_the_most_tokens_whose_predicted_pass_fits_the_target():
    take = plan_prefill([(0, 1000)], STREAMS, MODEL, 0.060, cap=256)
    fits = MODEL.predict(PassShape(4, 400, take[0], chunk_attention(0, take[0])))
    over = MODEL.predict(PassShape(4, 400, take[0] + 1, chunk_attention(0, take[0] + 1)))
    assert fits <= 0.060 < over


def test_a_prompt_deep_into_its_context_gets_fewer_tokens_for_the_same_target():
    early = plan_prefill([(0, 4000)], STREAMS, MODEL, 0.060, cap=256)[0]
    late = plan_prefill([(3000, 1000)], STREAMS, MODEL, 0.060, cap=256)[0]
    assert late < early


def test_streams_that_fill_the_target_still_give_the_prompt_as_much_as_they_take():
    decode_only = MODEL.predict(STREAMS)  # 18 ms, over a 1 ms target
    [take] = plan_prefill([(0, 1000)], STREAMS, MODEL, 0.001, cap=256, floor=16)
    tick = MODEL.predict(PassShape(4, 400, take, chunk_attention(0, take)))
    assert take > 16 and tick <= 2 * decode_only + 1e-12
    assert MODEL.predict(PassShape(4, 400, take + 1, chunk_attention(0, take + 1))) > \
        2 * decode_only
    assert plan_prefill([(0, 5)], STREAMS, MODEL, 0.001, cap=256, floor=16) == [5]


def test_without_a_target_every_prompt_runs_a_whole_chunk_as_in_chunked_prefill():
    take = plan_prefill([(0, 3000), (0, 8), (0, 30)], PassShape(), None, 0, cap=16)
    assert take == [16, 8, 16]
    assert plan_prefill([(0, 3000), (0, 400)], STREAMS, MODEL, 0, cap=256) == [256, 256]


def test_a_small_budget_is_not_all_given_to_the_oldest_prompt():
    # 16 tokens fit the target: a quarter to the oldest (4), the rest shortest first.
    one = PassShape(decode_rows=1, decode_context=100)  # twice its pass fits fewer tokens
    target = MODEL.predict(PassShape(1, 100, 16, chunk_attention(0, 4) + chunk_attention(0, 8)
                                     + chunk_attention(0, 4)))
    take = plan_prefill([(0, 3000), (0, 8), (0, 30)], one, MODEL, target, cap=256, floor=1)
    assert take == [4, 8, 4]


def test_short_prompts_go_first_but_the_oldest_always_progresses():
    # A 64-token budget: a quarter to the oldest, the short ones, the rest to the oldest.
    one = PassShape(decode_rows=1, decode_context=100)
    target = MODEL.predict(PassShape(1, 100, 64, chunk_attention(0, 24) + chunk_attention(0, 30)
                                     + chunk_attention(0, 10)))
    take = plan_prefill([(0, 3000), (0, 30), (0, 10)], one, MODEL, target, cap=256, floor=16)
    assert take == [16 + 8, 30, 10]
    # No row runs more than the cap, however large the budget.
    take = plan_prefill([(0, 3000), (0, 30)], STREAMS, MODEL, 10.0, cap=256, floor=16)
    assert take == [256, 30]


def test_a_model_fitted_from_measured_passes_predicts_them():
    truth = [0.02, 0.003, 0.004, 0.0008, 0.3]
    shapes = [PassShape(1, 16, 0, 0), PassShape(16, 256, 0, 0), PassShape(16, 4096, 0, 0),
              PassShape(0, 0, 32, chunk_attention(0, 32)), PassShape(0, 0, 128, 8256),
              PassShape(0, 0, 128, chunk_attention(1024, 128)), PassShape(8, 128, 64, 2080)]
    xs = [s.features() for s in shapes]
    ys = [sum(c * f for c, f in zip(truth, x, strict=True)) for x in xs]
    assert _nonnegative_fit(xs, ys) == pytest.approx(truth, rel=1e-6, abs=1e-9)


def test_a_fit_never_gives_a_negative_cost():
    xs = [[1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 2.0, 0.0, 0.0, 0.0], [1.0, 3.0, 0.0, 0.0, 0.0]]
    coefficients = _nonnegative_fit(xs, [0.03, 0.02, 0.01])  # falls with more rows: noise
    assert all(c >= 0 for c in coefficients)


def test_chunk_attention_counts_causal_pairs():
    assert chunk_attention(0, 1) == 1
    assert chunk_attention(0, 4) == 1 + 2 + 3 + 4
    assert chunk_attention(10, 2) == 11 + 12


def test_calibration_fits_the_passes_own_cost_through_a_stall_of_another_process():
    """A pass slowed by another process (a 1 s stall in one run of one shape) stays out of the
    fit: each shape's fastest run is fitted, and the model predicts the backend's true costs."""
    from inference.engine.sched.tick_budget import PassShape, calibrate, chunk_attention

    true = [0.005, 0.001, 1e-5, 3e-4, 1e-8]  # c0, c_row, c_ctx, c_tok, c_attn (seconds)
    now = [0.0]
    calls = [0]

    class Timed:
        max_model_len = 4096

        def prefill_and_decode(self, chunks, rows):
            shape = PassShape(len(rows), sum(r.position + 1 for r in rows),
                              sum(len(c.token_ids) for c in chunks),
                              sum(chunk_attention(c.start_pos, len(c.token_ids)) for c in chunks))
            calls[0] += 1
            now[0] += sum(c * f for c, f in zip(true, shape.features(), strict=True))
            if calls[0] == 5:
                now[0] += 1.0  # the stall

    model = calibrate(Timed(), list(range(128)), 16, clock=lambda: now[0])
    for shape in (PassShape(8, 2000, 0, 0), PassShape(4, 1000, 256, chunk_attention(2048, 256)),
                  PassShape(0, 0, 128, chunk_attention(0, 128))):
        expected = sum(c * f for c, f in zip(true, shape.features(), strict=True))
        assert abs(model.raw(shape) - expected) < 0.02 * expected + 1e-4


def test_a_fit_skewed_at_start_up_is_refitted_from_the_passes_that_follow():
    """A start-up fit measured on a busy machine (every calibration pass 3x slow, prompt tokens
    8x) predicts serving passes badly; the refits on measured passes bring the predictions back
    within 5 % of the true costs, and a refit that would fit worse is never kept."""
    import random

    from inference.engine.sched.tick_budget import (
        REFIT_EVERY,
        PassCostModel,
        PassShape,
        chunk_attention,
    )

    true = [0.008, 0.0003, 0.002, 2.7e-4, 1.2e-4]

    def cost(shape: PassShape) -> float:
        return sum(c * f for c, f in zip(true, shape.features(), strict=True))

    rng = random.Random(0)

    def serving_pass() -> PassShape:
        rows = rng.randint(1, 16)
        tokens = rng.choice([0, 0, 0, 16, 64, 256])
        start = rng.randint(0, 3000)
        return PassShape(rows, rows * rng.randint(50, 2000), tokens,
                         chunk_attention(start, tokens) if tokens else 0)

    calibration = [PassShape(1, 16), PassShape(16, 256), PassShape(16, 4096),
                   PassShape(0, 0, 32, chunk_attention(0, 32)),
                   PassShape(0, 0, 128, chunk_attention(0, 128)),
                   PassShape(0, 0, 128, chunk_attention(1024, 128))]
    skewed = [(s, 3 * cost(s) * (8 if s.prefill_tokens else 1)) for s in calibration]
    model = PassCostModel([0.03, 0.0, 0.0, 6e-3, 0.0], skewed)
    probes = [serving_pass() for _ in range(50)]

    def worst_error() -> float:
        return max(abs(model.predict(s) - cost(s)) / cost(s) for s in probes)

    assert worst_error() > 0.5
    for _ in range(4 * REFIT_EVERY):
        shape = serving_pass()
        model.observe(shape, cost(shape))
    assert model.refits >= 1 and worst_error() < 0.05
    kept = list(model.coefficients)
    for _ in range(REFIT_EVERY):  # passes a refit cannot improve on: the fit stays
        shape = serving_pass()
        model.observe(shape, cost(shape))
    assert model.coefficients == kept or worst_error() < 0.05


def test_refits_keep_what_the_latest_passes_do_not_vary():
    """Serving often runs one row count for minutes and no long prompt for a while: refits on
    such passes alone moved every cost onto c0 and none onto attention (a deep 256-token chunk
    predicted at a quarter of its cost). The calibration's passes pin those, so every refit
    stays near the true costs (10 % noise on each measured pass)."""
    import random

    from inference.engine.sched.tick_budget import PassCostModel, PassShape, chunk_attention

    rng = random.Random(0)
    true = [0.010, 0.0, 0.003, 0.0004, 0.100]

    def cost(shape: PassShape) -> float:
        return sum(c * f for c, f in zip(true, shape.features(), strict=True))

    calibration = [PassShape(1, 16), PassShape(8, 128), PassShape(8, 8192),
                   PassShape(0, 0, 32, chunk_attention(0, 32)),
                   PassShape(0, 0, 128, chunk_attention(0, 128)),
                   PassShape(0, 0, 128, chunk_attention(1024, 128)),
                   PassShape(8, 128, 64, chunk_attention(0, 64))]
    model = PassCostModel(true, [(s, cost(s)) for s in calibration])
    deep = PassShape(3, 900, 256, chunk_attention(2048, 256))
    wide = PassShape(32, 32 * 300)
    contexts, left, position, refits = [60, 200, 350], 0, 0, 0
    for i in range(64 * 60):
        contexts = [c + 1 if c < 460 else 60 for c in contexts]
        tokens = attention = 0
        if not left and i % 1500 == 700:
            left, position = 2400, 0
        if left:
            tokens = min(256, left)
            attention = chunk_attention(position, tokens)
            position, left = position + tokens, left - tokens
        elif rng.random() < 0.02:
            tokens, attention = 60, chunk_attention(0, 60)
        shape = PassShape(3, sum(contexts), tokens, attention)
        model.observe(shape, cost(shape) * rng.uniform(0.9, 1.1))
        if model.refits != refits:
            refits = model.refits
            for probe in (deep, wide):
                assert abs(model.raw(probe) - cost(probe)) < 0.25 * cost(probe), (i, probe)
    assert refits >= 10
