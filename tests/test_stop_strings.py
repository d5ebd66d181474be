"""Stop strings as an automaton (issue 25): the same results as the definition, at a cost per
token that does not grow with the stop list, and a stop list bounded by documented limits."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncinfer.detokenizer import IncrementalDetokenizer, StopMatcher
from asyncinfer.errors import InvalidParameterError
from asyncinfer.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams

ALPHABET = "ab世"


class CharTokenizer:
    """Token ``i`` is the character ``alphabet[i]``: text and tokens correspond one to one."""

    def __init__(self, alphabet: str = ALPHABET) -> None:
        self.alphabet = alphabet

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.alphabet[i] for i in ids)


def first_stop(text: str, stops: list[str], min_tokens: int) -> tuple[int, str] | None:
    """The definition: the stop string completed first (from character ``min_tokens`` on,
    one character a token); at one end, the longest (the one starting first)."""
    for end in range(max(min_tokens, 1), len(text) + 1):
        ending = [s for s in stops if text.endswith(s, 0, end)]
        if ending:
            return end, max(ending, key=len)
    return None


def held(text: str, stops: list[str], hold: int) -> int:
    """The definition of the held-back text: the longest suffix of at most ``hold`` characters
    that is the beginning of a stop string."""
    return max((k for k in range(1, min(hold, len(text)) + 1) if any(s.startswith(text[-k:]) for s in stops)),
               default=0)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 2), max_size=40),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), min_size=1, max_size=8),
       min_tokens=st.integers(0, 6), include=st.booleans())
def test_the_automaton_stops_and_holds_back_as_defined(ids, stops, min_tokens, include) -> None:
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=64, min_tokens=min_tokens)
    det = IncrementalDetokenizer(CharTokenizer(), [], params)
    text = CharTokenizer().decode(ids)
    hit = first_stop(text, stops, min_tokens)
    hold = 0 if include else max(map(len, stops)) - 1
    shown = ""
    for k, token in enumerate(ids, 1):
        chunk, stopped = det.add(token)
        shown += chunk
        if hit is not None and k == hit[0]:
            assert stopped and det.stop_reason == hit[1]
            cut = k if include else k - len(hit[1])
            assert shown + det.flush() == text[:cut] == det.text
            return
        assert not stopped
        assert shown == text[: k - held(text[:k], stops, hold)]  # all but a possible stop string's start
    assert hit is None
    assert shown + det.flush() == text == det.text and det.stop_reason is None


def test_samples_share_one_matcher_and_keep_their_own_state() -> None:
    params = SamplingParams(stop=["ab"], max_tokens=8)
    first = IncrementalDetokenizer(CharTokenizer(), [], params)
    second = IncrementalDetokenizer(CharTokenizer(), [], params, stops=first.stops)
    assert second.stops is first.stops
    assert first.add(0) == ("", False)  # "a": held
    assert second.add(1) == ("b", False)
    assert first.add(1) == ("", True) and first.stop_reason == "ab"
    assert second.add(0) == ("", False) and second.add(1) == ("", True)


def never_matching_stops(count: int, length: int) -> list[str]:
    """``count`` distinct stop strings that all start like the text (so each is a live candidate)
    and never complete in it: the worst case for a check that looks at every string."""
    return [("ab" * length)[: length - 4] + f"{i:04X}" for i in range(count)]


def per_token_seconds(stops: list[str], ids: list[int], rounds: int = 7) -> float:
    """The best of ``rounds`` runs of adding ``ids`` (the automaton built outside the timing)."""
    params = SamplingParams(stop=stops, max_tokens=len(ids))
    matcher = StopMatcher(params.stop_strings)
    best = float("inf")
    for _ in range(rounds):
        det = IncrementalDetokenizer(CharTokenizer(), [], params, stops=matcher)
        start = time.perf_counter()
        for token in ids:
            det.add(token)
        best = min(best, time.perf_counter() - start)
    return best / len(ids)


def test_a_long_stop_list_costs_a_token_what_a_short_one_does() -> None:
    """Measured, with a generous bound for a busy machine: the check per token of a list at the
    limits costs at most 3x that of one string (before: in proportion to the list, ~1000x here)."""
    ids = [0, 1] * 150  # "abab...": every stop string's start, again and again
    one = never_matching_stops(1, 16)
    many = never_matching_stops(MAX_STOP_STRINGS, MAX_STOP_CHARS // MAX_STOP_STRINGS)
    assert sum(map(len, many)) <= MAX_STOP_CHARS
    SamplingParams(stop=many)  # within the limits
    ratios = []
    for _ in range(3):  # interleaved, so that a slow moment of the machine hits both
        ratios.append(per_token_seconds(many, ids) / per_token_seconds(one, ids))
    assert min(ratios) < 3.0, ratios


def test_the_stop_list_limits_are_typed_errors_checked_before_the_list_is_read() -> None:
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(stop="x" * MAX_STOP_CHARS)
    SamplingParams(stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)

    class Unreadable(list):
        def __iter__(self):
            raise AssertionError("the list was read")

    too_many = Unreadable([None] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(stop=too_many)
    assert err.value.parameter == "stop" and f"at most {MAX_STOP_STRINGS}" in err.value.allowed
    assert str(MAX_STOP_STRINGS + 1) in str(err.value.value)
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(stop=["ab" * 300] * 30)
    assert err.value.parameter == "stop" and f"{MAX_STOP_CHARS} characters" in err.value.allowed
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(stop="x" * (MAX_STOP_CHARS + 1))
    assert err.value.parameter == "stop"
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(stop_token_ids=Unreadable([0] * (MAX_STOP_TOKEN_IDS + 1)))
    assert err.value.parameter == "stop_token_ids" and f"at most {MAX_STOP_TOKEN_IDS}" in err.value.allowed
