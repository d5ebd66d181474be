"""The engine's model-free rules of a prompt (``prompts.prompt_kind``, ``check_text_prompt``, ``check_messages``),
which ``generate --file`` checks each line by before the load (tests/cli/test_stranger61.py: a chat role no model
takes was let through by the command's own copy of the rules)."""

from __future__ import annotations

import pytest

from asyncinfer.errors import InvalidParameterError
from asyncinfer.prompts import check_messages, prompt_kind


@pytest.mark.parametrize(("prompt", "kind"), [
    ("", "text"), ("hi", "text"), ([1, 2], "ids"), ((3,), "ids"), ([{"role": "user", "content": "x"}], "chat"),
    ([], None), ([1, True], None), ([1, "a"], None), (b"hi", None), (range(3), None), (5, None), (None, None),
])
def test_prompt_kind_reads_the_shape_alone(prompt, kind) -> None:
    assert prompt_kind(prompt) == kind


def test_the_messages_rules_name_the_message_and_its_field() -> None:
    with pytest.raises(InvalidParameterError) as caught:
        check_messages([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    assert (caught.value.parameter, caught.value.value) == ("prompt[1].role", "robot")
