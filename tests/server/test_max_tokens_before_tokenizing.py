"""A ``max_tokens`` of ``max_model_len`` or more, refused before the prompt is tokenized: its 400 said "the prompt
leaves room for at most max_model_len - 1 = 511 tokens", and a caller who sent 511 got a second 400 naming the
prompt's own room (481 for a short chat). It now says what 511 is (a one-token prompt's room) and what to send."""

from __future__ import annotations

from asyncinfer import SamplingParams
from asyncinfer.prompts import check_prompt_len, check_room_for_max_tokens
from asyncinfer.server.errors import from_exception


def answer(check) -> tuple[int, str, str | None, str | None]:
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - the check's own refusal, answered as the routes answer it
        error = from_exception(exc, "req-1", rename=lambda p: p)
        return error.status, error.message, error.param, error.code
    raise AssertionError("not refused")


def test_a_max_tokens_no_prompt_leaves_room_for_names_the_context_not_the_prompts_room() -> None:
    status, message, param, code = answer(lambda: check_room_for_max_tokens(512, SamplingParams(max_tokens=600)))
    assert (status, param, code) == (400, "max_tokens", "context_length_exceeded")
    assert message == ("`max_tokens` is 600, but the context is 512 tokens (max_model_len), prompt and output together: "
                       "a prompt of one token leaves room for 511 at most, a longer one less. Lower `max_tokens` to at "
                       "most 512 less the prompt's tokens, shorten the prompt, or leave `max_tokens` out (the output "
                       "then stops where the context ends).")


def test_a_max_tokens_past_a_tokenized_prompts_room_still_names_that_room() -> None:
    status, message, _, _ = answer(lambda: check_prompt_len(list(range(31)), 512, SamplingParams(max_tokens=511)))
    assert status == 400
    assert message == ("`max_tokens` is 511, but the prompt leaves room for at most max_model_len - prompt tokens = "
                       "512 - 31 = 481 tokens. Lower `max_tokens`, shorten the prompt, or leave `max_tokens` out (the "
                       "output then stops where the context ends).")
