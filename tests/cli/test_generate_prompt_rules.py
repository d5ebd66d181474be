"""``generate --file`` checks each line's prompt by the engine's own model-free rules (``prompts.prompt_kind``,
``check_text_prompt``, ``check_messages``), not a copy of them: a chat message whose role no model takes
(``"bot"``) was accepted by the copy, ran after the load and came back as that request's error (exit 1), where the
help says every line is checked before anything runs."""

from __future__ import annotations

import pytest

from asyncinfer import cli
from asyncinfer.errors import InvalidParameterError
from asyncinfer.prompts import CHAT_ROLES, check_messages, prompt_kind


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    return captured.err.removeprefix("asyncinfer: error: ").rstrip("\n")


ROLES = ", ".join(map(repr, CHAT_ROLES))


@pytest.mark.parametrize(("line", "said"), [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}',
     f'messages[1].role="bot" is invalid: allowed one of {ROLES}'),
    ('{"prompt": [{"role": "user", "content": "hi"}, {"role": "user"}]}',
     "prompt[1]={\"role\": \"user\"} is invalid: allowed a dict with string 'role' and 'content'"),
])
def test_a_line_whose_chat_no_model_takes_fails_the_job_before_the_load(line, said, tmp_path, no_load,
                                                                        capsys) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "fine"}\n' + line + "\n", encoding="utf-8")
    assert cli.main(["generate", "--file", str(lines), "--no-progress"]) == 2
    assert error_line(capsys) == f"{lines} line 2: {said}"


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
