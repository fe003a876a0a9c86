"""The wire contract of ``n`` > 1 choices: ``Sampling.n``, ``TokenEvent.index``, one
``FinalEvent`` with ``choices`` (a :class:`ChoiceEnd` each, in index order), ``Resume.choices``
for a request preempted as a whole; a request of one choice serializes exactly as before."""

from __future__ import annotations

import pydantic
import pytest

from inference.protocol.events import (
    ChoiceEnd,
    ErrorCode,
    ErrorInfo,
    FinalEvent,
    FinishReason,
    TokenEvent,
    decode_event,
    encode_event,
    whole_request_choices,
)
from inference.protocol.messages import RequestMessage, Resume, ResumeChoice, Sampling


def test_sampling_n_defaults_to_one_and_is_at_least_one():
    assert Sampling().n == 1
    assert Sampling(n=4).n == 4
    with pytest.raises(pydantic.ValidationError):
        Sampling(n=0)
    message = RequestMessage(request_id="r", tenant="t", fairness_key="t", prompt="hi",
                             sampling=Sampling(n=3))
    assert RequestMessage.from_json(message.to_json()).sampling.n == 3


def test_one_choice_events_serialize_as_before():
    token = TokenEvent(request_id="r", seq=0, token_id=5, text="a")
    assert token.index == 0 and "index" not in token.model_dump()
    final = FinalEvent(request_id="r", seq=1, finish_reason=FinishReason.STOP)
    assert final.choices == () and "choices" not in final.model_dump_json()
    for event in (token, final):
        assert decode_event(encode_event(event)) == event


def test_choices_round_trip_in_index_order():
    error = ErrorInfo(code=ErrorCode.ENGINE_ERROR, message="x")
    final = FinalEvent(request_id="r", seq=9, finish_reason=FinishReason.LENGTH, choices=(
        ChoiceEnd(index=0, finish_reason=FinishReason.LENGTH, text="tail", completion_tokens=4),
        ChoiceEnd(index=1, finish_reason=FinishReason.ERROR, error=error, completion_tokens=2)))
    assert decode_event(encode_event(final)) == final
    token = TokenEvent(request_id="r", seq=3, token_id=5, text="a", index=1)
    assert decode_event(encode_event(token)).index == 1
    with pytest.raises(pydantic.ValidationError, match="index order"):
        FinalEvent(request_id="r", finish_reason=FinishReason.STOP, choices=(
            ChoiceEnd(index=1, finish_reason=FinishReason.STOP),))
    with pytest.raises(pydantic.ValidationError, match="error is set exactly"):
        ChoiceEnd(index=0, finish_reason=FinishReason.ERROR)


def test_a_request_ended_as_a_whole_ends_every_choice_as_it():
    error = ErrorInfo(code=ErrorCode.QUEUE_TIMEOUT, message="late")
    ends = whole_request_choices(3, FinishReason.ERROR, error)
    assert [(c.index, c.finish_reason, c.error) for c in ends] == [
        (i, FinishReason.ERROR, error) for i in range(3)]
    assert [c.error for c in whole_request_choices(2, FinishReason.ABORT, error)] == [None] * 2
    assert whole_request_choices(1, FinishReason.ERROR, error) == ()


def resume(**fields) -> Resume:
    base = dict(prompt_tokens=5, max_tokens=10, next_seq=7, preemptions=1, arrived_at=1.0,
                requeued_at=2.0)
    return Resume(**{**base, **fields})


def test_a_resume_of_n_choices_carries_each_choice():
    ended = ChoiceEnd(index=1, finish_reason=FinishReason.STOP, text="!", completion_tokens=2)
    state = resume(choices=(ResumeChoice(index=0, generated=(4, 5, 6), sampler_state="AAE="),
                            ResumeChoice(index=1, end=ended),
                            ResumeChoice(index=2, generated=(9,))))
    assert Resume.from_json(state.to_json()) == state
    assert state.usage().completion_tokens == 3 + 2 + 1
    ends = state.ended_choices(FinishReason.ABORT)
    assert [(c.index, c.finish_reason, c.completion_tokens) for c in ends] == [
        (0, FinishReason.ABORT, 3), (1, FinishReason.STOP, 2), (2, FinishReason.ABORT, 1)]
    one = resume(generated=(1, 2))
    assert "choices" not in one.to_json() and one.ended_choices(FinishReason.ABORT) == ()
    for bad in ({"generated": ()},  # nothing generated, no choices
                {"generated": (1,), "choices": state.choices},  # tokens in both
                {"choices": (ResumeChoice(index=1, generated=(1,)),)},  # not in index order
                {"choices": (ResumeChoice(index=0, end=ended.model_copy(update={"index": 0})),)}):
        with pytest.raises(pydantic.ValidationError):
            resume(**bad)
    with pytest.raises(pydantic.ValidationError):
        ResumeChoice(index=0)  # neither tokens nor an end
