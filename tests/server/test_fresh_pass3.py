"""A third fresh adversarial pass (issue 25): what one caller's request can do to another's, in-process and
over HTTP. Each case here was a fault on main before it was fixed."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.structured import StructuredOutput

from .conftest import TINY_OPTIONS

VICTIM_CHOICE = StructuredOutput.choice(["yes-victim", "no-victim"])
VICTIM_REGEX = StructuredOutput.regex("(yes|no)-victim")


class PosingSpec(StructuredOutput, frozen=True, kw_only=True):
    """A spec that hashes and compares as the victim's, whatever it holds."""

    def __hash__(self) -> int:
        return hash(VICTIM_CHOICE)

    def __eq__(self, other: object) -> bool:
        return True


class PosingText(str):
    """A str that hashes and compares as the victim's pattern, whatever it holds."""

    def __hash__(self) -> int:
        return hash(VICTIM_REGEX.value)

    def __eq__(self, other: object) -> bool:
        return True


def test_a_spec_is_kept_as_the_plain_spec_it_holds() -> None:
    params = SamplingParams(structured=PosingSpec(kind="regex", value="a+"))
    assert type(params.structured) is StructuredOutput and params.structured == StructuredOutput.regex("a+")
    assert params.structured != VICTIM_CHOICE
    spec = StructuredOutput.regex(PosingText("a+"))
    assert type(spec.value) is str and spec != VICTIM_REGEX and hash(spec) != hash(VICTIM_REGEX)
    choices = StructuredOutput.choice([PosingText("a"), "b"])
    assert [type(c) for c in choices.value] == [str, str] and type(choices.value) is tuple


@pytest.mark.parametrize(("hostile", "victim"), [
    (lambda: PosingSpec(kind="regex", value="a+"), VICTIM_CHOICE),
    (lambda: StructuredOutput.regex(PosingText("a+")), VICTIM_REGEX),
])
async def test_a_spec_posing_as_anothers_never_lends_it_its_grammar(tiny_chat_model, hostile, victim) -> None:
    """The compiled-grammar cache is keyed by the spec: a StructuredOutput subclass (or a spec holding a str
    subclass) whose ``__hash__`` and ``__eq__`` posed as another caller's spec put its own grammar in that spec's
    entry, and the other caller's request (same namespace: no cache salt, as in-process callers are) followed
    it: asked for "yes-victim" or "no-victim", it wrote "aaaaaaaa". A spec is now the plain spec it holds."""
    pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")
    async with AsyncEngine.from_pretrained(str(tiny_chat_model), **TINY_OPTIONS) as engine:
        own = await engine.generate("hello", SamplingParams(max_tokens=5, structured=hostile()))
        assert own.outputs[0].text == "aaaaa"
        answer = await engine.generate("hello", SamplingParams(max_tokens=16, structured=victim))
        assert answer.outputs[0].text in ("yes-victim", "no-victim"), answer.outputs[0].text
