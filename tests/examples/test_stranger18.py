"""A newcomer's first hour (stranger 18): examples/discord_bot.py's ChatBot refuses a reply length that leaves no
room for the history, instead of answering every message "That message is too long for me, sorry."."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from asyncinfer import InvalidParameterError, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "discord_bot.py"


def load_example():
    spec = importlib.util.spec_from_file_location("discord_bot_stranger18", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("max_tokens", [256, 300])
def test_a_reply_as_long_as_the_context_is_refused_at_construction(max_tokens) -> None:
    bot = load_example()
    engine = types.SimpleNamespace(max_model_len=256)  # all ChatBot's constructor reads of the engine
    with pytest.raises(InvalidParameterError) as caught:
        bot.ChatBot(engine, params=SamplingParams(max_tokens=max_tokens))
    assert str(caught.value) == (f"params.max_tokens={max_tokens} is invalid: allowed less than the engine's "
                                 "max_model_len (256), to leave room for the history")


def test_a_reply_that_leaves_room_is_taken() -> None:
    bot = load_example()
    chat = bot.ChatBot(types.SimpleNamespace(max_model_len=256), params=SamplingParams(max_tokens=255))
    assert chat.history_budget == 1
    chat = bot.ChatBot(types.SimpleNamespace(max_model_len=256), params=SamplingParams(max_tokens=300),
                       history_budget=100)  # an explicit budget is the caller's
    assert chat.history_budget == 100
