"""trim_messages: the longest run of whole recent turns within the budget, system messages kept."""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError, trim_messages


def words(messages: list[dict[str, str]]) -> int:
    """A stand-in token count: one token a word, plus two per message (its role markers)."""
    return sum(len(m["content"].split()) + 2 for m in messages)


def msg(role: str, n: int, tag: str = "") -> dict[str, str]:
    return {"role": role, "content": " ".join([tag or role] * n)}


SYSTEM = msg("system", 3)
TURNS = [msg("user", 4, "u1"), msg("assistant", 6, "a1"), msg("user", 4, "u2"), msg("assistant", 6, "a2"),
         msg("user", 5, "u3")]


@pytest.mark.parametrize("budget, kept", [
    (100, TURNS),  # everything fits
    (5 + 6 + 8 + 6, TURNS[4:]),  # system 5 + u2 6 + a2 8 + u3 7 = 26 > 25: only the last turn
    (5 + 6 + 8 + 7, TURNS[2:]),  # exactly u2, a2, u3
    (5 + 7, TURNS[4:]),  # only the last turn
])
def test_keeps_the_longest_run_of_whole_turns(budget, kept) -> None:
    history = [SYSTEM, *TURNS]
    trimmed = trim_messages(history, budget, words)
    assert trimmed == [SYSTEM, *kept] and words(trimmed) <= budget
    assert history == [SYSTEM, *TURNS]  # not changed in place


def test_calls_the_counter_a_logarithmic_number_of_times() -> None:
    history = [SYSTEM] + [m for i in range(64) for m in (msg("user", 3), msg("assistant", 3))]
    calls = []
    trim_messages(history, 40, lambda ms: calls.append(ms) or words(ms))
    assert len(calls) <= 8


def test_replies_before_the_first_user_message_are_a_turn_of_their_own() -> None:
    history = [msg("assistant", 2, "greeting"), *TURNS]
    assert trim_messages(history, 1000, words) == history
    assert trim_messages(history, words(TURNS), words) == TURNS


def test_a_system_message_after_the_first_turn_goes_with_its_turn() -> None:
    """Only the leading system messages are always kept (docs/api.md): a later one is part of the turn it follows."""
    late = msg("system", 3, "late")
    history = [SYSTEM, TURNS[0], TURNS[1], late, TURNS[2], TURNS[3], TURNS[4]]
    assert trim_messages(history, words([SYSTEM, *TURNS[2:]]), words) == [SYSTEM, *TURNS[2:]]
    assert trim_messages(history, words(history), words) == history


def test_refusals_name_the_parameter() -> None:
    with pytest.raises(InvalidParameterError) as err:
        trim_messages([SYSTEM, *TURNS], 11, words)  # system 5 + last turn 7 = 12
    assert err.value.parameter == "messages" and "they take 12" in err.value.allowed
    for bad in (0, -1, True, 2.5):
        with pytest.raises(InvalidParameterError) as err:
            trim_messages(TURNS, bad, words)
        assert err.value.parameter == "budget"
    with pytest.raises(InvalidParameterError, match="at least one message"):
        trim_messages([], 10, words)


@pytest.mark.parametrize("bad", ["hello", ["hi"], [{"role": "user", "content": "x"}, "hi"], b"hi", None, 3,
                                 {"role": "user", "content": "x"}])
def test_refuses_what_is_not_a_list_of_message_dicts(bad) -> None:
    with pytest.raises(InvalidParameterError) as err:
        trim_messages(bad, 10, words)
    assert (err.value.parameter, err.value.value) == ("messages", bad)
    assert err.value.allowed == "a list of {'role': ..., 'content': ...} dicts"
