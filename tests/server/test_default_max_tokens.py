"""A body without a token limit: ``/v1/completions`` stops at 16 tokens (OpenAI's and vLLM's default),
``/v1/chat/completions`` runs to the context length (OpenAI's chat), both cut where the context ends."""

from __future__ import annotations

from asyncinfer.server.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS

from .conftest import TINY_OPTIONS


def test_completions_without_max_tokens_generate_16_tokens(client) -> None:
    assert COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    out = client.completions.create(model="tiny", prompt="Hello world", extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_completions_default_stops_where_the_context_ends(client) -> None:
    room = 5
    prompt = [7] * (TINY_OPTIONS["max_model_len"] - room)
    out = client.completions.create(model="ids", prompt=prompt, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == room and out.choices[0].finish_reason == "length"


def test_chat_without_a_limit_runs_to_the_context_length(client) -> None:
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello world"}],
                                         extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens + out.usage.completion_tokens == TINY_OPTIONS["max_model_len"]
    assert out.choices[0].finish_reason == "length"
