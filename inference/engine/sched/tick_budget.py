"""ITL-targeted ticks: a cost model of one forward pass and the prefill budget it gives a tick.

With ``PREFILL_MODE=mixed_batch`` a tick is one forward pass carrying every decode row and some
prompt tokens. A running stream's inter-token latency (ITL) is the tick's duration, so the tick's
prompt tokens are sized to keep the pass near ``TARGET_ITL_MS`` (the idea of Sarathi-Serve's
token budget, Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI 2024; here the budget comes from a measured cost model instead of a fixed
token count). ``PREFILL_CHUNK_SIZE`` caps each prefilling row's tokens in a tick; with no stream
running, every row takes its whole cap (as a chunked tick does). Where the decode rows alone
take the target or more (a slow machine, a large batch), the prompt tokens still get as much of
the tick as the decode rows take.

The cost model (:class:`PassCostModel`) is linear in the features of a pass
(:class:`PassShape`)::

    seconds = c0 + c_row * decode_rows + c_ctx * decode_context
              + c_tok * prefill_tokens + c_attn * prefill_attention

``decode_context`` is the tokens the decode rows attend to in all; ``prefill_attention`` the
(query, key) pairs of the prompt tokens' causal attention (a chunk of ``n`` tokens from position
``s`` has ``n * s + n * (n + 1) / 2``). It is fitted at start-up from timed passes over the real
backend (:func:`calibrate`, least squares with non-negative coefficients) and corrected as it
runs: each pass's measured time over its prediction feeds an exponential moving average that
scales every prediction (:meth:`PassCostModel.observe`), so a slower or busier machine than at
start-up shrinks the budget within a few ticks; every :data:`REFIT_EVERY` passes the coefficients
are refitted on the latest measured passes, which replaces a start-up fit that a busy machine
skewed in shape.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inference.engine.backends.base import DecodeRow, ModelBackend, PrefillChunk

log = logging.getLogger(__name__)

# Smallest prompt share of a tick while streams run, so a prompt always progresses even when
# the decode rows alone take the whole target (tokens).
MIN_PREFILL_TOKENS = 16
CORRECTION_ALPHA = 0.2  # weight of the newest pass in the moving average of measured/predicted
CORRECTION_RANGE = (0.5, 4.0)
CALIBRATION_RUNS = 3  # timed runs of each calibration pass (the fastest is fitted)
REFIT_EVERY = 64  # measured passes between two refits of the coefficients
FIRST_REFIT = 16  # measured passes before the first (a start-up fit may be far off)
REFIT_WINDOW = 512  # the most recent measured passes a refit uses, with the calibration's
FEATURES = ("c0", "c_row", "c_ctx", "c_tok", "c_attn")


@dataclass(frozen=True)
class PassShape:
    """What a forward pass computes, as the cost model sees it (counts of tokens)."""

    decode_rows: int = 0
    decode_context: int = 0  # sum over decode rows of the tokens each attends to
    prefill_tokens: int = 0
    prefill_attention: int = 0  # (query, key) pairs of the prompt tokens, causal

    def features(self) -> list[float]:
        return [1.0, float(self.decode_rows), self.decode_context / 1e3,
                float(self.prefill_tokens), self.prefill_attention / 1e6]


def chunk_attention(start: int, tokens: int) -> int:
    """(query, key) pairs of ``tokens`` prompt tokens from position ``start``, causal."""
    return tokens * start + tokens * (tokens + 1) // 2


class PassCostModel:
    """Predicted seconds of a forward pass (module docstring); corrected by measured passes.

    Args:
        coefficients: ``c0, c_row, c_ctx, c_tok, c_attn`` in seconds per unit of
            :meth:`PassShape.features` (per row, per 1,000 context tokens, per prompt token, per
            million attention pairs).
    """

    def __init__(self, coefficients: Sequence[float],
                 points: Sequence[tuple[PassShape, float]] = ()):
        if len(coefficients) != len(FEATURES):
            raise ValueError(f"expected {len(FEATURES)} coefficients, got {len(coefficients)}")
        self.coefficients = [max(0.0, float(c)) for c in coefficients]
        self.correction = 1.0
        self.passes = 0
        self.refits = 0
        # The calibration's passes (none: the coefficients are never refitted) and the latest
        # measured ones: a start-up fit skewed by a busy machine is replaced as passes come.
        self._points = [(s.features(), t) for s, t in points]
        self._recent: deque[tuple[list[float], float]] = deque(maxlen=REFIT_WINDOW)

    def raw(self, shape: PassShape) -> float:
        """The calibrated prediction in seconds, before the running correction."""
        return sum(c * f for c, f in zip(self.coefficients, shape.features(), strict=True))

    def predict(self, shape: PassShape) -> float:
        """Predicted seconds of a pass of ``shape``."""
        return self.raw(shape) * self.correction

    def observe(self, shape: PassShape, seconds: float) -> None:
        """Feed a measured pass: moves the correction toward ``seconds / raw(shape)``."""
        raw = self.raw(shape)
        if raw <= 0 or not seconds > 0:
            return
        ratio = min(max(seconds / raw, CORRECTION_RANGE[0]), CORRECTION_RANGE[1])
        self.correction += CORRECTION_ALPHA * (ratio - self.correction)
        self.passes += 1
        if self._points:
            self._recent.append((shape.features(), seconds))
            if self.passes % REFIT_EVERY == 0 or self.passes == FIRST_REFIT:
                self._refit()

    def _refit(self) -> None:
        """Refit the coefficients on the latest passes and the calibration's, by relative error;
        keep the new fit only if it predicts the latest passes better than the corrected current
        one. The calibration's passes (1 to 16 rows, prompt chunks shallow and deep) pin what the
        latest ones do not vary: serving often runs the same row count for minutes, or no long
        prompt, and a fit on those alone puts any cost on ``c0`` or none on attention."""
        points = [*self._recent, *self._points]
        fit = _nonnegative_fit([[f / y for f in x] for x, y in points], [1.0] * len(points))
        if not all(math.isfinite(c) for c in fit) or not any(c > 0 for c in fit):
            return

        def error(coefficients: list[float], scale: float) -> float:
            return sum(abs(scale * sum(c * f for c, f in zip(coefficients, x, strict=True)) - y)
                       / y for x, y in self._recent)

        if error(fit, 1.0) < error(self.coefficients, self.correction):
            self.coefficients, self.correction = fit, 1.0
            self.refits += 1

    def to_dict(self) -> dict[str, float]:
        """The fit (ms per unit) and the running correction, for stats."""
        fit = {name: round(c * 1e3, 4) for name, c in zip(FEATURES, self.coefficients,
                                                          strict=True)}
        return {**fit, "correction": round(self.correction, 3), "refits": self.refits}


def plan_prefill(prefilling: Sequence[tuple[int, int]], decode: PassShape,
                 model: PassCostModel | None, target_s: float, cap: int,
                 floor: int = MIN_PREFILL_TOKENS) -> list[int]:
    """Prompt tokens each prefilling row runs this tick.

    Each row runs at most ``cap`` tokens (as a chunked prefill tick runs one chunk of every
    prefilling row). The tick's prompt budget is the most tokens whose predicted pass fits
    ``target_s``, but never less than the tokens whose predicted cost matches the decode rows'
    own (so when the decode rows alone take the target or more, a tick at most about doubles,
    and prompts still progress at a useful rate), nor than ``floor``. Rows are then served
    shortest-remaining first (it minimises the mean TTFT), except that the oldest row (index 0)
    always gets a quarter of the budget (at least one token), so no prompt waits forever behind
    a flow of short ones.

    Args:
        prefilling: ``(position of the next prompt token, prompt tokens left)`` per row, oldest
            first.
        decode: the tick's decode rows (prefill fields zero).
        model: the cost model; None: no target (every row takes ``cap``).
        target_s: the tick's target duration (seconds); 0 or less: no target.
        cap: most prompt tokens of one row in the tick (``PREFILL_CHUNK_SIZE``).
        floor: fewest prompt tokens in a tick that has decode rows (if any are left).

    Returns:
        Tokens per row, in ``prefilling``'s order (0: not this tick).
    """
    budget = sum(min(cap, left) for _, left in prefilling)
    if budget == 0:
        return [0] * len(prefilling)
    if decode.decode_rows and model is not None and target_s > 0:
        decode_only = model.predict(decode)
        budget = max(
            _largest_within(prefilling, decode, model, target_s, budget, floor, cap),
            _largest_within(prefilling, decode, model, 2 * decode_only, budget, floor, cap))
    return _split(prefilling, budget, cap)


def batch_ceiling(model: PassCostModel, interactive: PassShape, slack_fraction: float,
                  slack_s: float) -> float:
    """The longest pass batch rows may make (``docs/design.md``, "The batch service class"):
    the interactive rows' own predicted pass (``interactive``), times ``1 + slack_fraction``
    (``BATCH_ITL_SLACK_FRACTION``), plus ``slack_s`` seconds (``BATCH_ITL_SLACK_MS``)."""
    return model.predict(interactive) * (1.0 + slack_fraction) + slack_s


def batch_row_fits(interactive: PassShape, batch: PassShape, rows: int, context: int,
                   model: PassCostModel | None, slack_fraction: float, slack_s: float) -> bool:
    """Whether a batch request may be admitted (``docs/design.md``, "The batch service class"):
    the predicted pass of every row, its ``rows`` (attending to ``context`` tokens in all) added
    as decode rows, stays within :func:`batch_ceiling` of the interactive rows.

    Args:
        interactive, batch: the admitted rows of each class as the decode rows they are or
            become (prefill fields zero).
        model: the pass cost model; None: always True.

    Returns:
        True also when no interactive row is admitted: batch work then fills the machine.
    """
    if model is None or interactive.decode_rows == 0:
        return True
    with_row = PassShape(interactive.decode_rows + batch.decode_rows + rows,
                         interactive.decode_context + batch.decode_context + context)
    return model.predict(with_row) <= batch_ceiling(model, interactive, slack_fraction, slack_s)


def batch_decode_rows(interactive: PassShape, contexts: Sequence[int], model: PassCostModel,
                      ceiling_s: float) -> int:
    """How many batch decode rows (their context tokens ``contexts``, in the order they run)
    join a pass beside the interactive rows (``interactive``): the most whose predicted pass
    stays within ``ceiling_s``; the others wait for a later pass, their KV blocks kept."""
    rows, context = interactive.decode_rows, interactive.decode_context
    for n, tokens in enumerate(contexts):
        if model.predict(PassShape(rows + 1, context + tokens)) > ceiling_s:
            return n
        rows, context = rows + 1, context + tokens
    return len(contexts)


def plan_batch_prefill(prefilling: Sequence[tuple[int, int]], base: PassShape,
                       model: PassCostModel, ceiling_s: float, cap: int,
                       floor: int = 0) -> list[int]:
    """Prompt tokens each batch prefilling row runs this tick, beside interactive rows: the
    most (at most ``cap`` per row, split as :func:`plan_prefill` splits) whose predicted pass,
    ``base`` (every decode row and the interactive rows' prompt tokens) included, fits
    ``ceiling_s`` (the interactive rows' own pass plus the slack), and at least ``floor`` in
    all; none fit and no ``floor``: 0 each.

    Args:
        prefilling: ``(position of the next prompt token, prompt tokens left)`` per batch row,
            oldest first.
    """
    def fits(tokens: int) -> bool:
        extra = _shape(prefilling, base, tokens, cap)
        return model.predict(PassShape(
            base.decode_rows, base.decode_context, base.prefill_tokens + tokens,
            base.prefill_attention + extra.prefill_attention)) <= ceiling_s

    low, high = 0, sum(min(cap, left) for _, left in prefilling)
    if high and fits(high):
        low = high
    while high - low > 1:  # the prediction grows with the tokens: bisect
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    low = max(low, min(floor, high))
    return _split(prefilling, low, cap) if low else [0] * len(prefilling)


def _split(prefilling: Sequence[tuple[int, int]], budget: int, cap: int) -> list[int]:
    take = [0] * len(prefilling)
    take[0] = min(prefilling[0][1], cap, max(1, budget // 4))
    budget -= take[0]
    for i in sorted(range(len(prefilling)), key=lambda r: (prefilling[r][1], r)):
        more = min(min(prefilling[i][1], cap) - take[i], budget)
        take[i] += more
        budget -= more
        if budget == 0:
            break
    return take


def _shape(prefilling: Sequence[tuple[int, int]], decode: PassShape, tokens: int,
           cap: int) -> PassShape:
    attention = sum(chunk_attention(start, n)
                    for (start, _), n in zip(prefilling, _split(prefilling, tokens, cap),
                                             strict=True) if n)
    return PassShape(decode.decode_rows, decode.decode_context, tokens, attention)


def _largest_within(prefilling: Sequence[tuple[int, int]], decode: PassShape,
                    model: PassCostModel, target_s: float, budget: int, floor: int,
                    cap: int) -> int:
    """The most tokens (``floor`` to ``budget``) whose predicted pass fits ``target_s``."""
    low = min(floor, budget)
    if model.predict(_shape(prefilling, decode, budget, cap)) <= target_s:
        return budget
    high = budget  # predicted over the target
    while high - low > 1:  # the prediction grows with the tokens: bisect
        mid = (low + high) // 2
        if model.predict(_shape(prefilling, decode, mid, cap)) <= target_s:
            low = mid
        else:
            high = mid
    return low


def calibrate(backend: ModelBackend, blocks: Sequence[int], block_size: int,
              clock: Callable[[], float] = time.perf_counter) -> PassCostModel:
    """Fit a :class:`PassCostModel` from timed passes over ``backend`` (eight shapes, the
    fastest of :data:`CALIBRATION_RUNS` runs each, after a warm-up pass: about 1.5 s on the
    default model in bf16 on 2 cores).

    The passes write K/V into ``blocks`` (free blocks of the pool, at least 8; their content is
    scratch afterwards): decode batches of 1 to 16 rows at short and long contexts, prompt
    chunks of 32 and 128 tokens at the start and deep into a context, and a mixed pass. The
    fit needs to be right only roughly: the running correction (:meth:`PassCostModel.observe`)
    takes out a uniform error within a few ticks.

    Raises:
        ValueError: for fewer than 8 blocks.
    """
    if len(blocks) < 8:
        raise ValueError(f"calibration needs at least 8 free KV blocks, got {len(blocks)}")
    capacity = min(len(blocks) * block_size, backend.max_model_len)
    table = tuple(blocks)
    deep = max(0, min(capacity - 128, 1024))
    rows_fit = max(1, min(16, len(blocks) // 2))
    short = min(block_size, capacity // rows_fit)

    def decode_rows(n: int, length: int) -> list[DecodeRow]:
        per = len(table) // n
        return [DecodeRow(f"calibrate-d{i}", 0, length - 1, table[i * per:(i + 1) * per])
                for i in range(n)]

    def chunk(start: int, n: int) -> PrefillChunk:
        return PrefillChunk("calibrate-p", [0] * n, start, table)

    cases: list[tuple[list[PrefillChunk], list[DecodeRow]]] = [
        ([], decode_rows(1, short)), ([], decode_rows(rows_fit, short)),
        ([], decode_rows(rows_fit, max(short, (len(table) // rows_fit) * block_size))),
        ([chunk(0, min(32, capacity))], []), ([chunk(0, min(128, capacity))], []),
    ]
    if deep:
        cases.append(([chunk(deep, 128)], []))
    span = len(table) // 2
    mixed_rows = [DecodeRow(f"calibrate-m{i}", 0, short - 1, table[span + i:span + i + 1])
                  for i in range(min(8, span))]
    cases.append(([PrefillChunk("calibrate-p", [0] * min(64, span * block_size), 0,
                                table[:span])], mixed_rows))
    backend.prefill_and_decode(*cases[1])  # warm-up: first-call costs stay out of the fit
    points = []
    for chunks, rows in cases:
        # Another process taking the CPU only ever adds time: the fastest of a few runs is
        # the pass's own cost (one run each fitted anything from 0 to 1 s of c0 under load).
        seconds = float("inf")
        for _ in range(CALIBRATION_RUNS):
            started = clock()
            backend.prefill_and_decode(chunks, rows)
            seconds = min(seconds, clock() - started)
        shape = PassShape(
            len(rows), sum(r.position + 1 for r in rows), sum(len(c.token_ids) for c in chunks),
            sum(chunk_attention(c.start_pos, len(c.token_ids)) for c in chunks))
        points.append((shape, seconds))
    model = PassCostModel(_nonnegative_fit([p.features() for p, _ in points],
                                           [t for _, t in points]), points)
    log.info("pass cost model fitted (ms per unit): %s", model.to_dict())
    return model


def _nonnegative_fit(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares ``xs @ c ~ ys`` with ``c >= 0``: features whose coefficient comes out
    negative are dropped and the rest refitted (an active-set approximation of NNLS)."""
    active = list(range(len(xs[0])))
    x_all = torch.tensor(xs, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)[:, None]
    coef = torch.zeros(len(xs[0]), dtype=torch.float64)
    while active:
        sol = torch.linalg.lstsq(x_all[:, active], y).solution[:, 0]
        if bool((sol >= 0).all()):
            coef[active] = sol
            break
        active = [a for a, c in zip(active, sol.tolist(), strict=True) if c > 0]
    return coef.tolist()
