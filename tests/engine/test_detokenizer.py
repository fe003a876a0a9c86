"""Incremental detokenization and stop strings, on the byte-level reference tokenizer."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from inference.engine.backends.reference import ByteTokenizer
from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.request import SamplingParams
from inference.engine.sampling import sample

TOKENIZER = ByteTokenizer()


def stream(text, stop=()):
    detok = IncrementalDetokenizer(TOKENIZER, stop)
    deltas = [detok.add_token(t) for t in TOKENIZER.encode(text)]
    return deltas, detok


@given(st.text(min_size=1, max_size=40))
def test_every_delta_is_whole_characters_and_they_add_up_to_the_text(text):
    deltas, detok = stream(text)
    assert "".join(deltas) + detok.flush() == text
    for delta in deltas:
        assert "\ufffd" not in delta or "\ufffd" in text
        delta.encode("utf-8")  # valid on its own


def test_a_multibyte_character_is_emitted_once_when_complete():
    deltas, _ = stream("né🙂")
    assert [d for d in deltas if d] == ["n", "é", "🙂"]
    assert len(deltas) == 1 + 2 + 4


def test_a_stop_string_spanning_several_tokens_is_never_partly_streamed():
    deltas, detok = stream("hello END world", stop=("END",))
    assert "".join(deltas) == "hello "
    assert detok.stopped
    assert all("E" not in d for d in deltas)


def test_text_held_back_for_a_possible_stop_string_is_released_when_it_is_not_one():
    deltas, detok = stream("abc EN", stop=("END",))
    assert "".join(deltas) == "abc "
    assert not detok.stopped
    assert detok.flush() == "EN"


@given(st.text(alphabet="abE ND", max_size=30))
def test_stop_strings_never_leak_into_the_stream(text):
    deltas, detok = stream(text, stop=("END", "DD"))
    streamed = "".join(deltas) + ("" if detok.stopped else detok.flush())
    cut = min((i for i in (text.find("END"), text.find("DD")) if i >= 0), default=len(text))
    assert streamed == text[:cut]


def _request(**params):
    from inference.engine.request import Request

    return Request("r", [1], SamplingParams(**params))


def test_greedy_picks_the_best_logit_and_min_tokens_masks_eos():
    import torch

    logits = torch.tensor([[0.0, 1.0, 5.0]])
    assert sample(logits, [_request(max_tokens=4)], frozenset({2})) == [2]
    assert sample(logits, [_request(max_tokens=4, min_tokens=1)], frozenset({2})) == [1]


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch():
    import torch

    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    alone = _request(max_tokens=8, temperature=0.9, top_p=0.9, top_k=20, seed=11)
    batched = _request(max_tokens=8, temperature=0.9, top_p=0.9, top_k=20, seed=11)
    neighbours = [_request(max_tokens=8, temperature=1.0, seed=i) for i in range(5)]
    out_alone = [sample(logits[:1], [alone], frozenset())[0] for _ in range(8)]
    out_batched = [sample(logits, [batched, *neighbours], frozenset())[0] for _ in range(8)]
    assert out_alone == out_batched
    assert len(set(out_alone)) > 1


def test_top_k_one_and_tiny_top_p_are_greedy():
    import torch

    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    assert {sample(logits, [_request(temperature=1.5, top_k=1, seed=s)], frozenset())[0]
            for s in range(20)} == {1}
    assert {sample(logits, [_request(temperature=1.5, top_p=0.01, seed=s)], frozenset())[0]
            for s in range(20)} == {1}


class PieceTokenizer:
    """Tokens of several characters each (id = index in ``PIECES``), as BPE vocabularies have."""

    PIECES = ["he", "llo", " wor", "ld", " ", "E", "ND", "x", "END", "o w", "é", "🙂"]

    def decode(self, token_ids):
        return "".join(self.PIECES[t] for t in token_ids)


def run_with_items(pieces: list[int], stop: tuple[str, ...]) -> tuple[str, list[str]]:
    """(the returned text, the texts of the items released) for tokens ``pieces``, each token
    holding its own text as its item, as a token's logprob entry waits."""
    detok = IncrementalDetokenizer(PieceTokenizer(), stop)
    streamed, released = [], []
    for t in pieces:
        start = len(detok.text)
        streamed.append(detok.add_token(t))
        detok.hold(PieceTokenizer.PIECES[t], start)
        released += [cut if cut is not None else item for item, cut in detok.release()]
        if detok.stopped:
            break
    streamed.append(detok.flush())
    released += [cut if cut is not None else item for item, cut in detok.release(final=True)]
    return "".join(streamed), released


def test_a_token_a_stop_string_starts_inside_keeps_its_item_cut_and_later_ones_none():
    # "llo" straddles the stop string "lo w": its text is cut to "l"; " wor", "ld" are past it.
    text, items = run_with_items([0, 1, 2, 3], stop=("lo w",))
    assert text == "hel" and items == ["he", "l"]
    # A stop string starting exactly at a token's start: that token and the rest have none.
    text, items = run_with_items([0, 1, 4, 8, 2], stop=("END",))
    assert text == "hello " and items == ["he", "llo", " "]


@given(st.lists(st.integers(0, len(PieceTokenizer.PIECES) - 1), max_size=12),
       st.lists(st.sampled_from(["lo", "o w", "END", "E", "ld", "x", "é", "🙂w", "ENDx"]),
                max_size=2))
def test_the_items_released_cover_exactly_the_returned_text(pieces, stop):
    text, items = run_with_items(pieces, tuple(stop))
    assert "".join(items) == text
