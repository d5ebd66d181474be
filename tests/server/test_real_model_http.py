"""The real default model (SmolLM2-135M-Instruct) over HTTP: its chat template, its stop token, its text."""

from __future__ import annotations

import openai
import pytest

from asyncinfer import SamplingParams
from asyncinfer.server import ModelSpec, create_app

from .conftest import LiveServer

pytestmark = pytest.mark.real_model
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def smol(real_gguf):
    app = create_app(ModelSpec(str(real_gguf), "smol", {"max_model_len": 512, "kv_cache_memory": 32 * 1024 * 1024}))
    with LiveServer(app) as live:
        yield live


def test_greedy_chat_and_completion_equal_engine_generate(smol) -> None:
    engine = smol.engine
    chat_want = smol.call(engine.generate(MESSAGES, SamplingParams(max_tokens=16)))
    assert chat_want.finish_reason == "stop"  # it ends on its own <|im_end|>, left out of the text
    text_want = smol.call(engine.generate("The capital of France is", SamplingParams(max_tokens=6)))
    with openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0) as client:
        chat = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=16, temperature=0)
        assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (chat_want.text, "stop")
        assert "Paris" in chat.choices[0].message.content
        chunks = list(client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=16, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == chat_want.text
        assert chunks[-1].usage.prompt_tokens == len(chat_want.prompt_token_ids) == chat.usage.prompt_tokens
        assert chunks[-1].usage.completion_tokens == len(chat_want.token_ids)
        text = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=6,
                                         temperature=0)
        assert text.choices[0].text == text_want.text
